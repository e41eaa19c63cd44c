"""`tldp plan`: the plan of a run, the guarantee it would carry, before any data is read.

A plan is what `tldp plan` prints (schema tldp-plan/1): a manifest without outputs, and
the calibration. The same option checks, calibration, accounting and refusals as `tldp
perturb` (options.checked_options, calibration.calibrate_run, run_manifest.build_manifest),
from the input's headers alone, or from a description of its records (elements per record,
number of records, range). Nothing is read beyond the headers (image folders open
each image's header) and nothing is written.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from tldp_cli import formats
from tldp_cli.errors import UsageError
from tldp_cli.formats import ArrayJob, cf
from tldp_cli.run.calibration import calibrate_run, range_group_messages
from tldp_cli.run.context import Phase, Report, RunContext
from tldp_cli.run.library import speaks_python
from tldp_cli.run.pipeline import (
    checked_format_options,
    headers_phrase,
    planning_phrase,
    once_each,
    row_groups,
    without_unheld,
)
from tldp_cli.run.options import DESCRIBED, PerturbOptions, checked_input, checked_options
from tldp_cli.run.run_manifest import build_manifest

SCHEMA = "tldp-plan/1"


@speaks_python()
def plan(options: PerturbOptions, phase: Phase | None = None) -> dict[str, Any]:
    """The plan of tldp_cli.perturb(options), what `tldp plan INPUT --json` prints (schema
    tldp-plan/1: the manifest the run would write, without its outputs, and the
    calibration), from options.input's headers alone; nothing is written and no data is read.

    Refuses what perturb refuses before reading the data, with its errors (a UsageError,
    InputError, ...), their messages naming the parameters (run/library.py); the plan's
    "messages" are the lines the command prints, in its words, as PerturbResult.messages.
    `phase(label, what)` is told as each phase starts, as perturb tells it."""
    return plan_input(options, phase=phase)


def plan_input(options: PerturbOptions, phase: Phase | None = None) -> dict[str, Any]:
    """The plan of `tldp perturb` with these options on options.input; `phase(label, what)`
    is told as each phase starts, as perturb tells it."""
    report = Report(phase=phase)
    options, module = checked_input(options)
    report.tell("reading", headers_phrase(options.input, module, options))
    format_options = checked_format_options(options, module)
    reader = module.open_reader(options.input, format_options)
    try:
        jobs = reader.arrays()
        report.tell("planning", planning_phrase(options, jobs))
        calibrated = calibrate_run(options, jobs, rows=row_groups(module, reader, jobs),
                                   per_tensor=reader.records_are_tensors, keeps_dtypes=reader.keeps_dtypes)
        messages = [*reader.messages, *cf.marker_messages(calibrated.in_range_markers, options.public_missing),
                    *range_group_messages(calibrated)]
        return _report(RunContext(options, jobs, calibrated, module, reader, format_options), messages)
    finally:
        reader.close()


def plan_each(options: PerturbOptions, inputs: list[Path], phase: Phase | None = None
              ) -> Iterator[tuple[Path, dict[str, Any] | Exception]]:
    """`plan_input` for each of `inputs` in turn, as `tldp plan a.npy b.npy` does: (input,
    its plan, or the exception that stopped it); the next one is planned either way. Inputs
    of the same calibration share the accountant's work (calibration.certified_figures). Each
    takes what it holds of what --keep and --range NAME=LO:HI name (batch.check_names
    refuses a name no input holds)."""
    for path in inputs:
        try:
            told = once_each(phase)
            yield path, without_unheld(lambda o: plan_input(o, phase=told), dataclasses.replace(options, input=path))
        except Exception as exc:  # that input's failure: reported, and the next one planned
            yield path, exc


def plan_records(options: PerturbOptions, shape: tuple[int, ...], records: int,
                 input_dtype: str | None = None) -> dict[str, Any]:
    """The plan for `records` records of `shape` (no file). `input_dtype`: the data's dtype;
    default: integers when --range has integer ends (LO..HI-1), else float64."""
    if records < 1 or not shape or min(shape) < 1:
        raise UsageError("--records and --elements/--shape must be positive")
    options = checked_options(options)
    messages = []
    if input_dtype is None:
        lo_hi = options.value_range if isinstance(options.value_range, tuple) else (0.0, 0.0)  # (checked: a pair)
        whole = options.clip is None and all(float(v).is_integer() for v in lo_hi)
        input_dtype = "int64" if whole and options.value_range else "float64"
        if input_dtype == "int64" and lo_hi[1] - lo_hi[0] <= 1:
            raise UsageError(f"--range {lo_hi[0]:g}:{lo_hi[1]:g} with integer ends describes integer data, "
                             "and holds a single value of it; for float data give --input-dtype float32 "
                             "(or float64)")
        if input_dtype == "int64" and lo_hi[1] - lo_hi[0] < 256:
            # Fewer values than a byte's (0:256): as often float data in those units (--range -1:1
            # for tanh features), whose plan differs (-1:1 as integers is {-1, 0}: half the figures).
            messages.append(f"note: --range {lo_hi[0]:g}:{lo_hi[1]:g} has integer ends, so the records are "
                            f"planned as integers {lo_hi[0]:g} to {lo_hi[1] - 1:g}; for float data in that "
                            "range give --input-dtype float32 (or float64)")
    try:
        dtype = np.dtype(input_dtype)
    except TypeError:
        raise UsageError(f"--input-dtype must be a NumPy dtype (uint8, int16, float32, ...), "
                         f"not {input_dtype!r}") from None
    formats.check_numeric_dtype(Path(DESCRIBED), dtype, "the described data")
    if options.value_range is None and options.clip is None and (dtype.kind == "f" or dtype.itemsize > 2):
        # said here: the file-level message would name a file "records" the user never gave
        raise UsageError(f"--elements describes records without their values: {dtype} data needs "
                         "--range LO:HI, --clip C (the range -C:C), or --input-dtype uint8 or another 8- or "
                         "16-bit integer type, whose range is the default")
    full = (records, *shape)
    job = ArrayJob(name=DESCRIBED, shape=full, dtype=dtype, read=_never_read,
                   source={"format": "described", "shape": list(full), "dtype": str(dtype)})
    return _report(RunContext(options, [job], calibrate_run(options, [job])), messages)


def _never_read(start: int, stop: int) -> np.ndarray:
    raise AssertionError("a plan reads no data")


def _report(run: RunContext, messages: list[str]) -> dict[str, Any]:
    """The plan of `run`: its manifest without what only writing decides, and its calibration."""
    calibrated, jobs = run.calibrated, run.jobs
    manifest = build_manifest(run)
    # What the writer does (a model file's tensor dtypes, its postprocessing) is known only
    # to the writer: the plan states the perturbed values' dtype, and what is written where
    # the reader knows it (Reader.output_dtype: images' PNG bit depth).
    for field in ("outputs", "created", "seeded", "weak_seed", "output_dtype", "postprocessing"):
        manifest.pop(field, None)
    written = run.reader.output_dtype(calibrated.out_dtype) if run.reader is not None else None
    if written:
        manifest["output_dtype"] = written
    calib = calibrated.largest
    manifest["schema"] = SCHEMA
    manifest["calibration"] = {
        "noise_scale": calib.scale, "calibration_epsilon": calib.element_epsilon,
        # the worst record size's, as the manifest's own (calib is the largest record's)
        "retain_probability": manifest["retain_probability"],
        "retain_probability_log10": manifest.get("retain_probability_log10"),
        "values_dtype": str(calibrated.out_dtype),
        "records": sum(job.records for job in jobs),
        "elements": sum(job.records * job.elements for job in jobs),
    }
    manifest["messages"] = messages + [warning["message"] for warning in manifest.get("warnings", [])]
    return manifest
