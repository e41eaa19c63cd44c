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
            message = " ".join(exc.format_message().split())  # one line, even for choice lists
            _fail(f"{message}{hint}", exc.exit_code)
        except typer.Abort:
            _fail("interrupted; nothing was written", 130)
        sys.exit(code if isinstance(code, int) else 0)


def _fail(message: str, code: int):
    typer.echo(f"tldp: error: {message}", err=True)
    sys.exit(code)


app = typer.Typer(
    cls=_OneLineErrors, rich_markup_mode=None, add_completion=False, no_args_is_help=True,
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
             "shape, or one mask per record; for a folder of images, a folder of mask PNGs "
             "(see tldp weight-mask).")] = None,
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


class MaskMethod(str, Enum):
    intensity = "intensity"
    box = "box"
    image = "image"
    constant = "constant"
    faces = "faces"


@app.command("weight-mask", no_args_is_help=True)
def weight_mask_command(
    input: Annotated[Path, typer.Argument(
        help="The data the mask is for: a .npy file, an HDF5 file, a Zarr store or a folder of "
             "images (detected).", show_default=False)],
    method: Annotated[MaskMethod, typer.Option(
        help="constant: one weight everywhere (--weight). box: rectangles from a JSON or CSV "
             "file (--boxes). image: a grayscale picture of the weights (--mask-image). "
             "intensity: the paper's MNIST rule, w = ((x - lo) / (hi - lo)) ** gamma, one mask "
             "per record, computed from the private values (so it depends on the data). "
             "faces: face regions found by OpenCV's bundled Haar cascade (pip install "
             "'tldp[faces]'), also data-derived.",
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
        help="intensity, faces: the declared value range (as for perturb; integer data "
             "defaults to its dtype's range). Also scales the preview.")] = None,
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
         f"{report['mechanism']} {report['noise']}, eps={_fmt(report['epsilon'])} per "
         f"{report['budget']}; certified per record eps={_fmt(acc['per_record']['epsilon'])})")
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
    echo("tldp: wrote " + ", ".join(str(p) for p in written))


@app.command("evaluate", no_args_is_help=True)
def evaluate_command(
    original: Annotated[Path, typer.Argument(help="The data that was perturbed (any format perturb reads).",
                                             show_default=False)],
    perturbed: Annotated[Optional[Path], typer.Argument(
        help="perturb's output. Not with --sweep.", show_default=False)] = None,
    manifest: Annotated[Optional[Path], typer.Option(
        help="The privacy manifest. Default: PERTURBED.manifest.json.")] = None,
    json_report: Annotated[Optional[Path], typer.Option(
        "--json", metavar="REPORT", help="Write every number as JSON to REPORT ('-': stdout).")] = None,
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
        "--sweep", help="Perturb ORIGINAL in memory for every --eps with TLDP-L, TLDP-G and the "
                        "Laplace and Gaussian baselines; write a table and plots to --out.")] = False,
    eps: Annotated[Optional[str], typer.Option(
        "--eps", metavar="E1,E2,...", help="--sweep: the epsilons (see --budget).")] = None,
    out: Annotated[Optional[Path], typer.Option(
        help="--sweep: folder for sweep.csv, sweep.json and the PNG plots.")] = None,
    value_range: Annotated[Optional[str], typer.Option(
        "--range", metavar="LO:HI", help="--sweep: declared value range, as for perturb.")] = None,
    weights: Annotated[Optional[Path], typer.Option(
        help="--sweep: weight mask .npy; adds weighted TLDP (TLDP-L-w, TLDP-G-w).")] = None,
    budget: Annotated[Budget, typer.Option(help="--sweep: as for perturb.")] = Budget.element,
    seed: Annotated[Optional[int], typer.Option(help="--sweep: make the noise reproducible.")] = None,
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
      tldp evaluate sample_data/digits.npy sample_data/digits.tldp.npy --json report.json \\
          --labels sample_data/digits_labels.npy --test sample_data/digits_test.npy \\
          --test-labels sample_data/digits_test_labels.npy
      tldp evaluate sample_data/digits.npy --sweep --eps 0.1,0.5,1,2,5,10 --seed 0 \\
          --labels sample_data/digits_labels.npy --test sample_data/digits_test.npy \\
          --test-labels sample_data/digits_test_labels.npy --out sweep/

    Integrity (exit 1 on a mismatch): the outputs' sha256, shapes and record counts,
    and the manifest's scale, p and certified figures recomputed from its mechanism.
    Noise: per-record MSE, MAE, relative L2 (PSNR and SSIM for images), the noise norm
    against Table 5, the retained fraction against p and a KS test of the noise; these
    fail only at p < 1e-6 and are skipped for rounded and clipped (8-bit) output.
    """
    debug = debug or bool(os.environ.get(DEBUG_ENV))
    from tldp_cli import evaluate as ev

    def action():
        if sweep:
            if perturbed is not None:
                raise UsageError("--sweep perturbs ORIGINAL in memory; give no PERTURBED")
            if eps is None or out is None:
                raise UsageError("--sweep needs --eps E1,E2,... and --out DIR")
            if manifest is not None:
                raise UsageError("--manifest applies to ORIGINAL PERTURBED, not --sweep")
            epsilons = ev.parse_eps_list(eps)
            rng_range = parse_range(value_range) if value_range else None
            if not 0 < dp_delta < 1:
                raise UsageError(f"--dp-delta must lie in (0, 1), not {dp_delta}")
            advance, close = _progress_bar(quiet, "run")
            try:
                result = ev.sweep(original, epsilons, labels=labels, test=test, test_labels=test_labels,
                                  model=model.value, value_range=rng_range, weights=weights,
                                  budget=budget.value, seed=seed, rng=rng.value, dp_delta=dp_delta,
                                  dataset=dataset, progress=advance)
            finally:
                close()
            return result, ev.write_sweep(result, out, overwrite)
        if perturbed is None:
            raise UsageError("give ORIGINAL PERTURBED, or ORIGINAL --sweep")
        for name, given in (("--eps", eps), ("--out", out), ("--range", value_range),
                            ("--weights", weights), ("--seed", seed), ("--dataset", dataset)):
            if given is not None:
                raise UsageError(f"{name} applies to --sweep only")
        if json_report is not None and json_report != Path("-") and json_report.exists() and not overwrite:
            raise ev.OutputError(f"{json_report}: exists; pass --overwrite to replace it")
        advance, close = _progress_bar(quiet, "rec")
        try:
            report = ev.evaluate(original, perturbed, manifest, labels=labels, test=test,
                                 test_labels=test_labels, model=model.value, progress=advance)
        finally:
            close()
        if json_report is not None:
            text = json.dumps(report, indent=2, allow_nan=False)
            if json_report == Path("-"):
                typer.echo(text)
            else:
                ev.atomic_write(json_report, (text + "\n").encode())
        return report, None

    result, written = _run(debug, action)
    if sweep:
        if not quiet:
            _print_sweep(result, written)
        if json_report is not None:
            text = json.dumps(result, indent=2, allow_nan=False)
            if json_report == Path("-"):
                typer.echo(text)
            else:
                ev.atomic_write(json_report, (text + "\n").encode())
        return
    if not quiet:
        _print_report(result)
    failed = [c["check"] for c in result["checks"] if c["passed"] is False]
    if failed:
        _fail(f"{result['perturbed']}: failed {', '.join(failed)} (see the table"
              + (f" and {json_report})" if json_report else ")"), 1)
    if not quiet:
        typer.echo("tldp: every check passed", err=True)


def main():
    app()
