"""`tldp sweep` (and `tldp evaluate --sweep`, its deprecated alias)."""

from pathlib import Path
from typing import Annotated, Optional

import typer

from tldp_cli.cli.options import (AllowWeakSeed, ReferenceOption, Budget, Debug, InputFormat, Labels, Model, ModelOption, Quiet,
                                  RngKind, SeedFile, TestLabels, TestRecords, data_path, output_path, resolve_seed)
from tldp_cli.errors import UsageError
from tldp_cli.cli.app import app, debugging, deprecated_flag, emit_json, progress_bar, run, shown


def _print_sweep(result: dict, written: list) -> None:
    echo = lambda text="": typer.echo(text, err=True)  # noqa: E731
    ref = result["reference"]
    echo(f"  {'method':<10}{'eps':>8}{'record eps':>12}{'mean ||Z||':>12}{'F1':>8}")
    for row in result["rows"]:
        echo(f"  {row['method']:<10}{row['epsilon']:>8g}{row['record_epsilon']:>12.4g}"
             f"{row['mean_l2_error']:>12.4g}{shown(row['f1'], '.3f'):>8}")
    if ref:
        echo(f"  clean training data: F1 {ref['f1_clean']:.3f} ({ref['model']}); "
             f"majority class {ref['f1_majority_class']:.3f}")
    for skipped in result.get("skipped_methods", []):
        echo(f"  {skipped['method']} skipped: {skipped['reason']}")
    echo("tldp: wrote " + ", ".join(str(p) for p in written))
    echo(f"tldp: these files are {result['sensitive'].replace('keep it', 'keep them')}")


@app.command("sweep", no_args_is_help=True)
def sweep_command(
    original: Annotated[Path, typer.Argument(parser=data_path, metavar="ORIGINAL",
        help="The data to perturb in memory: one array (a .npy file, an array of an HDF5 file or "
        "Zarr store chosen with --dataset, a table's column) or a folder of images of one shape.",
        show_default=False)],
    eps: Annotated[str, typer.Option(
        "--eps", metavar="E1,E2,...", help="The epsilons (see --budget).", show_default=False)],
    out: Annotated[Path, typer.Option(parser=output_path, metavar="PATH",
        help="Folder for sweep.csv, sweep.json and the PNG plots.", show_default=False)],
    methods: Annotated[Optional[str], typer.Option(
        "--methods", metavar="M1,M2,...",
        help="Only these methods, by their table names (TLDP-L, TLDP-G, Laplace, Gaussian, "
             "MVG, IDN, TLDP-L-w, TLDP-G-w, privunit). Default: every one that applies.",
        show_default=False)] = None,
    value_range: Annotated[Optional[str], typer.Option(
        "--range", metavar="LO:HI", help="Declared value range, as for perturb.")] = None,
    weights: Annotated[Optional[Path], typer.Option(parser=data_path, metavar="PATH",
        help="Weight mask .npy; adds weighted TLDP (TLDP-L-w, TLDP-G-w).")] = None,
    budget: Annotated[Budget, typer.Option(help="As for perturb; privunit needs record.")] = Budget.element,
    reference: ReferenceOption = None,
    repeat: Annotated[int, typer.Option(
        metavar="N", help="Perturb and score every point N times with independent noise; "
                          "the table gives the mean and F1's standard deviation, min and max.")] = 1,
    seed: Annotated[Optional[str], typer.Option(
        metavar="HEX", help="Make the noise reproducible with this secret key, as for "
                            "perturb (or --seed-file, $TLDP_SEED).", show_default=False)] = None,
    seed_file: SeedFile = None,
    allow_weak_seed: AllowWeakSeed = False,
    rng: Annotated[RngKind, typer.Option(help="As for perturb.")] = RngKind.secure,
    dp_delta: Annotated[float, typer.Option(help="delta of the (eps, delta) figures.")] = 1e-5,
    dataset: Annotated[Optional[str], typer.Option(
        metavar="PATH", help="The HDF5/Zarr array to use when there are several.")] = None,
    labels: Labels = None,
    test: TestRecords = None,
    test_labels: TestLabels = None,
    model: ModelOption = Model.logistic,
    input_format: Annotated[Optional[InputFormat], typer.Option(
        "--format", help="Read ORIGINAL as this format instead of detecting it from its content.",
        show_default=False)] = None,
    json_out: Annotated[bool, typer.Option(
        "--json", help="Print the table as JSON to stdout. Computed from the raw data: keep it "
                       "with them, never with the release.")] = False,
    report_path: Annotated[Optional[Path], typer.Option(
        "--report", parser=output_path, metavar="PATH", help="Write the JSON table to PATH too (as --json "
                                                         "prints it). Both are readable by their owner only.",
        show_default=False)] = None,
    overwrite: Annotated[bool, typer.Option(help="Replace existing sweep files (and --report).")] = False,
    quiet: Quiet = False,
    debug: Debug = False,
):
    """Perturb ORIGINAL in memory for every --eps and measure error and F1.

    Methods: TLDP-L, TLDP-G, the Laplace and Gaussian baselines, MVG (matrix-shaped
    records), IDN, weighted TLDP with --weights and, with --budget record, privunit.
    Writes sweep.csv, sweep.json and two plots (against the nominal and the certified
    per-record eps) to --out. Nothing is written beside ORIGINAL.

    \b
    Examples:
      tldp sweep sample_data/digits.npy --eps 0.1,0.5,1,2,5,10 --out sweep/
      tldp sweep sample_data/digits.npy --eps 0.1,0.5,1,2,5,10 --seed 0 --allow-weak-seed \\
          --labels sample_data/digits_labels.npy --test sample_data/digits_test.npy \\
          --test-labels sample_data/digits_test_labels.npy --out sweep-f1/

    The tables are computed from the raw data: keep them with it, never with the release.
    """
    debug = debugging(debug)
    from tldp_cli import evaluate as ev
    from tldp_cli.run.options import parse_range

    def action():
        from tldp_cli.evaluate.utility import need
        from tldp_cli.files.output import check_file_target, check_outside_inputs

        need("matplotlib", load=False)  # the plots write_sweep draws: refused before the sweep, not after it
        epsilons = ev.parse_eps_list(eps)
        rng_range = parse_range(value_range) if value_range else None
        if not 0 < dp_delta < 1:
            raise UsageError(f"--dp-delta must lie in (0, 1), not {dp_delta}")
        named = ev.parse_methods(methods) if methods else None
        reads = [p for p in (original, weights, test, seed_file, *(Path(t) for t in (labels, test_labels) if t))
                 if p is not None]
        # before the sweep, not once its tables are written: complete or absent
        for path in (out / name for name in ev.SWEEP_FILES):
            check_outside_inputs(path, reads, "sweep table")
            check_file_target(path, overwrite, folder_made=True)  # write_sweep makes --out
        if report_path is not None:
            check_outside_inputs(report_path, reads, "report")
            check_file_target(report_path, overwrite)
        advance, close = progress_bar(quiet, "sweeping", "runs")
        try:
            result = ev.sweep(original, epsilons, labels=labels, test=test, test_labels=test_labels,
                              model=model.value, value_range=rng_range, weights=weights,
                              budget=budget.value, seed=resolve_seed(seed, seed_file),
                              allow_weak_seed=allow_weak_seed, rng=rng.value, dp_delta=dp_delta,
                              dataset=dataset, progress=advance,
                              input_format=input_format and input_format.value, repeats=repeat,
                              named=named, reference=reference)
        finally:
            close()
        return result, ev.write_sweep(result, out, overwrite)

    result, written = run(debug, action)
    if not quiet:
        _print_sweep(result, written)
    run(debug, lambda: emit_json(result, json_out, report_path, overwrite))


deprecated_flag("evaluate", "--sweep", "sweep")
