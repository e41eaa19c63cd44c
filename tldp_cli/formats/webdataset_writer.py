"""The WebDataset format's writer (formats/webdataset.py): each shard written anew, member by
member in the input's order as its records come back, with deterministic tar headers
(MTIME, no owner, no PAX records but those a name needs); the files --keep names copied.
"""

from __future__ import annotations

import io
import os
import tarfile
import threading
from pathlib import Path
from typing import BinaryIO
from PIL import Image

import numpy as np

from tldp_cli.errors import InputError
from tldp_cli.files.checked_io import open_regular, writing
from tldp_cli.formats import ArrayJob, FormatOptions, Writer, pixels
from tldp_cli.formats.webdataset_reader import WebDatasetReader
from tldp_cli.formats.webdataset_shards import ARRAY, FOLDER, IMAGE, LEFTOVER, Member, Shard, read_at

# Every output member's modification time: a constant (the epoch), as reproducible tar
# builds write, since the input's times can date when and where a subject was recorded.
MTIME = 0


def _tar_info(name: str, size: int, member: Member) -> tarfile.TarInfo:
    """A deterministic header: the name, size, mode and a constant time (MTIME); no owner."""
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = size, MTIME, member.mode
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    if member.kind == FOLDER:
        info.type, info.size = tarfile.DIRTYPE, 0
    return info


class WebDatasetWriter(Writer):
    """Writes the shards in order, each member once those before it are written: a
    perturbed member when its record comes back, a kept one copied from the input."""

    def __init__(self, reader: WebDatasetReader, tmp_path: Path, dtype: np.dtype, options: FormatOptions):
        self.root = tmp_path
        self.reader = reader
        self.dtype = np.dtype(dtype)
        self.by_job = {m.job: (s, m) for s in reader.shards for m in s.members if m.job is not None}
        self.items: list[tuple[str, Shard, Member | None]] = []
        for shard in reader.shards:
            self.items.append(("begin", shard, None))
            self.items += [("member", shard, m) for m in shard.members]
            self.items.append(("end", shard, None))
        self.position = 0
        self.pending: dict[str, bytes] = {}
        self.lock = threading.Lock()
        self.failed = False
        self.file: BinaryIO | None = None
        self.tar: tarfile.TarFile | None = None
        self.written: list[Path] = []
        with writing(tmp_path):
            tmp_path.mkdir()
        for rel in reader.kept_files:
            self._copy_file(reader.base / rel, rel)
        self._describe(reader)

    def _describe(self, reader: WebDatasetReader) -> None:
        members = [m for s in reader.shards for m in s.members if m.job is not None]
        image_dtypes = sorted({str(m.decoded_dtype.newbyteorder("=")) for m in members if m.kind == IMAGE})
        has_arrays = any(m.kind == ARRAY for m in members)
        steps = []
        if image_dtypes:
            depths = sorted({np.dtype(d).itemsize * 8 for d in image_dtypes})
            rounding = [] if self.dtype.kind in "iu" else ["round image members to the nearest integer (ties to even)"]
            steps += rounding + [
                "clip image members to " + ", ".join(f"[0, {2**d - 1}] ({d}-bit images)" for d in depths),
                "write each image member as a PNG member under its key (KEY.jpg -> KEY.png) " + pixels.PNG_ENCODING,
                ("copy an image's alpha channel unchanged (it is not perturbed; --keep alpha); " if reader.keep_alpha
                 else "leave out an image's alpha channel (RGBA written as RGB, LA as L); "
                 if any(m.has_alpha for m in members) else "")
                + ("keep" if reader.keep_icc else "drop") + " its ICC colour profile, drop EXIF and text metadata"]
        if has_arrays:
            steps.append(f"write each .npy member as a {self.dtype} .npy member of the same shape")
        steps.append("write each shard as a tar of the same name, its members in the input's order, with "
                     "new headers: each member's name and mode, modification time 0 (1970-01-01); no owner; "
                     "no other PAX records")
        if reader.anonymized:
            steps.append("name each member by its sample's number in the samples' order (000000, 000001, ...) "
                         "and its extension, instead of its key (--anonymize-names)")
        self.postprocessing = steps
        if image_dtypes:  # what evaluate reads back: values rounded and clipped (as image folders say)
            self.manifest_extra = {"image_output": {"format": "png", "clipped": True}}
        self.output_dtype = reader.output_dtype(self.dtype)

    def _copy_file(self, source: Path, rel: str) -> None:
        target = self.root / rel
        with writing(target):
            target.parent.mkdir(parents=True, exist_ok=True)
            with open_regular(source) as src, open(target, "xb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
                dst.flush()
                os.fsync(dst.fileno())
        self.written.append(target)

    def _encode(self, shard: Shard, member: Member, values: np.ndarray) -> bytes:
        if member.kind == ARRAY:
            out = io.BytesIO()
            np.lib.format.write_array(out, np.asarray(values, dtype=self.dtype), allow_pickle=False)
            return out.getvalue()
        info = np.iinfo(member.decoded_dtype)
        rounded = values if values.dtype.kind in "iu" else np.rint(values)
        image = np.clip(rounded, info.min, info.max).astype(member.decoded_dtype.newbyteorder("="))
        data = io.BytesIO(read_at(shard.path, member.offset, member.size))
        with Image.open(data) as im:
            icc = im.info.get("icc_profile") if self.reader.keep_icc else None
            alpha = pixels.decode(data, im).alpha if member.has_alpha and self.reader.keep_alpha else None
        if alpha is not None:
            image = np.dstack([image, alpha.astype(image.dtype)])
        return pixels.png(image, icc)

    def write(self, job: ArrayJob, start: int, block: np.ndarray) -> None:
        shard, member = self.by_job[job.name]
        encoded = self._encode(shard, member, block[0])
        with self.lock:
            if self.failed:  # the shard being written is broken: the run is failing
                return
            self.pending[job.name] = encoded
            try:
                self._advance()
            except BaseException:
                self.failed = True
                raise

    def _advance(self) -> None:
        """Writes the items in order while the next one is ready."""
        while self.position < len(self.items):
            what, shard, member = self.items[self.position]
            if what == "begin":
                self._open(shard)
            elif what == "end":
                self._close_shard()
            else:
                assert member is not None  # a "member" item
                if member.job is not None:
                    if member.job not in self.pending:
                        return
                    data = self.pending.pop(member.job)
                    with writing(self.root / shard.rel):
                        self._shard_tar().addfile(_tar_info(member.out_name, len(data), member),
                                                  io.BytesIO(data))
                elif (member.kind == FOLDER and not self.reader.anonymized) or (
                        member.kind == LEFTOVER and member.label in self.reader.kept_extensions):
                    self._copy_member(shard, member)
            self.position += 1

    def _shard_tar(self) -> tarfile.TarFile:
        """The shard being written (between its "begin" and "end" items)."""
        assert self.tar is not None
        return self.tar

    def _open(self, shard: Shard) -> None:
        target = self.root / shard.rel
        with writing(target):
            target.parent.mkdir(parents=True, exist_ok=True)
            self.file = open(target, "xb")
            self.tar = tarfile.open(fileobj=self.file, mode="w", format=tarfile.PAX_FORMAT)
        self.written.append(target)

    def _copy_member(self, shard: Shard, member: Member) -> None:
        info = _tar_info(member.out_name, member.size, member)
        with open_regular(shard.path) as src, writing(self.root / shard.rel):
            src.seek(member.offset)
            try:
                self._shard_tar().addfile(info, src if info.isreg() else None)
            except tarfile.ReadError:
                raise InputError(f"{shard.path}: ends inside member {member.name}; the shard may be "
                                 "truncated") from None

    def _close_shard(self) -> None:
        target = self.written[-1]
        tar, file = self._shard_tar(), self.file
        assert file is not None  # opened with the tar
        with writing(target):
            tar.close()
            file.flush()
            os.fsync(file.fileno())
            file.close()
        self.tar = self.file = None

    def finish(self) -> None:
        with self.lock:
            self._advance()
            if self.position < len(self.items) or self.pending:
                raise AssertionError("a member was not written")

    def close(self) -> list[Path]:
        with self.lock:
            if self.file is not None:
                try:
                    self.file.close()
                except OSError:
                    pass
                self.tar = self.file = None
        return list(self.written)
