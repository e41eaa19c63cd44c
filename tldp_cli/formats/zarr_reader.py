"""The Zarr format's reader (formats/zarr_store.py): which arrays are perturbed (those
named, or the numeric ones; an OME-Zarr image's full resolution), which are kept or left
out (formats.leftovers: coordinates, --keep, --exclude), and each array's CF encoding.
"""

from __future__ import annotations

import posixpath
from pathlib import Path
from typing import Any

import numpy as np
from zarr.storage import LocalStore

from tldp_cli.errors import InputError, UsageError
from tldp_cli.formats import ArrayJob, FormatOptions, check_numeric_dtype, data_file, default_selection
from tldp_cli.formats import cf, leftovers, zarr_chunks
from tldp_cli.formats import zarr_cf, zarr_ome, zarr_tree

class ZarrReader(cf.EncodedReader):
    def __init__(self, path: Path, options: FormatOptions, name: str):
        super().__init__(path, name)  # name: formats/zarr_store.py's NAME
        self.manifest_extra: dict = {}
        files = zarr_tree.store_files(path)  # first: it refuses links before any file is read
        self.zarr_format = zarr_tree.store_format(path)
        self.nodes = zarr_tree.walk(path, self.zarr_format)
        zarr_tree.check_attributes(path, files, self.nodes)
        self.store = LocalStore(path, read_only=True)
        opened = {n.path: zarr_tree.open_node(self.store, path, n.path, n.kind, self.zarr_format) for n in self.nodes}
        self.handles = {n.path: opened[n.path] for n in self.nodes if n.kind == "array"}
        self.group_handles = {n.path: opened[n.path] for n in self.nodes if n.kind == "group"}
        self.pyramids = zarr_ome.pyramids(path, self.nodes, opened)
        self.integer_labels = options.integer_labels  # the writer's (zarr_ome.label_dtypes)
        selected = self._select(options.datasets)
        self.jobs = [self._job(name) for name in selected]
        # The multiscale images whose lower levels the writer regenerates (all of them).
        self.regenerated = [p for p in self.pyramids if p.levels[0] in selected and len(p.levels) > 1]
        # Metadata computed from the raw values, which the writer leaves out, by image.
        self.raw_statistics = {p: zarr_ome.raw_statistics(opened[p.group].attrs.asdict())
                               for p in self.pyramids if p.levels[0] in selected}
        self.messages += [zarr_ome.regeneration_message(p) for p in self.regenerated]
        written = set(selected).union(*(p.levels[1:] for p in self.regenerated))
        self.leftovers = self._leftovers(files, written, options)
        self.manifest_extra.update(self.leftovers.manifest_extra())

    def _leftovers(self, files: list[str], written: set[str], options: FormatOptions) -> leftovers.Leftovers:
        """Decides from the metadata what is written besides the perturbed arrays (leftovers.py):
        the arrays (left_out: their paths) and files (left_out_files) left out, and each
        node's attributes where some are left out (attributes: the node's path -> the rest)."""
        left = leftovers.Leftovers(list(options.keep))
        left.considered(zarr_tree.display(name) for name in written)
        roles = dict.fromkeys(zarr_cf.grid_mapping_arrays(self.handles), leftovers.GRID_MAPPING)
        roles.update(dict.fromkeys(zarr_cf.coordinate_arrays(self.handles, self.group_handles), leftovers.COORDINATE))
        records = {job.row_dimension for job in self.jobs if job.row_dimension is not None}
        roles.update(dict.fromkeys(zarr_cf.record_coordinates(self.handles, self.group_handles, records),
                                   leftovers.RECORD_COORDINATE))
        self.left_out: set[str] = set()
        for path, array in self.handles.items():
            if path in written:
                continue
            name, fields = zarr_tree.display(path), {"shape": list(array.shape), "dtype": str(array.dtype)}
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
        for rel, owner in zarr_tree.not_zarr(files, self.nodes).items():
            if owner in self.left_out:
                continue  # left out with its array
            if owner not in written and left.kept(rel):
                data = data_file(self.path / rel)
                if data is not None:  # an .npy, a pickle, a Parquet file: records, never copied raw
                    raise UsageError(f"{self.path / rel}: holds {data}; tldp never copies it raw")
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
                kept = zarr_cf.unnamed(self.handles, group, self.left_out, {key: value for key, value in attrs.items()
                                                                            if left.attribute(zarr_tree.display(path), key)})
                kept = zarr_ome.without_ngff_names(zarr_tree.display(path), kept, left)
                if kept != attrs:
                    self.attributes[path] = kept
        left.check(self.path)
        return left

    def _select(self, requested: list[str]) -> list[str]:
        arrays = self.handles
        listing = ", ".join(zarr_tree.display(n) for n in arrays) or "none"
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
        coordinates = zarr_cf.coordinate_arrays(arrays, self.group_handles)
        left_out = [n for n, shape in numeric.items() if n in coordinates and len(shape) >= 2]
        numeric = {n: shape for n, shape in numeric.items() if n not in coordinates}
        names, message = default_selection(self.path, numeric, "array")
        for name in names:
            self._check(name)
        self.messages.append(message)
        if left_out:
            self.messages.append(f"not perturbing the coordinate arrays {', '.join(left_out)} "
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
        check_numeric_dtype(self.path, array.dtype, f"array {zarr_tree.display(name)}")
        if array.ndim == 0 or array.shape[0] == 0:
            raise InputError(f"{self.path}: array {zarr_tree.display(name)} has no records "
                             f"(shape {tuple(array.shape)}; axis 0 indexes records)")

    def _job(self, name: str) -> ArrayJob:
        array = self.handles[name]
        encoding, row_dimension = None, None  # multiscale images are images, not CF variables
        if not any(name in p.levels for p in self.pyramids):
            encoding = zarr_cf.cf_encoding(f"{self.path}: array {zarr_tree.display(name)}", array)
            dimensions = zarr_cf.dimension_names(array)
            if dimensions:  # xarray's dimensions are named within their group
                row_dimension = posixpath.join("/" + posixpath.dirname(name), dimensions[0])
        return self.encoded_job(
            zarr_tree.display(name), tuple(array.shape), array.dtype, encoding,
            zarr_tree.Records(self.path, name, self.zarr_format, encoding, zarr_chunks.of_array(array)),
            chunk_records=(array.shards or array.chunks)[0],
            row_dimension=row_dimension,
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

    def output_dtype(self, dtype: np.dtype) -> str | None:
        """Integer label images keep their dtype under privunit (zarr_ome.label_dtypes)."""
        return zarr_ome.label_output_dtype(dtype, self.label_dtypes(dtype), self.pyramids)

    def label_dtypes(self, dtype: np.dtype) -> dict[str, np.dtype]:
        """Under privunit (integer_labels), zarr_ome.label_dtypes of the images perturbed."""
        if not self.integer_labels:
            return {}
        return zarr_ome.label_dtypes(self.pyramids, {job.name.strip("/") for job in self.jobs}, self.handles, dtype)

    def close(self) -> None:
        self.store.close()
