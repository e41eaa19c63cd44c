"""The HDF5 format's writer (formats/hdf5.py): the output file, built from the input.

The output is built object by object rather than by copying whole groups, so that
a perturbed dataset reachable under a second name (a hard link) gets the perturbed
data there too, never a raw copy. Object references (dimension scales use them)
hold addresses in the file, so a second pass points them at the output's objects.
Attributes are copied byte for byte in their stored type and shape; a perturbed
dataset's CF attributes are rewritten as its values now are (cf.Encoding), and its
lossy filters (LOSSY_FILTERS) left off. The output file goes through hdf5_output.py.
No object of the output stores a time (HDF5 stamps each object header with the time it
is created unless told not to, and its object copy keeps the input's): a seeded run
writes the same bytes, and a copied dataset does not date the input's recording.
"""

from __future__ import annotations

import dataclasses
import math
import os
import posixpath
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, Mapping

import h5py
import numpy as np
from h5py import h5a, h5d, h5g, h5p, h5r, h5s, h5t, h5z

from tldp_cli.errors import InputError, OutputError, TldpError, UsageError, reason_of
from tldp_cli.formats import ArrayJob, Writer, dropped_filters
from tldp_cli.files.checked_io import Background, pwrite_all, writing
from tldp_cli.files.output import shown
from tldp_cli.formats import cf, hdf5_chunks, tensor_files
from tldp_cli.formats import hdf5_output, hdf5_reader, hdf5_storage

# Filters that may store other values than those written: HDF5's scale-offset (decimal
# scaling rounds floats; integers given too few bits wrap; dropped even where lossless)
# and the registered lossy compressors and quantizers, several lossless only at some
# settings. Left off perturbed datasets so the noisy values are stored exactly;
# compression, shuffle, fletcher32, n-bit and unknown filters are kept.
LOSSY_FILTERS = {h5z.FILTER_SCALEOFFSET: "scale-offset", 258: "fpzip", 32005: "APAX",
                 32007: "JPEG-XR", 32012: "JPEG-LS", 32013: "zfp", 32014: "fpzip", 32016: "B3D",
                 32017: "SZ", 32019: "JPEG", 32022: "BitGroom", 32023: "Granular BitRound",
                 32024: "SZ3", 32028: "SPERR", 32030: "FFmpeg"}


def _has_vlen(tid: h5t.TypeID) -> bool:
    kind = tid.get_class()
    if kind == h5t.VLEN or (kind == h5t.STRING and tid.is_variable_str()):
        return True
    if kind == h5t.ARRAY:
        return _has_vlen(tid.get_super())
    if kind == h5t.COMPOUND:
        return any(_has_vlen(tid.get_member_type(i)) for i in range(tid.get_nmembers()))
    return False


def _copy_attrs(src, dst, replaced: Mapping[bytes, np.ndarray | None] | None = None) -> None:
    """Copies every attribute in its stored type and shape; `replaced` gives new values
    for some (None: left out)."""
    src, dst = (obj["/"] if isinstance(obj, h5py.File) else obj for obj in (src, dst))
    replaced = replaced or {}
    for name in hdf5_reader.attr_names(src):
        if name in replaced:
            if replaced[name] is not None:
                dst.attrs.create(name.decode(), replaced[name])
            continue
        attr = h5a.open(src.id, name)
        stored, space = attr.get_type(), attr.get_space()
        if stored.committed():
            stored = stored.copy()  # a named type lives in the input; the output gets its own
        copy = h5a.create(dst.id, name, stored, space)
        if space.get_simple_extent_type() == h5s.NULL:
            continue
        if _has_vlen(stored) or hdf5_reader.has_refs(stored):
            # Pointers in memory: read and written through h5py's conversions, as attrs[...]
            # does (references are pointed into the output later, _fix_references).
            dtype, shape = attr.dtype, attr.shape
            if dtype.subdtype is not None:
                dtype, shape = dtype.subdtype[0], shape + dtype.subdtype[1]
            value = np.zeros(shape, dtype=dtype)
            mtype = h5t.py_create(attr.dtype)
        else:
            # The bytes as stored: a conversion would re-pad strings (netCDF-C's null-
            # terminated ones lose their last character) or change byte order.
            value = np.empty(attr.shape, dtype=np.dtype((np.void, stored.get_size())))
            mtype = stored
        attr.read(value, mtype=mtype)
        copy.write(value, mtype=mtype)


def _vlen_fill(ds: h5py.Dataset) -> bool:
    """Whether the dataset has a fill value of a variable-length type (netCDF-C gives its
    string variables one, ""), which HDF5's object copy writes corrupt into another file."""
    return (_has_vlen(ds.id.get_type())
            and ds.id.get_create_plist().fill_value_defined() == h5d.FILL_VALUE_USER_DEFINED)


def timeless(plist):
    """`plist` (an object's creation properties: file, group, dataset) set to store no times
    in the object's header (see the module docstring)."""
    plist.set_obj_track_times(False)
    return plist


def _stamped(obj) -> bool:
    """Whether the object's header holds a time, which HDF5's object copy would carry over."""
    info = h5py.h5o.get_info(obj.id)
    return any((info.atime, info.mtime, info.ctime, info.btime))


COPY_BLOCK_BYTES = 1 << 26  # a dataset copied anew without chunks goes through memory this much at a time


def _copy_anew(src: h5py.Dataset, dst: h5py.Group, name: str,
               left_out: dict[bytes, np.ndarray | None] | None) -> None:
    """Copies a dataset without HDF5's object copy, which writes a variable-length fill value
    (_vlen_fill) corrupt into another file and keeps the header's times (_stamped): created
    anew with its layout, chunks, filters and fill value (a variable-length one left off)
    but no times; stored chunks are copied as they are, compressed, other values through h5py."""
    plist = src.id.get_create_plist()
    if _vlen_fill(src):
        fresh = h5p.create(h5p.DATASET_CREATE)
        if plist.get_layout() == h5d.CHUNKED:
            fresh.set_chunk(src.chunks)
            for index in range(plist.get_nfilters()):
                code, flags, values, _ = plist.get_filter(index)
                fresh.set_filter(code, flags, values)
        fresh.set_attr_creation_order(plist.get_attr_creation_order())
        plist = fresh
    out = h5py.Dataset(h5d.create(dst.id, name.encode(), src.id.get_type(), src.id.get_space(),
                                  dcpl=timeless(plist)))
    pointers = _has_vlen(src.id.get_type()) or hdf5_reader.has_refs(src.id.get_type())
    if not src.shape:
        out[()] = src[()]
    elif src.chunks is not None and not pointers:  # (pointers: heap ids and addresses of the input)
        for index in range(src.id.get_num_chunks()):
            offset = src.id.get_chunk_info(index).chunk_offset
            mask, data = src.id.read_direct_chunk(offset)
            out.id.write_direct_chunk(offset, data, mask)
    else:
        step = max(1, COPY_BLOCK_BYTES // max(1, src.dtype.itemsize * math.prod(src.shape[1:])))
        for start in range(0, src.shape[0], step):
            out[start:start + step] = src[start:start + step]
    _copy_attrs(src, out, left_out)


def _create_bare_dimension(src: h5py.Dataset, dst: h5py.Group, name: str) -> None:
    """A dimension scale whose values are left out, kept as a dimension: a scale of the same
    shape holding no data (big-endian float, never written), as netCDF-C writes a dimension
    without a variable, keeping its list of the datasets attached to it (references pointed
    into the output later, _fix_references). In a netCDF file it is named by netCDF-C's
    phrase and the length and keeps its dimension id; elsewhere it keeps its NAME."""
    out = dst.create_dataset(name, shape=src.shape, maxshape=src.maxshape, chunks=src.chunks, dtype=">f4",
                             fillvalue=np.float32(np.nan),  # read as missing
                             track_order=True,  # netCDF-C lists attributes in creation order
                             track_times=False)
    netcdf = "_Netcdf4Dimid" in src.attrs
    names = [(b"CLASS", b"DIMENSION_SCALE")]
    if netcdf:
        names.append((b"NAME", hdf5_reader.BARE_DIMENSION + b"%10d" % src.shape[0]))
    for key, text in names:
        string = h5t.C_S1.copy()  # null-terminated, as netCDF-C writes them
        string.set_size(len(text) + 1)
        h5a.create(out.id, key, string, h5s.create(h5s.SCALAR)).write(np.array(text, dtype=f"S{len(text) + 1}"))
    kept = (b"_Netcdf4Dimid", b"REFERENCE_LIST") if netcdf else (b"NAME", b"REFERENCE_LIST")
    _copy_attrs(src, out, {name: None for name in hdf5_reader.attr_names(src) if name not in kept})


class Hdf5Writer(Writer):
    def __init__(self, reader: hdf5_reader.Hdf5Reader, tmp_path: Path, dtype: np.dtype,
                 bounds: dict[str, tuple[float, float, float | None]] | None = None):
        self.path = tmp_path
        self.source = reader.path
        self.dtype = np.dtype(dtype)
        self.messages: list[str] = []
        src = self.src = reader.file
        self.to_perturb = {hdf5_reader.object_key(src[job.name]): job.name for job in reader.jobs}
        # Keras weights: each keeps its dtype and shape (one record each), variances stay > 0
        self.tensors = {t.name: t for t in reader.tensors} if reader.records_are_tensors else {}
        self.variances = reader.variances
        self.datasets: dict[str, h5py.Dataset] = {}  # job name -> output dataset
        self.placements: dict[str, hdf5_storage.Placement] = {}  # job name -> where its records go
        self.deflated: dict[str, hdf5_chunks.Deflated] = {}  # job name -> its chunks, deflated here
        self._disk: Background | None = None  # writes the placed blocks on a thread of its own
        self.postprocessing: list[str]
        self.manifest_extra: dict[str, Any]
        self.dropped: dict[str, list[str]] = {}  # job name -> lossy filters left off
        self.size = reader.size
        self.encodings = reader.encodings
        self.missing: dict[str, list[tuple]] = {}  # job name -> (stored marker, output marker), ...
        self.bounds = bounds or {}  # job name -> (lo, hi, grid step): where moved values go
        self.moved: list[tuple[str, int]] = []  # (job name, noisy values moved off its markers) per block
        self.held_missing: set[str] = set()  # the job names whose input held missing values (stderr only)
        self.dropped_attrs: dict[str, list[str]] = {}  # job name -> CF attributes left off
        self.actions = reader.actions  # object -> DROP or DIMENSION (datasets not perturbed)
        self.left_out_attrs = reader.left_out_attrs  # object -> attributes not written
        self.left_out_links = reader.left_out_links  # soft links to nothing, external links
        self.copied: dict[tuple[int, int], str] = {hdf5_reader.object_key(src): "/"}  # source object -> output path
        self.pairs: list[tuple[str, str]] = [("/", "/")]  # (source path, output path) of each object
        fcpl = src.id.get_create_plist()  # user block size, ...
        # ... but not the root group's creation-order tracking (netCDF-C opens a file for
        # writing only with it, and lists variables and attributes in that order).
        root = src["/"].id.get_create_plist()
        fcpl.set_link_creation_order(root.get_link_creation_order())
        fcpl.set_attr_creation_order(root.get_attr_creation_order())
        timeless(fcpl)  # (the root group's)
        try:
            with open(reader.path, "rb") as f:
                self.userblock = f.read(fcpl.get_userblock())  # HDF5 leaves it to its owner to write
            if not reader.keep_userblock:
                self.userblock = bytes(len(self.userblock))
        except OSError as exc:
            raise InputError(f"{reader.path}: cannot read ({reason_of(exc)})") from None
        with writing(tmp_path):
            self.output = hdf5_output.Output(tmp_path)
        self.file: h5py.File | None = None
        try:
            with self._hdf5():
                try:
                    self.file = hdf5_output.create_output(self.output, fcpl)
                except Exception as exc:
                    raise OutputError(f"{shown(tmp_path)}: cannot create the HDF5 file "
                                      f"({hdf5_storage.reason(exc)})") from None
                classic = self._leave_classic_model(src)
                self._copy_group(src, self.file)
                self._fix_references()
            if self.placements:  # the workers go on computing while the disk writes
                self._disk = Background(self._write_placed, f"tldp write {tmp_path.name}")
            self.postprocessing, self.manifest_extra = dropped_filters(self.dropped)
            self.postprocessing += classic
            if self.tensors:
                chosen = list(self.tensors.values())
                self.postprocessing += tensor_files.postprocessing(chosen, self.dtype, self.variances)
                self.output_dtype = tensor_files.output_dtype(chosen)
            self._describe_cf()
            if self.deflated:
                self.manifest_extra["deflate_huffman_only"] = sorted(self.deflated)
            hdf5_storage.check_not_shrunk(reader.path, reader.size)  # what was copied came from the whole file
        except BaseException:
            with suppress(Exception):
                self.close()
            raise

    @property
    def _created(self) -> h5py.File:
        """The output file: created in __init__ before anything is copied into it."""
        assert self.file is not None
        return self.file

    @contextmanager
    def _hdf5(self):
        """Around HDF5 calls on the output: signals wait until they return, and an I/O error
        the driver kept is raised once they have, before any error HDF5 made of it."""
        with hdf5_output.signals_held():
            try:
                yield
            finally:
                if self.output.failure is not None:
                    raise self.output.error()

    @contextmanager
    def _copying(self, what: str):
        try:
            yield
        except TldpError:
            raise
        except Exception as exc:
            raise InputError(f"{self.source}: cannot copy {what} ({hdf5_storage.reason(exc)})") from None

    def _leave_classic_model(self, src: h5py.File) -> list[str]:
        """netCDF-4's classic model (format NETCDF4_CLASSIC: the root's _nc3_strict) holds no
        64-bit integers: an output of int64 values is plain netCDF-4, _nc3_strict left off.
        Returns the postprocessing step to record (none when the model holds the output)."""
        if self.dtype != np.int64 or self.tensors or b"_nc3_strict" not in hdf5_reader.attr_names(src["/"]):
            return []
        root = hdf5_reader.object_key(src)
        self.left_out_attrs = {**self.left_out_attrs, root: {**self.left_out_attrs.get(root, {}), b"_nc3_strict": None}}
        self.messages.append("the output is netCDF-4, not its classic model (NETCDF4_CLASSIC), which holds no "
                             "int64 values")
        return ["write netCDF-4 rather than its classic model: the perturbed values are int64, which the classic "
                "model does not hold (_nc3_strict left off)"]

    def _copy_group(self, src: h5py.Group, dst: h5py.Group) -> None:
        with self._copying(f"the attributes of {src.name}"):
            _copy_attrs(src, dst, self.left_out_attrs.get(hdf5_reader.object_key(src)))
        for name in src:  # in creation order when the group tracks it
            with self._copying(posixpath.join(src.name, name)):
                self._copy_member(src, dst, name)

    def _copy_member(self, src: h5py.Group, dst: h5py.Group, name: str) -> None:
        link = src.get(name, getlink=True)
        if isinstance(link, (h5py.SoftLink, h5py.ExternalLink)):
            if posixpath.join(src.name, name) in self.left_out_links:
                return
            dst[name] = h5py.SoftLink(link.path) if isinstance(link, h5py.SoftLink) else \
                h5py.ExternalLink(link.filename, link.path)
            return
        obj = src[name]
        key = hdf5_reader.object_key(obj)
        if key in self.copied:  # another hard link to an object already written
            dst[name] = self._created[self.copied[key]]
            return
        if self.actions.get(key) == hdf5_reader.DROP:  # under every name (references to it become null)
            return
        path = posixpath.join(dst.name, name)
        self.copied[key] = path
        self.pairs.append((obj.name, path))
        if key in self.to_perturb:
            self._create_perturbed(obj, dst, name, self.to_perturb[key])
        elif isinstance(obj, h5py.Group):
            group = h5py.Group(h5g.create(dst.id, name.encode(), gcpl=timeless(obj.id.get_create_plist())))
            self._copy_group(obj, group)
        elif self.actions.get(key) == hdf5_reader.DIMENSION:
            _create_bare_dimension(obj, dst, name)
        elif isinstance(obj, h5py.Dataset) and (_vlen_fill(obj) or _stamped(obj)):
            _copy_anew(obj, dst, name, self.left_out_attrs.get(key))
        elif key in self.left_out_attrs:
            # Copied without its attributes, then those written: deleting one from a copy
            # leaves its bytes in the file.
            src.copy(name, dst, name=name, without_attrs=True)
            _copy_attrs(obj, dst[name], self.left_out_attrs[key])
        else:
            src.copy(name, dst, name=name)

    def _fix_references(self) -> None:
        for src_path, dst_path in self.pairs:
            src, dst = self.src[src_path], self._created[dst_path]
            with self._copying(f"the references in {src_path}"):
                for key in src.attrs:
                    if key in dst.attrs and hdf5_reader.has_refs(src.attrs.get_id(key).get_type()):
                        self._remap_attribute(dst, key, self._remap(src.attrs[key]))
                if isinstance(src, h5py.Dataset) and src.shape and hdf5_reader.has_refs(src.id.get_type()):
                    dst[()] = self._remap(src[()])

    @staticmethod
    def _remap_attribute(dst, key: str, value) -> None:
        """Writes an attribute's references, pointed into the output. The dimension-scale
        attributes lose the references to objects not written (null now): a dimension scale's
        REFERENCE_LIST the datasets left out, a dataset's DIMENSION_LIST the scales left out
        (HDF5 cannot iterate the scales of a list holding a null one)."""
        if key == "REFERENCE_LIST" and isinstance(value, np.ndarray) and value.dtype.names \
                and "dataset" in value.dtype.names and value.ndim == 1:
            attached = value[[bool(ref) for ref in value["dataset"]]]
            if len(attached) < len(value):
                del dst.attrs[key]
                if len(attached):
                    dst.attrs.create(key, attached, dtype=value.dtype)
                return
        if key == "DIMENSION_LIST" and isinstance(value, np.ndarray) and value.dtype.kind == "O" \
                and not all(bool(ref) for refs in value.flat for ref in refs):
            value = value.copy()
            for index in np.ndindex(value.shape):
                value[index] = np.array([ref for ref in value[index] if ref], dtype=h5py.ref_dtype)
            if not any(len(refs) for refs in value.flat):
                del dst.attrs[key]
                return
        dst.attrs.modify(key, value)

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
        path = self.copied.get(hdf5_reader.object_key(target))
        if path is None:  # an object no name leads to: nothing in the output to point at
            return null
        if region:
            return h5r.create(self._created.id, path.encode(), h5r.DATASET_REGION,
                              h5r.get_region(ref, target.id))
        return self._created[path].ref

    def _create_perturbed(self, src: h5py.Dataset, dst: h5py.Group, name: str, job_name: str) -> None:
        plist = src.id.get_create_plist()
        space = src.id.get_space()
        dtype = src.dtype if job_name in self.tensors else self.dtype
        if plist.get_layout() == h5d.CHUNKED:
            # Keeps chunking, lossless filters, fill value (HDF5 converts it) and object flags;
            # the chunk layout records the element size, so set it again for the new dtype.
            plist.set_chunk(src.chunks)
            self._drop_lossy_filters(plist, job_name)
        else:
            # Contiguous, compact, virtual or external storage becomes a plain contiguous
            # dataset: compact may outgrow its size limit, and virtual or external layouts
            # would write into other files, the input's included.
            fresh = h5p.create(h5p.DATASET_CREATE)
            if plist.fill_value_defined() == h5d.FILL_VALUE_USER_DEFINED:
                fill = np.zeros((), dtype=dtype)
                plist.get_fill_value(fill)
                fresh.set_fill_value(fill)
            fresh.set_attr_creation_order(plist.get_attr_creation_order())
            plist = fresh
            space = h5s.create_simple(src.shape) if src.shape else h5s.create(h5s.SCALAR)
        replaced = {**self.left_out_attrs.get(hdf5_reader.object_key(src), {}), **self._cf_attrs(src, job_name)}
        fill_attr = replaced.get(b"_FillValue")
        if fill_attr is not None and fill_attr.size:  # HDF5's fill value, as netCDF-C sets it
            plist.set_fill_value(np.array(fill_attr.flat[0], dtype=self.dtype))
        elif b"_FillValue" in replaced and plist.fill_value_defined() == h5d.FILL_VALUE_USER_DEFINED:
            # An in-range _FillValue left off: netCDF-C would still take HDF5's for the variable's
            # fill value, so it becomes one no noisy value takes (NaN, or the least integer).
            plist.set_fill_value(np.array(cf.output_marker(np.nan, self.dtype), dtype=self.dtype))
        # Model tensors go through tensor_files.to_stored (their dtype, variances kept > 0).
        placed = job_name not in self.tensors and self._place(plist, src)
        out = h5py.Dataset(h5d.create(dst.id, name.encode(), h5t.py_create(dtype), space, dcpl=timeless(plist)))
        _copy_attrs(src, out, replaced)
        self.datasets[job_name] = out
        if placed and (placement := hdf5_storage.placement_of(out)) is not None:
            self.placements[job_name] = placement
        elif job_name not in self.tensors and (deflated := hdf5_chunks.deflated(out, allocated=False)):
            self.deflated[job_name] = dataclasses.replace(deflated, huffman_only=True)

    def _place(self, plist: h5p.PropDCID, src: h5py.Dataset) -> bool:
        """Allocates the dataset's storage when it is created, without writing fill values,
        if its records can then be written as plain bytes (see Placement): the pipeline
        writes every record."""
        if (self.dtype.kind not in "iuf" or not src.shape or plist.get_nfilters()
                or (plist.get_layout() == h5d.CHUNKED and tuple(src.chunks[1:]) != tuple(src.shape[1:]))
                or -(-src.shape[0] // (src.chunks or src.shape)[0]) > hdf5_storage.MAX_PLACED_CHUNKS):
            return False
        plist.set_alloc_time(h5d.ALLOC_TIME_EARLY)
        plist.set_fill_time(h5d.FILL_TIME_NEVER)
        return True

    def _cf_attrs(self, src: h5py.Dataset, job_name: str) -> dict[bytes, np.ndarray | None]:
        """The CF attributes a perturbed dataset gets instead of its own (None: left out):
        the missing-data markers in the output dtype; no value bounds; no packing."""
        encoding = self.encodings.get(job_name)
        replaced: dict[bytes, np.ndarray | None] = {}
        dropped = cf.dropped_attributes(src.attrs, encoding)
        for key in dropped:
            replaced[key.encode()] = None
        if dropped:
            self.dropped_attrs[job_name] = dropped
        if encoding is None:
            return replaced
        self.missing[job_name] = cf.output_markers(encoding, self.dtype)
        for key in cf.MISSING:
            values = hdf5_reader.attr_numbers(self.source, job_name, src, key)
            if values is None:  # no such attribute
                continue
            kept = cf.output_values(key, values, encoding, self.dtype)
            if kept is None:  # every marker of it taken as data
                replaced[key.encode()] = None
                continue
            shape = src.attrs.get_id(key).shape if len(kept) == len(values) else (len(kept),)
            replaced[key.encode()] = np.array(kept, dtype=self.dtype).reshape(shape)
        return replaced

    def _describe_cf(self) -> None:
        """The manifest's account of the CF attributes the perturbed datasets honour."""
        steps, extra = cf.describe(self.encodings, {name: str(self.src[name].dtype) for name in self.encodings},
                                   self.dropped_attrs, self.missing, self.dtype)
        self.postprocessing += steps
        self.manifest_extra.update(extra)

    def _drop_lossy_filters(self, plist: h5p.PropDCID, job_name: str) -> None:
        """Removes the filters that may not store the noisy values exactly."""
        dropped: list[str] = []
        for index in reversed(range(plist.get_nfilters())):
            code = plist.get_filter(index)[0]
            if code in LOSSY_FILTERS:
                plist.remove_filter(code)
                dropped.insert(0, LOSSY_FILTERS[code])
        if dropped:
            self.dropped[job_name] = dropped
            self.messages.append(f"{job_name}: written without the source's {', '.join(dropped)} "
                                 f"filter{'s' if len(dropped) > 1 else ''} (lossy), so the noisy "
                                 "values are stored exactly")

    def write(self, job: ArrayJob, start: int, block: np.ndarray) -> None:
        if self.output.failure is not None:
            raise self.output.error()
        markers = self.missing.get(job.name)
        if markers:
            block = block.copy()  # the caller's block is not ours to change
            moved, held = cf.restore_missing(job, start, block, markers, self.bounds.get(job.name))
            self.moved.append((job.name, moved))  # blocks may come from several threads: append is atomic
            if held:
                self.held_missing.add(job.name)
        placement = self.placements.get(job.name)
        if placement is not None:  # beside HDF5: the storage is allocated
            assert self._disk is not None  # started in __init__ when there are placements
            self._disk.put((placement, start, np.ascontiguousarray(block, dtype=placement.dtype)))
            return
        deflated = self.deflated.get(job.name)
        if deflated is not None and deflated.aligned(start, len(block)):
            chunks = list(deflated.encoded(start, block))  # compressed in this worker, outside HDF5's lock
            with self._hdf5():
                for offset, data in chunks:
                    self.datasets[job.name].id.write_direct_chunk(offset, data)
            return
        tensor = self.tensors.get(job.name)
        with self._hdf5():
            if tensor is not None:
                self.datasets[job.name][()] = tensor_files.to_stored(
                    block[0], tensor.dtype, self.datasets[job.name].dtype, positive=job.name in self.variances)
            else:
                self.datasets[job.name][start:start + len(block)] = block

    def finish(self) -> None:
        cf.count_moves(self.manifest_extra, self.moved)
        if self.held_missing:
            self.messages.append(cf.missing_message(sorted(self.held_missing)))

    def _write_placed(self, item: tuple[hdf5_storage.Placement, int, np.ndarray]) -> None:
        placement, start, block = item
        with writing(self.path):
            placement.write(self.path, self.output.open_fd(), start, block)

    def close(self) -> list[Path]:
        try:
            if self._disk is not None:
                disk, self._disk = self._disk, None
                try:
                    disk.close()  # the blocks queued are written (or the first failure raised)
                except BaseException:
                    if self.file is not None:
                        file, self.file = self.file, None
                        with suppress(Exception), self._hdf5():
                            file.close()
                    raise
            if self.file is not None:
                file, self.file = self.file, None
                with self._hdf5():
                    file.close()
                with writing(self.path):
                    pwrite_all(self.output.open_fd(), self.userblock, 0)
                    os.fsync(self.output.open_fd())
        finally:
            self.output.close()
        return [self.path]


class Hdf5CoefficientWriter(Hdf5Writer):
    """--store coefficients: the output the records writer makes (the same groups, links,
    kept attributes, datasets and coordinates), but each perturbed dataset holds its records'
    released coefficients, (records, k) in the engine's dtype, with none of the input
    dataset's attributes (its units, fill values and dimensions describe records). In a
    netCDF file (axis 0 a dimension) axis 0 keeps its dimension and axis 1 is a new
    `coefficient` dimension (its coordinate variable: 0 .. k-1), so netCDF4 and xarray read
    the variable as (record dimension, coefficient); the record's own dimensions and their
    coordinates stay in the file, unused by it; its coordinates attribute names only the
    variables written on the record dimension alone (cf.coefficient_coordinates). Missing values cannot be marked in
    coefficients: each record is one released vector."""

    def __init__(self, reader: hdf5_reader.Hdf5Reader, jobs: list[ArrayJob], tmp_path: Path, dtype: np.dtype):
        assert not reader.records_are_tensors  # Keras weights: refused by calibration.calibrate_run
        self.shapes = {job.name: job.shape for job in jobs}
        self.coefficients: list[tuple[h5py.Dataset, h5py.Dataset]] = []  # (input dataset, output dataset)
        super().__init__(reader, tmp_path, dtype)
        try:
            with self._hdf5():
                self._attach_dimensions()
        except BaseException:
            with suppress(Exception):
                self.close()
            raise

    def _create_perturbed(self, src: h5py.Dataset, dst: h5py.Group, name: str, job_name: str) -> None:
        plist = h5p.create(h5p.DATASET_CREATE)
        plist.set_attr_creation_order(src.id.get_create_plist().get_attr_creation_order())
        space = h5s.create_simple(self.shapes[job_name])
        out = h5py.Dataset(h5d.create(dst.id, name.encode(), h5t.py_create(self.dtype), space, dcpl=timeless(plist)))
        self.datasets[job_name] = out
        self.coefficients.append((src, out))

    def _cf_attrs(self, src: h5py.Dataset, job_name: str) -> dict[bytes, np.ndarray | None]:
        return {}  # no attribute of the input dataset is written, and no marker put back

    def _attach_dimensions(self) -> None:
        """netCDF: axis 0 on the record dimension's scale as written, axis 1 on the group's
        `coefficient` dimension (made once per group)."""
        made: dict[str, h5py.Dataset] = {}
        found: dict[str, h5py.Dataset] = {}  # the input's datasets by absolute path

        def visit(name: str, obj) -> None:
            if isinstance(obj, h5py.Dataset):
                found["/" + name] = obj

        self.src.visititems(visit)
        self._detach_copied_scales()
        for src, out in self.coefficients:
            row = hdf5_reader.row_dimension(src)
            written = self.copied.get(hdf5_reader.object_key(self.src[row])) if row else None
            if row is None or written is None:
                continue  # plain HDF5: no dimensions
            group = out.parent
            if group.name not in made:
                if cf.COEFFICIENT_DIMENSION in group:
                    raise UsageError(f"{self.source}: --store coefficients names the new dimension "
                                     f"{cf.COEFFICIENT_DIMENSION}, which {group.name} holds already")
                scale = group.create_dataset(cf.COEFFICIENT_DIMENSION, data=np.arange(out.shape[1], dtype=np.int32))
                scale.attrs["long_name"] = "index of the released coefficient (privunit.stored in the manifest)"
                scale.make_scale(cf.COEFFICIENT_DIMENSION)
                made[group.name] = scale
            out.dims[0].attach_scale(self._created[written])
            out.dims[1].attach_scale(made[group.name])
            self._write_coordinates(src, out, row, found)

    def _detach_copied_scales(self) -> None:
        """The dimension scales were copied with REFERENCE_LIST entries naming the perturbed
        datasets' axes, which the coefficients do not have (or have anew: attach_scale lists
        them): those entries go, and a list left empty with them. The scales are found among
        the objects copied: File.visititems on the output being written crashed HDF5."""
        file = self.file
        assert file is not None
        written = {hdf5_reader.object_key(out) for _, out in self.coefficients}
        copied = (file[path] for path in sorted(set(self.copied.values())))
        scales = [obj for obj in copied if isinstance(obj, h5py.Dataset) and "REFERENCE_LIST" in obj.attrs]
        for scale in scales:
            value = scale.attrs["REFERENCE_LIST"]
            keep = [bool(ref) and hdf5_reader.object_key(file[ref]) not in written for ref in value["dataset"]]
            if all(keep):
                continue
            del scale.attrs["REFERENCE_LIST"]
            if any(keep):
                scale.attrs.create("REFERENCE_LIST", value[keep], dtype=value.dtype)

    def _write_coordinates(self, src: h5py.Dataset, out: h5py.Dataset, row: str,
                           found: dict[str, h5py.Dataset]) -> None:
        """The coordinates attribute of the input dataset, naming only the datasets written on
        the record dimension alone (cf.coefficient_coordinates): a station's kept elev(station)
        stays its coordinate for xarray."""
        def dimensions(word: str) -> tuple[str, ...] | None:
            target = cf.variable(word, posixpath.dirname(src.name), found)
            if target is None:
                return None
            key = hdf5_reader.object_key(target)
            if key not in self.copied or self.actions.get(key) == hdf5_reader.DIMENSION or key in self.to_perturb:
                return None  # not written, a bare dimension (no variable), or coefficients itself
            return hdf5_reader.dimensions(target.name, target)

        text = cf.coefficient_coordinates(hdf5_reader.attr_text(src, "coordinates"), dimensions, row)
        if text:
            out.attrs.create("coordinates", np.array(text.encode()))
