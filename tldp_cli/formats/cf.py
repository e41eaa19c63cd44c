"""CF conventions (netCDF, xarray's Zarr) about a variable's values, shared by the
formats that honour them (hdf5, zarr_store); no I/O here.

Missing data: values equal to a variable's _FillValue or missing_value are missing,
copied rather than perturbed, and the writer puts its markers back. A noisy value
may land on a marker too (a fill value of -1 sits on the grid just below a range
starting at 0): every reader would take it for missing data, so the writer moves it
to the nearest value that is not a marker (move_off_markers), a deterministic
post-processing of the output that costs no privacy.
"""

from __future__ import annotations

import math
import posixpath
from dataclasses import dataclass
from typing import Any, Callable, Mapping, TypeVar

import numpy as np

from tldp_cli.errors import InputError

T = TypeVar("T")

MOVE_PASSES = 8  # a moved value lands on another marker at most once per marker


def keep_missing(block: np.ndarray, stored: np.ndarray, pairs: list[tuple],
                 bounds: tuple[float, float, float | None]) -> int:
    """Puts each output marker back, in place, where the input (`stored`) holds its
    stored marker (the block holds noise there), then moves the noisy values that equal
    a marker off it (move_off_markers). `pairs`: (stored marker, output marker). Returns
    how many values moved."""
    missing = np.zeros(block.shape, dtype=bool)
    for marker, out in pairs:
        where = np.isnan(stored) if np.isnan(marker) else stored == marker
        block[where] = out
        missing |= where
    return move_off_markers(block, missing, [out for _, out in pairs], bounds)


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

    @property
    def packed(self) -> bool:
        return self.scale is not None or self.offset is not None

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


def encoding(where: str, stored: np.dtype, numbers: Callable[[str], np.ndarray | None],
             unsigned_text: str | None, nan_missing: bool = False) -> Encoding | None:
    """A variable's Encoding from its attributes (`numbers(key)`: a numeric attribute's
    values, flat, None if absent; `unsigned_text`: its _Unsigned); None when its stored
    values are the values. `nan_missing`: NaN marks missing data even without a _FillValue
    (xarray's Zarr stores). `where` starts error messages."""
    markers = []
    for key in MISSING:
        values = numbers(key)
        for value in () if values is None else values:
            if stored.kind != "f" and not np.isfinite(value):
                continue  # no integer is NaN: such a marker marks nothing
            with np.errstate(invalid="ignore", over="ignore"):
                marker = np.asarray(value).astype(stored)
                # A marker the dtype cannot hold (missing_value 0.5 on integers) occurs nowhere.
                if np.array_equal(marker.astype(value.dtype), value, equal_nan=stored.kind == "f"):
                    markers.append(marker[()])
    if nan_missing and stored.kind == "f" and not any(np.isnan(m) for m in markers):
        markers.append(stored.type(np.nan))
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
    return Encoding(tuple(markers), unsigned, scale, offset, dtype)


def decoded_records(raw: np.ndarray, encoding: Encoding, present: Callable[[], np.generic]) -> np.ndarray:
    """Stored records as the values perturbed. Missing positions get a value the data holds
    (the block's first, else `present()`), so that they pass the range check; the writer
    puts the markers back, so their noisy values are never written."""
    values = encoding.decode(raw)
    missing = encoding.missing(raw)
    if missing is not None:
        kept = values[~missing]
        values[missing] = kept[0] if kept.size else present()
    return values


def first_present(stored: Callable[[int, int], np.ndarray], records: int, record_elements: int,
                  encoding: Encoding, where: str) -> np.generic:
    """The first value of a variable (read by `stored(start, stop)`) that is not missing."""
    step = max(1, (1 << 20) // max(1, record_elements))
    for start in range(0, records, step):
        raw = stored(start, start + step)
        missing = encoding.missing(raw)
        if missing is None or not missing.all():
            values = encoding.decode(raw)
            return values.flat[0] if missing is None else values[~missing][0]
    raise InputError(f"{where} holds only missing values (its _FillValue or missing_value); there is "
                     "nothing to perturb, so leave it out (choose the datasets with --dataset)")


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
        extra["unpacked"] = {
            name: {"stored_dtype": stored_dtypes[name], "unsigned": enc.unsigned,
                   "scale_factor": json_number(enc.scale), "add_offset": json_number(enc.offset)}
            for name, enc in decoded.items()}
    if any(key in VALUE_BOUNDS for keys in dropped_attrs.values() for key in keys):
        steps.append("drop the attributes bounding the perturbed datasets' values (valid_range, valid_min, "
                     "valid_max, actual_range): noisy values lie outside them (dropped_attributes)")
    if dropped_attrs:
        extra["dropped_attributes"] = dropped_attrs
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
    """What the command says about a variable's Encoding."""
    lines = []
    if encoding.packed:
        lines.append(f"{name}: unpacking its {stored} codes (scale_factor, add_offset) to "
                     f"{encoding.dtype} values before the noise; --range is in these units")
    if encoding.markers:
        lines.append(f"{name}: values equal to its _FillValue or missing_value are missing data, "
                     "copied, not perturbed: which values are missing is released as is")
    return lines


def count_moves(manifest_extra: dict[str, Any], moved: list[tuple[str, int]]) -> None:
    """Adds to each missing_values entry how many noisy values were moved off its markers
    (`moved`: (variable, count) per block)."""
    for name, entry in manifest_extra.get("missing_values", {}).items():
        entry["moved_off_markers"] = sum(count for moved_name, count in moved if moved_name == name)
