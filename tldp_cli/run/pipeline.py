"""Streams blocks of records: format reader -> validation -> engine -> format writer,
then moves the finished output and its manifest into place.

Output appears complete or not at all: everything is written under locked work
folders beside the destinations and moved into place together at the end
(output.py); any failure, Ctrl-C included, removes them. The exception is a
resumable output (Zarr, see resume.py): when a run is interrupted its finished
blocks are kept in a hidden sibling for --resume.

Blocks run serially, in threads (--workers) or on Dask (dask_runner.py); the same
per-block function (BlockTask) runs everywhere, and the output does not depend
on which.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from tldp_cli.run import dask_runner, ledger, resume
from tldp_cli.sampling import discrete, engine
from tldp_cli import formats
from tldp_cli.files import output
from tldp_cli.run import manifest as manifest_mod
from tldp_cli.errors import (DataError, InputError, Interrupted, NotHeld, OutOfMemory, OutputError, TldpError,
                              UsageError, reason_of)
from tldp_cli.formats import ArrayJob, FormatOptions, cf, plural
from tldp_cli.privacy.mechanisms import PRIVUNIT, Calibration
from tldp_cli.run import bases as bases_mod
from tldp_cli.sampling.rng import STREAM_UNIT_ELEMENTS, Streams, records_per_unit
from tldp_cli.run.masks import Mask, load_masks, sidecar_path, weights_warning
from tldp_cli.run.calibration import Calibrated, array_where, calibrate_run, missing_fills, range_group_messages
from tldp_cli.run.context import Phase, Progress, Report, RunContext
from tldp_cli.run.options import (  # noqa: F401 (the library's names: pipeline.PerturbOptions, ...)
    BLOCK_ELEMENTS, COEFFICIENTS, STORE_CHOICES, PerturbOptions, checked_input, checked_options, float_dtype)
from tldp_cli.run.run_manifest import build_manifest

# What `--resume` compares (_resume_record; the ledger states it for each release too). Each
# field of PerturbOptions is in exactly one of the three lists below, so a new option is
# decided on, never compared or ignored by default (tests/run/test_resume.py fails until it is).
# Compared as given: they can change the output (block_elements: how its blocks are cut,
# which the journal lists).
RESUME_COMPARED = (
    "eps", "noise", "mechanism", "budget", "value_range", "ranges", "rng", "dtype", "dp_delta", "granularity",
    "clip_input", "clip", "datasets", "exclude", "keep", "input_format", "image_format", "copy_other",
    "skip_bad", "block_elements", "allow_raw_release", "sampler", "anonymize_names", "public_missing", "basis",
    "reference", "store",
)
# Compared in another form: the input by its resolved path, the seed by whether one was given
# (never the seed nor anything derived from it: a hash would confirm guesses of a weak seed),
# the weights by what load_masks states of them.
RESUME_COMPARED_AS = ("input", "seed", "weights")
# Not compared: where the output and its files go, how the blocks are run, whether to resume
# or overwrite, and the ledger's own bookkeeping; none changes the values written.
RESUME_NOT_COMPARED = (
    "out", "manifest", "seed_file", "name_map", "allow_weak_seed", "overwrite", "resume", "workers", "scheduler",
    "dask_address", "dask_logs", "ledger", "max_record_eps", "max_record_delta",
)


@dataclass
class PerturbResult:
    """What tldp_cli.perturb wrote: the output, its manifest's path and the manifest itself,
    and the messages the command prints to stderr (warnings and notes, one line each)."""

    output: Path
    manifest_path: Path
    manifest: dict[str, Any]
    messages: list[str] = field(default_factory=list)


def check_finite(block: np.ndarray, job: ArrayJob, start: int, input_path: Path, *,
                 first_element: int = 0) -> None:
    """Raises, naming the first record and element, if the block holds NaN or Inf
    (`first_element`: a part of record `start` from that element on)."""
    if block.dtype.kind == "f":
        bad = ~np.isfinite(block.reshape(block.shape[0], -1))
        if bad.any():
            record, element = np.argwhere(bad)[0]
            member = formats.member_name(job.source)
            where = f" {member}," if member else ""
            raise DataError(f"{input_path}:{where} NaN or Inf at record {start + record}, "
                            f"element {first_element + element}; tldp needs finite values")


def validate_block(block: np.ndarray, job: ArrayJob, start: int, lo: float, hi: float,
                    input_path: Path, *, first_element: int = 0) -> int:
    """Raises on NaN/Inf; returns how many values lie outside [lo, hi]."""
    check_finite(block, job, start, input_path, first_element=first_element)
    if block.dtype.kind in "iu" and lo <= np.iinfo(block.dtype).min and np.iinfo(block.dtype).max <= hi:
        return 0  # no value of the dtype lies outside (uint8 in 0:256): skip a pass over the data
    if block.size == 0 or (block.min() >= lo and block.max() <= hi):
        return 0  # two fast reductions instead of comparisons, an OR and a count
    return int(np.count_nonzero((block < lo) | (block > hi)))


@dataclass(frozen=True)
class BlockTask:
    """The per-block function: read, validate, perturb, write. A pure function of the
    block's position (streams are keyed by it), so blocks may run anywhere and in any
    order. Picklable for Dask; it carries the stream key, never shown by its repr."""

    calibrations: dict[str, Calibration]  # by job name
    streams: Streams
    masks: dict[str, Mask]
    lo: float
    hi: float
    clip_input: bool
    dtype: np.dtype
    source: Path
    write: Callable[[ArrayJob, int, np.ndarray], object] | None  # None: return the block instead
    grid: discrete.Grid | None = None  # discrete noises: snapped values are clipped into it
    bounds: dict[str, tuple[float, float, discrete.Grid | None]] = field(default_factory=dict)  # (lo, top, grid)
    bases: dict[str, Any] = field(default_factory=dict)  # privunit with a user's basis: by job name
    coefficients: bool = False  # --store coefficients: each record's released (k) coefficients, not the record
    # A record of more elements than part_elements, of an array read in parts (ArrayJob.read_parts),
    # is read, perturbed and written part by part (write_part: Writer.part_writer); None: whole.
    write_part: Callable[[ArrayJob, int, int, np.ndarray], object] | None = None
    part_elements: int = 0

    def __call__(self, job: ArrayJob, start: int, stop: int,
                 count_only: bool = False) -> tuple[int, np.ndarray | None]:
        """(values outside the range, the noisy block if `write` is None). With values
        outside the range, or `count_only` (the run is failing), nothing is perturbed."""
        if self.in_parts(job):
            return self._parts(job, start, stop, count_only)
        lo, hi, grid = self.bounds.get(job.name, (self.lo, self.hi, self.grid))
        block = job.read(start, stop)
        outside = validate_block(block, job, start, lo, hi, self.source)
        if (outside and not self.clip_input) or count_only:
            return (0 if self.clip_input else outside), None
        if self.clip_input:
            block = np.clip(block, lo, hi)
        mask = self.masks.get(job.name)
        weights = None if mask is None else mask.for_block(start, stop)
        noisy = engine.perturb_records(block, start, job.name, self.calibrations[job.name],
                                       self.streams, weights, self.dtype, grid, job.records,
                                       self.bases.get(job.name), self.coefficients)
        if self.write is None:
            return 0, noisy
        self.write(job, start, noisy)
        return 0, None

    def in_parts(self, job: ArrayJob) -> bool:
        """Whether the job's records are perturbed part by part: larger than a part, read and
        written in parts, noised element by element (not privunit, no weight mask)."""
        return (self.write_part is not None and job.read_parts is not None and 0 < self.part_elements < job.elements
                and self.calibrations[job.name].privunit is None and job.name not in self.masks)

    def _parts(self, job: ArrayJob, start: int, stop: int, count_only: bool) -> tuple[int, None]:
        """__call__ on records read, perturbed and written part by part (in_parts): one
        part in memory at a time. Values outside the range stop the perturbing, not the count."""
        assert job.read_parts is not None and self.write_part is not None  # in_parts
        lo, hi, grid = self.bounds.get(job.name, (self.lo, self.hi, self.grid))
        outside = 0
        for record in range(start, stop):
            first = 0
            for part in job.read_parts(record, self.part_elements):
                values = part.reshape(1, -1)
                outside += validate_block(values, job, record, lo, hi, self.source, first_element=first)
                if not (count_only or (outside and not self.clip_input)):
                    if self.clip_input:
                        values = np.clip(values, lo, hi)
                    noisy = engine.perturb_records(values, record, job.name, self.calibrations[job.name],
                                                   self.streams, None, self.dtype, grid, job.records,
                                                   first_element=first)
                    self.write_part(job, record, first, noisy.reshape(-1))
                first += values.size
        return (0 if self.clip_input else outside), None


def part_elements(block_elements: int) -> int:
    """The elements of a part of a record perturbed in parts (BlockTask.in_parts): about
    block_elements, whole segments of the random streams (rng.segments), so no draw is wasted."""
    return max(1, block_elements // STREAM_UNIT_ELEMENTS) * STREAM_UNIT_ELEMENTS


def block_bounds(job: ArrayJob, block_elements: int) -> list[tuple[int, int]]:
    """Record ranges of about block_elements each.

    Chunked storage: whole chunks (shards), so each block is one read and one write per
    chunk. Otherwise: whole stream units, so no random draws are wasted. Either way the
    values do not depend on the blocking (see engine).
    """
    target = max(1, block_elements // job.elements)
    step = job.chunk_records or records_per_unit(job.elements)
    per_block = max(1, target // step) * step
    return [(s, min(s + per_block, job.records)) for s in range(0, job.records, per_block)]


def _run_tasks(process, tasks: list[tuple], workers: int):
    """Run process(*task) for every task, yielding (task, its result) when it is done.

    Several workers run blocks in threads (NumPy's generators and the codecs release
    the GIL); at most 2 * workers blocks are in memory at once, besides the few a
    writer may hold while its own threads write them (formats/npy.py). The output does not
    depend on the order: each block's random streams come from its position.
    """
    if workers <= 1:
        for task in tasks:
            yield task, process(*task)
        return
    with ThreadPoolExecutor(max_workers=workers) as pool:
        pending: deque = deque()
        try:
            for task in tasks:
                if len(pending) >= 2 * workers:
                    done_task, future = pending.popleft()
                    yield done_task, future.result()
                pending.append((task, pool.submit(process, *task)))
            while pending:
                done_task, future = pending.popleft()
                yield done_task, future.result()
        finally:
            for _, future in pending:
                future.cancel()


def perturb(options: PerturbOptions, progress: Progress | None = None, phase: Phase | None = None
            ) -> PerturbResult:
    """Perturb options.input into its output and manifest (see the module docstring). Memory
    running out anywhere in the run is an OutOfMemory naming the input (whatever was
    written is removed, a Zarr partial too). `progress(records, total)` is called as blocks
    finish, `phase(label, what)` as each phase starts."""
    try:
        return _perturb_input(options, Report(progress, phase))
    except MemoryError as exc:
        raise OutOfMemory(f"{options.input}: ran out of memory ({reason_of(exc)}); nothing was written: "
                          "free memory, or run with fewer --workers") from None


def _perturb_input(options: PerturbOptions, report: Report) -> PerturbResult:
    source = options.input
    options, module = checked_input(options)
    report.tell("reading", headers_phrase(source, module, options))
    if options.resume and options.store == COEFFICIENTS:
        raise UsageError("--resume continues an interrupted records run: a --store coefficients run is "
                         "written whole, and keeps nothing to resume from; run it again without --resume")
    if options.resume and not module.resumable:
        raise UsageError(f"{source}: --resume applies to Zarr output, not {module.name}: an interrupted "
                         f"{module.name} run keeps nothing to resume from")
    if options.name_map is not None and not options.anonymize_names:
        raise UsageError("--name-map applies to --anonymize-names")
    if options.anonymize_names and not module.name_map:
        raise UsageError(f"{source}: --anonymize-names applies to folders of images and WebDataset shards, "
                         f"not {module.name}")
    format_options = checked_format_options(options, module)
    reader = module.open_reader(source, format_options)
    try:
        return _perturb(options, module, reader, format_options, report)
    finally:
        reader.close()


def headers_phrase(source: Path, module, options: PerturbOptions) -> str:
    """What the reading phase does, for -v."""
    how = "--format" if options.input_format else "detected"
    return f"{source}: {module.title} ({how}); reading its headers"


def planning_phrase(options: PerturbOptions, jobs: list[ArrayJob]) -> str:
    """What the planning phase does, for -v."""
    sizes = len({job.elements for job in jobs})
    return (f"calibrating {options.mechanism} ({options.noise} noise) for {plural(sizes, 'record size')} "
            f"and certifying the figures (per element, per record, per file)")


def checked_format_options(options: PerturbOptions, module) -> FormatOptions:
    """What the format's reader is told; refuses --exclude and --keep where no reader would
    honour them."""
    if options.exclude and not module.honours_exclude:
        raise NotHeld(f"{options.input}: --exclude applies to model files (.npz, .safetensors, sharded model "
                      f"folders) and HDF5 files, not {module.name}", "exclude", list(options.exclude))
    if options.keep and not module.honours_keep:
        raise NotHeld(
            f"{options.input}: --keep applies to HDF5 files, Zarr stores, model files (.npz, .safetensors, "
            f"sharded model folders), NIfTI volumes, image folders' label maps, WebDataset shards and tables "
            f"(Parquet, Arrow, Hugging Face dataset folders), not {module.name}: it has nothing else to keep",
            "keep", list(options.keep))
    if options.public_missing and not module.cf_markers:
        raise UsageError(f"{options.input}: --public-missing applies to the missing-data markers of netCDF/HDF5 "
                         f"files and xarray's Zarr stores, not {module.name}")
    return FormatOptions(datasets=list(options.datasets), exclude=list(options.exclude), keep=list(options.keep),
                         image_format=options.image_format, copy_other=options.copy_other,
                         skip_bad=options.skip_bad, anonymize_names=options.anonymize_names, dtype=options.dtype,
                         integer_labels=options.mechanism == PRIVUNIT)


def without_unheld(call: Callable[[PerturbOptions], Any], options: PerturbOptions) -> Any:
    """call(options); where it raises NotHeld (nothing written yet), call again without the
    names this input does not hold (--keep and --exclude patterns, --range NAME=LO:HI): with several
    inputs each input takes what it holds of them (batch.check_names has checked that some
    input holds each). `call` should tell its phases through once_each(phase), so that the
    phase begun again is not told twice."""
    for _ in range(len(NOT_HELD_OPTIONS)):
        try:
            return call(options)
        except NotHeld as exc:
            if exc.option in ("keep", "exclude"):
                patterns = [name for name in getattr(options, exc.option) if name not in exc.names]
                if len(patterns) == len(getattr(options, exc.option)):
                    raise
                options = (dataclasses.replace(options, keep=patterns) if exc.option == "keep"
                           else dataclasses.replace(options, exclude=patterns))
            else:
                ranges = {name: value for name, value in options.ranges.items() if name not in exc.names}
                if len(ranges) == len(options.ranges):
                    raise
                options = dataclasses.replace(options, ranges=ranges)
    return call(options)


NOT_HELD_OPTIONS = ("keep", "exclude", "ranges")  # what NotHeld may name


def once_each(phase: Phase | None) -> Phase | None:
    """`phase`, telling each phase once (a run begun again by without_unheld goes through
    the phases it had begun again)."""
    if phase is None:
        return None
    told: set[tuple[str, str]] = set()

    def tell(label: str, what: str) -> None:
        if (label, what) not in told:
            told.add((label, what))
            phase(label, what)
    return tell


def _perturb(options: PerturbOptions, module, reader, format_options: FormatOptions,
             report: Report) -> PerturbResult:
    jobs = reader.arrays()
    report.tell("planning", planning_phrase(options, jobs))
    where: list[tuple[Path, Path]] = []  # the destinations, checked before the accounting
    calibrated = calibrate_run(options, jobs, rows=row_groups(module, reader, jobs),
                               per_tensor=reader.records_are_tensors, keeps_dtypes=reader.keeps_dtypes,
                               before_accounting=lambda: where.append(_destinations(options, module, reader)))
    destination, manifest_path = where[0]
    masks, weights_info = load_masks(options.weights, jobs) if options.weights is not None else ({}, None)
    run = RunContext(options, jobs, calibrated, module=module, reader=reader, format_options=format_options,
                     report=report, destination=destination, manifest_path=manifest_path, masks=masks,
                     weights_info=weights_info, streams=Streams(options.rng, options.seed, options.allow_weak_seed))
    report.tell("checking", "free space and memory" + (
        f"; reading every record once to fingerprint it for the ledger {options.ledger}" if options.ledger else ""))
    name_map = None  # --anonymize-names: the name map, written with the output
    if options.anonymize_names:
        name_map = module.name_map_destination(options.name_map, options.input, destination,
                                               manifest_path, options.overwrite)
    output.check_free_space(destination.parent, module.output_bytes(written_jobs(run), calibrated.out_dtype,
                                                                     format_options), destination)
    _check_memory(run)
    # Before anything is written: the ledger's cap, and the pending record that keeps a
    # concurrent run from passing it too.
    release = _begin_release(run)
    if calibrated.in_range_markers and not options.public_missing:
        # Before any block is read, after the ledger's fingerprint: the same data either way.
        reader.markers_are_data(calibrated.in_range_markers)
    fills = missing_fills(calibrated, jobs)
    if fills:  # after the ledger's fingerprint too, which hashes the markers as stored
        reader.missing_fill(fills)
    staging = output.Staging()
    try:
        staged = _stage(staging, run, name_map)
    except BaseException:
        staging.discard()
        _abandon(release)
        raise
    notes = staging.notes + staged.notes  # shown after the reader's and writer's messages
    notes += cf.marker_messages(calibrated.in_range_markers, options.public_missing) + range_group_messages(calibrated)
    partial = staged.partial
    committing = contextlib.ExitStack()
    try:
        writer, written = _write_blocks(run, staged, notes)
        for path in written:  # a cleanup script may have removed the output (or its folder)
            if not path.is_file():
                raise output.removed_during_run(path)
        digests = writer.digests()
        outputs = [{"path": str(destination / f.relative_to(staged.output)) if f != staged.output
                    else str(destination),
                    "sha256": digests.get(f) or manifest_mod.sha256_file(f)} for f in written]
        report.tell("committing", f"writing the manifest, then moving {destination} and {manifest_path} into place")
        manifest = build_manifest(run, writer, outputs)
        manifest_mod.write(manifest, staged.manifest, shown_as=manifest_path)
        if name_map:
            module.write_name_map(reader.name_map(destination, manifest_path), staged.name_map, name_map)
        keep_uninterruptible = committing.enter_context(output.uninterruptible())
        staging.commit(options.overwrite)
        keep_uninterruptible()  # the output is in place: the tldp command ends as a success
    except BaseException as exc:
        committing.close()
        staging.discard()
        _abandon(release)
        if partial is None:
            raise
        _keep_or_remove(partial, exc)
        raise
    with committing:  # the output is in place: the run ends as a success
        staging.close()
        if release:
            ledger.complete(release.db, release.id)
            release.db.close()
            notes.append(f"ledger {options.ledger}: the most-spent of the {release.subjects} subject"
                         f"{'s' if release.subjects != 1 else ''} this release touches: {release.spent.describe()}")
        if partial is not None:
            partial.remove()  # only its emptied folder and journal are left
        staging.check_in_place()  # never report an output another program has just removed
        return PerturbResult(destination, manifest_path, manifest,
                             _messages(run, writer, notes, name_map, manifest))


@dataclass
class _Staged:
    """Where a run writes before its commit: the output (a resumable format's partial
    store, or a work folder's file), the manifest and the name map."""

    output: Path
    manifest: Path
    name_map: Path | None
    partial: resume.Partial | None
    notes: list[str]


def _stage(staging: output.Staging, run: RunContext, name_map: Path | None) -> _Staged:
    module, destination, manifest_path, _ = run.writing()
    partial = None
    notes: list[str] = []
    if module.resumable and run.options.store != COEFFICIENTS:  # coefficients: written whole
        partial = resume.Partial(destination, _resume_record(run), run.options.resume)
        notes += partial.messages
        tmp_output = partial.store
        staging.adopt(tmp_output, destination)
    else:
        if module.resumable and resume.partial_path(destination).exists():
            leftover = resume.Partial(destination, _resume_record(run), False)  # an interrupted run's: removed,
            notes += leftover.messages  # as any run without --resume does (or refused while another runs)
            leftover.remove()
        tmp_output = staging.temporary(destination)
    return _Staged(tmp_output, staging.temporary(manifest_path),
                   staging.temporary(name_map) if name_map else None, partial, notes)


def _write_blocks(run: RunContext, staged: _Staged, notes: list[str]):
    """Perturb every block into a writer on the staged output; (writer, files written).
    Values outside the declared range stop the run once the blocks in flight are done.
    `notes`: the run's messages, which a Dask run adds to."""
    options, jobs, calibrated, report = run.options, run.jobs, run.calibrated, run.report
    module, _, _, streams = run.writing()
    partial = staged.partial
    total = sum(job.records for job in jobs)
    tasks = [(job, start, stop) for job in jobs
             for start, stop in block_bounds(job, options.block_elements)]
    if module.writes_rows:  # arrays interleaved, in row order (the order does not change the values)
        tasks.sort(key=lambda task: task[1])
    where = f"{options.workers} thread{'s' if options.workers != 1 else ''}" if options.scheduler == "threads" else "Dask"
    report.tell("perturbing", f"{plural(total, 'record')} in {plural(len(tasks), 'block')} on {where}, into a "
                              f"work copy beside the output")
    writer = _open_writer(run, staged)
    try:
        if partial is not None:
            partial.begin()
            writer.resumed({(name, start): note for (name, start, _), note in partial.completed.items()})
            kept = [t for t in tasks if (t[0].name, t[1], t[2]) in partial.completed]
            tasks = [t for t in tasks if (t[0].name, t[1], t[2]) not in partial.completed]
            if kept:
                report.done(sum(stop - start for _, start, stop in kept), total)
        # (values outside the range, first record of their block, the array)
        outside_counts: list[tuple[int, int, ArrayJob]] = []
        block_task = BlockTask(
            calibrations=calibrated.calib_of, streams=streams,
            # integer data under discrete noise: [lo, hi) holds lo..hi-1
            masks=run.masks, lo=calibrated.lo, hi=calibrated.top,
            clip_input=options.clip_input or options.clip is not None,
            dtype=calibrated.out_dtype,
            source=options.input, write=writer.write, grid=calibrated.grid, bounds=calibrated.checked_bounds(),
            bases=calibrated.bases, coefficients=options.store == COEFFICIENTS,
            write_part=writer.part_writer(), part_elements=part_elements(options.block_elements))
        if options.scheduler == "dask":
            remote = writer.block_writer()
            results = _run_dask(run, dataclasses.replace(block_task, write=remote,
                                                         write_part=block_task.write_part if remote else None), tasks,
                                staged.output, lambda: bool(outside_counts), notes)
        else:
            results = _run_tasks(
                lambda job, start, stop: block_task(job, start, stop, bool(outside_counts)),
                tasks, options.workers)
        # Closed even when the loop stops early (an error, Ctrl-C in progress): blocks
        # still running must end before their output is removed.
        with contextlib.closing(results):
            for (job, start, stop), (outside, noisy) in results:
                if outside:
                    outside_counts.append((outside, start, job))
                if not outside_counts:
                    if noisy is not None:
                        writer.write(job, start, noisy)
                    writer.block_written(job, start, stop)  # e.g. hash it, or wait until it is written
                    if partial is not None:
                        partial.done(job.name, start, stop, writer.block_note(job, start))
                report.done(stop - start, total)
        if not outside_counts:
            writer.finish()
    finally:
        written = writer.close()
    if outside_counts:
        raise _outside_error(outside_counts, calibrated, options.input)
    return writer, written


def written_jobs(run: RunContext) -> list[ArrayJob]:
    """The arrays as the run writes them: the input's, or with --store coefficients each of
    shape (records, k), one row of its records' k released coefficients."""
    if run.options.store != COEFFICIENTS:
        return run.jobs
    return [dataclasses.replace(job, shape=(job.records, run.calibrated.calib_of[job.name].privunit_params().k))
            for job in run.jobs]


def _open_writer(run: RunContext, staged: _Staged):
    """The format's writer on the staged output: a new one, a resumed one (--resume), or with
    --store coefficients its writer of coefficients (checked_input refused the formats without)."""
    module = run.writing()[0]
    options = dataclasses.replace(run.format_options, value_bounds=_value_bounds(run.calibrated, run.jobs))
    if run.options.store == COEFFICIENTS:
        assert module.create_coefficient_writer is not None  # checked_input
        return module.create_coefficient_writer(run.reader, written_jobs(run), staged.output,
                                                run.calibrated.out_dtype, options)
    open_writer = module.reopen_writer if staged.partial and staged.partial.resuming else module.create_writer
    assert open_writer is not None  # a resuming run's format is resumable (resume.Partial)
    return open_writer(run.reader, staged.output, run.calibrated.out_dtype, options)


def _value_bounds(calibrated: Calibrated, jobs: list[ArrayJob]
                  ) -> dict[str, tuple[float, float, float | None]]:
    """Each array's declared range and grid step (None: no grid) as FormatOptions.value_bounds."""
    bounds = {}
    for job in jobs:
        lo, hi, grid = calibrated.bounds.get(job.name, (calibrated.lo, calibrated.hi, calibrated.grid))
        bounds[job.name] = (lo, hi, None if grid is None else grid.granularity or 1)
    return bounds


def _outside_error(outside_counts: list[tuple[int, int, ArrayJob]], calibrated: Calibrated,
                   source: Path) -> DataError:
    _, first, job = min(outside_counts, key=lambda count: (count[2].name, count[1]))
    lo, hi, grid = calibrated.bounds.get(job.name, (calibrated.lo, calibrated.hi, calibrated.grid))
    return DataError(
        f"{array_where(job, source)}: {plural(sum(n for n, _, _ in outside_counts), 'value')} outside the "
        f"declared range [{lo:g}, {hi:g}{']' if grid is None or grid.granularity else ')'} (the "
        f"first in the block of records from {first}); fix --range or pass --clip-input to "
        "clip them into range")


# said by every seeded run: the command's line, and perturb_array's UserWarning
SEED_WARNING = ("warning: a seed makes the noise reproducible; the same seed on another input "
                "of the same shape gives the same noise, so use it for one release only")


def _messages(run: RunContext, writer, notes: list[str], name_map: Path | None,
              manifest: dict[str, Any]) -> list[str]:
    messages = [*run.reader.messages, *writer.messages, *notes]
    if name_map:
        messages.append(f"wrote the name map {name_map}: it pairs the original names with the "
                        "output's, so keep it with the raw data, never with the release")
    warning = weights_warning(run.options.weights, run.weights_info)
    if warning:
        messages.append(warning)
    if run.options.seed is not None:
        messages.append(SEED_WARNING)
    return messages + [warning["message"] for warning in manifest.get("warnings", [])]


def row_groups(module: formats.Format, reader, jobs: list[ArrayJob]) -> list[list[str]]:
    """The datasets each subject's record spans: in a format whose arrays share rows
    (Format.shares_rows: HDF5 files, Zarr stores), the arrays perturbed together that share
    their first axis (row i of each is subject i): the same dimension where the format
    names them (ArrayJob.row_dimension), else the same length; every other array is a
    record scope of its own. An array whose axis 0 has no name may be any named one's
    subjects: it joins every array of its length (all of them one scope). [] when no two
    arrays share rows. A reader that knows its rows says so (Reader.rows: a NIfTI
    series' frames)."""
    own = reader.rows(jobs)
    if own is not None:
        return own
    if not module.shares_rows or reader.records_are_tensors:
        return []
    unnamed = {job.records for job in jobs if job.row_dimension is None}
    by_length: dict[tuple[int, str | None], list[str]] = {}
    for job in jobs:
        dimension = None if job.records in unnamed else job.row_dimension
        by_length.setdefault((job.records, dimension), []).append(job.name)
    if all(len(names) == 1 for names in by_length.values()):
        return []
    return list(by_length.values())


def _destinations(options: PerturbOptions, module, reader) -> tuple[Path, Path]:
    """The output and manifest paths, checked to touch nothing but this run's own files
    (see output.py for the rules)."""
    source = options.input
    for flag, value in (("--out", options.out), ("--manifest", options.manifest)):
        if value is not None and str(value) == "":  # a blank shell variable, say: never "."
            raise UsageError(f"{flag} is empty: give a path, or leave {flag} out for the default")
    destination = output_of(options, module)
    if options.manifest is not None and str(options.manifest) == "-":
        raise UsageError("--manifest -: the manifest is a file; use --json to print it to stdout")
    if options.manifest is not None and str(options.manifest).endswith(("/", os.sep)):
        raise UsageError(f"--manifest {options.manifest}: the manifest is a file; give its path")
    manifest_path = Path(options.manifest) if options.manifest else manifest_mod.default_path(destination)
    if (options.resume and not options.overwrite and os.path.lexists(destination)
            and not os.path.lexists(resume.partial_path(destination))):
        raise OutputError(f"{destination}: the output is complete, so there is nothing left to resume "
                          "(no interrupted run of it); pass --overwrite, without --resume, to write it again")
    output.check_destination(destination, source, options.overwrite, "output",
                             folder=module.folder,
                             earlier_output=lambda path: _is_earlier_output(module, path, reader,
                                                                            manifest_path))
    output.check_destination(manifest_path, source, options.overwrite, "manifest", folder=False)
    # Neither, nor a --name-map, may replace a file the run reads: the weights (and their
    # sidecar, which says whether they are data-derived), the seed file, the ledger, a user's basis.
    protected = {"weights": options.weights, "seed file": options.seed_file, "ledger": options.ledger,
                 "weights sidecar": sidecar_path(Path(options.weights)) if options.weights else None,
                 "basis": bases_mod.parse_basis(options.basis).path if options.mechanism == PRIVUNIT else None}
    written = {"output": destination, "manifest": manifest_path,
               **({"name map": Path(options.name_map)} if options.name_map else {})}
    output.check_distinct({**written, **{what: Path(p) for what, p in protected.items() if p is not None}})
    return destination, manifest_path


def output_of(options: PerturbOptions, module) -> Path:
    """Where the run of `options` on an input of this format writes its output (--out by the
    rules of output.destination, or the default beside the input)."""
    source = options.input
    default = output.default_beside_store(source, module.default_output(source))
    out_text = None if options.out is None else str(options.out)
    return output.destination(None if options.out is None else Path(options.out), out_text,
                              default, module, lambda suffix: _named_by(suffix, module))


def _named_by(suffix: str, module: formats.Format) -> str | None:
    """How messages name the format other than `module` that `suffix` names, if any."""
    other = formats.named_by(suffix, skip=module)
    return None if other is None else other.title


def _is_earlier_output(module, path: Path, reader, manifest_path: Path) -> bool:
    """Whether an existing folder is an earlier output of this kind: its tldp manifest is
    where this run's goes and names files inside it, and the format recognises it as its
    own (Format.earlier_output: a Zarr store; a folder of images and of the files
    --copy-other copies from this input)."""
    try:
        earlier = manifest_mod.read(manifest_path)
        named = [Path(entry["path"]) for entry in earlier["outputs"]]
    except (OSError, InputError, ValueError, KeyError, TypeError):
        return False
    folder = Path(os.path.abspath(path))
    if earlier.get("schema") != manifest_mod.SCHEMA or not named or not all(
            folder == Path(os.path.abspath(p)) or folder in Path(os.path.abspath(p)).parents for p in named):
        return False
    return module.earlier_output(path, reader)


def _check_memory(run: RunContext) -> None:
    """Refuses, before any data is read, a record that cannot fit in this process's memory
    (a model file's tensor is one record): a block holds at least one, read, its noise and
    its output side by side; a record read in parts (ArrayJob.read_parts), a part of it.
    Blocks computed on a cluster's workers are theirs to hold."""
    options, jobs, calibrated = run.options, run.jobs, run.calibrated
    if options.scheduler == "dask" and options.dask_address:
        return
    noise_bytes = 8 if calibrated.grid is not None else calibrated.out_dtype.itemsize  # exact noise: int64
    part = part_elements(options.block_elements)

    def held(job: ArrayJob) -> int:  # the elements of a record held at once
        whole = job.read_parts is None or job.name in run.masks or calibrated.calib_of[job.name].privunit is not None
        return job.elements if whole else min(job.elements, part)

    job = max(jobs, key=lambda j: held(j) * j.dtype.itemsize)
    needed = held(job) * (job.dtype.itemsize + noise_bytes + calibrated.out_dtype.itemsize)
    what = (f"a record of {job.elements:,} elements (read, noised and written whole)" if held(job) == job.elements
            else f"a part of {held(job):,} elements of a record (read, noised and written in parts)")
    output.check_free_memory(needed, f"{array_where(job, options.input)}: {what}")


@dataclass
class _Release:
    db: Any  # the ledger's sqlite3 connection
    id: int
    spent: ledger.Spent  # by the most-spent subject it touches, with it
    subjects: int


def _begin_release(run: RunContext) -> _Release | None:
    """With --ledger: fingerprint the records the release touches (one more pass over
    them), check the caps and record the release as pending (ledger.begin); None without
    a ledger."""
    options = run.options
    if options.ledger is None:
        return None
    path = Path(options.ledger)
    member = output.store_member(Path(options.input))  # an array inside a store: the store is raw data too
    source = Path(options.input) if member is None else member[0]
    if source.is_dir() and source.resolve() in path.resolve().parents:
        raise UsageError(f"{path}: the ledger cannot be inside the input {source}: keep it beside the raw data")
    db = ledger.open_ledger(path)
    try:
        touched = _touched_records(options, run.module, run.reader, run.jobs, ledger.Fingerprints(db))
        figures = manifest_mod.ledger_figures(run.calibrated.certified)
        record = _resume_record(run)
        release_id, total, subjects = ledger.begin(
            db, touched, figures, input=os.path.abspath(options.input), output=os.path.abspath(run.writing()[1]),
            options={**record, "--dp-delta": options.dp_delta}, max_epsilon=options.max_record_eps,
            max_delta=options.max_record_delta, dp_delta=options.dp_delta)
    except BaseException:
        db.close()
        raise
    return _Release(db, release_id, total, subjects)


def _touched_records(options: PerturbOptions, module, reader, jobs: list[ArrayJob],
                     fingerprints: ledger.Fingerprints) -> list[np.ndarray]:
    """The fingerprints of the records a release touches, one array (arrays, rows) per row
    group it perturbs any of. A row group is read whole, its arrays this run leaves out too:
    row i of each array that tldp perturbs by default (and groups) is subject i's, whichever
    of them a run selects. A model file's tensors are one subject (one party's), linked as
    one row."""
    def of(job: ArrayJob) -> np.ndarray:
        part = part_elements(options.block_elements)
        if job.read_parts is not None and job.elements > part:  # a tensor larger than a block, in parts
            return np.array([fingerprints.of_parts(job.read_parts(record, part)) for record in range(job.records)],
                            dtype=np.int64)
        return fingerprints.of_array(job.read(start, stop) for start, stop in block_bounds(job, options.block_elements))

    if reader.records_are_tensors:  # a model file: one party's tensors, one subject (ledger_figures)
        return [np.concatenate([of(job) for job in jobs])[:, None]]
    default, jobs = _default_reader(options, module, reader, jobs)
    perturbed = {job.name for job in jobs}
    try:
        seen = list(jobs) + [job for job in (default.arrays() if default else []) if job.name not in perturbed]
        groups = row_groups(module, reader, seen) or [[job.name] for job in seen]
        by_name = {job.name: job for job in seen}
        return [np.stack([of(by_name[name]) for name in group]) for group in groups if perturbed & set(group)]
    finally:
        if default is not None:
            default.close()


def _default_reader(options: PerturbOptions, module, reader, jobs: list[ArrayJob]) -> tuple[Any, list[ArrayJob]]:
    """The reader of the arrays `perturb` takes by default from the file or store the run's
    arrays belong to (None where the run's own choice is that: no --dataset or --exclude, or
    no default choice), and the run's arrays named as in it. An array or group given by
    its path inside a Zarr store (rl.zarr/a) belongs to the store's row groups, as
    `rl.zarr --dataset a` does."""
    if not module.shares_rows or reader.records_are_tensors:
        return None, jobs
    member = output.store_member(Path(options.input)) if module.folder else None  # a store's array
    if member is None and not (options.datasets or options.exclude):
        return None, jobs
    path = Path(options.input) if member is None else member[0]
    default = None
    with contextlib.suppress(TldpError):  # no default choice (records differ): the run's own arrays
        default = module.open_reader(path, FormatOptions())
    if member is None or default is None:
        return default, jobs
    prefix = member[1]
    return default, [dataclasses.replace(job, name=prefix if job.name == "/" else f"{prefix}/{job.name}")
                     for job in jobs]


def _abandon(release: _Release | None) -> None:
    """The run failed before its output was in place: its pending release goes."""
    if release:
        ledger.abandon(release.db, release.id)
        release.db.close()


def _keep_or_remove(partial: resume.Partial, exc: BaseException) -> None:
    """After a failed resumable run: keep the blocks written when a rerun can use them
    (interrupted, cluster lost), raising the message that says so; remove them when the
    run failed for any other reason (bad input, options, output, memory, a bug)."""
    if not isinstance(exc, (KeyboardInterrupt, dask_runner.ClusterError)):
        partial.remove()
        return
    partial.release()
    kept = (f"the blocks written so far are kept in {partial.root}: run the same command with "
            "--resume (and the same --seed) to continue")
    if isinstance(exc, KeyboardInterrupt):
        raise Interrupted(f"interrupted; {kept}") from None
    if isinstance(exc, dask_runner.ClusterError):
        raise dask_runner.ClusterError(f"{exc}; {kept}") from None


# Each option's flag where it is not its field's name with "-" for "_" (eps: --eps). Both
# ways: a resume record's keys, and the library's messages (run/library.py: --range LO:HI
# reads value_range=(lo, hi) there).
OPTION_FLAGS: dict[str, str] = {"value_range": "--range", "ranges": "--range", "datasets": "--dataset", "input_format": "--format"}


def _resume_record(run: RunContext) -> dict[str, Any]:
    """What a resumed run must share with the interrupted one, keyed by option name: every
    option that can change the output, whether a seed was given (never the seed nor anything
    derived from it), the input's arrays and the weights."""
    options = run.options
    record: dict[str, Any] = {
        "input": str(options.input.resolve()), "format": run.writing()[0].name,
        "arrays": [[job.name, list(job.shape), str(job.dtype)] for job in run.jobs],
        "--seed": options.seed is not None, "--weights": run.weights_info,
    }
    for name in RESUME_COMPARED:
        value = getattr(options, name)
        if name == "value_range":
            value = [run.calibrated.lo, run.calibrated.hi]  # as resolved (integer data: its dtype's range)
        elif name == "dtype":
            value = float_dtype(options)  # as resolved: not given is float32
        elif name == "ranges":
            continue  # under a key of its own, last
        flag = OPTION_FLAGS.get(name, "--" + name.replace("_", "-"))
        record[flag] = str(value) if isinstance(value, Path) else value
    record["--ranges"] = {name: list(bounds) for name, bounds in options.ranges.items()}
    return record


def _run_dask(run: RunContext, task: BlockTask, tasks: list[tuple], tmp_output: Path,
              count_only: Callable[[], bool], messages: list[str]):
    """BlockTask on Dask. Blocks are written by the workers when the format has a block
    writer (task.write), else sent back and written here (the caller does that)."""
    from distributed.protocol.pickle import dumps

    options = run.options
    needed = [options.input] + [mask_path for m in run.masks.values()
                                if (mask_path := m.per_record or m.png) is not None]
    if tasks:
        try:
            dumps((task, tasks[0]))
        except Exception as exc:
            raise UsageError(f"{options.input}: the {tasks[0][0].source.get('format')} format cannot "
                             f"run on Dask (its blocks do not pickle: {reason_of(exc)})") from None
    address = dask_runner.parse_address(options.dask_address) if options.dask_address else None
    if address and dask_runner.plain_remote(address):
        messages.append(f"warning: {address} is unencrypted TCP: the run's secret noise key travels to "
                        "the workers in the clear; use tls:// with Dask's TLS settings")
    with dask_runner.quiet_logs(options.dask_logs), \
            dask_runner.connect(address, options.workers, options.dask_logs) as client:
        if address is not None:
            paths = [str(p) for p in needed] + ([str(tmp_output)] if task.write is not None else [])
            missing = dask_runner.check_visible(client, paths)
            if missing:
                unseen, worker = missing
                error = OutputError if unseen == str(tmp_output) else InputError
                raise error(f"{unseen}: Dask worker {worker} cannot see it; the input and output must be "
                            "on a filesystem every worker shares, at the same path (give absolute paths)")
        yield from dask_runner.run(client, task, tasks, count_only, local=address is None)
