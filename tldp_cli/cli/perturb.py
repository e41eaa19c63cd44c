"""`tldp perturb`."""

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from tldp_cli.cli.options import AnonymizeNames, CopyOther, SkipBad, given, InputFormatOption, Eps, NoiseOption, SamplerOption, MechanismOption, BudgetOption, Ranges, DpDelta, Granularity, Datasets, Exclude, Keep, Clip, DtypeOption, ImageFormatOption, AllowRawRelease, PublicMissing, RngOption, Quiet, Debug, AllowWeakSeed, ImageFormat, Mechanism, OutDtype, RngKind, Sampler, Scheduler, SeedFile, resolve_seed, BasisOption, ReferenceOption, Store, StoreOption, Verbose, input_paths, perturb_options, data_path, file_path, list_path, output_path, output_text
from tldp_cli.errors import UsageError
from tldp_cli.cli.summary import guarantee_line
from tldp_cli.files.output import uninterruptible
if TYPE_CHECKING:
    from tldp_cli.run.options import PerturbOptions

from tldp_cli.cli.app import (Display, app, debugging, fail, failure, kept_signals, library_warnings,
                              records_phrase, reference_hint, reference_note, run, sigterm_interrupts,
                              unperturbed_note)


@app.command("perturb", no_args_is_help=True)
def perturb_command(
    ctx: typer.Context,
    eps: Eps,
    inputs: Annotated[Optional[list[Path]], typer.Argument(parser=data_path,
        metavar="INPUT...",
        help="A .npy file, an HDF5 file, a Zarr store, a folder of images, a NIfTI volume, WebDataset "
             "shards (a folder of .tar files, one .tar, or a quoted brace pattern such as "
             "'shards/train-{000000..000009}.tar'), a table (.parquet, .arrow, a Hugging Face dataset "
             "folder; each row is one record) or a model-parameter file (.npz, .safetensors, "
             "a save_pretrained folder; each tensor is one record) (detected). Several: each is "
             "its own run, with its own output and manifest.",
                                          show_default=False)] = None,
    noise: NoiseOption = None,
    sampler: SamplerOption = Sampler.exact,
    mechanism: MechanismOption = Mechanism.tldp,
    budget: BudgetOption = None,
    basis: BasisOption = None,
    reference: ReferenceOption = None,
    store: StoreOption = Store.records,
    value_range: Ranges = None,
    weights: Annotated[Optional[Path], typer.Option(parser=data_path, metavar="PATH",
        help="Weight mask .npy in [0, 1] (weighted TLDP; not with mvg or idn): the record's "
             "shape, its spatial shape, or one mask per record; for a folder of images, a folder "
             "of mask PNGs (see tldp weight-mask).")] = None,
    out: Annotated[Optional[str], typer.Option(
        parser=output_text, metavar="PATH",
        help="The output, in the input's format. Default: a sibling, digits.npy -> "
             "digits.tldp.npy (an array inside a Zarr store: beside the store). A folder "
             "(an existing one for file outputs, or any PATH ending in '/') means: inside it, "
             "under the default name; tldp makes no folders, so it must exist. With several inputs (or --inputs-from): the existing "
             "folder every output goes in, under its default name.", show_default=False)] = None,
    inputs_from: Annotated[Optional[Path], typer.Option(
        "--inputs-from", parser=list_path, metavar="FILE",
        help="Also perturb the inputs listed in FILE, one path per line ('-': read the list from "
             "standard input), each its own run as for several INPUTs: one line per failed input, "
             "exit 1 if any failed; nothing is left of a failed one.", show_default=False)] = None,
    manifest: Annotated[Optional[str], typer.Option(  # text: a trailing '/' is refused, not dropped
        parser=output_text, metavar="PATH", help="Manifest path. Default: OUTPUT.manifest.json.", show_default=False)] = None,
    seed: Annotated[Optional[str], typer.Option(
        metavar="HEX",
        help="Make the run reproducible with this seed: a secret key of at least 32 hex digits "
             "(tldp seed makes one). Anyone who has it can remove the noise. It is never "
             "written anywhere, but other users can read a command line: prefer --seed-file or "
             "$TLDP_SEED (give one of the three). The same seed on another input of the same shape "
             "gives the same noise: use a seed for one release only.", show_default=False)] = None,
    seed_file: SeedFile = None,
    allow_weak_seed: AllowWeakSeed = False,
    rng: RngOption = RngKind.secure,
    dtype: DtypeOption = OutDtype.float32,
    granularity: Granularity = None,
    dp_delta: DpDelta = 1e-5,
    dataset: Datasets = None,
    exclude: Exclude = None,
    keep: Keep = None,
    input_format: InputFormatOption = None,
    image_format: ImageFormatOption = ImageFormat.png,
    copy_other: CopyOther = False,
    skip_bad: SkipBad = False,
    anonymize_names: AnonymizeNames = False,
    name_map: Annotated[Optional[Path], typer.Option(parser=output_path,
        metavar="PATH",
        help="With --anonymize-names: where to write the name map (original -> new names, skipped "
             "files). Keep it with the raw data; never inside the output. Default: "
             "INPUT.name-map.json beside the input (folder or shard).", show_default=False)] = None,
    clip_input: Annotated[bool, typer.Option(
        help="Clip input values outside --range into it (recorded in the manifest) "
             "instead of refusing.")] = False,
    clip: Clip = None,
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
    allow_raw_release: AllowRawRelease = False,
    public_missing: PublicMissing = False,
    ledger: Annotated[Optional[Path], typer.Option(parser=file_path,
        metavar="PATH", envvar="TLDP_LEDGER",
        help="A release ledger (SQLite, created if missing; or TLDP_LEDGER): charges this "
             "release to every subject (record) it touches, known by their content, and states "
             "what the most-spent of them has spent over all releases. Keep it with the raw data, "
             "never with the release.", show_default=False)] = None,
    max_record_eps: Annotated[Optional[float], typer.Option(
        metavar="E", help="With --ledger: refuse (exit 1, nothing written or recorded) a release "
                          "that would take any subject it touches past E per record over all "
                          "the releases charged to it.",
        show_default=False)] = None,
    max_record_delta: Annotated[Optional[float], typer.Option(
        metavar="D", help="With --ledger: the same cap for delta per record.", show_default=False)] = None,
    overwrite: Annotated[bool, typer.Option(
        help="Replace an existing output and manifest, once the new ones are complete (a folder "
             "only if it is an earlier output of the same kind).")] = False,
    preview: Annotated[Optional[Path], typer.Option(parser=output_path,
        metavar="FILE.png",
        help="Also write a before/after strip: the first few raw records over their perturbed "
             "copies as written. It shows raw records: keep it with the raw data, never publish "
             "it or put it in the output.", show_default=False)] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print the manifest to stdout.")] = False,
    quiet: Quiet = False,
    verbose: Verbose = False,
    block_elements: Annotated[Optional[int], typer.Option(min=1, hidden=True,
                                                          help="Elements per block (tests, benchmarks).")
                              ] = None,
    debug: Debug = False,
):
    """Perturb every record of INPUT with TLDP and write a privacy manifest.

    \b
    Examples:
      tldp perturb sample_data/digits.npy --eps 1
      tldp perturb sample_data/digits.npy --eps 1 --noise gaussian --out noisy.npy
      tldp perturb features.npy --eps 1 --range -1:1 --json > manifest.json
      tldp perturb sample_data/digits.npy --eps 8 --budget record --out record.npy
      tldp perturb sample_data/digits.npy --mechanism privunit --eps 4 --out privunit.npy
      tldp perturb sample_data/digits.npy --mechanism privunit --eps 4 --store coefficients \\
          --out coefficients.npy
      tldp perturb sample_data/digits.npy --eps 1 --mechanism mvg --sampler float --out mvg.npy
      tldp perturb sample_data/digits.npy --eps 1 --noise discrete-laplace --out discrete.npy
      tldp perturb sample_data/digits.npy --eps 1 --seed-file release-1.seed --out release-1.npy
      tldp perturb docs/type3/model.safetensors --eps 1 --clip 0.1
      mkdir released && tldp perturb day1.npy day2.npy photos/ --eps 1 --out released/
      find raw -name '*.npy' | tldp perturb --inputs-from - --eps 1

    The summary line states the certified guarantee per element and per record:
    TLDP's eps is a per-element budget, so a record of I elements gets I*eps.
    --mechanism privunit is record-level: --eps is what each whole record gets
    (pure), and an element is covered by its record's figure.
    In a model file (.npz, .safetensors) each tensor is a record, and the line
    adds the whole file, all its tensors composed.
    """
    # The library is imported here, not at the top: --help, completion and usage errors
    # stay quick (tests/cli/test_startup.py).
    from tldp_cli.run.options import BLOCK_ELEMENTS, checked_input

    asked_dtype = dtype.value if given(ctx, "dtype") else None  # None: the default, not asked for
    debug = debugging(debug)
    paths = run(debug, lambda: _inputs(inputs, inputs_from, quiet, verbose))

    def options() -> "PerturbOptions":
        return perturb_options(
            paths[0], value_range, eps=eps, mechanism=mechanism, noise=noise, budget=budget,
            weights=weights, out=out, manifest=manifest, seed=resolve_seed(seed, seed_file),
            seed_file=seed_file, allow_weak_seed=allow_weak_seed, rng=rng,
            dtype=asked_dtype, granularity=granularity, dp_delta=dp_delta, overwrite=overwrite,
            clip_input=clip_input, clip=clip, workers=workers or os.cpu_count() or 1,
            datasets=dataset, exclude=exclude, keep=keep, input_format=input_format, image_format=image_format,
            copy_other=copy_other, skip_bad=skip_bad, anonymize_names=anonymize_names, name_map=name_map,
            scheduler=scheduler, dask_address=dask_address, dask_logs=debug, resume=resume,
            allow_raw_release=allow_raw_release, public_missing=public_missing,
            ledger=ledger, max_record_eps=max_record_eps, max_record_delta=max_record_delta,
            sampler=sampler, basis=basis, reference=reference, store=store, block_elements=block_elements or BLOCK_ELEMENTS)

    display = Display(quiet, verbose)
    if len(paths) > 1 or inputs_from is not None:
        if preview is not None:
            fail("--preview shows one input's records; give it with one INPUT", 2)
        raise typer.Exit(_perturb_several(run(debug, options), paths, display, quiet, json_out, debug))

    def action():
        _check_preview(preview, out, overwrite, paths[0],
                       {"weights": weights, "seed file": seed_file, "ledger": ledger, "name map": name_map,
                        "manifest": manifest if manifest and not manifest.endswith(("/", os.sep)) else None})
        run_options = options()
        checked_input(run_options)  # the run's first refusals, before the pipeline (NumPy) is imported
        from tldp_cli.run.pipeline import perturb

        try:
            with sigterm_interrupts():
                return perturb(run_options, progress=display.advance, phase=display.phase)
        finally:
            display.close()

    result = run(debug, action)
    with uninterruptible():  # the output is in place: Ctrl-C while it is reported changes nothing
        _report(result, quiet, json_out)
    if preview is not None:
        run(debug, lambda: _write_preview(preview, paths[0], result, name_map, input_format, overwrite, quiet))


def _inputs(inputs: list[Path] | None, inputs_from: Path | None, quiet: bool, verbose: bool) -> list[Path]:
    """INPUT... then the paths --inputs-from lists."""
    if quiet and verbose:
        raise UsageError("give -q (no progress or summaries) or -v (say what each phase does), not both")
    return input_paths(inputs, inputs_from)


def _perturb_several(options: "PerturbOptions", paths: list[Path], display: Display, quiet: bool,
                     json_out: bool, debug: bool) -> int:
    """Each input its own run, reported as it ends (an error: one line naming it); exit 1
    if any failed. --json prints the manifests written, as one JSON list."""
    from tldp_cli.formats import plural
    from tldp_cli.run import batch

    each = run(debug, lambda: batch.prepare(options, paths))
    failed, manifests = [], []
    current: list[tuple[int, Path]] = []  # the input under way, and its index

    def start(i: int, options: "PerturbOptions") -> None:
        current[:] = [(i, options.input)]
        display.prefix, display.name = f"[{i + 1}/{len(each)}] ", f"{options.input}: "

    with kept_signals() as restore, sigterm_interrupts(), library_warnings(debug):
        try:
            for outcome in batch.perturb_each(each, display.advance, display.phase, start):
                display.close()
                if outcome.result is not None:
                    with uninterruptible():
                        _report(outcome.result, quiet, False)
                    manifests.append(outcome.result.manifest)
                else:
                    assert outcome.error is not None  # a run ends with its result or its error
                    failed.append(outcome.input)
                    message = failure(outcome.error, debug)[0]
                    message = message if str(outcome.input) in message else f"{outcome.input}: {message}"
                    typer.echo("tldp: error: " + " ".join(message.split()), err=True)
                restore()  # the next input is a run of its own: Ctrl-C stops it again
        except KeyboardInterrupt as exc:
            display.close()
            i, where = current[0]
            written = [o.input for o in each[:i] if o.input not in failed]
            later = [o.input for o in each[i + 1:]]
            fail(f"{where}: {str(exc) or 'interrupted; nothing was written'} ({plural(len(written), 'input')} "
                 f"before it written{_named(written)}, {plural(len(later), 'input')} after it not "
                 f"started{_named(later)})", 130)
    if json_out:
        typer.echo(json.dumps(manifests, indent=2))
    if not quiet:
        typer.echo(f"tldp: {len(each) - len(failed)} of {plural(len(each), 'input')} written"
                   + (f"; failed: {', '.join(map(str, failed))}" if failed else ""), err=True)
    return 1 if failed else 0


def _named(paths: list[Path]) -> str:
    """": a.npy, b.npy" (a few, then how many more), or nothing for none."""
    from tldp_cli.formats import listing

    return f": {listing([str(p) for p in paths])}" if paths else ""


def _check_preview(preview: Path | None, out: str | None, overwrite: bool, source: Path,
                   reads: dict[str, Path | None]) -> None:
    """--preview, before the run: a .png path in an existing folder, outside --out and the
    input, not a file the run reads or writes (`reads`), new unless --overwrite."""
    from tldp_cli.files import output

    if preview is None:
        return
    if preview.suffix.lower() != ".png":
        raise UsageError(f"--preview {preview}: give a .png file name")
    if not preview.parent.is_dir():
        raise UsageError(f"--preview {preview}: folder {preview.parent} does not exist")
    if preview.exists() and not overwrite:
        raise UsageError(f"--preview {preview}: exists; pass --overwrite to replace it")
    output.check_destination(preview, source, overwrite, "preview", folder=False)  # not the input
    output.check_distinct({"preview": preview, **{what: Path(p) for what, p in reads.items() if p is not None}})
    if out is not None and _inside(preview, Path(out)):
        raise UsageError(f"--preview {preview}: inside the output {out}; it shows raw records, "
                         "keep it with the raw data")


def _inside(path: Path, folder: Path) -> bool:
    path, folder = path.resolve(), folder.resolve()
    return path == folder or folder in path.parents


def _write_preview(preview: Path, input: Path, result, name_map, input_format, overwrite: bool,
                   quiet: bool) -> None:
    from tldp_cli import evaluate
    from tldp_cli.files.output import write_files

    if result.output.is_dir() and _inside(preview, result.output):
        raise UsageError(f"--preview {preview}: inside the output {result.output}; it shows raw "
                         "records, keep it with the raw data")
    png = evaluate.preview(input, result.output, result.manifest_path, name_map=name_map,
                           input_format=input_format and input_format.value)
    write_files({preview: png}, overwrite, private=True)  # raw records: its owner's only
    if not quiet:
        typer.echo(f"tldp: wrote the preview {preview} (raw records: keep it with the raw data, "
                   "never publish it)", err=True)


def _report(result, quiet: bool, json_out: bool) -> None:
    m = result.manifest
    if not quiet:
        for message in result.messages:
            typer.echo(f"tldp: {message}", err=True)
        stored = m.get("privunit", {}).get("stored")
        what = f"; stored as {m['privunit']['k']} {stored['dtype']} coefficients each" if stored else ""
        typer.echo(f"tldp: wrote {result.output} ({records_phrase(m)}{what}{unperturbed_note(m)}"
                   f"{reference_hint(m)}) and {result.manifest_path}", err=True)
        if (note := reference_note(m)) is not None:
            typer.echo(f"tldp: {note}", err=True)
        ranges = len(m.get("range_groups", []))
        typer.echo("tldp: " + guarantee_line(m["accounting"], m["noise"], ranges), err=True)
    if json_out:
        typer.echo(json.dumps(m, indent=2))


