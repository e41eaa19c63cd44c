"""The HDF5 format's reader (formats/hdf5.py): which datasets are perturbed (those named,
or the numeric ones; Keras weights), which are kept, left out or written as a bare netCDF
dimension (formats.leftovers), their CF encodings (formats.cf), and what the reader and
the writer (hdf5_writer.py) both ask of an HDF5 object: its key, its attributes, its
dimensions, whether its type holds references.
"""

from __future__ import annotations

import os
import posixpath
import re
from contextlib import suppress
from pathlib import Path
from typing import Any, Callable, Mapping

import h5py
import numpy as np
from h5py import h5, h5a, h5d, h5ds, h5o, h5p, h5t

from tldp_cli.errors import InputError, NotHeld, UsageError
from tldp_cli.formats import ArrayJob, FormatOptions, check_numeric_dtype, default_selection, listing
from tldp_cli.formats import cf, hdf5_chunks, leftovers, tensor_files
from tldp_cli.formats import hdf5_storage

USERBLOCK = "userblock"  # the user block's name in the manifest and for --keep


def _is_numeric(dtype: np.dtype) -> bool:
    return dtype.kind in "iuf" and h5py.check_enum_dtype(dtype) is None


def has_refs(tid: h5t.TypeID) -> bool:
    kind = tid.get_class()
    if kind == h5t.REFERENCE:
        return True
    if kind in (h5t.VLEN, h5t.ARRAY):
        return has_refs(tid.get_super())
    if kind == h5t.COMPOUND:
        return any(has_refs(tid.get_member_type(i)) for i in range(tid.get_nmembers()))
    return False


def object_key(obj) -> tuple[int, int]:
    """Identifies an object whatever name it was opened by."""
    info = h5o.get_info(obj.id)
    return info.fileno, info.addr


def _groups(file: h5py.File) -> dict[str, h5py.Group]:
    """The file's groups by absolute path ("/", "/grp"), the root's included."""
    found = {"/": file["/"]}
    file.visititems(lambda name, obj: found.update({"/" + name: obj}) if isinstance(obj, h5py.Group) else None)
    return found


def _text(nodes: Mapping[str, Any]) -> Callable[[str, str], str | None]:
    """cf.named's `text` for HDF5 datasets and groups (by absolute path): a string attribute."""
    return lambda path, key: attr_text(nodes[path], key)


def attr_text(obj, key: str) -> str | None:
    """A string attribute (or an array of strings, joined by spaces); None if absent or not text."""
    if key not in obj.attrs:
        return None
    try:
        value = obj.attrs[key]
    except Exception:
        return None
    parts = value.ravel().tolist() if isinstance(value, np.ndarray) else [value]
    if not all(isinstance(part, (str, bytes)) for part in parts):
        return None
    return " ".join(part.decode("utf-8", "replace") if isinstance(part, bytes) else part
                    for part in parts)


def attr_numbers(path: Path, name: str, obj, key: str) -> np.ndarray | None:
    """A numeric attribute's values, flat; None if absent."""
    if key not in obj.attrs:
        return None
    try:
        value = np.asarray(obj.attrs[key])
    except Exception as exc:
        raise InputError(f"{path}: dataset {name}: cannot read its {key} attribute "
                         f"({hdf5_storage.reason(exc)})") from None
    if value.dtype.kind not in "iuf":
        raise InputError(f"{path}: dataset {name}: its {key} attribute is {value.dtype}, "
                         "not a number")
    return value.ravel()


def _encoding(path: Path, name: str, ds: h5py.Dataset) -> cf.Encoding | None:
    """The dataset's cf.Encoding; None when its stored values are the values."""
    return cf.encoding(f"{path}: dataset {name}", ds.dtype, lambda key: attr_numbers(path, name, ds, key),
                       attr_text(ds, "_Unsigned"))


class Hdf5Reader(cf.EncodedReader):
    def __init__(self, path: Path, options: FormatOptions, name: str):
        super().__init__(path, name)  # name: formats/hdf5.py's NAME
        self.tensors: list[tensor_files.Tensor] = []  # Keras weights: the chosen ones
        self.variances: set[str] = set()  # Keras weights: the chosen moving variances
        try:
            self.size = os.stat(path).st_size
            self.file = h5py.File(path, "r")
        except Exception as exc:
            if "unable to lock file" in str(exc):  # HDF5's file lock: a writer has it open
                raise InputError(f"{path}: another program has the HDF5 file open for writing (HDF5 "
                                 "refuses the read lock); close it there and run again") from None
            raise InputError(f"{path}: cannot read the HDF5 file ({hdf5_storage.reason(exc)}); "
                             "it may be truncated or corrupt") from None
        try:
            found = self._all_datasets()
            self.keras = _keras_weights(self.file, found)
            if self.keras:
                self.jobs = self._select_tensors(found, options)
            else:
                self.jobs = [self._job(name, ds) for name, ds in self._select(found, options)]
            self.leftovers = self._leftovers(found, options)
            self._check_outside_references()
        except BaseException:
            self.file.close()
            raise
        self.manifest_extra = {**self.manifest_extra, **self.leftovers.manifest_extra()}

    def _leftovers(self, found: dict[str, h5py.Dataset], options: FormatOptions) -> leftovers.Leftovers:
        """Decides from the headers what is written besides the perturbed datasets
        (leftovers.py): each other dataset copied (no action), left out (DROP) or, a netCDF
        dimension whose coordinate variable holds no numbers, written as a bare dimension
        (DIMENSION); each attribute written or left out (left_out_attrs)."""
        left = leftovers.Leftovers(list(options.keep), unperturbed=list(self.manifest_extra.get("unperturbed", [])))
        left.considered(job.name for job in self.jobs)
        perturbed = {object_key(self.file[job.name]) for job in self.jobs}
        self.actions: dict[tuple[int, int], str] = {}  # object -> DROP or DIMENSION
        if not self.keras:  # a Keras file's datasets are all weights, copied when not perturbed
            roles = dict.fromkeys(self._grid_mappings(found), leftovers.GRID_MAPPING)
            roles.update(dict.fromkeys(self._coordinates(found), leftovers.COORDINATE))
            roles.update(dict.fromkeys(self._record_coordinates(found), leftovers.RECORD_COORDINATE))
            for name, ds in found.items():
                key = object_key(ds)
                if key not in perturbed:
                    action = _dataset_action(left, name, ds, roles.get(key), options.exclude)
                    if action is not None:
                        self.actions[key] = action
        self.left_out_attrs: dict[tuple[int, int], dict[bytes, np.ndarray | None]] = {}  # object -> left out (None) or rewritten
        objects = [self.file["/"]]
        try:
            self.file.visititems(lambda name, obj: objects.append(obj))
            for obj in objects:
                key = object_key(obj)
                if key not in self.actions:
                    names = [n for n in attr_names(obj)
                             if not left.attribute(obj.name, n.decode("utf-8", "replace"))]
                    if names:
                        self.left_out_attrs[key] = dict.fromkeys(names)
        except Exception as exc:
            raise InputError(f"{self.path}: cannot read the HDF5 file's attributes ({hdf5_storage.reason(exc)}); "
                             "it may be truncated or corrupt") from None
        self._unname_dropped_coordinates(found)
        self.keep_userblock = self._userblock(left)
        self.left_out_links = self._left_out_links(left)
        left.check(self.path)
        return left

    def _left_out_links(self, left: leftovers.Leftovers) -> set[str]:
        """Soft links to paths that hold nothing, whose text is any content (a name, an ID),
        and links into other files, whose target's file name and path (/data/patients/
        john_smith.h5) are the input's metadata, not structure: left out unless --keep names
        them; listed either way. Soft links that resolve are structure, copied as links,
        but those to a dataset the run leaves out, which would hold nothing in the output."""
        found: list[tuple[str, str, str]] = []  # (path, kind, reason)

        def visit(name, link):
            target = self.file.get("/" + name) if isinstance(link, h5py.SoftLink) else None
            if isinstance(link, h5py.SoftLink) and target is None:
                found.append(("/" + name, "soft link", "a link to a path that holds nothing in the "
                              "file (its text can be any content)"))
            elif isinstance(link, h5py.SoftLink) and self.actions.get(object_key(target)) == DROP:
                found.append(("/" + name, "soft link", f"a link to {link.path}, which is left out: it "
                              "would hold nothing in the output"))
            elif isinstance(link, h5py.ExternalLink):
                found.append(("/" + name, "external link", "a link into another file: its target's "
                              "file name and path are the input's metadata (--keep copies it as a link)"))

        try:
            self.file.visititems_links(visit)
        except Exception as exc:
            raise InputError(f"{self.path}: cannot read the HDF5 file's links ({hdf5_storage.reason(exc)}); "
                             "it may be truncated or corrupt") from None
        left_out = set()
        for path, kind, reason in found:
            if left.kept(path):
                left.copied(path, kind, leftovers.KEPT)
            else:
                left.drop(path, kind, reason)
                left_out.add(path)
        return left_out

    def _userblock(self, left: leftovers.Leftovers) -> bool:
        """Whether the file's user block (bytes before the HDF5 data, which HDF5 leaves to
        other programs: any content) is copied; else the output's holds zeros, listed as
        dropped. --keep userblock copies it."""
        size = self.file.userblock_size
        if not size:
            return True
        if left.kept(USERBLOCK):
            left.copied(USERBLOCK, "user block", leftovers.KEPT)
            return True
        left.drop(USERBLOCK, "user block", f"the {size} bytes before the HDF5 data, which HDF5 leaves "
                  "to other programs (any content): the output's user block holds zeros")
        return False

    def _check_outside_references(self) -> None:
        """Nothing outside the file is read into the output: a dataset that is not perturbed
        and keeps its values in other files (virtual or external storage) would be copied
        raw, so it is refused; links into other files that --keep names are copied as links
        (their targets are not read) and reported."""
        perturbed = {job.name for job in self.jobs}
        outside, links = [], []

        def visit(name, link):
            path = "/" + name
            if isinstance(link, h5py.ExternalLink):
                if path not in self.left_out_links:
                    links.append(f"{path} -> {link.filename}:{link.path}")
            elif isinstance(link, h5py.HardLink) and path not in perturbed:
                obj = self.file.get(path)
                if isinstance(obj, h5py.Dataset) and object_key(obj) not in self.actions:  # copied
                    plist = obj.id.get_create_plist()
                    if plist.get_layout() == h5d.VIRTUAL or plist.get_external_count() > 0:
                        outside.append(path)

        self.file.visititems_links(visit)
        if outside:
            raise InputError(f"{self.path}: dataset {outside[0]} keeps its values in other files "
                             "(virtual or external storage), which tldp would copy raw (named by --keep "
                             "or --exclude, or a coordinate); perturb it with --dataset, or remove it "
                             "from the file")
        if links:
            self.manifest_extra = {**self.manifest_extra, "external_links": links}
            self.messages.append(f"copied {len(links)} link(s) into other files as links (their "
                                 f"targets are not read): {', '.join(links[:5])}")

    def _all_datasets(self) -> dict[str, h5py.Dataset]:
        found = {}

        def visit(name, obj):
            if isinstance(obj, h5py.Dataset):
                found["/" + name] = obj

        # Walking the whole tree now finds corrupt metadata before any output exists.
        try:
            self.file.visititems(visit)
            for name, ds in found.items():
                hdf5_storage.check_storage(self.path, self.size, name, ds, perturbed=False)
        except InputError:
            raise
        except Exception as exc:
            raise InputError(f"{self.path}: cannot read the HDF5 file's objects ({hdf5_storage.reason(exc)}); "
                             "it may be truncated or corrupt") from None
        return found

    def _select_tensors(self, found: dict[str, h5py.Dataset], options: FormatOptions) -> list[ArrayJob]:
        """A Keras weights file: each weight one record, chosen as in any model file."""
        self.records_are_tensors = True
        self.keeps_dtypes = True  # Keras weights: each written back in its dtype
        tensors = [tensor_files.Tensor(name, tuple(ds.shape or ()), ds.dtype.name if ds.dtype.kind in "iufb"
                                       else str(ds.dtype)) for name, ds in found.items()]
        requested = [posixpath.normpath("/" + name.strip("/")) for name in options.datasets]
        chosen, self.messages, unperturbed = tensor_files.select(
            self.path, tensors, requested, options.exclude, norm_stats=_keras_norm_stats(found))
        self.messages.insert(0, f"{self.path.name} has the layout of a Keras weights file: each "
                                "weight is one record")
        self.manifest_extra = tensor_files.manifest_extra(unperturbed)
        self.tensors = chosen
        self.variances = {name for name in _keras_norm_stats(found, variances_only=True)
                          if name in {t.name for t in chosen}}
        for tensor in chosen:
            hdf5_storage.check_storage(self.path, self.size, tensor.name, found[tensor.name], perturbed=True)
        return [tensor_files.job(self.path, self.format, t, hdf5_storage.Whole(self.path, t.name, self.size))
                for t in chosen]

    def _select(self, found: dict[str, h5py.Dataset], options: FormatOptions) -> list[tuple[str, h5py.Dataset]]:
        requested = options.datasets
        unmatched = [p for p in options.exclude
                     if not any(tensor_files.matching(name, [p]) for name in found)]
        if unmatched:
            raise NotHeld(f"{self.path}: --exclude {unmatched[0]} matches no dataset in the file", "exclude",
                          unmatched)
        excluded = {name for name in found if tensor_files.matching(name, options.exclude)}
        both = sorted(excluded & {posixpath.normpath("/" + n.strip("/")) for n in requested})
        if both:
            raise UsageError(f"{self.path}: dataset {both[0]} is named by --dataset and matched by --exclude")
        if requested:
            # object -> (name, dataset): two names of one dataset perturb it once
            chosen: dict[tuple[int, int], tuple[str, h5py.Dataset]] = {}
            for name in self._globbed(requested, found, excluded):
                ds = self._requested(name, found)
                chosen.setdefault(object_key(ds), (name, ds))
            return list(chosen.values())

        numeric = {name: tuple(ds.shape) for name, ds in found.items()
                   if _is_numeric(ds.dtype) and ds.shape is not None and name not in excluded}
        if excluded:
            self.messages.append(f"left out the datasets {listing(sorted(excluded))} (--exclude)")
        coordinates = self._coordinates(found)
        left_out = [name for name, shape in numeric.items()
                    if object_key(found[name]) in coordinates and len(shape) >= 2]
        numeric = {name: shape for name, shape in numeric.items()
                   if object_key(found[name]) not in coordinates}
        names, message = default_selection(self.path, numeric, "dataset")
        self.messages.append(message)
        if left_out:
            self.messages.append(f"not perturbing the coordinate datasets {listing(left_out)} "
                                 "(name them with --dataset to perturb them)")
        return [(name, found[name]) for name in names]

    def _globbed(self, requested: list[str], found: dict[str, h5py.Dataset], excluded: set[str]) -> list[str]:
        """--dataset's paths, each glob (as --exclude's; never a dataset's own path) replaced
        by the numeric datasets it matches but the coordinates and those --exclude leaves out.
        A glob that matches no dataset is refused as a missing path is."""
        names = []
        for name in (posixpath.normpath("/" + n.strip("/")) for n in requested):
            if name in found or not any(c in name for c in "*?["):
                names.append(name)
                continue
            matched = sorted(n for n in found if tensor_files.matching(n, [name]))
            if not matched:
                self._requested(name, found)  # raises: no such dataset, with the listing
            coordinates = self._coordinates(found)
            numeric = [n for n in matched if n not in excluded and _is_numeric(found[n].dtype)
                       and found[n].shape is not None and object_key(found[n]) not in coordinates]
            if not numeric:
                raise InputError(f"{self.path}: --dataset {name} matches no numeric dataset to perturb "
                                 f"(it matches {listing(matched)}: not numeric, coordinates or excluded)")
            names += numeric
        return names

    def _coordinates(self, found: dict[str, h5py.Dataset]) -> set[tuple[int, int]]:
        """The datasets that locate or delimit the data rather than hold it: dimension
        scales (netCDF dimensions and coordinate variables) and the variables named in
        a dataset's coordinates, bounds, climatology or cell_measures attribute."""
        keys = set()
        for ds in found.values():
            with suppress(Exception):  # a malformed CLASS attribute: not a scale
                if h5ds.is_scale(ds.id):
                    keys.add(object_key(ds))
        groups = _groups(self.file)
        named = cf.named(found, _text({**groups, **found}), cf.COORDINATE_REFERENCES, groups=groups)
        return keys | {object_key(found[target]) for _, _, target in named}

    def _unname_dropped_coordinates(self, found: dict[str, h5py.Dataset]) -> None:
        """A coordinates, bounds, climatology, cell_measures, ancillary_variables or formula_terms
        attribute (cf.NAMING) naming datasets the run leaves out (a record coordinate; one
        written as a bare dimension is no variable either) is written naming only the others
        (left out if none is left; formula_terms whole, cf.unnamed_attribute): CF readers
        look for every variable it names."""
        dropped = set(self.actions)  # DROP or DIMENSION
        groups = _groups(self.file)  # a group's own attributes name variables too (xarray's)
        for name, ds in [*found.items(), *groups.items()]:
            key = object_key(ds)
            if key in self.actions:
                continue

            def gone(word: str, group: str = name if name in groups else posixpath.dirname(name)) -> bool:
                target = cf.variable(word, group, found)
                return target is not None and object_key(target) in dropped

            for attr in cf.NAMING:
                if attr.encode() in self.left_out_attrs.get(key, {}):
                    continue
                text = cf.unnamed_attribute(attr, attr_text(ds, attr), gone)
                if text is not None:
                    self.left_out_attrs.setdefault(key, {})[attr.encode()] = np.array(text.encode()) if text else None

    def _record_coordinates(self, found: dict[str, h5py.Dataset]) -> set[tuple[int, int]]:
        """The datasets that hold a value per record along the record dimension of a perturbed
        dataset, not a grid (cf.record_coordinates, leftovers.py)."""
        records = {job.row_dimension for job in self.jobs if job.row_dimension is not None}
        groups = _groups(self.file)
        paths = cf.record_coordinates(found, _text({**groups, **found}),
                                      lambda path: dimensions(path, found[path]), records, groups=groups)
        return {object_key(found[path]) for path in paths}

    @staticmethod
    def _grid_mappings(found: dict[str, h5py.Dataset]) -> set[tuple[int, int]]:
        """The CF grid mapping variables the datasets name (grid_mapping attributes)."""
        named = cf.named(found, lambda path, key: attr_text(found[path], key), ["grid_mapping"],
                         leftovers.grid_mappings)
        return {object_key(found[target]) for _, _, target in named}

    def _requested(self, name: str, found: dict[str, h5py.Dataset]) -> h5py.Dataset:
        where = f"{self.path}: dataset {name}"
        parts = name.strip("/").split("/")
        for i in range(1, len(parts) + 1):
            prefix = "/" + "/".join(parts[:i])
            try:
                link = self.file.get(prefix, getlink=True)
            except Exception:
                link = None
            if link is None:
                numeric = [n for n, ds in found.items() if _is_numeric(ds.dtype) and ds.shape]
                shown = numeric or list(found)
                listing = ", ".join(shown[:8]) + (", ..." if len(shown) > 8 else "")
                hint = (f"numeric datasets: {listing}" if numeric else
                        f"no numeric dataset; datasets: {listing}" if found else "it holds no dataset")
                raise InputError(f"{where}: no such dataset in the file ({hint})")
            what = "it" if prefix == name else prefix
            if isinstance(link, h5py.SoftLink):
                raise InputError(f"{where}: {what} is a soft link to {link.path}; "
                                 "name the dataset by its own path")
            if isinstance(link, h5py.ExternalLink):
                raise InputError(f"{where}: {what} is a link into another file ({link.filename}); "
                                 "tldp perturbs datasets stored in the file itself")
        obj = self.file[name]
        if not isinstance(obj, h5py.Dataset):
            raise InputError(f"{where}: is a {'group' if isinstance(obj, h5py.Group) else 'datatype'}, "
                             "not a dataset")
        kind = _h5py_kind(obj.dtype)
        if kind:
            raise InputError(f"{where}: holds {kind}; tldp perturbs integer and floating-point data only")
        check_numeric_dtype(self.path, obj.dtype, what=f"dataset {name}")
        if not obj.shape:
            raise InputError(f"{where}: is a scalar or empty dataset; it has no records "
                             "(axis 0 indexes records)")
        if 0 in obj.shape:
            raise InputError(f"{where}: has no records (shape {obj.shape})")
        return obj

    def _job(self, name: str, ds: h5py.Dataset) -> ArrayJob:
        hdf5_storage.check_storage(self.path, self.size, name, ds, perturbed=True)
        encoding = _encoding(self.path, name, ds)
        return self.encoded_job(
            name, tuple(ds.shape), ds.dtype, encoding,
            hdf5_storage.Records(self.path, name, self.size, encoding,
                                 hdf5_storage.placement_within(ds, self.size), hdf5_chunks.deflated(ds)),
            chunk_records=ds.chunks[0] if ds.chunks else None,
            row_dimension=row_dimension(ds),
        )

    def close(self) -> None:
        self.file.close()


# Keras 3 (Model.save_weights, the model.weights.h5 inside a .keras archive): every object's
# variables are datasets "0", "1", ... in a "vars" group, the model's own at /vars, a layer's
# at /layers/<snake_case class name>[_N]/vars. BatchNormalization's are gamma, beta (each
# when enabled), moving_mean, moving_variance: its statistics are the last two.
_KERAS_VARIABLE = re.compile(r"/(?:.*/)?vars/\d+")
_KERAS_BATCHNORM = re.compile(r"batch_normalization(?:_\d+)?")


def _keras_weights(file: h5py.File, found: dict[str, h5py.Dataset]) -> bool:
    """Whether the file has the layout of Keras 3 weights: a /vars group and every dataset
    a variable in a vars group."""
    return (file.get("vars", getclass=True) is h5py.Group and bool(found)
            and all(_KERAS_VARIABLE.fullmatch(name) for name in found))


def _keras_norm_stats(found: dict[str, h5py.Dataset], variances_only: bool = False) -> set[str]:
    """The moving_mean and moving_variance of each BatchNormalization layer (the variances
    only, with `variances_only`)."""
    by_layer: dict[str, list[str]] = {}
    for name in found:
        group = posixpath.dirname(posixpath.dirname(name))
        if _KERAS_BATCHNORM.fullmatch(posixpath.basename(group)):
            by_layer.setdefault(group, []).append(name)
    stats = set()
    for names in by_layer.values():
        names.sort(key=lambda n: int(posixpath.basename(n)))
        stats.update(names[-1:] if variances_only else names[-2:])
    return stats


DROP, DIMENSION = "drop", "dimension"  # what the writer does with a dataset it does not perturb
SCALE_STAYS = ("a dimension scale, so its dimension stays (a scale holding no data, as netCDF writes a "
               "dimension without a variable)")
# netCDF-C's NAME of a dimension scale that is a dimension without a variable.
BARE_DIMENSION = b"This is a netCDF dimension but not a netCDF variable."


def _h5py_kind(dtype: np.dtype) -> str | None:
    """What a dataset of one of h5py's special types holds (strings, an enumerated type, object
    references, variable-length sequences), as a phrase; None for any other type."""
    return ("strings" if h5py.check_string_dtype(dtype) else
            "an enumerated (categorical) type" if h5py.check_enum_dtype(dtype) else
            "object references" if h5py.check_ref_dtype(dtype) else
            "variable-length sequences" if h5py.check_vlen_dtype(dtype) else None)


def _not_numbers(dtype: np.dtype) -> str | None:
    """What a dataset holds when it is not plain numbers (as a phrase); None for numbers."""
    return _h5py_kind(dtype) or ("a compound (table) type" if dtype.names else
                                 None if dtype.kind in "iuf" else f"{dtype} values")


def _bare_dimension(ds: h5py.Dataset) -> bool:
    """A netCDF dimension without a coordinate variable: a dimension scale holding no data."""
    with suppress(Exception):
        return bytes(np.asarray(ds.attrs["NAME"]).tobytes()).startswith(BARE_DIMENSION)
    return False


def _dataset_action(left: leftovers.Leftovers, name: str, ds: h5py.Dataset, role: str | None,
                    exclude: list[str]) -> str | None:
    """What is written of a dataset that is not perturbed (None: a raw copy, listed in `left`
    unless it is a bare netCDF dimension); `role`: leftovers.COORDINATE or GRID_MAPPING, or
    None. See leftovers.py."""
    if _bare_dimension(ds):  # structure, holding no value: neither --keep nor --exclude names it
        return None
    fields = {"shape": list(ds.shape or ()), "dtype": str(ds.dtype)}
    pattern = tensor_files.matching(name, exclude)
    if pattern is not None:
        left.copied(name, "dataset", f"--exclude {pattern}", **fields)
        return None
    if left.kept(name):
        left.copied(name, "dataset", leftovers.KEPT, **fields)
        return None
    problem = _not_numbers(ds.dtype)
    if role == leftovers.RECORD_COORDINATE and problem is None:
        with suppress(Exception):  # malformed dimension-scale metadata: not a scale
            if h5ds.is_scale(ds.id):  # a feature's identifier, trajectory(trajectory)
                left.drop(name, "dataset", f"{leftovers.RECORD_COORDINATE_REASON}; {SCALE_STAYS}")
                return DIMENSION
        left.drop(name, "dataset", leftovers.RECORD_COORDINATE_REASON)
        return DROP
    if role and problem is None:
        left.copied(name, "dataset", role, **fields)
        return None
    if problem is None:
        left.drop(name, "dataset", "numbers not chosen for perturbation (--dataset perturbs them)")
        return DROP
    reason = f"holds {problem}, which tldp does not perturb"
    with suppress(Exception):  # malformed dimension-scale metadata: not a scale
        if role in (leftovers.COORDINATE, leftovers.RECORD_COORDINATE) and h5ds.is_scale(ds.id):
            left.drop(name, "dataset", f"{reason}; {SCALE_STAYS}")
            return DIMENSION
    left.drop(name, "dataset", reason)
    return DROP


def dimensions(path: str, ds: h5py.Dataset) -> tuple[str, ...]:
    """The dimensions of a dataset's axes (netCDF's): the dimension scale attached to each
    axis that has one, or (path,) for a dimension scale itself; () in plain HDF5."""
    with suppress(Exception):  # malformed dimension-scale metadata: no names
        if h5ds.is_scale(ds.id):
            return (path,)
        return tuple(scales[0].name for scales in (list(dim.values()) for dim in ds.dims) if scales)
    return ()


def row_dimension(ds: h5py.Dataset) -> str | None:
    """The dimension of axis 0 (netCDF's): the dimension scale attached to it, or the
    dataset itself if it is one; None in plain HDF5."""
    with suppress(Exception):  # malformed dimension-scale metadata: no name
        if h5ds.is_scale(ds.id):
            return ds.name
        scales = list(ds.dims[0].values())
        if scales:
            return scales[0].name
    return None


def attr_names(obj) -> list[bytes]:
    """In creation order where the object tracks it (as netCDF-C lists them), else by name."""
    order = obj.id.get_create_plist().get_attr_creation_order()
    index = h5.INDEX_CRT_ORDER if order & h5p.CRT_ORDER_TRACKED else h5.INDEX_NAME
    names: list[bytes] = []
    h5a.iterate(obj.id, names.append, index_type=index)
    return names
