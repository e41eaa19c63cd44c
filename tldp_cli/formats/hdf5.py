"""HDF5 files: the chosen numeric datasets are perturbed; everything else (the group
tree, attributes, links, other datasets, the user block) is copied unchanged.

The output is built object by object rather than by copying whole groups, so that
a perturbed dataset reachable under a second name (a hard link) gets the perturbed
data there too, never a raw copy. Object references (dimension scales use them)
hold addresses in the file, so a second pass points them at the output's objects.
"""

from __future__ import annotations

import os
import posixpath
import re
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np
from h5py import h5d, h5f, h5g, h5o, h5p, h5r, h5s, h5t, h5z

from tldp_cli.errors import InputError, OutputError, TldpError
from tldp_cli.formats import (
    ArrayJob,
    FormatOptions,
    check_numeric_dtype,
    default_selection,
)

NAME = "hdf5"
SIGNATURE = b"\x89HDF\r\n\x1a\n"


def can_open(path: Path) -> bool:
    """The signature sits at offset 0, or after a user block at 512, 1024, 2048, ..."""
    if not path.is_file():
        return False
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            offset = 0
            while offset + len(SIGNATURE) <= size:
                f.seek(offset)
                if f.read(len(SIGNATURE)) == SIGNATURE:
                    return True
                offset = offset * 2 if offset else 512
    except OSError:
        return False
    return False


def default_output(path: Path) -> Path:
    return path.with_name(f"{path.stem}.tldp{path.suffix}")


def _reason(exc: Exception) -> str:
    """h5py's 'Unable to synchronously open file (truncated file: ...)' -> 'truncated file: ...'."""
    text = str(exc)
    match = re.fullmatch(r"Unable to (?:synchronously )?[^(]*\((.*)\)", text, re.DOTALL)
    return match.group(1) if match else text


def _is_numeric(dtype: np.dtype) -> bool:
    return dtype.kind in "iuf" and h5py.check_enum_dtype(dtype) is None


def _has_refs(tid: h5t.TypeID) -> bool:
    kind = tid.get_class()
    if kind == h5t.REFERENCE:
        return True
    if kind in (h5t.VLEN, h5t.ARRAY):
        return _has_refs(tid.get_super())
    if kind == h5t.COMPOUND:
        return any(_has_refs(tid.get_member_type(i)) for i in range(tid.get_nmembers()))
    return False


def _object_key(obj) -> tuple[int, int]:
    """Identifies an object whatever name it was opened by."""
    info = h5o.get_info(obj.id)
    return info.fileno, info.addr


@dataclass(frozen=True)
class _Records:
    """Reads records of one dataset. Opens the file on each call: h5py handles do not
    pickle, so this callable can go to worker processes."""

    path: Path
    dataset: str

    def __call__(self, start: int, stop: int) -> np.ndarray:
        try:
            with h5py.File(self.path, "r") as f:
                return f[self.dataset][start:stop]
        except Exception as exc:
            raise InputError(f"{self.path}: cannot read records {start}:{stop} of dataset "
                             f"{self.dataset} ({_reason(exc)})") from None


class Hdf5Reader:
    format = NAME

    def __init__(self, path: Path, options: FormatOptions):
        self.path = path
        self.messages: list[str] = []
        try:
            self.file = h5py.File(path, "r")
        except Exception as exc:
            raise InputError(f"{path}: cannot read the HDF5 file ({_reason(exc)}); "
                             "it may be truncated or corrupt") from None
        try:
            self.jobs = [self._job(name, ds) for name, ds in self._select(options.datasets)]
        except BaseException:
            self.file.close()
            raise

    def _all_datasets(self) -> dict[str, h5py.Dataset]:
        found = {}

        def visit(name, obj):
            if isinstance(obj, h5py.Dataset):
                found["/" + name] = obj

        # Walking the whole tree now finds corrupt metadata before any output exists.
        try:
            self.file.visititems(visit)
        except Exception as exc:
            raise InputError(f"{self.path}: cannot read the HDF5 file's objects ({_reason(exc)}); "
                             "it may be truncated or corrupt") from None
        return found

    def _select(self, requested: list[str]) -> list[tuple[str, h5py.Dataset]]:
        found = self._all_datasets()
        if requested:
            chosen = {}  # object -> (name, dataset): two names of one dataset perturb it once
            for name in requested:
                name = posixpath.normpath("/" + name.strip("/"))
                ds = self._requested(name, found)
                chosen.setdefault(_object_key(ds), (name, ds))
            return list(chosen.values())

        numeric = {name: tuple(ds.shape) for name, ds in found.items()
                   if _is_numeric(ds.dtype) and ds.shape is not None}
        names, message = default_selection(self.path, numeric, "dataset")
        self.messages.append(message)
        return [(name, found[name]) for name in names]

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
        kind = ("strings" if h5py.check_string_dtype(obj.dtype) else
                "an enumerated (categorical) type" if h5py.check_enum_dtype(obj.dtype) else
                "object references" if h5py.check_ref_dtype(obj.dtype) else
                "variable-length sequences" if h5py.check_vlen_dtype(obj.dtype) else None)
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
        shape = tuple(ds.shape)
        return ArrayJob(
            name=name, shape=shape, dtype=ds.dtype, read=_Records(self.path, name),
            source={"path": str(self.path), "format": NAME, "dataset": name,
                    "shape": list(shape), "dtype": str(ds.dtype)},
            chunk_records=ds.chunks[0] if ds.chunks else None,
        )

    def arrays(self) -> list[ArrayJob]:
        return self.jobs

    def close(self) -> None:
        self.file.close()


def open_reader(path: Path, options: FormatOptions) -> Hdf5Reader:
    return Hdf5Reader(path, options)


def _copy_attrs(src, dst) -> None:
    for key in src.attrs:
        # The stored type, not the one numpy would infer: keeps string lengths and
        # encodings, byte order and integer widths exactly.
        stored = h5py.Datatype(src.attrs.get_id(key).get_type())
        dst.attrs.create(key, src.attrs[key], dtype=stored)


class Hdf5Writer:
    def __init__(self, reader: Hdf5Reader, tmp_path: Path, dtype: np.dtype):
        self.path = tmp_path
        self.source = reader.path
        self.dtype = np.dtype(dtype)
        self.messages = reader.messages
        src = self.src = reader.file
        self.to_perturb = {_object_key(src[job.name]): job.name for job in reader.jobs}
        self.datasets: dict[str, h5py.Dataset] = {}  # job name -> output dataset
        self.copied: dict[tuple[int, int], str] = {_object_key(src): "/"}  # source object -> output path
        self.pairs: list[tuple[str, str]] = [("/", "/")]  # (source path, output path) of each object
        fcpl = src.id.get_create_plist()  # user block size, creation-order tracking, ...
        self.userblock = fcpl.get_userblock()
        try:
            self.file = h5py.File(h5f.create(os.fsencode(tmp_path), h5f.ACC_EXCL, fcpl=fcpl))
        except Exception as exc:
            raise OutputError(f"{tmp_path.parent}: cannot create the output file ({_reason(exc)})") from None
        try:
            self._copy_group(src, self.file)
            self._fix_references()
        except BaseException:
            self.file.close()
            raise

    @contextmanager
    def _copying(self, what: str):
        try:
            yield
        except TldpError:
            raise
        except Exception as exc:
            raise InputError(f"{self.source}: cannot copy {what} ({_reason(exc)})") from None

    def _copy_group(self, src: h5py.Group, dst: h5py.Group) -> None:
        with self._copying(f"the attributes of {src.name}"):
            _copy_attrs(src, dst)
        for name in src:  # in creation order when the group tracks it
            with self._copying(posixpath.join(src.name, name)):
                self._copy_member(src, dst, name)

    def _copy_member(self, src: h5py.Group, dst: h5py.Group, name: str) -> None:
        link = src.get(name, getlink=True)
        if isinstance(link, h5py.SoftLink):
            dst[name] = h5py.SoftLink(link.path)
            return
        if isinstance(link, h5py.ExternalLink):
            dst[name] = h5py.ExternalLink(link.filename, link.path)
            return
        obj = src[name]
        key = _object_key(obj)
        if key in self.copied:  # another hard link to an object already written
            dst[name] = self.file[self.copied[key]]
            return
        path = posixpath.join(dst.name, name)
        self.copied[key] = path
        self.pairs.append((obj.name, path))
        if key in self.to_perturb:
            self._create_perturbed(obj, dst, name, self.to_perturb[key])
        elif isinstance(obj, h5py.Group):
            group = h5py.Group(h5g.create(dst.id, name.encode(), gcpl=obj.id.get_create_plist()))
            self._copy_group(obj, group)
        else:
            src.copy(name, dst, name=name)

    def _fix_references(self) -> None:
        for src_path, dst_path in self.pairs:
            src, dst = self.src[src_path], self.file[dst_path]
            with self._copying(f"the references in {src_path}"):
                for key in src.attrs:
                    if _has_refs(src.attrs.get_id(key).get_type()):
                        dst.attrs.modify(key, self._remap(src.attrs[key]))
                if isinstance(src, h5py.Dataset) and src.shape and _has_refs(src.id.get_type()):
                    dst[()] = self._remap(src[()])

    def _remap(self, value):
        """`value` with every reference into the source replaced by one into the output."""
        if isinstance(value, h5py.Reference):
            return self._map_ref(value)
        if isinstance(value, np.void) or (isinstance(value, np.ndarray) and value.dtype.names):
            out = np.array(value)
            for field in out.dtype.names:
                out[field] = self._remap(out[field])
            return out[()] if isinstance(value, np.void) else out
        if isinstance(value, np.ndarray) and value.dtype.kind == "O":
            out = value.copy()
            for index in np.ndindex(value.shape):
                out[index] = self._remap(value[index])
            return out
        return value

    def _map_ref(self, ref: h5py.Reference) -> h5py.Reference:
        region = isinstance(ref, h5py.RegionReference)
        null = h5py.RegionReference() if region else h5py.Reference()
        if not ref:
            return null
        try:
            target = self.src[ref]
        except Exception:
            return null
        path = self.copied.get(_object_key(target))
        if path is None:  # an object no name leads to: nothing in the output to point at
            return null
        if region:
            return h5r.create(self.file.id, path.encode(), h5r.DATASET_REGION,
                              h5r.get_region(ref, target.id))
        return self.file[path].ref

    def _create_perturbed(self, src: h5py.Dataset, dst: h5py.Group, name: str, job_name: str) -> None:
        plist = src.id.get_create_plist()
        space = src.id.get_space()
        if plist.get_layout() == h5d.CHUNKED:
            # Keeps chunking, filters, fill value (HDF5 converts it) and object flags;
            # the chunk layout records the element size, so set it again for the new dtype.
            plist.set_chunk(src.chunks)
            if src.scaleoffset is not None and src.dtype.kind in "iu":
                plist.remove_filter(h5z.FILTER_SCALEOFFSET)
                self.messages.append(f"{job_name}: written without the source's integer scale-offset "
                                     f"filter, which does not apply to {self.dtype} data")
        else:
            # Contiguous, compact, virtual or external storage becomes a plain contiguous
            # dataset: compact may outgrow its size limit, and virtual or external layouts
            # would write into other files, the input's included.
            fresh = h5p.create(h5p.DATASET_CREATE)
            if plist.fill_value_defined() == h5d.FILL_VALUE_USER_DEFINED:
                fill = np.zeros((), dtype=self.dtype)
                plist.get_fill_value(fill)
                fresh.set_fill_value(fill)
            fresh.set_obj_track_times(plist.get_obj_track_times())
            fresh.set_attr_creation_order(plist.get_attr_creation_order())
            plist = fresh
            space = h5s.create_simple(src.shape)
        out = h5py.Dataset(h5d.create(dst.id, name.encode(), h5t.py_create(self.dtype), space, dcpl=plist))
        _copy_attrs(src, out)
        self.datasets[job_name] = out

    def write(self, job: ArrayJob, start: int, block: np.ndarray) -> None:
        self.datasets[job.name][start:start + len(block)] = block

    def close(self) -> list[Path]:
        if self.file is not None:
            self.file.close()
            self.file = None
            if self.userblock:
                with open(self.source, "rb") as src, open(self.path, "r+b") as dst:
                    dst.write(src.read(self.userblock))
        return [self.path]


def create_writer(reader: Hdf5Reader, tmp_path: Path, dtype: np.dtype,
                  options: FormatOptions) -> Hdf5Writer:
    return Hdf5Writer(reader, tmp_path, dtype)
