"""HDF5 files: the chosen numeric datasets are perturbed; everything else (the group
tree, attributes, links, other datasets, the user block) is copied unchanged. A
perturbed dataset keeps its chunks and lossless filters; filters that may be lossy
(LOSSY_FILTERS) are left off and listed in the manifest (dropped_filters).

The output is built object by object rather than by copying whole groups, so that
a perturbed dataset reachable under a second name (a hard link) gets the perturbed
data there too, never a raw copy. Object references (dimension scales use them)
hold addresses in the file, so a second pass points them at the output's objects.

HDF5 does not survive a failed write: when a write fails while it flushes its
caches (chunks are cached, so a full disk often shows only when the file is
closed), closing the file fails halfway, and the next attempt, at the latest when
the process exits, reads freed memory and crashes. So the output goes through
h5py's file-object driver to _Output, which never lets HDF5 see an I/O error: the
first is kept, the writes after it are dropped (the output is discarded anyway),
and the writer raises it once HDF5 has returned. Ctrl-C and SIGTERM wait while
HDF5 works on the output, so that their KeyboardInterrupt never surfaces inside a
driver call either.

The input is checked before anything is written:
- a contiguous dataset must lie within the file. HDF5 refuses a file shorter than
  the end address its superblock records; whether it refuses a dataset placed
  beyond that end when it opens the dataset, or only when it reads it, mid-run,
  depends on the release;
- of a perturbed dataset, the part stored nowhere in the file (chunks never
  written, contiguous storage never allocated: HDF5 reads it as the fill value)
  may be at most max(FILL_LIMIT, FILL_RATIO x the file's size). Such sparse
  datasets are legal, but a 1 kB file declaring 10^15 values is a damaged or
  hostile header, not data to perturb for days. Written chunks are not bounded by
  their compression ratio: codecs store a constant chunk in a few bytes whatever
  its size, so no ratio is implausible for real data.
And while it is read: HDF5 reads the part of a file cut off after it was opened as
zeros, so each read checks that the file is not shorter than it was at open.
"""

from __future__ import annotations

import math
import os
import posixpath
import re
import signal
import threading
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np
from h5py import h5d, h5f, h5fd, h5g, h5o, h5p, h5r, h5s, h5t, h5z

from tldp_cli.errors import InputError, OutputError, TldpError
from tldp_cli.formats import (
    ArrayJob,
    FormatOptions,
    check_numeric_dtype,
    default_selection,
    dropped_filters,
)
from tldp_cli.formats.checked_io import pwrite_all, write_error, writing
from tldp_cli.output import shown

NAME = "hdf5"
SIGNATURE = b"\x89HDF\r\n\x1a\n"
FILL_LIMIT = 1 << 30  # bytes of a perturbed dataset read as fill value, allowed whatever the file's size
FILL_RATIO = 16  # ... or this many times the file's size
# Filters that may store other values than those written: HDF5's scale-offset (decimal
# scaling rounds floats; integers given too few bits wrap; dropped even where lossless)
# and the registered lossy compressors and quantizers, several lossless only at some
# settings. Left off perturbed datasets so the noisy values are stored exactly;
# compression, shuffle, fletcher32, n-bit and unknown filters are kept.
LOSSY_FILTERS = {h5z.FILTER_SCALEOFFSET: "scale-offset", 258: "fpzip", 32005: "APAX",
                 32007: "JPEG-XR", 32012: "JPEG-LS", 32013: "zfp", 32014: "fpzip", 32016: "B3D",
                 32017: "SZ", 32019: "JPEG", 32022: "BitGroom", 32023: "Granular BitRound",
                 32024: "SZ3", 32028: "SPERR", 32030: "FFmpeg"}


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
    text = str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)  # str() quotes a key
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


def _check_not_shrunk(path: Path, size: int) -> None:
    """Raises if the file is shorter than `size`, its size at open."""
    try:
        now = os.stat(path).st_size
    except OSError as exc:
        raise InputError(f"{path}: cannot read ({exc.strerror or exc})") from None
    if now < size:
        raise InputError(f"{path}: the file shrank from {size} to {now} bytes while tldp was "
                         "reading it")


@dataclass(frozen=True)
class _Records:
    """Reads records of one dataset. Opens the file on each call: h5py handles do not
    pickle, so this callable can go to worker processes."""

    path: Path
    dataset: str
    size: int  # the file's size at open

    def __call__(self, start: int, stop: int) -> np.ndarray:
        try:
            with h5py.File(self.path, "r") as f:
                block = f[self.dataset][start:stop]
        except Exception as exc:
            _check_not_shrunk(self.path, self.size)  # the likelier cause of "truncated file"
            raise InputError(f"{self.path}: cannot read records {start}:{stop} of dataset "
                             f"{self.dataset} ({_reason(exc)})") from None
        _check_not_shrunk(self.path, self.size)  # a part cut off during the read came back as zeros
        return block


def _check_storage(path: Path, size: int, name: str, ds: h5py.Dataset, perturbed: bool) -> None:
    """Refuses a contiguous dataset beyond the end of the file and, if `perturbed`, a
    dataset mostly stored nowhere (see the module docstring)."""
    plist = ds.id.get_create_plist()
    layout = plist.get_layout()
    if layout == h5d.CONTIGUOUS and plist.get_external_count() == 0:
        offset = ds.id.get_offset()  # None: never written (all fill value)
        stored = ds.id.get_storage_size()
        if offset is not None and offset + stored > size:
            raise InputError(f"{path}: dataset {name} lies at bytes {offset} to {offset + stored}, "
                             f"beyond the end of the file ({size} bytes); it may be truncated")
        if not perturbed:
            return
        unstored = ds.nbytes if offset is None else 0
    elif layout == h5d.CHUNKED and perturbed:
        chunks = math.prod(-(-n // c) for n, c in zip(ds.shape, ds.chunks))
        chunk_bytes = math.prod(ds.chunks) * ds.dtype.itemsize
        unstored = min(ds.nbytes, (chunks - ds.id.get_num_chunks()) * chunk_bytes)
    else:
        return  # compact (in the object header), virtual or external: nothing to compare
    if unstored > max(FILL_LIMIT, FILL_RATIO * size):
        raise InputError(f"{path}: dataset {name} declares {ds.nbytes} bytes (shape {ds.shape}), "
                         f"{unstored} of them never written to the {size}-byte file; "
                         "the file may be damaged")


class Hdf5Reader:
    format = NAME

    def __init__(self, path: Path, options: FormatOptions):
        self.path = path
        self.messages: list[str] = []
        try:
            self.size = os.stat(path).st_size
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
            for name, ds in found.items():
                _check_storage(self.path, self.size, name, ds, perturbed=False)
        except InputError:
            raise
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
        _check_storage(self.path, self.size, name, ds, perturbed=True)
        shape = tuple(ds.shape)
        return ArrayJob(
            name=name, shape=shape, dtype=ds.dtype, read=_Records(self.path, name, self.size),
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


class _Output:
    """The output file as h5py's file-object driver sees it: keeps the first error instead
    of raising it into HDF5, and drops the writes after it (see the module docstring)."""

    def __init__(self, path: Path):
        self.path = path
        self.fd: int | None = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
        self.position = 0
        self.failure: BaseException | None = None

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        if whence == os.SEEK_CUR:
            offset += self.position
        elif whence == os.SEEK_END:
            try:
                offset += os.fstat(self.fd).st_size
            except BaseException as exc:
                self.failure = self.failure or exc
        self.position = offset
        return offset

    def tell(self) -> int:
        return self.position

    def write(self, data) -> int:
        size = memoryview(data).nbytes
        if self.failure is None:
            try:
                pwrite_all(self.fd, data, self.position)
            except BaseException as exc:
                self.failure = exc
        self.position += size
        return size

    def readinto(self, buffer) -> int:
        view = memoryview(buffer).cast("B")
        done = 0
        try:
            while done < len(view):
                count = os.preadv(self.fd, [view[done:]], self.position + done)
                if count == 0:
                    break
                done += count
        except BaseException as exc:
            self.failure = self.failure or exc
        view[done:] = bytes(len(view) - done)  # beyond the end: zeros, as HDF5's own driver reads
        self.position += len(view)
        return len(view)

    def truncate(self, size: int) -> int:
        if self.failure is None:
            try:
                os.ftruncate(self.fd, size)
            except BaseException as exc:
                self.failure = exc
        return size

    def flush(self) -> None:
        pass  # every write is in the file already; the writer syncs it when done

    def error(self) -> BaseException:
        return write_error(self.path, self.failure) if isinstance(self.failure, OSError) else self.failure

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _create_output(output: _Output, fcpl: h5p.PropFCID) -> h5py.File:
    """A new HDF5 file written through `output`. The file-access list holding `output` is
    released on return: one still open when Python exits is freed after it, and its
    driver's callback into Python crashes the process."""
    fapl = h5p.create(h5p.FILE_ACCESS)
    fapl.set_fileobj_driver(h5fd.fileobj_driver, output)
    return h5py.File(h5f.create(os.fsencode(output.path), h5f.ACC_TRUNC, fcpl=fcpl, fapl=fapl))


@contextmanager
def _signals_held():
    """Holds SIGINT and SIGTERM (Python handlers, which raise KeyboardInterrupt) until the
    block ends: inside a driver callback, HDF5 would take the exception for a failed write."""
    if threading.current_thread() is not threading.main_thread():
        yield  # the handlers run on the main thread, never inside this thread's callbacks
        return
    held: list[int] = []
    previous = {}
    for number in (signal.SIGINT, signal.SIGTERM):
        if callable(signal.getsignal(number)):
            previous[number] = signal.signal(number, lambda signum, frame: held.append(signum))
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
        if held:
            signal.raise_signal(held[0])


class Hdf5Writer:
    def __init__(self, reader: Hdf5Reader, tmp_path: Path, dtype: np.dtype):
        self.path = tmp_path
        self.source = reader.path
        self.dtype = np.dtype(dtype)
        self.messages = reader.messages
        src = self.src = reader.file
        self.to_perturb = {_object_key(src[job.name]): job.name for job in reader.jobs}
        self.datasets: dict[str, h5py.Dataset] = {}  # job name -> output dataset
        self.dropped: dict[str, list[str]] = {}  # job name -> lossy filters left off
        self.copied: dict[tuple[int, int], str] = {_object_key(src): "/"}  # source object -> output path
        self.pairs: list[tuple[str, str]] = [("/", "/")]  # (source path, output path) of each object
        fcpl = src.id.get_create_plist()  # user block size, creation-order tracking, ...
        try:
            with open(reader.path, "rb") as f:
                self.userblock = f.read(fcpl.get_userblock())  # HDF5 leaves it to its owner to write
        except OSError as exc:
            raise InputError(f"{reader.path}: cannot read ({exc.strerror or exc})") from None
        with writing(tmp_path):
            self.output = _Output(tmp_path)
        self.file = None
        try:
            with self._hdf5():
                try:
                    self.file = _create_output(self.output, fcpl)
                except Exception as exc:
                    raise OutputError(f"{shown(tmp_path)}: cannot create the HDF5 file "
                                      f"({_reason(exc)})") from None
                self._copy_group(src, self.file)
                self._fix_references()
            self.postprocessing, self.manifest_extra = dropped_filters(self.dropped)
            _check_not_shrunk(reader.path, reader.size)  # what was copied came from the whole file
        except BaseException:
            with suppress(Exception):
                self.close()
            raise

    @contextmanager
    def _hdf5(self):
        """Around HDF5 calls on the output: signals wait until they return, and an I/O error
        the driver kept is raised once they have, before any error HDF5 made of it."""
        with _signals_held():
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

    def _drop_lossy_filters(self, plist: h5p.PropDCID, job_name: str) -> None:
        """Removes the filters that may not store the noisy values exactly."""
        dropped = []
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
        with self._hdf5():
            self.datasets[job.name][start:start + len(block)] = block

    def close(self) -> list[Path]:
        try:
            if self.file is not None:
                file, self.file = self.file, None
                with self._hdf5():
                    file.close()
                with writing(self.path):
                    pwrite_all(self.output.fd, self.userblock, 0)
                    os.fsync(self.output.fd)
        finally:
            self.output.close()
        return [self.path]


def create_writer(reader: Hdf5Reader, tmp_path: Path, dtype: np.dtype,
                  options: FormatOptions) -> Hdf5Writer:
    return Hdf5Writer(reader, tmp_path, dtype)
