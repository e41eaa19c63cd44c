"""Where an HDF5 dataset's records are stored, and reading and writing them (formats/hdf5.py):
through h5py, or outside HDF5 at their places in the file (Placement) where their bytes
allow it.

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
import re
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np
from h5py import h5d

from tldp_cli.errors import InputError, reason_of
from tldp_cli.files.checked_io import pwrite_all, write_direct
from tldp_cli.formats import cf, hdf5_chunks
from tldp_cli.sampling.engine import PAGE

FILL_LIMIT = 1 << 30  # bytes of a perturbed dataset read as fill value, allowed whatever the file's size
FILL_RATIO = 16  # ... or this many times the file's size


def reason(exc: Exception) -> str:
    """h5py's 'Unable to synchronously open file (truncated file: ...)' -> 'truncated file: ...'."""
    text = str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)  # str() quotes a key
    match = re.fullmatch(r"Unable to (?:synchronously )?[^(]*\((.*)\)", text, re.DOTALL)
    return (match.group(1) if match else text).strip() or reason_of(exc)


def check_not_shrunk(path: Path, size: int) -> None:
    """Raises if the file is shorter than `size`, its size at open."""
    try:
        now = os.stat(path).st_size
    except OSError as exc:
        raise InputError(f"{path}: cannot read ({reason_of(exc)})") from None
    if now < size:
        raise InputError(f"{path}: the file shrank from {size} to {now} bytes while tldp was "
                         "reading it")


# Datasets of more chunks than this are read and written through HDF5: listing where
# each chunk lies would cost more than the lock it saves.
MAX_PLACED_CHUNKS = 1 << 16


@dataclass(frozen=True)
class Placement:
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


def placement_of(ds: h5py.Dataset) -> Placement | None:
    """The dataset's placement (see Placement), or None when its records are not plain
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
        return Placement(ds.dtype, ds.shape[0], record_shape, ds.shape[0], (offset,))
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
    return Placement(ds.dtype, ds.shape[0], record_shape, n, tuple(found[i] for i in range(count)))


def placement_within(ds: h5py.Dataset, size: int) -> Placement | None:
    """The input dataset's placement if every piece lies inside the file's `size` bytes."""
    placement = placement_of(ds)
    if placement is None or max(placement.offsets) + min(
            placement.chunk_records * placement.record_bytes, ds.nbytes) > size:
        return None
    return placement


@dataclass(frozen=True)
class Records(cf.EncodedRecords):
    """Reads records of one dataset, decoded by `encoding`. Opens the file on each call:
    h5py handles do not pickle, so this callable can go to worker processes."""

    path: Path
    dataset: str
    size: int  # the file's size at open
    encoding: cf.Encoding | None = None
    placement: Placement | None = None  # read outside HDF5 when known
    deflated: hdf5_chunks.Deflated | None = None  # or its chunks decompressed outside HDF5

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
            check_not_shrunk(self.path, self.size)  # the likelier cause of "truncated file"
            raise InputError(f"{self.path}: cannot read records {start}:{stop} of dataset "
                             f"{self.dataset} ({reason(exc)})") from None
        check_not_shrunk(self.path, self.size)  # a part cut off during the read came back as zeros
        return block


def check_storage(path: Path, size: int, name: str, ds: h5py.Dataset, perturbed: bool) -> None:
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


@dataclass(frozen=True)
class Whole:
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
            check_not_shrunk(self.path, self.size)
            raise InputError(f"{self.path}: cannot read dataset {self.dataset} ({reason(exc)})") from None
        check_not_shrunk(self.path, self.size)
        return values[None][start:stop]
