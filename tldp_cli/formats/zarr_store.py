"""Zarr directory stores, Zarr format 2 and 3: a single array or a group tree.

The output starts as a file-for-file copy of the input without the perturbed
arrays' chunks and what is left out (below). Their metadata is rewritten for the float output dtype (same
chunks, shards, codecs, fill value, attributes, dimension names) and the noisy
records are written as chunk files (zarr_chunks.py) or, for sharded and other
layouts, through zarr-python. Consolidated metadata is rebuilt at the end.

Nothing outside the store is read or copied. A symbolic link anywhere inside it
(to a file or a directory, dangling or not), or any other entry that is neither a
regular file nor a directory, is refused before anything is written; only the
store's own path may be a link. Every directory below a group must be a node (hold
zarr.json, or .zarray/.zgroup): one without is refused as a damaged store, since it
may be an array that lost its metadata. Node names starting with "." are nodes like
any other.

What is not perturbed (arrays, free-text attributes, files that are neither
metadata nor chunks of an array, such as .DS_Store or a README) is left out unless
it is structural metadata, a numeric coordinate or named by --keep, and listed in
the manifest (formats.leftovers).
"""

from __future__ import annotations

import base64
import copy
import hashlib
import itertools
import json
import math
import os
import posixpath
import re
import shutil
import stat
import struct
import warnings
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal

import numpy as np
import zarr
from zarr.storage import LocalStore

from tldp_cli.errors import InputError, OutputError, UsageError, reason_of
from tldp_cli.files.checked_io import Background, flushed_files, json_value, open_regular
from tldp_cli.files.output import removed_during_run, shown
from tldp_cli.formats import (
    ArrayJob,
    DocRow,
    Format,
    FormatOptions,
    Reader,
    Writer,
    check_numeric_dtype,
    default_selection,
    dropped_filters,
    tldp_name,
)
from tldp_cli.formats import cf, leftovers, zarr_chunks

zarr_chunks.use_checked_codecs()  # chunks zarr-python decodes: sizes checked before decoding

NAME = "zarr"
METADATA_FILES = ("zarr.json", ".zarray", ".zgroup", ".zattrs", ".zmetadata")
# A chunk (or shard) key within its array's directory: "0.0", "0/0", "c/0/0", "c.0.0", "c".
_CHUNK_KEY = re.compile(r"^(c|\d+)([./]\d+)*$")


def can_open(path: Path) -> bool:
    """A folder with Zarr metadata at its root (even a corrupt one). Chunk-like names alone
    decide nothing: folders named 0..9 are the usual layout of a folder of images by class,
    and a store that lost its root metadata cannot be read as Zarr anyway (perturb
    --format zarr says what is missing)."""
    return path.is_dir() and any((path / name).is_file() for name in METADATA_FILES)


def default_output(path: Path) -> Path:
    if path.name in ("", ".."):
        path = path.resolve()
    return tldp_name(path, ".zarr", FORMAT.compound_suffixes)


@dataclass
class _Node:
    path: str  # within the store, "" for the root
    kind: str  # "array" or "group"
    meta: dict[str, Any]  # the parsed zarr.json (format 3) or .zarray/.zgroup (format 2)
    consolidated: bool = False


def _display(name: str) -> str:
    return name or "/"


# The free-text names, identifiers and dates inside the NGFF metadata: an image's name
# (multiscales[].name, omero.name: bioformats2raw writes the source image's, often its file
# name), its id in the OMERO server it came from (omero.id), a plate's name and its
# acquisitions' names, descriptions and times (plate.name, plate.acquisitions.name, ...). None
# is structure readers need. Left out unless --keep names GROUP@FIELD (GROUP@omero.name).
NGFF_NAME_REASON = ("a free-text name inside the OME-Zarr metadata (often the source image's file name, which "
                    "can name the subject), not structure readers need (--keep copies it)")
NGFF_ID_REASON = ("the image's identifier in the OMERO server it came from, which ties the release to the "
                  "source record, not structure readers need (--keep copies it)")
NGFF_TIME_REASON = ("when the acquisition was made (the input's metadata, as a file's dates), not structure "
                    "readers need (--keep copies it)")
_NGFF_FIELDS = {"name": NGFF_NAME_REASON, "description": NGFF_NAME_REASON, "id": NGFF_ID_REASON,
                "starttime": NGFF_TIME_REASON, "endtime": NGFF_TIME_REASON}


def _ngff_named(attrs: dict[str, Any]) -> list[tuple[str, dict, str]]:
    """(the name --keep and the manifest give it, the object holding it, its key) of each
    name, identifier and date (_NGFF_FIELDS) in the NGFF metadata (NGFF 0.5: under "ome")."""
    ngff = attrs["ome"] if isinstance(attrs.get("ome"), dict) else attrs
    found: list[tuple[str, dict, str]] = []

    def add(where: str, obj: Any, keys: tuple[str, ...]) -> None:
        if isinstance(obj, dict):
            found.extend((f"{where}.{key}", obj, key) for key in keys if key in obj)

    def entries(value: Any) -> list:
        return value if isinstance(value, list) else []

    for entry in entries(ngff.get("multiscales")):
        add("multiscales", entry, ("name",))
    add("omero", ngff.get("omero"), ("name", "id"))
    plate = ngff.get("plate")
    add("plate", plate, ("name",))
    for acquisition in entries(plate.get("acquisitions") if isinstance(plate, dict) else None):
        add("plate.acquisitions", acquisition, ("name", "description", "starttime", "endtime"))
    return found


def _without_ngff_names(owner: str, attrs: dict[str, Any], left: leftovers.Leftovers) -> dict[str, Any]:
    """`attrs` less the NGFF names, identifiers and dates (_ngff_named), each listed as
    OWNER@FIELD (OWNER@omero.name) in `dropped`, or kept and listed where --keep names it."""
    if not _ngff_named(attrs):
        return attrs
    attrs = copy.deepcopy(attrs)  # the nested objects are the input's
    found = _ngff_named(attrs)
    for field in dict.fromkeys(field for field, _, _ in found):
        name = leftovers.attribute_name(owner, field)
        if left.kept(name):
            left.copied(name, "attribute", leftovers.KEPT)
            continue
        key = field.rsplit(".", 1)[1]
        left.drop(name, "attribute", _NGFF_FIELDS[key])
        for _, obj, _ in [item for item in found if item[0] == field]:
            del obj[key]
    return attrs


def _read_json(store: Path, file: Path) -> dict[str, Any]:
    where = file.relative_to(store).as_posix()
    try:
        with open_regular(file, follow_links=False) as f:  # listed as a regular file: still one
            text = f.read().decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"{store}: damaged Zarr store: {where} is not valid JSON ({reason_of(exc)})") from None
    meta = json_value(text, f"{store}: damaged Zarr store: {where}")
    if not isinstance(meta, dict):
        raise InputError(f"{store}: damaged Zarr store: {where} is not a JSON object")
    return meta


# The Zarr format versions zarr-python reads and writes.
ZarrFormat = Literal[2, 3]


def _zarr_format(store: Path) -> ZarrFormat:
    if (store / "zarr.json").is_file():
        return 3
    if (store / ".zarray").is_file() or (store / ".zgroup").is_file():
        return 2
    raise InputError(f"{store}: damaged Zarr store: no zarr.json, .zarray or .zgroup at its root "
                     "(its metadata is missing)")


def _node_at(store: Path, directory: Path, zarr_format: ZarrFormat) -> _Node | None:
    rel = directory.relative_to(store).as_posix()
    rel = "" if rel == "." else rel
    if zarr_format == 3:
        if not (directory / "zarr.json").is_file():
            return None
        meta = _read_json(store, directory / "zarr.json")
        kind = meta.get("node_type")
        if kind not in ("array", "group") or meta.get("zarr_format") != 3:
            raise InputError(f"{store}: damaged Zarr store: {_display(rel)} has no valid "
                             "node_type/zarr_format in its zarr.json")
        return _Node(rel, kind, meta, meta.get("consolidated_metadata") is not None)
    if (directory / ".zarray").is_file():
        return _Node(rel, "array", _read_json(store, directory / ".zarray"))
    if (directory / ".zgroup").is_file():
        return _Node(rel, "group", _read_json(store, directory / ".zgroup"),
                     (directory / ".zmetadata").is_file())
    return None


def _files(store: Path) -> list[str]:
    """Relative POSIX paths of the files in the store, found without following links.
    A link is refused rather than skipped: zarr would follow it when reading, and the
    copy of the unperturbed files would publish whatever it points to."""
    def unreadable(exc: OSError):
        raise InputError(f"{store}: cannot list {exc.filename} ({reason_of(exc)})")

    files = []
    for directory, dirs, names in os.walk(store, onerror=unreadable):
        dirs.sort()
        for name in sorted(dirs + names):
            entry = Path(directory, name)
            rel = entry.relative_to(store).as_posix()
            mode = entry.lstat().st_mode
            if stat.S_ISLNK(mode):
                raise InputError(f"{store}: {rel} is a symbolic link; tldp does not follow links "
                                 "inside a Zarr store (replace it with a copy of what it points to)")
            if stat.S_ISREG(mode):
                files.append(rel)
            elif not stat.S_ISDIR(mode):
                raise InputError(f"{store}: {rel} is neither a regular file nor a directory")
    return sorted(files)


def _walk(store: Path, zarr_format: ZarrFormat) -> list[_Node]:
    """Every node of the store, read from its own metadata file (never from consolidated
    metadata, which may be stale)."""
    root = _node_at(store, store, zarr_format)
    assert root is not None  # _zarr_format found its metadata
    nodes = [root]
    pending = [root]
    while pending:
        group = pending.pop()
        if group.kind != "group":
            continue
        directory = store / group.path
        for child in sorted(p for p in directory.iterdir() if p.is_dir()):
            node = _node_at(store, child, zarr_format)
            if node is None:
                # Most likely an array that lost its metadata: copying it as is could
                # publish raw data in the perturbed output.
                expected = "zarr.json" if zarr_format == 3 else ".zarray or .zgroup"
                raise InputError(f"{store}: damaged Zarr store: {child.relative_to(store).as_posix()}/ "
                                 f"has no {expected}")
            nodes.append(node)
            pending.append(node)
    return sorted(nodes, key=lambda n: n.path)


def _check_attributes(store: Path, files: list[str], nodes: list[_Node]) -> None:
    """Reads the nodes' Zarr 2 attributes (.zattrs, which zarr-python parses itself) with
    _read_json first: one that is not JSON, or nests too deeply, is refused naming it,
    before zarr-python reaches it. (.zmetadata is never read: the output's is rebuilt.)"""
    node_paths = {n.path for n in nodes}
    for rel in files:
        parent, _, name = rel.rpartition("/")
        if name == ".zattrs" and parent in node_paths:
            _read_json(store, store / rel)


def _not_zarr(files: list[str], nodes: list[_Node]) -> dict[str, str | None]:
    """The files that are neither a node's metadata nor chunks of an array, each with
    the array whose directory holds it (None if it lies in a group's)."""
    node_paths = {n.path for n in nodes}
    arrays = [n.path for n in nodes if n.kind == "array"]
    others: dict[str, str | None] = {}
    for rel in files:
        parent, _, name = rel.rpartition("/")
        if parent in node_paths and name in METADATA_FILES:
            continue
        # Arrays have no children, so at most one holds the file.
        owner = next((a for a in arrays if a == "" or rel.startswith(a + "/")), None)
        if owner is not None and _CHUNK_KEY.match(rel[len(owner) + 1:] if owner else rel):
            continue
        others[rel] = owner
    return others


def _open(store: LocalStore, where: Path, node: str, kind: str, zarr_format: ZarrFormat,
          mode: Literal["r", "r+"] = "r"):
    try:
        if kind == "group":
            return zarr.open_group(store=store, path=node, mode=mode, zarr_format=zarr_format,
                                   use_consolidated=False)
        return zarr.open_array(store=store, path=node, mode=mode, zarr_format=zarr_format)
    except Exception as exc:  # zarr raises many kinds on bad metadata
        detail = f"no {exc} field" if isinstance(exc, KeyError) else reason_of(exc)
        raise InputError(f"{where}: damaged Zarr store: {kind} {_display(node)} has invalid "
                         f"metadata ({detail})") from None


@dataclass(frozen=True)
class _Records:
    """Reads records of one array. Picklable: opens the store inside each call, so it can
    run in Dask worker processes."""

    store: Path
    name: str  # the array's path in the store, "" for a single-array store
    zarr_format: ZarrFormat
    encoding: cf.Encoding | None = None  # CF: missing values and packing (xarray's stores)
    chunk_files: zarr_chunks.Layout | None = None  # plain chunk files are read without zarr-python

    def __call__(self, start: int, stop: int) -> np.ndarray:
        raw = self.stored(start, stop)
        if self.encoding is None:
            return raw
        return cf.decoded_records(raw, self.encoding)

    def stored(self, start: int, stop: int) -> np.ndarray:
        """Records start:stop as stored."""
        try:
            if self.chunk_files is not None:
                return self.chunk_files.read(self.store / self.name, start, stop)
            array = _open(LocalStore(self.store, read_only=True), self.store, self.name, "array",
                          self.zarr_format)
            return np.asarray(array[start:stop])
        except InputError:
            raise
        except MemoryError:  # not damage: the run says memory ran out
            raise
        except Exception as exc:
            raise InputError(f"{self.store}: cannot read records {start}-{stop} of array "
                             f"{_display(self.name)} ({reason_of(exc)}); a chunk may be damaged") from None


# Multiscale images (OME-Zarr / NGFF 0.4 and 0.5). A multiscale group lists its levels,
# full resolution first. Only the full resolution is perturbed: the lower levels are
# regenerated from it (post-processing), never copied, so none is raw and the records
# are released once.
MEAN, NEAREST = "mean", "nearest"


@dataclass(frozen=True)
class _Pyramid:
    group: str  # the image's group in the store, "" for the root
    index: int  # its entry in the group's multiscales list
    in_ome: bool  # NGFF 0.5: the list is under the "ome" attribute
    levels: tuple[str, ...]  # the arrays' paths in the store, full resolution first
    # each lower level: per axis, how many elements of the level above make one of it
    factors: tuple[tuple[int, ...], ...]
    method: str  # MEAN or NEAREST
    declared: str | None  # the downsampling the metadata declares (type, metadata.method)

    @property
    def name(self) -> str:
        return _display(self.group)

    def describe(self) -> dict[str, Any]:
        """The manifest's entry (multiscale_images)."""
        return {"image": self.name, "perturbed": self.levels[0], "regenerated": list(self.levels[1:]),
                "downsampling": self.method, "factors": [list(f) for f in self.factors],
                "declared_downsampling": self.declared}


def _multiscales(attrs: dict[str, Any]) -> tuple[list | None, bool, bool]:
    """A group's multiscales list (None if it has none), whether it sits under "ome"
    (NGFF 0.5), and whether the group is a label image."""
    ome = attrs.get("ome")
    if isinstance(ome, dict) and "multiscales" in ome:
        return ome["multiscales"], True, "image-label" in ome
    return attrs.get("multiscales"), False, "image-label" in attrs


def _declared_method(entry: dict[str, Any], label: bool) -> tuple[str, str | None]:
    """The downsampling tldp applies (nearest for labels and where declared, else the mean)
    and the one the metadata declares, as text."""
    metadata = entry.get("metadata")
    metadata = metadata if isinstance(metadata, dict) else {}
    parts = [str(p) for p in (entry.get("type"), metadata.get("method")) if p]
    declared = " / ".join(parts) or None
    kwargs = metadata.get("kwargs")
    kwargs = kwargs if isinstance(kwargs, dict) else {}
    text = (declared or "").lower()
    if label or any(word in text for word in (NEAREST, "subsample", "pick")) or kwargs.get("order") == 0:
        return NEAREST, declared
    return MEAN, declared


def _scale(dataset: dict[str, Any]) -> list[float] | None:
    for transform in dataset.get("coordinateTransformations") or []:
        if isinstance(transform, dict) and transform.get("type") == "scale" \
                and isinstance(transform.get("scale"), list):
            return [float(s) for s in transform["scale"]]
    return None


_Size = tuple[tuple[int, ...], list[float] | None]  # a level's shape and scale


def _level_factors(where: str, above: _Size, level: _Size, name: str) -> tuple[int, ...]:
    """How many elements of the level above make one of this level, per axis: the ratio of
    their scales (of their shapes when no scale is declared), which the shapes must fit. A
    scale ratio that is the ratio of the shapes (ome-zarr-py's, for odd sizes: 45 -> 22 is
    2.045) is read as the nearest whole factor."""
    (shape_above, scale_above), (shape, scale) = above, level
    if len(shape) != len(shape_above):
        raise InputError(f"{where}: level {name} has {len(shape)} dimensions, the level above "
                         f"{len(shape_above)}")
    factors = []
    for axis, (n_above, n) in enumerate(zip(shape_above, shape)):
        if scale and scale_above and len(scale) == len(shape) == len(scale_above) and scale_above[axis] > 0:
            ratio = scale[axis] / scale_above[axis]
        else:
            ratio = n_above / max(n, 1)
        factor = max(1, round(ratio))
        whole = abs(ratio - factor) <= 1e-6 * ratio or abs(ratio - n_above / max(n, 1)) <= 1e-6 * ratio
        if not whole or n not in (n_above // factor, -(-n_above // factor)):
            raise InputError(f"{where}: level {name} (shape {shape}) is not a downsampling of the level "
                             f"above (shape {shape_above}) by a whole factor on axis {axis} (ratio "
                             f"{ratio:g}); tldp cannot regenerate it")
        factors.append(factor)
    return tuple(factors)


def _pyramids(path: Path, nodes: list[_Node], opened: dict[str, Any]) -> list[_Pyramid]:
    """The multiscale images of the store, from their groups' attributes."""
    found = []
    for node in (n for n in nodes if n.kind == "group"):
        entries, in_ome, label = _multiscales(opened[node.path].attrs.asdict())
        if entries is None:
            continue
        where = f"{path}: OME-Zarr image {_display(node.path)}"
        if not isinstance(entries, list):
            raise InputError(f"{where}: damaged metadata (multiscales is not a list)")
        for index, entry in enumerate(entries):
            datasets = entry.get("datasets") if isinstance(entry, dict) else None
            if not isinstance(datasets, list) or not datasets or \
                    not all(isinstance(d, dict) and isinstance(d.get("path"), str) for d in datasets):
                raise InputError(f"{where}: damaged metadata (multiscales[{index}] has no datasets with "
                                 "a path)")
            levels = tuple(f"{node.path}/{d['path']}".strip("/") for d in datasets)
            missing = [lvl for lvl in levels if not isinstance(opened.get(lvl), zarr.Array)]
            if missing:
                raise InputError(f"{where}: its multiscales list {missing[0]}, which is not an array of "
                                 "the store")
            sizes = [(tuple(opened[lvl].shape), _scale(d)) for lvl, d in zip(levels, datasets)]
            factors = tuple(_level_factors(where, sizes[k - 1], sizes[k], levels[k])
                            for k in range(1, len(levels)))
            method, declared = _declared_method(entry, label)
            found.append(_Pyramid(node.path, index, in_ome, levels, factors, method, declared))
    return found


# CF conventions in stores written by xarray (to_zarr): dimension names in the
# _ARRAY_DIMENSIONS attribute (Zarr 2) or the dimension_names metadata (Zarr 3); the
# _FillValue is the array's fill_value (Zarr 2) or an attribute, holding a float as the
# base64 of a little-endian double (Zarr 3); NaN is missing data.
def _dimension_names(array) -> tuple[str, ...] | None:
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
            and _dimension_names(array) is not None)


def _cf_encoding(where: str, array) -> cf.Encoding | None:
    unsigned = array.attrs.get("_Unsigned")
    return cf.encoding(where, array.dtype, lambda key: _cf_attribute(where, array, key),
                       unsigned if isinstance(unsigned, str) else None,
                       nan_missing=_dimension_names(array) is not None,
                       labels={"_FillValue": FILL_VALUE} if _fill_is_cf(array) else {})


FILL_VALUE = "fill_value"  # how markers from a Zarr 2 fill_value are named (ArrayJob.markers)


def _output_fill(array, encoding: cf.Encoding | None):
    """The fill value of a perturbed array's output, before its dtype: none where the array's
    fill_value is its _FillValue and a marker taken as data (cf.Encoding.as_data), since
    xarray would mask every noisy value equal to it."""
    if encoding is not None and _fill_is_cf(array) and encoding.is_data(FILL_VALUE, array.fill_value):
        return None
    return array.fill_value


def _coordinate_arrays(arrays: dict[str, Any], groups: dict[str, Any]) -> set[str]:
    """The arrays that locate or delimit the data rather than hold it: those named like one
    of their own dimensions (xarray's coordinates) and those a CF coordinates, bounds,
    climatology or cell_measures attribute of an array or group names."""
    found = {path for path, array in arrays.items() if posixpath.basename(path) in (_dimension_names(array) or ())}
    named = cf.named(["/" + path for path in arrays], _text({**groups, **arrays}), cf.COORDINATE_REFERENCES,
                     groups=[posixpath.normpath("/" + path) for path in groups])
    return found | {target.lstrip("/") for _, _, target in named}


def _text(nodes: dict[str, Any]) -> Callable[[str, str], str | None]:
    """cf.named's `text` for Zarr arrays and groups (by path without the leading "/"): a
    string attribute."""
    def text(path: str, key: str) -> str | None:
        value = nodes[path.strip("/")].attrs.get(key)
        return value if isinstance(value, str) else None
    return text


def _dimensions(arrays: dict[str, Any]) -> Callable[[str], tuple[str, ...]]:
    """cf.record_coordinates' `dimensions` for Zarr arrays: xarray's, named within their group."""
    def dimensions(path: str) -> tuple[str, ...]:
        names = _dimension_names(arrays[path.lstrip("/")]) or ()
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


def _record_coordinates(arrays: dict[str, Any], groups: dict[str, Any], records: set[str]) -> set[str]:
    """The arrays that hold a value per record along the record dimension of a perturbed array
    (`records`, as ArrayJob.row_dimension), not a grid (cf.record_coordinates, leftovers.py);
    a group's coordinates attribute names them too (xarray's, for coordinates no data
    variable takes)."""
    found = cf.record_coordinates(["/" + path for path in arrays], _text({**groups, **arrays}), _dimensions(arrays),
                                  _inherited(records), groups=[posixpath.normpath("/" + path) for path in groups])
    return {path.lstrip("/") for path in found}


def _unnamed(arrays: dict[str, Any], group: str, left_out: set[str], attrs: dict[str, Any]) -> dict[str, Any]:
    """A node's attributes, its CF coordinates, bounds, climatology and cell_measures attributes
    naming only the arrays written (each left out when it names none of them): CF readers
    look for every variable they name. `group`: the group its names are looked up in (an
    array's, or a group itself), by absolute path."""
    by_path = {"/" + name: name for name in arrays}
    out = dict(attrs)
    for key in cf.COORDINATE_REFERENCES:
        text = attrs.get(key)
        rewritten = cf.unnamed(text if isinstance(text, str) else None,
                               lambda word: cf.variable(word, group, by_path) in left_out)
        if rewritten == "":
            del out[key]
        elif rewritten is not None:
            out[key] = rewritten
    return out


def _grid_mapping_arrays(arrays: dict[str, Any]) -> set[str]:
    """The arrays a CF grid_mapping attribute of an array names."""
    named = cf.named(["/" + path for path in arrays], _text(arrays), ["grid_mapping"], leftovers.grid_mappings)
    return {target.lstrip("/") for _, _, target in named}


def _cf_output_attrs(where: str, array, attrs: dict[str, Any], encoding: cf.Encoding | None,
                     dtype: np.dtype) -> tuple[dict[str, Any], list[str], list[tuple]]:
    """A perturbed array's attributes for the output (of `attrs`, those written): no value
    bounds, no packing, the missing-data markers in the output dtype (a float _FillValue of
    Zarr 3 as xarray writes it); the attributes dropped; (stored marker, output marker) pairs."""
    dropped = [key for key in cf.VALUE_BOUNDS if key in attrs]
    if encoding is not None and (encoding.packed or encoding.unsigned):
        dropped += [key for key in cf.PACKING if key in attrs]
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
    return out, dropped, [(marker, cf.output_marker(marker, dtype)) for marker in encoding.markers]


class ZarrReader(Reader):
    format = NAME

    def __init__(self, path: Path, options: FormatOptions):
        self.path = path
        self.messages: list[str] = []
        self.manifest_extra: dict = {}
        files = _files(path)  # first: it refuses links before any file is read
        self.zarr_format = _zarr_format(path)
        self.nodes = _walk(path, self.zarr_format)
        _check_attributes(path, files, self.nodes)
        self.store = LocalStore(path, read_only=True)
        opened = {n.path: _open(self.store, path, n.path, n.kind, self.zarr_format) for n in self.nodes}
        self.handles = {n.path: opened[n.path] for n in self.nodes if n.kind == "array"}
        self.group_handles = {n.path: opened[n.path] for n in self.nodes if n.kind == "group"}
        self.encodings: dict[str, cf.Encoding] = {}  # job name -> its CF encoding, where it has one
        self.pyramids = _pyramids(path, self.nodes, opened)
        selected = self._select(options.datasets)
        self.jobs = [self._job(name) for name in selected]
        # The multiscale images whose lower levels the writer regenerates (all of them).
        self.regenerated = [p for p in self.pyramids if p.levels[0] in selected and len(p.levels) > 1]
        # Metadata computed from the raw values, which the writer leaves out, by image.
        self.raw_statistics = {p: _raw_statistics(opened[p.group].attrs.asdict())
                               for p in self.pyramids if p.levels[0] in selected}
        self.messages += [_regeneration_message(p) for p in self.regenerated]
        written = set(selected).union(*(p.levels[1:] for p in self.regenerated))
        self.leftovers = self._leftovers(files, written, options)
        self.manifest_extra.update(self.leftovers.manifest_extra())

    def _leftovers(self, files: list[str], written: set[str], options: FormatOptions) -> leftovers.Leftovers:
        """Decides from the metadata what is written besides the perturbed arrays (leftovers.py):
        the arrays (left_out: their paths) and files (left_out_files) left out, and each
        node's attributes where some are left out (attributes: the node's path -> the rest)."""
        left = leftovers.Leftovers(list(options.keep))
        left.considered(_display(name) for name in written)
        roles = dict.fromkeys(_grid_mapping_arrays(self.handles), leftovers.GRID_MAPPING)
        roles.update(dict.fromkeys(_coordinate_arrays(self.handles, self.group_handles), leftovers.COORDINATE))
        records = {job.row_dimension for job in self.jobs if job.row_dimension is not None}
        roles.update(dict.fromkeys(_record_coordinates(self.handles, self.group_handles, records),
                                   leftovers.RECORD_COORDINATE))
        self.left_out: set[str] = set()
        for path, array in self.handles.items():
            if path in written:
                continue
            name, fields = _display(path), {"shape": list(array.shape), "dtype": str(array.dtype)}
            if left.kept(name):
                left.copied(name, "array", leftovers.KEPT, **fields)
            elif roles.get(path) == leftovers.RECORD_COORDINATE and array.dtype.kind in "iuf":
                left.drop(name, "array", leftovers.RECORD_COORDINATE_REASON)
                self.left_out.add(path)
            elif path in roles and array.dtype.kind in "iuf":
                left.copied(name, "array", roles[path], **fields)
            else:
                left.drop(name, "array", "numbers not chosen for perturbation (--dataset perturbs them)"
                          if array.dtype.kind in "iuf" else f"holds {leftovers.not_numbers(array.dtype)}, "
                          "which tldp does not perturb")
                self.left_out.add(path)
        self.left_out_files: set[str] = set()
        for rel, owner in _not_zarr(files, self.nodes).items():
            if owner in self.left_out:
                continue  # left out with its array
            if owner not in written and left.kept(rel):
                left.copied(rel, "file", leftovers.KEPT)
                continue
            self.left_out_files.add(rel)
            left.drop(rel, "file", "neither Zarr metadata nor chunks, " + (
                "inside a perturbed array" if owner in written else "not perturbed"))
        self.attributes: dict[str, dict[str, Any]] = {}
        for path, node in {**self.group_handles, **self.handles}.items():
            if path not in self.left_out:
                attrs = node.attrs.asdict()
                group = posixpath.normpath("/" + path)
                group = group if path in self.group_handles else posixpath.dirname(group)
                kept = _unnamed(self.handles, group, self.left_out, {key: value for key, value in attrs.items()
                                                                   if left.attribute(_display(path), key)})
                kept = _without_ngff_names(_display(path), kept, left)
                if kept != attrs:
                    self.attributes[path] = kept
        left.check(self.path)
        return left

    def _select(self, requested: list[str]) -> list[str]:
        arrays = self.handles
        listing = ", ".join(_display(n) for n in arrays) or "none"
        if requested:
            names: list[str] = []
            groups = {n.path for n in self.nodes if n.kind == "group"}
            for item in requested:
                name = self._full_resolution(item.strip("/"))
                if name not in arrays:
                    what = "is a group, not an array" if name in groups else "does not exist"
                    raise InputError(f"{self.path}: Zarr array {item} {what} (arrays: {listing})")
                self._check(name)
                if name not in names:
                    names.append(name)
            left_raw = [p.name for p in self.pyramids if p.levels[0] not in names]
            if left_raw:
                raise UsageError(
                    f"{self.path}: --dataset leaves multiscale image{'s' if len(left_raw) > 1 else ''} "
                    f"{', '.join(left_raw)} unperturbed, and an image of the store (labels included) is data "
                    f"of the same subject; add --dataset {' --dataset '.join(left_raw)}, or leave out "
                    "--dataset to perturb them all")
            return names
        if "" in arrays:  # a single-array store
            self._check("")
            return [""]
        if self.pyramids:
            return self._all_images()
        numeric = {n: tuple(a.shape) for n, a in arrays.items() if a.dtype.kind in "iuf"}
        coordinates = _coordinate_arrays(arrays, self.group_handles)
        left_out = [n for n, shape in numeric.items() if n in coordinates and len(shape) >= 2]
        numeric = {n: shape for n, shape in numeric.items() if n not in coordinates}
        names, message = default_selection(self.path, numeric, "array")
        for name in names:
            self._check(name)
        self.messages.append(message)
        if left_out:
            self.messages.append(f"left out the coordinate arrays {', '.join(left_out)} "
                                 "(name them with --dataset to perturb them)")
        return names

    def _full_resolution(self, name: str) -> str:
        """A multiscale image's group or any of its levels stands for its full resolution
        (the lower levels are regenerated from it)."""
        for pyramid in self.pyramids:
            if name == pyramid.group or (name in pyramid.levels[1:]):
                if name != pyramid.group:
                    self.messages.append(f"{name} is a lower level of multiscale image {pyramid.name}: "
                                         f"perturbing its full resolution {pyramid.levels[0]} instead")
                return pyramid.levels[0]
        return name

    def _all_images(self) -> list[str]:
        """Without --dataset, in a store with multiscale images: the full resolution of every
        image (labels included) and every other numeric array of two or more dimensions."""
        lower = {level for p in self.pyramids for level in p.levels[1:]}
        names = [p.levels[0] for p in self.pyramids]
        names += [n for n, a in self.handles.items() if n not in lower and n not in names
                  and a.dtype.kind in "iuf" and a.ndim >= 2 and 0 not in a.shape]
        for name in names:
            self._check(name)
        self.messages.append(f"perturbing {', '.join(names)} of {self.path.name}: every multiscale image's "
                             "full resolution (choose with --dataset)")
        return names

    def _check(self, name: str) -> None:
        array = self.handles[name]
        check_numeric_dtype(self.path, array.dtype, f"array {_display(name)}")
        if array.ndim == 0 or array.shape[0] == 0:
            raise InputError(f"{self.path}: array {_display(name)} has no records "
                             f"(shape {tuple(array.shape)}; axis 0 indexes records)")

    def _job(self, name: str) -> ArrayJob:
        array = self.handles[name]
        shape = tuple(array.shape)
        encoding, row_dimension = None, None  # multiscale images are images, not CF variables
        if not any(name in p.levels for p in self.pyramids):
            encoding = _cf_encoding(f"{self.path}: array {_display(name)}", array)
            dimensions = _dimension_names(array)
            if dimensions:  # xarray's dimensions are named within their group
                row_dimension = posixpath.join("/" + posixpath.dirname(name), dimensions[0])
        if encoding is not None:
            self.encodings[_display(name)] = encoding
            self.messages += cf.messages(_display(name), array.dtype, encoding)
        return ArrayJob(
            name=_display(name), shape=shape, dtype=encoding.dtype if encoding else array.dtype,
            read=_Records(self.path, name, self.zarr_format, encoding,
                          zarr_chunks.of_array(array)),
            source={"path": str(self.path), "format": NAME, "dataset": _display(name),
                    "shape": list(shape), "dtype": str(array.dtype)},
            chunk_records=(array.shards or array.chunks)[0],
            row_dimension=row_dimension,
            markers=encoding.labelled() if encoding else (),
            aliases=self._aliases(name),
        )

    def _aliases(self, name: str) -> tuple[str, ...]:
        """The names that stand for a multiscale image's full resolution in --range NAME=LO:HI,
        as in --dataset (_full_resolution): its group (a group with several images: the
        first) and its lower levels."""
        for pyramid in self.pyramids:
            if pyramid.levels[0] == name:
                first = next(p for p in self.pyramids if p.group == pyramid.group) is pyramid
                return ((pyramid.group,) if pyramid.group and first else ()) + pyramid.levels[1:]
        return ()

    def arrays(self) -> list[ArrayJob]:
        return self.jobs

    def markers_are_data(self, data: dict[str, tuple[tuple[str, float], ...]]) -> None:
        cf.take_as_data(self.jobs, self.encodings, data)

    def missing_fill(self, fills: dict[str, float]) -> None:
        cf.fill_missing(self.jobs, self.encodings, fills)

    def close(self) -> None:
        self.store.close()


def _regeneration_message(pyramid: _Pyramid) -> str:
    how = "the first element" if pyramid.method == NEAREST else "the mean"
    note = ""
    if pyramid.declared and pyramid.method not in pyramid.declared.lower():
        note = f" (its metadata declares {pyramid.declared}, which tldp does not reproduce)"
    return (f"multiscale image {pyramid.name}: levels {', '.join(pyramid.levels[1:])} are regenerated from "
            f"the perturbed {pyramid.levels[0]} ({how} of each block of the scale factors{note})")


def open_reader(path: Path, options: FormatOptions) -> ZarrReader:
    return ZarrReader(path, options)


def _json_fill(value: np.generic) -> int | float | str:
    """A fill value as Zarr writes it: an integer type's as a JSON integer (the Zarr 3
    spec allows no fraction there), a float's as a number, NaN and the infinities as
    strings."""
    if value.dtype.kind in "iub":
        return value.item()
    if np.isnan(value):
        return "NaN"
    if np.isinf(value):
        return "Infinity" if float(value) > 0 else "-Infinity"
    return float(value)


# Codecs that store other values than those written (quantize, round bits, scale to a
# fixed precision, change the stored type, lossy compression), by their numcodecs id,
# without a "numcodecs." or "imagecodecs_" prefix. Dropped from perturbed arrays, so
# the noisy values are stored exactly; the rest (compressors, shuffle, delta,
# checksums) are kept. ZFP and the image codecs are lossless only at some settings.
LOSSY_CODECS = ("quantize", "bitround", "fixedscaleoffset", "astype", "zfpy", "zfp", "sz3", "sperr",
                "lerc", "jpeg", "jpeg8", "jpeg2k", "jpegls", "jpegxl", "jpegxr", "webp", "avif", "heif")
# Of those, the ones that turn the array into bytes (Zarr 3): replaced by "bytes".
_LOSSY_SERIALIZERS = ("zfpy", "zfp", "sz3", "sperr", "lerc", "jpeg", "jpeg8", "jpeg2k", "jpegls",
                      "jpegxl", "jpegxr", "webp", "avif", "heif")


def _codec_id(codec: dict[str, Any]) -> str:
    name = str(codec.get("name") or codec.get("id") or "")
    for prefix in ("numcodecs.", "imagecodecs_"):
        name = name.removeprefix(prefix)
    return name.lower()


def _check_codec(codec: dict[str, Any], config: dict[str, Any], dtype: np.dtype, where: str) -> None:
    """Filters bound to a dtype (delta, ...) cannot be carried over to another output
    dtype; refuse rather than drop them or change what they mean."""
    for key in ("dtype", "astype"):
        if key not in config:
            continue
        try:
            same = np.dtype(config[key]) == dtype
        except TypeError:
            same = False
        if not same:
            name = codec.get("name") or codec.get("id")
            raise InputError(f"{where} uses the {name} filter for {config[key]} data, which "
                             f"cannot apply to the {dtype} output; re-encode the array without it")


# Compressors whose level only trades CPU for size, by numcodecs id, and the key of the
# level in their configuration. Noise compresses no better at a high level than at 1
# (int16 noise of scale 256: 0.774 of its size with zstd at levels 1 and 3 alike; float
# noise hardly at all), so perturbed arrays are written at level 1 at most.
_LEVELS = {"zstd": "level", "blosc": "clevel", "gzip": "level", "zlib": "level"}
FAST_LEVEL = 1
_ZSTD_DEFAULT = 3  # zstd's level 0 means its default level


def _fast_level(codec: dict[str, Any], config: dict[str, Any], levels: list[dict[str, Any]]) -> None:
    """Lowers a compressor's level in `config` (in place) to FAST_LEVEL, noted in `levels`;
    levels at or below it (and zstd's fast negative levels) stay."""
    key = _LEVELS.get(_codec_id(codec))
    if key is None:
        return
    level = config.get(key)
    if not isinstance(level, int) or isinstance(level, bool):
        return
    effective = _ZSTD_DEFAULT if _codec_id(codec) == "zstd" and level == 0 else level
    if effective > FAST_LEVEL:
        config[key] = FAST_LEVEL
        levels.append({"codec": _codec_id(codec), "input_level": level, "output_level": FAST_LEVEL})


def _output_codecs(codecs: list, dtype: np.dtype, where: str, dropped: list[str],
                   levels: list[dict[str, Any]]) -> list:
    """Zarr 3 codecs for the output: lossy ones dropped (named in `dropped`), compression
    levels lowered (noted in `levels`), the rest checked against the output dtype."""
    result = []
    for entry in codecs:
        codec: dict[str, Any] = {"name": entry} if isinstance(entry, str) else copy.deepcopy(entry)
        config = codec.get("configuration") or {}
        if _codec_id(codec) in LOSSY_CODECS:
            dropped.append(codec["name"])  # Zarr 3 codecs have one (zarr-python opened the array)
            if _codec_id(codec) in _LOSSY_SERIALIZERS:
                result.append({"name": "bytes", "configuration": {"endian": "little"}})
            continue
        _check_codec(codec, config, dtype, where)
        if codec.get("name") == "bytes" and "endian" not in config:
            codec["configuration"] = {**config, "endian": "little"}  # required for multi-byte types
        if codec.get("name") == "blosc" and "typesize" in config:
            config["typesize"] = dtype.itemsize  # the shuffle's element size, as zarr-python sets it
        if codec.get("name") == "sharding_indexed":
            config["codecs"] = _output_codecs(config.get("codecs", []), dtype, where, dropped, levels)
        _fast_level(codec, config, levels)
        result.append(codec)
    return result


def _output_metadata(node: _Node, fill_value: Any, zarr_format: ZarrFormat, dtype: np.dtype,
                     where: str) -> tuple[dict[str, Any], list[str], list[dict[str, Any]]]:
    """A perturbed array's metadata for the output dtype, the lossy codecs dropped and the
    compression levels lowered."""
    meta = copy.deepcopy(node.meta)
    dropped: list[str] = []
    levels: list[dict[str, Any]] = []
    # The fill value in the output dtype as the missing-data markers are (cf.output_marker):
    # where the dtype cannot hold it, the least value (or NaN), never a wrapped one
    # (uint32 4294967295 as int16 would be -1, which noisy values take).
    fill = None if fill_value is None else _json_fill(cf.output_marker(fill_value, dtype))
    if zarr_format == 3:
        meta["data_type"] = dtype.name
        meta["fill_value"] = fill
        meta["codecs"] = _output_codecs(meta.get("codecs", []), dtype, where, dropped, levels)
    else:
        meta["dtype"] = dtype.str
        meta["fill_value"] = fill
        filters = []
        for codec in meta.get("filters") or []:
            if _codec_id(codec) in LOSSY_CODECS:
                dropped.append(codec.get("id"))
            else:
                _check_codec(codec, codec, dtype, where)
                filters.append(codec)
        meta["filters"] = filters or None
        compressor = meta.get("compressor")
        if compressor and _codec_id(compressor) in LOSSY_CODECS:
            dropped.append(compressor.get("id"))
            meta["compressor"] = None
        elif compressor:
            _check_codec(compressor, compressor, dtype, where)
            _fast_level(compressor, compressor, levels)
    return meta, dropped, levels


@dataclass
class _Blocks:
    """Writes blocks of records through zarr. Picklable (the open arrays are not pickled:
    each process opens its own), so Dask workers can write their blocks themselves.
    Blocks must cover whole shards (pipeline.block_bounds): two writers filling
    different chunks of one shard would lose one of them."""

    root: Path
    source: Path  # the input, named in messages
    paths: dict[str, str]  # job name -> the array's path in the store
    zarr_format: ZarrFormat
    dtype: np.dtype
    missing: dict[str, list[tuple]] = field(default_factory=dict)  # job name -> CF (stored, output) markers
    bounds: dict[str, tuple[float, float, float | None]] = field(default_factory=dict)  # FormatOptions.value_bounds

    def __post_init__(self) -> None:
        self._arrays: dict[str, Any] = {}
        self.digests: dict[Path, str] = {}  # chunk files written here; in Dask workers it stays empty
        # Chunk files go to disk from a thread of their own, so that the workers go on
        # computing while the direct writes wait for the disk; Dask workers write their
        # own (None).
        self._disk: Background | None = Background(lambda item: zarr_chunks.write_files(*item),
                                                   f"tldp write {self.root.name}", depth=8)
        self._on_disk: dict[tuple[str, int], Future] = {}  # by (job name, first record) of the block

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k not in ("_arrays", "digests", "_disk", "_on_disk")}

    def __setstate__(self, state):
        self.__dict__.update(state, _arrays={}, digests={}, _disk=None, _on_disk={})

    def array(self, job_name: str):
        """(the open array, its plain chunk files' layout or None)"""
        if job_name not in self._arrays:
            array = _open(LocalStore(self.root), self.source, self.paths[job_name], "array",
                          self.zarr_format, mode="r+")
            chunk_files = zarr_chunks.of_array(array)
            if chunk_files is not None:
                chunk_files.codec  # built now: an unknown codec fails before any block runs
            self._arrays[job_name] = array, chunk_files
        return self._arrays[job_name]

    def open_arrays(self) -> None:
        """Opens every array now, so that a bad codec fails before any block runs."""
        try:
            for job_name in self.paths:
                self.array(job_name)
        except BaseException:
            self.flush()
            raise

    def __call__(self, job: ArrayJob, start: int, block: np.ndarray) -> tuple[int, bool]:
        """Writes the block; returns how many noisy values it moved off missing-data markers,
        and whether the input held missing values there."""
        array, chunk_files = self.array(job.name)
        block = np.asarray(block, dtype=self.dtype)
        kept = 0, False
        if job.name in self.missing:
            block = block.copy()  # the caller's block is not ours to change
            kept = self._keep_missing(job, start, block)
        try:
            if chunk_files is None or not chunk_files.aligned(start, len(block)):
                array[start:start + len(block)] = block
                return kept
            directory = self.root / self.paths[job.name]
            files = chunk_files.encoded(directory, start, block)
        except OSError:
            raise
        except Exception as exc:
            raise InputError(f"{self.source}: cannot encode array {job.name} as {self.dtype} with "
                             f"its codecs ({reason_of(exc)})") from None
        self.digests.update((path, hashlib.sha256(data).hexdigest()) for path, data in files)
        if self._disk is None:
            zarr_chunks.write_files(directory, files)
        else:
            self._on_disk[job.name, start] = self._disk.put((directory, files))
        return kept

    def wait(self, job_name: str, start: int) -> None:
        """Returns once the block's chunk files are written; raises the failure to write them."""
        on_disk = self._on_disk.pop((job_name, start), None)
        if on_disk is not None:
            on_disk.result()

    def flush(self) -> None:
        """Waits for every chunk file queued; raises the failure to write them, if any."""
        if self._disk is not None:
            self._disk.close()

    def _keep_missing(self, job: ArrayJob, start: int, block: np.ndarray) -> tuple[int, bool]:
        """Puts the markers back where the input is missing (the block holds noise there) and
        moves the noisy values that equal a marker off it (cf.move_off_markers)."""
        records = job.read
        assert isinstance(records, _Records)  # the input's: markers come from its encodings
        stored = records.stored(start, start + len(block))
        return cf.keep_missing(block, stored, self.missing[job.name],
                               self.bounds.get(job.name) or (-math.inf, math.inf, None))


def _downsample(block: np.ndarray, factors: tuple[int, ...], shape: tuple[int, ...], method: str,
                dtype: np.dtype) -> np.ndarray:
    """One region of a lower level from the block of the level above that covers it (which
    starts on a multiple of the factors): the first element of each block of factors
    (NEAREST), or their mean (MEAN; a block cut by the array's edge averages the elements
    it has), rounded to the nearest integer for integer output."""
    if method == NEAREST:
        return np.asarray(block[tuple(slice(0, n * f, f) for n, f in zip(shape, factors))], dtype=dtype)
    block = block[tuple(slice(0, n * f) for n, f in zip(shape, factors))]
    padding = [(0, n * f - s) for n, f, s in zip(shape, factors, block.shape)]
    padded = np.pad(block.astype(np.float64), padding)
    sums = padded.reshape([d for n, f in zip(shape, factors) for d in (n, f)]).sum(
        axis=tuple(range(1, 2 * len(shape), 2)))
    counts = np.ones(shape)
    for axis, (n, f, s) in enumerate(zip(shape, factors, block.shape)):
        per_axis = np.minimum(f, s - np.arange(n) * f)
        counts = counts * per_axis.reshape([-1 if a == axis else 1 for a in range(len(shape))])
    mean = sums / counts
    return (np.rint(mean) if dtype.kind in "iu" else mean).astype(dtype)


def _regions(shape: tuple[int, ...], tile: tuple[int, ...]):
    """The regions of an array, one per tile (chunk or shard) of its grid."""
    starts = [range(0, n, t) for n, t in zip(shape, tile)]
    for corner in itertools.product(*starts):
        yield tuple(slice(c, min(c + t, n)) for c, t, n in zip(corner, tile, shape))


def _regeneration_step(pyramid: _Pyramid) -> str:
    """The manifest's postprocessing entry for one multiscale image."""
    how = "the first element" if pyramid.method == NEAREST else "the mean"
    return (f"regenerate the lower levels {', '.join(pyramid.levels[1:])} of multiscale image {pyramid.name} "
            f"from the perturbed full resolution {pyramid.levels[0]}: {how} of each block of the scale "
            "factors of the level above (multiscale_images; post-processing, no privacy cost)")


def _regenerate(root: Path, source: Path, pyramid: _Pyramid, zarr_format: ZarrFormat, dtype: np.dtype) -> None:
    """Writes every lower level of `pyramid` in the output from the level above it, one
    tile (shard, or chunk) at a time: memory holds one tile and the block above it."""
    store = LocalStore(root)
    above = _open(store, source, pyramid.levels[0], "array", zarr_format)
    for path, factors in zip(pyramid.levels[1:], pyramid.factors):
        for leftover in (p for p in (root / path).iterdir() if p.name not in METADATA_FILES):
            # An interrupted run's chunks: one that is now all fill value would not be rewritten.
            if leftover.is_dir():
                shutil.rmtree(leftover)
            else:
                leftover.unlink()
        level = _open(store, source, path, "array", zarr_format, mode="r+")
        for region in _regions(tuple(level.shape), level.shards or level.chunks):
            covering = tuple(slice(r.start * f, min(r.stop * f, n))
                             for r, f, n in zip(region, factors, above.shape))
            shape = tuple(r.stop - r.start for r in region)
            level[region] = _downsample(np.asarray(above[covering]), factors, shape, pyramid.method, dtype)
        above = level


def _describe_multiscale(root: Path, pyramid: _Pyramid, zarr_format: ZarrFormat) -> None:
    """The output's multiscales entry says how its lower levels were made (NGFF's
    type and metadata fields)."""
    group = zarr.open_group(LocalStore(root), path=pyramid.group, mode="r+", zarr_format=zarr_format,
                            use_consolidated=False)
    attrs: dict[str, Any] = copy.deepcopy(group.attrs.asdict())  # any JSON
    entries = attrs["ome"]["multiscales"] if pyramid.in_ome else attrs["multiscales"]
    entries[pyramid.index]["type"] = pyramid.method
    entries[pyramid.index]["metadata"] = {
        "method": "tldp_cli", "description": (
            f"levels {', '.join(pyramid.levels[1:])} regenerated from the perturbed {pyramid.levels[0]}: "
            + ("the first element" if pyramid.method == NEAREST else "the mean")
            + " of each block of the scale factors of the level above")}
    group.attrs.put(attrs)


def _raw_statistics(attrs: dict[str, Any]) -> list[str]:
    """The fields of an image group's NGFF metadata that other tools compute from the raw
    values: the display windows of its omero channels (min, max, start, end) and the
    per-label properties of a label image (areas, intensities, ...)."""
    ngff = attrs["ome"] if isinstance(attrs.get("ome"), dict) else attrs
    found = []
    omero = ngff.get("omero")
    if isinstance(omero, dict) and any(isinstance(c, dict) and "window" in c
                                       for c in omero.get("channels") or []):
        found.append("omero channel windows")
    label = ngff.get("image-label")
    if isinstance(label, dict) and "properties" in label:
        found.append("image-label properties")
    return found


def _declared_window(bounds: tuple[float, float, float | None] | None,
                     dtype: np.dtype) -> dict[str, float] | None:
    """An omero channel window of the declared range (public, in the manifest), in place of
    the one computed from the raw values: NGFF 0.4 validators require a window. Integer
    output holds lo..hi-1 (the range is half-open under integer noise)."""
    if bounds is None:
        return None
    lo, hi = bounds[0], bounds[1]
    if dtype.kind in "iu":
        lo, hi = int(lo), int(hi) - 1
    return {"min": lo, "max": hi, "start": lo, "end": hi}


def _drop_raw_statistics(root: Path, pyramid: _Pyramid, zarr_format: ZarrFormat,
                         window: dict[str, float] | None) -> None:
    """Replaces the omero channel windows with `window` (or drops them, when None) and drops
    the label properties."""
    group = zarr.open_group(LocalStore(root), path=pyramid.group, mode="r+", zarr_format=zarr_format,
                            use_consolidated=False)
    attrs: dict[str, Any] = copy.deepcopy(group.attrs.asdict())  # any JSON
    ngff = attrs["ome"] if isinstance(attrs.get("ome"), dict) else attrs
    for channel in (ngff.get("omero") or {}).get("channels") or []:
        if isinstance(channel, dict) and "window" in channel:
            if window is None:
                del channel["window"]
            else:
                channel["window"] = dict(window)
    if isinstance(ngff.get("image-label"), dict):
        ngff["image-label"].pop("properties", None)
    group.attrs.put(attrs)


def _statistics_step(pyramid: _Pyramid, fields: list[str], window: dict[str, float] | None) -> str:
    """The manifest's postprocessing entry for _drop_raw_statistics."""
    steps = []
    if "omero channel windows" in fields and window is not None:
        steps.append(f"replace the omero channel windows of multiscale image {pyramid.name} with the declared "
                     f"range [{window['min']}, {window['max']}]")
        fields = [f for f in fields if f != "omero channel windows"]
    if fields:
        steps.append(f"drop the {' and the '.join(fields)} of multiscale image {pyramid.name}")
    return "; ".join(steps) + ": they are computed from the raw values"


def _copy_store(reader: ZarrReader, root: Path, metadata: dict[str, dict], attributes: dict[str, dict],
                perturbed: set[str]) -> None:
    """Copies the input store to `root` but the perturbed arrays' chunks and what the reader
    leaves out (arrays, files: formats.leftovers), then writes the rewritten metadata
    (`metadata`, by node path) and Zarr 2 attributes (`attributes`), with every other node's
    attributes less those left out."""
    left_out = reader.left_out | reader.left_out_files

    def skip(directory: str, entries: list[str]) -> list[str]:
        rel = Path(directory).relative_to(reader.path).as_posix()
        rel = rel if rel != "." else ""
        return [e for e in entries if (rel in metadata and e not in METADATA_FILES)
                or posixpath.join(rel, e) in left_out]

    # The reader refused links; one made since is copied as a link, not followed. Contents and
    # modes only: the input's times can date a recording, so the copies get the run's time
    # (copytree gives folders the input's; they are reset below).
    shutil.copytree(reader.path, root, ignore=skip, symlinks=True, copy_function=shutil.copy)
    for directory, _, _ in os.walk(root):
        os.utime(directory)
    nodes = {n.path: n for n in reader.nodes}
    for path, attrs in reader.attributes.items():
        if path in perturbed:
            continue  # in `metadata` or `attributes` already
        if reader.zarr_format == 2:
            attributes[path] = attrs
        elif path in metadata:  # a regenerated level
            metadata[path]["attributes"] = attrs
        else:
            metadata[path] = {**nodes[path].meta, "attributes": attrs}
    for path, meta in metadata.items():
        name = "zarr.json" if reader.zarr_format == 3 else ".zarray"  # (Zarr 2: arrays only here)
        (root / path / name).write_text(json.dumps(meta, indent=2), encoding="utf-8")
    for path, attrs in attributes.items():  # Zarr 2 keeps attributes in a file of their own
        (root / path / ".zattrs").write_text(json.dumps(attrs, indent=2), encoding="utf-8")


# Zarr's LocalStore writes through temporary files named like this; a killed run leaves them.
_STORE_TEMP = re.compile(r"\.[0-9a-f]{32}\.partial$")


class ZarrWriter(Writer):
    def __init__(self, reader: ZarrReader, tmp_path: Path, dtype: np.dtype, reopen: bool = False,
                 bounds: dict[str, tuple[float, float, float | None]] | None = None):
        self.root = tmp_path
        self.dtype = np.dtype(dtype)
        self.messages: list[str] = []  # a line added in finish() is shown too
        self.postprocessing: list[str]
        self.manifest_extra: dict[str, Any]
        if tmp_path.resolve().is_relative_to(reader.path.resolve()):
            raise OutputError(f"{tmp_path.parent}: the output cannot go inside the input store "
                              f"{reader.path}")
        nodes = {n.path: n for n in reader.nodes}
        names = {job.name: job.name.strip("/") for job in reader.jobs}
        # Rewritten before anything is copied, so an impossible filter fails fast.
        metadata, dropped, lowered = {}, {}, {}
        for job_name, path in names.items():
            metadata[path], lossy, levels = _output_metadata(
                nodes[path], _output_fill(reader.handles[path], reader.encodings.get(job_name)),
                reader.zarr_format, self.dtype, f"{reader.path}: array {_display(path)}")
            if lossy:
                dropped[job_name] = lossy
            if levels:
                lowered[job_name] = levels
        for path in (level for p in reader.regenerated for level in p.levels[1:]):
            metadata[path], lossy, levels = _output_metadata(nodes[path], reader.handles[path].fill_value,
                                                             reader.zarr_format, self.dtype,
                                                             f"{reader.path}: array {_display(path)}")
            if lossy:
                dropped[path] = lossy
            if levels:
                lowered[path] = levels
        self.postprocessing, self.manifest_extra = dropped_filters(dropped)
        if lowered:  # the values are the same at any level: only the CPU spent differs
            self.manifest_extra["codec_levels"] = lowered
        attributes = self._cf_attributes(reader, names, metadata)
        self.pyramids = reader.regenerated
        if self.pyramids:
            self.postprocessing = [*self.postprocessing, *(_regeneration_step(p) for p in self.pyramids)]
            self.manifest_extra = {**self.manifest_extra,
                                   "multiscale_images": [p.describe() for p in self.pyramids]}
        job_of = {path: job_name for job_name, path in names.items()}
        windows = {p: _declared_window((bounds or {}).get(job_of.get(p.levels[0], "")), self.dtype)
                   for p in reader.raw_statistics}
        self.postprocessing += [_statistics_step(p, fields, windows[p])
                                for p, fields in reader.raw_statistics.items() if fields]
        self.messages += [f"array {name}: written without the input's lossy "
                          f"filter{'s' if len(lossy) > 1 else ''} {', '.join(lossy)}, so the noisy "
                          "values are stored exactly" for name, lossy in dropped.items()]
        meta_file = self.meta_file = "zarr.json" if reader.zarr_format == 3 else ".zarray"
        if reopen:
            for path, meta in metadata.items():
                try:
                    same = json.loads((tmp_path / path / meta_file).read_text(encoding="utf-8")) == meta
                except (OSError, UnicodeDecodeError, ValueError):
                    same = False
                if not same:
                    raise OutputError(f"{tmp_path}: the partial output does not match this input "
                                      f"(array {_display(path)}); remove it to start over")
            for leftover in [p for p in tmp_path.rglob("*") if _STORE_TEMP.search(p.name)]:
                leftover.unlink()
        else:
            _copy_store(reader, tmp_path, metadata, attributes, set(names.values()))
            for pyramid in self.pyramids:
                _describe_multiscale(tmp_path, pyramid, reader.zarr_format)
            for pyramid, fields in reader.raw_statistics.items():
                if fields:
                    _drop_raw_statistics(tmp_path, pyramid, reader.zarr_format, windows[pyramid])
        self.blocks = _Blocks(tmp_path, reader.path, names, reader.zarr_format, self.dtype, self.missing,
                              bounds or {})
        # (job name, first record) -> noisy values moved off its markers, per block written
        self.moved: dict[tuple[str, int], int] = {}
        self.held: dict[tuple[str, int], bool] = {}  # ... whether its input held missing values (stderr only)
        self.blocks.open_arrays()
        self.consolidate = [n.path for n in reader.nodes if n.consolidated]
        self.zarr_format = reader.zarr_format

    def _cf_attributes(self, reader: ZarrReader, names: dict[str, str],
                       metadata: dict[str, dict]) -> dict[str, dict]:
        """Rewrites the perturbed arrays' CF attributes (cf.describe tells the manifest): in
        their metadata (Zarr 3); returns the .zattrs to write (Zarr 2)."""
        self.missing: dict[str, list[tuple]] = {}
        dropped_attrs, zattrs = {}, {}
        for job_name, path in names.items():
            array = reader.handles[path]
            attrs, dropped, pairs = _cf_output_attrs(f"{reader.path}: array {job_name}", array,
                                                     reader.attributes.get(path, array.attrs.asdict()),
                                                     reader.encodings.get(job_name), self.dtype)
            if dropped:
                dropped_attrs[job_name] = dropped
            if pairs:
                self.missing[job_name] = pairs
            if attrs != array.attrs.asdict():
                if reader.zarr_format == 3:
                    metadata[path]["attributes"] = attrs
                else:
                    zattrs[path] = attrs
        steps, extra = cf.describe(reader.encodings, {name: str(reader.handles[names[name]].dtype)
                                                      for name in reader.encodings},
                                   dropped_attrs, self.missing, self.dtype)
        self.postprocessing += steps
        self.manifest_extra = {**self.manifest_extra, **extra}
        return zattrs

    def write(self, job: ArrayJob, start: int, block: np.ndarray) -> None:
        # One key per block: thread-safe.
        self.moved[job.name, start], self.held[job.name, start] = self.blocks(job, start, block)

    def block_written(self, job: ArrayJob, start: int, stop: int) -> None:
        self.blocks.wait(job.name, start)  # written before --resume journals it

    def block_note(self, job: ArrayJob, start: int) -> dict[str, Any]:
        if (job.name, start) not in self.moved:
            return {}
        return {"moved_off_markers": self.moved[job.name, start], "held_missing": self.held[job.name, start]}

    def resumed(self, notes: dict[tuple[str, int], dict[str, Any]]) -> None:
        """The blocks an interrupted run wrote count in moved_off_markers (and the missing
        values they held in the message about them) as well."""
        for key, note in notes.items():
            if "moved_off_markers" in note:
                self.moved[key] = note["moved_off_markers"]
                self.held[key] = bool(note.get("held_missing"))

    def digests(self) -> dict[Path, str]:
        return dict(self.blocks.digests)

    def block_writer(self) -> _Blocks | None:
        """None where CF markers are kept: the blocks come back, so that the moves are counted."""
        return None if self.missing else self.blocks

    def finish(self) -> None:
        """Wait for the chunk files and check that each array's metadata is still there,
        regenerate the lower levels of multiscale images from the perturbed full
        resolution, then rebuild consolidated metadata; only a complete output is worth it."""
        self.blocks.flush()  # the lower levels are read from the chunk files
        for path in self.blocks.paths.values():
            if not (self.root / path / self.meta_file).is_file():  # zarr-python makes removed folders again
                raise OutputError(f"{shown(self.root / path)}: its metadata was removed while tldp wrote "
                                  "it (another program?); nothing was written")
        for chunk in self.blocks.digests:  # the chunk files this process wrote
            if not chunk.is_file():
                raise removed_during_run(chunk)
        for pyramid in self.pyramids:
            _regenerate(self.root, self.blocks.source, pyramid, self.zarr_format, self.dtype)
        if self.consolidate:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "consolidated metadata is not in the v3 spec"
                # Nested groups first, the root last.
                for path in sorted(self.consolidate, key=lambda p: (p == "", -p.count("/"))):
                    zarr.consolidate_metadata(LocalStore(self.root), path=path,
                                              zarr_format=self.zarr_format)
        cf.count_moves(self.manifest_extra, [(name, count) for (name, _), count in self.moved.items()])
        held = sorted({name for (name, _), held in self.held.items() if held})
        if held:
            self.messages.append(cf.missing_message(held))

    def close(self) -> list[Path]:
        """Waits for the chunk files (each flushed to disk as it is written), then flushes
        every other file: metadata, files copied, chunks written through zarr-python or
        by another process."""
        self.blocks.flush()
        return flushed_files(self.root, self.blocks.digests)


def create_writer(reader: ZarrReader, tmp_path: Path, dtype: np.dtype,
                  options: FormatOptions) -> ZarrWriter:
    return ZarrWriter(reader, tmp_path, dtype, bounds=options.value_bounds)


def reopen_writer(reader: ZarrReader, tmp_path: Path, dtype: np.dtype,
                  options: FormatOptions) -> ZarrWriter:
    """The writer of an output an interrupted run began: its blocks are kept (--resume)."""
    return ZarrWriter(reader, tmp_path, dtype, reopen=True, bounds=options.value_bounds)


COEFFICIENT_DIMENSION = "coefficient"


class ZarrCoefficientWriter(ZarrWriter):
    """--store coefficients: the store the records writer makes (the same groups, kept
    arrays, attributes and files), but each perturbed array holds its records' released
    coefficients, (records, k) in the engine's dtype, chunked along axis 0 as the input (no
    shards), with none of the input array's attributes (its units and fill values describe
    records). Where the array names its dimensions (xarray), axis 0 keeps its name and axis 1
    is `coefficient`, and its coordinates attribute names only the arrays written on the
    record dimension alone (cf.coefficient_coordinates). Missing values cannot be marked in
    coefficients, and multiscale images (OME-Zarr), whose lower levels are images, are refused."""

    def __init__(self, reader: ZarrReader, jobs: list[ArrayJob], tmp_path: Path, dtype: np.dtype):
        if any(job.name.strip("/") in p.levels for p in reader.pyramids for job in jobs):
            raise UsageError(f"{reader.path}: --store coefficients applies to arrays of records, not to "
                             "multiscale images (OME-Zarr), whose lower levels are images")
        super().__init__(reader, tmp_path, dtype)
        self.blocks.flush()  # the records-shaped arrays' writer: replaced below
        store = LocalStore(tmp_path)
        perturbed = {j.name.strip("/") for j in jobs}
        for job in jobs:
            path = job.name.strip("/")
            names = _dimension_names(reader.handles[path])
            dimensions = None if names is None else [names[0], COEFFICIENT_DIMENSION]
            if dimensions and posixpath.join(posixpath.dirname(path), COEFFICIENT_DIMENSION) in reader.handles:
                raise UsageError(f"{reader.path}: --store coefficients names the new dimension "
                                 f"{COEFFICIENT_DIMENSION}, which an array beside {_display(path)} has as its name")
            attributes: dict[str, Any] = dict(_coefficient_coordinates(reader, path, perturbed)) if dimensions else {}
            if dimensions and reader.zarr_format == 2:
                attributes["_ARRAY_DIMENSIONS"] = dimensions
            try:
                zarr.create_array(
                    store=store, name=path, shape=job.shape, dtype=self.dtype, fill_value=np.nan,  # (V is never NaN)
                    chunks=(min(job.records, job.chunk_records or job.records), job.shape[1]),
                    zarr_format=reader.zarr_format, overwrite=True,
                    dimension_names=dimensions if reader.zarr_format == 3 else None, attributes=attributes)
            except OSError as exc:
                raise OutputError(f"{shown(tmp_path)}: cannot write array {_display(path)} ({reason_of(exc)})") from None
        self.blocks = _Blocks(tmp_path, reader.path, self.blocks.paths, reader.zarr_format, self.dtype)
        self.blocks.open_arrays()

    def _cf_attributes(self, reader: ZarrReader, names: dict[str, str],
                       metadata: dict[str, dict]) -> dict[str, dict]:
        self.missing = {}  # no attribute of the input array is written, and no marker put back
        return {}


def _coefficient_coordinates(reader: ZarrReader, path: str, perturbed: set[str]) -> dict[str, str]:
    """The coordinates attribute of an array written as coefficients (xarray's): its input's,
    naming only the arrays written on its record dimension alone (cf.coefficient_coordinates),
    so that xarray still reads a station's kept elev(station) as its coordinate; {} if none."""
    by_path = {"/" + name: name for name in reader.handles}
    dimensions_of = _dimensions(reader.handles)

    def dimensions(word: str) -> tuple[str, ...] | None:
        target = cf.variable(word, posixpath.dirname("/" + path), by_path)
        if target is None or target in reader.left_out or target in perturbed:
            return None  # not written, or coefficients itself
        return dimensions_of("/" + target)

    text = _text(reader.handles)("/" + path, "coordinates")
    found = cf.coefficient_coordinates(text, dimensions, dimensions_of("/" + path)[0])
    return {"coordinates": found} if found else {}


def create_coefficient_writer(reader: ZarrReader, jobs: list[ArrayJob], tmp_path: Path, dtype: np.dtype,
                              options: FormatOptions) -> ZarrCoefficientWriter:
    return ZarrCoefficientWriter(reader, jobs, tmp_path, dtype)


def is_earlier_output(path: Path, reader: ZarrReader) -> bool:
    """A folder whose manifest names it is an earlier output if it is a Zarr store."""
    return any((path / name).is_file() for name in METADATA_FILES)


FORMAT = Format(
    name=NAME, title="Zarr store", suffixes=(".zarr",), compound_suffixes=(".ome.zarr",), folder=True,
    selects_arrays=True, honours_keep=True, cf_markers=True, shares_rows=True,
    can_open=can_open, default_output=default_output, open_reader=open_reader, create_writer=create_writer,
    reopen_writer=reopen_writer, earlier_output=is_earlier_output, create_coefficient_writer=create_coefficient_writer,
    docs=(DocRow("Zarr store (format 2 or 3)",
                 "`zarr.json`, `.zarray`, `.zgroup`, `.zattrs` or `.zmetadata` at its root",
                 "`tldp perturb sample_data/digits.zarr --eps 1`",
                 "`digits.tldp.zarr`: same format version, groups, structural attributes, chunks, shards, codecs"),
          DocRow("OME-Zarr image (NGFF 0.4, 0.5)", "a Zarr group with `multiscales`",
                 "`tldp perturb cells.ome.zarr --eps 1`",
                 "`cells.tldp.ome.zarr`: the full resolution perturbed, lower levels regenerated from it "
                 "([below](#ome-zarr-multiscale-images))")),
)
