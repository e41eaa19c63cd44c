"""`tldp plan`."""

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from tldp_cli.cli.options import AnonymizeNames, CopyOther, SkipBad, given, InputFormatOption, OptionalEps, NoiseOption, SamplerOption, MechanismOption, BudgetOption, Ranges, DpDelta, Granularity, Datasets, Exclude, Keep, Clip, DtypeOption, ImageFormatOption, AllowRawRelease, PublicMissing, Quiet, Debug, ImageFormat, Mechanism, OutDtype, Sampler, BasisOption, ReferenceOption, Store, StoreOption, Verbose, data_path, input_paths, list_path, perturb_options
from tldp_cli.errors import UsageError
from tldp_cli.cli.summary import guarantee_line
if TYPE_CHECKING:
    from tldp_cli.run.options import PerturbOptions

from tldp_cli.cli.app import (Display, app, debugging, failure, library_warnings, privunit_phrase, records_phrase,
                              reference_note, run, unperturbed_note)


@app.command("plan", no_args_is_help=True)
def plan_command(
    ctx: typer.Context,
    inputs: Annotated[Optional[list[Path]], typer.Argument(parser=data_path,
        metavar="[INPUT]...", help="The input perturb would read (headers only; several: each "
                                   "planned in turn); or describe the records with --elements "
                                   "instead.", show_default=False)] = None,
    eps: OptionalEps = None,
    noise: NoiseOption = None,
    sampler: SamplerOption = Sampler.exact,
    mechanism: MechanismOption = Mechanism.tldp,
    budget: BudgetOption = None,
    basis: BasisOption = None,
    reference: ReferenceOption = None,
    store: StoreOption = Store.records,
    value_range: Ranges = None,
    dp_delta: DpDelta = 1e-5,
    granularity: Granularity = None,
    dataset: Datasets = None,
    exclude: Exclude = None,
    keep: Keep = None,
    clip: Clip = None,
    dtype: DtypeOption = OutDtype.float32,
    input_format: InputFormatOption = None,
    image_format: ImageFormatOption = ImageFormat.png,
    allow_raw_release: AllowRawRelease = False,
    public_missing: PublicMissing = False,
    anonymize_names: AnonymizeNames = False,
    copy_other: CopyOther = False,
    skip_bad: SkipBad = False,
    elements: Annotated[Optional[str], typer.Option(
        "--elements", "--shape", metavar="I", help="Without INPUT: elements per record, or the "
                                                   "record's shape (28x28).", show_default=False)] = None,
    records: Annotated[int, typer.Option(help="Without INPUT: the number of records.")] = 1,
    input_dtype: Annotated[Optional[str], typer.Option(
        metavar="DTYPE", help="Without INPUT: the data's dtype (uint8, float32, ...). Default: "
                              "integers when --range has integer ends, else float64.",
        show_default=False)] = None,
    inputs_from: Annotated[Optional[Path], typer.Option(
        "--inputs-from", parser=list_path, metavar="FILE",
        help="Also plan the inputs listed in FILE, one path per line ('-': read the list from "
             "standard input), each in turn as for several INPUTs.", show_default=False)] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print the plan as JSON to stdout.")] = False,
    quiet: Quiet = False,
    verbose: Verbose = False,
    debug: Debug = False,
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
      tldp plan sample_data/digits.npy --mechanism privunit --eps 4
      tldp plan day1.npy day2.npy photos/ --eps 1
      find raw -name '*.npy' | tldp plan --inputs-from - --eps 1 --json

    With several inputs, each is planned in turn (a failed one: one line naming it, exit 1
    at the end) and --json prints the plans as one JSON list.
    """
    from tldp_cli.run.options import DESCRIBED, PerturbOptions, checked_input, checked_options

    asked_dtype = dtype.value if given(ctx, "dtype") else None  # None: the default, not asked for
    debug = debugging(debug)

    display = Display(quiet, verbose)
    paths: list[Path] = []

    def action():
        if eps is None:
            raise UsageError("--eps is required")
        if inputs or inputs_from is not None:
            paths.extend(input_paths(inputs, inputs_from))
        if (not paths) == (elements is None):
            raise UsageError("give INPUT, or --elements to describe the records instead (one of the two)")
        if quiet and verbose:
            raise UsageError("give -q (no progress or summaries) or -v (say what each phase does), not both")
        options = perturb_options(
            paths[0] if paths else Path(DESCRIBED), value_range, eps=eps, mechanism=mechanism,
            noise=noise, sampler=sampler, budget=budget, dtype=asked_dtype, granularity=granularity,
            dp_delta=dp_delta, clip=clip, datasets=dataset, exclude=exclude, keep=keep,
            image_format=image_format, allow_raw_release=allow_raw_release, public_missing=public_missing,
            anonymize_names=anonymize_names, copy_other=copy_other, skip_bad=skip_bad, input_format=input_format,
            basis=basis, reference=reference, store=store)
        if len(paths) > 1 or inputs_from is not None:
            checked_options(options)  # what is wrong with the options is said once, exit 2
            from tldp_cli.run import batch

            batch.check_names([dataclasses.replace(options, input=path) for path in paths])
            return options
        if paths:
            checked_input(options)  # the plan's first refusals, before the pipeline (NumPy) is imported
        from tldp_cli.run import plan

        try:
            if paths:
                return plan.plan_input(options, phase=display.phase)
            from tldp_cli.audit import parse_shape

            return plan.plan_records(options, parse_shape(elements), records, input_dtype)
        finally:
            display.close()

    report = run(debug, action)
    if isinstance(report, PerturbOptions):  # several inputs
        raise typer.Exit(_plan_several(report, paths, display, quiet, json_out, debug))
    _print(report, quiet)
    if json_out:
        typer.echo(json.dumps(report, indent=2, allow_nan=False))


def _plan_several(options: "PerturbOptions", inputs: list[Path], display: Display, quiet: bool,
                  json_out: bool, debug: bool) -> int:
    """Each input planned in turn: its plan, or one line naming it; exit 1 if any failed."""
    from tldp_cli.run import plan

    reports, failed = [], []
    display.prefix = f"[1/{len(inputs)}] "
    with library_warnings(debug):
        for i, (path, report) in enumerate(plan.plan_each(options, inputs, phase=display.phase)):
            display.close()
            display.prefix = f"[{i + 2}/{len(inputs)}] "
            if isinstance(report, Exception):
                failed.append(path)
                message = failure(report, debug)[0]
                message = message if str(path) in message else f"{path}: {message}"
                typer.echo("tldp: error: " + " ".join(message.split()), err=True)
                continue
            if not quiet:
                typer.echo(f"tldp: {path}:", err=True)
            _print(report, quiet)
            reports.append(report)
    if json_out:
        typer.echo(json.dumps(reports, indent=2, allow_nan=False))
    return 1 if failed else 0


def _print(report: dict, quiet: bool) -> None:
    if not quiet:
        for message in report["messages"]:
            typer.echo(f"tldp: {message}", err=True)
        c = report["calibration"]
        if "privunit" in report:
            written = report.get("output_dtype", c["values_dtype"])
            stored = (f"stored as {report['privunit']['k']} {c['values_dtype']} coefficients per record"
                      if "stored" in report["privunit"] else f"values {written}")
            typer.echo(f"tldp: plan: {records_phrase(report)}; {privunit_phrase(report)}, {stored}"
                       f"{unperturbed_note(report)}", err=True)
            if (note := reference_note(report)) is not None:
                typer.echo(f"tldp: {note}", err=True)
        else:
            typer.echo(f"tldp: plan: {records_phrase(report)}; {report['noise']} noise of scale "
                       f"{c['noise_scale']:.4g}, element eps "
                       f"{c['calibration_epsilon']:.4g}, retain probability {c['retain_probability']:.3g}, "
                       f"values {report.get('output_dtype', c['values_dtype'])}{unperturbed_note(report)}",
                       err=True)
        ranges = len(report.get("range_groups", []))
        typer.echo("tldp: " + guarantee_line(report["accounting"], report["noise"], ranges), err=True)
