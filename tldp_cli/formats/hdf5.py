"""HDF5 files: the chosen numeric datasets are perturbed; the group tree, links and the
user block are copied unchanged, and of the attributes and other datasets what
formats.leftovers keeps (structural metadata, numeric coordinates, what --keep or
--exclude names); the rest is left out and listed in the manifest. A
perturbed dataset keeps its chunks and lossless filters; filters that may be lossy
(LOSSY_FILTERS) are left off and listed in the manifest (dropped_filters). Records
are read and written outside HDF5 where their bytes allow it: at their places in the
file (_Placement) or, for deflated chunks, compressed by the workers (hdf5_chunks.py).

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

netCDF-4 files are HDF5 files, and the copy keeps what netCDF readers rely on:
- attributes are copied byte for byte in their stored type and shape (converting
  netCDF-C's fixed-length null-terminated strings drops their last character);
- the root group keeps its creation-order tracking, which the file creation list
  the input reports leaves out: netCDF-C opens a file for writing only with it, and
  lists variables and attributes in that order.
Of a perturbed dataset, the CF attributes about its values are honoured (cf.Encoding):
values equal to its _FillValue or missing_value are missing data, copied rather than
perturbed (the writer puts them back, so which values are missing is released as
is), unless the marker lies inside the declared range: then it is data (see cf.py)
and the output leaves it off; packed integers (scale_factor, add_offset, _Unsigned) are unpacked, perturbed in
physical units and written unpacked; valid_range, valid_min, valid_max and
actual_range are dropped, since noisy values pass them and readers would mask them.
Coordinate variables (dimension scales, and the variables named in a coordinates,
bounds, climatology or cell_measures attribute) are not perturbed unless named; one
that holds text is left out, its dimension written as netCDF-C writes a dimension
without a variable, so the file stays valid netCDF.
"""

from __future__ import annotations

import dataclasses
import math
import os
import posixpath
import re
import signal
import threading
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import h5py
import numpy as np
from h5py import h5, h5a, h5d, h5ds, h5f, h5fd, h5g, h5o, h5p, h5r, h5s, h5t, h5z

from tldp_cli.errors import InputError, NotHeld, OutputError, TldpError, UsageError, reason_of
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
    listing,
    tldp_name,
)
from tldp_cli.files.checked_io import Background, pwrite_all, write_direct, write_error, writing
from tldp_cli.files.output import shown
from tldp_cli.formats import cf, hdf5_chunks, leftovers, tensor_files
from tldp_cli.sampling.engine import PAGE

NAME = "hdf5"
SIGNATURE = b"\x89HDF\r\n\x1a\n"
USERBLOCK = "userblock"  # the user block's name in the manifest and for --keep
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
    return tldp_name(path, path.suffix, FORMAT.compound_suffixes)


def _reason(exc: Exception) -> str:
    """h5py's 'Unable to synchronously open file (truncated file: ...)' -> 'truncated file: ...'."""
    text = str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)  # str() quotes a key
    match = re.fullmatch(r"Unable to (?:synchronously )?[^(]*\((.*)\)", text, re.DOTALL)
    return (match.group(1) if match else text).strip() or reason_of(exc)


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
        raise InputError(f"{path}: cannot read ({reason_of(exc)})") from None
    if now < size:
        raise InputError(f"{path}: the file shrank from {size} to {now} bytes while tldp was "
                         "reading it")


def _groups(file: h5py.File) -> dict[str, h5py.Group]:
    """The file's groups by absolute path ("/", "/grp"), the root's included."""
    found = {"/": file["/"]}
    file.visititems(lambda name, obj: found.update({"/" + name: obj}) if isinstance(obj, h5py.Group) else None)
    return found


def _text(nodes: Mapping[str, Any]) -> Callable[[str, str], str | None]:
    """cf.named's `text` for HDF5 datasets and groups (by absolute path): a string attribute."""
    return lambda path, key: _attr_text(nodes[path], key)


def _attr_text(obj, key: str) -> str | None:
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


def _attr_numbers(path: Path, name: str, obj, key: str) -> np.ndarray | None:
    """A numeric attribute's values, flat; None if absent."""
    if key not in obj.attrs:
        return None
    try:
        value = np.asarray(obj.attrs[key])
    except Exception as exc:
        raise InputError(f"{path}: dataset {name}: cannot read its {key} attribute "
                         f"({_reason(exc)})") from None
    if value.dtype.kind not in "iuf":
        raise InputError(f"{path}: dataset {name}: its {key} attribute is {value.dtype}, "
                         "not a number")
    return value.ravel()


def _encoding(path: Path, name: str, ds: h5py.Dataset) -> cf.Encoding | None:
    """The dataset's cf.Encoding; None when its stored values are the values."""
    return cf.encoding(f"{path}: dataset {name}", ds.dtype, lambda key: _attr_numbers(path, name, ds, key),
                       _attr_text(ds, "_Unsigned"))


# Datasets of more chunks than this are read and written through HDF5: listing where
# each chunk lies would cost more than the lock it saves.
MAX_PLACED_CHUNKS = 1 << 16


@dataclass(frozen=True)
class _Placement:
    """Where a dataset's records lie in its file, so that blocks of them are read and
    written with plain positional I/O: outside HDF5, h5py's global lock and (for the
    output) the Python file driver, so worker threads do it in parallel. Contiguous
    storage (one piece) or unfiltered chunks that each hold whole records, all
    allocated; offsets[i] is where chunk i (records i * chunk_records ...) starts."""

    dtype: np.dtype
    records: int
    record_shape: tuple[int, ...]
    chunk_records: int
    offsets: tuple[int, ...]

    @property
    def record_bytes(self) -> int:
        return math.prod(self.record_shape) * self.dtype.itemsize

    def pieces(self, start: int, stop: int):
        """(file offset, first record, end record) of each chunk's part of records start:stop."""
        n = self.chunk_records
        for chunk in range(start // n, (stop - 1) // n + 1):
            first, end = max(start, chunk * n), min(stop, (chunk + 1) * n)
            yield self.offsets[chunk] + (first - chunk * n) * self.record_bytes, first, end

    def read(self, path: Path, start: int, stop: int) -> np.ndarray:
        """Records start:stop (stop past the end: up to the end, as h5py slices)."""
        stop = max(start, min(stop, self.records))
        out = np.empty((stop - start, *self.record_shape), self.dtype)
        view = out.reshape(-1).view(np.uint8).data
        size = self.record_bytes
        fd = os.open(path, os.O_RDONLY)
        try:
            for offset, first, end in self.pieces(start, stop):
                part, done = view[(first - start) * size:(end - start) * size], 0
                while done < len(part):
                    count = os.preadv(fd, [part[done:]], offset + done)
                    if count == 0:
                        raise EOFError("truncated file")
                    done += count
        finally:
            os.close(fd)
        return out

    def write(self, path: Path, fd: int, start: int, block: np.ndarray) -> None:
        """Writes the records at their places: the whole pages inside each piece with direct
        I/O where the filesystem takes it (no page-cache copy, as the .npy writer), the
        partial pages at its ends through `fd`."""
        data = np.ascontiguousarray(block, dtype=self.dtype).reshape(-1).view(np.uint8)
        size = self.record_bytes
        for offset, first, end in self.pieces(start, start + len(block)):
            part = data[(first - start) * size:(end - start) * size]
            head = min(-offset % PAGE, part.size)
            pages = (part.size - head) // PAGE * PAGE
            if pages and write_direct(path, part[head:head + pages], offset + head):
                rest = [(part[:head], offset), (part[head + pages:], offset + head + pages)]
            else:
                rest = [(part, offset)]
            for piece, at in rest:
                if piece.size:
                    pwrite_all(fd, piece, at)


def _placement(ds: h5py.Dataset) -> _Placement | None:
    """The dataset's placement (see _Placement), or None when its records are not plain
    bytes at known places (filters, partial-record chunks, unallocated or external storage,
    a type other than a plain number)."""
    if (ds.dtype.kind not in "iuf" or ds.dtype.names or not ds.shape or ds.size == 0 or ds.is_virtual
            or not hdf5_chunks.plain_numbers(ds)):
        return None
    plist = ds.id.get_create_plist()
    if plist.get_external_count():
        return None
    record_shape = tuple(ds.shape[1:])
    record_bytes = math.prod(record_shape) * ds.dtype.itemsize
    if plist.get_layout() == h5d.CONTIGUOUS:
        offset = ds.id.get_offset()
        if offset is None or ds.id.get_storage_size() < ds.nbytes:
            return None
        return _Placement(ds.dtype, ds.shape[0], record_shape, ds.shape[0], (offset,))
    if plist.get_layout() != h5d.CHUNKED or plist.get_nfilters() or tuple(ds.chunks[1:]) != record_shape:
        return None
    n = ds.chunks[0]
    count = -(-ds.shape[0] // n)
    if count > MAX_PLACED_CHUNKS or ds.id.get_num_chunks() != count:
        return None
    found: dict[int, int] = {}

    def visit(info) -> None:
        if info.size == n * record_bytes and not info.filter_mask:
            found[info.chunk_offset[0] // n] = info.byte_offset

    ds.id.chunk_iter(visit)
    if len(found) != count:
        return None
    return _Placement(ds.dtype, ds.shape[0], record_shape, n, tuple(found[i] for i in range(count)))


def _placement_within(ds: h5py.Dataset, size: int) -> _Placement | None:
    """The input dataset's placement if every piece lies inside the file's `size` bytes."""
    placement = _placement(ds)
    if placement is None or max(placement.offsets) + min(
            placement.chunk_records * placement.record_bytes, ds.nbytes) > size:
        return None
    return placement


@dataclass(frozen=True)
class _Records:
    """Reads records of one dataset, decoded by `encoding`. Opens the file on each call:
    h5py handles do not pickle, so this callable can go to worker processes."""

    path: Path
    dataset: str
    size: int  # the file's size at open
    encoding: cf.Encoding | None = None
    placement: _Placement | None = None  # read outside HDF5 when known
    deflated: hdf5_chunks.Deflated | None = None  # or its chunks decompressed outside HDF5

    def __call__(self, start: int, stop: int) -> np.ndarray:
        raw = self.stored(start, stop)
        if self.encoding is None:
            return raw
        return cf.decoded_records(raw, self.encoding)

    def stored(self, start: int, stop: int) -> np.ndarray:
        """Records start:stop as stored."""
        try:
            if self.placement is not None:
                block = self.placement.read(self.path, start, stop)
            else:
                with h5py.File(self.path, "r") as f:
                    ds = f[self.dataset]
                    block = ds[start:stop] if self.deflated is None else self.deflated.read(ds, start, stop)
        except MemoryError:  # not damage: the run says memory ran out
            raise
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


class Hdf5Reader(Reader):
    format = NAME

    def __init__(self, path: Path, options: FormatOptions):
        self.path = path
        self.messages: list[str] = []
        self.tensors: list[tensor_files.Tensor] = []  # Keras weights: the chosen ones
        self.variances: set[str] = set()  # Keras weights: the chosen moving variances
        self.encodings: dict[str, cf.Encoding] = {}  # job name -> its encoding, where it has one
        try:
            self.size = os.stat(path).st_size
            self.file = h5py.File(path, "r")
        except Exception as exc:
            if "unable to lock file" in str(exc):  # HDF5's file lock: a writer has it open
                raise InputError(f"{path}: another program has the HDF5 file open for writing (HDF5 "
                                 "refuses the read lock); close it there and run again") from None
            raise InputError(f"{path}: cannot read the HDF5 file ({_reason(exc)}); "
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
        perturbed = {_object_key(self.file[job.name]) for job in self.jobs}
        self.actions: dict[tuple[int, int], str] = {}  # object -> DROP or DIMENSION
        if not self.keras:  # a Keras file's datasets are all weights, copied when not perturbed
            roles = dict.fromkeys(self._grid_mappings(found), leftovers.GRID_MAPPING)
            roles.update(dict.fromkeys(self._coordinates(found), leftovers.COORDINATE))
            roles.update(dict.fromkeys(self._record_coordinates(found), leftovers.RECORD_COORDINATE))
            for name, ds in found.items():
                key = _object_key(ds)
                if key not in perturbed:
                    action = _dataset_action(left, name, ds, roles.get(key), options.exclude)
                    if action is not None:
                        self.actions[key] = action
        self.left_out_attrs: dict[tuple[int, int], dict[bytes, np.ndarray | None]] = {}  # object -> left out (None) or rewritten
        objects = [self.file["/"]]
        try:
            self.file.visititems(lambda name, obj: objects.append(obj))
            for obj in objects:
                key = _object_key(obj)
                if key not in self.actions:
                    names = [n for n in _attr_names(obj)
                             if not left.attribute(obj.name, n.decode("utf-8", "replace"))]
                    if names:
                        self.left_out_attrs[key] = dict.fromkeys(names)
        except Exception as exc:
            raise InputError(f"{self.path}: cannot read the HDF5 file's attributes ({_reason(exc)}); "
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
        them; listed either way. Soft links that resolve are structure, copied as links."""
        found: list[tuple[str, str, str]] = []  # (path, kind, reason)

        def visit(name, link):
            if isinstance(link, h5py.SoftLink) and self.file.get("/" + name) is None:
                found.append(("/" + name, "soft link", "a link to a path that holds nothing in the "
                              "file (its text can be any content)"))
            elif isinstance(link, h5py.ExternalLink):
                found.append(("/" + name, "external link", "a link into another file: its target's "
                              "file name and path are the input's metadata (--keep copies it as a link)"))

        try:
            self.file.visititems_links(visit)
        except Exception as exc:
            raise InputError(f"{self.path}: cannot read the HDF5 file's links ({_reason(exc)}); "
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
                if isinstance(obj, h5py.Dataset) and _object_key(obj) not in self.actions:  # copied
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
                _check_storage(self.path, self.size, name, ds, perturbed=False)
        except InputError:
            raise
        except Exception as exc:
            raise InputError(f"{self.path}: cannot read the HDF5 file's objects ({_reason(exc)}); "
                             "it may be truncated or corrupt") from None
        return found

    def _select_tensors(self, found: dict[str, h5py.Dataset], options: FormatOptions) -> list[ArrayJob]:
        """A Keras weights file: each weight one record, chosen as in any model file."""
        self.records_are_tensors = True
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
            _check_storage(self.path, self.size, tensor.name, found[tensor.name], perturbed=True)
        return [tensor_files.job(self.path, NAME, t, _Whole(self.path, t.name, self.size)) for t in chosen]

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
            for name in requested:
                name = posixpath.normpath("/" + name.strip("/"))
                ds = self._requested(name, found)
                chosen.setdefault(_object_key(ds), (name, ds))
            return list(chosen.values())

        numeric = {name: tuple(ds.shape) for name, ds in found.items()
                   if _is_numeric(ds.dtype) and ds.shape is not None and name not in excluded}
        if excluded:
            self.messages.append(f"left out the datasets {listing(sorted(excluded))} (--exclude)")
        coordinates = self._coordinates(found)
        left_out = [name for name, shape in numeric.items()
                    if _object_key(found[name]) in coordinates and len(shape) >= 2]
        numeric = {name: shape for name, shape in numeric.items()
                   if _object_key(found[name]) not in coordinates}
        names, message = default_selection(self.path, numeric, "dataset")
        self.messages.append(message)
        if left_out:
            self.messages.append(f"left out the coordinate datasets {listing(left_out)} "
                                 "(name them with --dataset to perturb them)")
        return [(name, found[name]) for name in names]

    def _coordinates(self, found: dict[str, h5py.Dataset]) -> set[tuple[int, int]]:
        """The datasets that locate or delimit the data rather than hold it: dimension
        scales (netCDF dimensions and coordinate variables) and the variables named in
        a dataset's coordinates, bounds, climatology or cell_measures attribute."""
        keys = set()
        for ds in found.values():
            with suppress(Exception):  # a malformed CLASS attribute: not a scale
                if h5ds.is_scale(ds.id):
                    keys.add(_object_key(ds))
        groups = _groups(self.file)
        named = cf.named(found, _text({**groups, **found}), cf.COORDINATE_REFERENCES, groups=groups)
        return keys | {_object_key(found[target]) for _, _, target in named}

    def _unname_dropped_coordinates(self, found: dict[str, h5py.Dataset]) -> None:
        """A coordinates, bounds, climatology or cell_measures attribute naming datasets the run
        leaves out (a record coordinate; one written as a bare dimension is no variable either)
        is written naming only the others (left out if none is left): CF readers look for every
        variable it names."""
        dropped = set(self.actions)  # DROP or DIMENSION
        groups = _groups(self.file)  # a group's own attributes name variables too (xarray's)
        for name, ds in [*found.items(), *groups.items()]:
            key = _object_key(ds)
            if key in self.actions:
                continue

            def gone(word: str, group: str = name if name in groups else posixpath.dirname(name)) -> bool:
                target = cf.variable(word, group, found)
                return target is not None and _object_key(target) in dropped

            for attr in cf.COORDINATE_REFERENCES:
                if attr.encode() in self.left_out_attrs.get(key, {}):
                    continue
                text = cf.unnamed(_attr_text(ds, attr), gone)
                if text is not None:
                    self.left_out_attrs.setdefault(key, {})[attr.encode()] = np.array(text.encode()) if text else None

    def _record_coordinates(self, found: dict[str, h5py.Dataset]) -> set[tuple[int, int]]:
        """The datasets that hold a value per record along the record dimension of a perturbed
        dataset, not a grid (cf.record_coordinates, leftovers.py)."""
        records = {job.row_dimension for job in self.jobs if job.row_dimension is not None}
        groups = _groups(self.file)
        paths = cf.record_coordinates(found, _text({**groups, **found}),
                                      lambda path: _dimensions(path, found[path]), records, groups=groups)
        return {_object_key(found[path]) for path in paths}

    @staticmethod
    def _grid_mappings(found: dict[str, h5py.Dataset]) -> set[tuple[int, int]]:
        """The CF grid mapping variables the datasets name (grid_mapping attributes)."""
        named = cf.named(found, lambda path, key: _attr_text(found[path], key), ["grid_mapping"],
                         leftovers.grid_mappings)
        return {_object_key(found[target]) for _, _, target in named}

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
        encoding = _encoding(self.path, name, ds)
        if encoding is not None:
            self.encodings[name] = encoding
            self.messages += cf.messages(name, ds.dtype, encoding)
        return ArrayJob(
            name=name, shape=shape, dtype=encoding.dtype if encoding else ds.dtype,
            read=_Records(self.path, name, self.size, encoding, _placement_within(ds, self.size),
                          hdf5_chunks.deflated(ds)),
            source={"path": str(self.path), "format": NAME, "dataset": name,
                    "shape": list(shape), "dtype": str(ds.dtype)},
            chunk_records=ds.chunks[0] if ds.chunks else None,
            row_dimension=_row_dimension(ds),
            markers=encoding.labelled() if encoding else (),
        )

    def arrays(self) -> list[ArrayJob]:
        return self.jobs

    def markers_are_data(self, data: dict[str, tuple[tuple[str, float], ...]]) -> None:
        cf.take_as_data(self.jobs, self.encodings, data)

    def missing_fill(self, fills: dict[str, float]) -> None:
        cf.fill_missing(self.jobs, self.encodings, fills)

    def close(self) -> None:
        self.file.close()


def open_reader(path: Path, options: FormatOptions) -> Hdf5Reader:
    return Hdf5Reader(path, options)


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


def _not_numbers(dtype: np.dtype) -> str | None:
    """What a dataset holds when it is not plain numbers (as a phrase); None for numbers."""
    return ("strings" if h5py.check_string_dtype(dtype) else
            "an enumerated (categorical) type" if h5py.check_enum_dtype(dtype) else
            "object references" if h5py.check_ref_dtype(dtype) else
            "variable-length sequences" if h5py.check_vlen_dtype(dtype) else
            "a compound (table) type" if dtype.names else
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
        if not _bare_dimension(ds):
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


def _dimensions(path: str, ds: h5py.Dataset) -> tuple[str, ...]:
    """The dimensions of a dataset's axes (netCDF's): the dimension scale attached to each
    axis that has one, or (path,) for a dimension scale itself; () in plain HDF5."""
    with suppress(Exception):  # malformed dimension-scale metadata: no names
        if h5ds.is_scale(ds.id):
            return (path,)
        return tuple(scales[0].name for scales in (list(dim.values()) for dim in ds.dims) if scales)
    return ()


def _row_dimension(ds: h5py.Dataset) -> str | None:
    """The dimension of axis 0 (netCDF's): the dimension scale attached to it, or the
    dataset itself if it is one; None in plain HDF5."""
    with suppress(Exception):  # malformed dimension-scale metadata: no name
        if h5ds.is_scale(ds.id):
            return ds.name
        scales = list(ds.dims[0].values())
        if scales:
            return scales[0].name
    return None


@dataclass(frozen=True)
class _Whole:
    """Reads one dataset whole, as one record (a model weight). Picklable."""

    path: Path
    dataset: str
    size: int  # the file's size at open

    def __call__(self, start: int, stop: int) -> np.ndarray:
        try:
            with h5py.File(self.path, "r") as f:
                values = np.asarray(f[self.dataset][()])
        except MemoryError:  # not damage: the run says memory ran out
            raise
        except Exception as exc:
            _check_not_shrunk(self.path, self.size)
            raise InputError(f"{self.path}: cannot read dataset {self.dataset} ({_reason(exc)})") from None
        _check_not_shrunk(self.path, self.size)
        return values[None][start:stop]


def _has_vlen(tid: h5t.TypeID) -> bool:
    kind = tid.get_class()
    if kind == h5t.VLEN or (kind == h5t.STRING and tid.is_variable_str()):
        return True
    if kind == h5t.ARRAY:
        return _has_vlen(tid.get_super())
    if kind == h5t.COMPOUND:
        return any(_has_vlen(tid.get_member_type(i)) for i in range(tid.get_nmembers()))
    return False


def _attr_names(obj) -> list[bytes]:
    """In creation order where the object tracks it (as netCDF-C lists them), else by name."""
    order = obj.id.get_create_plist().get_attr_creation_order()
    index = h5.INDEX_CRT_ORDER if order & h5p.CRT_ORDER_TRACKED else h5.INDEX_NAME
    names: list[bytes] = []
    h5a.iterate(obj.id, names.append, index_type=index)
    return names


def _copy_attrs(src, dst, replaced: Mapping[bytes, np.ndarray | None] | None = None) -> None:
    """Copies every attribute in its stored type and shape; `replaced` gives new values
    for some (None: left out)."""
    src, dst = (obj["/"] if isinstance(obj, h5py.File) else obj for obj in (src, dst))
    replaced = replaced or {}
    for name in _attr_names(src):
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
        if _has_vlen(stored) or _has_refs(stored):
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


def _copy_vlen_filled(src: h5py.Dataset, dst: h5py.Group, name: str,
                      left_out: dict[bytes, np.ndarray | None] | None) -> None:
    """Copies a dataset with a variable-length fill value (_vlen_fill) without HDF5's object
    copy: created anew with its chunks and filters but no fill value, its values written
    through h5py."""
    plist = src.id.get_create_plist()
    fresh = h5p.create(h5p.DATASET_CREATE)
    if plist.get_layout() == h5d.CHUNKED:
        fresh.set_chunk(src.chunks)
        for index in range(plist.get_nfilters()):
            code, flags, values, _ = plist.get_filter(index)
            fresh.set_filter(code, flags, values)
    fresh.set_attr_creation_order(plist.get_attr_creation_order())
    fresh.set_obj_track_times(plist.get_obj_track_times())
    out = h5py.Dataset(h5d.create(dst.id, name.encode(), src.id.get_type(), src.id.get_space(), dcpl=fresh))
    if src.shape:
        out[()] = src[()]
    _copy_attrs(src, out, left_out)


def _create_bare_dimension(src: h5py.Dataset, dst: h5py.Group, name: str) -> None:
    """A dimension scale whose values are left out, kept as a dimension: a scale of the same
    shape holding no data (big-endian float, never written), as netCDF-C writes a dimension
    without a variable, keeping its list of the datasets attached to it (references pointed
    into the output later, _fix_references). In a netCDF file it is named by netCDF-C's
    phrase and the length and keeps its dimension id; elsewhere it keeps its NAME."""
    out = dst.create_dataset(name, shape=src.shape, maxshape=src.maxshape, chunks=src.chunks, dtype=">f4",
                             fillvalue=np.float32(np.nan),  # read as missing
                             track_order=True)  # netCDF-C lists attributes in creation order
    netcdf = "_Netcdf4Dimid" in src.attrs
    names = [(b"CLASS", b"DIMENSION_SCALE")]
    if netcdf:
        names.append((b"NAME", BARE_DIMENSION + b"%10d" % src.shape[0]))
    for key, text in names:
        string = h5t.C_S1.copy()  # null-terminated, as netCDF-C writes them
        string.set_size(len(text) + 1)
        h5a.create(out.id, key, string, h5s.create(h5s.SCALAR)).write(np.array(text, dtype=f"S{len(text) + 1}"))
    kept = (b"_Netcdf4Dimid", b"REFERENCE_LIST") if netcdf else (b"NAME", b"REFERENCE_LIST")
    _copy_attrs(src, out, {name: None for name in _attr_names(src) if name not in kept})


class _Output:
    """The output file as h5py's file-object driver sees it: keeps the first error instead
    of raising it into HDF5, and drops the writes after it (see the module docstring)."""

    def __init__(self, path: Path):
        self.path = path
        self.fd: int | None = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
        self.position = 0
        self.failure: BaseException | None = None

    def open_fd(self) -> int:
        """The file's descriptor (ValueError once closed, as a closed Python file)."""
        if self.fd is None:
            raise ValueError("I/O operation on closed file")
        return self.fd

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        if whence == os.SEEK_CUR:
            offset += self.position
        elif whence == os.SEEK_END:
            try:
                offset += os.fstat(self.open_fd()).st_size
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
                pwrite_all(self.open_fd(), data, self.position)
            except BaseException as exc:
                self.failure = exc
        self.position += size
        return size

    def readinto(self, buffer) -> int:
        view = memoryview(buffer).cast("B")
        done = 0
        try:
            while done < len(view):
                count = os.preadv(self.open_fd(), [view[done:]], self.position + done)
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
                os.ftruncate(self.open_fd(), size)
            except BaseException as exc:
                self.failure = exc
        return size

    def flush(self) -> None:
        pass  # every write is in the file already; the writer syncs it when done

    def error(self) -> BaseException:
        """The error to raise for the failure kept (asked only once there is one)."""
        failure = self.failure
        assert failure is not None
        return write_error(self.path, failure) if isinstance(failure, OSError) else failure

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
    if fcpl.get_userblock() == 0:  # (HDF5 wants a user block larger than the alignment)
        fapl.set_alignment(PAGE, PAGE)  # objects of a page or more start on a page: direct writes
    return h5py.File(h5f.create(os.fsencode(output.path), h5f.ACC_TRUNC, fcpl=fcpl, fapl=fapl))


@contextmanager
def _signals_held() -> Iterator[None]:
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


class Hdf5Writer(Writer):
    def __init__(self, reader: Hdf5Reader, tmp_path: Path, dtype: np.dtype,
                 bounds: dict[str, tuple[float, float, float | None]] | None = None):
        self.path = tmp_path
        self.source = reader.path
        self.dtype = np.dtype(dtype)
        self.messages: list[str] = []
        src = self.src = reader.file
        self.to_perturb = {_object_key(src[job.name]): job.name for job in reader.jobs}
        # Keras weights: each keeps its dtype and shape (one record each), variances stay > 0
        self.tensors = {t.name: t for t in reader.tensors} if reader.records_are_tensors else {}
        self.variances = reader.variances
        self.datasets: dict[str, h5py.Dataset] = {}  # job name -> output dataset
        self.placements: dict[str, _Placement] = {}  # job name -> where its records go
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
        self.copied: dict[tuple[int, int], str] = {_object_key(src): "/"}  # source object -> output path
        self.pairs: list[tuple[str, str]] = [("/", "/")]  # (source path, output path) of each object
        fcpl = src.id.get_create_plist()  # user block size, ...
        # ... but not the root group's creation-order tracking (netCDF-C opens a file for
        # writing only with it, and lists variables and attributes in that order).
        root = src["/"].id.get_create_plist()
        fcpl.set_link_creation_order(root.get_link_creation_order())
        fcpl.set_attr_creation_order(root.get_attr_creation_order())
        try:
            with open(reader.path, "rb") as f:
                self.userblock = f.read(fcpl.get_userblock())  # HDF5 leaves it to its owner to write
            if not reader.keep_userblock:
                self.userblock = bytes(len(self.userblock))
        except OSError as exc:
            raise InputError(f"{reader.path}: cannot read ({reason_of(exc)})") from None
        with writing(tmp_path):
            self.output = _Output(tmp_path)
        self.file: h5py.File | None = None
        try:
            with self._hdf5():
                try:
                    self.file = _create_output(self.output, fcpl)
                except Exception as exc:
                    raise OutputError(f"{shown(tmp_path)}: cannot create the HDF5 file "
                                      f"({_reason(exc)})") from None
                self._copy_group(src, self.file)
                self._fix_references()
            if self.placements:  # the workers go on computing while the disk writes
                self._disk = Background(self._write_placed, f"tldp write {tmp_path.name}")
            self.postprocessing, self.manifest_extra = dropped_filters(self.dropped)
            if self.tensors:
                chosen = list(self.tensors.values())
                self.postprocessing += tensor_files.postprocessing(chosen, self.dtype, self.variances)
                self.output_dtype = tensor_files.output_dtype(chosen)
            self._describe_cf()
            if self.deflated:
                self.manifest_extra["deflate_huffman_only"] = sorted(self.deflated)
            _check_not_shrunk(reader.path, reader.size)  # what was copied came from the whole file
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
            _copy_attrs(src, dst, self.left_out_attrs.get(_object_key(src)))
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
        key = _object_key(obj)
        if key in self.copied:  # another hard link to an object already written
            dst[name] = self._created[self.copied[key]]
            return
        if self.actions.get(key) == DROP:  # under every name (references to it become null)
            return
        path = posixpath.join(dst.name, name)
        self.copied[key] = path
        self.pairs.append((obj.name, path))
        if key in self.to_perturb:
            self._create_perturbed(obj, dst, name, self.to_perturb[key])
        elif isinstance(obj, h5py.Group):
            group = h5py.Group(h5g.create(dst.id, name.encode(), gcpl=obj.id.get_create_plist()))
            self._copy_group(obj, group)
        elif self.actions.get(key) == DIMENSION:
            _create_bare_dimension(obj, dst, name)
        elif isinstance(obj, h5py.Dataset) and _vlen_fill(obj):
            _copy_vlen_filled(obj, dst, name, self.left_out_attrs.get(key))
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
                    if key in dst.attrs and _has_refs(src.attrs.get_id(key).get_type()):
                        self._remap_attribute(dst, key, self._remap(src.attrs[key]))
                if isinstance(src, h5py.Dataset) and src.shape and _has_refs(src.id.get_type()):
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
        path = self.copied.get(_object_key(target))
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
            fresh.set_obj_track_times(plist.get_obj_track_times())
            fresh.set_attr_creation_order(plist.get_attr_creation_order())
            plist = fresh
            space = h5s.create_simple(src.shape) if src.shape else h5s.create(h5s.SCALAR)
        replaced = {**self.left_out_attrs.get(_object_key(src), {}), **self._cf_attrs(src, job_name)}
        fill_attr = replaced.get(b"_FillValue")
        if fill_attr is not None and fill_attr.size:  # HDF5's fill value, as netCDF-C sets it
            plist.set_fill_value(np.array(fill_attr.flat[0], dtype=self.dtype))
        elif b"_FillValue" in replaced and plist.fill_value_defined() == h5d.FILL_VALUE_USER_DEFINED:
            # An in-range _FillValue left off: netCDF-C would still take HDF5's for the variable's
            # fill value, so it becomes one no noisy value takes (NaN, or the least integer).
            plist.set_fill_value(np.array(cf.output_marker(np.nan, self.dtype), dtype=self.dtype))
        # Model tensors go through tensor_files.to_stored (their dtype, variances kept > 0).
        placed = job_name not in self.tensors and self._place(plist, src)
        out = h5py.Dataset(h5d.create(dst.id, name.encode(), h5t.py_create(dtype), space, dcpl=plist))
        _copy_attrs(src, out, replaced)
        self.datasets[job_name] = out
        if placed and (placement := _placement(out)) is not None:
            self.placements[job_name] = placement
        elif job_name not in self.tensors and (deflated := hdf5_chunks.deflated(out, allocated=False)):
            self.deflated[job_name] = dataclasses.replace(deflated, huffman_only=True)

    def _place(self, plist: h5p.PropDCID, src: h5py.Dataset) -> bool:
        """Allocates the dataset's storage when it is created, without writing fill values,
        if its records can then be written as plain bytes (see _Placement): the pipeline
        writes every record."""
        if (self.dtype.kind not in "iuf" or not src.shape or plist.get_nfilters()
                or (plist.get_layout() == h5d.CHUNKED and tuple(src.chunks[1:]) != tuple(src.shape[1:]))
                or -(-src.shape[0] // (src.chunks or src.shape)[0]) > MAX_PLACED_CHUNKS):
            return False
        plist.set_alloc_time(h5d.ALLOC_TIME_EARLY)
        plist.set_fill_time(h5d.FILL_TIME_NEVER)
        return True

    def _cf_attrs(self, src: h5py.Dataset, job_name: str) -> dict[bytes, np.ndarray | None]:
        """The CF attributes a perturbed dataset gets instead of its own (None: left out):
        the missing-data markers in the output dtype; no value bounds; no packing."""
        encoding = self.encodings.get(job_name)
        replaced: dict[bytes, np.ndarray | None] = {}
        dropped = [key for key in cf.VALUE_BOUNDS if key in src.attrs]
        if encoding is not None and (encoding.packed or encoding.unsigned):
            dropped += [key for key in cf.PACKING if key in src.attrs]
        for key in dropped:
            replaced[key.encode()] = None
        if dropped:
            self.dropped_attrs[job_name] = dropped
        if encoding is None:
            return replaced
        self.missing[job_name] = [(marker, cf.output_marker(marker, self.dtype))
                                  for marker in encoding.markers]
        for key in cf.MISSING:
            values = _attr_numbers(self.source, job_name, src, key)
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
            # The block holds noise where the input is missing: read which positions those are.
            records = job.read
            assert isinstance(records, _Records)  # the input's: markers come from its encodings
            stored = records.stored(start, start + len(block))
            block = block.copy()  # the caller's block is not ours to change
            moved, held = cf.keep_missing(block, stored, markers, self._bounds(job.name))
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

    def _bounds(self, job_name: str) -> tuple[float, float, float | None]:
        return self.bounds.get(job_name) or (-math.inf, math.inf, None)

    def finish(self) -> None:
        cf.count_moves(self.manifest_extra, self.moved)
        if self.held_missing:
            self.messages.append(cf.missing_message(sorted(self.held_missing)))

    def _write_placed(self, item: tuple[_Placement, int, np.ndarray]) -> None:
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


def create_writer(reader: Hdf5Reader, tmp_path: Path, dtype: np.dtype,
                  options: FormatOptions) -> Hdf5Writer:
    return Hdf5Writer(reader, tmp_path, dtype, options.value_bounds)


COEFFICIENT_DIMENSION = "coefficient"


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

    def __init__(self, reader: Hdf5Reader, jobs: list[ArrayJob], tmp_path: Path, dtype: np.dtype):
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
        out = h5py.Dataset(h5d.create(dst.id, name.encode(), h5t.py_create(self.dtype), space, dcpl=plist))
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
            row = _row_dimension(src)
            written = self.copied.get(_object_key(self.src[row])) if row else None
            if row is None or written is None:
                continue  # plain HDF5: no dimensions
            group = out.parent
            if group.name not in made:
                if COEFFICIENT_DIMENSION in group:
                    raise UsageError(f"{self.source}: --store coefficients names the new dimension "
                                     f"{COEFFICIENT_DIMENSION}, which {group.name} holds already")
                scale = group.create_dataset(COEFFICIENT_DIMENSION, data=np.arange(out.shape[1], dtype=np.int32))
                scale.attrs["long_name"] = "index of the released coefficient (privunit.stored in the manifest)"
                scale.make_scale(COEFFICIENT_DIMENSION)
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
        written = {_object_key(out) for _, out in self.coefficients}
        copied = (file[path] for path in sorted(set(self.copied.values())))
        scales = [obj for obj in copied if isinstance(obj, h5py.Dataset) and "REFERENCE_LIST" in obj.attrs]
        for scale in scales:
            value = scale.attrs["REFERENCE_LIST"]
            keep = [bool(ref) and _object_key(file[ref]) not in written for ref in value["dataset"]]
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
            key = _object_key(target)
            if key not in self.copied or self.actions.get(key) == DIMENSION or key in self.to_perturb:
                return None  # not written, a bare dimension (no variable), or coefficients itself
            return _dimensions(target.name, target)

        text = cf.coefficient_coordinates(_attr_text(src, "coordinates"), dimensions, row)
        if text:
            out.attrs.create("coordinates", np.array(text.encode()))


def create_coefficient_writer(reader: Hdf5Reader, jobs: list[ArrayJob], tmp_path: Path, dtype: np.dtype,
                              options: FormatOptions) -> Hdf5CoefficientWriter:
    return Hdf5CoefficientWriter(reader, jobs, tmp_path, dtype)


FORMAT = Format(
    name=NAME, title="HDF5 file", suffixes=(".h5", ".hdf5", ".hdf", ".he5", ".nc", ".nc4", ".cdf"),
    compound_suffixes=(".weights.h5",),
    selects_arrays=True, honours_exclude=True, honours_keep=True, cf_markers=True, shares_rows=True,
    can_open=can_open, default_output=default_output, open_reader=open_reader, create_writer=create_writer,
    create_coefficient_writer=create_coefficient_writer,
    docs=(DocRow("HDF5 file", "the HDF5 signature (any suffix)",
                 "`tldp perturb sample_data/digits.h5 --eps 1 --dataset images`",
                 "`digits.tldp.h5`: same groups, structural attributes, chunks, filters; labels and other "
                 "datasets not perturbed left out ([below](#what-is-not-perturbed))"),
          DocRow("Keras 3 `.weights.h5`", "an HDF5 file with the Keras weights layout",
                 "`tldp perturb model.weights.h5 --eps 1 --clip 0.1`",
                 "`model.tldp.weights.h5`: the same groups, attributes, dtypes and shapes")),
)
