"""Streams blocks of records: format reader -> validation -> engine -> format writer,
then moves the finished output and its manifest into place.

Output appears complete or not at all: everything is written to temporary
siblings of the destination and renamed at the end; any failure, Ctrl-C
included, removes them.
"""

from __future__ import annotations

import math
import os
import secrets
import shutil
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from tldp_cli import accounting, engine, formats
from tldp_cli import manifest as manifest_mod
from tldp_cli.errors import DataError, OutputError, UsageError
from tldp_cli.formats import ArrayJob, FormatOptions
from tldp_cli.mechanisms import Calibration, calibrate, check_parameters
from tldp_cli.rng import Streams, records_per_unit
from tldp_cli.weights import Mask, load_masks

# Records per block are chosen so a block holds about this many elements.
BLOCK_ELEMENTS = 1 << 22

Progress = Callable[[int, int], None]  # (records just finished, total records)


@dataclass
class PerturbOptions:
    input: Path
    epsilon: float
    noise: str = "laplace"
    mechanism: str = "tldp"
    budget: str = "element"
    value_range: tuple[float, float] | None = None
    weights: Path | None = None
    out: Path | None = None
    manifest: Path | None = None
    seed: int | None = None
    rng: str = "secure"
    dtype: str = "float32"
    dp_delta: float = 1e-5
    overwrite: bool = False
    clip_input: bool = False
    datasets: list[str] = field(default_factory=list)
    image_format: str = "png"
    copy_other: bool = False
    skip_bad: bool = False
    workers: int = 1
    block_elements: int = BLOCK_ELEMENTS


@dataclass
class PerturbResult:
    output: Path
    manifest_path: Path
    manifest: dict[str, Any]
    messages: list[str] = field(default_factory=list)


def parse_range(text: str) -> tuple[float, float]:
    """'LO:HI' -> (lo, hi); refuses empty, inverted and non-finite ranges."""
    parts = text.split(":")
    if len(parts) != 2:
        raise UsageError(f"--range must be LO:HI (for example 0:256), not {text!r}")
    try:
        lo, hi = float(parts[0]), float(parts[1])
    except ValueError:
        raise UsageError(f"--range must be two numbers LO:HI, not {text!r}") from None
    if not (math.isfinite(lo) and math.isfinite(hi)):
        raise UsageError(f"--range must be finite, not {text!r}")
    if hi <= lo:
        raise UsageError(f"--range {text} is empty or inverted: HI must be greater than LO")
    return lo, hi


def resolve_range(value_range: tuple[float, float] | None, jobs: list[ArrayJob],
                  input_path: Path) -> tuple[float, float]:
    """The declared range; integer data defaults to its dtype's range (uint8 -> 0:256).

    Never inferred from the values: a data-dependent range leaks the data.
    """
    if value_range is not None:
        return value_range
    defaults = set()
    for job in jobs:
        if job.dtype.kind == "f":
            raise UsageError(f"{input_path}: {job.dtype} data needs --range LO:HI "
                             "(the range is never inferred from the values)")
        info = np.iinfo(job.dtype)
        defaults.add((float(info.min), float(info.max) + 1.0))
    if len(defaults) > 1:
        raise UsageError(f"{input_path}: the arrays have different integer dtypes; give --range LO:HI")
    return defaults.pop()


def check_output_path(path: Path, input_path: Path, overwrite: bool, what: str) -> None:
    if not path.parent.is_dir():
        raise OutputError(f"{path}: {what} directory {path.parent} does not exist")
    if path.resolve() == input_path.resolve():
        raise OutputError(f"{path}: {what} would replace the input")
    if input_path.is_dir() and input_path.resolve() in path.resolve().parents:
        raise OutputError(f"{path}: {what} would be written inside the input folder {input_path}")
    if path.exists() and not overwrite:
        raise OutputError(f"{path}: {what} exists; pass --overwrite to replace it")


def check_finite(block: np.ndarray, job: ArrayJob, start: int, input_path: Path) -> None:
    """Raises, naming the first record and element, if the block holds NaN or Inf."""
    if block.dtype.kind == "f":
        bad = ~np.isfinite(block.reshape(block.shape[0], -1))
        if bad.any():
            record, element = np.argwhere(bad)[0]
            where = f" dataset {job.source['dataset']}," if "dataset" in job.source else ""
            raise DataError(f"{input_path}:{where} NaN or Inf at record {start + record}, "
                            f"element {element}; tldp needs finite values")


def _validate_block(block: np.ndarray, job: ArrayJob, start: int, lo: float, hi: float,
                    input_path: Path) -> int:
    """Raises on NaN/Inf; returns how many values lie outside [lo, hi]."""
    check_finite(block, job, start, input_path)
    return int(np.count_nonzero((block < lo) | (block > hi)))


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


def temp_sibling(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")


def remove_output(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink()


def move_into_place(tmp: Path, final: Path) -> None:
    if final.is_dir() and not final.is_symlink():
        backup = temp_sibling(final)
        final.rename(backup)
        tmp.rename(final)
        shutil.rmtree(backup, ignore_errors=True)
    else:
        os.replace(tmp, final)


def _run_tasks(process, tasks: list[tuple], workers: int):
    """Run process(*task) for every task, yielding each task when it is done.

    Several workers run blocks in threads (NumPy's generators and the codecs release
    the GIL); at most 2 * workers blocks are in memory at once. The output does not
    depend on the order: each block's random streams come from its position.
    """
    if workers <= 1:
        for task in tasks:
            process(*task)
            yield task
        return
    with ThreadPoolExecutor(max_workers=workers) as pool:
        pending: deque = deque()
        try:
            for task in tasks:
                if len(pending) >= 2 * workers:
                    done_task, future = pending.popleft()
                    future.result()
                    yield done_task
                pending.append((task, pool.submit(process, *task)))
            while pending:
                done_task, future = pending.popleft()
                future.result()
                yield done_task
        finally:
            for _, future in pending:
                future.cancel()


def perturb(options: PerturbOptions, progress: Progress | None = None) -> PerturbResult:
    source = options.input
    check_parameters(mechanism=options.mechanism, noise=options.noise, budget=options.budget,
                     epsilon=options.epsilon, dp_delta=options.dp_delta)
    if options.dtype not in ("float32", "float64"):
        raise UsageError(f"--dtype must be float32 or float64, not {options.dtype}")
    module = formats.detect(source)
    format_options = FormatOptions(datasets=list(options.datasets), image_format=options.image_format,
                                   copy_other=options.copy_other, skip_bad=options.skip_bad)
    reader = module.open_reader(source, format_options)
    try:
        return _perturb(options, module, reader, format_options, progress)
    finally:
        reader.close()


def _perturb(options: PerturbOptions, module, reader, format_options: FormatOptions,
             progress: Progress | None) -> PerturbResult:
    source = options.input
    jobs = reader.arrays()
    lo, hi = resolve_range(options.value_range, jobs, source)
    out_dtype = np.dtype(options.dtype)
    calibrations: dict[int, Calibration] = {}
    for job in jobs:
        if job.elements not in calibrations:
            calibrations[job.elements] = calibrate(
                mechanism=options.mechanism, noise=options.noise, budget=options.budget,
                epsilon=options.epsilon, range_width=hi - lo, elements=job.elements,
                dp_delta=options.dp_delta)
    binding = calibrations[max(calibrations)]  # the largest record: the weakest guarantee
    # Before the data: a failure costs nothing, and the accountant's peak memory does
    # not stack on the streaming buffers.
    certified = accounting.certify(binding)
    masks: dict[str, Mask] = {}
    weights_info = None
    if options.weights is not None:
        masks, weights_info = load_masks(options.weights, jobs)

    output = options.out or module.default_output(source)
    manifest_path = options.manifest or manifest_mod.default_path(output)
    check_output_path(output, source, options.overwrite, "output")
    check_output_path(manifest_path, source, options.overwrite, "manifest")
    if manifest_path.resolve() == output.resolve():
        raise UsageError(f"{manifest_path}: --manifest and --out name the same file")

    streams = Streams(options.rng, options.seed)
    total = sum(job.records for job in jobs)
    tmp_output = temp_sibling(output)
    tmp_manifest: Path | None = None
    try:
        writer = module.create_writer(reader, tmp_output, out_dtype, format_options)
        try:
            tasks = [(job, start, stop) for job in jobs
                     for start, stop in block_bounds(job, options.block_elements)]
            outside_counts: list[tuple[int, int]] = []  # (values outside the range, first record)

            def process(job: ArrayJob, start: int, stop: int) -> None:
                block = job.read(start, stop)
                outside = _validate_block(block, job, start, lo, hi, source)
                if outside and not options.clip_input:
                    outside_counts.append((outside, start))
                if outside_counts:
                    return  # the run will fail: only keep counting
                if options.clip_input:
                    block = np.clip(block, lo, hi)
                mask = masks.get(job.name)
                weights = None if mask is None else mask.for_block(start, stop)
                noisy = engine.perturb_records(block, start, job.name, calibrations[job.elements],
                                               streams, weights, out_dtype)
                writer.write(job, start, noisy)

            for job, start, stop in _run_tasks(process, tasks, options.workers):
                if progress:
                    progress(stop - start, total)
        finally:
            written = writer.close()
        if outside_counts:
            raise DataError(
                f"{source}: {sum(n for n, _ in outside_counts)} values lie outside the declared "
                f"range [{lo:g}, {hi:g}] (the first in the block of records from "
                f"{min(s for _, s in outside_counts)}); fix --range or pass --clip-input to clip "
                "them into range")

        outputs = [{"path": str(output / f.relative_to(tmp_output)) if f != tmp_output else str(output),
                    "sha256": manifest_mod.sha256_file(f)} for f in written]
        extra = dict(getattr(reader, "manifest_extra", {}))
        if len(calibrations) > 1:
            extra["elements_per_record_range"] = [min(calibrations), max(calibrations)]
        manifest = manifest_mod.build(
            calib=binding, certified=certified, value_range=(lo, hi), records=total, rng=options.rng,
            seeded=streams.seeded, weights=weights_info,
            inputs=[job.source for job in jobs], outputs=outputs,
            preprocessing=["clip_input"] if options.clip_input else [],
            postprocessing=getattr(writer, "postprocessing", []),
            output_dtype=getattr(writer, "output_dtype", str(out_dtype)), extra=extra)
        tmp_manifest = manifest_mod.write_atomic(manifest, manifest_path)
        move_into_place(tmp_output, output)
        os.replace(tmp_manifest, manifest_path)
    except BaseException:
        remove_output(tmp_output)
        if tmp_manifest is not None:
            remove_output(tmp_manifest)
        raise
    messages = list(getattr(reader, "messages", []))
    if weights_info and weights_info["data_derived"]:
        messages.append(f"warning: the weights in {options.weights} were computed from the private "
                        f"values (method {weights_info['method']}); the manifest says so")
    return PerturbResult(output, manifest_path, manifest, messages)
