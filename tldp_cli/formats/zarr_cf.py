"""The CF conventions as xarray writes them into a Zarr store (formats/zarr_store.py, over
formats/cf.py): dimension names, missing-data markers (_FillValue, missing_value, a Zarr 2
fill_value), packing, coordinate and grid-mapping arrays, and a perturbed array's CF
attributes in the output.
"""

from __future__ import annotations

import base64
import posixpath
import struct
from typing import Any, Callable

import numpy as np

from tldp_cli.errors import InputError
from tldp_cli.formats import cf, leftovers

# CF conventions in stores written by xarray (to_zarr): dimension names in the
# _ARRAY_DIMENSIONS attribute (Zarr 2) or the dimension_names metadata (Zarr 3); the
# _FillValue is the array's fill_value (Zarr 2) or an attribute, holding a float as the
# base64 of a little-endian double (Zarr 3); NaN is missing data.
def dimension_names(array) -> tuple[str, ...] | None:
    if array.metadata.zarr_format == 3:
        names = array.metadata.dimension_names
    else:
        names = array.attrs.get("_ARRAY_DIMENSIONS")
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        return None
    return tuple(names)


def _cf_attribute(where: str, array, key: str) -> np.ndarray | None:
    """A CF numeric attribute's values, flat (as xarray writes them); None if absent."""
    if key in array.attrs:
        value = array.attrs[key]
    elif key == "_FillValue" and _fill_is_cf(array):
        value = array.fill_value
    else:
        return None
    if value is None:
        return None
    if key == "_FillValue" and isinstance(value, str):
        try:
            value = (float(value) if value in ("NaN", "Infinity", "-Infinity")
                     else struct.unpack("<d", base64.b64decode(value, validate=True))[0])
        except (ValueError, struct.error):
            raise InputError(f"{where}: its _FillValue attribute {value!r} is neither a number nor "
                             "xarray's base64 of a double") from None
    number = np.asarray(value)
    if number.dtype.kind not in "iuf":
        raise InputError(f"{where}: its {key} attribute is {value!r}, not a number")
    return number.ravel()


def _fill_is_cf(array) -> bool:
    """Whether the array's fill_value is its CF _FillValue (xarray's Zarr 2 arrays)."""
    return (array.metadata.zarr_format == 2 and "_FillValue" not in array.attrs
            and dimension_names(array) is not None)


def cf_encoding(where: str, array) -> cf.Encoding | None:
    unsigned = array.attrs.get("_Unsigned")
    return cf.encoding(where, array.dtype, lambda key: _cf_attribute(where, array, key),
                       unsigned if isinstance(unsigned, str) else None,
                       nan_missing=dimension_names(array) is not None,
                       labels={"_FillValue": FILL_VALUE} if _fill_is_cf(array) else {})


FILL_VALUE = "fill_value"  # how markers from a Zarr 2 fill_value are named (ArrayJob.markers)


def output_fill(array, encoding: cf.Encoding | None):
    """The fill value of a perturbed array's output, before its dtype: none where the array's
    fill_value is its _FillValue and a marker taken as data (cf.Encoding.as_data), since
    xarray would mask every noisy value equal to it."""
    if encoding is not None and _fill_is_cf(array) and encoding.is_data(FILL_VALUE, array.fill_value):
        return None
    return array.fill_value


def coordinate_arrays(arrays: dict[str, Any], groups: dict[str, Any]) -> set[str]:
    """The arrays that locate or delimit the data rather than hold it: those named like one
    of their own dimensions (xarray's coordinates) and those a CF coordinates, bounds,
    climatology or cell_measures attribute of an array or group names."""
    found = {path for path, array in arrays.items() if posixpath.basename(path) in (dimension_names(array) or ())}
    named = cf.named(["/" + path for path in arrays], text_lookup({**groups, **arrays}), cf.COORDINATE_REFERENCES,
                     groups=[posixpath.normpath("/" + path) for path in groups])
    return found | {target.lstrip("/") for _, _, target in named}


def text_lookup(nodes: dict[str, Any]) -> Callable[[str, str], str | None]:
    """cf.named's `text` for Zarr arrays and groups (by path without the leading "/"): a
    string attribute."""
    def text(path: str, key: str) -> str | None:
        value = nodes[path.strip("/")].attrs.get(key)
        return value if isinstance(value, str) else None
    return text


def dimension_lookup(arrays: dict[str, Any]) -> Callable[[str], tuple[str, ...]]:
    """cf.record_coordinates' `dimensions` for Zarr arrays: xarray's, named within their group."""
    def dimensions(path: str) -> tuple[str, ...]:
        names = dimension_names(arrays[path.lstrip("/")]) or ()
        return tuple(posixpath.join(posixpath.dirname(path), name) for name in names)
    return dimensions


def _inherited(records: set[str]) -> set[str]:
    """The record dimensions, each also under its name in every group above its own: a
    group sees its parents' dimensions (xarray's DataTree), named alike."""
    found = set()
    for dimension in records:
        group, name = posixpath.split(dimension)
        found.add(dimension)
        while group != "/":
            group = posixpath.dirname(group)
            found.add(posixpath.join(group, name))
    return found


def record_coordinates(arrays: dict[str, Any], groups: dict[str, Any], records: set[str]) -> set[str]:
    """The arrays that hold a value per record along the record dimension of a perturbed array
    (`records`, as ArrayJob.row_dimension), not a grid (cf.record_coordinates, leftovers.py);
    a group's coordinates attribute names them too (xarray's, for coordinates no data
    variable takes)."""
    found = cf.record_coordinates(["/" + path for path in arrays], text_lookup({**groups, **arrays}),
                                  dimension_lookup(arrays), _inherited(records),
                                  groups=[posixpath.normpath("/" + path) for path in groups])
    return {path.lstrip("/") for path in found}


def unnamed(arrays: dict[str, Any], group: str, left_out: set[str], attrs: dict[str, Any]) -> dict[str, Any]:
    """A node's attributes, its CF coordinates, bounds, climatology, cell_measures,
    ancillary_variables and formula_terms attributes (cf.NAMING) naming only the arrays
    written (each left out when it names none of them; formula_terms when it names one
    left out, cf.unnamed_attribute): CF readers look for every variable they name.
    `group`: the group its names are looked up in (an array's, or a group itself), by
    absolute path."""
    by_path = {"/" + name: name for name in arrays}
    out = dict(attrs)
    for key in cf.NAMING:
        text = attrs.get(key)
        rewritten = cf.unnamed_attribute(key, text if isinstance(text, str) else None,
                                         lambda word: cf.variable(word, group, by_path) in left_out)
        if rewritten == "":
            del out[key]
        elif rewritten is not None:
            out[key] = rewritten
    return out


def grid_mapping_arrays(arrays: dict[str, Any]) -> set[str]:
    """The arrays a CF grid_mapping attribute of an array names."""
    named = cf.named(["/" + path for path in arrays], text_lookup(arrays), ["grid_mapping"], leftovers.grid_mappings)
    return {target.lstrip("/") for _, _, target in named}


def cf_output_attrs(where: str, array, attrs: dict[str, Any], encoding: cf.Encoding | None,
                    dtype: np.dtype) -> tuple[dict[str, Any], list[str], list[tuple]]:
    """A perturbed array's attributes for the output (of `attrs`, those written): no value
    bounds, no packing, the missing-data markers in the output dtype (a float _FillValue of
    Zarr 3 as xarray writes it); the attributes dropped; (stored marker, output marker) pairs."""
    dropped = cf.dropped_attributes(attrs, encoding)
    out = {key: value for key, value in attrs.items() if key not in dropped}
    if encoding is None:
        return out, dropped, []
    stored = array.dtype
    for key in (k for k in cf.MISSING if k in out):
        attribute = _cf_attribute(where, array, key)
        if attribute is None:  # null: no marker to rewrite
            continue
        with np.errstate(invalid="ignore", over="ignore"):
            own = [np.asarray(v).astype(stored) for v in attribute]
            values = cf.output_values(key, own, encoding, dtype)
        if values is None:  # every marker of it taken as data
            del out[key]
            continue
        if key == "_FillValue" and array.metadata.zarr_format == 3 and dtype.kind == "f":
            out[key] = base64.standard_b64encode(struct.pack("<d", float(values[0]))).decode()
        else:
            numbers = [v.item() for v in values]
            out[key] = numbers if isinstance(out[key], list) else numbers[0]
    return out, dropped, cf.output_markers(encoding, dtype)
