"""NumPy .npz archives of named arrays (np.savez, np.savez_compressed), read as a
model-parameter file: each member is one tensor, one record (see tensor_files).

The output is the same archive: every array member in its order, under its name,
with its compression and attributes, dated MEMBER_DATE (the input's dates can date when
the model was trained or a recording made, as numpy 1.x and zip wrote the time); perturbed members keep their dtype,
shape and byte order, and the other arrays (integer arrays, ...) are copied
unchanged. A bfloat16 array (ml_dtypes's, which JAX and flax hand to np.savez) is stored
as a 2-byte void dtype with a byte order, '<V2', which np.load reads back as '|V2': it is
read and perturbed as bfloat16 (tensor_files) and written back under the same header, in one
piece. Members that are not .npy arrays, arrays of strings, bytes, objects, records or other
void dtypes (text or raw bytes, not parameters) and zip comments (free text) are left out
unless --keep names them (formats.leftovers); an array of Python objects or a member that is a
pickle is never copied: a --keep naming it is refused. Members are written one after another: a
perturbed tensor waits in memory until the members before it are written (at most a few
blocks in flight). A tensor larger than a block, stored in C order, is read (decompressed)
and written (compressed) part by part, in flat memory; with several --workers, the parts of a
tensor whose turn has not come wait on disk, in an unnamed work file beside the output.
"""

from __future__ import annotations

import contextlib
import math
import os
import tempfile
import threading
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tldp_cli.errors import InputError, UsageError, reason_of
from tldp_cli.formats import (ArrayJob, DocRow, Format, FormatOptions, Reader, Writer, is_pickle, is_torch_zip,
                              leftovers, tensor_files, tldp_name, zip_first_member)
from tldp_cli.files.checked_io import copy_bytes, writing
from tldp_cli.formats.tensor_files import Tensor

NAME = "npz"
COMMENT = "a zip comment (free text), not perturbed"
# Every output member's date: zip's first, as numpy 2's np.savez writes them.
MEMBER_DATE = (1980, 1, 1, 0, 0, 0)


def _zip_head(path: Path) -> bytes:
    """A file's first local header and the name after it (as formats.zip_first_member reads
    them: the name's length is in the header); b"" if it cannot be read."""
    if not path.is_file():
        return b""
    try:
        with open(path, "rb") as f:
            head = f.read(30)
            return head + f.read(int.from_bytes(head[26:28], "little")) if len(head) == 30 else head
    except OSError:
        return b""


def _member_head(path: Path, info: zipfile.ZipInfo, size: int = 352) -> bytes:
    """The first `size` bytes of a member (decompressed), or b"" if it cannot be read."""
    try:
        with zipfile.ZipFile(path) as zf, zf.open(info) as f:
            return f.read(size)
    except (OSError, zipfile.BadZipFile, EOFError, ValueError, NotImplementedError):
        return b""


def can_open(path: Path) -> bool:
    """A zip archive whose first member is a .npy file; or a PyTorch checkpoint, which the
    reader refuses with the way to convert it."""
    head = _zip_head(path)
    first = zip_first_member(head)
    return first is not None and (first.endswith(b".npy") or is_torch_zip(head))


def default_output(path: Path) -> Path:
    named = tldp_name(path, ".npz")
    return named if named.name.endswith(".npz") else path.with_name(path.name + ".tldp.npz")


def _key(member: str) -> str:
    return member[:-4] if member.endswith(".npy") else member


def _dtype_name(dtype: np.dtype) -> str:
    return dtype.name if dtype.kind in "iufbc" else str(dtype)


def _not_numbers(dtype: np.dtype) -> str:
    """What a member that is not numbers holds; a plain void dtype is named with what
    tldp reads as numbers of those that look like it (bfloat16, tensor_files.bfloat16_order)."""
    if dtype.kind == "V" and dtype.names is None:
        return tensor_files.void_values(dtype)
    return leftovers.not_numbers(dtype)


def _corrupt(path: Path, exc: Exception) -> InputError:
    return InputError(f"{path}: not a valid .npz file ({reason_of(exc)}); it may be truncated or corrupt")


@dataclass(frozen=True)
class _Member:
    """Reads one member whole (one record). Picklable: opens the archive inside each call."""

    path: Path
    member: str
    bfloat16: str | None = None  # a bfloat16 member's byte order: read as float32 (exactly)

    def __call__(self, start: int, stop: int) -> np.ndarray:
        try:
            with zipfile.ZipFile(self.path) as zf, zf.open(self.member) as f:
                array = np.lib.format.read_array(f, allow_pickle=False)
        except MemoryError:  # not damage: the run says memory ran out
            raise
        except Exception as exc:  # bad CRC, truncated deflate stream, ...
            raise InputError(f"{self.path}: cannot read tensor {_key(self.member)} ({reason_of(exc)}); "
                             "the file may be corrupt") from None
        if self.bfloat16:
            array = tensor_files.bfloat16_to_float32(array.view(f"{self.bfloat16}u2"))
        return array[None][start:stop]


@dataclass(frozen=True)
class _MemberParts:
    """Reads one member in parts (ArrayJob.read_parts), decompressing it in order: one part in
    memory at a time. Picklable: opens the archive inside each call."""

    path: Path
    member: str

    def __call__(self, record: int, part: int) -> Iterator[np.ndarray]:
        try:
            with zipfile.ZipFile(self.path) as zf, zf.open(self.member) as f:
                shape, _, dtype = _read_header(f)
                size = math.prod(shape)
                for first in range(0, size, part):
                    count = min(part, size - first)
                    raw = f.read(count * dtype.itemsize)  # the last read checks the member's CRC
                    if len(raw) < count * dtype.itemsize:
                        raise EOFError(f"the member ends {first + len(raw) // dtype.itemsize} elements in")
                    yield np.frombuffer(raw, dtype)
        except MemoryError:  # not damage: the run says memory ran out
            raise
        except InputError:
            raise
        except Exception as exc:  # bad CRC, truncated deflate stream, ...
            raise InputError(f"{self.path}: cannot read tensor {_key(self.member)} ({reason_of(exc)}); "
                             "the file may be corrupt") from None


def _read_header(f) -> tuple[tuple[int, ...], bool, np.dtype]:
    """A .npy member's shape, Fortran order and dtype; `f` is left at its data."""
    major, _ = np.lib.format.read_magic(f)
    read_header = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
    return read_header(f)


def _raw(values: np.ndarray) -> np.ndarray:
    """The bytes of `values` in C order (a uint8 view when it is contiguous)."""
    return np.ascontiguousarray(values).reshape(-1).view(np.uint8)


def _write_header(f, shape: tuple[int, ...], dtype: np.dtype) -> None:
    """The .npy header np.lib.format.write_array writes for a C-order array (format 1.0,
    2.0 when the header does not fit)."""
    header = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": shape}
    try:
        np.lib.format.write_array_header_1_0(f, header)
    except ValueError:
        np.lib.format.write_array_header_2_0(f, header)


class NpzReader(Reader):
    format = NAME
    records_are_tensors = True  # the manifest gets per-tensor figures
    keeps_dtypes = True  # each tensor written back in its dtype

    def __init__(self, path: Path, options: FormatOptions):
        self.path = path
        if is_torch_zip(_zip_head(path)):
            raise InputError(f"{path}: a PyTorch checkpoint (torch.save), which holds pickled code "
                             "tldp does not load; save the state dict with "
                             "safetensors.torch.save_file(model.state_dict(), 'model.safetensors') "
                             "and perturb that")
        self.dtypes: dict[str, np.dtype] = {}  # each tensor's stored dtype, byte order included
        self.bfloat16: dict[str, str] = {}  # the bfloat16 tensors' byte orders, by name
        self.fortran: set[str] = set()  # the tensors stored in Fortran order: read whole
        try:
            with zipfile.ZipFile(path) as zf:
                self.members = zf.infolist()
                self.comment = zf.comment
                self.tensors = [self._tensor(zf, info) for info in self.members
                                if info.filename.endswith(".npy")]
        except InputError:
            raise
        except Exception as exc:
            raise _corrupt(path, exc) from None
        names = [t.name for t in self.tensors]
        if len(set(names)) != len(names):
            twice = sorted({n for n in names if names.count(n) > 1})
            raise InputError(f"{path}: holds more than one array named {', '.join(twice)}")
        chosen, self.messages, unperturbed = tensor_files.select(path, self.tensors, options.datasets,
                                                                 options.exclude)
        self.manifest_extra = self._leftovers(options, unperturbed).manifest_extra()
        self.jobs = [tensor_files.job(path, NAME, t, _Member(path, t.name + ".npy", self.bfloat16.get(t.name)),
                                      None if t.name in self.fortran or t.name in self.bfloat16
                                      else _MemberParts(path, t.name + ".npy"))
                     for t in chosen]

    def _leftovers(self, options: FormatOptions, unperturbed: list[dict]) -> leftovers.Leftovers:
        """What is written besides the tensors (formats.leftovers): members that are not .npy
        arrays and comments (the archive's, a member's as MEMBER@comment) only when --keep
        names them."""
        # Arrays of strings, bytes, objects or records are not parameters but text (class
        # names, file names, IDs): left out unless named, as an HDF5 file's are.
        text = {name: dtype for name, dtype in self.dtypes.items()
                if dtype.kind in "USOV" and name not in self.bfloat16}
        left = leftovers.Leftovers(list(options.keep), unperturbed=[u for u in unperturbed if u["name"] not in text])
        left.considered(t.name for t in self.tensors if t.name not in text)
        self.left_out: set[str] = set()  # members not written
        for tensor in self.tensors:
            if tensor.name not in text:
                continue
            if left.kept(tensor.name):
                if text[tensor.name].hasobject:  # np.save pickles object arrays: never copied raw, as pickles
                    raise UsageError(f"{self.path}: member {tensor.name}.npy holds Python objects (a pickle "
                                     "inside the .npy), data tldp does not load; tldp never copies it raw")
                left.copied(tensor.name, "array", leftovers.KEPT, shape=list(tensor.shape), dtype=tensor.dtype)
            else:
                left.drop(tensor.name, "array", f"holds {_not_numbers(text[tensor.name])}, not perturbed")
                self.left_out.add(tensor.name + ".npy")
        for info in self.members:
            if not info.filename.endswith(".npy"):
                if left.kept(info.filename):
                    head = _member_head(self.path, info)
                    if is_pickle(head) or is_torch_zip(head):
                        raise UsageError(f"{self.path}: member {info.filename} holds a Python pickle, data tldp "
                                         "does not load; tldp never copies it raw")
                    left.copied(info.filename, "file", leftovers.KEPT)
                else:
                    left.drop(info.filename, "file", "not an array (.npy member), not perturbed")
                    self.left_out.add(info.filename)
        self.comments = {info.filename for info in self.members if info.filename not in self.left_out
                         and info.comment and left.attribute(info.filename, "comment", (), "comment", COMMENT)}
        self.keep_comment = bool(self.comment) and left.attribute("", "comment", (), "comment", COMMENT)
        left.check(self.path)
        return left

    def _tensor(self, zf: zipfile.ZipFile, info: zipfile.ZipInfo) -> Tensor:
        try:
            with zf.open(info) as f:
                shape, fortran_order, dtype = _read_header(f)
                header = f.tell()
        except Exception as exc:
            raise InputError(f"{self.path}: member {info.filename} is not a valid .npy array "
                             f"({reason_of(exc)})") from None
        declared = header + math.prod(shape) * dtype.itemsize
        if declared > info.file_size:  # checked before a tensor is read (and its size allocated)
            raise InputError(f"{self.path}: member {info.filename} declares a {'x'.join(map(str, shape))} "
                             f"{_dtype_name(dtype)} array ({declared:,} bytes with its header) but holds "
                             f"{info.file_size:,} bytes; the file is damaged")
        self.dtypes[_key(info.filename)] = dtype
        order = tensor_files.bfloat16_order(dtype, _header(zf, info, header)) if dtype.kind == "V" else None
        if order is not None:
            self.bfloat16[_key(info.filename)] = order
            return Tensor(_key(info.filename), tuple(shape), "bfloat16")
        if fortran_order:
            self.fortran.add(_key(info.filename))
        return Tensor(_key(info.filename), tuple(shape), _dtype_name(dtype))

    def arrays(self) -> list[ArrayJob]:
        return self.jobs

    def close(self) -> None:
        pass


def _header(zf: zipfile.ZipFile, info: zipfile.ZipInfo, size: int) -> bytes:
    """A member's .npy header as stored (`size` bytes, checked already), for what NumPy's
    reading of it drops (the byte order of a void dtype)."""
    with zf.open(info) as f:
        return f.read(size)


def open_reader(path: Path, options: FormatOptions) -> NpzReader:
    return NpzReader(path, options)


class NpzWriter(Writer):
    """Writes the archive member by member in the input's order."""

    def __init__(self, reader: NpzReader, tmp_path: Path, dtype: np.dtype):
        self.source = reader.path
        self.path = tmp_path
        self.members = [info for info in reader.members if info.filename not in reader.left_out]
        self.comments = reader.comments  # the members whose comment is written
        self.dtypes = reader.dtypes
        self.bfloat16 = reader.bfloat16
        self.shapes = {t.name: t.shape for t in reader.tensors}
        self.to_write = {job.name for job in reader.jobs}
        chosen = [t for t in reader.tensors if t.name in self.to_write]
        self.variances = tensor_files.variances(chosen)
        self.postprocessing = tensor_files.postprocessing(chosen, dtype, self.variances)
        self.output_dtype = tensor_files.output_dtype(chosen)
        self.pending: dict[str, np.ndarray] = {}  # perturbed, waiting for the members before them
        self.parts: dict[str, list[np.ndarray]] = {}  # tensors written in parts: those not written yet
        self.spools: dict[str, Any] = {}  # parts that came before their member's turn: unnamed work files
        self.part_member: Any = None  # the member being written in parts, open
        self.received: set[str] = set()
        self.next = 0  # index of the next member to write
        self.lock = threading.Lock()
        self.failed = False  # a member could not be written: close() only releases the files
        self.src = zipfile.ZipFile(reader.path)
        try:
            with writing(tmp_path):
                self.file = open(tmp_path, "x+b")
        except BaseException:
            self.src.close()
            raise
        self.out: zipfile.ZipFile | None = zipfile.ZipFile(self.file, "w", allowZip64=True)  # None: closed
        self.out.comment = reader.comment if reader.keep_comment else b""

    def write(self, job: ArrayJob, start: int, block: np.ndarray) -> None:
        stored = tensor_files.to_stored(block[0], job.source["dtype"], self.dtypes[job.name],
                                        positive=job.name in self.variances)
        with self.lock:
            self.pending[job.name] = stored
            self.received.add(job.name)
            self._flush()

    def part_writer(self):
        return self.write_part

    def write_part(self, job: ArrayJob, record: int, first: int, values: np.ndarray) -> None:
        """Part of a tensor (Writer.part_writer): written at once when its member's turn has
        come, else kept until it does."""
        stored = tensor_files.to_stored(values, job.source["dtype"], self.dtypes[job.name],
                                        positive=job.name in self.variances)
        with self.lock:
            self.parts.setdefault(job.name, []).append(stored)
            if first + values.size == job.elements:
                self.received.add(job.name)
            self._flush()
            if self.parts.get(job.name):  # not its turn: kept on disk until it comes, not in memory
                try:
                    with writing(self.path):
                        if job.name not in self.spools:
                            self.spools[job.name] = tempfile.TemporaryFile(dir=self.path.parent)
                        self.spools[job.name].write(_raw(self.parts[job.name].pop()))
                except BaseException:
                    self.failed = True
                    raise

    def _flush(self) -> None:
        try:
            with writing(self.path):
                self._write_members()
        except BaseException:
            self.failed = True
            raise

    def _write_members(self) -> None:
        assert self.out is not None  # written until close()
        while self.next < len(self.members):
            info = self.members[self.next]
            name = _key(info.filename)
            perturbed = info.filename.endswith(".npy") and name in self.to_write
            if perturbed and name in self.parts:
                if not self._write_parts(info, name):
                    return
                continue
            if perturbed and name not in self.pending:
                return
            with self.out.open(self._target(info), "w", force_zip64=True) as f:
                if perturbed and name in self.bfloat16:  # its bit patterns, under the input's '<V2' header
                    _write_bfloat16(f, self.pending.pop(name), self.bfloat16[name])
                elif perturbed:
                    np.lib.format.write_array(f, self.pending.pop(name), allow_pickle=False)
                else:
                    try:
                        member = self.src.open(info)
                    except Exception as exc:
                        raise InputError(f"{self.source}: cannot copy member {info.filename} "
                                         f"({reason_of(exc)}); the file may be corrupt") from None
                    with member:
                        copy_bytes(member, f"{self.source} (member {info.filename})", f, self.path)
            self.next += 1

    def _target(self, info: zipfile.ZipInfo) -> zipfile.ZipInfo:
        """The output's member for the input's `info`: its name, compression and attributes."""
        target = zipfile.ZipInfo(info.filename, date_time=MEMBER_DATE)
        target.compress_type, target.external_attr = info.compress_type, info.external_attr
        target.comment = info.comment if info.filename in self.comments else b""
        target.create_system = info.create_system
        return target

    def _write_parts(self, info: zipfile.ZipInfo, name: str) -> bool:
        """Writes the parts of `name` received so far into its member (opened, with the .npy
        header, at its first); True once the member is whole and closed."""
        assert self.out is not None  # written until close()
        if self.part_member is None:
            self.part_member = self.out.open(self._target(info), "w", force_zip64=True)
            _write_header(self.part_member, tuple(self.shapes[name]), self.dtypes[name])
            spool = self.spools.pop(name, None)
            if spool is not None:  # the parts that came before its turn
                with spool:
                    spool.seek(0)
                    copy_bytes(spool, f"{self.path.parent} (a work file)", self.part_member, self.path)
        while self.parts[name]:
            self.part_member.write(_raw(self.parts[name].pop(0)))
        if name not in self.received:
            return False
        self.part_member.close()
        self.part_member = None
        del self.parts[name]
        self.next += 1
        return True

    def close(self) -> list[Path]:
        if self.out is None:
            return [self.path]
        with self.lock:
            try:
                if self.received == self.to_write and not self.failed:  # else the output is discarded
                    self._flush()  # the members after the last perturbed one
                    with writing(self.path):
                        self.out.close()
                        self.file.flush()
                        os.fsync(self.file.fileno())
                        self.file.close()
            finally:
                # After a failure: release the files whatever happens writing to them.
                if self.part_member is not None:
                    with contextlib.suppress(OSError, ValueError):
                        self.part_member.close()
                for spool in self.spools.values():
                    spool.close()
                with contextlib.suppress(OSError, ValueError):
                    self.out.close()
                with contextlib.suppress(OSError):
                    self.file.close()
                self.src.close()
                self.out = None
        return [self.path]


def _write_bfloat16(f, bits: np.ndarray, order: str) -> None:
    """A bfloat16 member as ml_dtypes writes it: the bit patterns (uint16, `order` byte
    order) under a '<V2' (or '>V2') header, which np.load reads as '|V2'."""
    header = np.lib.format.header_data_from_array_1_0(bits)
    header["descr"] = f"{order}V2"
    np.lib.format.write_array_header_1_0(f, header)  # a header of at most 64 dimensions: short
    f.write(np.ascontiguousarray(bits, dtype=f"{order}u2").tobytes())


def create_writer(reader: NpzReader, tmp_path: Path, dtype: np.dtype,
                  options: FormatOptions) -> NpzWriter:
    return NpzWriter(reader, tmp_path, dtype)


FORMAT = Format(
    name=NAME, title=".npz file", suffixes=(".npz",), member_noun="tensor",
    selects_arrays=True, honours_exclude=True, honours_keep=True,
    can_open=can_open, default_output=default_output, open_reader=open_reader, create_writer=create_writer,
    docs=(DocRow("`.npz` archive of named arrays (model parameters)", "a zip whose first member is a `.npy` file",
                 "`tldp perturb docs/type3/model.npz --eps 1 --clip 0.1`",
                 "`model.tldp.npz`: same members in the same order, names, dtypes, shapes, byte order, "
                 "compression"),),
)
