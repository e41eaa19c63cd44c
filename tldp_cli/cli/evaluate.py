"""`tldp evaluate`."""

import os
from pathlib import Path
from typing import Annotated, Optional

import typer

from tldp_cli.cli.options import (Debug, InputFormat, Labels, Model, ModelOption, Quiet, TestLabels, TestRecords,
                                  data_path, file_path, output_path)
from tldp_cli.errors import UsageError
from tldp_cli.cli.app import app, debugging, emit_json, fail, progress_bar, run, shown


def _row_records(report: dict) -> str:
    """Where arrays share their rows, the certified figure is a row's (of several arrays),
    not one of the records measured: say so."""
    rows = report.get("row_records")
    if not rows:
        return ""
    return (f", a record being one row of each array that shares it: {rows['records']} of up to "
            f"{rows['elements_per_record']} elements")


def _print_report(report: dict) -> None:
    echo = lambda text="": typer.echo(text, err=True)  # noqa: E731
    acc = report["accounting"]
    echo(f"tldp: {report['perturbed']} against {report['original']} ({report['format']}, "
         f"{report['records']} records {'of up to' if report.get('record_sizes', 1) > 1 else 'x'} "
         f"{report['elements_per_record']} elements; "
         f"{' '.join(dict.fromkeys((report['mechanism'], report['noise'])))}, {report['epsilon_scope']}; "
         f"certified per record eps={shown(acc['per_record']['epsilon'])}{_row_records(report)})")
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
            echo(f"  {label:<20}{shown(s['mean']):>11}{shown(s['median']):>11}{shown(s['max']):>11}")
    utility = report.get("utility")
    if utility:
        echo(f"  weighted F1 ({utility['model']}): trained on perturbed {utility['f1_perturbed']:.3f}, "
             f"on clean {utility['f1_clean']:.3f}, majority class {utility['f1_majority_class']:.3f}")


@app.command("evaluate", no_args_is_help=True)
def evaluate_command(
    original: Annotated[Path, typer.Argument(parser=data_path, metavar="ORIGINAL", help="The data that was perturbed (any format perturb reads).",
                                             show_default=False)],
    perturbed: Annotated[Path, typer.Argument(parser=data_path,
        metavar="PERTURBED", help="perturb's output.", show_default=False)],
    manifest: Annotated[Optional[Path], typer.Option(parser=file_path, metavar="PATH",
        help="The privacy manifest. Default: PERTURBED.manifest.json.")] = None,
    json_out: Annotated[bool, typer.Option(
        "--json", help="Print every number as JSON to stdout. Computed from the raw data: keep it "
                       "with them, never with the release.")] = False,
    report_path: Annotated[Optional[Path], typer.Option(
        "--report", parser=output_path, metavar="PATH",
        help="Write the JSON report to PATH (as --json prints it), readable by its owner only.",
        show_default=False)] = None,
    per_record: Annotated[bool, typer.Option(
        "--per-record", help="Add each record's MSE, MAE, relative L2 and ||Z|| (PSNR, SSIM) to "
                             "the JSON report; together they give each record's exact norm. "
                             "Default: only their mean, median, min and max.")] = False,
    name_map: Annotated[Optional[Path], typer.Option(parser=file_path,
        metavar="PATH", help="The name map of a perturb --anonymize-names run, which pairs each "
                             "image with its perturbed copy. Default: ORIGINAL.name-map.json.",
        show_default=False)] = None,
    labels: Labels = None,
    test: TestRecords = None,
    input_format: Annotated[Optional[InputFormat], typer.Option(
        "--format", help="Read ORIGINAL (and PERTURBED) as this format instead of detecting it "
                         "from its content.", show_default=False)] = None,
    test_labels: TestLabels = None,
    model: ModelOption = Model.logistic,
    basis: Annotated[Optional[Path], typer.Option(
        "--basis", parser=data_path, metavar="FILE.npy",
        help="The user basis of a --mechanism privunit --basis FILE.npy run, which the manifest "
             "names (privunit.basis.path, as perturb was given it) but does not hold; its sha256 "
             "must be the manifest's. Default: that path, or, if it is relative and not found, "
             "that path beside the manifest.", show_default=False)] = None,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing --report file.")] = False,
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

    Integrity (exit 1 on a mismatch): the outputs' sha256, shapes and record counts,
    and the manifest's scale, p and certified figures recomputed from its mechanism.
    Noise: per-record MSE, MAE, relative L2 (PSNR and SSIM for images), the noise norm
    against Table 5, the retained fraction against p and a test of the noise's
    distribution (chi-square for the discrete noises, Kolmogorov-Smirnov for --sampler
    float); these fail only at p < 1e-6 and are skipped for rounded and clipped (8-bit)
    output.

    Reports are computed from the raw data: keep them with it, never with the release.
    Per-record figures go into --json only with --per-record. Sweeps over epsilons are
    `tldp sweep` (`tldp evaluate --sweep` is its deprecated alias).
    """
    debug = debugging(debug)
    from tldp_cli import evaluate as ev

    def action():
        if per_record and not (json_out or report_path):
            raise UsageError("--per-record adds per-record lists to the JSON report; give --json or "
                             "--report PATH")
        if report_path is not None:
            from tldp_cli.files.output import check_outside_inputs
            from tldp_cli.run.manifest import default_path

            reads = [original, perturbed, manifest or default_path(perturbed),
                     name_map or original.with_name(original.name + ".name-map.json"), basis, test,
                     *(Path(text) for text in (labels, test_labels) if text)]
            check_outside_inputs(report_path, [p for p in reads if p is not None], "report")
        if report_path is not None and os.path.lexists(report_path) and not overwrite:
            raise ev.OutputError(f"{report_path}: exists; pass --overwrite to replace it")
        advance, close = progress_bar(quiet, "evaluating", "records")
        try:
            report = ev.evaluate(original, perturbed, manifest, labels=labels, test=test,
                                 test_labels=test_labels, model=model.value, progress=advance,
                                 per_record=per_record, name_map=name_map,
                                 input_format=input_format and input_format.value, basis=basis)
        finally:
            close()
        emit_json(report, json_out, report_path, overwrite)
        return report

    result = run(debug, action)
    if not quiet:
        _print_report(result)
    failed = [c["check"] for c in result["checks"] if c["passed"] is False]
    if failed:
        where = ([] if quiet else ["the table"]) + ([str(report_path)] if report_path else [])
        fail(f"{result['perturbed']}: failed {', '.join(failed)}"
             + (f" (see {' and '.join(where)})" if where else " (run without -q for the table)"), 1)
    if not quiet:
        typer.echo("tldp: every check passed", err=True)


