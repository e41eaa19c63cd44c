"""The `tldp` command: parses options, calls the library, maps errors to exit codes.

Human-readable text goes to stderr; stdout carries only machine output (--json).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer
from typer.core import TyperGroup

from tldp_cli import __version__, accounting
from tldp_cli.errors import TldpError, UsageError
from tldp_cli.pipeline import PerturbOptions, parse_range, perturb

DEBUG_ENV = "TLDP_DEBUG"


class _OneLineErrors(TyperGroup):
    """Every failure is one line on stderr: exit 2 for usage errors, 1 otherwise."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        try:
            code = super().main(args=args, prog_name=prog_name or "tldp", complete_var=complete_var,
                                standalone_mode=False, **extra)
        except typer.TyperException as exc:  # Typer's usage errors carry exit code 2
            ctx = getattr(exc, "ctx", None)
            hint = f" (see 'tldp {ctx.info_name} --help')" if ctx is not None and ctx.parent else ""
            _fail(f"{exc.format_message()}{hint}", exc.exit_code)
        except typer.Abort:
            _fail("interrupted; nothing was written", 130)
        sys.exit(code if isinstance(code, int) else 0)


def _fail(message: str, code: int):
    typer.echo(f"tldp: error: {message}", err=True)
    sys.exit(code)


app = typer.Typer(
    cls=_OneLineErrors, rich_markup_mode=None, add_completion=False, no_args_is_help=True,
    context_settings={"help_option_names": ["-h", "--help"]},
    help="Local differential privacy (TLDP) for tensor datasets on disk.",
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
    """


class Noise(str, Enum):
    laplace = "laplace"
    gaussian = "gaussian"


class Mechanism(str, Enum):
    tldp = "tldp"
    baseline = "baseline"


class Budget(str, Enum):
    element = "element"
    record = "record"


class RngKind(str, Enum):
    secure = "secure"
    fast = "fast"


class ImageFormat(str, Enum):
    png = "png"
    tiff = "tiff"


class OutDtype(str, Enum):
    float32 = "float32"
    float64 = "float64"


def _run(debug: bool, action):
    """Run a library call; a TldpError becomes one line and exit 1 (2 for usage)."""
    try:
        return action()
    except UsageError as exc:
        if debug:
            traceback.print_exc()
        _fail(str(exc), 2)
    except TldpError as exc:
        if debug:
            traceback.print_exc()
        _fail(str(exc), 1)
    except KeyboardInterrupt:
        _fail("interrupted; nothing was written", 130)
    except OSError as exc:
        if debug:
            traceback.print_exc()
        where = exc.filename or "I/O"
        _fail(f"{where}: {exc.strerror or exc}", 1)


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
        help="A .npy file, an HDF5 file, a Zarr store or a folder of images (detected).",
                                          show_default=False)],
    eps: Annotated[float, typer.Option("--eps", help="Privacy budget epsilon (see --budget).",
                                       show_default=False)],
    noise: Annotated[Noise, typer.Option(help="Noise distribution.")] = Noise.laplace,
    mechanism: Annotated[Mechanism, typer.Option(
        help="tldp: keep each value with probability p, else add noise (paper, Algorithm 1). "
             "baseline: noise on every element calibrated to the whole record.")] = Mechanism.tldp,
    budget: Annotated[Budget, typer.Option(
        help="element: the paper's calibration, --eps is what each element gets (a record of I "
             "elements then gets I*eps). record: --eps is what each whole record gets.")] = Budget.element,
    value_range: Annotated[Optional[str], typer.Option(
        "--range", metavar="LO:HI",
        help="Declared value range. Required for float data; integer data defaults to its "
             "dtype's range (uint8 -> 0:256). Never inferred from the data.")] = None,
    weights: Annotated[Optional[Path], typer.Option(
        help="Weight mask .npy in [0, 1] (weighted TLDP): the record's shape, its spatial "
             "shape, or one mask per record.")] = None,
    out: Annotated[Optional[Path], typer.Option(
        help="Output path. Default: a sibling, digits.npy -> digits.tldp.npy.")] = None,
    manifest: Annotated[Optional[Path], typer.Option(
        help="Manifest path. Default: OUTPUT.manifest.json.")] = None,
    seed: Annotated[Optional[int], typer.Option(
        help="Make the run reproducible. The seed is a secret: anyone who has it can remove "
             "the noise. It is never written anywhere.")] = None,
    rng: Annotated[RngKind, typer.Option(
        help="secure: AES-CTR keyed from OS entropy (or the seed). fast: PCG64, predictable "
             "from its output.")] = RngKind.secure,
    dtype: Annotated[OutDtype, typer.Option(help="Output dtype; noise is drawn in it.")] = OutDtype.float32,
    dp_delta: Annotated[float, typer.Option(
        help="delta at which (epsilon, delta) figures are reported.")] = 1e-5,
    dataset: Annotated[Optional[list[str]], typer.Option(
        "--dataset", metavar="PATH",
        help="HDF5/Zarr: a dataset or array to perturb (repeatable). Default: every numeric "
             "dataset whose first axis matches the others'.")] = None,
    image_format: Annotated[ImageFormat, typer.Option(
        help="Image folders: png (8/16-bit, rounded and clipped to the range) or tiff "
             "(float32, unclipped).")] = ImageFormat.png,
    copy_other: Annotated[bool, typer.Option(
        help="Image folders: copy files that are not images (default: report and skip).")] = False,
    skip_bad: Annotated[bool, typer.Option(
        help="Image folders: skip unreadable images (listed in the manifest) instead of "
             "stopping.")] = False,
    clip_input: Annotated[bool, typer.Option(
        help="Clip input values outside --range into it (recorded in the manifest) "
             "instead of refusing.")] = False,
    workers: Annotated[Optional[int], typer.Option(
        min=1, help="Blocks perturbed in parallel threads. Default: the number of cores. "
                    "The output is the same for any number.")] = None,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing output.")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print the manifest to stdout.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Print nothing but errors.")] = False,
    debug: Annotated[bool, typer.Option(help="Show tracebacks.", hidden=True)] = False,
):
    """Perturb every record of INPUT with TLDP and write a privacy manifest.

    \b
    Examples:
      tldp perturb sample_data/digits.npy --eps 1
      tldp perturb sample_data/digits.npy --eps 1 --noise gaussian --out noisy.npy
      tldp perturb features.npy --eps 2 --range -1:1 --budget record --json > manifest.json

    The summary line states the certified guarantee per element and per record:
    TLDP's eps is a per-element budget, so a record of I elements gets I*eps.
    """
    debug = debug or bool(os.environ.get(DEBUG_ENV))

    def action():
        options = PerturbOptions(
            input=input, epsilon=eps, noise=noise.value, mechanism=mechanism.value,
            budget=budget.value, value_range=parse_range(value_range) if value_range else None,
            weights=weights, out=out, manifest=manifest, seed=seed, rng=rng.value,
            dtype=dtype.value, dp_delta=dp_delta, overwrite=overwrite, clip_input=clip_input,
            workers=workers or os.cpu_count() or 1,
            datasets=dataset or [], image_format=image_format.value, copy_other=copy_other,
            skip_bad=skip_bad)
        advance, close = _progress_bar(quiet, "rec")
        try:
            return perturb(options, progress=advance)
        finally:
            close()

    result = _run(debug, action)
    m = result.manifest
    if not quiet:
        for message in result.messages:
            typer.echo(f"tldp: {message}", err=True)
        typer.echo(f"tldp: wrote {result.output} ({m['records']} records x "
                   f"{m['elements_per_record']} elements) and {result.manifest_path}", err=True)
        typer.echo("tldp: " + accounting.summary_line(m["accounting"], m["noise"]), err=True)
    if json_out:
        typer.echo(json.dumps(m, indent=2))


def main():
    app()
