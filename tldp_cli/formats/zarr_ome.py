"""OME-Zarr (NGFF 0.4 on Zarr 2, 0.5 on Zarr 3) in a Zarr store (formats/zarr_store.py).

A multiscale image is perturbed once, at its full resolution; its lower levels are
regenerated from the perturbed one (regenerate: the mean of each block, or the nearest
element for labels and where the metadata declares it), never released raw. The
metadata's free-text names, OMERO identifiers and acquisition times are left out unless
--keep names them (without_ngff_names), and the statistics other tools computed from the
raw values are dropped (drop_raw_statistics: omero channel windows, replaced by the
declared range, and label properties and colors).
"""

from __future__ import annotations

import copy
import itertools
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import zarr
from zarr.storage import LocalStore

from tldp_cli.errors import InputError
from tldp_cli.formats import leftovers
from tldp_cli.formats import zarr_tree

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


def without_ngff_names(owner: str, attrs: dict[str, Any], left: leftovers.Leftovers) -> dict[str, Any]:
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


# Multiscale images (OME-Zarr / NGFF 0.4 and 0.5). A multiscale group lists its levels,
# full resolution first. Only the full resolution is perturbed: the lower levels are
# regenerated from it (post-processing), never copied, so none is raw and the records
# are released once.
MEAN, NEAREST = "mean", "nearest"


@dataclass(frozen=True)
class Pyramid:
    group: str  # the image's group in the store, "" for the root
    index: int  # its entry in the group's multiscales list
    in_ome: bool  # NGFF 0.5: the list is under the "ome" attribute
    levels: tuple[str, ...]  # the arrays' paths in the store, full resolution first
    # each lower level: per axis, how many elements of the level above make one of it
    factors: tuple[tuple[int, ...], ...]
    method: str  # MEAN or NEAREST
    declared: str | None  # the downsampling the metadata declares (type, metadata.method)
    label: bool = False  # a label image (image-label): NGFF requires integer values

    @property
    def name(self) -> str:
        return zarr_tree.display(self.group)

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


def pyramids(path: Path, nodes: list[zarr_tree.Node], opened: dict[str, Any]) -> list[Pyramid]:
    """The multiscale images of the store, from their groups' attributes."""
    found = []
    for node in (n for n in nodes if n.kind == "group"):
        entries, in_ome, label = _multiscales(opened[node.path].attrs.asdict())
        if entries is None:
            continue
        where = f"{path}: OME-Zarr image {zarr_tree.display(node.path)}"
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
            found.append(Pyramid(node.path, index, in_ome, levels, factors, method, declared, label))
    return found


def label_dtypes(pyramids: list[Pyramid], perturbed: set[str], arrays: dict[str, Any],
                 dtype: np.dtype) -> dict[str, np.dtype]:
    """The arrays of the integer label images perturbed that keep their integer dtype where
    the engine's values are floats, under --mechanism privunit (FormatOptions.integer_labels;
    the noise mechanisms' checks in tldp evaluate read their outputs unrounded): NGFF
    requires integer label images. By the array's path in the store: every level of each
    label image."""
    if np.dtype(dtype).kind != "f":
        return {}
    return {level: np.dtype(arrays[level].dtype) for p in pyramids if p.label and p.levels[0] in perturbed
            for level in p.levels if np.dtype(arrays[p.levels[0]].dtype).kind in "iu"}


def to_label_dtype(block: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Released values of a label image in its integer dtype: rounded to the nearest
    integer and clipped to the dtype's range (post-processing of the released values)."""
    info = np.iinfo(dtype)
    return np.clip(np.rint(np.asarray(block, dtype=np.float64)), info.min, info.max).astype(dtype)


def label_output_dtype(dtype: np.dtype, labels: dict[str, np.dtype], pyramids: list[Pyramid]) -> str | None:
    """The manifest's output_dtype where label images keep their integer dtype (label_dtypes),
    the engine's dtype first; None where none does."""
    kept = [f"{p.name} {labels[p.levels[0]]}" for p in pyramids if p.levels[0] in labels]
    if not kept:
        return None
    return f"{np.dtype(dtype)} (label images keep their integer dtype: {', '.join(kept)})"


def label_steps(pyramids: list[Pyramid], labels: dict[str, np.dtype]) -> list[str]:
    """The manifest's postprocessing entries for the label images kept in their integer dtype."""
    steps = []
    for pyramid in (p for p in pyramids if p.levels[0] in labels):
        dtype = labels[pyramid.levels[0]]
        info = np.iinfo(dtype)
        steps.append(f"round the released values of label image {pyramid.name} to the nearest integer and clip "
                     f"them to [{info.min}, {info.max}], cast to {dtype} (NGFF label images are integers; "
                     "post-processing, no privacy cost)")
    return steps


def regeneration_message(pyramid: Pyramid) -> str:
    how = "the first element" if pyramid.method == NEAREST else "the mean"
    note = ""
    if pyramid.declared and pyramid.method not in pyramid.declared.lower():
        note = f" (its metadata declares {pyramid.declared}, which tldp does not reproduce)"
    return (f"multiscale image {pyramid.name}: levels {', '.join(pyramid.levels[1:])} are regenerated from "
            f"the perturbed {pyramid.levels[0]} ({how} of each block of the scale factors{note})")


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


def regeneration_step(pyramid: Pyramid) -> str:
    """The manifest's postprocessing entry for one multiscale image."""
    how = "the first element" if pyramid.method == NEAREST else "the mean"
    return (f"regenerate the lower levels {', '.join(pyramid.levels[1:])} of multiscale image {pyramid.name} "
            f"from the perturbed full resolution {pyramid.levels[0]}: {how} of each block of the scale "
            "factors of the level above (multiscale_images; post-processing, no privacy cost)")


def regenerate(root: Path, source: Path, pyramid: Pyramid, zarr_format: zarr_tree.ZarrFormat, dtype: np.dtype) -> None:
    """Writes every lower level of `pyramid` in the output from the level above it, one
    tile (shard, or chunk) at a time: memory holds one tile and the block above it."""
    store = LocalStore(root)
    above = zarr_tree.open_node(store, source, pyramid.levels[0], "array", zarr_format)
    for path, factors in zip(pyramid.levels[1:], pyramid.factors):
        for leftover in (p for p in (root / path).iterdir() if p.name not in zarr_tree.METADATA_FILES):
            # An interrupted run's chunks: one that is now all fill value would not be rewritten.
            if leftover.is_dir():
                shutil.rmtree(leftover)
            else:
                leftover.unlink()
        level = zarr_tree.open_node(store, source, path, "array", zarr_format, mode="r+")
        for region in _regions(tuple(level.shape), level.shards or level.chunks):
            covering = tuple(slice(r.start * f, min(r.stop * f, n))
                             for r, f, n in zip(region, factors, above.shape))
            shape = tuple(r.stop - r.start for r in region)
            level[region] = _downsample(np.asarray(above[covering]), factors, shape, pyramid.method, dtype)
        above = level


def describe_multiscale(root: Path, pyramid: Pyramid, zarr_format: zarr_tree.ZarrFormat) -> None:
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


def raw_statistics(attrs: dict[str, Any]) -> list[str]:
    """The fields of an image group's NGFF metadata that other tools compute from the raw
    values: the display windows of its omero channels (min, max, start, end), and the
    per-label properties (areas, intensities, ...) and colors of a label image: an entry
    per label value, which tools write for the values the raw labels hold (how many cells
    or lesions), and which no longer name the noisy ids."""
    ngff = attrs["ome"] if isinstance(attrs.get("ome"), dict) else attrs
    found = []
    omero = ngff.get("omero")
    if isinstance(omero, dict) and any(isinstance(c, dict) and "window" in c
                                       for c in omero.get("channels") or []):
        found.append("omero channel windows")
    label = ngff.get("image-label")
    if isinstance(label, dict) and "properties" in label:
        found.append("image-label properties")
    if isinstance(label, dict) and "colors" in label:
        found.append("image-label colors")
    return found


def declared_window(bounds: tuple[float, float, float | None] | None,
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


def drop_raw_statistics(root: Path, pyramid: Pyramid, zarr_format: zarr_tree.ZarrFormat,
                        window: dict[str, float] | None) -> None:
    """Replaces the omero channel windows with `window` (or drops them, when None) and drops
    the label properties and colors."""
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
        ngff["image-label"].pop("colors", None)
    group.attrs.put(attrs)


def statistics_step(pyramid: Pyramid, fields: list[str], window: dict[str, float] | None) -> str:
    """The manifest's postprocessing entry for drop_raw_statistics."""
    steps = []
    if "omero channel windows" in fields and window is not None:
        steps.append(f"replace the omero channel windows of multiscale image {pyramid.name} with the declared "
                     f"range [{window['min']}, {window['max']}]")
        fields = [f for f in fields if f != "omero channel windows"]
    if fields:
        steps.append(f"drop the {' and the '.join(fields)} of multiscale image {pyramid.name}")
    return "; ".join(steps) + ": they are computed from the raw values"
