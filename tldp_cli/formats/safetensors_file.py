"""safetensors files (Hugging Face), read as a model-parameter file: each tensor is
one record (see tensor_files).

Tensors keep their dtype and shape, so the output reuses the input's header: names,
dtypes, shapes, order and data offsets all come through, byte for byte. Of
`__metadata__` (free text: author, training data, ...) only `format` is kept, which
transformers needs, and the keys --keep names (formats.leftovers); the others are left
out and listed in the manifest (`dropped`). Perturbed tensors are written at their
offsets; the others are copied unchanged.

Tensors are read with the `safetensors.numpy` API (safe_open, framework "np"), which
also validates the header. NumPy has no bfloat16, so bfloat16 tensors are read from
their offsets as float32 (exactly) and written back rounded to bfloat16.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tldp_cli.errors import InputError, OutputError, reason_of
from tldp_cli.formats import (ArrayJob, DocRow, Format, FormatOptions, Reader, Writer, leftovers, tensor_files,
                              tldp_name)
from tldp_cli.files.checked_io import copy_bytes, fsync_file, json_value, pwrite_all, writing
from tldp_cli.formats.tensor_files import Tensor

NAME = "safetensors"
MAX_HEADER = 100_000_000  # the safetensors library's own limit
STRUCTURAL_METADATA = ("format",)  # __metadata__ keys kept: transformers loads only {"format": "pt", ...}
METADATA_REASON = "a __metadata__ entry (free text), not perturbed; only format, which loaders need, is kept"
DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
          "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8",
          "U64": "uint64", "U32": "uint32", "U16": "uint16", "U8": "uint8", "BOOL": "bool",
          "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "C64": "complex64"}


def can_open(path: Path) -> bool:
    """8 bytes of little-endian header length, then a JSON object (a file shorter than its
    header says is one, truncated: the reader says so)."""
    if not path.is_file():
        return False
    try:
        with open(path, "rb") as f:
            head = f.read(9)
    except OSError:
        return False
    if len(head) < 9:
        return False
    length = struct.unpack("<Q", head[:8])[0]
    return 2 <= length <= MAX_HEADER and head[8:9] == b"{"


def default_output(path: Path) -> Path:
    return tldp_name(path, path.suffix)


def _invalid(path: Path, reason: str) -> InputError:
    return InputError(f"{path}: not a valid safetensors file ({reason}); it may be truncated or corrupt")


@dataclass(frozen=True)
class _Entry:
    tensor: Tensor
    begin: int  # data offsets, relative to the end of the header
    end: int


def _header_with(header: bytes, metadata: dict[str, str]) -> bytes:
    """The header (length prefix included) with `metadata` as its `__metadata__` (none if
    empty), padded with spaces to a multiple of 8 bytes as the safetensors library writes."""
    parsed = json.loads(header[8:])
    parsed.pop("__metadata__", None)
    if metadata:
        parsed = {"__metadata__": metadata, **parsed}
    text = json.dumps(parsed, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def _parse(path: Path) -> tuple[bytes, dict, list[_Entry]]:
    """The raw header (length prefix included), its __metadata__ and the tensors in file order."""
    try:
        with open(path, "rb") as f:
            length = struct.unpack("<Q", f.read(8))[0]
            raw = f.read(length)
    except OSError as exc:
        raise InputError(f"{path}: cannot read ({reason_of(exc)})") from None
    if len(raw) < length:
        raise _invalid(path, f"its header of {length} bytes ends after the file, {len(raw)} bytes in")
    header = json_value(raw, f"{path}: not a valid safetensors file: its header")
    if not isinstance(header, dict):
        raise _invalid(path, "the header is not a JSON object")
    # The library checks offsets, sizes and coverage of the data; its message says what is wrong.
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="np") as f:
            metadata = f.metadata()
    except Exception as exc:
        raise _invalid(path, reason_of(exc)) from None
    entries = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = DTYPES.get(info["dtype"], info["dtype"].lower())
        begin, end = info["data_offsets"]
        entries.append(_Entry(Tensor(name, tuple(info["shape"]), dtype), begin, end))
    entries.sort(key=lambda e: (e.begin, e.end))
    return struct.pack("<Q", length) + raw, metadata or {}, entries


@dataclass(frozen=True)
class _Read:
    """Reads one tensor whole (one record). Picklable: opens the file inside each call."""

    path: Path
    entry: _Entry
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


class SafetensorsReader(Reader):
    format = NAME
    records_are_tensors = True  # the manifest gets per-tensor figures

    def __init__(self, path: Path, options: FormatOptions):
        self.path = path
        self.header, self.metadata, self.entries = _parse(path)
        self.data_start = len(self.header)
        tensors = [e.tensor for e in self.entries]
        chosen, self.messages, unperturbed = tensor_files.select(path, tensors, options.datasets,
                                                                 options.exclude)
        left = leftovers.Leftovers(list(options.keep), unperturbed=unperturbed)
        left.considered(t.name for t in tensors)
        kept = {key: value for key, value in self.metadata.items()
                if left.attribute("", key, STRUCTURAL_METADATA, "metadata key", METADATA_REASON)}
        left.check(path)
        self.manifest_extra = left.manifest_extra()
        self.out_header = self.header if kept == self.metadata else _header_with(self.header, kept)
        names = {t.name for t in chosen}
        self.jobs = [tensor_files.job(path, NAME, e.tensor, _Read(path, e, self.data_start))
                     for e in self.entries if e.tensor.name in names]

    def arrays(self) -> list[ArrayJob]:
        return self.jobs

    def close(self) -> None:
        pass


def open_reader(path: Path, options: FormatOptions) -> SafetensorsReader:
    return SafetensorsReader(path, options)


@dataclass(frozen=True)
class _Blocks:
    """Writes a perturbed tensor at its offset. Picklable: opens the file inside each call."""

    path: Path
    data_start: int
    offsets: dict  # tensor name -> (begin, end)
    variances: frozenset[str]  # kept > 0 (tensor_files.to_stored)

    def __call__(self, job: ArrayJob, start: int, block: np.ndarray) -> None:
        begin, end = self.offsets[job.name]
        data = tensor_files.to_stored(block[0], job.source["dtype"], positive=job.name in self.variances)
        data = data.astype(data.dtype.newbyteorder("<"), copy=False)  # safetensors is little-endian
        if data.nbytes != end - begin:
            raise OutputError(f"{self.path}: tensor {job.name} would take {data.nbytes} bytes, "
                              f"not {end - begin}")
        with writing(self.path):
            fd = os.open(self.path, os.O_WRONLY)
            try:
                pwrite_all(fd, np.ascontiguousarray(data).reshape(-1).view(np.uint8), self.data_start + begin)
            finally:
                os.close(fd)


class SafetensorsWriter(Writer):
    def __init__(self, reader: SafetensorsReader, tmp_path: Path, dtype: np.dtype):
        self.path = tmp_path
        chosen = {job.name for job in reader.jobs}
        tensors = [e.tensor for e in reader.entries if e.tensor.name in chosen]
        variances = tensor_files.variances(tensors)
        self.postprocessing = tensor_files.postprocessing(tensors, dtype, variances)
        self.output_dtype = tensor_files.output_dtype(tensors)
        end = max((e.end for e in reader.entries), default=0)
        data_start = len(reader.out_header)  # the output's: its __metadata__ may be shorter
        with open(reader.path, "rb") as src, writing(tmp_path), open(tmp_path, "xb") as out:
            out.write(reader.out_header)
            out.truncate(data_start + end)
            for e in reader.entries:  # the tensors that are not perturbed, unchanged
                if e.tensor.name not in chosen:
                    src.seek(reader.data_start + e.begin)
                    out.seek(data_start + e.begin)
                    copy_bytes(src, reader.path, out, tmp_path, e.end - e.begin)
        self.write = _Blocks(tmp_path, data_start,
                             {e.tensor.name: (e.begin, e.end) for e in reader.entries}, frozenset(variances))

    def block_writer(self) -> _Blocks:
        return self.write

    def close(self) -> list[Path]:
        fsync_file(self.path)
        return [self.path]


def create_writer(reader: SafetensorsReader, tmp_path: Path, dtype: np.dtype,
                  options: FormatOptions) -> SafetensorsWriter:
    return SafetensorsWriter(reader, tmp_path, dtype)


FORMAT = Format(
    name=NAME, title=".safetensors file", suffixes=(".safetensors",), member_noun="tensor",
    selects_arrays=True, honours_exclude=True, honours_keep=True,
    can_open=can_open, default_output=default_output, open_reader=open_reader, create_writer=create_writer,
    docs=(DocRow("`.safetensors` model file", "8-byte little-endian header length and a JSON header",
                 "`tldp perturb docs/type3/model.safetensors --eps 1 --clip 0.1`",
                 "`model.tldp.safetensors`: the same tensor entries byte for byte (names, dtypes, shapes, "
                 "order, offsets); of `__metadata__` only `format`"),),
)
