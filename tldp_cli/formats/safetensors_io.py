"""Reading and writing safetensors files, shared by the formats that hold them (a single
.safetensors file, and the shards of a sharded model folder); not a format itself.

A file is read as its raw header (length prefix included), its `__metadata__` and its
tensors in file order, each with its data offsets; the safetensors library validates
the header (offsets, sizes, coverage of the data, no two tensors sharing bytes). An
output reuses the input's header, with only the `__metadata__` keys the run keeps, so
names, dtypes, shapes, order and offsets come through byte for byte: the tensors not
perturbed are copied at their offsets and the perturbed ones written at theirs.

Tensors are read with the `safetensors.numpy` API (safe_open, framework "np"). NumPy has
no bfloat16, so bfloat16 tensors are read from their offsets as float32 (exactly) and
written back rounded to bfloat16. A tensor larger than a block is read from its offsets
and written at them part by part (ReadParts, TensorBlocks.part): memory stays flat
whatever the tensor's size.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tldp_cli.errors import InputError, OutputError, reason_of
from tldp_cli.files.checked_io import copy_bytes, json_value, pwrite_all, writing
from tldp_cli.formats import ArrayJob, tensor_files
from tldp_cli.formats.tensor_files import Tensor

MAX_HEADER = 100_000_000  # the safetensors library's own limit
STRUCTURAL_METADATA = ("format",)  # __metadata__ keys kept: transformers loads only {"format": "pt", ...}
METADATA_REASON = "a __metadata__ entry (free text), not perturbed; only format, which loaders need, is kept"
DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
          "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8",
          "U64": "uint64", "U32": "uint32", "U16": "uint16", "U8": "uint8", "BOOL": "bool",
          "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "C64": "complex64",
          # the microscaling formats (MXFP4, NVFP4, ...): FP6 and FP4 weights, E8M0 their block scales
          "F8_E8M0": "float8_e8m0fnu", "F6_E2M3": "float6_e2m3fn", "F6_E3M2": "float6_e3m2fn",
          "F4": "float4_e2m1fn"}


def invalid(path: Path, reason: str) -> InputError:
    return InputError(f"{path}: not a valid safetensors file ({reason}); it may be truncated or corrupt")


@dataclass(frozen=True)
class Entry:
    tensor: Tensor
    begin: int  # data offsets, relative to the end of the header
    end: int


def header_with(header: bytes, metadata: dict[str, str]) -> bytes:
    """The header (length prefix included) with `metadata` as its `__metadata__` (none if
    empty), padded with spaces to a multiple of 8 bytes as the safetensors library writes."""
    parsed = json.loads(header[8:])
    parsed.pop("__metadata__", None)
    if metadata:
        parsed = {"__metadata__": metadata, **parsed}
    text = json.dumps(parsed, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def parse(path: Path) -> tuple[bytes, dict, list[Entry]]:
    """The raw header (length prefix included), its __metadata__ and the tensors in file order."""
    try:
        with open(path, "rb") as f:
            length = struct.unpack("<Q", f.read(8))[0]
            size = os.fstat(f.fileno()).st_size
            if length > size - 8:  # never read (and allocate) what a damaged length claims
                raise invalid(path, f"its header of {length} bytes ends after the file, {size - 8} bytes in")
            raw = f.read(length)
    except OSError as exc:
        raise InputError(f"{path}: cannot read ({reason_of(exc)})") from None
    except struct.error:
        raise invalid(path, "it is shorter than the 8 bytes of its header's length") from None
    if len(raw) < length:
        raise invalid(path, f"its header of {length} bytes ends after the file, {len(raw)} bytes in")
    header = json_value(raw, f"{path}: not a valid safetensors file: its header")
    if not isinstance(header, dict):
        raise invalid(path, "the header is not a JSON object")
    # The library checks offsets, sizes and coverage of the data; its message says what is wrong.
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="np") as f:
            metadata = f.metadata()
    except Exception as exc:
        raise invalid(path, reason_of(exc)) from None
    entries = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = DTYPES.get(info["dtype"], info["dtype"].lower())
        begin, end = info["data_offsets"]
        entries.append(Entry(Tensor(name, tuple(info["shape"]), dtype), begin, end))
    entries.sort(key=lambda e: (e.begin, e.end))
    return struct.pack("<Q", length) + raw, metadata or {}, entries


@dataclass(frozen=True)
class ReadTensor:
    """Reads one tensor whole (one record). Picklable: opens the file inside each call."""

    path: Path
    entry: Entry
    data_start: int

    def __call__(self, start: int, stop: int) -> np.ndarray:
        tensor = self.entry.tensor
        try:
            if tensor.dtype == "bfloat16":
                with open(self.path, "rb") as f:
                    f.seek(self.data_start + self.entry.begin)
                    raw = f.read(self.entry.end - self.entry.begin)
                bits = np.frombuffer(raw, dtype="<u2")
                values = tensor_files.bfloat16_to_float32(bits).reshape(tensor.shape)
            else:
                from safetensors import safe_open

                with safe_open(str(self.path), framework="np") as f:
                    values = f.get_tensor(tensor.name)
        except MemoryError:  # not damage: the run says memory ran out
            raise
        except Exception as exc:
            raise InputError(f"{self.path}: cannot read tensor {tensor.name} ({reason_of(exc)})") from None
        return np.asarray(values)[None][start:stop]


@dataclass(frozen=True)
class ReadParts:
    """Reads one tensor in parts from its offsets (ArrayJob.read_parts): one part in memory
    at a time, bfloat16 as float32 (exactly). Picklable: opens the file inside each call."""

    path: Path
    entry: Entry
    data_start: int

    def __call__(self, record: int, part: int) -> Iterator[np.ndarray]:
        tensor = self.entry.tensor
        bfloat16 = tensor.dtype == "bfloat16"
        stored = np.dtype("<u2" if bfloat16 else np.dtype(tensor.dtype).newbyteorder("<"))
        try:
            with open(self.path, "rb") as f:
                f.seek(self.data_start + self.entry.begin)
                for first in range(0, tensor.size, part):
                    count = min(part, tensor.size - first)
                    raw = f.read(count * stored.itemsize)
                    if len(raw) < count * stored.itemsize:
                        raise OSError(f"the file ends inside it, {first + len(raw) // stored.itemsize} elements in")
                    values = np.frombuffer(raw, stored)
                    yield tensor_files.bfloat16_to_float32(values) if bfloat16 else values
        except OSError as exc:
            raise InputError(f"{self.path}: cannot read tensor {tensor.name} ({reason_of(exc)})") from None


@dataclass(frozen=True)
class TensorBlocks:
    """Writes a perturbed tensor at its offset. Picklable: opens the file inside each call."""

    path: Path
    data_start: int
    offsets: dict  # tensor name -> (begin, end)
    variances: frozenset[str]  # kept > 0 (tensor_files.to_stored)

    def __call__(self, job: ArrayJob, start: int, block: np.ndarray) -> None:
        begin, end = self.offsets[job.name]
        data = self._stored(job, block[0])
        if data.nbytes != end - begin:
            raise OutputError(f"{self.path}: tensor {job.name} would take {data.nbytes} bytes, "
                              f"not {end - begin}")
        self._pwrite(data, begin)

    def part(self, job: ArrayJob, record: int, first: int, values: np.ndarray) -> None:
        """Writes part of a perturbed tensor, its values from element `first` on (Writer.part_writer)."""
        begin, end = self.offsets[job.name]
        data = self._stored(job, values)
        offset = begin + first * data.itemsize
        if offset + data.nbytes > end:
            raise OutputError(f"{self.path}: tensor {job.name} would end {offset + data.nbytes - end} bytes "
                              "after its offsets")
        self._pwrite(data, offset)

    def _stored(self, job: ArrayJob, values: np.ndarray) -> np.ndarray:
        data = tensor_files.to_stored(values, job.source["dtype"], positive=job.name in self.variances)
        return data.astype(data.dtype.newbyteorder("<"), copy=False)  # safetensors is little-endian

    def _pwrite(self, data: np.ndarray, offset: int) -> None:
        """`data` at `offset` of the tensors' data."""
        with writing(self.path):
            fd = os.open(self.path, os.O_WRONLY)
            try:
                pwrite_all(fd, np.ascontiguousarray(data).reshape(-1).view(np.uint8), self.data_start + offset)
            finally:
                os.close(fd)


def start_output(source: Path, source_data_start: int, entries: list[Entry], out_header: bytes,
                 target: Path, chosen: set[str], variances: set[str]) -> TensorBlocks:
    """Creates `target` with `out_header`, the tensors not in `chosen` copied unchanged at
    their offsets and room for the others; returns what writes those."""
    end = max((e.end for e in entries), default=0)
    data_start = len(out_header)  # the output's: its __metadata__ may be shorter
    with open(source, "rb") as src, writing(target), open(target, "xb") as out:
        out.write(out_header)
        out.truncate(data_start + end)
        for e in entries:  # the tensors that are not perturbed, unchanged
            if e.tensor.name not in chosen:
                src.seek(source_data_start + e.begin)
                out.seek(data_start + e.begin)
                copy_bytes(src, source, out, target, e.end - e.begin)
    return TensorBlocks(target, data_start, {e.tensor.name: (e.begin, e.end) for e in entries},
                        frozenset(variances))
