"""NumPy .npy files: input read block by block with positional reads (a Fortran-order
array's block one read per element of the record, where its records run contiguous;
memory-mapped where those runs are shorter than a page), output written with positional
writes so blocks can land in any order.

The output's data starts at a page boundary (the header is padded to PAGE bytes,
which the format allows) so that whole pages of a block go to the disk with
direct I/O (O_DIRECT): written from the block's memory, they are not copied into
the page cache. Writing gigabytes through the page cache costs a CPU second or
more per GB (more on virtual machines that hand freed memory back to their
host) and evicts the cache other jobs use; direct writes cost a few percent of
that. Filesystems without direct I/O get ordinary writes.

A bfloat16 array (ml_dtypes's, which JAX and flax hand to np.save) is stored as a 2-byte
void dtype with a byte order, '<V2', which np.load reads back as '|V2': it is read as
float32 (exactly), perturbed, and written back rounded to bfloat16 under the same
header (tensor_files). NumPy's own void dtypes ('|V2') are raw bytes and refused.
"""

from __future__ import annotations

import errno
import hashlib
import io
import math
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tldp_cli.sampling.engine import PAGE
from tldp_cli.errors import InputError, UsageError, reason_of
from tldp_cli.formats import (DATASET_FORMATS, ArrayJob, DocRow, Format, FormatOptions, Reader, Writer,
                              check_numeric_dtype, tensor_files, tldp_name)
from tldp_cli.files.checked_io import Background, fsync_file, pwrite_all, write_direct, writing

NAME = "npy"
MAGIC = b"\x93NUMPY"


def can_open(path: Path) -> bool:
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(len(MAGIC)) == MAGIC


def default_output(path: Path) -> Path:
    named = tldp_name(path, ".npy")
    return named if named.name.endswith(".npy") else path.with_name(path.name + ".tldp.npy")


def _header(path: Path) -> tuple[tuple[int, ...], bool, np.dtype, str | None]:
    """The array's shape, order and dtype, and the byte order of a bfloat16 array's values
    (tensor_files.bfloat16_order: from the header as stored), else None."""
    try:
        with open(path, "rb") as f:
            major, _ = np.lib.format.read_magic(f)
            read_header = (np.lib.format.read_array_header_1_0 if major == 1
                           else np.lib.format.read_array_header_2_0)
            shape, fortran, dtype = read_header(f)
            size = f.tell()
            f.seek(0)
            order = tensor_files.bfloat16_order(dtype, f.read(size)) if dtype.kind == "V" else None
    except Exception as exc:  # numpy raises ValueError, OSError or worse on garbage
        raise InputError(f"{path}: not a valid .npy file ({reason_of(exc)})") from None
    return tuple(shape), fortran, dtype, order


FORTRAN_READS = 4096  # a Fortran-order block in at most this many reads, or in runs of a page at least


@dataclass(frozen=True)
class _Records:
    """Reads records [start, stop). Picklable: opens the file inside each call."""

    path: Path
    offset: int  # where the array's data starts
    dtype: np.dtype  # as stored; a bfloat16 array's: its bit patterns (uint16 of its byte order)
    shape: tuple[int, ...]
    fortran: bool = False
    bfloat16: bool = False  # read as float32 (exactly)

    def __call__(self, start: int, stop: int) -> np.ndarray:
        block = self._stored(start, stop)
        return tensor_files.bfloat16_to_float32(block.view(self.dtype)) if self.bfloat16 else block

    def _stored(self, start: int, stop: int) -> np.ndarray:
        # Positional reads into the block: no memory map, whose pages (the whole file's, for a
        # Fortran-order array, whose every page a block of records touches) would count as resident.
        record_shape = self.shape[1:]
        if self.fortran and (stop - start) * self.dtype.itemsize < PAGE and math.prod(record_shape) > FORTRAN_READS:
            # Many runs shorter than a page (150,528 of 13 bytes for 13 RGB images of 224 x 224):
            # a page holds several, which one fault of a fresh map reads together; a read per
            # run, a system call each, took 60 times as long.
            mm = np.load(self.path, mmap_mode="r", allow_pickle=False)
            try:
                return np.array(mm[start:stop])
            finally:
                del mm
        fd = os.open(self.path, os.O_RDONLY)
        try:
            if not self.fortran:  # records are contiguous: one read
                block = np.empty((stop - start, *record_shape), self.dtype)
                self._read(fd, block, self.offset + start * block[:1].nbytes, stop)
                return block
            # Fortran order: element j of every record is contiguous, records start..stop of it
            # one read; column j is element j in Fortran order of the record's axes.
            columns = np.empty((math.prod(record_shape), stop - start), self.dtype)
            for j, column in enumerate(columns):
                self._read(fd, column, self.offset + (j * self.shape[0] + start) * self.dtype.itemsize, stop)
            return columns.reshape(*record_shape[::-1], stop - start).T
        finally:
            os.close(fd)

    def _read(self, fd: int, into: np.ndarray, position: int, stop: int) -> None:
        view = into.reshape(-1).view(np.uint8).data
        while view:
            count = os.preadv(fd, [view], position)
            if count == 0:
                raise InputError(f"{self.path}: the file ends before record {stop}; it may be truncated")
            view, position = view[count:], position + count


class NpyReader(Reader):
    format = NAME

    def __init__(self, path: Path, options: FormatOptions):
        self.path = path
        if options.datasets:
            raise UsageError(f"{path}: --dataset applies to {DATASET_FORMATS}, not .npy")
        shape, fortran, dtype, self.bfloat16 = _header(path)  # bfloat16: its values' byte order
        if self.bfloat16:
            stored = np.dtype(f"{self.bfloat16}u2")  # its bit patterns
        elif dtype.kind == "V" and dtype.names is None:  # not a record of fields: raw bytes
            raise InputError(f"{path}: the array holds {tensor_files.void_values(dtype)}")
        else:
            check_numeric_dtype(path, dtype)
            stored = dtype
        if len(shape) == 0:
            raise InputError(f"{path}: a 0-d array has no records (axis 0 indexes records)")
        if shape[0] == 0:
            raise InputError(f"{path}: the array has no records (shape {shape})")
        try:
            mm = np.load(path, mmap_mode="r", allow_pickle=False)
            offset = mm.offset
            del mm
        except Exception as exc:
            raise InputError(f"{path}: cannot read the array data ({reason_of(exc)}); the file may be "
                             "truncated") from None
        self.job = ArrayJob(
            name="array", shape=shape, dtype=np.dtype(np.float32) if self.bfloat16 else dtype,
            read=_Records(path, offset, stored, tuple(shape), fortran and len(shape) > 1, bool(self.bfloat16)),
            source={"path": str(path), "format": NAME, "shape": list(shape),
                    "dtype": "bfloat16" if self.bfloat16 else str(dtype)},
        )

    def arrays(self) -> list[ArrayJob]:
        return [self.job]

    def output_dtype(self, dtype: np.dtype) -> str | None:
        return "bfloat16" if self.bfloat16 else None

    def close(self) -> None:
        pass


def open_reader(path: Path, options: FormatOptions) -> NpyReader:
    return NpyReader(path, options)


@dataclass(frozen=True)
class _Blocks:
    """Writes a block of records at its place in the output. Picklable: opens the file
    inside each call, so blocks can be written from Dask worker processes."""

    path: Path
    offset: int  # where the data starts, after the header: a multiple of PAGE
    row_bytes: int
    dtype: np.dtype  # as stored; bfloat16's: its bit patterns (uint16 of its byte order)
    bfloat16: bool = False  # values rounded to bfloat16 (tensor_files.to_stored)

    def stored(self, block: np.ndarray) -> np.ndarray:
        """The block as written: contiguous, in the output's dtype."""
        if self.bfloat16:
            block = tensor_files.to_stored(block, "bfloat16")
        return np.ascontiguousarray(block, dtype=self.dtype)

    def __call__(self, job: ArrayJob, start: int, block: np.ndarray) -> None:
        self.write_stored(start, self.stored(block))

    def write_stored(self, start: int, data: np.ndarray) -> None:
        """Writes a block already in the output's dtype (stored) from record `start`."""
        with writing(self.path):
            self._write(data.reshape(-1).view(np.uint8), self.offset + start * self.row_bytes)

    def _write(self, data: np.ndarray, position: int) -> None:
        # The whole pages inside the block go direct; the partial pages at its ends (shared
        # with the neighbouring blocks, or the end of the file) through the page cache.
        head = min(-position % PAGE, data.size)
        pages = (data.size - head) // PAGE * PAGE
        if pages and write_direct(self.path, data[head:head + pages], position + head):
            rest = [(data[:head], position), (data[head + pages:], position + head + pages)]
        else:
            rest = [(data, position)]
        rest = [(part, at) for part, at in rest if part.size]
        if rest:
            fd = os.open(self.path, os.O_WRONLY)
            try:
                for part, at in rest:
                    pwrite_all(fd, part, at)
            finally:
                os.close(fd)


def _page_header(fields: dict) -> bytes:
    """A version 2.0 .npy header padded with spaces to PAGE bytes (NumPy pads to 64; any
    length that keeps the data aligned is valid, and NumPy reads it)."""
    head = io.BytesIO()
    np.lib.format.write_array_header_2_0(head, fields)
    natural = head.getvalue()
    text = natural[12:].rstrip(b" \n")  # after magic (6), version (2) and length (4)
    size = max(PAGE, -(-len(natural) // PAGE) * PAGE)
    return natural[:8] + (size - 12).to_bytes(4, "little") + text.ljust(size - 13) + b"\n"


class NpyWriter(Writer):
    def __init__(self, job: ArrayJob, tmp_path: Path, dtype: np.dtype, bfloat16: str | None = None):
        """`bfloat16`: the byte order of the input's bfloat16 values, which the output keeps
        (the engine's values rounded to bfloat16, under a '<V2' or '>V2' header)."""
        self.path = tmp_path
        noise_dtype, dtype = np.dtype(dtype), np.dtype(f"{bfloat16}u2" if bfloat16 else dtype)
        descr = f"{bfloat16}V2" if bfloat16 else np.lib.format.dtype_to_descr(dtype)
        header = _page_header({"descr": descr, "fortran_order": False, "shape": tuple(job.shape)})
        with writing(tmp_path), open(tmp_path, "wb") as f:
            f.write(header)
            f.truncate(len(header) + job.records * job.elements * dtype.itemsize)
        self._blocks = _Blocks(tmp_path, len(header), job.elements * dtype.itemsize, dtype, bool(bfloat16))
        if bfloat16:
            self.output_dtype = "bfloat16"
            self.postprocessing = tensor_files.postprocessing(
                [tensor_files.Tensor(job.name, job.record_shape, "bfloat16")], noise_dtype)
        # The manifest's sha256, computed as the blocks are written rather than by reading
        # the whole output again at the end: the prefix written so far, in file order.
        self._sha256 = hashlib.sha256(header)
        self._records = job.records
        self._hashed = 0  # records hashed
        # Blocks written beyond that prefix: start -> (stop, the block, or None to read it
        # back). At most the blocks in flight wait here.
        self._waiting: dict[int, tuple[int, np.ndarray | None]] = {}
        self._lock = threading.Lock()
        # write() hands each block to two threads, one writing it (mostly waiting for the
        # disk) and one hashing it from memory, so the workers go on computing meanwhile.
        self._submitted: set[int] = set()  # first records of the blocks write() took
        self._submitted_lock = threading.Lock()  # not _lock: the hasher holds that while it hashes
        self._disk = Background(lambda item: self._blocks.write_stored(*item), f"tldp write {tmp_path.name}")
        self._hasher = Background(lambda item: self._hash(*item), f"tldp hash {tmp_path.name}")

    def write(self, job: ArrayJob, start: int, block: np.ndarray) -> None:
        """Queues a block (from any thread, in any order) to be written and hashed from memory.
        A failure to write surfaces here, on a later call, or at close()."""
        data = self._blocks.stored(block)
        with self._submitted_lock:
            self._submitted.add(start)
        self._hasher.put((start, start + len(data), data))
        self._disk.put((start, data))

    def block_writer(self) -> _Blocks:
        return self._blocks  # blocks it writes elsewhere are hashed by block_written

    def block_written(self, job: ArrayJob, start: int, stop: int) -> None:
        """Records [start, stop) are in the file, written elsewhere (a block that went through
        write() is hashed by the writing thread, perhaps not yet written)."""
        with self._submitted_lock:
            if start in self._submitted:
                return
        self._hash(start, stop, None)

    def _hash(self, start: int, stop: int, data: np.ndarray | None) -> None:
        with self._lock:
            if start < self._hashed or start in self._waiting:
                return  # write() has it already
            self._waiting[start] = (stop, data)
            while self._hashed in self._waiting:
                stop, data = self._waiting.pop(self._hashed)
                if data is None:
                    self._hash_from_file(self._hashed, stop)
                else:
                    self._sha256.update(data.data)  # contiguous (write); .data: a memoryview of it
                self._hashed = stop

    def _hash_from_file(self, start: int, stop: int) -> None:
        position = self._blocks.offset + start * self._blocks.row_bytes
        end = self._blocks.offset + stop * self._blocks.row_bytes
        with writing(self.path):
            fd = os.open(self.path, os.O_RDONLY)
            try:
                while position < end:
                    chunk = os.pread(fd, min(1 << 22, end - position), position)
                    if not chunk:
                        raise OSError(errno.EIO, "it is shorter than the records written")
                    self._sha256.update(chunk)
                    position += len(chunk)
            finally:
                os.close(fd)

    def digests(self) -> dict[Path, str]:
        """sha256 of the output once every record is written, else nothing."""
        return {self.path: self._sha256.hexdigest()} if self._hashed == self._records else {}

    def close(self) -> list[Path]:
        """Waits for the queued blocks, raises a failure to write them, and flushes the file."""
        try:
            self._disk.close()
        finally:
            self._hasher.close()
        # Blocks may have been written by other processes: fsync flushes the file's pages
        # whoever wrote them.
        fsync_file(self.path)
        return [self.path]


def create_writer(reader: NpyReader, tmp_path: Path, dtype: np.dtype,
                  options: FormatOptions) -> NpyWriter:
    return NpyWriter(reader.job, tmp_path, dtype, reader.bfloat16)


def create_coefficient_writer(reader: NpyReader, jobs: list[ArrayJob], tmp_path: Path, dtype: np.dtype,
                              options: FormatOptions) -> NpyWriter:
    """--store coefficients: one (records, k) array, written as the records are."""
    return NpyWriter(jobs[0], tmp_path, dtype)


FORMAT = Format(
    name=NAME, title=".npy array", suffixes=(".npy",), single_array=True,
    can_open=can_open, default_output=default_output, open_reader=open_reader, create_writer=create_writer,
    create_coefficient_writer=create_coefficient_writer,
    docs=(DocRow("`.npy` array", "the NumPy magic bytes", "`tldp perturb sample_data/digits.npy --eps 1`",
                 "`digits.tldp.npy`: integers (int16) for integer input; the grid in float32 for float input, "
                 "rounded back to bfloat16 for ml_dtypes's bfloat16 (`<V2`)"),),
)
