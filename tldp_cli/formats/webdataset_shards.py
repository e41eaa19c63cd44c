"""WebDataset shards and their members (formats/webdataset.py): the brace patterns that name
shards (expand_braces, as WebDataset expands them), finding a folder's shards, scanning a
shard's members (Member, Shard: their keys and extensions as webdataset groups them, and
what is refused: unsafe paths, links, devices, members past the shard's end), a member's
kind (image, array, label or metadata, never copied), and reading its bytes.
"""

from __future__ import annotations

import io
import os
import posixpath
import re
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from PIL import Image

import numpy as np

from tldp_cli.errors import InputError, UsageError, reason_of
from tldp_cli.files.checked_io import open_regular
from tldp_cli.formats import DICOM_REASON, decode_reason, folder_files, is_torch_zip, named_by, pixels
from tldp_cli.formats.images_reader import UNREAD_IMAGE, unread_image_magic

SHARD_SUFFIX = ".tar"
COMPRESSED_SUFFIXES = (".tar.gz", ".tgz", ".tar.bz2", ".tar.xz", ".tar.zst", ".tar.lz4")
IMAGE_EXTENSIONS = ("png", "jpg", "jpeg", "bmp", "tif", "tiff", "webp")
ARRAY_SUFFIX = ".npy"
PICKLE_EXTENSIONS = ("pyd", "pickle", "pkl", "pth")
USTAR_MAGIC = b"ustar"  # at offset 257 of a POSIX (ustar, pax) or GNU tar header
MAX_SHARDS = 1_000_000  # names a brace pattern may expand to
PROBE_BYTES = 1 << 16  # an image member's head, read to learn its header (all of it if that fails)
# WebDataset's rule (webdataset.tariterators.base_plus_ext): key, then extension after the
# first dot of the base name
_KEY = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")
_BRACE = re.compile(r"\{([^{}]*)\}")
_RANGE = re.compile(r"^(-?\d+)\.\.(-?\d+)$")

IMAGE, ARRAY, LEFTOVER, NEVER, FOLDER = "image", "array", "leftover", "never copied", "folder"
PICKLE_REASON = "a Python pickle, data tldp does not load"
TORCH_REASON = "a PyTorch checkpoint (torch.save: a pickle in a zip), data tldp does not load"
# Images webdataset decodes (and others) in formats tldp does not read, by extension; and
# by signature (images_reader.unread_image_magic), whatever the extension.
UNREAD_IMAGE_EXTENSIONS = {"gif": "GIF", "pbm": "PPM", "pgm": "PPM", "ppm": "PPM", "pnm": "PPM", "heic": "HEIF/AVIF",
                           "heif": "HEIF/AVIF", "avif": "HEIF/AVIF", "jxl": "JPEG XL", "ico": "ICO", "tga": "TGA"}


def _key(name: str) -> tuple[str | None, str | None]:
    """(key, extension) of a member name by WebDataset's rule; (None, None) for a name
    without a dot in its base name (webdataset skips it)."""
    match = _KEY.match(name)
    return (match.group(1), match.group(2).lower()) if match else (None, None)


def expand_braces(text: str) -> list[str]:
    """The names a brace pattern stands for, as WebDataset's braceexpand gives them:
    `{a,b}` lists, `{000..009}` ranges (zero-padded to the wider end when one is), several
    braces multiplied out. Braces holding neither stay as they are; nested or unbalanced
    braces are refused."""
    depth = 0
    for char in text:
        depth += (char == "{") - (char == "}")
        if not 0 <= depth <= 1:
            break
    if depth != 0:
        raise UsageError(f"{text}: nested or unbalanced braces in the pattern of shards")
    return _expanded(text)


def _expanded(text: str) -> list[str]:
    match = _BRACE.search(text)
    if match is None:
        return [text]
    body, head, rest = match.group(1), text[:match.start()], text[match.end():]
    numbers = _RANGE.match(body)
    if numbers:
        a, b = numbers.group(1), numbers.group(2)
        width = max(len(a), len(b)) if (a.lstrip("-").startswith("0") and len(a) > 1) or \
            (b.lstrip("-").startswith("0") and len(b) > 1) else 0
        lo, hi = int(a), int(b)
        if abs(hi - lo) >= MAX_SHARDS:
            raise UsageError(f"{text}: the pattern names more than {MAX_SHARDS} shards")
        step = 1 if hi >= lo else -1
        options = [f"{n:0{width}d}" for n in range(lo, hi + step, step)]
    elif "," in body:
        options = body.split(",")
    else:
        options = ["{" + body + "}"]
    tails = _expanded(rest)
    if len(options) * len(tails) > MAX_SHARDS:
        raise UsageError(f"{text}: the pattern names more than {MAX_SHARDS} shards")
    return [head + option + tail for option in options for tail in tails]


def is_pattern(path: Path) -> bool:
    """A brace pattern of shards: a name with braces that names no file itself."""
    text = str(path)
    return ("{" in text or "}" in text) and not os.path.lexists(path) and text.lower().endswith(SHARD_SUFFIX)


def pattern_files(path: Path) -> list[Path]:
    """The shards a brace pattern names ([] for a path that is not one)."""
    return [Path(name) for name in dict.fromkeys(expand_braces(str(path)))] if is_pattern(path) else []


def pattern_base(path: Path) -> Path:
    """The folder the shards a pattern names are relative to: its longest leading folder
    without a brace."""
    parts = Path(path).parts
    fixed = next(i for i, part in enumerate(parts) if "{" in part or "}" in part)
    return Path(*parts[:fixed]) if fixed else Path(".")


def is_tar(path: Path) -> bool:
    try:
        with open_regular(path) as f:
            return f.read(262)[257:262] == USTAR_MAGIC
    except (OSError, InputError):
        return False


def is_compressed_shard(path: Path) -> bool:
    return path.name.lower().endswith(COMPRESSED_SUFFIXES)


@dataclass
class Member:
    name: str  # as in the tar
    offset: int  # of its data in the shard
    size: int
    mode: int
    kind: str  # IMAGE, ARRAY, LEFTOVER, NEVER or FOLDER
    key: str | None
    extension: str | None  # WebDataset's, lower-cased ("seg.png"); None: no dot in the base name
    out_name: str  # its name in the output (an image's ends .png)
    job: str | None = None  # the array it is perturbed as
    reason: str = ""  # NEVER: why it is never copied
    shape: tuple[int, ...] = ()  # a record's: (H, W), (H, W, 3), an array's shape
    dtype: np.dtype | None = None
    has_alpha: bool = False
    has_icc: bool = False  # carries an ICC colour profile (written where --keep icc_profile names it)
    withheld: str = ""  # --anonymize-names: what names it where its own name is withheld (NO_KEY, UNDECLARED)

    @property
    def label(self) -> str:
        """What --keep and the manifest name it by: its extension, or its name without one
        (NO_KEY or UNDECLARED where --anonymize-names withholds it)."""
        if self.withheld:
            return self.withheld
        return self.extension if self.extension is not None else self.name

    @property
    def decoded_dtype(self) -> np.dtype:
        """Its dtype, known once it is decoded (every member perturbed is, when it is read)."""
        assert self.dtype is not None
        return self.dtype


@dataclass
class Shard:
    path: Path
    rel: str  # its name in the output folder
    members: list[Member] = field(default_factory=list)


def read_at(path: Path, offset: int, size: int) -> bytes:
    """`size` bytes of the shard from `offset` (a member's data)."""
    with open_regular(path) as f:
        data = os.pread(f.fileno(), size, offset)
        while len(data) < size:  # pread may return less; the reader checked the shard's length
            more = os.pread(f.fileno(), size - len(data), offset + len(data))
            if not more:
                raise InputError(f"{path}: ends inside a member's data; the shard may be truncated")
            data += more
    return data


def _unsafe(shard: Path, info: tarfile.TarInfo) -> str | None:
    """Why a member is refused (its path escapes, or it is not a file or folder), or None."""
    name = info.name
    parts = name.split("/")
    if name.startswith("/") or re.match(r"^[A-Za-z]:", name) or "\\" in name:
        return f"member {name!r} has an absolute or non-POSIX path"
    if ".." in parts or name in ("", "."):
        return f"member {name!r} has a path that climbs out of the shard (..)"
    if info.issym() or info.islnk():
        return f"member {name!r} is a {'symbolic' if info.issym() else 'hard'} link"
    if info.issparse():
        return f"member {name!r} is a sparse file"
    if not (info.isreg() or info.isdir()):
        return f"member {name!r} is a device, FIFO or other special file"
    return None


def _kind(info: tarfile.TarInfo, extension: str | None, head: bytes) -> tuple[str, str]:
    """The member's kind and, for NEVER, the reason; `head`: its first bytes (348 at most)."""
    if info.isdir():
        return FOLDER, ""
    last = (extension or "").rsplit(".", 1)[-1]
    if last == "dcm" or head[128:132] == b"DICM":
        return NEVER, f"DICOM: {DICOM_REASON}"
    if (extension or "").endswith(("nii", "nii.gz")) or head[344:348] in (b"n+1\0", b"ni1\0"):
        return NEVER, "NIfTI: a medical image volume, whose header can name the patient"
    if last in PICKLE_EXTENSIONS or (len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5):
        return NEVER, PICKLE_REASON
    if is_torch_zip(head):  # a .pt, .bin: a pickle in a zip
        return NEVER, TORCH_REASON
    unread = unread_image_magic(head) or UNREAD_IMAGE_EXTENSIONS.get(last)
    if unread:  # a record, as an image folder's: never copied raw (images_reader._unread_image)
        return NEVER, f"{UNREAD_IMAGE} ({unread}; convert it to PNG to perturb it), a record of the shard's data"
    if last in IMAGE_EXTENSIONS:
        return IMAGE, ""
    if "." + last == ARRAY_SUFFIX:
        return ARRAY, ""
    data = named_by("." + last)  # data tldp reads (.npz, .safetensors, .parquet, .h5, ...), as data_file
    if data is not None:
        return NEVER, f"{data.name} data, which tldp perturbs on its own (extract the member and perturb it)"
    return LEFTOVER, ""


def output_name(member_name: str, kind: str) -> str:
    if kind != IMAGE:
        return member_name
    stem, _ = posixpath.splitext(member_name)
    return stem + ".png"


def scan(path: Path, rel: str) -> Shard:
    """The shard's members, in order, checked (see the module docstring)."""
    size = os.stat(path).st_size
    shard = Shard(path, rel)
    seen: set[str] = set()
    try:
        with open_regular(path) as raw, tarfile.open(fileobj=raw, mode="r:") as tar:
            for info in tar:
                problem = _unsafe(path, info)
                if problem:
                    raise InputError(f"{path}: {problem}; tldp reads only regular files and folders "
                                     "inside a shard")
                name = info.name.rstrip("/") if info.isdir() else info.name
                if name in seen:
                    raise InputError(f"{path}: two members are named {name!r}")
                seen.add(name)
                if info.offset_data + info.size > size:
                    raise InputError(f"{path}: member {name!r} runs past the end of the shard; it may be "
                                     "truncated")
                key, extension = _key(name)
                head = os.pread(raw.fileno(), min(info.size, 348), info.offset_data) if info.isreg() else b""
                kind, reason = _kind(info, extension, head)
                shard.members.append(Member(name, info.offset_data, info.size, info.mode & 0o777, kind, key,
                                            extension, output_name(name, kind),
                                             reason=reason))
                # flat memory however many members (typeshed does not declare TarFile.members)
                tar.members = []  # type: ignore[attr-defined]
    except tarfile.TarError as exc:
        raise InputError(f"{path}: not a readable tar file ({reason_of(exc)}); it may be truncated") from None
    return shard


def probe_image(shard: Path, member: Member) -> pixels.Header:
    """The image's header, from the member's head (or all of it when the head is not enough)."""
    for size in dict.fromkeys((min(member.size, PROBE_BYTES), member.size)):
        data = io.BytesIO(read_at(shard, member.offset, size))
        try:
            with Image.open(data) as im:
                found = pixels.header(data, im)
            if found.pages > 1:
                raise pixels.Unsupported(f"a multi-page TIFF ({found.pages} pages); a WebDataset image "
                                         "member is one page")
            return found
        except pixels.Unsupported:
            raise
        except Exception:
            if size == member.size:
                raise
    raise AssertionError("unreachable")


def probe_array(shard: Path, member: Member) -> tuple[tuple[int, ...], np.dtype]:
    data = io.BytesIO(read_at(shard, member.offset, min(member.size, PROBE_BYTES)))
    major, _ = np.lib.format.read_magic(data)
    read = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
    shape, _, dtype = read(data)
    if data.tell() + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize != member.size:
        raise ValueError("its header states another size than the member holds")
    return tuple(shape), dtype


@dataclass(frozen=True)
class ReadMember:
    """Reads a member as one record. Picklable: opens the shard inside each call."""

    shard: Path
    name: str
    offset: int
    size: int
    kind: str
    shape: tuple[int, ...]  # the record's
    dtype: np.dtype

    def __call__(self, start: int, stop: int) -> np.ndarray:
        where = f"{self.shard}: member {self.name}"
        data = read_at(self.shard, self.offset, self.size)
        try:
            if self.kind == IMAGE:
                stream = io.BytesIO(data)
                with Image.open(stream) as im:
                    values = pixels.decode(stream, im).colour
            else:
                values = np.load(io.BytesIO(data), allow_pickle=False)
        except MemoryError:
            raise
        except Exception as exc:
            raise InputError(f"{where}: cannot be decoded ({decode_reason(exc)})") from None
        if values.shape != self.shape or values.dtype.kind != self.dtype.kind \
                or values.dtype.itemsize != self.dtype.itemsize:
            raise InputError(f"{where}: the member changed while tldp was reading the shard")
        return np.asarray(values, dtype=self.dtype)[None]


def _walk(root: Path) -> tuple[list[str], list[str], list[str]]:
    """Relative POSIX paths of the shards, the other files and the symbolic links, sorted
    (formats.folder_files: links not followed, FIFOs and devices refused)."""
    files, links = folder_files(root)
    is_shard = [rel.lower().endswith(SHARD_SUFFIX) or rel.lower().endswith(COMPRESSED_SUFFIXES) for rel in files]
    return ([rel for rel, shard in zip(files, is_shard) if shard],
            [rel for rel, shard in zip(files, is_shard) if not shard], links)


def shard_files(path: Path) -> tuple[Path, list[str], list[str], list[str]]:
    """(the folder the shards' names are relative to, the shards, other files, links)."""
    if is_pattern(path):
        base = pattern_base(path)
        names = list(dict.fromkeys(expand_braces(str(path))))
        for name in names:
            if not Path(name).is_file():
                raise InputError(f"{name}: no such shard (named by the pattern {path})")
        return base, [Path(name).relative_to(base).as_posix() if base != Path(".") else Path(name).as_posix()
                      for name in names], [], []
    if path.is_file():
        return path.parent, [path.name], [], []
    return (path, *_walk(path))
