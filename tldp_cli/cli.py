"""The `tldp` command: parses options, calls the library, maps errors to exit codes.

Human-readable text goes to stderr; stdout carries only machine output (--json).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import stat
import sys
import traceback
import warnings
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer
from typer.core import TyperGroup

from tldp_cli import __version__, accounting, output
from tldp_cli.errors import TldpError, UsageError
from tldp_cli.mechanisms import default_noise
from tldp_cli.pipeline import BLOCK_ELEMENTS, PerturbOptions, parse_range, perturb

DEBUG_ENV = "TLDP_DEBUG"
SEED_ENV = "TLDP_SEED"


class _OneLineErrors(TyperGroup):
    """Every failure is one line on stderr: exit 2 for usage errors, 1 otherwise."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        prog_name = prog_name or "tldp"
        words = list(sys.argv[1:] if args is None else args)
        if not os.environ.get(f"_{prog_name.upper()}_COMPLETE") and self._bare(words):
            self._help(prog_name, words)  # a bare `tldp` or `tldp perturb`: the help, as is
        try:
            code = super().main(args=args, prog_name=prog_name, complete_var=complete_var,
                                standalone_mode=False, **extra)
        except typer.TyperException as exc:  # Typer's usage errors carry exit code 2
            ctx = getattr(exc, "ctx", None)
            hint = f" (see 'tldp {ctx.info_name} --help')" if ctx is not None and ctx.parent else ""
            _fail(f"{exc.format_message()}{hint}", exc.exit_code)
        except typer.Abort:
            _fail("interrupted; nothing was written", 130)
        sys.exit(code if isinstance(code, int) else 0)

    def _bare(self, words: list[str]) -> bool:
        """No words, or only a command that needs arguments (no_args_is_help)."""
        if not words:
            return True
        command = self.commands.get(words[0]) if len(words) == 1 else None
        return bool(command is not None and getattr(command, "no_args_is_help", False))

    def _help(self, prog_name: str, words: list[str]) -> None:
        with self.make_context(prog_name, [], resilient_parsing=True) as ctx:
            if words:
                command = self.commands[words[0]]
                with command.make_context(words[0], [], parent=ctx, resilient_parsing=True) as sub:
                    typer.echo(command.get_help(sub), err=True)
            else:
                typer.echo(self.get_help(ctx), err=True)
        sys.exit(2)


def _fail(message: str, code: int):
    message = " ".join(message.split())  # one line, even when an embedded message has several
    typer.echo(f"tldp: error: {message}", err=True)
    sys.exit(code)


app = typer.Typer(
    cls=_OneLineErrors, rich_markup_mode=None, add_completion=True, no_args_is_help=True,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool):
    if value:
        typer.echo(f"tldp {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                          help="Print the version and exit.")] = False,
):
    """Local differential privacy (TLDP) for tensor datasets on disk.

    \b
    Examples:
      tldp perturb sample_data/digits.npy --eps 1 --noise gaussian
      tldp perturb data.npy --eps 1 --range 0:1 --out noisy.npy --json
      tldp weight-mask photos/ --method box --boxes faces.csv --out masks --preview check.png
      tldp evaluate sample_data/digits.npy sample_data/digits.tldp.npy
      tldp audit --eps 1 --elements 4 --range 0:1
      tldp plan --elements 28x28 --range 0:256 --eps 8 --budget record
    """


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


class Budget(str, Enum):
    element = "element"
    record = "record"


class RngKind(str, Enum):
    secure = "secure"
    fast = "fast"


class ImageFormat(str, Enum):
    png = "png"
    tiff = "tiff"


class Scheduler(str, Enum):
    threads = "threads"
    dask = "dask"


class OutDtype(str, Enum):
    float32 = "float32"
    float64 = "float64"


def _run(debug: bool, action):
    """Run a library call; a TldpError becomes one line and exit 1 (2 for usage), and so
    does any other exception (a bug: the traceback with --debug). Warnings from the
    libraries underneath (NumPy, dp-accounting, zarr) are the tool's internals: shown with
    --debug only; what the user needs to know the library says in its own messages."""
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                return action()
            finally:
                if debug:
                    for warning in caught:
                        typer.echo(f"tldp: debug: {warning.category.__name__}: {warning.message} "
                                   f"({warning.filename}:{warning.lineno})", err=True)
    except UsageError as exc:
        if debug:
            traceback.print_exc()
        _fail(str(exc), 2)
    except TldpError as exc:
        if debug:
            traceback.print_exc()
        _fail(str(exc), 1)
    except KeyboardInterrupt as exc:  # an errors.Interrupted says what it kept
        _fail(str(exc) or "interrupted; nothing was written", 130)
    except OSError as exc:
        if debug:
            traceback.print_exc()
        where = exc.filename or "I/O"
        _fail(f"{where}: {exc.strerror or exc}", 1)
    except Exception as exc:  # a bug, not the user's doing: still one line without --debug
        if debug:
            traceback.print_exc()
        _fail(f"unexpected error ({type(exc).__name__}: {exc}); please report it, and rerun with "
              "--debug for the traceback", 1)


# --seed-file and --allow-weak-seed, the same for every command that takes a seed.
SeedFile = Annotated[Optional[Path], typer.Option(
    metavar="PATH", help=f"Read the seed from PATH (whitespace around it stripped) instead of "
                         f"--seed or ${SEED_ENV}, which keeps it out of the command line; warns "
                         f"when other users may read or write PATH.", show_default=False)]
AllowWeakSeed = Annotated[bool, typer.Option(
    help="Accept a seed shorter than 32 hex digits (128 bits), for tests and demos: it can be "
         "guessed. Recorded as weak_seed.")]
_SEED_FILE_LIMIT = 4096  # bytes; a seed is a few dozen, more is the wrong file


def _resolve_seed(seed: Optional[str], seed_file: Optional[Path], quiet: bool) -> Optional[str]:
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
    # container's secret mount), and a refusal would push the seed back into argv.
    if stat.S_ISREG(mode) and mode & 0o077 and not quiet:
        typer.echo(f"tldp: warning: other users may read or write the seed file {seed_file} "
                   f"(mode {stat.S_IMODE(mode):04o}); it holds a secret key: chmod 600 {seed_file}",
                   err=True)
    return text


def _emit_json(data: dict, to_stdout: bool, path: Path | None, overwrite: bool) -> None:
    """--json prints the report to stdout; --report PATH writes it (complete or not at all)."""
    text = json.dumps(data, indent=2, allow_nan=False)
    if path is not None:
        output.write_files({Path(path): (text + "\n").encode()}, overwrite)
    if to_stdout:
        typer.echo(text)


@contextlib.contextmanager
def _sigterm_interrupts():
    """SIGTERM stops a run as Ctrl-C does, so its temporary output is cleaned up (or, when
    resumable, kept for --resume) instead of the process just vanishing."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt

    try:
        previous = signal.signal(signal.SIGTERM, interrupt)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _progress_bar(quiet: bool, unit: str):
    """A tqdm callback on a terminal, None otherwise (pipes and CI logs stay clean)."""
    if quiet or not sys.stderr.isatty():
        return None, lambda: None
    from tqdm import tqdm

    bar = None

    def advance(done: int, total: int):
        nonlocal bar
        if bar is None:
            bar = tqdm(total=total, unit=unit, file=sys.stderr, dynamic_ncols=True, leave=False)
        bar.update(done)

    return advance, lambda: bar is not None and bar.close()


@app.command("perturb", no_args_is_help=True)
def perturb_command(
    input: Annotated[Path, typer.Argument(
        metavar="INPUT",
        help="A .npy file, an HDF5 file, a Zarr store, a folder of images, or a model-parameter "
             "file (.npz, .safetensors; each tensor is one record) (detected).",
                                          show_default=False)],
    eps: Annotated[float, typer.Option("--eps", help="Privacy budget epsilon (see --budget).",
                                       show_default=False)],
    noise: Annotated[Optional[Noise], typer.Option(
        help="Noise distribution. Default: laplace; gaussian for mvg and idn, which take no "
             "other. With the default --sampler exact, laplace and gaussian are drawn as "
             "discrete-laplace and discrete-gaussian: exact integer noise, free of "
             "floating-point leaks; integer data stays integer, float data is snapped to a grid "
             "(--granularity).", show_default=False)] = None,
    sampler: Annotated[Sampler, typer.Option(
        help="exact: noise whose figures hold for the bytes written (see --noise). float: "
             "continuous noise computed in floating point, whose low-order bits leak the input; "
             "its figures hold for the real-valued mechanism only (the manifest and summary "
             "say so). mvg and idn need float.")] = Sampler.exact,
    mechanism: Annotated[Mechanism, typer.Option(
        help="tldp: keep each value with probability p, else add noise (paper, Algorithm 1). "
             "baseline: noise on every element calibrated to the whole record. mvg: the "
             "Matrix-Variate Gaussian mechanism with identity covariances (records unfolded "
             "along their first axis); idn: Independent Directional Noise with W = identity; "
             "both (eps, delta) at --dp-delta for the whole record.")] = Mechanism.tldp,
    budget: Annotated[Budget, typer.Option(
        help="element: the paper's calibration, --eps is what each element gets (a record of I "
             "elements then gets I*eps; baseline, mvg, idn: the paper's calibration for the "
             "whole record). record: --eps is what each whole record gets (certified).")] = Budget.element,
    value_range: Annotated[Optional[str], typer.Option(
        "--range", metavar="LO:HI",
        help="Declared value range. Required for float data and integers wider than 16 bits; "
             "8- and 16-bit integer data defaults to its dtype's range (uint8 -> 0:256). Never "
             "inferred from the data.")] = None,
    weights: Annotated[Optional[Path], typer.Option(
        help="Weight mask .npy in [0, 1] (weighted TLDP; not with mvg or idn): the record's "
             "shape, its spatial shape, or one mask per record; for a folder of images, a folder "
             "of mask PNGs (see tldp weight-mask).")] = None,
    out: Annotated[Optional[str], typer.Option(
        metavar="PATH",
        help="The output, in the input's format. Default: a sibling, digits.npy -> "
             "digits.tldp.npy (an array inside a Zarr store: beside the store). A folder "
             "(an existing one for file outputs, or any PATH ending in '/') means: inside it, "
             "under the default name.", show_default=False)] = None,
    manifest: Annotated[Optional[Path], typer.Option(
        help="Manifest path. Default: OUTPUT.manifest.json.")] = None,
    seed: Annotated[Optional[str], typer.Option(
        metavar="HEX",
        help="Make the run reproducible with this seed: a secret key of at least 32 hex digits "
             "(tldp seed makes one). Anyone who has it can remove the noise. It is never "
             "written anywhere, but other users can read a command line: prefer --seed-file or "
             "$TLDP_SEED (give one of the three). The same seed on another input of the same shape "
             "gives the same noise: use a seed for one release only.", show_default=False)] = None,
    seed_file: SeedFile = None,
    allow_weak_seed: AllowWeakSeed = False,
    rng: Annotated[RngKind, typer.Option(
        help="secure: AES-CTR keyed from OS entropy (or the seed). fast: PCG64, predictable "
             "from its output.")] = RngKind.secure,
    dtype: Annotated[OutDtype, typer.Option(
        help="Output dtype; continuous noise is drawn in it. Discrete noise: integer data "
             "comes out as the smallest signed integer type that cannot wrap; float data on "
             "the grid in this dtype.")] = OutDtype.float32,
    granularity: Annotated[Optional[float], typer.Option(
        metavar="G",
        help="Discrete noise on float data: snap values to multiples of G and add the noise in "
             "steps of G (the range gains one step of sensitivity). Default: the largest power "
             "of two at most (HI - LO) / (1024 max(1, eps)).", show_default=False)] = None,
    dp_delta: Annotated[float, typer.Option(
        help="delta at which (epsilon, delta) figures are reported.")] = 1e-5,
    dataset: Annotated[Optional[list[str]], typer.Option(
        "--dataset", metavar="PATH",
        help="HDF5/Zarr: a dataset or array to perturb (repeatable). Default: every numeric "
             "dataset whose first axis matches the others'. Model files (.npz, .safetensors): a "
             "tensor by name; default: every floating-point tensor. Unselected ones are copied "
             "unchanged.")] = None,
    image_format: Annotated[ImageFormat, typer.Option(
        help="Image folders: png (8/16-bit, rounded and clipped to the range) or tiff "
             "(float32, unclipped).")] = ImageFormat.png,
    copy_other: Annotated[bool, typer.Option(
        help="Image folders: copy files that are not images (default: report and skip).")] = False,
    skip_bad: Annotated[bool, typer.Option(
        help="Image folders: skip unreadable images (listed in the manifest) instead of "
             "stopping.")] = False,
    anonymize_names: Annotated[bool, typer.Option(
        help="Image folders: name the output images 000000.png, 000001.png, ... in a random order "
             "in one flat folder, and keep every input file and folder name out of the manifest "
             "(skipped files are counted, not named). The name map (--name-map) pairs the names; "
             "evaluate needs it. Not with --copy-other.")] = False,
    name_map: Annotated[Optional[Path], typer.Option(
        metavar="PATH",
        help="With --anonymize-names: where to write the name map (original -> new names, skipped "
             "files). Keep it with the raw data; never inside the output. Default: "
             "INPUT.name-map.json beside the input folder.", show_default=False)] = None,
    clip_input: Annotated[bool, typer.Option(
        help="Clip input values outside --range into it (recorded in the manifest) "
             "instead of refusing.")] = False,
    clip: Annotated[Optional[float], typer.Option(
        "--clip", metavar="C",
        help="Clip every value to [-C, C] (L-infinity clipping, e.g. model parameters) before "
             "the noise and take (-C, C) as the range, so the range width is 2C. Not with "
             "--range. Recorded in the manifest.", show_default=False)] = None,
    workers: Annotated[Optional[int], typer.Option(
        min=1, envvar="TLDP_WORKERS", help="Blocks perturbed in parallel threads (with --scheduler dask and no "
                    "--dask-address: local worker processes). Default: the number of cores. "
                    "The output is the same for any number.")] = None,
    scheduler: Annotated[Scheduler, typer.Option(
        help="threads: this process. dask: Dask workers (pip install 'tldp-tensors[dask]'): a local "
             "cluster, or the one at --dask-address. The output is the same with either.")
    ] = Scheduler.threads,
    dask_address: Annotated[Optional[str], typer.Option(
        metavar="HOST:PORT",
        help="With --scheduler dask: the scheduler of an existing dask.distributed cluster "
             "(tls://HOST:PORT for TLS). Its workers must see the input and output at the same "
             "paths; the run fails when no worker has joined within 30 s. The run's secret "
             "noise key travels to them: use TLS off this machine.",
        show_default=False)] = None,
    resume: Annotated[bool, typer.Option(
        help="Zarr output: continue an interrupted run from the blocks it wrote (kept in "
             ".OUT.tldp-partial). The options must match; with the same --seed the result "
             "equals an uninterrupted run, without a seed only privacy holds (fresh noise "
             "for the remaining blocks). A run without --resume removes such a leftover.")] = False,
    allow_raw_release: Annotated[bool, typer.Option(
        help="Accept a TLDP run whose kept raw values cost more than --dp-delta (refused "
             "otherwise; the manifest records the consent under raw_release_allowed).")] = False,
    ledger: Annotated[Optional[Path], typer.Option(
        metavar="PATH", envvar="TLDP_LEDGER",
        help="A release ledger (SQLite, created if missing; or TLDP_LEDGER): records this "
             "release of the input's content and states what all its releases spend together. "
             "Keep it with the raw data, never with the release.", show_default=False)] = None,
    max_record_eps: Annotated[Optional[float], typer.Option(
        metavar="E", help="With --ledger: refuse (exit 1, nothing written or recorded) a release "
                          "that would take this data's releases past E per record.",
        show_default=False)] = None,
    max_record_delta: Annotated[Optional[float], typer.Option(
        metavar="D", help="With --ledger: the same cap for delta per record.", show_default=False)] = None,
    overwrite: Annotated[bool, typer.Option(
        help="Replace an existing output and manifest, once the new ones are complete (a folder "
             "only if it is an earlier output of the same kind).")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print the manifest to stdout.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Print nothing but errors.")] = False,
    block_elements: Annotated[int, typer.Option(min=1, hidden=True,
                                                help="Elements per block (tests, benchmarks).")
                              ] = BLOCK_ELEMENTS,
    debug: Annotated[bool, typer.Option(help="Show tracebacks.", hidden=True)] = False,
):
    """Perturb every record of INPUT with TLDP and write a privacy manifest.

    \b
    Examples:
      tldp perturb sample_data/digits.npy --eps 1
      tldp perturb sample_data/digits.npy --eps 1 --noise gaussian --out noisy.npy
      tldp perturb features.npy --eps 2 --range -1:1 --budget record --json > manifest.json
      tldp perturb features.npy --eps 1 --range -1:1 --mechanism mvg --sampler float
      tldp perturb sample_data/digits.npy --eps 1 --noise discrete-laplace
      tldp perturb sample_data/digits.npy --eps 1 --seed-file release-1.seed
      tldp perturb docs/type3/model.safetensors --eps 1 --clip 0.1

    The summary line states the certified guarantee per element and per record:
    TLDP's eps is a per-element budget, so a record of I elements gets I*eps.
    In a model file (.npz, .safetensors) each tensor is a record, and the line
    adds the whole file, all its tensors composed.
    """
    debug = debug or bool(os.environ.get(DEBUG_ENV))

    def action():
        options = PerturbOptions(
            input=input, epsilon=eps, mechanism=mechanism.value,
            noise=noise.value if noise is not None else default_noise(mechanism.value),
            budget=budget.value, value_range=parse_range(value_range) if value_range else None,
            weights=weights, out=out, manifest=manifest, seed=_resolve_seed(seed, seed_file, quiet),
            seed_file=seed_file,
            allow_weak_seed=allow_weak_seed, rng=rng.value,
            dtype=dtype.value, granularity=granularity, dp_delta=dp_delta, overwrite=overwrite,
            clip_input=clip_input, clip=clip,
            workers=workers or os.cpu_count() or 1,
            datasets=dataset or [], image_format=image_format.value, copy_other=copy_other,
            skip_bad=skip_bad, anonymize_names=anonymize_names, name_map=name_map,
            scheduler=scheduler.value, dask_address=dask_address,
            dask_logs=debug, resume=resume, allow_raw_release=allow_raw_release,
            ledger=ledger, max_record_eps=max_record_eps, max_record_delta=max_record_delta,
            sampler=sampler.value,
            block_elements=block_elements)
        advance, close = _progress_bar(quiet, "rec")
        try:
            with _sigterm_interrupts():
                return perturb(options, progress=advance)
        finally:
            close()

    result = _run(debug, action)
    m = result.manifest
    if not quiet:
        for message in result.messages:
            typer.echo(f"tldp: {message}", err=True)
        shape = (f"{m['records']} tensors, the largest of {m['elements_per_record']} elements"
                 if "per_tensor" in m["accounting"] else
                 f"{m['records']} records x {m['elements_per_record']} elements")
        typer.echo(f"tldp: wrote {result.output} ({shape}) and {result.manifest_path}", err=True)
        typer.echo("tldp: " + accounting.summary_line(m["accounting"], m["noise"]), err=True)
    if json_out:
        typer.echo(json.dumps(m, indent=2))


class MaskMethod(str, Enum):
    intensity = "intensity"
    box = "box"
    image = "image"
    constant = "constant"
    faces = "faces"


@app.command("weight-mask", no_args_is_help=True)
def weight_mask_command(
    input: Annotated[Path, typer.Argument(
        metavar="INPUT",
        help="The data the mask is for: a .npy file, an HDF5 file, a Zarr store or a folder of "
             "images (detected).", show_default=False)],
    method: Annotated[MaskMethod, typer.Option(
        help="constant: one weight everywhere (--weight). box: rectangles from a JSON or CSV "
             "file (--boxes). image: a grayscale picture of the weights (--mask-image). "
             "intensity: the paper's MNIST rule, w = ((x - lo) / (hi - lo)) ** gamma, one mask "
             "per record, computed from the private values (so it depends on the data). "
             "faces: face regions found by OpenCV's bundled Haar cascade (pip install "
             "'tldp-tensors[faces]'), also data-derived.",
        show_default=False)],
    out: Annotated[Path, typer.Option(
        help="The mask: a .npy file, or for a folder of images a folder of mask PNGs (8-bit "
             "grayscale, 0..255 = weight 0..1) named like the images. A sidecar OUT.json "
             "records the method.", show_default=False)],
    weight: Annotated[Optional[float], typer.Option(
        help="constant: the weight, in [0, 1]. box: the weight of boxes that give none; "
             "faces: the weight of faces (default 1).", show_default=False)] = None,
    boxes: Annotated[Optional[Path], typer.Option(
        help="box: JSON list of {x0, y0, x1, y1, weight?, file?} or CSV x0,y0,x1,y1,weight "
             "(a header may name the columns, with an optional file column). Pixels, x the "
             "column, y the row, x1 and y1 exclusive. A box with a file applies to that image "
             "only; overlapping boxes take the larger weight.", show_default=False)] = None,
    mask_image: Annotated[Optional[Path], typer.Option(
        help="image: a grayscale image, black = weight 0, white = weight 1.",
        show_default=False)] = None,
    resize: Annotated[bool, typer.Option(
        help="image: resize the mask image to the records' size (bilinear) instead of "
             "refusing a different size.")] = False,
    value_range: Annotated[Optional[str], typer.Option(
        "--range", metavar="LO:HI",
        help="intensity, faces: the declared value range (as for perturb; 8- and 16-bit "
             "integer data defaults to its dtype's range). Also scales the preview.")] = None,
    gamma: Annotated[Optional[float], typer.Option(
        help="intensity: exponent of the rule (default 1).", show_default=False)] = None,
    margin: Annotated[Optional[float], typer.Option(
        help="faces: grow each face box by this fraction of its size on every side "
             "(default 0.2).", show_default=False)] = None,
    feather: Annotated[int, typer.Option(
        metavar="PIXELS", help="Soften the mask's edges: weights ramp down to 0 over PIXELS "
                               "pixels outward (never lowered inside).")] = 0,
    preview: Annotated[Optional[Path], typer.Option(
        help="Write a PNG of the first record or image with the mask tinted red, to check by "
             "eye. It shows the private data: keep it private.", show_default=False)] = None,
    dataset: Annotated[Optional[str], typer.Option(
        metavar="PATH", help="HDF5/Zarr: the array the mask is for.", show_default=False)] = None,
    data_derived: Annotated[bool, typer.Option(
        help="box/image: record that the regions were found in the private data themselves "
             "(e.g. by a detector run on each image).")] = False,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing mask, sidecar or preview.")] = False,
    json_out: Annotated[bool, typer.Option(
        "--json", help="Print the sidecar (how the mask was made) and the files written as JSON "
                       "to stdout.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Print nothing but errors.")] = False,
    debug: Annotated[bool, typer.Option(help="Show tracebacks.", hidden=True)] = False,
):
    """Make a weight mask for weighted TLDP (perturb --weights).

    A weight w in [0, 1] per position lowers the chance that the raw value is
    kept from p to (1 - w) p. A mask of the records' spatial shape covers every
    channel.

    \b
    Examples:
      tldp weight-mask photos/ --method box --boxes faces.csv --out masks --preview check.png
      tldp perturb photos/ --eps 1 --weights masks
      tldp weight-mask sample_data/digits.npy --method intensity --out digits.mask.npy
      tldp weight-mask data.npy --method constant --weight 0.5 --out half.npy
      tldp weight-mask photos/ --method image --mask-image region.png --resize --out masks
      tldp weight-mask photos/ --method faces --margin 0.3 --feather 8 --out masks --preview check.png
    """
    from tldp_cli.weights import MaskOptions, make_mask

    debug = debug or bool(os.environ.get(DEBUG_ENV))

    def action():
        return make_mask(MaskOptions(
            input=input, method=method.value, out=out, weight=weight, boxes=boxes,
            mask_image=mask_image, resize=resize,
            value_range=parse_range(value_range) if value_range else None, gamma=gamma,
            margin=margin, feather=feather, preview=preview, dataset=dataset, data_derived=data_derived,
            overwrite=overwrite))

    result = _run(debug, action)
    if not quiet:
        for message in result.messages:
            typer.echo(f"tldp: {message}", err=True)
        also = f"; preview {result.preview}" if result.preview else ""
        typer.echo(f"tldp: wrote {result.output} ({result.description}, method {method.value}) "
                   f"and {result.sidecar}{also}", err=True)
    if json_out:
        sidecar = json.loads(Path(result.sidecar).read_text())
        typer.echo(json.dumps({"mask": str(result.output), "sidecar": str(result.sidecar),
                               "preview": str(result.preview) if result.preview else None,
                               **sidecar}, indent=2))


class Model(str, Enum):
    logistic = "logistic"
    mlp = "mlp"


def _fmt(value, spec: str = ".4g") -> str:
    return "-" if value is None else format(value, spec)


def _print_report(report: dict) -> None:
    echo = lambda text="": typer.echo(text, err=True)  # noqa: E731
    acc = report["accounting"]
    echo(f"tldp: {report['perturbed']} against {report['original']} ({report['format']}, "
         f"{report['records']} records x {report['elements_per_record']} elements; "
         f"{report['mechanism']} {report['noise']}, {report['epsilon_scope']}; "
         f"certified per record eps={_fmt(acc['per_record']['epsilon'])})")
    echo(f"tldp: this report is {report['sensitive']}")
    echo(f"  {'check':<20}{'result':<9}detail")
    for check in report["checks"]:
        result = {True: "ok", False: "FAILED", None: "skipped"}[check["passed"]]
        echo(f"  {check['check']:<20}{result:<9}{check.get('detail', '')}")
    noise = report["error"]
    echo(f"  {'per record':<20}{'mean':>11}{'median':>11}{'max':>11}")
    for key, label in (("mse", "MSE"), ("mae", "MAE"), ("relative_l2", "relative L2"),
                       ("l2", "||Z||_2"), ("psnr", "PSNR (dB)"), ("ssim", "SSIM")):
        if key in noise:
            s = noise[key]
            echo(f"  {label:<20}{_fmt(s['mean']):>11}{_fmt(s['median']):>11}{_fmt(s['max']):>11}")
    utility = report.get("utility")
    if utility:
        echo(f"  weighted F1 ({utility['model']}): trained on perturbed {utility['f1_perturbed']:.3f}, "
             f"on clean {utility['f1_clean']:.3f}, majority class {utility['f1_majority_class']:.3f}")


def _print_sweep(result: dict, written: list) -> None:
    echo = lambda text="": typer.echo(text, err=True)  # noqa: E731
    ref = result["reference"]
    echo(f"  {'method':<10}{'eps':>8}{'record eps':>12}{'mean ||Z||':>12}{'F1':>8}")
    for row in result["rows"]:
        echo(f"  {row['method']:<10}{row['epsilon']:>8g}{row['record_epsilon']:>12.4g}"
             f"{row['mean_l2_error']:>12.4g}{_fmt(row['f1'], '.3f'):>8}")
    if ref:
        echo(f"  clean training data: F1 {ref['f1_clean']:.3f} ({ref['model']}); "
             f"majority class {ref['f1_majority_class']:.3f}")
    for skipped in result.get("skipped_methods", []):
        echo(f"  {skipped['method']} skipped: {skipped['reason']}")
    echo("tldp: wrote " + ", ".join(str(p) for p in written))
    echo(f"tldp: these files are {result['sensitive'].replace('keep it', 'keep them')}")


@app.command("evaluate", no_args_is_help=True)
def evaluate_command(
    original: Annotated[Path, typer.Argument(metavar="ORIGINAL", help="The data that was perturbed (any format perturb reads).",
                                             show_default=False)],
    perturbed: Annotated[Optional[Path], typer.Argument(
        metavar="PERTURBED", help="perturb's output. Not with --sweep.", show_default=False)] = None,
    manifest: Annotated[Optional[Path], typer.Option(
        help="The privacy manifest. Default: PERTURBED.manifest.json.")] = None,
    json_out: Annotated[bool, typer.Option(
        "--json", help="Print every number as JSON to stdout. Computed from the raw data: keep it "
                       "with them, never with the release.")] = False,
    report_path: Annotated[Optional[Path], typer.Option(
        "--report", metavar="PATH", help="Write the JSON report to PATH (as --json prints it).",
        show_default=False)] = None,
    per_record: Annotated[bool, typer.Option(
        "--per-record", help="Add each record's MSE, MAE, relative L2 and ||Z|| (PSNR, SSIM) to "
                             "the JSON report; together they give each record's exact norm. "
                             "Default: only their mean, median, min and max.")] = False,
    name_map: Annotated[Optional[Path], typer.Option(
        metavar="PATH", help="The name map of a perturb --anonymize-names run, which pairs each "
                             "image with its perturbed copy. Default: ORIGINAL.name-map.json.",
        show_default=False)] = None,
    labels: Annotated[Optional[str], typer.Option(
        metavar="LABELS",
        help="Class labels of ORIGINAL's records, enabling the task-utility score: a 1-D .npy "
             "file, dataset=NAME (an array inside ORIGINAL, HDF5/Zarr) or subfolders (an image "
             "folder's top-level subfolder names).")] = None,
    test: Annotated[Optional[Path], typer.Option(
        help="Clean test records (any format perturb reads) for the task-utility score.")] = None,
    test_labels: Annotated[Optional[str], typer.Option(
        metavar="LABELS", help="Labels of --test, in the forms --labels takes (dataset=NAME and "
                               "subfolders refer to --test).")] = None,
    model: Annotated[Model, typer.Option(
        help="Classifier: logistic regression or a small MLP (scikit-learn).")] = Model.logistic,
    sweep: Annotated[bool, typer.Option(
        "--sweep", help="Perturb ORIGINAL in memory for every --eps with TLDP-L, TLDP-G, the "
                        "Laplace and Gaussian baselines, MVG (matrix-shaped records) and IDN; "
                        "write a table and plots to --out.")] = False,
    eps: Annotated[Optional[str], typer.Option(
        "--eps", metavar="E1,E2,...", help="--sweep: the epsilons (see --budget).")] = None,
    out: Annotated[Optional[Path], typer.Option(
        help="--sweep: folder for sweep.csv, sweep.json and the PNG plots.")] = None,
    value_range: Annotated[Optional[str], typer.Option(
        "--range", metavar="LO:HI", help="--sweep: declared value range, as for perturb.")] = None,
    weights: Annotated[Optional[Path], typer.Option(
        help="--sweep: weight mask .npy; adds weighted TLDP (TLDP-L-w, TLDP-G-w).")] = None,
    budget: Annotated[Budget, typer.Option(help="--sweep: as for perturb.")] = Budget.element,
    repeat: Annotated[int, typer.Option(
        metavar="N", help="--sweep: perturb and score every point N times with independent noise; "
                          "the table gives the mean and F1's standard deviation, min and max.")] = 1,
    seed: Annotated[Optional[str], typer.Option(
        metavar="HEX", help="--sweep: make the noise reproducible with this secret key, as for "
                            "perturb (or --seed-file, $TLDP_SEED).", show_default=False)] = None,
    seed_file: SeedFile = None,
    allow_weak_seed: AllowWeakSeed = False,
    rng: Annotated[RngKind, typer.Option(help="--sweep: as for perturb.")] = RngKind.secure,
    dp_delta: Annotated[float, typer.Option(help="--sweep: delta of the (eps, delta) figures.")] = 1e-5,
    dataset: Annotated[Optional[str], typer.Option(
        metavar="PATH", help="--sweep: the HDF5/Zarr array to use when there are several.")] = None,
    overwrite: Annotated[bool, typer.Option(help="Replace existing report or sweep files.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Print nothing but errors.")] = False,
    debug: Annotated[bool, typer.Option(help="Show tracebacks.", hidden=True)] = False,
):
    """Check perturbed data against its manifest and measure what survived the noise.

    \b
    Examples:
      tldp evaluate sample_data/digits.npy sample_data/digits.tldp.npy
      tldp evaluate sample_data/digits.npy sample_data/digits.tldp.npy --report report.json \\
          --labels sample_data/digits_labels.npy --test sample_data/digits_test.npy \\
          --test-labels sample_data/digits_test_labels.npy
      tldp evaluate sample_data/digits.npy --sweep --eps 0.1,0.5,1,2,5,10 --seed 0 --allow-weak-seed \\
          --labels sample_data/digits_labels.npy --test sample_data/digits_test.npy \\
          --test-labels sample_data/digits_test_labels.npy --out sweep/

    Integrity (exit 1 on a mismatch): the outputs' sha256, shapes and record counts,
    and the manifest's scale, p and certified figures recomputed from its mechanism.
    Noise: per-record MSE, MAE, relative L2 (PSNR and SSIM for images), the noise norm
    against Table 5, the retained fraction against p and a KS test of the noise; these
    fail only at p < 1e-6 and are skipped for rounded and clipped (8-bit) output.

    Reports and sweeps are computed from the raw data: keep them with it, never with
    the release. Per-record figures go into --json only with --per-record.
    """
    debug = debug or bool(os.environ.get(DEBUG_ENV))
    from tldp_cli import evaluate as ev

    def action():
        if sweep:
            if perturbed is not None:
                raise UsageError("--sweep perturbs ORIGINAL in memory; give no PERTURBED")
            if eps is None or out is None:
                raise UsageError("--sweep needs --eps E1,E2,... and --out DIR")
            for name, given in (("--manifest", manifest), ("--per-record", per_record or None),
                                ("--name-map", name_map)):
                if given is not None:
                    raise UsageError(f"{name} applies to ORIGINAL PERTURBED, not --sweep")
            epsilons = ev.parse_eps_list(eps)
            rng_range = parse_range(value_range) if value_range else None
            if not 0 < dp_delta < 1:
                raise UsageError(f"--dp-delta must lie in (0, 1), not {dp_delta}")
            advance, close = _progress_bar(quiet, "run")
            try:
                result = ev.sweep(original, epsilons, labels=labels, test=test, test_labels=test_labels,
                                  model=model.value, value_range=rng_range, weights=weights,
                                  budget=budget.value, seed=_resolve_seed(seed, seed_file, quiet),
                                  allow_weak_seed=allow_weak_seed, rng=rng.value, dp_delta=dp_delta,
                                  dataset=dataset, progress=advance, repeats=repeat)
            finally:
                close()
            return result, ev.write_sweep(result, out, overwrite)
        if perturbed is None:
            raise UsageError("give ORIGINAL PERTURBED, or ORIGINAL --sweep")
        for name, given in (("--eps", eps), ("--out", out), ("--range", value_range),
                            ("--weights", weights), ("--seed", seed), ("--seed-file", seed_file),
                            ("--dataset", dataset), ("--repeat", None if repeat == 1 else repeat)):
            if given is not None:
                raise UsageError(f"{name} applies to --sweep only")
        if per_record and not (json_out or report_path):
            raise UsageError("--per-record adds per-record lists to the JSON report; give --json or "
                             "--report PATH")
        if report_path is not None and os.path.lexists(report_path) and not overwrite:
            raise ev.OutputError(f"{report_path}: exists; pass --overwrite to replace it")
        advance, close = _progress_bar(quiet, "rec")
        try:
            report = ev.evaluate(original, perturbed, manifest, labels=labels, test=test,
                                 test_labels=test_labels, model=model.value, progress=advance,
                                 per_record=per_record, name_map=name_map)
        finally:
            close()
        _emit_json(report, json_out, report_path, overwrite)
        return report, None

    result, written = _run(debug, action)
    if sweep:
        if not quiet:
            _print_sweep(result, written)
        _run(debug, lambda: _emit_json(result, json_out, report_path, overwrite))
        return
    if not quiet:
        _print_report(result)
    failed = [c["check"] for c in result["checks"] if c["passed"] is False]
    if failed:
        _fail(f"{result['perturbed']}: failed {', '.join(failed)} (see the table"
              + (f" and {report_path})" if report_path else ")"), 1)
    if not quiet:
        typer.echo("tldp: every check passed", err=True)


@app.command("plan", no_args_is_help=True)
def plan_command(
    input: Annotated[Optional[Path], typer.Argument(
        metavar="[INPUT]", help="The input perturb would read (headers only); or describe the "
                                "records with --elements instead.", show_default=False)] = None,
    eps: Annotated[float, typer.Option("--eps", help="As for perturb.", show_default=False)] = None,
    noise: Annotated[Optional[Noise], typer.Option(help="As for perturb.", show_default=False)] = None,
    sampler: Annotated[Sampler, typer.Option(help="As for perturb.")] = Sampler.exact,
    mechanism: Annotated[Mechanism, typer.Option(help="As for perturb.")] = Mechanism.tldp,
    budget: Annotated[Budget, typer.Option(help="As for perturb.")] = Budget.element,
    value_range: Annotated[Optional[str], typer.Option(
        "--range", metavar="LO:HI", help="As for perturb.", show_default=False)] = None,
    dp_delta: Annotated[float, typer.Option(help="As for perturb.")] = 1e-5,
    granularity: Annotated[Optional[float], typer.Option(metavar="G", help="As for perturb.",
                                                         show_default=False)] = None,
    dataset: Annotated[Optional[list[str]], typer.Option(
        "--dataset", metavar="PATH", help="As for perturb.", show_default=False)] = None,
    clip: Annotated[Optional[float], typer.Option("--clip", metavar="C", help="As for perturb.",
                                                  show_default=False)] = None,
    dtype: Annotated[OutDtype, typer.Option(help="As for perturb.")] = OutDtype.float32,
    image_format: Annotated[ImageFormat, typer.Option(help="As for perturb.")] = ImageFormat.png,
    allow_raw_release: Annotated[bool, typer.Option(help="As for perturb.")] = False,
    elements: Annotated[Optional[str], typer.Option(
        "--elements", "--shape", metavar="I", help="Without INPUT: elements per record, or the "
                                                   "record's shape (28x28).", show_default=False)] = None,
    records: Annotated[int, typer.Option(help="Without INPUT: the number of records.")] = 1,
    input_dtype: Annotated[Optional[str], typer.Option(
        metavar="DTYPE", help="Without INPUT: the data's dtype (uint8, float32, ...). Default: "
                              "integers when --range has integer ends, else float64.",
        show_default=False)] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print the plan as JSON to stdout.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Print nothing but errors.")] = False,
    debug: Annotated[bool, typer.Option(help="Show tracebacks.", hidden=True)] = False,
):
    """State the guarantee perturb would give, before any data is read; write nothing.

    Reads the input's headers only (or a description of its records) and prints the
    summary line perturb would print; --json prints the manifest's accounting and
    calibration (noise scale, retain probability, the perturbed values' dtype, the arrays
    a row spans).
    With --budget record it gives the per-element epsilon and the noise scale that meet
    the per-record target, or, where the target cannot be met, the refusal perturb gives.

    \b
    Examples:
      tldp plan sample_data/digits.npy --eps 1 --noise gaussian
      tldp plan --elements 28x28 --records 60000 --range 0:256 --eps 8 --budget record --json
      tldp plan big.h5 --eps 1 --dataset images --json > plan.json
    """
    from tldp_cli import planning
    from tldp_cli.audit import parse_shape

    debug = debug or bool(os.environ.get(DEBUG_ENV))

    def action():
        if eps is None:
            raise UsageError("--eps is required")
        if (input is None) == (elements is None):
            raise UsageError("give INPUT or --elements (a description of the records), not both")
        options = PerturbOptions(
            input=input or Path(planning.DESCRIBED), epsilon=eps, mechanism=mechanism.value,
            noise=noise.value if noise is not None else default_noise(mechanism.value),
            sampler=sampler.value, budget=budget.value,
            value_range=parse_range(value_range) if value_range else None, dtype=dtype.value,
            granularity=granularity, dp_delta=dp_delta, clip=clip, datasets=dataset or [],
            image_format=image_format.value, allow_raw_release=allow_raw_release)
        if input is not None:
            return planning.plan_input(options)
        return planning.plan_records(options, parse_shape(elements), records, input_dtype)

    report = _run(debug, action)
    if not quiet:
        for message in report["messages"]:
            typer.echo(f"tldp: {message}", err=True)
        c = report["calibration"]
        typer.echo(f"tldp: plan: {c['records']} records, the largest of {report['elements_per_record']} "
                   f"elements; {report['noise']} noise of scale {c['noise_scale']:.4g}, element eps "
                   f"{c['calibration_epsilon']:.4g}, retain probability {c['retain_probability']:.3g}, "
                   f"values {c['values_dtype']}", err=True)
        typer.echo("tldp: " + accounting.summary_line(report["accounting"], report["noise"]), err=True)
    if json_out:
        typer.echo(json.dumps(report, indent=2, allow_nan=False))


@app.command("ledger", no_args_is_help=True)
def ledger_command(
    path: Annotated[Path, typer.Argument(metavar="LEDGER", help="A ledger written by perturb --ledger.",
                                         show_default=False)],
    json_out: Annotated[bool, typer.Option("--json", help="Print the ledger as JSON to stdout.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Print nothing but errors.")] = False,
    debug: Annotated[bool, typer.Option(help="Show tracebacks.", hidden=True)] = False,
):
    """List the datasets of a release ledger, their releases and what they spend together.

    A dataset is identified by a keyed fingerprint of its content (the key lives in the
    ledger): a copy at another path is the same data. Pending releases are runs that were
    killed after recording their release; they count as spent.

    \b
    Examples:
      tldp ledger ledger.db
      tldp ledger ledger.db --json > releases.json
    """
    from tldp_cli import ledger as ledger_mod

    debug = debug or bool(os.environ.get(DEBUG_ENV))
    report = _run(debug, lambda: ledger_mod.listing(path))
    if json_out:
        typer.echo(json.dumps(report, indent=2, allow_nan=False))
        return
    if quiet:
        return
    for dataset in report["datasets"]:
        total = dataset["cumulative_per_record"]
        typer.echo(f"data {dataset['fingerprint'][:16]}: {total['releases']} release(s)"
                   + (f", {total['pending']} pending" if total["pending"] else "")
                   + f"; together, each record (eps={total['epsilon']:.4g}, delta={total['delta']:.3g})")
        for r in dataset["releases"]:
            record = r["per_record"]
            typer.echo(f"  #{r['id']} {r['created']} {r['status']:8} {r['input']} -> {r['output']}: "
                       f"each record (eps={record['epsilon']:.4g}, delta={record['delta']:.3g})")
    if not report["datasets"]:
        typer.echo("no releases recorded", err=True)


class AuditScope(str, Enum):
    both = "both"
    element = "element"
    record = "record"


@app.command("audit", no_args_is_help=True)
def audit_command(
    eps: Annotated[float, typer.Option("--eps", help="Privacy budget epsilon, as for perturb.",
                                       show_default=False)],
    noise: Annotated[Optional[Noise], typer.Option(
        help="As for perturb. Default: laplace; gaussian for mvg and idn.", show_default=False)] = None,
    sampler: Annotated[Sampler, typer.Option(
        help="As for perturb: exact audits laplace and gaussian as perturb draws them for float "
             "data (discrete noise on its automatic grid); float audits the continuous samplers, "
             "whose floating-point leak the audit detects. --noise discrete-* audits integer "
             "data.")] = Sampler.exact,
    mechanism: Annotated[Mechanism, typer.Option(help="As for perturb.")] = Mechanism.tldp,
    budget: Annotated[Budget, typer.Option(help="As for perturb.")] = Budget.element,
    value_range: Annotated[str, typer.Option(
        "--range", metavar="LO:HI", help="The declared value range; the neighbours sit at its ends.")] = "0:256",
    elements: Annotated[str, typer.Option(
        "--elements", metavar="I", help="Elements per record, or the record's shape (28x28; "
                                        "mvg needs it).")] = "1",
    dp_delta: Annotated[float, typer.Option(
        help="delta at which (epsilon, delta) figures are certified, as for perturb.")] = 1e-5,
    granularity: Annotated[Optional[float], typer.Option(
        metavar="G", help="Discrete noise on float data snapped to multiples of G, as for "
                          "perturb. Default: integer data (an integer --range).",
        show_default=False)] = None,
    samples: Annotated[int, typer.Option(
        help="Draws of each neighbour per scope, in elements (the record scope draws "
             "SAMPLES // I records). About 100 bytes of memory each (at most 2e7).")] = 1_000_000,
    confidence: Annotated[float, typer.Option(
        help="Probability that every lower bound in the report holds.")] = 0.95,
    scope: Annotated[AuditScope, typer.Option(
        help="element: two records that differ in one element; record: two records at opposite "
             "ends of the range.")] = AuditScope.both,
    seed: Annotated[Optional[str], typer.Option(
        metavar="HEX", help="Make the audit reproducible with this secret key, as for perturb "
                            "(or --seed-file, $TLDP_SEED).", show_default=False)] = None,
    seed_file: SeedFile = None,
    allow_weak_seed: AllowWeakSeed = False,
    rng: Annotated[RngKind, typer.Option(help="As for perturb.")] = RngKind.secure,
    dtype: Annotated[OutDtype, typer.Option(help="Output dtype, as for perturb.")] = OutDtype.float32,
    json_out: Annotated[bool, typer.Option("--json", help="Print the report as JSON to stdout.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Print nothing but errors.")] = False,
    debug: Annotated[bool, typer.Option(help="Show tracebacks.", hidden=True)] = False,
):
    """Look for evidence that a mechanism leaks more than its certified figures.

    Runs the mechanism on two neighbouring inputs, chooses the most telling event on
    half the draws and bounds its probabilities on the other half (Clopper-Pearson):
    the audited eps is a lower bound on the true privacy loss at the stated
    confidence. Exit 1 when it exceeds a certified figure (VIOLATION). A lower
    bound is never a certificate: "ok" means no violation was found, and figures
    above the reach (about ln of the draws) cannot be contradicted at that size.

    \b
    Examples:
      tldp audit --eps 1 --elements 4 --range 0:1
      tldp audit --eps 1 --noise gaussian --elements 784 --samples 4000000 --json > audit.json
      tldp audit --eps 2 --mechanism mvg --sampler float --elements 28x28 --scope record --seed-file audit.seed
      tldp audit --eps 1 --noise discrete-laplace --elements 16 --range 0:256
    """
    from tldp_cli import audit as audit_mod

    debug = debug or bool(os.environ.get(DEBUG_ENV))

    def action():
        return audit_mod.run(
            mechanism=mechanism.value, budget=budget.value, epsilon=eps,
            noise=noise.value if noise is not None else default_noise(mechanism.value),
            value_range=parse_range(value_range), shape=audit_mod.parse_shape(elements),
            dp_delta=dp_delta, granularity=granularity, samples=samples, confidence=confidence,
            scopes=audit_mod.SCOPES if scope is AuditScope.both else (scope.value,),
            seed=_resolve_seed(seed, seed_file, quiet), allow_weak_seed=allow_weak_seed,
            rng=rng.value, dtype=dtype.value, sampler=sampler.value)

    report = _run(debug, action)
    if not quiet:
        for line in audit_mod.format_report(report):
            typer.echo(f"tldp: {line}" if not line.startswith(" ") else line, err=True)
    if json_out:
        typer.echo(json.dumps(report, indent=2, allow_nan=False))
    if report["verdict"] == "VIOLATION":
        worst = max((row for s in report["scopes"] for row in s["claims"]),
                    key=lambda row: row["epsilon_lower_bound"] - row["certified_epsilon"])
        _fail(f"audit found a privacy VIOLATION: eps >= {worst['epsilon_lower_bound']:.4g} at "
              f"delta {worst['delta']:.3g}, certified {worst['certified_epsilon']:.4g} "
              f"(confidence {report['confidence']:g})", 1)
    if report["verdict"] == "MISCALIBRATED":
        worst = next(row for row in report["request"]["scopes"] if not row["consistent"])
        _fail(f"the audited calibration is not the request's: it certifies eps "
              f"{worst['certified_epsilon']:.4g} {worst['scope'].replace('_', ' ')} where --eps "
              f"{report['epsilon']:g} implies {worst['requested_epsilon']:.4g}", 1)
    if not quiet:
        typer.echo(f"tldp: consistent: no audited lower bound exceeds its certified figure "
                   f"(confidence {report['confidence']:g}); this is evidence, not a proof", err=True)


@app.command("seed")
def seed_command(
    json_out: Annotated[bool, typer.Option("--json", help='Print {"seed": ...} as JSON.')] = False,
):
    """Print a fresh random seed: 32 hex digits (128 bits) from the OS's secure source.

    A seed is a secret key: whoever has it can regenerate the noise and subtract
    it. Keep it off command lines (other users see them in ps; shells keep them
    in their history): pass it with --seed-file or the TLDP_SEED variable. Use a
    seed for one release only.

    \b
    Examples:
      (umask 077; tldp seed > release-1.seed)
      tldp perturb data.npy --eps 1 --range 0:1 --seed-file release-1.seed
      TLDP_SEED=$(cat release-1.seed) tldp perturb data.npy --eps 1 --range 0:1
      python -c "import secrets; print(secrets.token_hex(16))"    # the same, without tldp
    """
    seed = secrets.token_hex(16)
    typer.echo(json.dumps({"seed": seed}) if json_out else seed)


def main():
    app()
