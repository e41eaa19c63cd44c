"""A run calibrated and certified before any data is read: each array's declared range
(--clip, --range NAME=LO:HI, --range LO:HI, or an integer dtype's own), the grid, each
array's calibration, the output dtype and the certified figures (calibrate_run, which
returns a Calibrated), from the options and the arrays' shapes and dtypes alone.

Shared by `tldp perturb` (pipeline.py), `tldp plan` (plan.py), perturb_array (arrays.py),
several inputs in one call (batch.py) and evaluate, which recomputes a run's calibration
from its manifest.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import math
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from tldp_cli import formats
from tldp_cli.errors import NotHeld, UsageError
from tldp_cli.formats import ArrayJob, plural
from tldp_cli.privacy.certificates import Certificate
from tldp_cli.privacy.mechanisms import (
    PRIVUNIT,
    Calibration,
    calibrate_arrays,
    calibrate_privunit,
    calibrated_each,
    matrix_rows,
    raw_release_advice,
)
from tldp_cli.run import bases as bases_mod
from tldp_cli.run import manifest as manifest_mod
from tldp_cli.run.options import COEFFICIENTS, DESCRIBED, PerturbOptions, as_range, checked_budget, checked_noise, float_dtype
from tldp_cli.sampling import discrete, engine

DEFAULT_RANGE_BITS = 16  # integer dtypes up to this wide default to their own range


def resolve_range(value_range: tuple[float, float] | None, jobs: list[ArrayJob],
                  input_path: Path) -> tuple[float, float]:
    """The declared range; 8- and 16-bit integer data defaults to its dtype's range
    (uint8 -> 0:256). Wider integers need one: counts stored as int64 would otherwise get
    noise scaled to 2^64.

    Never inferred from the values: a data-dependent range leaks the data.
    """
    if value_range is not None:
        return value_range
    defaults = {dtype_range(job.dtype, input_path) for job in jobs}
    if len(defaults) > 1:
        raise UsageError(f"{input_path}: the arrays have different integer dtypes; give --range LO:HI")
    return defaults.pop()


def dtype_range(dtype: np.dtype, input_path: Path, name: str | None = None,
                stored: str | None = None) -> tuple[float, float]:
    """The default range of 8- and 16-bit integer data: its dtype's (uint8 -> 0:256); any
    other dtype needs --range. `name`: the array's, said where an input holds several or
    where its values are `stored` as another dtype (packed netCDF, scaled NIfTI)."""
    where = f"{input_path}: {name}:" if name else f"{input_path}:"
    own = f" (or --range {name}=LO:HI for it alone)" if name else ""
    if stored is not None:  # the dtype the user sees on disk is not the values'
        own += f": its stored {stored} values are scaled to {dtype} before the noise, in whose units the range is"
    if dtype.kind == "f":
        raise UsageError(f"{where} {dtype} data needs --range LO:HI{own} "
                         "(the range is never inferred from the values)")
    if dtype.itemsize * 8 > DEFAULT_RANGE_BITS:
        raise UsageError(f"{where} {dtype} data needs --range LO:HI{own} (only 8- and "
                         "16-bit integers default to their dtype's range; the range is never "
                         "inferred from the values)")
    info = np.iinfo(dtype)
    return float(info.min), float(info.max) + 1.0


def array_where(job: ArrayJob, source: Path) -> str:
    """The input, and the dataset, tensor or image inside it, for an error message."""
    member = formats.member_name(job.source)
    if member:
        return f"{source}: {member}"
    return str(job.source.get("path", source))


@dataclass
class Calibrated:
    """A run calibrated and certified (calibrate_run): what it will do, decided from the
    options and the arrays' shapes and dtypes alone (no data values): the range, the grid,
    each array's calibration, the output dtype and the certified figures. `tldp plan`
    prints it (run/plan.py), perturb writes by it, evaluate recomputes it."""

    lo: float
    hi: float
    grid: discrete.Grid | None
    calib_of: dict[str, Calibration]  # by array name
    calibrations: list[Calibration]  # the distinct ones
    largest: Calibration  # the largest record's: the manifest's scalar fields describe it
    out_dtype: np.dtype
    certified: Certificate
    rows: list[list[str]]
    raw_release: list[tuple[str, float]]  # scopes whose kept raw values cost more than dp_delta
    # by array name, where arrays have different ranges (--range NAME=LO:HI): (lo, hi, grid)
    bounds: dict[str, tuple[float, float, discrete.Grid | None]] = field(default_factory=dict)
    # by array name, its CF missing-data markers (ArrayJob.markers) inside its declared range
    in_range_markers: dict[str, tuple[tuple[str, float], ...]] = field(default_factory=dict)
    bases: dict[str, Any] = field(default_factory=dict)  # privunit with a user's basis: by array name
    user_basis: bases_mod.UserBasis | None = None  # privunit: --basis FILE.npy, loaded and checked
    # Where arrays have different ranges: each range's arrays and figures (the manifest's range_groups)
    range_groups: list[dict[str, Any]] = field(default_factory=list)

    @property
    def top(self) -> float:
        """The largest valid value: hi, or for integer data under discrete noise (range
        [lo, hi), the values lo..hi-1) the grid's last value."""
        return _top(self.hi, self.grid)

    def checked_bounds(self) -> dict[str, tuple[float, float, discrete.Grid | None]]:
        """Each array's (lo, top, grid) where arrays have different ranges (see pipeline.BlockTask)."""
        return {name: (lo, _top(hi, grid), grid) for name, (lo, hi, grid) in self.bounds.items()}

    def records_of(self, jobs: list[ArrayJob]) -> dict[Calibration, int]:
        """How many records of `jobs` each calibration perturbs (the manifest's calibrations),
        in the order the jobs first use it."""
        records: dict[Calibration, int] = {}
        for job in jobs:
            calib = self.calib_of[job.name]
            records[calib] = records.get(calib, 0) + job.records
        return records


def _top(hi: float, grid: discrete.Grid | None) -> float:
    return hi if grid is None or grid.granularity else grid.high


def _declared_ranges(options: PerturbOptions, jobs: list[ArrayJob]
                     ) -> dict[str, tuple[tuple[float, float], str]]:
    """Each array's declared range, with what declared it (for the manifest's range_groups):
    from --clip, its own --range NAME=LO:HI, or the default --range LO:HI; without one,
    integer data of 8 and 16 bits gets its dtype's (an image folder of 8- and 16-bit images:
    each bit depth its own)."""
    source = options.input
    if options.clip is not None:
        lo, hi = -options.clip, options.clip
        if discrete.is_discrete(checked_noise(options)) and all(job.dtype.kind in "iu" for job in jobs):
            # Integer data under discrete noise: [lo, hi) holds lo..hi-1, so clipping to
            # [-C, C] declares [-floor C, floor C + 1).
            lo, hi = -math.floor(options.clip), math.floor(options.clip) + 1
            if hi - lo < 2:  # the range said "0:1", which nobody typed
                raise UsageError(f"{source}: --clip {options.clip:g} on integer data ({jobs[0].dtype}) keeps "
                                 "one integer, 0: there is nothing to protect; give --clip 1 or more, or --range")
        return {job.name: ((lo, hi), "--clip") for job in jobs}
    named = {given: arrays_named(given, jobs) for given in options.ranges}
    unheld = [given for given, names in named.items() if not names]
    if unheld:
        lo, hi = as_range(options.ranges[unheld[0]])
        raise NotHeld(f"{source}: --range {unheld[0]}={lo:g}:{hi:g} names no array this "
                      f"run perturbs (it perturbs {formats.listing([job.name for job in jobs])})", "ranges", unheld)
    own: dict[str, tuple[tuple[float, float], str]] = {}
    for given, bounds in options.ranges.items():
        for name in named[given]:
            if name in own:
                raise UsageError(f"{source}: --range {given}=...: {name} has a range already (another --range "
                                 "names it, by another of its names or a glob)")
            own[name] = (as_range(bounds), "--range NAME=LO:HI")  # (a pair already: checked_options)
    for job in jobs:
        if job.name in own:
            continue
        if options.value_range is not None:
            own[job.name] = (as_range(options.value_range), "--range LO:HI")
        else:
            stored = _scaled_from(job)
            own[job.name] = (dtype_range(job.dtype, source, job.name if len(jobs) > 1 or stored else None, stored),
                             f"the {job.dtype} dtype's range (default)")
    return {job.name: own[job.name] for job in jobs}


def _scaled_from(job: ArrayJob) -> str | None:
    """The integer dtype a float array's values are stored as, scaled (packed netCDF and
    Zarr variables, scaled NIfTI); None where the values are stored as they are perturbed."""
    given = job.source.get("dtype")
    try:
        stored = np.dtype(given) if given is not None else job.dtype
    except TypeError:  # a dtype NumPy does not name (bfloat16): not scaled integers
        return None
    return str(stored) if stored.kind in "iu" and job.dtype.kind == "f" else None


def arrays_named(given: str, jobs: list[ArrayJob]) -> list[str]:
    """The arrays --range NAME=LO:HI names: by any of their names (HDF5 names with or
    without "/"; the other names a format gives an array), or every array a glob matches
    (--range '*.npy=0:1')."""
    by_shown = {}
    for job in jobs:
        by_shown.update({alias.lstrip("/"): job.name for alias in job.aliases})
    by_shown.update({job.name.lstrip("/"): job.name for job in jobs})
    given = given.lstrip("/")
    if not any(c in given for c in "*?["):
        return [by_shown[given]] if given in by_shown else []
    found = {name for shown, name in by_shown.items() if fnmatch.fnmatchcase(shown, given)}
    return [job.name for job in jobs if job.name in found]


@dataclass
class _RangeGroup:
    """The arrays of one declared range, their grid and calibrations."""

    lo: float
    hi: float
    grid: discrete.Grid | None
    calib_of: dict[str, Calibration]
    out_dtype: np.dtype
    bases: dict[str, Any] = field(default_factory=dict)


def _privunit_group(options: PerturbOptions, lo: float, hi: float, jobs: list[ArrayJob],
                    rows: list[list[str]], user: bases_mod.UserBasis | None) -> _RangeGroup:
    """--mechanism privunit: one calibration per record shape (records of one shape share
    the basis and the split). A subject's record that spans n arrays (rows) gets --eps / n
    in each of them, so the pure figures of its parts add up to --eps."""
    choice = bases_mod.parse_basis(options.basis)
    parts = {name: len(row) for row in rows for name in row if len(row) > 1}
    made: dict[tuple[tuple[int, ...], int], Calibration] = {}
    calib_of, user_bases = {}, {}
    for job in jobs:
        key = (job.record_shape, parts.get(job.name, 1))
        if user is not None:
            user_bases[job.name] = user.for_records(job.record_shape, array_where(job, options.input))
        if key not in made:
            try:
                made[key] = calibrate_privunit(
                    epsilon=options.eps / key[1], record_shape=job.record_shape, value_range=(lo, hi),
                    dp_delta=options.dp_delta, k=user.k if user else choice.k, basis=choice.kind,
                    basis_sha256=user.sha256 if user else None, reference=options.reference)
            except UsageError as exc:
                hint = ("; it releases each array's records on their own: hold a subject's values in "
                        "one array of shape (records, values) (a table: one list column)"
                        if math.prod(job.record_shape) < 2 else "")
                raise UsageError(f"{array_where(job, options.input)}: {exc}{hint}") from None
        calib_of[job.name] = made[key]
    out_dtype = np.dtype(float_dtype(options))
    largest = max(abs(lo), abs(hi))  # the written values are clipped into [lo, hi]
    if not largest < float(np.finfo(out_dtype).max):
        raise UsageError(f"{options.input}: --dtype {out_dtype} cannot hold values up to {largest:.3g} (the "
                         "range); express the values in larger units or use --dtype float64")
    return _RangeGroup(lo, hi, None, calib_of, out_dtype, user_bases)


@contextmanager
def _naming(source: Path) -> Iterator[None]:
    """Names the input in the usage errors raised inside, as a run of several inputs does:
    they follow from what the input holds, not from the options alone (plan --elements
    describes records: no file to name)."""
    try:
        yield
    except UsageError as exc:
        if str(source) in str(exc) or str(source) == DESCRIBED:
            raise
        raise UsageError(f"{source}: {exc}") from None


def _calibrate_group(options: PerturbOptions, lo: float, hi: float, jobs: list[ArrayJob],
                     rows: list[list[str]], user: bases_mod.UserBasis | None = None, *,
                     keeps_dtypes: bool = False) -> _RangeGroup:
    if options.mechanism == PRIVUNIT:
        return _privunit_group(options, lo, hi, jobs, rows, user)
    source = options.input
    grid = None  # discrete noises: the integers, or the grid G*Z that float data is snapped to
    if discrete.is_discrete(checked_noise(options)):
        grid = discrete.resolve_grid(lo, hi, [job.dtype for job in jobs], options.granularity,
                                     options.eps, source)
    elif options.granularity is not None:
        raise UsageError("--granularity applies to the discrete noises (discrete-laplace, discrete-gaussian)")
    arrays = {job.name: (job.elements, matrix_rows(options.mechanism, job.record_shape, array_where(job, source)))
              for job in jobs}
    with _naming(source):  # a refusal that follows from the input's records and dtypes
        calib_of = calibrate_arrays(
            mechanism=options.mechanism, noise=checked_noise(options), budget=checked_budget(options),
            epsilon=options.eps,
            range_width=hi - lo if grid is None else grid.range_width, dp_delta=options.dp_delta,
            granularity=None if grid is None else grid.granularity, rows=rows, arrays=arrays)
    out_dtype = np.dtype(float_dtype(options))
    scales = [c.scale for c in calib_of.values()]
    if grid is None:
        for scale in set(scales):  # before any output: float noise the dtype can hold
            try:
                engine.check_noise_scale(scale, out_dtype)
            except UsageError as exc:
                raise UsageError(f"{source}: {exc}") from None
    else:  # integers stay integers, widened so they never wrap
        with _naming(source):
            out_dtype = _grid_dtype(options, grid, max(scales), keeps_dtypes)
    return _RangeGroup(lo, hi, grid, calib_of, out_dtype)


def _grid_dtype(options: PerturbOptions, grid: discrete.Grid, scale: float, keeps_dtypes: bool) -> np.dtype:
    """discrete.output_dtype in --dtype; where the format writes each array back in its own
    dtype whatever the noise's (Reader.keeps_dtypes: model files, tables), without --dtype:
    float64 where float32 cannot hold the grid values (a record of ~1000 elements or more
    under --budget record), the rounding to the array's dtype being post-processing of
    the exact float64 values."""
    try:
        return discrete.output_dtype(grid, checked_noise(options), scale, float_dtype(options))
    except UsageError:
        if not keeps_dtypes or options.dtype is not None or grid.granularity is None:
            raise
        # Only float32's exactness limit: grid steps or values float32 cannot hold at all
        # would come out as 0 or saturated in a float32 tensor, so those stay refused.
        tail = discrete.tail_bound(checked_noise(options), scale)
        steps = max(abs(grid.low - tail), abs(grid.high + tail))
        f32 = np.finfo(np.float32)
        if not (steps > 2**24 and grid.granularity >= f32.tiny and grid.granularity * steps < f32.max):
            raise
        return discrete.output_dtype(grid, checked_noise(options), scale, "float64")


def _shared_dtype(dtypes: list[np.dtype], float_dtype: np.dtype) -> np.dtype:
    """The one output dtype of arrays perturbed together (a writer takes one): integers
    widened as they need while every array is integer; with a float array among them,
    --dtype, or float64 where --dtype cannot hold an integer array's values exactly."""
    if all(d.kind in "iu" for d in dtypes):
        return np.result_type(*dtypes)
    exact = np.finfo(float_dtype).nmant + 1  # bits of integer a float holds exactly
    if all(d.kind == "f" or d.itemsize * 8 <= exact for d in dtypes):
        return np.result_type(float_dtype, *(d for d in dtypes if d.kind == "f"))
    return np.dtype(np.float64)


def calibrate_run(options: PerturbOptions, jobs: list[ArrayJob], rows: list[list[str]] | None = None,
                  per_tensor: bool = False, before_accounting: Callable[[], Any] | None = None,
                  keeps_dtypes: bool = False) -> Calibrated:
    """Calibrate and certify a run of `options` over `jobs` (options.noise as drawn, see
    sampled_noise); refuses, as perturb does, what cannot work or needs consent. What
    `tldp plan` states, perturb writes by and evaluate checks against.
    `before_accounting` runs once the options are calibrated, before the certified figures
    are computed (perturb checks its destinations there: a path error comes after the usage
    errors of the options and of their calibration, but before the accounting, without
    importing it, and so before the refusal of a raw release, which needs its figures).
    `keeps_dtypes`: the reader's (Reader.keeps_dtypes), see _grid_dtype."""
    source = options.input
    rows = rows or []
    declared = _declared_ranges(options, jobs)
    range_of = {name: bounds for name, (bounds, _) in declared.items()}
    members: dict[tuple[float, float], list[ArrayJob]] = {}
    for job in jobs:
        members.setdefault(range_of[job.name], []).append(job)
    split = [row for row in rows if len({range_of[name] for name in row}) > 1]
    if split and options.budget == "record":
        budget = ("--mechanism privunit" if options.mechanism == PRIVUNIT else "--budget record")
        raise UsageError(f"{source}: {budget}: a record spans {', '.join(split[0])} (one row of "
                         "each), which have different declared ranges (--range, or their dtypes'); give "
                         "them one range" + ("" if options.mechanism == PRIVUNIT else ", or use --budget element"))
    choice = bases_mod.parse_basis(options.basis) if options.mechanism == PRIVUNIT else None
    user = bases_mod.load_basis(choice.path) if choice and choice.kind == bases_mod.FILE and choice.path else None
    def calibrate_group(bounds: tuple[float, float]) -> _RangeGroup:
        within = [row for row in rows if all(range_of[name] == bounds for name in row)]
        return _calibrate_group(options, bounds[0], bounds[1], members[bounds], within, user, keeps_dtypes=keeps_dtypes)

    groups = list(calibrated_each(list(members), calibrate_group).values())
    calib_of = {name: calib for group in groups for name, calib in group.calib_of.items()}
    calibrations = list(dict.fromkeys(calib_of.values()))
    if options.store == COEFFICIENTS and per_tensor:
        raise UsageError(f"{source}: --store coefficients applies to arrays of records along their first axis; "
                         "in a model file each tensor is one record, written in its own shape")
    if options.store == COEFFICIENTS and len(calibrations) > 1:
        shapes = sorted({"x".join(map(str, job.record_shape)) or "()" for job in jobs})
        raise UsageError(f"{source}: --store coefficients: the arrays hold records of several shapes or "
                         f"budgets ({', '.join(shapes)}), each with its own basis; the manifest describes one: "
                         "store them one --dataset at a time")
    out_dtype = _shared_dtype([group.out_dtype for group in groups], np.dtype(float_dtype(options)))
    if before_accounting is not None:
        before_accounting()
    from tldp_cli.privacy import accounting  # here: usage and path errors never import it

    # The certified figures are the worst case over every calibration. Computed before the
    # data: a failure costs nothing, and the accountant's peak memory does not stack on the
    # streaming buffers.
    certified = certified_figures(calibrations, [[calib_of[name] for name in row] for row in rows],
                                  [(job.name, calib_of[job.name], job.records) for job in jobs], per_tensor)
    _refuse_infinite(certified, source, options.eps)
    raw_release = accounting.raw_release_scopes(certified)
    if raw_release and not options.allow_raw_release:
        scope, delta = next(((s, d) for s, d in raw_release if s == "per_record"), raw_release[0])
        unmet = (f"--eps {options.eps:g} per record cannot be met at --dp-delta {options.dp_delta:g}"
                 if options.budget == "record" else f"above --dp-delta {options.dp_delta:g}")
        raise UsageError(
            f"{source}: TLDP would keep each raw value with probability "
            f"{max(c.p for c in calibrations):.3g}, so the {scope.replace('_', ' ')} delta "
            f"is {delta:.3g}, {unmet} (the retain probability depends on the data's units). "
            f"{raw_release_advice(checked_noise(options))}; "
            "or pass --allow-raw-release to accept it (the manifest records it)")
    largest = max(calibrations, key=lambda c: (c.elements, -c.scale))
    # The scalar fields (value_range, grid) describe the largest record's range, as its calibration
    main = next(group for group in groups if largest in group.calib_of.values())
    bounds = {name: (group.lo, group.hi, group.grid) for group in groups for name in group.calib_of}
    return Calibrated(main.lo, main.hi, main.grid, calib_of, calibrations, largest, out_dtype, certified, rows,
                      raw_release, bounds if len(groups) > 1 or options.ranges else {},
                      _in_range_markers(jobs, bounds),
                      {name: basis for group in groups for name, basis in group.bases.items()}, user,
                      _range_groups(groups, jobs, rows, declared) if len(groups) > 1 else [])


def _refuse_infinite(certified: Certificate, source: object, eps: float) -> None:
    """A figure past float64 (an --eps near its largest value, times a record's elements or
    the file's records) cannot be stated, in the manifest or anywhere: refused as a usage error."""
    for scope in ("per_element", "per_record", "per_file"):
        figures = getattr(certified, scope)
        values = [] if figures is None else [figures.epsilon, figures.approx_epsilon, figures.rho or 0.0]
        if not all(math.isfinite(value) for value in values):
            raise UsageError(f"{source}: --eps {eps:g} gives an infinite eps {scope.replace('_', ' ')} "
                             "(beyond float64 arithmetic); lower --eps")


def _range_groups(groups: list[_RangeGroup], jobs: list[ArrayJob], rows: list[list[str]],
                  declared: dict[str, tuple[tuple[float, float], str]]) -> list[dict[str, Any]]:
    """The manifest's range_groups: each declared range, what declared it, its arrays and
    the figures of its records (accounting.certify_all over its own calibrations). Each
    record is perturbed once, at its group's range, so its figures are its group's; the
    run's per_element and per_record are the worst over the groups."""
    from tldp_cli.privacy import accounting  # here: usage and path errors never import it

    entries = []
    for group in sorted(groups, key=lambda g: (g.lo, g.hi)):
        members = [job for job in jobs if job.name in group.calib_of]
        calibrations = list(dict.fromkeys(group.calib_of.values()))
        inside = [[group.calib_of[name] for name in row] for row in rows
                  if all(name in group.calib_of for name in row)]
        figures = accounting.certify_all(calibrations, inside)
        sizes = sorted({job.elements for job in members})
        entry = {"value_range": [group.lo, group.hi],
                 "declared_by": sorted({declared[job.name][1] for job in members}),
                 "input_dtypes": sorted({str(job.dtype) for job in members}),
                 "arrays": len(members), "records": sum(job.records for job in members),
                 "elements_per_record": sizes[-1] if len(sizes) == 1 else sizes[::len(sizes) - 1],
                 "noise_scale": max(c.scale for c in calibrations),
                 "retain_probability": max(c.p for c in calibrations),
                 "accounting": {"per_element": manifest_mod.scope_entry(figures.per_element),
                                "per_record": manifest_mod.scope_entry(figures.per_record)}}
        if group.grid is not None:
            entry["granularity"] = group.grid.granularity
        entries.append(entry)
    return entries


def range_group_messages(calibrated: Calibrated) -> list[str]:
    """The line that says a run's records have ranges of their own (range_groups)."""
    if not calibrated.range_groups:
        return []
    parts = [f"{lo:g}:{hi:g} for {' and '.join(g['input_dtypes'])} ({plural(g['records'], 'record')}; "
             f"per record eps={g['accounting']['per_record']['epsilon']:.4g})"
             for g in calibrated.range_groups for lo, hi in [g["value_range"]]]
    spanning = [row for row in calibrated.rows if len({calibrated.bounds[name][:2] for name in row}) > 1]
    if spanning:
        rule = (f"A record spanning several ranges (a row of {', '.join(spanning[0])}) composes its parts: "
                "the guarantee line's per-record figure")
    else:
        rule = ("Each record is perturbed once, at its own range, so its figures are its group's (the "
                "manifest's range_groups); the guarantee line states the worst of them")
    return [f"calibrated each declared range on its own: {'; '.join(parts)}. {rule}"]


def certified_figures(calibrations: list[Calibration], records: list[list[Calibration]],
                      arrays: list[tuple[str, Calibration, int]], per_tensor: bool) -> Certificate:
    """accounting.certify_run for a run (see calibrate_run), computed once per distinct calibrations
    and record counts in a process: the inputs of one `tldp perturb` call that share them
    (the same shape, the same options) share the accountant's work."""
    certified = _certified(tuple(calibrations), tuple(tuple(row) for row in records),
                           tuple((calib, n) for _, calib, n in arrays), per_tensor)
    if certified.per_tensor is None:
        return certified
    return dataclasses.replace(certified, per_tensor=tuple(
        dataclasses.replace(tensor, name=name) for tensor, (name, _, _) in zip(certified.per_tensor, arrays)))


@functools.lru_cache(maxsize=32)
def _certified(calibrations: tuple[Calibration, ...], records: tuple[tuple[Calibration, ...], ...],
               arrays: tuple[tuple[Calibration, int], ...], per_tensor: bool) -> Certificate:
    from tldp_cli.privacy import accounting  # here: usage and path errors never import it

    return accounting.certify_run(list(calibrations), [list(row) for row in records],
                                  [("", calib, n) for calib, n in arrays], per_tensor=per_tensor)


def _in_range_markers(jobs: list[ArrayJob], bounds: dict[str, tuple[float, float, discrete.Grid | None]]
                      ) -> dict[str, tuple[tuple[str, float], ...]]:
    """By array, its missing-data markers (ArrayJob.markers) inside its declared range (as
    pipeline.validate_block checks values: lo to the largest valid value), from the headers alone."""
    found = {}
    for job in jobs:
        lo, hi, grid = bounds[job.name]
        inside = tuple((key, value) for key, value in job.markers if lo <= value <= _top(hi, grid))
        if inside:
            found[job.name] = inside
    return found


def missing_fills(calibrated: Calibrated, jobs: list[ArrayJob]) -> dict[str, float]:
    """By array with missing-data markers (ArrayJob.markers), the value its missing positions
    hold before the noise (Reader.missing_fill): public (the options, the declared range and
    the dtype), never a value of the data, since privunit projects the whole record and a
    value of another record there would make this record's release depend on it (and on
    the blocks). Under privunit, its reference point: a missing position then adds nothing
    to the record's direction. Under the per-element mechanisms, whose noisy values at a
    missing position are never written (the marker goes back) and whose draws do not depend
    on the values, the least value of the array's dtype inside its declared range."""
    fills = {}
    for job in jobs:
        if not job.markers:
            continue
        calib = calibrated.calib_of[job.name]
        if calib.privunit is not None:
            fills[job.name] = calib.privunit.reference
        else:
            lo, _, _ = calibrated.bounds.get(job.name, (calibrated.lo, calibrated.hi, calibrated.grid))
            fills[job.name] = _least_held(lo, np.dtype(job.dtype))
    return fills


def _least_held(lo: float, dtype: np.dtype) -> float:
    """The least value of `dtype` not below `lo`."""
    if dtype.kind in "iu":
        return float(max(math.ceil(lo), np.iinfo(dtype).min))
    with np.errstate(over="ignore"):
        value = dtype.type(lo)
    return float(value if value >= lo else np.nextafter(value, dtype.type(np.inf)))


