"""Vectorised TLDP: perturb a block of records.

A pure function of the block, its global position, the calibration and the random
streams. Each stream unit (rng.records_per_unit records; an array smaller than that
is one unit of its own size) draws its noise and its retain decisions from its own
generator in a fixed order, always for the whole unit, so a block that covers part
of a unit gets the same values as a block that covers all of it. A record larger than
a unit (rng.segments: a model's tensor) draws in segments of rng.STREAM_UNIT_ELEMENTS
elements, each from its own generator, so a block may hold part of such a record
(`first_element`) and get the values the whole record gets. Changing what a unit draws, or in which order, changes the output
for a seed: bump rng.STREAM_LAYOUT (so --resume refuses to mix the two).

Retain decisions are exact without a uniform per element when p is small: the
number of candidates in a unit is Binomial(m, p_max), their positions uniform
without replacement, and each candidate is then kept with probability (1 - w)
(thinning), which gives every element probability (1 - w) p_max.
"""

from __future__ import annotations

import ctypes
import math

import numpy as np

from tldp_cli.sampling import discrete, privunit, projection, ziggurat
from tldp_cli.errors import UsageError
from tldp_cli.privacy.privunit import cap_probability
from tldp_cli.privacy.privunit import emphasis as emphasis_of
from tldp_cli.privacy.privunit import write_back_weights as write_back_weights_of
from tldp_cli.privacy.types import DISCRETE_NOISES, Calibration
from tldp_cli.sampling.rng import STREAM_UNIT_ELEMENTS, Streams, records_per_unit, segments

# Output blocks start at a page boundary, so a writer can hand whole pages of them to
# the disk with direct I/O (formats/npy.py) without copying them first.
PAGE = 4096

# At or above this p every element gets its own uniform; below it the
# binomial-and-place method draws far fewer numbers.
DENSE_RETAIN_P = 1e-3


def _keep_freed_memory() -> None:
    """Let glibc's malloc keep freed memory for reuse (heap allocations up to 32 MiB, no
    trimming below 256 MiB of free heap). By default it returns each freed block of more
    than about a megabyte to the system, so every temporary array of the samplers came
    back as fresh pages: a page fault per 4 KiB, which cost more than the arithmetic
    (2.5x on the exact samplers). The process's peak memory is unchanged: what it keeps
    is what it used. Elsewhere than glibc, nothing to do."""
    try:
        # The process's own symbols (libc among them): ctypes.util.find_library would run
        # ldconfig in a child process at every start.
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    m_trim_threshold, m_mmap_threshold = -1, -3  # <malloc.h>
    mallopt(m_mmap_threshold, 32 << 20)
    mallopt(m_trim_threshold, 256 << 20)


_keep_freed_memory()


def page_aligned_empty(shape, dtype) -> np.ndarray:
    """np.empty whose data starts at a page boundary."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    raw = np.empty(nbytes + PAGE, np.uint8)
    start = -raw.ctypes.data % PAGE
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def check_noise_scale(scale: float, dtype: np.dtype | type) -> None:
    """Refuses float noise that `dtype` cannot carry (below its resolution near 0, or near
    its largest value), before any is drawn."""
    info = np.finfo(dtype)
    if not (float(info.tiny) * 2**30 < scale < float(info.max) / 2**10):
        raise UsageError(f"the noise scale {scale:g} is beyond what {np.dtype(dtype)} output can hold; "
                         "rescale the data" + (" or use --dtype float64" if np.dtype(dtype) == np.float32 else ""))


def draw_noise(rng: np.random.Generator, noise: str, scale: float, size: int,
               dtype: np.dtype) -> np.ndarray:
    if noise == "gaussian" and dtype == np.float32:
        return ziggurat.standard_normal(rng, size, scale)  # never 0.0; about twice NumPy's speed
    if noise == "gaussian":
        z = rng.standard_normal(size, dtype=dtype)
    else:
        z = rng.standard_exponential(size, dtype=dtype)
        negative = np.unpackbits(np.frombuffer(rng.bytes((size + 7) // 8), np.uint8), count=size)
        # Negation flips the IEEE sign bit; XOR-ing it in is the same values as
        # np.negative(where=...), several times faster.
        bits = z.view(np.uint32 if dtype.itemsize == 4 else np.uint64)
        np.bitwise_xor(bits, np.left_shift(negative, 8 * dtype.itemsize - 1, dtype=bits.dtype), out=bits)
    z *= dtype.type(scale)
    # NumPy's float32 ziggurats return exactly 0.0 about once in 2^23 draws. Such an element
    # would come out unchanged: a kept raw value that no retain probability accounts for.
    # Redraw them (in place, from the same stream, so the output stays reproducible).
    zeros = np.flatnonzero(z == 0)
    while zeros.size:
        if noise == "gaussian":
            z[zeros] = rng.standard_normal(zeros.size, dtype=dtype) * dtype.type(scale)
        else:
            z[zeros] = np.copysign(rng.standard_exponential(zeros.size, dtype=dtype) * dtype.type(scale),
                                   z[zeros])
        zeros = zeros[z[zeros] == 0]
    return z


def retain_probability(calib: Calibration) -> float:
    """The probability with which the engine keeps a raw value (before any weight): the
    calibration's p, rounded down for the exact samplers so that the realised retain
    probability never exceeds the certified one. 0 when p underflows float64 (log10 p
    below about -324: an MNIST digit at --eps 1): then no raw value is ever kept, and a
    weight mask, which only lowers it, cannot change the output."""
    if calib.noise in DISCRETE_NOISES:
        return math.nextafter(calib.p, 0.0) if calib.p > 0 else 0.0
    return calib.p


def retain_candidates(rng: np.random.Generator, p_max: float, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Positions that may keep their raw value, and a uniform per position for thinning.

    Each position is a candidate with probability p_max; a candidate is kept where its
    uniform is below 1 - w.
    """
    if p_max <= 0.0:
        return np.empty(0, np.int64), np.empty(0)
    if p_max >= DENSE_RETAIN_P:
        u = rng.random(size)
        positions = np.flatnonzero(u < p_max)
        return positions, u[positions] / p_max
    count = int(rng.binomial(size, p_max))
    positions = np.sort(rng.choice(size, count, replace=False)) if count else np.empty(0, np.int64)
    return positions, rng.random(count)


def zero_kept(noise: np.ndarray, positions: np.ndarray, thinning: np.ndarray,
              weights: np.ndarray | None, first_row: int, stop_row: int, block_offset: int) -> None:
    """Zero the noise of the candidate positions (flat, in a unit's (rows, I) noise) that keep
    their raw value: those in rows [first_row, stop_row) whose thinning uniform is below
    1 - w. `block_offset` turns a unit row into a row of the block's (n, I) weights."""
    rows, cols = np.divmod(positions, noise.shape[1])
    inside = (rows >= first_row) & (rows < stop_row)
    rows, cols, thinning = rows[inside], cols[inside], thinning[inside]
    if weights is None:
        kept = np.ones(rows.shape, bool)
    elif weights.ndim == 1:
        kept = thinning < 1.0 - weights[cols]
    else:
        kept = thinning < 1.0 - weights[rows + block_offset, cols]
    noise[rows[kept], cols[kept]] = 0


def _records_and_output(block: np.ndarray, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """The block as (records, elements), and a page-aligned output of that shape in `dtype`."""
    records = block.reshape(block.shape[0], -1) if block.shape[0] else block.reshape(0, math.prod(block.shape[1:]))
    return records, page_aligned_empty(records.shape, dtype)


def _block_weights(weights: np.ndarray | None, row: int, cols: slice) -> np.ndarray | None:
    """The weights of row `row` of the block, columns `cols` (one row of a 2-D mask)."""
    if weights is None:
        return None
    return weights[cols] if weights.ndim == 1 else weights[row:row + 1, cols]


def noise_pieces(first_record: int, n: int, first_element: int, width: int, elements: int,
                 array_records: int | None, array_name: str, streams: Streams, draw,
                 weights: np.ndarray | None):
    """The noise of a block of n records (or of the `width` elements from `first_element` of one
    record), piece by piece: for each stream unit, or segment of a record larger than a unit
    (rng.segments), that the block covers, its noise there with the retained values' noise
    zeroed, and the rows and columns of the block it covers. `draw(rng, size)` draws a
    unit's (or segment's) noise, then its retain candidates: (noise, positions, thinning).
    Each unit and segment draws whole, whatever part of it the block covers."""
    if not segments(elements):
        if width != elements or first_element:
            raise ValueError("a block holds whole records unless they are larger than a stream unit")
        per_unit = records_per_unit(elements, array_records)
        for unit in range(first_record // per_unit, (first_record + n - 1) // per_unit + 1):
            unit_start = unit * per_unit
            noise, positions, thinning = draw(streams.generator(array_name, unit), per_unit * elements)
            noise = noise.reshape(per_unit, elements)
            lo, hi = max(first_record, unit_start), min(first_record + n, unit_start + per_unit)
            if positions.size:  # usually none: p is astronomically small for real tensors
                zero_kept(noise, positions, thinning, weights, lo - unit_start, hi - unit_start,
                          unit_start - first_record)
            yield noise[lo - unit_start:hi - unit_start], slice(lo - first_record, hi - first_record), slice(None)
        return
    if first_element < 0 or first_element + width > elements or (width != elements and n != 1):
        raise ValueError("a part of a record lies inside one record")
    size = STREAM_UNIT_ELEMENTS
    for row in range(n):
        for segment in range(first_element // size, (first_element + width - 1) // size + 1):
            begin, end = segment * size, min(segment * size + size, elements)
            noise, positions, thinning = draw(streams.generator(array_name, first_record + row, segment), end - begin)
            lo, hi = max(begin, first_element), min(end, first_element + width)  # what the block covers
            view = noise[lo - begin:hi - begin].reshape(1, hi - lo)
            inside = (positions >= lo - begin) & (positions < hi - begin)
            cols = slice(lo - first_element, hi - first_element)
            if inside.any():
                zero_kept(view, positions[inside] - (lo - begin), thinning[inside],
                          _block_weights(weights, row, cols), 0, 1, 0)
            yield view, slice(row, row + 1), cols


def perturb_records(block: np.ndarray, first_record: int, array_name: str, calib: Calibration,
                    streams: Streams, weights: np.ndarray | None = None,
                    dtype: np.dtype | type = np.float32, grid: discrete.Grid | None = None,
                    array_records: int | None = None, basis=None, coefficients: bool = False,
                    first_element: int = 0) -> np.ndarray:
    """Perturbed copy of `block` (records along axis 0, starting at global index `first_record`).

    `array_records`: how many records the whole array has (rng.records_per_unit), the
    same for every block of it; None, as many as a stream unit holds. `first_element`: a
    block of one row that is part of a record larger than a stream unit (rng.segments)
    holds its elements from `first_element` on; the values do not depend on how a record
    is cut (weights, then, cover the part's elements).

    `weights`: None, one mask of I values for every record, or an (n, I) array with one
    mask per record of the block; values in [0, 1] (validated by the caller).
    Discrete noises go to perturb_discrete (exact integer samplers; an integer
    dtype gets grid values, a float dtype G times them; `grid`, the run's grid, bounds the
    snapped values). --mechanism privunit goes to perturb_privunit (`basis`: a user's
    basis; None, the DCT basis of the calibration; `coefficients`: the released (n, k)
    coefficients instead of the records, --store coefficients).
    """
    if calib.privunit is not None:
        return perturb_privunit(block, first_record, array_name, calib, streams, basis, dtype, coefficients)
    if coefficients:
        raise ValueError("coefficients are released by --mechanism privunit only")
    if calib.noise in DISCRETE_NOISES:
        return perturb_discrete(block, first_record, array_name, calib, streams, weights, dtype, grid,
                                array_records, first_element)
    dtype = np.dtype(dtype)
    check_noise_scale(calib.scale, dtype)
    records, out = _records_and_output(block, dtype)
    if records.shape[0] == 0:
        return out.reshape(block.shape)
    p_max = retain_probability(calib)

    def draw(rng: np.random.Generator, size: int):
        return (draw_noise(rng, calib.noise, calib.scale, size, dtype), *retain_candidates(rng, p_max, size))

    for noise, rows, cols in noise_pieces(first_record, records.shape[0], first_element, records.shape[1],
                                          calib.elements, array_records, array_name, streams, draw, weights):
        # One pass: cast the raw values to dtype and add the noise (no astype copy first).
        np.add(records[rows, cols], noise, out=out[rows, cols], dtype=dtype)
    return out.reshape(block.shape)


def _to_output(values: np.ndarray, granularity: float | None, dtype: np.dtype,
               out: np.ndarray | None = None) -> np.ndarray:
    """Grid values in `dtype` (integer: saturating; float: G * value, one rounding), into
    `out` when given (one pass, no temporary)."""
    if out is None:
        out = np.empty(values.shape, dtype)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return np.clip(values, info.min, info.max, out=out, casting="unsafe")
    return np.multiply(values, 1.0 if granularity is None else granularity, out=out, casting="unsafe")


def perturb_discrete(block: np.ndarray, first_record: int, array_name: str, calib: Calibration,
                     streams: Streams, weights: np.ndarray | None = None,
                     dtype: np.dtype | type | None = None, grid: discrete.Grid | None = None,
                     array_records: int | None = None, first_element: int = 0) -> np.ndarray:
    """perturb_records for the discrete noises (exact integer samplers): the same stream units (and
    segments), and in each the noise of the whole unit first, then the retain decisions. The output is in `dtype`
    (integer: saturating; float: G * grid value); None gives int64 (grid units). `grid`:
    the run's grid, into which snapped float values are clipped (see discrete.snap)."""
    dtype = np.dtype(np.int64 if dtype is None else dtype)
    granularity = getattr(calib, "granularity", None)
    records, out = _records_and_output(block, dtype)
    if records.shape[0] == 0:
        return out.reshape(block.shape)
    # Integer data adds to the noise as it is (no int64 copy of the block first).
    direct = granularity is None and records.dtype.kind in "iu" and np.can_cast(records.dtype, np.int64)
    noise_sampler = discrete.sampler(calib.noise, calib.scale)
    p_keep = retain_probability(calib)

    def draw(rng: np.random.Generator, size: int):
        noise = noise_sampler.sample(rng, size)
        positions = discrete.retain_mask(rng, p_keep, size)
        return noise, positions, rng.random(positions.size)

    for values, rows, cols in noise_pieces(first_record, records.shape[0], first_element, records.shape[1],
                                           calib.elements, array_records, array_name, streams, draw, weights):
        values += records[rows, cols] if direct else discrete.snap(records[rows, cols], granularity, grid)
        _to_output(values, granularity, dtype, out[rows, cols])
    return out.reshape(block.shape)


# --------------------------------------------------------------------------- PrivUnit
# Each record draws from a stream of its own (PRIVUNIT_STREAMS + the array's name, the
# record's index): a record's draws never depend on another's, nor on the blocking.
PRIVUNIT_STREAMS = "privunit/"


def privunit_basis(calib: Calibration, basis=None):
    """The basis a PrivUnit calibration projects on: `basis` (a user's, which must match
    the calibration's k and sha256), else the DCT basis of its record shape and k."""
    params = calib.privunit_params()
    if basis is None:
        if params.basis != "dct":
            raise ValueError("a privunit calibration with a user's basis needs that basis")
        return projection.dct_basis(params.record_shape, params.k)
    if basis.k != params.k or getattr(basis, "sha256", None) != params.basis_sha256:
        raise ValueError("the basis does not match the privunit calibration")
    return basis


def emphasis_weights(calib: Calibration, basis) -> np.ndarray | None:
    """d, the public pre-emphasis of each coefficient before the normalisation (a DCT basis
    over two or three axes: privacy/privunit.emphasis of its frequencies; otherwise None, none)."""
    params = calib.privunit_params()
    if params.emphasis_exponent is None or getattr(basis, "kind", None) != "dct":
        return None
    return emphasis_of(basis.frequencies(), params.emphasis_exponent)


def record_directions(block: np.ndarray, calib: Calibration, basis, scale: np.ndarray | None = None) -> np.ndarray:
    """u: each record's coefficients in the basis, measured from the public reference
    point, times the public pre-emphasis d (emphasis_weights; `scale` per coefficient in its
    place when given), divided by their norm ((n, k) float64; a record of zero
    coefficients: e_1)."""
    params = calib.privunit_params()
    x = block.reshape(block.shape[0], *params.record_shape).astype(np.float64) - params.reference
    z = basis.project(x)
    if scale is None:
        scale = emphasis_weights(calib, basis)
    return privunit.unit_directions(z if scale is None else z * scale)


def sample_directions(u: np.ndarray, first_record: int, array_name: str, calib: Calibration,
                      streams: Streams) -> np.ndarray:
    """One PrivUnit draw per row of u, record i (global index first_record + i) from its own stream."""
    params = calib.privunit_params()
    q = cap_probability(params.gamma, params.k)  # the batch size only
    released = np.empty_like(u)
    for i in range(u.shape[0]):
        rng = streams.generator(PRIVUNIT_STREAMS + array_name, first_record + i)
        released[i] = privunit.sample(rng, u[i], params.gamma, params.p_numerator, q)
    return released


def write_back_weights(calib: Calibration, basis) -> np.ndarray | None:
    """w, the public weight of each released coefficient in the write-back (a DCT basis:
    privacy/privunit.write_back_weights of its frequencies, E<V, u> and the pre-emphasis; a
    user's basis: None, unweighted)."""
    params = calib.privunit_params()
    if getattr(basis, "kind", None) != "dct" or (params.prior_exponent is None
                                                 and params.emphasis_exponent is None):
        return None
    return write_back_weights_of(basis.frequencies(), params.alignment, params.prior_exponent,
                                 params.emphasis_exponent)


def write_back(released: np.ndarray, calib: Calibration, basis, dtype: np.dtype | type) -> np.ndarray:
    """The records written: reference + c B^T (w * V), clipped to the declared range, in
    `dtype` (a function of V alone, and of public values: post-processing)."""
    params = calib.privunit_params()
    weights = write_back_weights(calib, basis)
    scale = params.output_scale if weights is None else params.output_scale * weights
    values = basis.synthesize(scale * released)
    values += params.reference
    np.clip(values, params.low, params.high, out=values)
    out = page_aligned_empty(values.shape, dtype)
    out[...] = values
    return out


def perturb_privunit(block: np.ndarray, first_record: int, array_name: str, calib: Calibration,
                     streams: Streams, basis=None, dtype: np.dtype | type = np.float32,
                     coefficients: bool = False) -> np.ndarray:
    """--mechanism privunit on a block of whole records: project on the basis, normalise,
    draw V (sampling/privunit.py), write back reference + c B^T (w * V) in the record's shape;
    with `coefficients` (--store coefficients), V itself: (n, k) in `dtype`, each row the
    released unit vector rounded once (a function of V alone: post-processing)."""
    dtype = np.dtype(dtype)
    basis = privunit_basis(calib, basis)
    if block.shape[0] == 0:
        return page_aligned_empty((0, basis.k) if coefficients else block.shape, dtype)
    u = record_directions(block, calib, basis)
    released = sample_directions(u, first_record, array_name, calib, streams)
    if coefficients:
        out = page_aligned_empty(released.shape, dtype)
        out[...] = released
        return out
    return write_back(released, calib, basis, dtype).reshape(block.shape)
