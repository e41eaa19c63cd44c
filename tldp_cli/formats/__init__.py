"""One module per on-disk format, each a plug-in that declares what it is and can do.

A format module ends with its declaration, a `Format`:

    FORMAT = Format(name="npy", title=".npy array", suffixes=(".npy",), ...,
                    can_open=can_open, default_output=default_output,
                    open_reader=open_reader, create_writer=create_writer)

and the registry below, FORMAT_MODULES, lists it (name -> module, in detection order).
`Format` names every capability the pipeline, the tools and the CLI ask about, with the
default of a format that has none of it: which --format NAME it answers to, the suffixes
that name it, whether it is a folder (and may also read one file, or a pattern of files
that names no file itself: a brace pattern of WebDataset shards), how it is detected
(can_open sniffs the content, not the suffix), whether an interrupted run resumes (reopen_writer), which options its
reader honours (--dataset, --exclude, --keep, CF markers), whether arrays share rows,
whether each record is a file of its own, the name map of --anonymize-names, the least
size of its output, and how an earlier output of its own is recognised (--overwrite
replaces nothing else). Nothing outside a format's module and the registry spells its
name: the others ask the declaration (tests/formats/test_format_interface.py checks it).

The pipeline asks the reader for the arrays to perturb, streams blocks of records
through the engine into the writer, and moves the finished output into place.
The writer writes only under tmp_path (a file or a directory); the pipeline
renames it to the destination once everything succeeded.

Every reader subclasses `Reader`, which declares `messages` (lines the CLI shows,
e.g. which datasets it chose), `manifest_extra` (fields added to the manifest, e.g.
the files skipped), `records_are_tensors`, `keeps_dtypes` (its writer stores each array
back in its own dtype: model files, tables), `record_description` (what one subject's
record is, in words, where the format knows), `manifest_inputs()`, `rows()` (the
arrays whose row i is one subject's record, where the format knows) and
`markers_are_data()` (CF missing-data markers inside the declared range) and `missing_fill()`
(the public value missing positions hold before the noise) with defaults.

Every writer subclasses `Writer`, which declares what the pipeline may use and the
defaults of a writer that needs none of it: `messages` (its own lines, shown after the
reader's), `postprocessing` and `manifest_extra` for the manifest, `output_dtype`,
`block_writer()` (a picklable function that writes a block from any process; None:
blocks computed on Dask come back and `write` stores them), `part_writer()` (a function
that writes part of a record, for a record its reader reads in parts: ArrayJob.read_parts),
`block_written()` and `digests()` (hashing while writing), `finish()`.
A reader's and a writer's `manifest_extra` are parts of the manifest that
run/manifest.py's `build` joins with the others: a key another part writes raises
KeyCollision (but for `unperturbed` and `dropped`, whose entries are joined), and every
key is declared in docs/manifest.schema.json and named in docs/manifest.md (how:
docs/architecture.md).
Blocks may run in other processes (--scheduler dask), so ArrayJob.read (and read_parts)
must be picklable and open its file inside each call (never hold an open handle).
`write` may keep the block and write it later (the .npy writer does, on a thread of
its own): a block must not be changed once handed over.

A resumable format (Zarr) also provides
  reopen_writer(reader, tmp_path, dtype, options) -> Writer
      reopens an output an interrupted run began, keeping its blocks (--resume).
"""

from __future__ import annotations

import importlib
import os

from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Callable, Generic, Iterator, Mapping, NamedTuple, Sequence, TypeVar

from tldp_cli.files import output
from tldp_cli.errors import InputError, UsageError, reason_of

if TYPE_CHECKING:  # NumPy and the readers' file helpers are imported where used: the CLI's
    import numpy as np  # --help and usage errors import this registry and nothing heavy


@dataclass
class ArrayJob:
    """One array to perturb: records along axis 0."""

    name: str  # unique within the input; keys the random streams
    shape: tuple[int, ...]
    dtype: np.dtype
    read: Callable[[int, int], np.ndarray]  # records [start, stop) as an in-memory array
    source: dict[str, Any]  # the manifest's inputs entry: path, format, dataset?, shape, dtype
    chunk_records: int | None = None  # records per storage chunk along axis 0, if chunked
    # The name of axis 0 where the format names dimensions (netCDF dimension scales, xarray's
    # Zarr dimension names): only arrays whose axis 0 has the same name share rows.
    row_dimension: str | None = None
    # CF missing-data markers (formats/cf.py): (attribute, value in the units perturbed), e.g.
    # ("_FillValue", 0.0); the pipeline compares them with the declared range (Reader.markers_are_data).
    markers: tuple[tuple[str, float], ...] = ()
    # Other names that stand for the array in --range NAME=LO:HI, as in --dataset (an OME-Zarr
    # image's group and lower levels stand for its full resolution).
    aliases: tuple[str, ...] = ()
    # read_parts(record, part): the record's values, flat, in parts of `part` elements (the last
    # shorter), in order, each a 1-D array in the array's dtype; the pipeline perturbs a record
    # larger than a block part by part (a model's tensor, in flat memory) where the format's
    # writer writes parts (Writer.part_writer). None: records are read whole.
    read_parts: Callable[[int, int], Iterator[Any]] | None = None

    @property
    def records(self) -> int:
        return self.shape[0]

    @property
    def record_shape(self) -> tuple[int, ...]:
        return tuple(self.shape[1:])

    @property
    def elements(self) -> int:
        import numpy as np

        return int(np.prod(self.record_shape, dtype=np.int64)) if self.record_shape else 1


class Reader:
    """What every format's reader offers the pipeline, with the defaults of a reader that
    has nothing to add (class-level defaults are immutable: a reader that adds to them
    assigns its own)."""

    format: str
    path: Path
    records_are_tensors = False  # model files: each tensor is one record of its own
    # Its writer writes each array back in its own dtype, whatever the engine's (model files:
    # each tensor's; tables: each column's), so a run may compute in float64 unasked
    # (calibration._grid_dtype)
    keeps_dtypes = False
    messages: Sequence[str] = ()  # lines the CLI shows (e.g. which datasets it chose)
    manifest_extra: Mapping[str, Any] = MappingProxyType({})  # fields it adds to the manifest
    # What one subject's record is, in words, for the warnings (a NIfTI file: the whole scan);
    # None: the pipeline says it from the arrays
    record_description: str | None = None

    def arrays(self) -> list[ArrayJob]:
        raise NotImplementedError

    def rows(self, jobs: list[ArrayJob]) -> list[list[str]] | None:
        """The arrays among `jobs` whose row i is one subject's record, where the format says
        so (a NIfTI series: all its frames are one person's); None: the pipeline's rule (HDF5
        and Zarr arrays that share their first axis)."""
        return None

    def manifest_inputs(self) -> list[dict[str, Any]]:
        """The manifest's `inputs` entries: the arrays' sources."""
        return [job.source for job in self.arrays()]

    def manifest_name(self, name: str) -> str:
        """How the manifest names array `name` where it keys figures by array (value_ranges):
        its own name, or the output's where the input's names are withheld (image folders'
        --anonymize-names)."""
        return name

    def output_dtype(self, dtype: np.dtype) -> str | None:
        """What its writer writes when the engine's values are of `dtype` (Writer.output_dtype),
        where the reader knows it before anything is written (images: their PNG bit depth),
        for `tldp plan`; None where it does not."""
        return None

    def markers_are_data(self, data: dict[str, tuple[tuple[str, float], ...]]) -> None:
        """Told before any block is read: by array name, the markers of ArrayJob.markers that
        are data (inside the declared range): their values are read and perturbed like any
        other, and the writer leaves them off the output. A reader that declares no markers
        is never told."""
        if data:
            raise NotImplementedError

    def missing_fill(self, fills: dict[str, float]) -> None:
        """Told before any block is perturbed: by array name (arrays with ArrayJob.markers), the
        public value the records read hold where values are missing, in place of any value
        of the data (a record-level mechanism projects the whole record: a value of another
        record there would make this record's release depend on it). Until told, the reader
        returns the markers as stored, decoded. A reader that declares no markers is never told."""
        if fills:
            raise NotImplementedError

    def close(self) -> None:
        """Releases what it holds open."""


class Writer:
    """What every format's writer offers the pipeline. The defaults are those of a writer
    that needs none of it; a format overrides what it does (its capabilities)."""

    # Class-level defaults are immutable: a writer that adds to them assigns its own.
    messages: Sequence[str] = ()  # lines the CLI shows after the reader's (e.g. filters left off)
    postprocessing: Sequence[str] = ()  # steps after the noise (e.g. clip and round), for the manifest
    manifest_extra: Mapping[str, Any] = MappingProxyType({})  # fields it adds (e.g. dropped_filters)
    output_dtype: str | None = None  # what it writes, when not the engine's dtype (e.g. 8-bit PNG)

    def write(self, job: ArrayJob, start: int, block: np.ndarray) -> None:
        raise NotImplementedError

    def block_writer(self) -> Callable[[ArrayJob, int, np.ndarray], object] | None:
        """A picklable function that writes a block from any process (Dask workers; what
        it returns is not used), or None: blocks come back and `write` stores them."""
        return None

    def part_writer(self) -> Callable[[ArrayJob, int, int, np.ndarray], object] | None:
        """A function that writes part of a record, (job, record, first element, its noisy values
        flat), for the records the reader reads in parts (ArrayJob.read_parts): called from any
        thread, in order within a record; picklable where block_writer is given (Dask
        workers call it then). None: records are written whole."""
        return None

    def block_written(self, job: ArrayJob, start: int, stop: int) -> None:
        """Told once a block is written or handed to `write` (e.g. to hash it meanwhile). A
        resumable writer returns once the block is in its files: --resume journals it next."""

    def block_note(self, job: ArrayJob, start: int) -> dict[str, Any]:
        """What a resumed run must know of a written block besides its place (--resume
        journals it with the block), e.g. counts the manifest adds up."""
        return {}

    def resumed(self, notes: dict[tuple[str, int], dict[str, Any]]) -> None:
        """Given, when resuming, the notes of the blocks the interrupted run wrote, by
        (array name, start)."""

    def finish(self) -> None:
        """Called once every block is written, before close."""

    def digests(self) -> dict[Path, str]:
        """sha256 of the files it hashed as it wrote them; the others are read again."""
        return {}

    def close(self) -> list[Path]:
        """Finish writing; return the files written (under the temporary path)."""
        raise NotImplementedError


# The formats whose readers take --dataset (Format.selects_arrays), named where another's
# reader refuses it; tests/formats/test_format_interface.py checks it names each of them.
DATASET_FORMATS = ("HDF5 files, Zarr stores, model files (.npz, .safetensors, sharded model folders) and "
                   "tables (Parquet, Arrow, Hugging Face dataset folders)")


# The end of an image folder's error on an image it cannot decode, for the commands that take
# --skip-bad (perturb, plan, weight-mask); evaluate and sweep, which do not, say another.
SKIP_BAD_HINT = "; pass --skip-bad to skip it"


@dataclass
class FormatOptions:
    datasets: list[str] = field(default_factory=list)  # DATASET_FORMATS: which arrays (tensors, columns) to perturb
    exclude: list[str] = field(default_factory=list)  # model files and HDF5: globs of arrays left out
    keep: list[str] = field(default_factory=list)  # names (globs) of what is copied raw, not dropped (leftovers.py)
    image_format: str = "png"  # image folders: png (clipped, rounded) or tiff (float32)
    copy_other: bool = False  # image folders: copy non-image files instead of skipping them
    skip_bad: bool = False  # image folders: skip unreadable images (listed in the manifest)
    anonymize_names: bool = False  # image folders, WebDataset: neutral output names, none of the input's
    # --dtype as given (None: not given): image folders and WebDataset shards note where it does not apply
    dtype: str | None = None
    # --mechanism privunit: OME-Zarr integer label images keep their dtype (zarr_ome.label_dtypes)
    integer_labels: bool = False
    # Set by the pipeline for the writer: each array's declared range and the noise's grid
    # step (None: no grid), for writers that move a noisy value off a missing-data marker.
    value_bounds: dict[str, tuple[float, float, float | None]] = field(default_factory=dict)


def least_output_bytes(jobs: list[ArrayJob], dtype: np.dtype, options: FormatOptions) -> int:
    """The least an output needs on disk: the perturbed values in the engine's dtype (noise
    does not compress)."""
    import numpy as np

    return sum(job.records * job.elements for job in jobs) * np.dtype(dtype).itemsize


def never_a_pattern(path: Path) -> bool:
    """No input is a pattern of files for the format."""
    return False


def no_pattern_files(path: Path) -> list[Path]:
    """No input is a pattern of files for the format: it names no files but itself."""
    return []


def never_earlier_output(path: Path, reader: Reader) -> bool:
    """No existing folder is taken for an earlier output of the format (it is no folder)."""
    return False


# The reader a format's functions take: its own reader class (create_writer(reader: NpyReader,
# ...)). A Format is generic in it so that open_reader, create_writer, reopen_writer and
# earlier_output are checked to agree; the registry holds Format[Any].
R = TypeVar("R", bound=Reader)


class DocRow(NamedTuple):
    """A row of the formats table in docs/formats.md (make_format_table.py writes it)."""

    input: str  # what the input is, in words
    detected_by: str  # how can_open recognises it
    example: str  # a command
    output: str  # what the output is and keeps


@dataclass(frozen=True)
class Format(Generic[R]):
    """A format plug-in: what it is, what it can do, and its functions. The defaults are
    those of a format that can do none of it."""

    name: str  # --format NAME, and the manifest's inputs[].format
    title: str  # how messages name an input of it: "HDF5 file"
    can_open: Callable[[Path], bool]  # detection: sniffs the content, not the suffix
    default_output: Callable[[Path], Path]  # the sibling the output goes to without --out
    open_reader: Callable[[Path, FormatOptions], R]
    create_writer: Callable[[R, Path, np.dtype, FormatOptions], Writer]
    docs: tuple[DocRow, ...]  # its rows of the formats table, the first one the format itself
    suffixes: tuple[str, ...] = ()  # names that say this format: --out x.h5 on a .npy input is refused
    # Where its readers know it by the name's suffix alone (nibabel.load): --out must end
    # with one of these.
    required_suffixes: tuple[str, ...] = ()
    # Two-part suffixes that the tools reading them match whole (Keras loads only
    # *.weights.h5): the default output's ".tldp" goes before them (tldp_name).
    compound_suffixes: tuple[str, ...] = ()
    folder: bool = False  # an input and its output are folders, not files
    # A folder format whose input may also be one file (a WebDataset shard): its output is
    # still a folder.
    file_input: bool = False
    # Whether a path that names no file is a pattern of the format's files (a brace pattern
    # of WebDataset shards), which its reader expands.
    pattern_input: Callable[[Path], bool] = never_a_pattern
    # The files a pattern input names ([] for a path that is not a pattern), so that one call
    # releases no file twice (run/batch.py).
    pattern_files: Callable[[Path], list[Path]] = no_pattern_files
    # Resumable (--resume): reopens the output an interrupted run began, keeping its blocks.
    reopen_writer: Callable[[R, Path, np.dtype, FormatOptions], Writer] | None = None
    selects_arrays: bool = False  # its reader perturbs the arrays --dataset names
    honours_exclude: bool = False  # its reader leaves out the arrays --exclude names
    honours_keep: bool = False  # its reader copies raw what --keep names instead of dropping it
    cf_markers: bool = False  # its reader declares CF missing-data markers (--public-missing)
    # Arrays of one input that share their first axis hold one subject's record in row i
    # (pipeline.row_groups), and a labels array beside them may give their classes.
    shares_rows: bool = False
    # Each record is a file of its own (an image in a folder): a weight mask is a folder of
    # PNGs, evaluate pairs the outputs file by file, labels can come from subfolders.
    records_are_files: bool = False
    record_noun: str | None = None  # one record in words when it is a file: "an image"
    # Its writer writes whole rows, all its arrays' row i together (a table's columns): the
    # pipeline hands blocks over in the order of their first record, arrays interleaved, so
    # that the writer holds a few blocks, not whole arrays.
    writes_rows: bool = False
    single_array: bool = False  # the file is one array: messages do not name it
    member_noun: str = "dataset"  # an array inside it in messages: "dataset /x", "tensor w"
    # --anonymize-names: where the name map goes (checked), and how it is written.
    name_map_destination: Callable[[Path | None, Path, Path, Path, bool], Path] | None = None
    write_name_map: Callable[[dict, Path, Path], None] | None = None
    # The least its output needs on disk: (arrays, the engine's dtype, options) -> bytes.
    output_bytes: Callable[[list[ArrayJob], np.dtype, FormatOptions], int] = least_output_bytes
    # Whether an existing folder (whose manifest, where this run's goes, names it) is an
    # earlier output of this format, which --overwrite may replace: (folder, reader) -> bool.
    earlier_output: Callable[[Path, R], bool] = never_earlier_output
    # --store coefficients (--mechanism privunit): a writer of each array's released
    # coefficients, one row of k values per record, in place of the records: (reader, the
    # arrays as written, of shape (records, k), tmp_path, dtype, options) -> Writer. None:
    # the format holds records only, and the option is refused.
    create_coefficient_writer: Callable[[R, list[ArrayJob], Path, np.dtype, FormatOptions], Writer] | None = None

    @property
    def resumable(self) -> bool:
        return self.reopen_writer is not None

    @property
    def name_map(self) -> bool:
        """Whether it renames its records on --anonymize-names and writes a name map."""
        return self.write_name_map is not None


# The registry: every format's name -> its module, in the order detect() tries them. Each
# module is imported when its turn comes (h5py and zarr take a quarter of a second to
# import, which a .npy run need not pay); the names alone (the CLI's --format choices)
# import none. A new format adds its module here, and to the independence contract in
# pyproject.toml.
FORMAT_MODULES = {
    "npy": "npy",
    "hdf5": "hdf5",
    "zarr": "zarr_store",
    "npz": "npz",
    "safetensors": "safetensors_file",
    "sharded-safetensors": "sharded_safetensors",
    "nifti": "nifti",
    "parquet": "parquet_file",
    "arrow": "arrow_file",
    "hf-dataset": "dataset_folder",
    "webdataset": "webdataset",
    "images": "images",
}


def names() -> list[str]:
    """Every format's name, in detection order, without importing any."""
    return list(FORMAT_MODULES)


def get(name: str) -> Format:
    """The format named `name` (KeyError for none)."""
    module = importlib.import_module(f"tldp_cli.formats.{FORMAT_MODULES[name]}")
    return module.FORMAT


def of_source(source: Mapping[str, Any]) -> Format | None:
    """The format an ArrayJob's source names; None for an array in memory (arrays.py)."""
    name = source.get("format")
    return get(name) if name in FORMAT_MODULES else None


def registered():
    """Every format, in the order detect() tries them."""
    for name in FORMAT_MODULES:
        yield get(name)


def named_by(suffix: str, skip: Format | None = None) -> Format | None:
    """The format whose names end in `suffix` (".h5"; lower case), other than `skip`."""
    if not suffix or (skip is not None and suffix in skip.suffixes):
        return None
    return next((f for f in registered() if f is not skip and suffix in f.suffixes), None)


def detect(path: Path, format_name: str | None = None) -> Format:
    """The format that can open `path`; `format_name` (--format) skips the sniffing for
    inputs it cannot settle, and the chosen reader says what it finds wrong. A path that
    names no file may be a pattern of files (Format.pattern_input)."""
    if format_name is not None and format_name not in FORMAT_MODULES:
        raise UsageError(f"--format must be one of {', '.join(names())}, not {format_name}")
    # Patterns of files are brace patterns; a missing path without braces imports no format
    # library to find out that it is missing (tests/cli/test_startup.py).
    if not os.path.lexists(path) and ("{" in str(path) or "}" in str(path)):
        chosen = next((f for f in registered() if format_name in (None, f.name) and f.pattern_input(path)), None)
        if chosen is not None:
            return chosen
    output.check_input(path)
    if format_name is not None:
        chosen = get(format_name)
        if path.is_dir() != chosen.folder and not (chosen.file_input and path.is_file()):
            kind = "a folder" if path.is_dir() else "a file"
            raise UsageError(f"{path}: is {kind}, which --format {format_name} does not read")
        return chosen
    for fmt in registered():
        if fmt.can_open(path):
            return fmt
    if path.is_file() and is_dicom(path):
        raise dicom_refused(path)
    head = _head(path, 4) if path.is_file() else b""
    if is_pickle(head):
        raise InputError(f"{path}: a Python pickle (e.g. a PyTorch checkpoint from torch.save), which "
                         "can run code when loaded and which tldp does not load; save the tensors with "
                         "safetensors (safetensors.torch.save_file(model.state_dict(), ...)) and perturb that")
    if _is_classic_netcdf(head):
        raise InputError(f"{path}: a classic netCDF file (netCDF-3), which tldp does not read (it reads netCDF-4, "
                         "an HDF5 file); convert it, e.g. nccopy -k nc4 IN.nc OUT.nc, or with xarray "
                         "xr.open_dataset(IN).to_netcdf(OUT, format='NETCDF4'), and perturb that")
    raise InputError(f"{path}: not a dataset tldp can read (supported: {', '.join(names())})")


DICOM_REASON = ("its headers hold patient names and IDs, which tldp does not read; convert it to NIfTI "
                "without identifiers first (e.g. dcm2niix -ba y) and perturb the .nii.gz")


def is_dicom(path: Path) -> bool:
    """A DICOM file: the magic DICM after the 128-byte preamble, or the .dcm suffix. False
    for what is not a regular file (never opened: a FIFO would block)."""
    from tldp_cli.files.checked_io import open_regular

    if path.name.lower().endswith(".dcm"):
        return True
    try:
        if not path.is_file():
            return False
        with open_regular(path) as f:
            return f.read(132)[128:] == b"DICM"
    except (OSError, InputError):
        return False


def dicom_refused(path: Path, files: int | None = None) -> InputError:
    """The error for DICOM input: a file, or a folder holding `files` DICOM files."""
    what = "a DICOM file" if files is None else f"a folder of {plural(files, 'DICOM file')}"
    reason = DICOM_REASON if files is None else DICOM_REASON.replace("convert it", "convert them")
    return InputError(f"{path}: {what}: {reason}")


def data_file(path: Path) -> str | None:
    """Why a file must never be copied raw beside perturbed data (image folders'
    --copy-other): it holds data tldp reads (a registered format), a Python pickle, or a
    medical image (DICOM, NIfTI), whose headers can also name the patient. None for any
    other file, and for what is not a regular file (never opened: a FIFO would block)."""
    from tldp_cli.files.checked_io import open_regular

    name = path.name.lower()
    try:
        if not path.is_file():
            return None
        with open_regular(path) as f:
            head = raw = f.read(352)
        if head[:2] == b"\x1f\x8b":  # gzip, whatever the name (brain.gz): judge what it holds
            head = _gunzipped_head(path, 352)
        if name.endswith(".dcm") or head[128:132] == b"DICM":  # is_dicom, on the head read here
            return "DICOM: a medical image whose headers can name the patient"
        if name.endswith((".nii", ".nii.gz")) or head[344:348] in (b"n+1\0", b"ni1\0") \
                or head[4:8] in (b"n+2\0", b"ni2\0"):
            return f"NIfTI: a medical image volume, which tldp perturbs on its own (tldp perturb {path.name})"
        if is_pickle(raw):
            return "a Python pickle (e.g. a PyTorch checkpoint), data tldp does not load"
        if is_torch_zip(raw):  # before the formats: npz detects it too, only to refuse it
            return "a PyTorch checkpoint (torch.save: a pickle in a zip), data tldp does not load"
        for fmt in registered():
            if (not fmt.folder or fmt.file_input) and fmt.can_open(path):
                return f"{fmt.name} data, which tldp perturbs on its own (tldp perturb {path.name})"
    except (OSError, InputError):
        return None  # unreadable, or no longer a regular file: copying it fails with the reason
    return None


def _gunzipped_head(path: Path, size: int) -> bytes:
    """The first `size` bytes a gzip file holds (at most that much is decompressed), or
    b"" when it is not valid gzip."""
    import gzip
    import zlib

    from tldp_cli.files.checked_io import open_regular
    try:
        with open_regular(path) as f, gzip.GzipFile(fileobj=f) as unzipped:
            return unzipped.read(size)
    except (OSError, EOFError, zlib.error):
        return b""


def _head(path: Path, size: int) -> bytes:
    """The first `size` bytes of a file (fewer if it is shorter), or b"" if it cannot be read."""
    try:
        with open(path, "rb") as f:
            return f.read(size)
    except OSError:
        return b""


def is_pickle(head: bytes) -> bool:
    """Pickle protocol 2 or later: the PROTO opcode, then the protocol number."""
    return len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5


def zip_first_member(head: bytes) -> bytes | None:
    """The name of a zip archive's first member, from `head`, the file's first bytes (the first
    local header, 30 bytes, then the name, cut where `head` ends); None if it is no zip's."""
    if len(head) < 30 or head[:4] != b"PK\x03\x04":
        return None
    return head[30:30 + int.from_bytes(head[26:28], "little")]


def is_torch_zip(head: bytes) -> bool:
    """torch.save's zip format (the default since PyTorch 1.6: optimizer.pt, training_args.bin):
    its first member, in the first local header, is ARCHIVE/data.pkl."""
    first = zip_first_member(head)
    return first is not None and first.endswith(b"/data.pkl")


def _is_classic_netcdf(head: bytes) -> bool:
    """netCDF-3: CDF then 1 (classic), 2 (64-bit offsets) or 5 (64-bit data)."""
    return head[:4] in (b"CDF\x01", b"CDF\x02", b"CDF\x05")


LISTED = 5  # names shown in a message before "... and N more"
# macOS's Archive Utility zips a folder with a __MACOSX folder of AppleDouble files (._a.png:
# the resource fork and Finder's metadata of a.png), which unzipping elsewhere leaves in place.
MACOS_ARCHIVE_FOLDER = "__MACOSX"
HIDDEN_REASON = ("hidden (.git, .DS_Store, .ipynb_checkpoints, .picasa.ini, a macOS archive's __MACOSX): "
                 "not the folder's data, never read nor copied")


def is_hidden(name: str) -> bool:
    """Whether a folder format leaves the file or folder `name` (one path component) out
    unread: a hidden one (".git", ".DS_Store", ".ipynb_checkpoints", ".picasa.ini", which
    holds Picasa's face tags: people's names) or a macOS archive's __MACOSX folder."""
    return name.startswith(".") or name == MACOS_ARCHIVE_FOLDER


def folder_files(root: Path, hidden: list[str] | None = None) -> tuple[list[str], list[str]]:
    """The regular files and the symbolic links below `root`, as sorted relative POSIX
    paths, for the formats that are folders. Links are listed, never followed (os.walk
    lists a linked folder among the folders without entering it). A folder that cannot be
    listed (os.walk would skip it, and its files, in silence) or an entry that is neither a
    regular file nor a folder (a FIFO, which would never end a read, a socket, a device)
    is an InputError naming it. Two files that are one (hard links: the same st_dev and
    st_ino) are a UsageError naming both: each would be a record released on its own, one
    subject's data twice, with noise of its own each time. With `hidden` (a list), hidden
    files and folders (is_hidden) are neither listed nor entered but appended to it,
    sorted, a folder with a trailing "/"."""
    import stat

    def unreadable(exc: OSError):
        raise InputError(f"{root}: cannot list {exc.filename} ({reason_of(exc)})")

    files, links, found_hidden = [], [], []
    linked: dict[tuple[int, int], Path] = {}  # the files with more than one name, by (st_dev, st_ino)
    for directory, dirs, names in os.walk(root, onerror=unreadable):
        if hidden is not None:
            found_hidden += [(Path(directory) / name).relative_to(root).as_posix() + ("/" if name in dirs else "")
                             for name in names + dirs if is_hidden(name)]
            names, dirs[:] = [n for n in names if not is_hidden(n)], [d for d in dirs if not is_hidden(d)]
        for name in names + dirs:
            path = Path(directory) / name
            rel = path.relative_to(root).as_posix()
            try:
                info = path.lstat()
            except OSError as exc:
                raise InputError(f"{root}: cannot list {rel} ({reason_of(exc)})") from None
            mode = info.st_mode
            if stat.S_ISLNK(mode):
                links.append(rel)
            elif stat.S_ISREG(mode):
                first = linked.setdefault((info.st_dev, info.st_ino), path) if info.st_nlink > 1 else path
                if first != path:
                    raise UsageError(f"{root}: {first} and {path} are the same file (hard links to it), which "
                                     "would be released twice, as two records; give one of them")
                files.append(rel)
            elif not stat.S_ISDIR(mode):
                raise InputError(f"{root}: {rel} is neither a regular file nor a directory (a pipe, socket or "
                                 "device); tldp reads only regular files: remove it or move it out of the folder")
    if hidden is not None:
        hidden += sorted(found_hidden)
    return sorted(files), sorted(links)


def listing(names: list[str]) -> str:
    shown = ", ".join(names[:LISTED])
    return shown if len(names) <= LISTED else f"{shown}, ... and {len(names) - LISTED} more"


def decode_reason(exc: Exception) -> str:
    """Why Pillow could not decode an image (an image folder's, a mask's), in words: its
    "cannot identify image file" names the open file object (<_io.BufferedReader name=3>),
    not the file."""
    from PIL import UnidentifiedImageError

    if isinstance(exc, UnidentifiedImageError):
        return "not an image format Pillow recognises"
    return reason_of(exc)


def plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def tldp_name(path: Path, suffix: str, compound: Sequence[str] = ()) -> Path:
    """The default output's name: ".tldp" before the format's suffix, or before one of its
    compound suffixes (Format.compound_suffixes: model.weights.h5 -> model.tldp.weights.h5,
    image.ome.zarr -> image.tldp.ome.zarr; data.h5 -> data.tldp.h5); a name without
    either gets ".tldp" at the end."""
    name = path.name
    for known in (*compound, suffix):
        if known and name.lower().endswith(known.lower()) and len(name) > len(known):
            return path.with_name(f"{name[:-len(known)]}.tldp{name[-len(known):]}")
    return path.with_name(name + ".tldp")


def folder_output(path: Path) -> Path:
    """The default output of a folder format: a folder beside the input, NAME.tldp (the
    current folder, `.` or `..`, by its own name)."""
    if path.name in ("", ".", ".."):
        path = path.resolve()
    return path.with_name(path.name + ".tldp")


def member_name(source: dict[str, Any]) -> str | None:
    """How a message names the array inside a file (an ArrayJob's source): "tensor w" in a
    model file, "dataset x" in HDF5/Zarr; None for a whole-file array or an image."""
    if "dataset" not in source:
        return None
    fmt = of_source(source)
    return f"{fmt.member_noun if fmt else 'dataset'} {source['dataset']}"


def dropped_filters(dropped: dict[str, list[str]]) -> tuple[list[str], dict[str, Any]]:
    """What the manifest says about the lossy filters (HDF5) or codecs (Zarr) left off the
    perturbed arrays, {array: [names]}: a postprocessing step and `dropped_filters`."""
    if not dropped:
        return [], {}
    return (["store the noisy values exactly: the input's lossy filters are not applied to the "
             "perturbed arrays (dropped_filters)"], {"dropped_filters": dropped})


def whole_chunks(start: int, records: int, chunk_records: int, total: int) -> bool:
    """Whether records start:start+records of an array of `total` records are whole chunks
    of `chunk_records` along axis 0 (the last may end with the array)."""
    stop = start + records
    return start % chunk_records == 0 and (stop % chunk_records == 0 or stop == total)


def padded_chunk(part: np.ndarray, chunk_shape: tuple[int, ...], fill_value: Any,
                 dtype: np.dtype) -> np.ndarray:
    """A chunk cut by the array's edge, padded to its full shape with the fill value (as
    HDF5 and zarr-python store it); a whole chunk as it is."""
    if part.shape == tuple(chunk_shape):
        return part
    import numpy as np

    padded = np.full(chunk_shape, fill_value, dtype=dtype)
    padded[tuple(slice(0, n) for n in part.shape)] = part
    return padded


def wrong_chunk_size(declared: int, size: int, codec: str) -> ValueError:
    """The error for a compressed chunk whose header states another size than its chunk's."""
    return ValueError(f"its {codec} header says it expands to {declared} bytes, where a chunk "
                      f"holds {size}")


def decompressed(new: Callable[[], Any], data: bytes, size: int, streams: bool = True) -> bytes:
    """`data` decompressed by `new()` (a zlib.decompressobj, bz2.BZ2Decompressor or
    lzma.LZMADecompressor), never to more than `size` + 1 bytes: a chunk of a few kilobytes
    can expand to gigabytes, which the one-call decompress functions would allocate before
    anyone compares it with the chunk's size. `streams`: streams that follow the first are
    decompressed too (gzip members, bz2 and xz streams), else ignored (zlib). Raises
    ValueError for more than `size` bytes, or a stream cut short."""
    parts, total, rest = [], 0, data
    while True:
        stream = new()
        part = stream.decompress(rest, size + 1 - total)
        parts.append(part)
        total += len(part)
        if total > size:
            raise ValueError(f"it expands to more than the {size} bytes a chunk holds")
        if not stream.eof:
            raise ValueError("its compressed stream stops early")
        rest = stream.unused_data
        if not streams or not rest.strip(b"\0"):
            return b"".join(parts)


def check_numeric_dtype(path: Path, dtype: np.dtype, what: str = "array") -> None:
    if dtype.kind not in "iuf":
        kinds = {"O": "object (pickled)", "c": "complex", "b": "boolean", "U": "string",
                 "S": "bytes", "T": "string", "V": "structured", "M": "datetime", "m": "timedelta"}
        raise InputError(f"{path}: {what} has {kinds.get(dtype.kind, str(dtype))} dtype {dtype}; "
                         "tldp perturbs integer and floating-point data only")


def default_selection(path: Path, shapes: dict[str, tuple[int, ...]], noun: str) -> tuple[list[str], str]:
    """The arrays to perturb when --dataset is not given, and the message that says so.

    `shapes` holds the numeric arrays by name. Candidates have two or more dimensions
    and records; if they disagree on the number of records, the user must choose.
    """
    candidates = {name: shape for name, shape in shapes.items() if len(shape) >= 2 and 0 not in shape}
    if not candidates:
        raise InputError(f"{path}: no numeric {noun} with 2 or more dimensions to perturb; "
                         "name one with --dataset PATH")
    if len({shape[0] for shape in candidates.values()}) > 1:
        listing = ", ".join(f"{name} {shape}" for name, shape in candidates.items())
        raise UsageError(f"{path}: the numeric {noun}s differ in their number of records (first axis): "
                         f"{listing}; choose which to perturb with --dataset PATH")
    plural = "s" if len(candidates) > 1 else ""
    return list(candidates), f"perturbing {noun}{plural} {', '.join(candidates)} of {path.name} (choose with --dataset)"
