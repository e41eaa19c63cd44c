"""Options that several commands share, defined once: their choices, their help,
where a seed comes from, and the library's PerturbOptions that perturb's and plan's make."""

import sys
import os
import stat
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer

from tldp_cli import formats
from tldp_cli.cli.app import SEED_ENV
from tldp_cli.errors import UsageError
from tldp_cli.files import local

if TYPE_CHECKING:
    from tldp_cli.run.pipeline import PerturbOptions


class Noise(str, Enum):
    laplace = "laplace"
    gaussian = "gaussian"
    discrete_laplace = "discrete-laplace"
    discrete_gaussian = "discrete-gaussian"


class Sampler(str, Enum):
    exact = "exact"
    float = "float"


class Mechanism(str, Enum):
    tldp = "tldp"
    baseline = "baseline"
    mvg = "mvg"
    idn = "idn"
    privunit = "privunit"


class Store(str, Enum):
    records = "records"
    coefficients = "coefficients"


class Budget(str, Enum):
    element = "element"
    record = "record"


class RngKind(str, Enum):
    secure = "secure"
    fast = "fast"


class ImageFormat(str, Enum):
    png = "png"
    tiff = "tiff"


# --format's choices: the registered formats, in detection order (no format module is imported).
# (mypy reads no members from a mapping built at runtime: it knows the class, not its members)
InputFormat = Enum("InputFormat", {name: name for name in formats.names()}, type=str)  # type: ignore[misc]


class Scheduler(str, Enum):
    threads = "threads"
    dask = "dask"


class Model(str, Enum):
    logistic = "logistic"
    mlp = "mlp"


class OutDtype(str, Enum):
    float32 = "float32"
    float64 = "float64"


# What a path option takes: a local path (files.local); `-` and URLs are refused while the
# command line is parsed, before anything is imported or read.
def _local(text: str, stream: str) -> str:
    problem = local.problem(text, stream)
    if problem:
        raise typer.BadParameter(problem)
    return text


def data_path(text: str) -> Path:
    """A data input (perturb's INPUT, a mask, a basis): a local file or folder."""
    if not text:
        raise typer.BadParameter("the path is empty")
    return Path(_local(text, local.STDIN))


def file_path(text: str) -> Path:
    """Another file read or written (a ledger, a seed file, a name map, boxes)."""
    if not text:
        raise typer.BadParameter("the path is empty")
    return Path(_local(text, local.STREAM))


def local_text(text: str) -> str:
    """A data input that may also be a name (--basis dct:K, --labels dataset=NAME): as given."""
    return _local(text, local.STDIN)


def list_path(text: str) -> Path:
    """--inputs-from: a file listing paths, or `-` for standard input."""
    if not text:
        raise typer.BadParameter("the path is empty")
    return Path(text) if text == "-" else Path(_local(text, local.STREAM))


def output_path(text: str) -> Path:
    """A file or folder written."""
    if not text:
        raise typer.BadParameter("the path is empty")
    return Path(output_text(text))


def output_text(text: str) -> str:
    """--out and --manifest as given: a trailing '/' means a folder (an empty one is refused later)."""
    return _local(text, local.STDOUT)


# --seed-file and --allow-weak-seed, the same for every command that takes a seed.
SeedFile = Annotated[Optional[Path], typer.Option(parser=file_path,
    metavar="PATH", help=f"Read the seed from PATH (whitespace around it stripped) instead of "
                         f"--seed or ${SEED_ENV}, which keeps it out of the command line; warns "
                         f"when other users may read or write PATH.", show_default=False)]
AllowWeakSeed = Annotated[bool, typer.Option(
    help="Accept a seed shorter than 32 hex digits (128 bits) or one that follows an obvious "
         "pattern (000..0, a repeated or counting sequence, a padded number), for tests and "
         "demos: it can be guessed. Recorded as weak_seed.")]
_SEED_FILE_LIMIT = 4096  # bytes; a seed is a few dozen, more is the wrong file


def resolve_seed(seed: Optional[str], seed_file: Optional[Path]) -> Optional[str]:
    """The seed from whichever of --seed, --seed-file and $TLDP_SEED is given (None: none;
    an empty TLDP_SEED counts as unset). Two at once is a usage error, not a precedence
    rule: a forgotten exported TLDP_SEED must not silently win or lose."""
    from_env = os.environ.get(SEED_ENV) or None
    given = [name for name, value in (("--seed", seed), ("--seed-file", seed_file), (f"${SEED_ENV}", from_env))
             if value is not None]
    if len(given) > 1:
        raise UsageError(f"a seed is given by both {given[0]} and {given[1]}; give it one way "
                         f"(--seed-file or ${SEED_ENV} keep it out of the command line)")
    if seed_file is None:
        return seed if seed is not None else from_env
    with open(seed_file, "rb") as f:  # an OSError names the file (see _run)
        mode = os.fstat(f.fileno()).st_mode
        content = f.read(_SEED_FILE_LIMIT + 1)
    try:
        text = content.decode("ascii")
    except UnicodeDecodeError:
        text = None
    if text is None or len(content) > _SEED_FILE_LIMIT or not text.strip():
        raise UsageError(f"{seed_file}: not a seed file (a seed is one line of hex digits, e.g. "
                         f"from `tldp seed`)")
    # Only warned about: the mode alone does not prove exposure (a private folder, a
    # container's secret mount), and a refusal would push the seed back into argv. Warned
    # about with -q too: it asks for a change (chmod) that no manifest records.
    if stat.S_ISREG(mode) and mode & 0o077:
        typer.echo(f"tldp: warning: other users may read or write the seed file {seed_file} "
                   f"(mode {stat.S_IMODE(mode):04o}); it holds a secret key: chmod 600 {seed_file}",
                   err=True)
    return text


def given(ctx: typer.Context, name: str) -> bool:
    """Whether the command's parameter `name` was given (command line or environment), not
    left at its default: --dtype is None in PerturbOptions unless asked for."""
    source = ctx.get_parameter_source(name)
    return source is not None and source.name not in ("DEFAULT", "DEFAULT_MAP")


def perturb_options(input: Path, value_range: Optional[list[str]], **values: Any) -> "PerturbOptions":
    """The PerturbOptions of a command's values as Typer parsed them, keyed by field name:
    the one place the command line becomes the library's options (perturb and plan; a
    manifest becomes them in run_manifest.options_of_manifest, the library's own keywords are
    PerturbOptions' fields). A choice (an Enum) gives its value, a repeatable option given
    none an empty list, and --range's texts (`value_range`) the default range and each
    array's own (pipeline.parse_ranges). The noise and the budget left None are the
    mechanism's (pipeline.checked_options)."""
    from tldp_cli.run.options import PerturbOptions, parse_ranges

    default_range, ranges = parse_ranges(value_range or [])
    fields = {name: value.value if isinstance(value, Enum) else value for name, value in values.items()}
    for name in ("datasets", "exclude", "keep"):
        if name in fields:
            fields[name] = fields[name] or []
    return PerturbOptions(input=input, value_range=default_range, ranges=ranges, **fields)


# The options several commands take, defined once.
EPS_HELP = "Privacy budget epsilon (see --budget)."
Eps = Annotated[float, typer.Option("--eps", help=EPS_HELP, show_default=False)]
OptionalEps = Annotated[Optional[float], typer.Option("--eps", help=EPS_HELP, show_default=False)]  # tldp plan
NoiseOption = Annotated[Optional[Noise], typer.Option(
    help="Noise distribution. Default: laplace; gaussian for mvg and idn, which take no "
         "other. With the default --sampler exact, laplace and gaussian are drawn as "
         "discrete-laplace and discrete-gaussian: exact integer noise, free of "
         "floating-point leaks; integer data stays integer, float data is snapped to a grid "
         "(--granularity).", show_default=False)]
SamplerOption = Annotated[Sampler, typer.Option(
    help="exact: noise whose figures hold for the bytes written (see --noise). float: "
         "continuous noise computed in floating point, whose low-order bits leak the input; "
         "its figures hold for the real-valued mechanism only (the manifest and summary "
         "say so). mvg and idn need float.")]
MechanismOption = Annotated[Mechanism, typer.Option(
    help="tldp: keep each value with probability p, else add noise (paper, Algorithm 1). "
         "baseline: noise on every element calibrated to the whole record. mvg: the "
         "Matrix-Variate Gaussian mechanism with identity covariances (records unfolded "
         "along their first axis); idn: Independent Directional Noise with W = identity; "
         "both (eps, delta) at --dp-delta for the whole record. privunit: each record "
         "projected on k coefficients of a public basis (--basis) and released as one "
         "PrivUnit unit vector, written back in the record's shape; pure --eps per record "
         "(it implies --budget record).")]
BudgetOption = Annotated[Optional[Budget], typer.Option(
    help="element: the paper's calibration, --eps is what each element gets (a record of I "
         "elements then gets I*eps; baseline, mvg, idn: the paper's calibration for the "
         "whole record). record: --eps is what each whole record gets (certified). "
         "Default: element; record for privunit, which takes no other.", show_default=False)]
BasisOption = Annotated[Optional[str], typer.Option(
    "--basis", parser=local_text, metavar="dct|dct:K|FILE.npy",
    help="--mechanism privunit: the public basis records are projected on. dct (default): a "
         "low-pass block of the DCT-II over the record's spatial axes (3-D for a volume, "
         "2-D for an image, docs/choosing-eps.md), k = min(I, 128) (I the "
         "record's size, whatever --eps); dct:K: K coefficients; FILE.npy: your own k x I "
         "matrix of orthonormal rows, which you declare public (its sha256 goes in the "
         "manifest; a basis learned from the data released is not public).",
    show_default=False)]
ReferenceOption = Annotated[Optional[str], typer.Option(
    "--reference", metavar="auto|zero|low|mid|VALUE",
    help="--mechanism privunit: the value records are measured from and written back around "
         "(x - r projected, r + c B^T (w V) written; public, the guarantee does not depend on it). "
         "zero: 0, or the range end nearest 0; low: the range's lower end; mid: its middle; "
         "VALUE: a number in the range. auto (default): mid for colour images (records of shape "
         "H x W x 3 or 4, or a stack of them D x H x W x 3 or 4: a photo written from 0 comes out dark), "
         "zero for every other record "
         "(digits on black, volumes, vectors). The manifest states it.",
    show_default=False)]
StoreOption = Annotated[Store, typer.Option(
    "--store",
    help="--mechanism privunit: what each record is written as. records (default): written back in "
         "the record's shape and the input's format. coefficients: its k released coefficients "
         "(V, the released unit vector, in --dtype), one row of k values per record, with what rebuilds "
         "the records in the manifest (privunit.stored); .npy, HDF5/netCDF and Zarr outputs. "
         "The guarantee is the same.")]
Ranges = Annotated[Optional[list[str]], typer.Option(
    "--range", metavar="[NAME=]LO:HI",
    help="Declared value range. Required for float data and integers wider than 16 bits; "
         "8- and 16-bit integer data defaults to its dtype's range (uint8 -> 0:256; 8- and 16-bit "
         "images in one folder: each its own). Never "
         "inferred from the data. NAME=LO:HI (repeatable) gives one dataset or tensor its "
         "own range (--range t2m=200:330 --range tp=0:0.5; an OME-Zarr image's group names its "
         "full resolution; a glob names every array it matches: --range '*.npy=0:1'); LO:HI is "
         "then the range of the others. With several inputs, a NAME "
         "applies to the inputs that hold it; a NAME no input holds is refused.", show_default=False)]
DpDelta = Annotated[float, typer.Option(
    help="delta at which (epsilon, delta) figures are reported.")]
Granularity = Annotated[Optional[float], typer.Option(
    metavar="G",
    help="Discrete noise on float data: snap values to multiples of G and add the noise in "
         "steps of G (the range gains one step of sensitivity). Default: the largest power "
         "of two at most (HI - LO) / (1024 max(1, eps)).", show_default=False)]
Datasets = Annotated[Optional[list[str]], typer.Option(
    "--dataset", metavar="PATH",
    help="HDF5/Zarr: a dataset or array to perturb (repeatable; HDF5: or a glob as --exclude's, "
         "its numeric non-coordinate datasets). Default: every numeric "
         "dataset of two or more dimensions whose first axis matches the others' (a 1-D one, "
         "such as labels, only when named). Model files (.npz, .safetensors, "
         "sharded model folders, Keras .weights.h5): a tensor by name, or a glob as --exclude's "
         "(e.g. 'encoder.*': the floating-point tensors it matches); default: every floating-point tensor but the "
         "normalisation statistics (running_mean, running_var, moving_mean, moving_variance). "
         "Unselected tensors are copied unchanged and listed; unselected datasets and arrays "
         "are left out (see --keep). Parquet, Arrow and Hugging Face dataset folders: a column; "
         "default: every image and tensor (list) column.")]
Exclude = Annotated[Optional[list[str]], typer.Option(
    "--exclude", metavar="PATTERN",
    help="Model files and HDF5: leave out the tensors or datasets whose name matches this "
         "glob (repeatable, e.g. '*.bias'); they are copied unchanged and listed.",
    show_default=False)]
Keep = Annotated[Optional[list[str]], typer.Option(
    "--keep", metavar="NAME",
    help="HDF5, Zarr, model files, NIfTI, image folders, WebDataset, tables (Parquet, Arrow, Hugging Face "
         "dataset folders): copy this raw instead of leaving it out "
         "(repeatable; a glob matches several): a dataset or array that is not perturbed, an attribute as "
         "PATH@ATTR (the file's own as @ATTR, e.g. a safetensors __metadata__ key or a NIfTI "
         "header field such as @descrip), a NIfTI header extension as @extension.N, a file in a "
         "Zarr store or a sharded model folder (README.md; a shard's __metadata__ key as SHARD@KEY), "
         "an HDF5 file's user block as userblock (a link into another file by its path: copied as "
         "a link), a palette image (label map) of an "
         "image folder by its path, a WebDataset shard's label members by their extension (cls, "
         "meta.json; with --anonymize-names also a field name it declares public, seg.png), a table's column (e.g. label), an image column's file names as COLUMN.path, "
         "images' alpha channels as alpha (a table's as COLUMN.alpha; left out by default: RGBA written as RGB, LA "
         "as L) and ICC colour profiles as icc_profile (COLUMN.icc_profile). "
         "By default everything not perturbed is left out (listed in the manifest's "
         "dropped) but structural metadata (CF units and conventions, dimensions, numeric "
         "coordinates). Kept items are listed as unperturbed: e.g. --keep /labels --keep "
         "'@history'. It never stops a dataset being perturbed (--exclude does). With several "
         "inputs, each keeps what it holds of what --keep names; a name no input holds is refused.",
    show_default=False)]
Clip = Annotated[Optional[float], typer.Option(
    "--clip", metavar="C",
    help="Clip every value to [-C, C] (L-infinity clipping, e.g. model parameters) before "
         "the noise and take (-C, C) as the range, so the range width is 2C. Not with "
         "--range. Recorded in the manifest.", show_default=False)]
DtypeOption = Annotated[OutDtype, typer.Option(
    help="Output dtype; continuous noise is drawn in it. Discrete noise: integer data "
         "comes out as the smallest signed integer type that cannot wrap; float data on "
         "the grid in this dtype (model files and tables, not given: float64 where float32 cannot "
         "hold the grid; each tensor or column keeps its dtype).")]
ImageFormatOption = Annotated[ImageFormat, typer.Option(
    help="Image folders: png (8/16-bit, rounded and clipped to the range) or tiff "
         "(float32, unclipped; Pillow, and the loaders built on it, cannot open such TIFF "
         "in colour: tldp warns).")]
InputFormatOption = Annotated[Optional[InputFormat], typer.Option(
    "--format", help="Read INPUT as this format instead of detecting it from its content (a "
                     "folder with Zarr metadata is Zarr, one with a *.safetensors.index.json (or model.safetensors "
                     "and config.json) a model folder, one with save_to_disk's state.json or with Parquet "
                     "files and no image a Hugging Face dataset folder, one with .tar files and no image "
                     "WebDataset shards, any other folder a folder of images).",
    show_default=False)]
AnonymizeNames = Annotated[bool, typer.Option(
    help="Image folders: name the output images 000000.png, 000001.png, ... in a random order "
         "in one flat folder, and keep every input file and folder name out of the manifest "
         "(skipped files are counted, not named); evaluate needs the name map. Not with "
         "--copy-other. WebDataset shards: rename each sample's key to its number in the samples' "
         "order across the shards (000000.png, 000000.cls with --keep cls, 000001.png, ...); an "
         "extension other than a file type alone (seg.png) may be part of a name and is refused "
         "unless --keep declares it (--keep seg.png). The name map (perturb --name-map) pairs the names.")]
CopyOther = Annotated[bool, typer.Option(
    help="Image folders: copy files that are not images (default: report and skip), listed "
         "as unperturbed; never data (DICOM, NIfTI, pickles, files tldp reads, images in formats it "
         "does not read such as GIF or HEIC, thumbnail caches: Thumbs.db), which are left out and "
         "listed as dropped; nor hidden files and folders (.DS_Store, .ipynb_checkpoints, __MACOSX), "
         "never read.")]
SkipBad = Annotated[bool, typer.Option(
    help="Image folders: skip unreadable images (listed in the manifest) instead of "
         "stopping; every image is then decoded up front to find them.")]
AllowRawRelease = Annotated[bool, typer.Option(
    help="Accept a TLDP run whose kept raw values cost more than --dp-delta (refused "
         "otherwise; the manifest records the consent under raw_release_allowed).")]
PublicMissing = Annotated[bool, typer.Option(
    help="netCDF/HDF5 and xarray's Zarr: declare which values are missing public. Values equal to "
         "a _FillValue or missing_value (or Zarr 2 fill_value) that lies inside the declared range "
         "then stay missing, copied, not perturbed, and the guarantee covers the other values only "
         "(recorded in the manifest as public_missing). Default: such a marker is an ordinary value, "
         "perturbed, and left off the output.")]
RngOption = Annotated[RngKind, typer.Option(
    help="secure: AES-CTR keyed from OS entropy (or the seed). fast: PCG64, predictable "
         "from its output.")]
Quiet = Annotated[bool, typer.Option("--quiet", "-q", help=(
    "Silence stderr's progress, notes, summaries and a run's warnings (its manifest keeps them). "
    "Errors, warnings that ask for a change nothing records (a seed file others can read, a "
    "deprecated command), and what goes to stdout (--json, the seed, the ledger's listing) still print."))]
Verbose = Annotated[bool, typer.Option(
    "--verbose", "-v", help="Say what each phase does as it starts (reading the headers, planning, "
                            "checking, perturbing, committing), one line each on stderr.")]
Debug = Annotated[bool, typer.Option(help="Show tracebacks.", hidden=True)]

# The task-utility options of evaluate and sweep: labels, clean test records, the classifier.
Labels = Annotated[Optional[str], typer.Option(
    parser=local_text, metavar="LABELS",
    help="Class labels of ORIGINAL's records, enabling the task-utility score: a 1-D .npy "
         "file, dataset=NAME (an array inside ORIGINAL, HDF5/Zarr) or subfolders (an image "
         "folder's top-level subfolder names).")]
TestRecords = Annotated[Optional[Path], typer.Option(parser=data_path, metavar="PATH",
    help="Clean test records (any format perturb reads) for the task-utility score.")]
TestLabels = Annotated[Optional[str], typer.Option(
    parser=local_text, metavar="LABELS", help="Labels of --test, in the forms --labels takes (dataset=NAME and "
                           "subfolders refer to --test).")]
ModelOption = Annotated[Model, typer.Option(
    help="Classifier: logistic regression or a small MLP (scikit-learn).")]


def input_paths(inputs: list[Path] | None, inputs_from: Path | None) -> list[Path]:
    """INPUT... then the paths --inputs-from lists (perturb and plan)."""
    paths = list(inputs or [])
    if inputs_from is not None:
        from tldp_cli.run import batch

        where = "--inputs-from -" if str(inputs_from) == "-" else str(inputs_from)
        # paths are bytes on POSIX: any that are not UTF-8 come through as they are (surrogateescape),
        # from standard input too, whose text layer is strict in a UTF-8 locale (en_US.UTF-8)
        data = sys.stdin.buffer.read() if str(inputs_from) == "-" else inputs_from.read_bytes()
        text = data.decode("utf-8", "surrogateescape")
        paths += batch.input_list(text, where)
    if not paths:
        raise UsageError("give INPUT, or --inputs-from FILE")
    return paths
