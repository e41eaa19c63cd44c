"""Gaussian noise by a ziggurat vectorised over whole arrays of raw generator bits.

NumPy's float32 `standard_normal` runs Marsaglia and Tsang's ziggurat one element at
a time through the bit generator's function pointer; this module runs the same
algorithm (256 layers, r and v of NumPy's `random_standard_normal_f`) over arrays:

- Tables (float64, at import): x_0 = v/f(r) is the virtual width of the base strip,
  x_1 = r, x_{k+1} = f^-1(f(x_k) + v/x_k), x_256 = 0, with f(x) = exp(-x^2/2). Layer k
  is the box [0, x_k] x [f(x_k), f(x_{k+1})] (for k = 0: [0, r] x [0, f(r)] plus the
  tail beyond r); every layer has area v.
- One uint32 per candidate: bits 0-7 the layer k, bit 8 the sign, bits 9-31 rabs, the
  position U = rabs / 2^23 across the layer. Fast path: accept x = U x_k when
  0 < rabs < K[k] = floor(x_{k+1}/x_k 2^23), a point that lies under the curve however
  the ratio rounds. rabs == 0 is rejected so that no draw is ever exactly 0.0 (the
  engine counts on it: a zero noise value would be a kept raw value that no retain
  probability accounts for).
- Slow path, on the ~1.5% of candidates the fast path rejects, with float64 uniforms
  from `gen.random`: a wedge point (k >= 1) is accepted when
  f(x_k) + U2 (f(x_{k+1}) - f(x_k)) < f(x); a base-strip point beyond r becomes r + a,
  a drawn from the tail by Marsaglia's method (repeated until it accepts, as in the
  sequential ziggurat: restarting the ziggurat instead would thin the tail by the
  method's 6% rejection rate); rejected wedge points and rabs == 0 are replaced by fresh
  draws of the whole procedure, the sequential ziggurat's restart. Each element is
  therefore an independent draw from the ziggurat's distribution.

The scale is folded into the float32 table of widths (x_k / 2^23 * scale, one
rounding) and the sign into its index (a second half of negated widths), so the fast
path is two table lookups, a multiply and a compare.

Draw order, for `size` elements: random_raw(ceil(size / 2)) 64-bit words (their
uint32 halves, low half first, are the candidates; an odd size leaves the last high
half unused), then the tail's uniforms (two per attempt, in batches), then one
uniform per wedge point (gen.random: one 64-bit word each), then the
fresh draws of the same procedure for what is still missing, recursively. random_raw
reads the bit generator's stream directly: it does not see a uint32 the generator
may hold back from an earlier next_uint32 call (NumPy's float32 samplers leave one).
"""

from __future__ import annotations

import functools
import operator

import numpy as np

R = 3.6541528853610088  # x_1: where the tail begins
V = 0.00492867323399  # area of every layer
LAYERS = 256
_UNIT = 2.0**23  # rabs has 23 bits
# The fast path works through the candidates in pieces of this many elements (a whole
# stream unit of the engine): fewer, longer array operations let worker threads run in
# parallel (with pieces of 2^15, small enough for a core's L2 cache, one thread was 30%
# faster but two threads no faster than one, queueing for the GIL between short
# operations), and the temporaries stay bounded for records of any size. The output does
# not depend on it.
CHUNK = 1 << 18


def _f(x):
    return np.exp(-0.5 * np.square(x))


def _widths() -> np.ndarray:
    x = np.empty(LAYERS + 1)
    x[0], x[1] = V / _f(R), R
    for k in range(1, LAYERS - 1):
        x[k + 1] = np.sqrt(-2.0 * np.log(_f(x[k]) + V / x[k]))
    x[LAYERS] = 0.0
    return x


X = _widths()  # x_0 .. x_256
F = _f(X)  # f(x_k); F[0] is not used
K = np.floor(X[1:] / X[:-1] * _UNIT).astype(np.uint32)  # fast-path bound per layer
# K - 1 for the one-pass test (rabs - 1) < (K - 1) in uint32, where rabs == 0 wraps
# round and fails; K == 0 (the top layer) must fail for every rabs, so it stays 0.
_K1 = np.tile(np.maximum(K, 1) - 1, 2)
# Slow-path tables in float64, indexed like the fast path's by layer + 256 * sign:
# x = rabs * _XS (signed), wedge test f(x_k) + U2 (f(x_{k+1}) - f(x_k)) < f(x).
_XS = np.concatenate([X[:LAYERS], -X[:LAYERS]]) / _UNIT
_FS = np.tile(F[:LAYERS], 2)
_DFS = np.tile(np.diff(F), 2)
_SMALLEST = X[LAYERS - 1] / _UNIT  # the smallest |x| either path can return, over scale
_FLOAT32_MAX = float(np.finfo(np.float32).max)


def standard_normal(gen: np.random.Generator, size: int, scale: float = 1.0) -> np.ndarray:
    """float32 array of `size` draws of N(0, scale^2), never exactly 0.0, drawn from gen's
    bit generator in a fixed order (same generator state -> same output, bit for bit)."""
    size = operator.index(size)
    if size < 0:
        raise ValueError(f"size must be >= 0, got {size}")
    scale = float(scale)
    if not (np.float32(_SMALLEST * scale) > 0 and 16.0 * scale <= _FLOAT32_MAX):
        # 16 bounds |z|: the tail's offset is at most -log(2^-53)/r < 11
        raise ValueError(f"scale must be positive and within float32's range, got {scale!r}")
    return _draw(gen, size, scale, _widths32(scale))


@functools.lru_cache(maxsize=16)
def _widths32(scale: float) -> np.ndarray:
    """The fast path's float32 x_k / 2^23 * scale, indexed by layer + 256 * sign."""
    width = (X[:LAYERS] / _UNIT * scale).astype(np.float32)
    width = np.concatenate([width, -width])
    width.flags.writeable = False
    return width


def _draw(gen: np.random.Generator, size: int, scale: float, width: np.ndarray) -> np.ndarray:
    words = gen.bit_generator.random_raw((size + 1) // 2).view(np.uint32)[:size]
    slow = _fast_path(words, width)
    out = words.view(np.float32)  # the fast path wrote over the words it accepted
    if slow.size:
        left = words[slow]
        out[slow] = _slow(gen, (left & 0x1FF).astype(np.intp), left >> 9, scale, width)
    return out


def _fast_path(words: np.ndarray, width: np.ndarray) -> np.ndarray:
    """Writes rabs * width (float32) over each word the fast path accepts and leaves the
    others as they are; returns the positions of those others."""
    out = words.view(np.float32)
    size = words.size
    step = min(size, CHUNK)
    index = np.empty(step, np.intp)
    rabs, below, bounds = (np.empty(step, np.uint32) for _ in range(3))
    w = np.empty(step, np.float32)
    rejected = np.empty(step, bool)
    slow = []
    for start in range(0, size, CHUNK):
        n = min(CHUNK, size - start)
        chunk = words[start:start + n]
        i, ra, bl, bd, wd, rj = index[:n], rabs[:n], below[:n], bounds[:n], w[:n], rejected[:n]
        np.bitwise_and(chunk, 0x1FF, out=i, casting="unsafe")
        np.right_shift(chunk, 9, out=ra)
        # mode="wrap" skips take's bounds check (the indices are < 512 by construction)
        np.take(width, i, out=wd, mode="wrap")
        np.take(_K1, i, out=bd, mode="wrap")
        np.subtract(ra, 1, out=bl)
        np.greater_equal(bl, bd, out=rj)
        at = np.flatnonzero(rj)
        left = chunk[at]
        np.multiply(ra, wd, out=out[start:start + n], dtype=np.float32, casting="unsafe")
        chunk[at] = left
        slow.append(at + start)
    return np.concatenate(slow) if slow else np.empty(0, np.intp)


def _slow(gen: np.random.Generator, index: np.ndarray, rabs: np.ndarray, scale: float,
          width: np.ndarray) -> np.ndarray:
    """Values for the candidates the fast path rejected (index = layer + 256 * sign)."""
    z = np.zeros(index.size)  # 0 marks a candidate to be replaced by a fresh draw
    layer = index & 0xFF
    base = np.flatnonzero(layer == 0)
    tail = base[rabs[base] != 0]
    z[tail] = np.copysign(R + _tail(gen, tail.size), _XS[index[tail]])
    wedge = np.flatnonzero(layer)  # rabs == 0 gives x = 0 here, which stays a 0
    i = index[wedge]
    x = rabs[wedge] * _XS[i]
    z[wedge] = np.where(_FS[i] + gen.random(wedge.size) * _DFS[i] < _f(x), x, 0.0)
    values = (z * scale).astype(np.float32)
    missing = np.flatnonzero(z == 0)
    if missing.size:
        values[missing] = _draw(gen, missing.size, scale, width)
    return values


def _tail(gen: np.random.Generator, size: int) -> np.ndarray:
    """`size` draws of z - r for z from the standard normal's tail z > r (Marsaglia 1964:
    a = -log(U1)/r, accepted when -2 log(U2) > a^2; 1 - U keeps log away from 0).

    Attempts are drawn in batches about 1/8 larger than what is still needed (about 6%
    are rejected), and the first `size` accepted ones are kept: accepted attempts are
    independent draws from the tail, so this is exact and rarely needs a second batch.
    """
    accepted = []
    need = size
    while need > 0:
        tries = need + need // 8 + 4
        u = gen.random(2 * tries)
        a = -np.log1p(-u[:tries]) / R
        a = a[-2.0 * np.log1p(-u[tries:]) > a * a]
        accepted.append(a[:need])
        need -= accepted[-1].size
    return np.concatenate(accepted) if accepted else np.empty(0)
