"""CF conventions (netCDF, xarray's Zarr) about a variable's values, shared by the
formats that honour them (hdf5, zarr_store); no I/O here.

Missing data: values equal to a variable's _FillValue or missing_value are missing,
copied rather than perturbed, and the writer puts its markers back. Before the noise a
missing position holds a public value the pipeline chooses (Reader.missing_fill, through
Encoding.fill), never a value of the data: a record-level mechanism (privunit) projects the
whole record, so a value taken from another record (or from anywhere but public options)
would make this record's release depend on it, outside that record's certificate, and on
how the records were cut into blocks. Until told, a read returns the markers decoded, as
stored (what the release ledger fingerprints). A noisy value
may land on a marker too (a fill value of -1 sits on the grid just below a range
starting at 0): every reader would take it for missing data, so the writer moves it
to the nearest value that is not a marker (move_off_markers), a deterministic
post-processing of the output that costs no privacy.

A marker inside the declared range is an ordinary value, though: copying the values
equal to it would release them raw, outside the certified figures. The pipeline
decides (calibration.calibrate_run, from the range alone): such a marker is data unless the user
declares the missingness pattern public (--public-missing), and the reader is told
(Encoding.as_data): its values are perturbed like the others and the writer leaves the
marker off the output (output_values), so that no reader takes a noisy value for a
missing one.
"""

from __future__ import annotations

import dataclasses
import math
import posixpath
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Collection, Container, Iterable, Iterator, Mapping, TypeVar

import numpy as np

from tldp_cli.errors import InputError
from tldp_cli.formats import ArrayJob, Reader, listing

T = TypeVar("T")

MOVE_PASSES = 8  # a moved value lands on another marker at most once per marker


def keep_missing(block: np.ndarray, stored: np.ndarray, pairs: list[tuple],
                 bounds: tuple[float, float, float | None]) -> tuple[int, bool]:
    """Puts each output marker back, in place, where the input (`stored`) holds its
    stored marker (the block holds noise there), then moves the noisy values that equal
    a marker off it (move_off_markers). `pairs`: (stored marker, output marker). Returns
    how many values moved, and whether the block held a missing value."""
    missing = np.zeros(block.shape, dtype=bool)
    for marker, out in pairs:
        where = np.isnan(stored) if np.isnan(marker) else stored == marker
        block[where] = out
        missing |= where
    return move_off_markers(block, missing, [out for _, out in pairs], bounds), bool(missing.any())


def restore_missing(job: ArrayJob, start: int, block: np.ndarray, pairs: list[tuple],
                    bounds: tuple[float, float, float | None] | None) -> tuple[int, bool]:
    """keep_missing on `block`, the noisy records of `job` from `start` (in place), where the
    input's records as stored (its reader's EncodedRecords) hold a marker; `bounds` None:
    no range declared for it."""
    records = job.read
    assert isinstance(records, EncodedRecords)  # the input's: markers come from its encodings
    stored = records.stored(start, start + len(block))
    return keep_missing(block, stored, pairs, bounds or (-math.inf, math.inf, None))


def move_off_markers(block: np.ndarray, missing: np.ndarray | None, markers: list,
                     bounds: tuple[float, float, float | None]) -> int:
    """Moves, in place, every value of `block` outside `missing` that equals one of
    `markers` (output values meaning "missing") one step toward the declared range
    (lo, hi): a grid step where the noise is on a grid (step), else one ulp of the
    block's dtype. Returns how many values moved."""
    targets = [m for m in markers if not np.isnan(m)]  # NaN equals no value
    if not targets:
        return 0
    lo, hi, step = bounds
    moved = 0
    for _ in range(MOVE_PASSES):
        hit = np.isin(block, np.asarray(targets, dtype=block.dtype))
        if missing is not None:
            hit &= ~missing
        count = int(np.count_nonzero(hit))
        if not count:
            break
        moved = moved or count  # later passes move values the first one moved
        values = block[hit]
        up = values.astype(np.float64) < (lo + hi) / 2
        block[hit] = _step(values, up, step)
    return moved


def _step(values: np.ndarray, up: np.ndarray, step: float | None) -> np.ndarray:
    """Each value one step up (where `up`) or down: `step` where it changes the value in
    the values' dtype, else the next representable value."""
    dtype = values.dtype
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        # At the dtype's limit the only way is back (values saturate there).
        up = np.where(values == info.max, False, np.where(values == info.min, True, up))
        return np.where(up, values + dtype.type(1), values - dtype.type(1)).astype(dtype)
    toward = np.where(up, np.inf, -np.inf).astype(dtype)
    nearest = np.nextafter(values, toward)
    if step is None:
        return nearest
    with np.errstate(over="ignore"):
        stepped = np.where(up, values + step, values - step).astype(dtype)
    return np.where(stepped == values, nearest, stepped)


# CF attributes bounding a variable's values: noisy values fall outside them, and readers
# (netCDF4-python) would mask those as invalid. Dropped from perturbed variables.
VALUE_BOUNDS = ("valid_range", "valid_min", "valid_max", "actual_range")
MISSING = ("_FillValue", "missing_value")  # CF: values that mark missing data
PACKING = ("scale_factor", "add_offset", "_Unsigned")
# CF attributes naming the variables that locate or delimit the data (coordinates,
# cell bounds, cell areas): never perturbed unless named with --dataset.
COORDINATE_REFERENCES = ("coordinates", "bounds", "climatology", "cell_measures")
BOUNDS = ("bounds", "climatology")  # of these, the variables delimiting the cells of the one naming them
# CF attributes naming other variables, which the output prunes of the variables it does not
# hold (unnamed_attribute): the coordinate references, a variable's ancillary_variables
# (quality flags, standard errors) and a parametric vertical coordinate's formula_terms.
NAMING = (*COORDINATE_REFERENCES, "ancillary_variables", "formula_terms")


@dataclass(frozen=True)
class Encoding:
    """How the values stored in a variable become the values perturbed (CF conventions):
    which stored values mark missing data, and how packed integers unpack
    (unsigned = _Unsigned, then * scale_factor + add_offset)."""

    markers: tuple  # stored values meaning "missing" (_FillValue, missing_value), NaN included
    unsigned: bool
    scale: np.generic | None
    offset: np.generic | None
    dtype: np.dtype  # of the values perturbed
    sources: tuple = ()  # the attribute each marker comes from (NAN_LABEL: NaN without one)
    # (attribute, stored marker) of the markers taken as data (as_data): no longer in `markers`
    data: tuple = ()
    # The public value missing positions hold in the values perturbed (fill_missing); None: the
    # markers, decoded, as stored
    fill: float | None = None

    @property
    def packed(self) -> bool:
        return self.scale is not None or self.offset is not None

    def labelled(self) -> tuple[tuple[str, float], ...]:
        """(attribute, value in the units perturbed) of each marker: what the pipeline
        compares with the declared range (ArrayJob.markers)."""
        found = []
        for source, marker in zip(self.sources, self.markers):
            value = self.decode(np.asarray([marker]))[0]
            found.append((source, float(value)))
        return tuple(found)

    def as_data(self, data: tuple[tuple[str, float], ...]) -> Encoding:
        """This encoding with the markers `data` names ((attribute, value) pairs of
        `labelled`) taken as data: no longer missing, recorded in `data`."""
        chosen = set(data)
        keep = [i for i, pair in enumerate(self.labelled()) if pair not in chosen]
        return dataclasses.replace(
            self, markers=tuple(self.markers[i] for i in keep), sources=tuple(self.sources[i] for i in keep),
            data=self.data + tuple((self.sources[i], self.markers[i])
                                   for i in range(len(self.markers)) if i not in keep))

    def is_data(self, key: str, value) -> bool:
        """Whether `value` of the attribute `key` (in its own type) is a marker taken as data."""
        return any(source == key and _same(value, marker) for source, marker in self.data)

    def missing(self, raw: np.ndarray) -> np.ndarray | None:
        """Where `raw` (stored values) holds a marker; None if nowhere."""
        mask = None
        for marker in self.markers:
            found = np.isnan(raw) if np.isnan(marker) else raw == marker
            mask = found if mask is None else mask | found
        return mask if mask is not None and mask.any() else None

    def decode(self, raw: np.ndarray) -> np.ndarray:
        values = raw.view(raw.dtype.str.replace("i", "u")) if self.unsigned else raw
        if not self.packed:
            return values
        values = values.astype(self.dtype)
        if self.scale is not None:
            values *= self.scale
        if self.offset is not None:
            values += self.offset
        return values


NAN_LABEL = "NaN"  # the source of NaN as a marker where no attribute declares it (xarray's Zarr)


def _as_stored(value, stored: np.dtype):
    """A marker attribute's value in the stored dtype; None where the dtype cannot hold it
    (missing_value 0.5 or NaN on integers): such a marker occurs nowhere."""
    value = np.asarray(value)
    if stored.kind != "f" and not np.isfinite(value):
        return None  # no integer is NaN
    with np.errstate(invalid="ignore", over="ignore"):
        marker = value.astype(stored)
        if np.array_equal(marker.astype(value.dtype), value, equal_nan=stored.kind == "f"):
            return marker[()]
    return None


def _same(value, marker) -> bool:
    marker = np.asarray(marker)
    stored = _as_stored(value, marker.dtype)
    return stored is not None and bool(np.array_equal(stored, marker, equal_nan=marker.dtype.kind == "f"))


def encoding(where: str, stored: np.dtype, numbers: Callable[[str], np.ndarray | None],
             unsigned_text: str | None, nan_missing: bool = False,
             labels: Mapping[str, str] = MappingProxyType({})) -> Encoding | None:
    """A variable's Encoding from its attributes (`numbers(key)`: a numeric attribute's
    values, flat, None if absent; `unsigned_text`: its _Unsigned); None when its stored
    values are the values. `nan_missing`: NaN marks missing data even without a _FillValue
    (xarray's Zarr stores). `labels`: how to name an attribute's markers where the format
    stores it elsewhere (Zarr 2: _FillValue is the array's fill_value). `where` starts
    error messages."""
    markers, sources = [], []
    for key in MISSING:
        values = numbers(key)
        for value in () if values is None else values:
            marker = _as_stored(value, stored)
            if marker is not None:
                markers.append(marker)
                sources.append(labels.get(key, key))
    if nan_missing and stored.kind == "f" and not any(np.isnan(m) for m in markers):
        markers.append(stored.type(np.nan))
        sources.append(NAN_LABEL)
    unsigned = stored.kind == "i" and (unsigned_text or "").strip().lower() == "true"
    packing = {}
    for key in ("scale_factor", "add_offset"):
        value = numbers(key)
        if value is not None:
            if value.size != 1:
                raise InputError(f"{where}: its {key} attribute holds {value.size} values; packed "
                                 "data has one scale_factor and one add_offset")
            packing[key] = value
    dtype = np.dtype(stored.str.replace("i", "u")) if unsigned else stored
    if packing:
        # CF: the unpacked values have the type of scale_factor and add_offset.
        kinds = [value.dtype for value in packing.values()]
        dtype = (np.result_type(*kinds) if all(k.kind == "f" for k in kinds) else np.dtype("float64")
                 ).newbyteorder("=")
    if not (markers or unsigned or packing):
        return None
    scale, offset = (packing[key].astype(dtype)[0] if key in packing else None
                     for key in ("scale_factor", "add_offset"))
    return Encoding(tuple(markers), unsigned, scale, offset, dtype, tuple(sources))


def _holds(dtype: np.dtype, value: float) -> bool:
    """Whether `dtype` holds `value` exactly."""
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return float(value).is_integer() and info.min <= value <= info.max
    with np.errstate(over="ignore"):
        return float(dtype.type(value)) == value


class EncodedRecords:
    """A reader of one array's records stored under a CF encoding (the HDF5 and Zarr
    readers' Records): called, records start:stop as perturbed (decoded_records); `stored`,
    as stored, which each format reads its own way."""

    encoding: Encoding | None

    def __call__(self, start: int, stop: int) -> np.ndarray:
        raw = self.stored(start, stop)
        if self.encoding is None:
            return raw
        return decoded_records(raw, self.encoding)

    def stored(self, start: int, stop: int) -> np.ndarray:
        raise NotImplementedError


def decoded_records(raw: np.ndarray, encoding: Encoding) -> np.ndarray:
    """Stored records as the values perturbed. Missing positions hold the encoding's public
    `fill` (in float64 where the values' dtype cannot hold it exactly: privunit measures
    records from it in float64), so that they pass the range check and, under privunit, add
    nothing to the record's direction; never another value of the data, which would make a
    record's release depend on another's. The writer puts the markers back, so their noisy
    values are never written. Without a fill, the markers as stored, decoded."""
    values = encoding.decode(raw)
    if encoding.fill is None:
        return values
    missing = encoding.missing(raw)
    if missing is not None:
        if not _holds(values.dtype, encoding.fill):
            values = values.astype(np.float64)
        values[missing] = encoding.fill
    return values


class EncodedReader(Reader):
    """What the readers of the formats that store arrays under CF encodings (HDF5, Zarr)
    share: each perturbed array's ArrayJob (encoded_job), read through an EncodedRecords (a
    frozen dataclass with an `encoding` field), and `encodings` (job name -> its Encoding,
    where it has one), which the format's writer reads. Told which markers are data
    (markers_are_data) or what missing positions hold (missing_fill), it changes both."""

    jobs: list[ArrayJob]

    def __init__(self, path: Path, name: str):
        self.path = path
        self.format = name  # the format's name (its NAME), in each array's source
        self.messages: list[str] = []
        self.encodings: dict[str, Encoding] = {}  # job name -> its encoding, where it has one

    def encoded_job(self, name: str, shape: tuple[int, ...], stored: np.dtype, encoding: Encoding | None,
                    read: EncodedRecords, **fields: Any) -> ArrayJob:
        """The ArrayJob of array `name`, stored as `stored` under `encoding` (None: its stored
        values are the values perturbed), which it records (and what the command says of it);
        `fields`: ArrayJob's others (chunk_records, row_dimension, aliases)."""
        if encoding is not None:
            self.encodings[name] = encoding
            self.messages += messages(name, stored, encoding)
        return ArrayJob(
            name=name, shape=shape, dtype=encoding.dtype if encoding else stored, read=read,
            source={"path": str(self.path), "format": self.format, "dataset": name,
                    "shape": list(shape), "dtype": str(stored)},
            markers=encoding.labelled() if encoding else (), **fields)

    def arrays(self) -> list[ArrayJob]:
        return self.jobs

    def markers_are_data(self, data: dict[str, tuple[tuple[str, float], ...]]) -> None:
        """Each array's encoding (in `encodings`, which its writer reads) and reader take the
        markers `data` names as data."""
        for job in self.jobs:
            if data.get(job.name):
                self._recode(job, self.encodings[job.name].as_data(data[job.name]))
                job.markers = self.encodings[job.name].labelled()

    def missing_fill(self, fills: dict[str, float]) -> None:
        """Each array's missing positions hold its value in `fills`."""
        for job in self.jobs:
            if job.name in fills:
                self._recode(job, dataclasses.replace(self.encodings[job.name], fill=fills[job.name]))

    def _recode(self, job: ArrayJob, encoding: Encoding) -> None:
        """The job's array read, and written, under `encoding` from now on."""
        self.encodings[job.name] = encoding
        read: Any = job.read  # an EncodedRecords, a frozen dataclass
        job.read = dataclasses.replace(read, encoding=encoding)


def output_marker(marker, dtype: np.dtype):
    """A missing-data marker in the output dtype: its own value where the dtype holds it,
    else NaN (floats) or the dtype's least value (integers, which noisy values reach only
    by saturating beyond the noise's tail bound)."""
    value = np.asarray(marker)[()]
    with np.errstate(invalid="ignore", over="ignore"):
        out = dtype.type(value)
    # Compared as Python numbers, which compare exactly: a cast back to the marker's dtype
    # would take a wrapped value (2**32 - 1 as int16: -1) for the marker itself.
    if out.item() == value.item() or (dtype.kind == "f" and np.isnan(value)):
        return out
    return dtype.type(np.nan) if dtype.kind == "f" else dtype.type(np.iinfo(dtype).min)


def output_markers(encoding: Encoding, dtype: np.dtype) -> list[tuple]:
    """(stored marker, output marker) of each of the encoding's missing-data markers: the
    pairs a writer puts the missing values back with (keep_missing)."""
    return [(marker, output_marker(marker, dtype)) for marker in encoding.markers]


def dropped_attributes(present: Container[str], encoding: Encoding | None) -> list[str]:
    """The CF attributes of a perturbed variable (of those `present`) its output leaves off:
    the value bounds, which noisy values pass (readers would mask them), and the packing of
    packed values, which the output holds unpacked."""
    dropped = [key for key in VALUE_BOUNDS if key in present]
    if encoding is not None and (encoding.packed or encoding.unsigned):
        dropped += [key for key in PACKING if key in present]
    return dropped


def json_number(value):
    """A NumPy number for JSON: NaN and infinities as strings ("nan", "inf"); None stays None."""
    if value is None:
        return None
    value = value.item() if isinstance(value, np.generic) else value
    return value if isinstance(value, int) or math.isfinite(value) else str(value)


def referenced(text: str | None) -> list[str]:
    """The variable names in a coordinates, bounds, climatology or cell_measures attribute
    (cell_measures: "area: cell_area" names cell_area)."""
    return [word for word in (text or "").split() if not word.endswith(":")]


def variable(word: str, group: str, found: Mapping[str, T]) -> T | None:
    """The variable a CF attribute names (`found`: by absolute path, "/grp/name"): an
    absolute path, or a name looked up in the referring variable's group, then in each
    enclosing group (CF 1.8 groups)."""
    if word.startswith("/"):
        return found.get(posixpath.normpath(word))
    while True:
        target = found.get(posixpath.normpath(posixpath.join(group, word)))
        if target is not None or group == "/":
            return target
        group = posixpath.dirname(group)


def named(paths: Collection[str], text: Callable[[str, str], str | None], keys: Iterable[str],
          words: Callable[[str | None], list[str]] = referenced,
          groups: Collection[str] = ()) -> Iterator[tuple[str, str, str]]:
    """(path, key, target) for each variable that attribute `key` of a variable or of one of
    `groups` names (`paths`, `groups`: by absolute path, "/grp/name"; `text(path, key)`: an
    attribute's text, None if absent; `words`: the variable names in it), target by its
    absolute path."""
    found = {path: path for path in paths}
    for path in (*paths, *groups):
        where = path if path in groups else posixpath.dirname(path)
        for key in keys:
            for word in words(text(path, key)):
                target = variable(word, where, found)
                if target is not None:
                    yield path, key, target


def record_coordinates(paths: Collection[str], text: Callable[[str, str], str | None],
                       dimensions: Callable[[str], tuple[str, ...]], records: set[str],
                       groups: Collection[str] = ()) -> set[str]:
    """The variables (by absolute path) that hold a value per record, not a grid: those a
    coordinates, bounds, climatology or cell_measures attribute names (CF's auxiliary
    coordinates, such as a trajectory's lat(trajectory, obs), a station's elev(station)) and
    those with a cf_role (the identifier of a feature: a trajectory, a station), that have
    the record dimension of a perturbed variable (`records`) among their `dimensions`
    (absolute names, "/grp/dim"); and the record dimension's own coordinate (subject(subject)
    holding hospital numbers, time(time) of each record) with its bounds (time_bnds(time, nv)):
    one value per record too. Not the own coordinate of another dimension (lat(lat)) unless
    it has a cf_role, nor the bounds of one, which delimit its grid.
    `groups`: groups whose own attributes name variables too (xarray's, for coordinates no
    data variable takes)."""
    own = {path for path in paths if dimensions(path) == (path,)}
    found = {path for path in paths if text(path, "cf_role") is not None and records.intersection(dimensions(path))}
    found.update(own.intersection(records))
    grid = own - records
    for path, key, target in named(paths, text, COORDINATE_REFERENCES, groups=groups):
        if target not in grid and not (key in BOUNDS and path in grid) and records.intersection(dimensions(target)):
            found.add(target)
    return found


def unnamed(text: str | None, gone: Callable[[str], bool]) -> str | None:
    """A coordinates, bounds, climatology or cell_measures attribute's text without the
    variables `gone` says the output leaves out (cell_measures: each with its measure, "area:"),
    "" if it names no other; None if it names none of them (the attribute is left as it is)."""
    kept: list[str] = []
    removed = False
    for word in (text or "").split():
        if word.endswith(":") or not gone(word):
            kept.append(word)
            continue
        removed = True
        if kept and kept[-1].endswith(":"):
            kept.pop()
    return " ".join(kept) if removed else None


def unnamed_attribute(key: str, text: str | None, gone: Callable[[str], bool]) -> str | None:
    """Attribute `key` of NAMING as unnamed rewrites it, but a formula_terms attribute that
    names a variable gone is left out whole (""): a formula missing a term computes nothing."""
    rewritten = unnamed(text, gone)
    return "" if key == "formula_terms" and rewritten is not None else rewritten


COEFFICIENT_DIMENSION = "coefficient"  # axis 1 of a variable written as coefficients (--store coefficients)


def coefficient_coordinates(text: str | None, dimensions: Callable[[str], tuple[str, ...] | None],
                            row: str) -> str:
    """The coordinates attribute of a variable written as coefficients, on (`row`, coefficient):
    the variables its input's coordinates attribute (`text`) names that are written and on no
    dimension but `row` (a station's elev(station), a scalar height), so that readers
    (xarray's decode_coords) still take them for its coordinates; "" if none.
    `dimensions(word)`: the dimensions of the variable a word names, None if the output has
    no such variable."""
    return " ".join(word for word in referenced(text)
                    if (dims := dimensions(word)) is not None and set(dims) <= {row})


def describe(encodings: dict[str, Encoding], stored_dtypes: dict[str, str],
             dropped_attrs: dict[str, list[str]], missing: dict[str, list[tuple]],
             dtype: np.dtype) -> tuple[list[str], dict[str, Any]]:
    """The manifest's account of the CF attributes the perturbed variables honour: its
    postprocessing steps and fields (unpacked, dropped_attributes, missing_values;
    `missing`: by variable, (stored marker, output marker) pairs)."""
    steps: list[str] = []
    extra: dict[str, Any] = {}
    decoded = {name: enc for name, enc in encodings.items() if enc.packed or enc.unsigned}
    if decoded:
        steps.append("write packed datasets unpacked: their stored codes were unpacked (_Unsigned, "
                     f"scale_factor, add_offset) before the noise, and are written as {dtype} "
                     "without those attributes (unpacked)")
        # Not the scale_factor and add_offset themselves: packing tools (ncpdq, ERA5's files)
        # derive them from each variable's own minimum and maximum, which they then give away.
        extra["unpacked"] = {name: {"stored_dtype": stored_dtypes[name], "unsigned": enc.unsigned}
                             for name, enc in decoded.items()}
    if any(key in VALUE_BOUNDS for keys in dropped_attrs.values() for key in keys):
        steps.append("drop the attributes bounding the perturbed datasets' values (valid_range, valid_min, "
                     "valid_max, actual_range): noisy values lie outside them (dropped_attributes)")
    if dropped_attrs:
        extra["dropped_attributes"] = dropped_attrs
    if any(enc.data for enc in encodings.values()):
        steps.append("perturb the values equal to a missing-data marker inside the declared range like every "
                     "other value, and leave that marker off the output so that readers take no noisy value "
                     "for a missing one (dropped)")
    kept = {name: pairs for name, pairs in missing.items() if pairs}
    if kept:
        steps.append("keep missing data: the positions holding a dataset's _FillValue or missing_value are "
                     "copied, not perturbed, so which values are missing is released as is (missing_values)")
        steps.append("move noisy values off the missing-data markers: a perturbed value equal to its "
                     "dataset's output _FillValue or missing_value is moved one grid step (one ulp without a "
                     "grid) toward the declared range, so that readers do not take it for missing data "
                     "(missing_values.moved_off_markers counts them; post-processing, no privacy cost)")
        extra["missing_values"] = {
            name: {"input": [json_number(m) for m, _ in pairs],
                   "output": [json_number(out) for _, out in pairs], "action": "copied, not perturbed"}
            for name, pairs in kept.items()}
    return steps, extra


def messages(name: str, stored: np.dtype, encoding: Encoding) -> list[str]:
    """What the command says about a variable's Encoding when it opens it (missing values:
    missing_message, once the run has seen one)."""
    if encoding.packed:
        return [f"{name}: unpacking its {stored} codes (scale_factor, add_offset) to "
                f"{encoding.dtype} values before the noise; --range is in these units"]
    return []


def missing_message(names: list[str]) -> str:
    """The line a run prints when variables held missing values (`names`: those that did)."""
    return (f"{', '.join(names)}: values equal to {'its' if len(names) == 1 else 'their'} _FillValue or "
            "missing_value are missing data, copied, not perturbed: which values are missing is released "
            "as is")


def output_values(key: str, values, encoding: Encoding | None, dtype: np.dtype) -> list | None:
    """The values a perturbed variable's missing-data attribute `key` gets in the output
    (`values`: its own, flat): each in the output dtype (output_marker), less those taken as
    data (Encoding.as_data); None when none is left, so the attribute is dropped."""
    kept = [v for v in values if encoding is None or not encoding.is_data(key, v)]
    return [output_marker(v, dtype) for v in kept] or None


def count_moves(manifest_extra: dict[str, Any], moved: list[tuple[str, int]]) -> None:
    """Adds to each missing_values entry how many noisy values were moved off its markers
    (`moved`: (variable, count) per block)."""
    for name, entry in manifest_extra.get("missing_values", {}).items():
        entry["moved_off_markers"] = sum(count for moved_name, count in moved if moved_name == name)


def _named(in_range: Mapping[str, tuple[tuple[str, float], ...]]) -> list[str]:
    """"array/attribute" of each marker inside its declared range (calibration.Calibrated).
    Named, never shown by value: the value compared is the marker decoded (unpacked), and a
    packed variable's decoded marker is add_offset + code * scale_factor, which packing tools
    derive from the variable's own minimum and maximum (an ERA5-style -32767 decodes to just
    below the raw minimum). The stored marker is the input's attribute, and missing_values
    states it where the output keeps it."""
    return [f"{name}/{key}" for name, markers in in_range.items() for key, _ in markers]


def marker_fields(in_range: Mapping[str, tuple[tuple[str, float], ...]], public: bool) -> dict[str, Any]:
    """The manifest's account of the missing-data markers inside the declared range
    (`in_range`: by array, (attribute, value in the units perturbed)): `dropped` entries,
    or with `public` (--public-missing) the `public_missing` opt-in and what it covers."""
    named = _named(in_range)
    if public:
        return {"public_missing": {
            "markers": [{"name": name} for name in named],
            "figures_cover": "the elements that are not missing: values equal to these markers (inside the "
                             "declared range) are kept as missing data, copied, not perturbed, and the "
                             "certified figures hold for the other elements, conditional on which elements "
                             "are missing, a pattern declared public and released as is" if named else
                             "every element: no missing-data marker lies inside the declared range"}}
    return {"dropped": [
        {"name": name, "kind": "attribute", "reason": "missing-data marker inside the declared range: values equal "
                                 "to it are data, perturbed like every other, so the output does not declare "
                                 "it (--public-missing keeps them missing instead)"}
        for name in named]} if named else {}


def marker_messages(in_range: Mapping[str, tuple[tuple[str, float], ...]], public: bool) -> list[str]:
    """The line a run (or its plan) prints about the markers inside the declared range."""
    named = listing(_named(in_range))
    if not named:
        return []
    if public:
        return [f"--public-missing: values equal to the missing-data markers inside the declared range "
                f"({named}) stay missing, copied, not perturbed: the guarantee holds for the other values, "
                "given which values are missing, which is released as is"]
    return [f"missing-data markers inside the declared range are data ({named}): values equal to them are "
            "perturbed like every other, and the output does not declare these markers (dropped in the "
            "manifest); --public-missing keeps them missing instead"]

