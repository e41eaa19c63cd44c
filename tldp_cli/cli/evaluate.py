"""`tldp evaluate`."""

import os
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from tldp_cli.cli.options import InputFormat, Quiet, Debug, AllowWeakSeed, Budget, RngKind, SeedFile, resolve_seed
from tldp_cli.errors import UsageError
from tldp_cli.cli.app import DEBUG_ENV, app, emit_json, fail, progress_bar, run


class Model(str, Enum):
    logistic = "logistic"
    mlp = "mlp"


def _fmt(value, spec: str = ".4g") -> str:
    return "-" if value is None else format(value, spec)


def _print_report(report: dict) -> None:
    echo = lambda text="": typer.echo(text, err=True)  # noqa: E731
    acc = report["accounting"]
    echo(f"tldp: {report['perturbed']} against {report['original']} ({report['format']}, "
         f"{report['records']} records {'of up to' if report.get('record_sizes', 1) > 1 else 'x'} "
         f"{report['elements_per_record']} elements; "
         f"{report['mechanism']} {report['noise']}, {report['epsilon_scope']}; "
         f"certified per record eps={_fmt(acc['per_record']['epsilon'])})")
    echo(f"tldp: this report is {report['sensitive']}")
    echo(f"  {'check':<20}{'result':<9}detail")
    for check in report["checks"]:
        result = {True: "ok", False: "FAILED", None: check.get("status") or "skipped"}[check["passed"]]
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
    original: Annotated[Path, typer.Argument(readable=False, metavar="ORIGINAL", help="The data that was perturbed (any format perturb reads).",
                                             show_default=False)],
    perturbed: Annotated[Optional[Path], typer.Argument(readable=False,
        metavar="PERTURBED", help="perturb's output. Not with --sweep.", show_default=False)] = None,
    manifest: Annotated[Optional[Path], typer.Option(readable=False,
        help="The privacy manifest. Default: PERTURBED.manifest.json.")] = None,
    json_out: Annotated[bool, typer.Option(
        "--json", help="Print every number as JSON to stdout. Computed from the raw data: keep it "
                       "with them, never with the release.")] = False,
    report_path: Annotated[Optional[Path], typer.Option(
        "--report", readable=False, metavar="PATH", help="Write the JSON report to PATH (as --json prints it).",
        show_default=False)] = None,
    per_record: Annotated[bool, typer.Option(
        "--per-record", help="Add each record's MSE, MAE, relative L2 and ||Z|| (PSNR, SSIM) to "
                             "the JSON report; together they give each record's exact norm. "
                             "Default: only their mean, median, min and max.")] = False,
    name_map: Annotated[Optional[Path], typer.Option(readable=False,
        metavar="PATH", help="The name map of a perturb --anonymize-names run, which pairs each "
                             "image with its perturbed copy. Default: ORIGINAL.name-map.json.",
        show_default=False)] = None,
    labels: Annotated[Optional[str], typer.Option(
        metavar="LABELS",
        help="Class labels of ORIGINAL's records, enabling the task-utility score: a 1-D .npy "
             "file, dataset=NAME (an array inside ORIGINAL, HDF5/Zarr) or subfolders (an image "
             "folder's top-level subfolder names).")] = None,
    test: Annotated[Optional[Path], typer.Option(readable=False,
        help="Clean test records (any format perturb reads) for the task-utility score.")] = None,
    input_format: Annotated[Optional[InputFormat], typer.Option(
        "--format", help="Read ORIGINAL (and PERTURBED) as this format instead of detecting it "
                         "from its content.", show_default=False)] = None,
    test_labels: Annotated[Optional[str], typer.Option(
        metavar="LABELS", help="Labels of --test, in the forms --labels takes (dataset=NAME and "
                               "subfolders refer to --test).")] = None,
    model: Annotated[Model, typer.Option(
        help="Classifier: logistic regression or a small MLP (scikit-learn).")] = Model.logistic,
    sweep: Annotated[bool, typer.Option(
        "--sweep", help="Perturb ORIGINAL in memory for every --eps with TLDP-L, TLDP-G, the "
                        "Laplace and Gaussian baselines, MVG (matrix-shaped records), IDN and, "
                        "with --budget record, privunit; write a table and plots to --out.")] = False,
    eps: Annotated[Optional[str], typer.Option(
        "--eps", metavar="E1,E2,...", help="--sweep: the epsilons (see --budget).")] = None,
    methods: Annotated[Optional[str], typer.Option(
        "--methods", metavar="M1,M2,...",
        help="--sweep: only these methods, by their table names (TLDP-L, TLDP-G, Laplace, Gaussian, "
             "MVG, IDN, TLDP-L-w, TLDP-G-w, privunit). Default: every one that applies.",
        show_default=False)] = None,
    out: Annotated[Optional[Path], typer.Option(readable=False,
        help="--sweep: folder for sweep.csv, sweep.json and the PNG plots.")] = None,
    value_range: Annotated[Optional[str], typer.Option(
        "--range", metavar="LO:HI", help="--sweep: declared value range, as for perturb.")] = None,
    weights: Annotated[Optional[Path], typer.Option(readable=False,
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
    quiet: Quiet = False,
    debug: Debug = False,
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
    from tldp_cli.run.pipeline import parse_range

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
            advance, close = progress_bar(quiet, "run")
            try:
                result = ev.sweep(original, epsilons, labels=labels, test=test, test_labels=test_labels,
                                  model=model.value, value_range=rng_range, weights=weights,
                                  budget=budget.value, seed=resolve_seed(seed, seed_file, quiet),
                                  allow_weak_seed=allow_weak_seed, rng=rng.value, dp_delta=dp_delta,
                                  dataset=dataset, progress=advance,
                                  input_format=input_format and input_format.value, repeats=repeat,
                                  named=ev.parse_methods(methods) if methods else None)
            finally:
                close()
            return result, ev.write_sweep(result, out, overwrite)
        if perturbed is None:
            raise UsageError("give ORIGINAL PERTURBED, or ORIGINAL --sweep")
        for name, given in (("--eps", eps), ("--out", out), ("--range", value_range),
                            ("--weights", weights), ("--seed", seed), ("--seed-file", seed_file),
                            ("--dataset", dataset), ("--repeat", None if repeat == 1 else repeat),
                            ("--methods", methods)):
            if given is not None:
                raise UsageError(f"{name} applies to --sweep only")
        if per_record and not (json_out or report_path):
            raise UsageError("--per-record adds per-record lists to the JSON report; give --json or "
                             "--report PATH")
        if report_path is not None and os.path.lexists(report_path) and not overwrite:
            raise ev.OutputError(f"{report_path}: exists; pass --overwrite to replace it")
        advance, close = progress_bar(quiet, "rec")
        try:
            report = ev.evaluate(original, perturbed, manifest, labels=labels, test=test,
                                 test_labels=test_labels, model=model.value, progress=advance,
                                 per_record=per_record, name_map=name_map,
                                 input_format=input_format and input_format.value)
        finally:
            close()
        emit_json(report, json_out, report_path, overwrite)
        return report, None

    result, written = run(debug, action)
    if sweep:
        if not quiet:
            _print_sweep(result, written)
        run(debug, lambda: emit_json(result, json_out, report_path, overwrite))
        return
    if not quiet:
        _print_report(result)
    failed = [c["check"] for c in result["checks"] if c["passed"] is False]
    if failed:
        shown = ([] if quiet else ["the table"]) + ([str(report_path)] if report_path else [])
        fail(f"{result['perturbed']}: failed {', '.join(failed)}"
             + (f" (see {' and '.join(shown)})" if shown else " (run without -q for the table)"), 1)
    if not quiet:
        typer.echo("tldp: every check passed", err=True)


