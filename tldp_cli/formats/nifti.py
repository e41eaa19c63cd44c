"""NIfTI-1 and NIfTI-2 volumes (.nii, .nii.gz), read and written with nibabel.

Records. A NIfTI file is one subject's scan. A volume of up to three dimensions is one
record. A series (4-D: fMRI, diffusion; more dimensions: more frames per time point) is
read as its 3-D frames, in file order, each an array of one record named "frame 0",
"frame 1", ..., so that memory holds a few frames however long the series is. Every
frame is the same person's, so the frames form one row (`rows`): as for arrays that
share their rows (docs/guarantee.md, "Rows are subjects"), one record is the whole
series, the per-record figure composes all its frames, and --budget record spreads
--eps over all of them.

Values. The values perturbed are those nibabel reads (`img.dataobj`): the stored
values, or where the header scales them (scl_slope, scl_inter) the scaled values in
float64, as CF packing is handled (formats/cf.py): --range is in those units, and the
output is written unscaled, as --dtype. Integer data without scaling defaults its range
to its dtype's (8 and 16 bits); float data needs --range.

Header. The output keeps what places and times the voxels: the dimensions, voxel sizes
and units, the qform and sform (codes and transforms, so nibabel gives the same affine),
slice timing, the intent and its parameters. Every other field is written as a new
nibabel header has it; where the input's differs it is listed in the manifest's
`dropped` (free text: `descrip`, `aux_file`, `intent_name`, `db_name`; statistics of the
raw values: `cal_min`, `cal_max`, `glmin`, `glmax`; legacy ANALYZE fields), and so are
the header extensions (DICOM headers, AFNI, JSON sidecars, ...), unless --keep names
them (`@descrip`, `@extension.1`; formats/leftovers.py).

Output. nibabel writes the header (and kept extensions) and tldp the frames after it,
in order (a frame computed early waits for those before it), into the temporary file the
pipeline commits; gzip-compressed, at nibabel's level 1, when the output's name ends in
.gz. nibabel knows NIfTI by the name's suffix alone, so the output's name must end with
.nii or .nii.gz (files/output.py refuses any other --out).
"""

from __future__ import annotations

import contextlib
import gzip
import io
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from tldp_cli.errors import InputError, UsageError, reason_of
from tldp_cli.files.checked_io import open_regular, writing
from tldp_cli.formats import (DATASET_FORMATS, ArrayJob, DocRow, Format, FormatOptions, Reader, Writer,
                              check_numeric_dtype, leftovers, tldp_name)

NAME = "nifti"
GZIP_MAGIC = b"\x1f\x8b"
HEAD_BYTES = 548  # a NIfTI-2 header (540 bytes) and the extension flag
COMPRESS_LEVEL = 1  # nibabel's default for .nii.gz: noise compresses no better at higher levels
VOLUME = "volume"  # the one array of a volume of up to three dimensions

# Header fields that place and time the voxels: copied to the output as they are.
STRUCTURAL_FIELDS = (
    "dim_info", "dim", "intent_p1", "intent_p2", "intent_p3", "intent_code", "pixdim", "slice_start",
    "slice_end", "slice_code", "xyzt_units", "slice_duration", "toffset", "qform_code", "sform_code",
    "quatern_b", "quatern_c", "quatern_d", "qoffset_x", "qoffset_y", "qoffset_z", "srow_x", "srow_y",
    "srow_z")
# Header fields written anew for the output's data: its type, where it starts, no scaling.
LAYOUT_FIELDS = ("sizeof_hdr", "magic", "datatype", "bitpix", "vox_offset", "scl_slope", "scl_inter")
TEXT_FIELDS = ("descrip", "aux_file", "intent_name", "db_name", "data_type", "unused_str")
STATISTICS_FIELDS = ("cal_min", "cal_max", "glmin", "glmax")
TEXT_REASON = "free text in the header (it can name the subject, the site or the scanner), not perturbed"
STATISTICS_REASON = "a statistic of the raw values (display window, extremes), not perturbed"
LEGACY_REASON = "an ANALYZE 7.5 field that NIfTI readers ignore, not perturbed"
EXTENSION_REASON = "a header extension: data tldp does not perturb (DICOM headers, notes, sidecars)"
CIFTI_INTENTS = range(3000, 3100)  # nibabel opens a file with one of these as CIFTI-2, which needs its extension
CIFTI_EXTENSION = 32
CIFTI_REASON = ("a CIFTI-2 intent, whose CIFTI extension is left out: written as none (plain NIfTI-2), "
                "since readers open a file with this intent as CIFTI-2 and fail without the extension")


def _nibabel():
    import nibabel  # 0.2 s to import: only when a NIfTI file is read or written

    return nibabel


def _gzip_ng():
    from zlib_ng import gzip_ng  # the gzip module's GzipFile on zlib-ng: twice as fast to write

    return gzip_ng


def _is_gzip(path: Path) -> bool:
    with open_regular(path) as f:
        return f.read(2) == GZIP_MAGIC


@contextlib.contextmanager
def _opened(path: Path):
    """The file's bytes, decompressed if it is gzip (by its content, whatever its name)."""
    with open_regular(path) as raw:
        if raw.read(2) != GZIP_MAGIC:
            raw.seek(0)
            yield raw
            return
        raw.seek(0)
        # The standard library's reader: zlib-ng's reads ahead, and fails on a cut stream
        # before giving the header at its start
        with gzip.GzipFile(fileobj=raw, mode="rb") as unzipped:
            yield unzipped


def _magic(head: bytes) -> bytes | None:
    """b"n+1" / b"ni1" (NIfTI-1, single file / header of a pair), b"n+2" / b"ni2", or None."""
    for size, at in ((348, 344), (540, 4)):
        if len(head) >= at + 4 and size in (int.from_bytes(head[:4], "little"), int.from_bytes(head[:4], "big")) \
                and head[at:at + 4] in (b"n+1\0", b"ni1\0", b"n+2\0", b"ni2\0"):
            return head[at:at + 3]
    return None


def can_open(path: Path) -> bool:
    """A NIfTI-1 or NIfTI-2 header, gzip-compressed or not."""
    if not path.is_file():
        return False
    try:
        with _opened(path) as f:
            return _magic(f.read(HEAD_BYTES)) is not None
    except (OSError, EOFError, InputError):
        return False


def default_output(path: Path) -> Path:
    named = tldp_name(path, ".nii", FORMAT.compound_suffixes)
    if named.name.lower().endswith((".nii", ".nii.gz")):
        return named
    return path.with_name(path.name + (".tldp.nii.gz" if _is_gzip(path) else ".tldp.nii"))


def frame_name(index: int) -> str:
    return f"frame {index}"


@dataclass(frozen=True)
class _Frame:
    """Reads one 3-D frame (one record) through nibabel's array proxy, which decodes its
    byte order and scaling. Picklable: a .nii is opened inside each call; a .nii.gz is read
    through its process's one stream of the file (_GzipFrames), opened on first use."""

    path: Path
    shape: tuple[int, ...]  # the volume's spatial axes, then its frames
    dtype: np.dtype  # as stored, byte order included
    offset: int
    slope: float
    inter: float
    index: int
    compressed: bool = False

    def __call__(self, start: int, stop: int) -> np.ndarray:
        from nibabel.arrayproxy import ArrayProxy

        try:
            if self.compressed:
                size = int(np.prod(self.shape[:-1], dtype=np.int64)) * self.dtype.itemsize
                data = _gzip_frames(self.path, self.offset, size).frame(self.index)
                proxy = ArrayProxy(io.BytesIO(data), (self.shape[:-1], self.dtype, 0, self.slope, self.inter),
                                   mmap=False)
                frame = np.asarray(proxy[...])
            else:
                with open_regular(self.path) as f:
                    proxy = ArrayProxy(f, (self.shape, self.dtype, self.offset, self.slope, self.inter),
                                       mmap=False)
                    frame = np.asarray(proxy[..., self.index])
        except (InputError, MemoryError):  # MemoryError is not damage: the run says memory ran out
            raise
        except Exception as exc:  # EOFError from a cut gzip stream, ValueError from a short read
            what = "its voxels" if self.shape[-1] == 1 else f"{frame_name(self.index)} of its voxels"
            raise InputError(f"{self.path}: cannot read {what} ({reason_of(exc)}); it may be truncated or "
                             "corrupt") from None
        return frame.astype(frame.dtype.newbyteorder("="), copy=False)[None][start:stop]


class _GzipFrames:
    """The frames of a gzip-compressed series, inflated in order from one stream: gzip has no
    random access, so reading each frame from the start would inflate a series of T frames
    T/2 times over. Reading frame k after frame j < k inflates only the frames between, and
    those passed over wait here (up to WAITING_BYTES) for their own read: blocks run a few at
    a time, a little out of order. A frame before the stream's place (a second pass over the
    file) opens the file again."""

    WAITING_BYTES = 64 << 20

    def __init__(self, path: Path, offset: int, frame_bytes: int):
        self.path, self.offset, self.frame_bytes = path, offset, frame_bytes
        self.lock = threading.Lock()
        self.stream: BinaryIO | None = None
        self.raw: BinaryIO | None = None
        self.next = 0  # the frame the stream is at
        self.waiting: dict[int, bytes] = {}

    def frame(self, index: int) -> bytes:
        with self.lock:
            if index in self.waiting:
                return self.waiting.pop(index)
            if self.stream is None or index < self.next:
                self._open(index)
            while self.next < index:
                passed = self._read()
                if (len(self.waiting) + 1) * self.frame_bytes > self.WAITING_BYTES and self.waiting:
                    self.waiting.pop(min(self.waiting))
                self.waiting[self.next - 1] = passed
            return self._read()

    def _open(self, index: int) -> None:
        self.close()
        self.raw = open_regular(self.path)
        self.stream = _gzip_ng().GzipNGFile(fileobj=self.raw, mode="rb")
        self.stream.seek(self.offset + index * self.frame_bytes)  # inflates up to the frame
        self.next, self.waiting = index, {}

    def _read(self) -> bytes:
        assert self.stream is not None  # opened by _open
        data = self.stream.read(self.frame_bytes)
        if len(data) < self.frame_bytes:
            raise EOFError(f"the stream ends {self.frame_bytes - len(data)} bytes into {frame_name(self.next)}")
        self.next += 1
        return data

    def close(self) -> None:
        for handle in (self.stream, self.raw):
            if handle is not None:
                with contextlib.suppress(OSError, EOFError):
                    handle.close()
        self.stream = self.raw = None
        self.waiting = {}


_STREAMS: dict[tuple, _GzipFrames] = {}  # by file (path and identity): one stream per process
_STREAMS_LOCK = threading.Lock()


def _stream_key(path: Path) -> tuple:
    info = os.stat(path)
    return (os.path.abspath(path), info.st_dev, info.st_ino, info.st_mtime_ns, info.st_size)


def _gzip_frames(path: Path, offset: int, frame_bytes: int) -> _GzipFrames:
    key = (_stream_key(path), offset, frame_bytes)
    with _STREAMS_LOCK:
        if key not in _STREAMS:
            _STREAMS[key] = _GzipFrames(path, offset, frame_bytes)
        return _STREAMS[key]


def _close_streams(path: Path) -> None:
    """Closes this process's streams of `path` (the reader's close)."""
    with _STREAMS_LOCK:
        for key in [key for key in _STREAMS if key[0][0] == os.path.abspath(path)]:
            stream = _STREAMS.pop(key)
            with stream.lock:
                stream.close()


@contextlib.contextmanager
def _silenced(logger: logging.Logger):
    """`logger` prints nothing meanwhile (with no handler, logging's last resort would)."""
    level = logger.level
    logger.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        logger.setLevel(level)


def _load(path: Path):
    """The nibabel image of a single-file NIfTI (its header; the voxels stay on disk)."""
    nib = _nibabel()
    with _opened(path) as f:
        magic = _magic(f.read(HEAD_BYTES))
    if magic in (b"ni1", b"ni2"):
        raise InputError(f"{path}: the header of a NIfTI pair, whose voxels are in a separate .img "
                         "file; tldp reads single-file NIfTI: nibabel.save(nibabel.load(path), "
                         "'scan.nii.gz') makes one")
    klass = nib.Nifti2Image if magic == b"n+2" else nib.Nifti1Image
    try:
        # nibabel logs each fix it tries on a damaged header to stderr ("sizeof_hdr should be
        # 348; set sizeof_hdr to 348"): the one line below says what is wrong instead
        with _opened(path) as f, _silenced(nib.imageglobals.logger):
            header = klass.header_class.from_fileobj(f)
    except Exception as exc:  # HeaderDataError, EOFError, ValueError on damaged headers
        raise InputError(f"{path}: not a readable NIfTI header ({reason_of(exc)})") from None
    return klass, header


class NiftiReader(Reader):
    format = NAME

    def __init__(self, path: Path, options: FormatOptions):
        self.path = path
        if options.datasets:
            raise UsageError(f"{path}: --dataset applies to {DATASET_FORMATS}, not NIfTI: a volume or "
                             "series is perturbed whole")
        self.image_class, self.header = _load(path)
        header = self.header
        try:
            self.shape = tuple(int(n) for n in header.get_data_shape())
            self.stored = header.get_data_dtype()
            self.offset = int(header.get_data_offset())
            slope, inter = header.get_slope_inter()
        except Exception as exc:
            raise InputError(f"{path}: not a readable NIfTI header ({reason_of(exc)})") from None
        check_numeric_dtype(path, self.stored, "the volume")
        if not self.shape or 0 in self.shape:
            raise InputError(f"{path}: the volume is empty (shape {self.shape}); nothing to perturb")
        self.scaling = None if slope is None or (slope, inter or 0.0) == (1.0, 0.0) \
            else (float(slope), float(inter or 0.0))
        self.compressed = _is_gzip(path)
        self._check_size()
        self.messages: list[str] = []
        if self.scaling:
            self.messages.append(f"{path.name}: scaling its {self.stored.name} voxels (scl_slope, "
                                 "scl_inter) to float64 values before the noise, as nibabel reads them; "
                                 "--range is in these units")
        self.jobs = self._jobs()
        self.left = self._leftovers(options)
        self.manifest_extra = self.left.manifest_extra()
        self.record_description = (
            f"the whole volume ({self.jobs[0].elements} voxels), one subject's scan" if len(self.jobs) == 1
            else f"the whole series, one subject's scan: its {len(self.jobs)} frames of "
                 f"{self.jobs[0].elements} voxels, composed")

    @property
    def spatial(self) -> tuple[int, ...]:
        return self.shape[:3]

    @property
    def frames(self) -> int:
        return int(np.prod(self.shape[3:], dtype=np.int64))

    def _check_size(self) -> None:
        """A .nii shorter than its header says is refused now (a .nii.gz when it is read)."""
        needed = self.offset + int(np.prod(self.shape, dtype=np.int64)) * self.stored.itemsize
        if not self.compressed:
            size = os.stat(self.path).st_size
            if size < needed:
                raise InputError(f"{self.path}: ends {needed - size} bytes before its voxel data does "
                                 "(the header says more voxels than the file holds); it may be truncated")

    def _jobs(self) -> list[ArrayJob]:
        value_dtype = np.dtype(np.float64) if self.scaling else self.stored.newbyteorder("=")
        slope, inter = self.scaling or (1.0, 0.0)
        layout = (*self.spatial, self.frames)
        jobs = []
        for index in range(self.frames):
            name = VOLUME if self.frames == 1 else frame_name(index)
            source = {"path": str(self.path), "format": NAME, "shape": list(self.spatial),
                      "dtype": self.stored.name}
            if self.frames > 1:
                source["frame"] = index
            jobs.append(ArrayJob(name=name, shape=(1, *self.spatial), dtype=value_dtype,
                                 read=_Frame(self.path, layout, self.stored, self.offset, slope, inter, index,
                                             self.compressed),
                                 source=source))
        return jobs

    def _leftovers(self, options: FormatOptions) -> leftovers.Leftovers:
        """The header fields and extensions the output leaves out (the manifest's `dropped`),
        or copies when --keep names them (`unperturbed`)."""
        left = leftovers.Leftovers(list(options.keep))
        left.considered(f"@{key}" for key in self.header.keys())  # --keep @descrip on a blank one: nothing to do
        blank = self.image_class.header_class()
        self.kept_fields: list[str] = []
        for key in self.header.keys():
            if key in STRUCTURAL_FIELDS or key in LAYOUT_FIELDS or _same(self.header[key], blank[key]):
                continue
            reason = (TEXT_REASON if key in TEXT_FIELDS else STATISTICS_REASON if key in STATISTICS_FIELDS
                      else LEGACY_REASON)
            if left.attribute("", key, (), "header field", reason):
                self.kept_fields.append(key)
        self.kept_extensions = []
        for number, extension in enumerate(self.header.extensions, 1):
            name = f"@extension.{number}"
            code = extension.get_code()
            label = _nibabel().nifti1.extension_codes.label.get(code, "unknown")
            if left.kept(name):
                left.copied(name, "extension", leftovers.KEPT)
                self.kept_extensions.append(extension)
            else:
                left.drop(name, "extension", f"{EXTENSION_REASON}; code {code} ({label}), "
                                             f"{len(extension.content)} bytes")
        self.plain_intent = (int(self.header["intent_code"]) in CIFTI_INTENTS
                             and not any(e.get_code() == CIFTI_EXTENSION for e in self.kept_extensions))
        if self.plain_intent:
            left.drop("@intent_code", "header field", CIFTI_REASON)
        left.check(self.path)
        return left

    def arrays(self) -> list[ArrayJob]:
        return self.jobs

    def rows(self, jobs: list[ArrayJob]) -> list[list[str]] | None:
        """Every frame of a series is the same subject's: one row."""
        return [[job.name for job in jobs]] if len(jobs) > 1 else None

    def close(self) -> None:
        _close_streams(self.path)


def _same(value: Any, default: Any) -> bool:
    a, b = np.asarray(value), np.asarray(default)
    if a.dtype.kind in "SU" or b.dtype.kind in "SU":
        return a.tobytes().rstrip(b"\0") == b.tobytes().rstrip(b"\0")
    return a.shape == b.shape and bool(np.array_equal(a, b, equal_nan=a.dtype.kind == "f"))


def open_reader(path: Path, options: FormatOptions) -> NiftiReader:
    return NiftiReader(path, options)


def output_header(reader: NiftiReader, dtype: np.dtype):
    """The output's header: a new nibabel header of the input's kind and byte order, with
    the input's structural fields, those --keep names and the extensions it names, for
    unscaled data of `dtype`."""
    source = reader.header
    header = reader.image_class.header_class(endianness=source.endianness)
    for key in (*STRUCTURAL_FIELDS, *reader.kept_fields):
        if key in source.keys():
            header[key] = source[key]
    if reader.plain_intent:
        header["intent_code"] = 0
    header.set_data_dtype(np.dtype(dtype))
    header.set_slope_inter(None, None)  # unscaled: nibabel writes NaN
    header["vox_offset"] = 0  # nibabel sets the least offset the extensions leave
    for extension in reader.kept_extensions:
        header.extensions.append(extension)
    return header


class NiftiWriter(Writer):
    """Writes the header, then each frame once those before it are written."""

    def __init__(self, reader: NiftiReader, tmp_path: Path, dtype: np.dtype):
        self.path = tmp_path
        self.header = output_header(reader, dtype)
        self.dtype = self.header.get_data_dtype()  # the output's, in the header's byte order
        self.index = {job.name: i for i, job in enumerate(reader.jobs)}
        self.pending: dict[int, bytes] = {}
        self.next = 0
        self.lock = threading.Lock()
        self.failed = False
        compress = tmp_path.name.lower().endswith(".gz")  # the output's name ends .nii or .nii.gz
        if reader.scaling:
            self.postprocessing = [
                f"write the scaled volume unscaled: its stored {reader.stored.name} values were scaled "
                f"(scl_slope, scl_inter) before the noise, and are written as {np.dtype(dtype).name} with "
                "no scaling (unpacked)"]
            # Not scl_slope and scl_inter themselves: writers derive them from the volume's own
            # minimum and maximum (nibabel, SPM), which they then give away.
            self.manifest_extra = {"unpacked": {reader.path.name: {
                "stored_dtype": reader.stored.name, "unsigned": False}}}
        with writing(tmp_path):
            self.file: BinaryIO = open(tmp_path, "xb")
            try:
                self.stream: BinaryIO = (_gzip_ng().GzipNGFile(filename="", mode="wb", fileobj=self.file,
                                                            compresslevel=COMPRESS_LEVEL, mtime=0)
                                         if compress else self.file)
                head = io.BytesIO()
                self.header.write_to(head)
                offset = int(self.header.get_data_offset())
                self.stream.write(head.getvalue().ljust(offset, b"\0"))
            except BaseException:
                self.file.close()
                raise

    def write(self, job: ArrayJob, start: int, block: np.ndarray) -> None:
        data = np.asarray(block[0], dtype=self.dtype).tobytes(order="F")  # NIfTI: x varies fastest
        with self.lock:
            self.pending[self.index[job.name]] = data
            try:
                with writing(self.path):
                    while self.next in self.pending:
                        self.stream.write(self.pending.pop(self.next))
                        self.next += 1
            except BaseException:
                self.failed = True
                raise

    def close(self) -> list[Path]:
        with self.lock:
            if self.file.closed:
                return [self.path]
            try:
                if self.next == len(self.index) and not self.failed:  # else the output is discarded
                    with writing(self.path):
                        if self.stream is not self.file:
                            self.stream.close()
                        self.file.flush()
                        os.fsync(self.file.fileno())
            finally:
                with contextlib.suppress(OSError, ValueError):
                    if self.stream is not self.file:
                        self.stream.close()
                with contextlib.suppress(OSError):
                    self.file.close()
        return [self.path]


def create_writer(reader: NiftiReader, tmp_path: Path, dtype: np.dtype,
                  options: FormatOptions) -> NiftiWriter:
    return NiftiWriter(reader, tmp_path, dtype)


FORMAT = Format(
    # .nii.gz's last suffix (.gz) names no format: only .nii says NIfTI, and nibabel knows
    # NIfTI by the name alone, so an output's name ends with either.
    name=NAME, title="NIfTI volume", suffixes=(".nii",), compound_suffixes=(".nii.gz",),
    required_suffixes=(".nii", ".nii.gz"), honours_keep=True,
    can_open=can_open, default_output=default_output, open_reader=open_reader, create_writer=create_writer,
    docs=(DocRow("NIfTI volume (`.nii`, `.nii.gz`; NIfTI-1 and NIfTI-2)",
                 "the NIfTI header's size and magic (`n+1`, `n+2`), gzip-compressed or not",
                 "`tldp perturb bold.nii.gz --eps 1`",
                 "`bold.tldp.nii.gz`: the same dimensions, voxel sizes, units, qform and sform (nibabel gives "
                 "the same affine), byte order; header text and extensions left out "
                 "([below](#nifti-volumes-nii-niigz))"),),
)
