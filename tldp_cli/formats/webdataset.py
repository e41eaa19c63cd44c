"""WebDataset shards: uncompressed .tar files whose members, grouped by key, are samples.

Input. One run reads a folder of shards (every .tar in it, in subfolders too), one .tar
file, or a brace pattern of shards as WebDataset takes it (`shards/train-{000000..000009}.tar`,
`{train,val}/part-{0..3}.tar`; quoted, so that the shell leaves the braces alone). A
shard's members are grouped as WebDataset groups them (webdataset.tariterators): a
member's key is its path up to the first dot of its base name, its extension the rest
(`images/0001.seg.png`: key `images/0001`, extension `seg.png`), and consecutive members
with the same key are one sample.

Records. Each image member (its last extension png, jpg, jpeg, bmp, tif, tiff or webp;
decoded as image folders decode theirs, formats/pixels.py) and each numeric .npy member
is one record of its own, an array named SHARD/MEMBER by the member's name in the output
(`train-000000.tar/0001.png` for 0001.jpg), which keys its random streams and --range. The perturbed members of one sample are one
subject's (`rows`): the per-record figure composes them, and --budget record spreads
--eps over them, as for arrays that share their rows.

Everything else is a label or metadata (.cls, .json, .txt, ...): by the rule of
formats/leftovers.py it is left out of the output and listed in the manifest's `dropped`,
one entry per extension with the number of members, unless --keep names its extension
(`--keep cls`, `--keep meta.json`; globs too), which copies those members raw (listed in
`unperturbed`). Members that hold what tldp never copies raw (DICOM, NIfTI, Python pickles:
.pyd, .pickle, .pth) are dropped even when --keep names them. Files in the folder beside
the shards are dropped and listed (kind "file"), or copied raw when --keep names them.

Output. A folder holding each shard under its own relative name, members in the input's
order: image members as lossless PNG (`0001.jpg` becomes `0001.png`, in the same sample),
clipped and rounded to the image's integer range, alpha channel and ICC profile dropped
unless --keep alpha, --keep icc_profile; .npy members as .npy of the run's output dtype and the same
shape. Tar headers are written anew, deterministic: each member's name and mode from the
input, a constant modification time (MTIME: the input's can date a recording), no
owner (uid, gid 0, names blank) and none of the input's PAX records but those a long or
non-ASCII name needs. The sample keys are written as they are (often file names, which
can name a person): listed in `unperturbed` as "sample keys". With --anonymize-names each
sample's key becomes its number in the samples' order across the shards (000000,
000001, ...: the order the output holds them in anyway), the same for all its members,
so webdataset groups them as before; the name map, kept with the raw data, pairs the
keys. The manifest then names each shard as the output does (not by the input's path), and
counts the files beside the shards it leaves out and the links it skips (the name map names
them), as an image folder's. Folder entries and members without a key (no extension) are then not written,
their names being the input's; the shards keep their names. An extension is written only
when it is a file type alone (TYPE_EXTENSIONS) or --keep declares it a field name (seg.png):
any other may be the rest of a name (alice.smith.jpg: extension smith.jpg, shared by every
Smith), so it is refused on a perturbed member and withheld from the manifest on a dropped
label member. A shard is written member by member as its records come back, so
memory holds a few members whatever the shard's size.

Refused, with one line: compressed shards (.tar.gz: decompress them first), members
whose path is absolute or climbs out with `..`, links (symbolic and hard), devices,
FIFOs and sparse members, two members of one name, a member that runs past the end of
its shard, and two image members of a sample that would both be written as KEY.png.
Symbolic links inside a shard folder are skipped and listed (nothing outside it is read).
"""

from __future__ import annotations

import datetime as _dt
import io
import os
import posixpath
import re
import secrets
import tarfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Iterator

import numpy as np
from PIL import Image

from tldp_cli import __version__
from tldp_cli.errors import InputError, UsageError, reason_of
from tldp_cli.files.checked_io import open_regular, writing
from tldp_cli.formats import (DATASET_FORMATS, DICOM_REASON, ArrayJob, DocRow, Format, FormatOptions, Reader, Writer,
                              check_numeric_dtype, data_file, decode_reason, folder_files, folder_output,
                              leftovers, listing, name_maps, pixels, plural)

NAME = "webdataset"
SHARD_SUFFIX = ".tar"
COMPRESSED_SUFFIXES = (".tar.gz", ".tgz", ".tar.bz2", ".tar.xz", ".tar.zst", ".tar.lz4")
IMAGE_EXTENSIONS = ("png", "jpg", "jpeg", "bmp", "tif", "tiff", "webp")
ARRAY_SUFFIX = ".npy"
PICKLE_EXTENSIONS = ("pyd", "pickle", "pkl", "pth")
# Every output member's modification time: a constant (the epoch), as reproducible tar
# builds write, since the input's times can date when and where a subject was recorded.
MTIME = 0
USTAR_MAGIC = b"ustar"  # at offset 257 of a POSIX (ustar, pax) or GNU tar header
MAX_SHARDS = 1_000_000  # names a brace pattern may expand to
PROBE_BYTES = 1 << 16  # an image member's head, read to learn its header (all of it if that fails)
# WebDataset's rule (webdataset.tariterators.base_plus_ext): key, then extension after the
# first dot of the base name
_KEY = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")
_BRACE = re.compile(r"\{([^{}]*)\}")
_RANGE = re.compile(r"^(-?\d+)\.\.(-?\d+)$")

IMAGE, ARRAY, LEFTOVER, NEVER, FOLDER = "image", "array", "leftover", "never copied", "folder"
LABEL_REASON = "a label or metadata member, not perturbed"
OTHER_FILE_REASON = "a file beside the shards, not perturbed"
FILES_WITHHELD = "files beside the shards"  # how --anonymize-names lists them: a count, not their names
PICKLE_REASON = "a Python pickle, data tldp does not load"
ANONYMOUS_DIGITS = 6  # --anonymize-names: keys 000000, 000001, ...: at least this many digits
NO_KEY = "(no extension)"  # how the manifest names members without a key, anonymized
NO_KEY_REASON = ("a member without an extension, so of no sample: its name is the input's "
                 "(--anonymize-names writes none)")
# --anonymize-names writes a member's extension as it is. Public by rule: a file type alone
# (what webdataset's encoders and decoders dispatch on: the last component), optionally
# gzipped (json.gz). Any other extension (seg.png, meta.json, smith.png) may be the rest of
# a name (alice.smith.png: key alice) and is written only where --keep declares it.
TYPE_EXTENSIONS = frozenset((
    *IMAGE_EXTENSIONS, *PICKLE_EXTENSIONS,
    # webdataset's writer's handlers and autodecode's decoders, in their words
    *"cls cls2 class count index inx id txt text transcript html htm npy npz ten tenbin tb json jsn mp "
     "msgpack msg cbor img image pbm pgm ppm gif".split(),
    # other common members' types
    *"csv tsv xml yaml yml md jsonl parquet safetensors pt dcm nii wav flac mp3 ogg opus m4a mp4 avi mov "
     "mkv webm".split()))
UNDECLARED = "(undeclared extension)"  # how the manifest names members whose extension is withheld
UNDECLARED_REASON = ("a label or metadata member whose extension is no file type alone and not declared "
                     "with --keep, so may be the rest of a name (--anonymize-names writes none; "
                     "--keep EXTENSION declares it and copies the members raw)")
FIELD_REASON = "kept by --keep (declared a field name, not part of a sample's name)"
FOLDER_ENTRIES = "folder entries"
FOLDER_REASON = "tar folder entries, whose names are the input's: not written (--anonymize-names)"


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


def _pattern_base(path: Path) -> Path:
    """The folder the shards a pattern names are relative to: its longest leading folder
    without a brace."""
    parts = Path(path).parts
    fixed = next(i for i, part in enumerate(parts) if "{" in part or "}" in part)
    return Path(*parts[:fixed]) if fixed else Path(".")


def _is_tar(path: Path) -> bool:
    try:
        with open_regular(path) as f:
            return f.read(262)[257:262] == USTAR_MAGIC
    except (OSError, InputError):
        return False


def _is_compressed_shard(path: Path) -> bool:
    return path.name.lower().endswith(COMPRESSED_SUFFIXES)


def can_open(path: Path) -> bool:
    """A tar file (the ustar magic), a compressed shard (refused by the reader with the
    reason), or a folder holding .tar files and no images (not a Zarr store)."""
    if path.is_file():
        return _is_tar(path) or _is_compressed_shard(path)
    if not path.is_dir() or any((path / marker).exists() for marker in ("zarr.json", ".zarray", ".zgroup")):
        return False
    found = False
    for _, _, files in os.walk(path):
        for name in files:
            lower = name.lower()
            if lower.rsplit(".", 1)[-1] in IMAGE_EXTENSIONS:
                return False
            found = found or lower.endswith(SHARD_SUFFIX) or lower.endswith(COMPRESSED_SUFFIXES)
    return found


def default_output(path: Path) -> Path:
    """A folder beside the input: shards/ -> shards.tldp/, train-000.tar -> train-000.tldp/,
    shards/train-{0..9}.tar -> shards.tldp/."""
    if is_pattern(path):
        path = _pattern_base(path)
    elif path.is_file() and path.name.lower().endswith(SHARD_SUFFIX):
        return path.with_name(path.name[:-len(SHARD_SUFFIX)] + ".tldp")
    return folder_output(path)


@dataclass
class _Member:
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
class _Shard:
    path: Path
    rel: str  # its name in the output folder
    members: list[_Member] = field(default_factory=list)


def _read_at(path: Path, offset: int, size: int) -> bytes:
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
    if last in IMAGE_EXTENSIONS:
        return IMAGE, ""
    if "." + last == ARRAY_SUFFIX:
        return ARRAY, ""
    return LEFTOVER, ""


def _public_extension(extension: str) -> bool:
    """A file type alone (png, cls, json), or gzipped (json.gz): names no one (TYPE_EXTENSIONS)."""
    parts = extension.split(".")
    if len(parts) == 2 and parts[1] == "gz":
        parts = parts[:1]
    return len(parts) == 1 and parts[0] in TYPE_EXTENSIONS


def _out_name(member_name: str, kind: str) -> str:
    if kind != IMAGE:
        return member_name
    stem, _ = posixpath.splitext(member_name)
    return stem + ".png"


def _scan(path: Path, rel: str) -> _Shard:
    """The shard's members, in order, checked (see the module docstring)."""
    size = os.stat(path).st_size
    shard = _Shard(path, rel)
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
                shard.members.append(_Member(name, info.offset_data, info.size, info.mode & 0o777, kind, key,
                                             extension, _out_name(name, kind),
                                             reason=reason))
                # flat memory however many members (typeshed does not declare TarFile.members)
                tar.members = []  # type: ignore[attr-defined]
    except tarfile.TarError as exc:
        raise InputError(f"{path}: not a readable tar file ({reason_of(exc)}); it may be truncated") from None
    return shard


def _probe_image(shard: Path, member: _Member) -> pixels.Header:
    """The image's header, from the member's head (or all of it when the head is not enough)."""
    for size in dict.fromkeys((min(member.size, PROBE_BYTES), member.size)):
        data = io.BytesIO(_read_at(shard, member.offset, size))
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


def _probe_array(shard: Path, member: _Member) -> tuple[tuple[int, ...], np.dtype]:
    data = io.BytesIO(_read_at(shard, member.offset, min(member.size, PROBE_BYTES)))
    major, _ = np.lib.format.read_magic(data)
    read = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
    shape, _, dtype = read(data)
    if data.tell() + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize != member.size:
        raise ValueError("its header states another size than the member holds")
    return tuple(shape), dtype


@dataclass(frozen=True)
class _ReadMember:
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
        data = _read_at(self.shard, self.offset, self.size)
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


def _shard_files(path: Path) -> tuple[Path, list[str], list[str], list[str]]:
    """(the folder the shards' names are relative to, the shards, other files, links)."""
    if is_pattern(path):
        base = _pattern_base(path)
        names = list(dict.fromkeys(expand_braces(str(path))))
        for name in names:
            if not Path(name).is_file():
                raise InputError(f"{name}: no such shard (named by the pattern {path})")
        return base, [Path(name).relative_to(base).as_posix() if base != Path(".") else Path(name).as_posix()
                      for name in names], [], []
    if path.is_file():
        return path.parent, [path.name], [], []
    return (path, *_walk(path))


class WebDatasetReader(Reader):
    format = NAME

    def __init__(self, path: Path, options: FormatOptions):
        self.path = path
        self.messages: list[str] = []
        if options.datasets:
            raise UsageError(f"{path}: --dataset applies to {DATASET_FORMATS}, not WebDataset "
                             "shards: every image and .npy member is perturbed")
        if options.image_format != "png":
            raise UsageError(f"{path}: --image-format {options.image_format}: WebDataset image members "
                             "are written as PNG")
        if options.copy_other or options.skip_bad:
            raise UsageError(f"{path}: --{'copy-other' if options.copy_other else 'skip-bad'} applies to "
                             "folders of images, not WebDataset shards (--keep NAME copies a file beside "
                             "the shards; a member that cannot be decoded stops the run)")
        self.base, rels, self.others, self.links = _shard_files(path)
        if not rels:
            links = [rel for rel in self.links if rel.lower().endswith(SHARD_SUFFIX)]
            hint = (f" but {plural(len(links), 'symbolic link')} to shards, which tldp does not follow in a "
                    f"folder: name them with a brace pattern ('{path}/NAME-{{000..009}}.tar'), whose "
                    "links it follows" if links else "")
            raise InputError(f"{path}: no .tar shards in the folder{hint}")
        compressed = [rel for rel in rels if _is_compressed_shard(Path(rel))]
        if compressed:
            raise InputError(f"{self.base / compressed[0]}: a compressed shard, which tldp does not read "
                             "member by member; decompress it first (gunzip, zstd -d) and give the .tar")
        self.shards = [_scan(self.base / rel, rel) for rel in rels]
        self.anonymized = options.anonymize_names
        self.left = leftovers.Leftovers(list(options.keep))
        self.new_keys = self._anonymize() if self.anonymized else {}
        self.jobs = self._jobs()
        if not self.jobs:
            raise InputError(f"{path}: no image or .npy members to perturb in "
                             f"{plural(len(self.shards), 'shard')}")
        self._leftovers(self.left)
        self.samples = self._samples()
        self.manifest_extra: dict[str, Any] = {**self.left.manifest_extra(), NAME: {
            "shards": len(self.shards), "samples": self.sample_count,
            "perturbed_members": len(self.jobs),
            "members_renamed": sum(_out_name(m.name, m.kind) != m.name for s in self.shards for m in s.members)}}
        if self.anonymized:
            self.name_map_id = secrets.token_hex(16)  # ties the manifest to its name map
            self.manifest_extra["anonymized_names"] = {
                "name_map_id": self.name_map_id,
                "rule": "each sample's key renamed to its number in the samples' order across the shards "
                        "(000000, 000001, ...), the same for all its members; folder entries and members "
                        "without a key left out; the shards keep their names, inputs name them so and not "
                        "by the input's path; files left out and links skipped are counts; the name map "
                        "kept with the raw data pairs the keys and names those files"}
        grouped = [row for rows in self.samples.values() for row in rows if len(row) > 1]
        self.record_description = (
            "a sample: its perturbed members (images, .npy arrays) together, composed" if grouped
            else "one member of a sample (an image or a .npy array)")
        self._report()
        if options.dtype is not None and all(m.kind == IMAGE for s in self.shards for m in s.members if m.job):
            # asked for, but PNG members hold the images' own integers (.npy members would take it)
            self.messages.append(pixels.dtype_not_applied(options.dtype, "the image members"))

    def _anonymize(self) -> dict[str, str]:
        """--anonymize-names: each sample's key becomes its number in the samples' order across
        the shards, in each of its members' names (a key that comes back in its shard keeps
        its number: one subject, _samples); a member without a key is never written. Returns
        the name map's pairs, "SHARD/KEY" -> the new key."""
        numbers: dict[tuple[str, str], int] = {}
        for shard, member in self._keyed_members():
            numbers.setdefault((shard.rel, str(member.key)), len(numbers))
        self._check_extensions()
        digits = max(ANONYMOUS_DIGITS, len(str(len(numbers) - 1)))
        for shard in self.shards:
            for member in shard.members:
                if member.kind == FOLDER:
                    continue  # not written (WebDatasetWriter)
                if member.key is None:
                    member.kind, member.reason, member.withheld = NEVER, NO_KEY_REASON, NO_KEY
                    continue
                # its name is the key, then what follows it (".seg.png")
                member.out_name = f"{numbers[shard.rel, member.key]:0{digits}d}{member.out_name[len(member.key):]}"
        return {f"{rel}/{key}": f"{number:0{digits}d}" for (rel, key), number in numbers.items()}

    def _check_extensions(self) -> None:
        """--anonymize-names writes each member's extension as it is: all of its base name after
        the first dot (webdataset's rule). Only a file type alone is public by rule
        (_public_extension); any other (seg.png, or smith.png of alice.smith.png, however many
        samples hold it) is written only where --keep declares it, listed as a field name. An
        undeclared one is refused on a perturbed member, before anything is written; a label
        member is dropped anyway, and listed without its extension (UNDECLARED)."""
        fields: dict[str, int] = {}
        for shard, member in self._keyed_members():
            extension = str(member.extension)
            if _public_extension(extension):
                continue
            if self.left.kept(extension):  # declared: a label member is then copied, under its name
                if member.kind in (IMAGE, ARRAY):
                    fields[extension] = fields.get(extension, 0) + 1
                continue
            if member.kind in (IMAGE, ARRAY):
                raise InputError(
                    f"{shard.path}: member {member.name!r}: its extension {extension!r} (all of its base name "
                    "after the first dot, which webdataset and --anonymize-names keep) is not a file type "
                    f"alone, so it may be part of a name; if it is a field of the samples, declare it with "
                    f"--keep {extension}; otherwise rename the files before making the shards (KEY.FIELD, "
                    "with no dot in KEY)")
            member.kind, member.reason, member.withheld = NEVER, UNDECLARED_REASON, UNDECLARED
        for extension, count in fields.items():
            self.left.copied(extension, "field name", FIELD_REASON, members=count)

    def _keyed_members(self) -> Iterator[tuple[_Shard, _Member]]:
        """Each (shard, member) of a sample: a member with a key (an extension), not a folder entry."""
        for shard in self.shards:
            for member in shard.members:
                if member.key is not None and member.kind != FOLDER:
                    yield shard, member

    def _jobs(self) -> list[ArrayJob]:
        jobs = []
        for shard in self.shards:
            written: dict[str, str] = {}
            for member in shard.members:
                if member.kind in (IMAGE, ARRAY):
                    self._probe(shard, member)
                    jobs.append(self._job(shard, member))
                clash = written.get(member.out_name)
                if clash is not None:
                    raise InputError(f"{shard.path}: members {clash} and {member.name} would both be "
                                     f"written as {member.out_name} (images are written as PNG); rename one")
                written[member.out_name] = member.name
        return jobs

    def _probe(self, shard: _Shard, member: _Member) -> None:
        where = f"{shard.path}: member {member.name}"
        try:
            if member.kind == IMAGE:
                header = _probe_image(shard.path, member)
                member.shape, member.dtype, member.has_alpha = header.shape, header.dtype, header.has_alpha
                member.has_icc = header.has_icc
            else:
                member.shape, member.dtype = _probe_array(shard.path, member)
        except InputError:
            raise
        except pixels.Unsupported as exc:
            raise InputError(f"{where}: {exc}") from None
        except MemoryError:
            raise
        except Exception as exc:
            what = "an image" if member.kind == IMAGE else "a .npy array"
            raise InputError(f"{where}: cannot be decoded as {what} ({decode_reason(exc)})") from None
        check_numeric_dtype(Path(f"{shard.path}: member {member.name}"), member.dtype)

    def _job(self, shard: _Shard, member: _Member) -> ArrayJob:
        member.job = f"{shard.rel}/{member.out_name}"  # as in the output: evaluate pairs them by it
        dtype = member.decoded_dtype.newbyteorder("=")
        return ArrayJob(name=member.job, shape=(1, *member.shape), dtype=dtype,
                        read=_ReadMember(shard.path, member.name, member.offset, member.size, member.kind,
                                         member.shape, dtype),
                        source={"path": str(shard.path), "format": NAME,
                                "dataset": member.out_name if self.anonymized else member.name,
                                "shape": list(member.shape), "dtype": str(member.dtype)})

    def _leftovers(self, left: leftovers.Leftovers) -> None:
        """Labels and metadata by extension, and the files beside the shards: dropped and
        listed, or copied raw where --keep names them."""
        counts: dict[tuple[str, str], int] = {}
        for shard in self.shards:
            for member in shard.members:
                if member.kind in (LEFTOVER, NEVER):
                    key = (member.label, LEFTOVER if member.kind == LEFTOVER else member.reason)
                    counts[key] = counts.get(key, 0) + 1
        self.kept_extensions: set[str] = set()
        for (label, what), count in counts.items():
            if what != LEFTOVER:
                left.kept(label)  # a --keep naming it is used: it is refused below, not unmatched
                left.dropped.append({"name": label, "kind": "member", "members": count,
                                     "reason": what if label == UNDECLARED else f"{what}: never copied raw"})
            elif left.kept(label):
                self.kept_extensions.add(label)
                left.unperturbed.append({"name": label, "kind": "member", "members": count,
                                         "reason": leftovers.KEPT})
            else:
                left.dropped.append({"name": label, "kind": "member", "members": count,
                                     "reason": LABEL_REASON})
        self._files_beside(left)
        self.keep_alpha = left.alpha_channels(sum(member.has_alpha for shard in self.shards
                                                  for member in shard.members if member.job), "image member")
        keys = len({(shard.path, member.key) for shard in self.shards for member in shard.members if member.job})
        if keys and not self.anonymized:  # written as they are: listed, so the summary line names them
            left.copied("sample keys", "name", f"the keys of {plural(keys, 'sample')} (member names without their "
                                               "extensions), written as they are: often file names, which can "
                                               "name a person; --anonymize-names numbers them")
        folders = sum(member.kind == FOLDER for shard in self.shards for member in shard.members)
        if folders and self.anonymized:
            left.dropped.append({"name": FOLDER_ENTRIES, "kind": "member", "members": folders,
                                 "reason": FOLDER_REASON})
        self.keep_icc = left.icc_profiles(sum(member.has_icc for shard in self.shards
                                              for member in shard.members if member.job), "image member")
        left.considered(job.name for job in self.jobs)
        left.check(self.path)

    def _files_beside(self, left: leftovers.Leftovers) -> None:
        """The files beside the shards: copied raw under their names where --keep names them,
        else dropped and listed, by name, or with --anonymize-names counted (their names can
        name people; the name map lists them, as an image folder's skipped files)."""
        self.kept_files: list[str] = []
        self.files_left_out: list[str] = []
        for rel in self.others:
            never = data_file(self.base / rel)
            if never:
                left.kept(rel)  # a --keep naming it is used: it is refused, not unmatched
                self.files_left_out.append(rel)
                if not self.anonymized:
                    left.drop(rel, "file", f"{never}: never copied raw")
            elif left.kept(rel):
                self.kept_files.append(rel)
                left.copied(rel, "file", leftovers.KEPT)
            else:
                self.files_left_out.append(rel)
                if not self.anonymized:
                    left.drop(rel, "file", OTHER_FILE_REASON)
        if self.anonymized and self.files_left_out:
            left.drop(FILES_WITHHELD, "file", f"{plural(len(self.files_left_out), 'file')} beside the shards, not "
                                              "perturbed and not named by --keep (which never copies a data file); "
                                              "their names withheld (--anonymize-names): the name map lists them")

    def _samples(self) -> dict[str, list[list[str]]]:
        """By shard, the perturbed members of each sample: the members of one key. A key
        that comes back after other keys' members (which webdataset reads as a second
        sample) is the same subject's, so its members join the first ones' record: counted
        apart, each would carry a figure that leaves the other out."""
        found: dict[str, list[list[str]]] = {}
        self.sample_count = 0
        for shard in self.shards:
            rows: dict[str, list[str]] = {}
            for member in shard.members:
                if member.key is None or member.kind == FOLDER:
                    continue
                row = rows.setdefault(member.key, [])
                if member.job is not None:
                    row.append(member.job)
            self.sample_count += len(rows)
            found[shard.rel] = [row for row in rows.values() if row]
        return found

    def _report(self) -> None:
        labels = (LABEL_REASON, UNDECLARED_REASON)
        never = [e for e in self.left.dropped if e["kind"] == "member" and e["reason"] not in (*labels, FOLDER_REASON)]
        for entry in never:
            self.messages.append(f"dropped the {entry['name']} members ({plural(entry['members'], 'member')}): "
                                 f"{entry['reason']}, not even with --keep")
        if self.anonymized and self.files_left_out:
            self.messages.append(f"dropped {plural(len(self.files_left_out), 'file')} beside the shards (named in "
                                 "the name map; --keep NAME copies one raw)")
        files = [e["name"] for e in self.left.dropped if e["kind"] == "file" and e["reason"] == OTHER_FILE_REASON]
        if files:
            self.messages.append(f"dropped {plural(len(files), 'file')} beside the shards: {listing(files)} "
                                 "(--keep NAME copies one raw)")
        data = [e["name"] for e in self.left.dropped
                if e["kind"] == "file" and e["reason"] != OTHER_FILE_REASON and e["name"] != FILES_WITHHELD]
        if data:
            self.messages.append(f"dropped {plural(len(data), 'file')} holding data beside the shards, never "
                                 f"copied raw, not even with --keep: {listing(data)} (the manifest's dropped "
                                 "says why)")
        dropped = [e for e in self.left.dropped if e["kind"] == "member" and e["reason"] in labels]
        kept = [e for e in self.left.unperturbed if e["kind"] == "member"]
        if dropped:
            self.messages.append(f"dropped the {', '.join(e['name'] for e in dropped)} members "
                                 f"({plural(sum(e['members'] for e in dropped), 'member')}; the manifest's "
                                 "dropped lists them; --keep EXTENSION copies labels raw)")
        if kept:
            self.messages.append(f"copied the {', '.join(e['name'] for e in kept)} members raw (--keep)")
        if self.links:  # with --anonymize-names a count: the name map names them
            self.manifest_extra["skipped_symbolic_links"] = len(self.links) if self.anonymized else self.links
            self.messages.append(f"skipped {plural(len(self.links), 'symbolic link')}: "
                                 + ("named in the name map" if self.anonymized else listing(self.links)))
        if self.anonymized:
            self.messages.append(f"renamed the keys of {plural(len(self.new_keys), 'sample')} to their numbers "
                                 "in order, 000000, 000001, ... (the name map pairs them)")
        renamed = self.manifest_extra[NAME]["members_renamed"]
        if renamed and not self.anonymized:
            self.messages.append(f"{plural(renamed, 'image member')} written as PNG under the same key "
                                 "(KEY.jpg -> KEY.png)")

    def arrays(self) -> list[ArrayJob]:
        return self.jobs

    def manifest_inputs(self) -> list[dict[str, Any]]:
        """The arrays' sources; with --anonymize-names each names its shard as the output does
        (its name in the folder of shards), not by the input's path, whose folders can name people."""
        if not self.anonymized:
            return super().manifest_inputs()
        shard_of = {m.job: s.rel for s in self.shards for m in s.members if m.job is not None}
        return [{**job.source, "path": shard_of[job.name]} for job in self.jobs]

    def name_map(self, output_path: Path, manifest_path: Path) -> dict:
        """The name map: the sample keys the output withholds. It can name the people in the data."""
        return {"schema": name_maps.SCHEMA, "sensitive": name_maps.SENSITIVE,
                "tool": {"name": "tldp", "version": __version__}, "name_map_id": self.name_map_id,
                "input": str(self.path), "output": str(output_path), "manifest": str(manifest_path),
                "samples": self.new_keys, "files_left_out": self.files_left_out,
                "skipped_symbolic_links": self.links,
                "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}

    def output_dtype(self, dtype: np.dtype) -> str:
        """Image members as PNG of their own bit depth, .npy members of the engine's dtype."""
        members = [m for s in self.shards for m in s.members if m.job is not None]
        image_dtypes = sorted({str(m.decoded_dtype.newbyteorder("=")) for m in members if m.kind == IMAGE})
        kinds = [" and ".join(f"{d} PNG" for d in image_dtypes)] if image_dtypes else []
        return ", ".join(kinds + ([f"{np.dtype(dtype)} .npy"] if any(m.kind == ARRAY for m in members) else []))

    def rows(self, jobs: list[ArrayJob]) -> list[list[str]] | None:
        """The perturbed members of a sample are one subject's record; every member is in
        one row (a sample of one member is a row of one)."""
        wanted = {job.name for job in jobs}
        rows = [[name for name in row if name in wanted] for shard in self.samples.values() for row in shard]
        rows = [row for row in rows if row]
        return rows if any(len(row) > 1 for row in rows) else None


def open_reader(path: Path, options: FormatOptions) -> WebDatasetReader:
    return WebDatasetReader(path, options)


def name_map_destination(name_map: Path | None, source: Path, output_path: Path, manifest: Path,
                         overwrite: bool) -> Path:
    """name_maps.destination; a brace pattern's goes beside the folder of its shards."""
    return name_maps.destination(name_map, _pattern_base(source) if is_pattern(source) else source, output_path,
                                 manifest, overwrite)


def _tar_info(name: str, size: int, member: _Member) -> tarfile.TarInfo:
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
        self.items: list[tuple[str, _Shard, _Member | None]] = []
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

    def _encode(self, shard: _Shard, member: _Member, values: np.ndarray) -> bytes:
        if member.kind == ARRAY:
            out = io.BytesIO()
            np.lib.format.write_array(out, np.asarray(values, dtype=self.dtype), allow_pickle=False)
            return out.getvalue()
        info = np.iinfo(member.decoded_dtype)
        rounded = values if values.dtype.kind in "iu" else np.rint(values)
        image = np.clip(rounded, info.min, info.max).astype(member.decoded_dtype.newbyteorder("="))
        data = io.BytesIO(_read_at(shard.path, member.offset, member.size))
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

    def _open(self, shard: _Shard) -> None:
        target = self.root / shard.rel
        with writing(target):
            target.parent.mkdir(parents=True, exist_ok=True)
            self.file = open(target, "xb")
            self.tar = tarfile.open(fileobj=self.file, mode="w", format=tarfile.PAX_FORMAT)
        self.written.append(target)

    def _copy_member(self, shard: _Shard, member: _Member) -> None:
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


def create_writer(reader: WebDatasetReader, tmp_path: Path, dtype: np.dtype,
                  options: FormatOptions) -> WebDatasetWriter:
    return WebDatasetWriter(reader, tmp_path, dtype, options)


def output_bytes(jobs: list[ArrayJob], dtype: np.dtype, options: FormatOptions) -> int:
    """The least the output needs: image members 8 or 16 bits a value (noise does not
    compress), arrays the engine's dtype."""
    total = 0
    for job in jobs:
        is_image = job.source.get("dataset", "").lower().rsplit(".", 1)[-1] in IMAGE_EXTENSIONS
        total += job.records * job.elements * (job.dtype.itemsize if is_image else np.dtype(dtype).itemsize)
    return total


def is_earlier_output(path: Path, reader: WebDatasetReader) -> bool:
    """A folder whose manifest names it is an earlier output if it holds only this input's
    shards (by name) and the files --keep copies."""
    expected = {shard.rel for shard in reader.shards} | set(reader.kept_files)
    for directory, _, files in os.walk(path):
        for name in files:
            if (Path(directory) / name).relative_to(path).as_posix() not in expected:
                return False
    return True


FORMAT = Format(
    name=NAME, title="WebDataset shards", folder=True, file_input=True, pattern_input=is_pattern,
    pattern_files=pattern_files,
    honours_keep=True, member_noun="member",
    name_map_destination=name_map_destination, write_name_map=name_maps.write,
    can_open=can_open, default_output=default_output, open_reader=open_reader, create_writer=create_writer,
    output_bytes=output_bytes, earlier_output=is_earlier_output,
    docs=(DocRow("WebDataset shards: a folder of `.tar` files, one `.tar`, or a brace pattern "
                 "(`'shards/train-{000000..000009}.tar'`)",
                 "the tar header's `ustar` magic; a folder holding `.tar` files and no images",
                 "`tldp perturb shards/ --eps 1`",
                 "`shards.tldp/`: the same shards and member order, images as PNG, `.npy` arrays; labels "
                 "left out unless `--keep EXT` ([below](#webdataset-shards-tar))"),),
)
