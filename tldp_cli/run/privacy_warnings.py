"""Warnings about a release whose privacy settings do less than they seem to.

- A subject's certified epsilon above accounting.RECORD_EPSILON_WARNING: the figure
  is true and protects nothing (docs/choosing-eps.md).
- A weight mask (--weights) on records whose retain probability is already 0 in the
  engine (engine.retain_probability): the mask only lowers it, so it cannot change
  the output.
- --clip C on integer data: it clips the dtype's values outside [-C, C] before the noise,
  and declares (-C, C), wider than the values that reach the noise where the dtype holds
  fewer (unsigned, or C beyond the dtype): the noise is scaled to the wider range.
- --keep on a dataset, array or column holding a value per record (its first axis has the
  records' length; a table's every column): its values leave raw, outside the certified
  figure (usual for labels, which it then releases as they are).

Each is an entry of the manifest's `warnings` ({kind, message, ...}: `tldp plan` and
`perturb --json` show it too) and a line of the run's messages, which the CLI prints
unless -q. The figures come from the accounting the run already did.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from tldp_cli.formats import ArrayJob, Format, leftovers, listing, plural
from tldp_cli.privacy.certificates import Certificate
from tldp_cli.privacy.types import Calibration
from tldp_cli.sampling.engine import retain_probability

GUIDE = "docs/choosing-eps.md"


def record_name(fmt: Format | None, jobs: list[ArrayJob], rows: list[list[str]],
                per_tensor: bool) -> str:
    """What one subject's record is, in words: "an image", "row i of a, b". `fmt`: the
    input's format (None: an array in memory)."""
    if per_tensor:
        return f"one party's {plural(len(jobs), 'tensor')}, composed"
    if fmt is not None and fmt.record_noun:
        return fmt.record_noun
    if rows:
        return "; ".join(f"row i of {', '.join(row)}" for row in rows)
    if len(jobs) == 1:
        # a file that is one array (Format.single_array), or an array in memory: not named
        of = "" if fmt is None or fmt.single_array else f" of {jobs[0].name}"
        which = "the only entry" if jobs[0].records == 1 else f"one of the {jobs[0].records} entries"
        return f"{which} along the first axis{of}, of {jobs[0].elements} elements"
    return f"a row of {listing([job.name for job in jobs])}"


def large_epsilon(certified: Certificate, record: str, budget: str) -> dict[str, Any] | None:
    """The warning on a subject's certified epsilon above the threshold, if it is."""
    from tldp_cli.privacy import accounting  # here: a run's early refusals never import it

    epsilon = accounting.large_record_epsilon(certified)
    if epsilon is None:
        return None
    threshold, scope = accounting.RECORD_EPSILON_WARNING, accounting.subject_scope(certified)[0]
    unit, what = ("file", "the file is") if scope == "per_file" else ("record", "a record is")
    if budget == "record":  # --eps is already each record's (tensor's): only a lower one helps
        advice = "lower --eps" if scope == "per_record" else "lower --eps: each tensor gets it, the file composes them"
    else:
        advice = ("--budget record sets eps per tensor, the file composes them" if scope == "per_file" else
                  "--budget record sets eps per record")
    return {"kind": "large_record_epsilon", "record": record, "scope": scope, "epsilon": epsilon,
            "threshold": threshold, "guide": GUIDE,
            "message": f"warning: the certified eps per {unit} is {epsilon:.4g}, above {threshold:g} "
                       f"({what} {record}): a bound of e^eps on what the release tells about it "
                       f"protects nothing; see {GUIDE} for choosing eps ({advice})"}


def _sizes(calibrations: list[Calibration]) -> str:
    sizes = sorted({c.elements for c in calibrations})
    return f"{sizes[0]} elements" if len(sizes) == 1 else f"{sizes[0]} to {sizes[-1]} elements"


def idle_weights(weights: Path | None, jobs: list[ArrayJob], calib_of: dict[str, Calibration],
                 masked: list[str], epsilon: float, budget: str) -> dict[str, Any] | None:
    """The warning on a weight mask that cannot change the output (or part of it), if any:
    the records it covers whose retain probability is 0 in the engine."""
    covered = [job for job in jobs if job.name in masked]
    idle = [job for job in covered if retain_probability(calib_of[job.name]) == 0.0]
    if weights is None or not idle:
        return None
    calibs = list(dict.fromkeys(calib_of[job.name] for job in idle))
    logs = [c.p_log10 for c in calibs if c.p_log10 is not None]
    records, total = sum(job.records for job in idle), sum(job.records for job in covered)
    part = "" if records == total else f" for {records} of the {total} records it covers"
    why = ("the mechanism keeps no raw value" if not logs else
           f"TLDP's retain probability is already 0 at --eps {epsilon:g} ({budget} budget) for "
           f"records of {_sizes(calibs)} (log10 p = {max(logs):.5g} underflows), and a mask only "
           "lowers it")
    return {"kind": "weights_without_effect", "records": records, "of": total,
            "message": f"warning: the weight mask {weights} cannot change the output{part}: {why}; "
                       "see docs/weight-masks.md"}


def integer_clip(clip: float | None, jobs: list[ArrayJob], lo: float, top: float,
                 exclusive: bool) -> dict[str, Any] | None:
    """The warning on --clip over integer arrays, if any: what it clips of each integer
    dtype, and the range it declares where that is wider than the values that reach the
    noise. `lo`, `top`: the declared range's least and largest valid values (the run's
    calibrated lo and top); `exclusive`: the range is written [lo, top + 1) (integers under
    discrete noise), as --range takes it."""
    integers = [job for job in jobs if job.dtype.kind in "iu"]
    if clip is None or not integers:
        return None
    hi = top + 1 if exclusive else top
    # not named: a run's names can be withheld (--anonymize-names)
    what = "integer data" if len(integers) == len(jobs) else f"{plural(len(integers), 'integer array')} of {len(jobs)}"
    parts = []
    for dtype in dict.fromkeys(job.dtype for job in integers):
        info = np.iinfo(dtype)
        low, high = max(int(info.min), lo), min(int(info.max), top)  # the values that reach the noise
        cut = [f"below {lo:g} become {lo:g}"] if info.min < lo else []
        cut += [f"{'those ' if cut else ''}above {top:g} become {top:g}"] if info.max > top else []
        said = (f"its values {' and '.join(cut)} before the noise" if cut
                else "it clips none of its values")
        if lo < info.min or top > info.max:
            end = high + 1 if exclusive else high  # the range of the values that reach the noise
            said += (f", and the range it declares, {lo:g}:{hi:g}, is {(hi - lo) / (end - low):.3g} times as "
                     f"wide as the values that reach the noise ({low:g}..{high:g}), which the noise is scaled "
                     f"to; --range {low:g}:{end:g}{' --clip-input' if cut else ''} scales it to them")
        parts.append(f"{dtype} (values {info.min}..{info.max}): {said}")
    return {"kind": "clip_on_integers",
            "message": f"warning: --clip {clip:g} on {what}: {'; '.join(parts)}"}


def kept_per_record(unperturbed: list[dict[str, Any]], jobs: list[ArrayJob], withheld: bool = False,
                    per_tensor: bool = False) -> dict[str, Any] | None:
    """The warning on what --keep copies raw that holds a value per record, if any: a
    dataset or array (HDF5, netCDF, Zarr, .npz) whose first axis has the length of a
    perturbed array's records, a table's column (one value per row), or a WebDataset's
    members of one extension (kind "member": one per sample). `unperturbed`: the
    reader's manifest entries (leftovers.Leftovers), whose reason says --keep copied them;
    `withheld`: the run withholds names (--anonymize-names), so the message counts them;
    `per_tensor`: records are tensors (model files), so no array holds one per record."""
    lengths = {job.records for job in jobs}
    kept = [u for u in unperturbed if u.get("reason") == leftovers.KEPT and not per_tensor and (
        u.get("kind") in ("column", "member") or (u.get("kind") in ("dataset", "array") and u.get("shape")
                                                  and u["shape"][0] in lengths))]
    if not kept:
        return None
    names = [u["name"] for u in kept]
    what = (f"{len(kept)} " + ("array, column or member" if len(kept) == 1 else "arrays, columns or members")
            if withheld else listing(names))
    they, are = ("it holds", "it is") if len(kept) == 1 else ("they hold", "they are")
    return {"kind": "kept_per_record", **({} if withheld else {"names": names}),
            "message": f"warning: --keep copies {what} raw: {they} a value per record (a first axis of the "
                       f"records' length, a table's column, or a member of each sample), released as {are}, "
                       "outside the certified eps "
                       "(usual for labels, which are then published raw); see docs/formats.md#what-is-not-perturbed"}
