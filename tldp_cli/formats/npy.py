"""NumPy .npy files: memory-mapped input read block by block, output written with
positional writes so blocks can land in any order."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from tldp_cli.errors import InputError
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


class NpyReader:
    format = NAME

    def __init__(self, path: Path, options: FormatOptions):
        self.path = path
        if options.datasets:
            raise InputError(f"{path}: --dataset applies to HDF5 and Zarr inputs, not .npy")
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
            name="array", shape=shape, dtype=dtype, read=self._read,
            source={"path": str(path), "format": NAME, "shape": list(shape), "dtype": str(dtype)},
        )

    def _read(self, start: int, stop: int) -> np.ndarray:
        # A fresh map per block keeps resident memory flat however large the file.
        mm = np.load(self.path, mmap_mode="r", allow_pickle=False)
        try:
            return np.array(mm[start:stop])
        finally:
            del mm

    def arrays(self) -> list[ArrayJob]:
        return [self.job]

    def close(self) -> None:
        pass


def open_reader(path: Path, options: FormatOptions) -> NpyReader:
    return NpyReader(path, options)


class NpyWriter:
    def __init__(self, job: ArrayJob, tmp_path: Path, dtype: np.dtype):
        self.path = tmp_path
        self.dtype = np.dtype(dtype)
        self.row_bytes = job.elements * self.dtype.itemsize
        header = {"descr": np.lib.format.dtype_to_descr(self.dtype), "fortran_order": False,
                  "shape": tuple(job.shape)}
        with open(tmp_path, "wb") as f:
            np.lib.format.write_array_header_2_0(f, header)
            self.offset = f.tell()
            f.truncate(self.offset + job.records * self.row_bytes)
        self.fd = os.open(tmp_path, os.O_WRONLY)

    def write(self, job: ArrayJob, start: int, block: np.ndarray) -> None:
        data = np.ascontiguousarray(block, dtype=self.dtype)
        os.pwrite(self.fd, data.data, self.offset + start * self.row_bytes)

    def close(self) -> list[Path]:
        if self.fd is not None:
            os.fsync(self.fd)
            os.close(self.fd)
            self.fd = None
        return [self.path]


def create_writer(reader: NpyReader, tmp_path: Path, dtype: np.dtype,
                  options: FormatOptions) -> NpyWriter:
    return NpyWriter(reader.job, tmp_path, dtype)
