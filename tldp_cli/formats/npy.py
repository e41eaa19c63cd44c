"""NumPy .npy files: memory-mapped input read block by block, output written with
positional writes so blocks can land in any order."""

from __future__ import annotations

import hashlib
import io
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tldp_cli.errors import InputError, UsageError
from tldp_cli.formats import ArrayJob, FormatOptions, check_numeric_dtype

NAME = "npy"
MAGIC = b"\x93NUMPY"


def can_open(path: Path) -> bool:
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(len(MAGIC)) == MAGIC


def default_output(path: Path) -> Path:
    stem = path.name[:-4] if path.name.endswith(".npy") else path.name
    return path.with_name(stem + ".tldp.npy")


def _header(path: Path) -> tuple[tuple[int, ...], bool, np.dtype]:
    try:
        with open(path, "rb") as f:
            major, _ = np.lib.format.read_magic(f)
            read_header = (np.lib.format.read_array_header_1_0 if major == 1
                           else np.lib.format.read_array_header_2_0)
            shape, fortran, dtype = read_header(f)
    except Exception as exc:  # numpy raises ValueError, OSError or worse on garbage
        raise InputError(f"{path}: not a valid .npy file ({exc})") from None
    return tuple(shape), fortran, dtype


@dataclass(frozen=True)
class _Records:
    """Reads records [start, stop). Picklable: maps the file inside each call."""

    path: Path

    def __call__(self, start: int, stop: int) -> np.ndarray:
        # A fresh map per block keeps resident memory flat however large the file.
        mm = np.load(self.path, mmap_mode="r", allow_pickle=False)
        try:
            return np.array(mm[start:stop])
        finally:
            del mm


class NpyReader:
    format = NAME

    def __init__(self, path: Path, options: FormatOptions):
        self.path = path
        if options.datasets:
            raise UsageError(f"{path}: --dataset applies to HDF5, Zarr and model files "
                             "(.npz, .safetensors), not .npy")
        shape, _, dtype = _header(path)
        check_numeric_dtype(path, dtype)
        if len(shape) == 0:
            raise InputError(f"{path}: a 0-d array has no records (axis 0 indexes records)")
        if shape[0] == 0:
            raise InputError(f"{path}: the array has no records (shape {shape})")
        try:
            mm = np.load(path, mmap_mode="r", allow_pickle=False)
            del mm
        except Exception as exc:
            raise InputError(f"{path}: cannot read the array data ({exc}); the file may be truncated") from None
        self.job = ArrayJob(
            name="array", shape=shape, dtype=dtype, read=_Records(path),
            source={"path": str(path), "format": NAME, "shape": list(shape), "dtype": str(dtype)},
        )

    def arrays(self) -> list[ArrayJob]:
        return [self.job]

    def close(self) -> None:
        pass


def open_reader(path: Path, options: FormatOptions) -> NpyReader:
    return NpyReader(path, options)


@dataclass(frozen=True)
class _Blocks:
    """Writes a block of records at its place in the output. Picklable: opens the file
    inside each call, so blocks can be written from Dask worker processes."""

    path: Path
    offset: int  # where the data starts, after the header
    row_bytes: int
    dtype: np.dtype

    def __call__(self, job: ArrayJob, start: int, block: np.ndarray) -> None:
        data = np.ascontiguousarray(block, dtype=self.dtype)
        fd = os.open(self.path, os.O_WRONLY)
        try:
            os.pwrite(fd, data.data, self.offset + start * self.row_bytes)
        finally:
            os.close(fd)


class NpyWriter:
    def __init__(self, job: ArrayJob, tmp_path: Path, dtype: np.dtype):
        self.path = tmp_path
        dtype = np.dtype(dtype)
        header = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False,
                  "shape": tuple(job.shape)}
        head = io.BytesIO()
        np.lib.format.write_array_header_2_0(head, header)
        with open(tmp_path, "wb") as f:
            f.write(head.getvalue())
            f.truncate(len(head.getvalue()) + job.records * job.elements * dtype.itemsize)
        self._blocks = _Blocks(tmp_path, len(head.getvalue()), job.elements * dtype.itemsize, dtype)
        # The manifest's sha256, computed as the blocks are written rather than by reading
        # the whole output again at the end: the prefix written so far, in file order.
        self._sha256 = hashlib.sha256(head.getvalue())
        self._records = job.records
        self._hashed = 0  # records hashed
        # Blocks written beyond that prefix: start -> (stop, the block, or None to read it
        # back). At most the blocks in flight wait here.
        self._waiting: dict[int, tuple[int, np.ndarray | None]] = {}
        self._lock = threading.Lock()

    def write(self, job: ArrayJob, start: int, block: np.ndarray) -> None:
        """Writes a block (from any thread, in any order) and hashes it from memory."""
        data = np.ascontiguousarray(block, dtype=self._blocks.dtype)
        self._blocks(job, start, data)
        self._hash(start, start + len(data), data)

    def block_writer(self) -> _Blocks:
        return self._blocks  # blocks it writes elsewhere are hashed by block_written

    def block_written(self, job: ArrayJob, start: int, stop: int) -> None:
        """Records [start, stop) are in the file, whoever wrote them."""
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
                    self._sha256.update(data)
                self._hashed = stop

    def _hash_from_file(self, start: int, stop: int) -> None:
        position = self._blocks.offset + start * self._blocks.row_bytes
        end = self._blocks.offset + stop * self._blocks.row_bytes
        fd = os.open(self.path, os.O_RDONLY)
        try:
            while position < end:
                chunk = os.pread(fd, min(1 << 22, end - position), position)
                if not chunk:
                    raise OSError(f"{self.path}: shorter than the records written")
                self._sha256.update(chunk)
                position += len(chunk)
        finally:
            os.close(fd)

    def digests(self) -> dict[Path, str]:
        """sha256 of the output once every record is written, else nothing."""
        return {self.path: self._sha256.hexdigest()} if self._hashed == self._records else {}

    def close(self) -> list[Path]:
        # Blocks may have been written by other processes: fsync flushes the file's pages
        # whoever wrote them.
        fd = os.open(self.path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        return [self.path]


def create_writer(reader: NpyReader, tmp_path: Path, dtype: np.dtype,
                  options: FormatOptions) -> NpyWriter:
    return NpyWriter(reader.job, tmp_path, dtype)
