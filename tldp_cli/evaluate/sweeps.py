"""`sweep(...)` (`tldp sweep`): ORIGINAL perturbed in memory over a grid of epsilons for
TLDP-L, TLDP-G and the paper's Laplace, Gaussian, MVG and IDN baselines (and weighted
TLDP), and, with --budget record, privunit (its default basis and k rule), each point's
error and F1; `write_sweep(...)` writes a CSV, a JSON table and PNG plots."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from tldp_cli import __version__, formats
from tldp_cli.errors import InputError, OutputError, UsageError
from tldp_cli.evaluate.common import SENSITIVE, Progress, finite
from tldp_cli.evaluate.utility import (check_task, check_task_options, load_labels, load_records, majority_f1, need,
                                       weighted_f1)
from tldp_cli.files import output
from tldp_cli.privacy.mechanisms import Calibration, calibrate, calibrate_privunit, parse_reference
from tldp_cli.run.calibration import resolve_range
from tldp_cli.run.pipeline import check_finite
from tldp_cli.sampling import engine
from tldp_cli.sampling.rng import Streams
if TYPE_CHECKING:
    from tldp_cli.privacy.certificates import Certificate

SWEEP_SCHEMA = "tldp-sweep/1"
SWEEP_METHODS = (  # label, mechanism, noise, weighted
    ("TLDP-L", "tldp", "laplace", False),
    ("TLDP-G", "tldp", "gaussian", False),
    ("Laplace", "baseline", "laplace", False),
    ("Gaussian", "baseline", "gaussian", False),
    ("MVG", "mvg", "gaussian", False),
    ("IDN", "idn", "gaussian", False),
    ("TLDP-L-w", "tldp", "laplace", True),
    ("TLDP-G-w", "tldp", "gaussian", True),
    ("privunit", "privunit", "privunit", False),  # --budget record only: its eps is per record
)

SWEEP_FILES = ("sweep.csv", "sweep.json", "sweep_nominal_eps.png", "sweep_record_eps.png")
SWEEP_COLUMNS = ("method", "mechanism", "noise", "weighted", "epsilon", "budget",
                 "element_epsilon", "record_epsilon", "record_delta", "noise_scale",
                 "retain_probability_log10", "mean_l2_error", "rms_l2_error",
                 "expected_l2_error", "mse", "f1", "f1_std", "f1_min", "f1_max", "repeats")

TABLE_DIGITS = 6  # significant digits of the numbers in sweep.csv and sweep.json (reruns compare equal)


def parse_eps_list(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UsageError(f"--eps must be a comma-separated list of numbers, not {text!r}") from None
    if not values or not all(math.isfinite(v) and v > 0 for v in values):
        raise UsageError(f"--eps values must be finite numbers > 0, not {text!r}")
    return sorted(set(values))


def parse_methods(text: str) -> list[str]:
    """--methods: table names of SWEEP_METHODS, comma-separated."""
    names = [v.strip() for v in text.split(",") if v.strip()]
    known = [mm[0] for mm in SWEEP_METHODS]
    unknown = [name for name in names if name not in known]
    if not names or unknown:
        raise UsageError(f"--methods takes names from {', '.join(known)}, not {text!r}")
    return names


def sweep(original: Path, epsilons: list[float], *, labels: Path | str | None = None,
          test: Path | None = None, test_labels: Path | str | None = None, model: str = "logistic",
          value_range: tuple[float, float] | None = None, weights: Path | None = None,
          budget: str = "element", seed: str | int | None = None, rng: str = "secure",
          dp_delta: float = 1e-5, dataset: str | None = None,
          progress: Progress | None = None, allow_weak_seed: bool = False,
          input_format: str | None = None, repeats: int = 1,
          named: list[str] | None = None, reference: str | float | None = None) -> dict[str, Any]:
    """Perturb ORIGINAL in memory for every (method, epsilon) and measure error and F1.

    `named`: table names of SWEEP_METHODS to run (None: every one that applies); a
    named method that does not apply (weighted TLDP without weights, MVG on vectors,
    privunit under the element budget) is listed in skipped_methods with the reason.

    `repeats`: independent noise draws per point (stream keys sweep/METHOD/EPS, then
    sweep/METHOD/EPS/1, /2, ...); a row gives the mean over them and F1's sample standard
    deviation, min and max. `reference`: privunit's --reference (None: auto)."""
    from tldp_cli.run.masks import load_mask

    original = Path(original)
    check_task_options(labels, test, test_labels, model)
    if not epsilons:
        raise UsageError("a sweep needs --eps with at least one value")
    if repeats < 1:
        raise UsageError(f"--repeat must be at least 1, not {repeats}")
    streams = Streams(rng, seed, allow_weak_seed)  # a bad seed fails before the data are read
    x = load_records(original, dataset, input_format)
    if x.dtype.kind not in "iuf":
        raise InputError(f"{original}: {x.dtype} data cannot be perturbed")
    job = formats.ArrayJob("array", tuple(x.shape), x.dtype, lambda a, b: x[a:b], {})
    check_finite(x, job, 0, original)  # NaN (missing data): no noise or error can be measured on it
    lo, hi = resolve_range(value_range, [job], original)
    if x.size and (x.min() < lo or x.max() > hi):
        raise InputError(f"{original}: values lie outside the declared range [{lo:g}, {hi:g}]")
    elements = job.elements
    mask = load_mask(Path(weights), job.record_shape, job.records) if weights else None
    methods, skipped = _sweep_methods(mask is not None, job.record_shape, budget, elements, named)
    _check_reference(reference, methods, skipped)
    if not methods:  # every method --methods named is skipped: an empty table is no sweep
        raise UsageError("--methods: no named method applies to this sweep: "
                         + "; ".join(f"{entry['method']}: {entry['reason']}" for entry in skipped))
    rows_mvg = job.record_shape[0] if len(job.record_shape) >= 2 else None
    clean = None
    if labels and test and test_labels:  # (all three or none, checked above)
        y = load_labels(labels, original)
        test_x, test_y = load_records(test), load_labels(test_labels, test, "--test-labels")
        check_task(len(x), y, test_x, test_y, job.record_shape, labels, test)
        clean = {"f1_clean": weighted_f1(x, y, test_x, test_y, model, (lo, hi)),
                     "f1_majority_class": majority_f1(test_y), "model": model,
                     "train_records": int(len(x)), "test_records": int(len(test_y))}
    rows = []
    total = len(methods) * len(epsilons) * repeats
    xf = x.reshape(len(x), -1).astype(np.float64)
    for label, mechanism, noise, weighted in methods:
        for eps in epsilons:
            t0 = time.perf_counter()
            if mechanism == "privunit":
                calib = calibrate_privunit(epsilon=eps, record_shape=job.record_shape,
                                           value_range=(lo, hi), dp_delta=dp_delta, reference=reference)
            else:
                calib = calibrate(mechanism=mechanism, noise=noise, budget=budget, epsilon=eps,
                                  range_width=hi - lo, elements=elements, dp_delta=dp_delta,
                                  rows=rows_mvg if mechanism == "mvg" else None)
            from tldp_cli.privacy import accounting  # here: usage and path errors never import it
            cert = accounting.certify(calib)
            norms, mses, f1s = [], [], []
            for r in range(repeats):
                key = f"sweep/{label}/{eps!r}" + (f"/{r}" if r else "")
                noisy = engine.perturb_records(x, 0, key, calib, streams,
                                               mask.values if weighted and mask is not None else None,
                                               np.float32)
                z = noisy.reshape(len(x), -1).astype(np.float64) - xf
                norms.append(np.sqrt((z * z).sum(axis=1)))
                mses.append(float((z * z).mean()))
                if labels:
                    f1s.append(weighted_f1(noisy, y, test_x, test_y, model, (lo, hi)))
                if progress:
                    progress(1, total)
            row = _sweep_row(calib, cert, np.concatenate(norms), mses, f1s)
            row.update(method=label, weighted=weighted, budget=budget, repeats=repeats,
                       seconds=time.perf_counter() - t0)
            rows.append(row)
    return {"schema": SWEEP_SCHEMA, "sensitive": SENSITIVE, "tool": {"name": "tldp", "version": __version__},
            "original": str(original), "records": int(len(x)), "elements_per_record": elements,
            "value_range": [lo, hi], "budget": budget, "dp_delta": dp_delta, "rng": rng,
            "seeded": streams.seeded,
            "weak_seed": streams.weak_seed, "weights": mask.info if mask is not None else None,
            "epsilons": epsilons, "repeats": repeats, "methods": [mm[0] for mm in methods], "skipped_methods": skipped,
            "reference": clean, "rows": rows}


def _sweep_methods(weighted: bool, record_shape: tuple[int, ...], budget: str, elements: int,
                   named: list[str] | None) -> tuple[list, list[dict]]:
    """The SWEEP_METHODS that apply (weighted TLDP with a mask, MVG on matrices, privunit
    under --budget record), restricted to `named`; the others, with the reason, as skipped."""
    methods = [mm for mm in SWEEP_METHODS if not mm[3] or weighted]
    skipped = []
    if len(record_shape) < 2:  # MVG needs matrix-shaped records
        methods = [mm for mm in methods if mm[1] != "mvg"]
        skipped.append({"method": "MVG", "reason": f"records of shape {record_shape} are not "
                                                   "matrices (MVG needs 2 or more axes)"})
    methods, skipped = _privunit_in_sweep(methods, skipped, budget, elements)
    if named is None:
        return methods, skipped
    skipped = [entry for entry in skipped if entry["method"] in named]
    skipped += [{"method": mm[0], "reason": "weighted TLDP needs --weights"}
                for mm in SWEEP_METHODS if mm[3] and not weighted and mm[0] in named]
    return [mm for mm in methods if mm[0] in named], skipped


def _check_reference(reference: str | float | None, methods: list, skipped: list[dict]) -> None:
    """--reference is privunit's: a bad value, or a sweep that runs no privunit, is a usage
    error (as for perturb, where it needs --mechanism privunit)."""
    if reference is None:
        return
    parse_reference(reference)
    if not any(mm[1] == "privunit" for mm in methods):
        why = next((entry["reason"] for entry in skipped if entry["method"] == "privunit"), "--methods leaves it out")
        raise UsageError(f"--reference applies to privunit, which this sweep does not run ({why})")


def _privunit_in_sweep(methods: list, skipped: list[dict], budget: str,
                       elements: int) -> tuple[list, list[dict]]:
    """privunit's --eps is each record's figure: it joins --budget record sweeps of records
    of 2 or more elements, and is listed as skipped, with the reason, otherwise."""
    reason = None
    if budget != "record":
        reason = "its --eps is per record: run the sweep with --budget record"
    elif elements < 2:
        reason = "it releases a direction, which needs records of 2 or more elements"
    if reason is None:
        return methods, skipped
    return ([mm for mm in methods if mm[1] != "privunit"],
            skipped + [{"method": "privunit", "reason": reason}])


def _sweep_row(calib: Calibration, cert: Certificate, norms: np.ndarray, mses: list[float],
               f1s: list[float]) -> dict[str, Any]:
    """One (method, epsilon) point of a sweep: its calibration, certified figures, the
    noise's measured size over every draw and F1's mean and spread (None without labels)."""
    row = {"method": None, "mechanism": calib.mechanism, "noise": calib.noise, "weighted": None,
           "epsilon": calib.epsilon, "budget": calib.budget,
           "element_epsilon": cert.per_element.epsilon,
           "record_epsilon": cert.per_record.epsilon,
           "record_delta": cert.per_record.delta, "noise_scale": calib.scale,
           "retain_probability_log10": finite(calib.p_log10),
           "mean_l2_error": float(norms.mean()),
           "rms_l2_error": float(math.sqrt((norms**2).mean())),
           "expected_l2_error": finite(calib.expected_l2_error()),
           "mse": float(np.mean(mses)), "f1": None, "f1_std": None, "f1_min": None,
           "f1_max": None, "repeats": None}
    if f1s:
        row.update(f1=float(np.mean(f1s)), f1_min=min(f1s), f1_max=max(f1s),
                   f1_std=float(np.std(f1s, ddof=1)) if len(f1s) > 1 else None)
    return row


def write_sweep(result: dict[str, Any], out_dir: Path, overwrite: bool = False) -> list[Path]:
    """sweep.csv, sweep.json and two PNGs (against the nominal and the certified per-record eps),
    readable by their owner only, as every file computed from the raw data."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise OutputError(f"{out_dir}: exists and is not a folder")
    targets = [out_dir / name for name in SWEEP_FILES]
    made = [p for p in (out_dir, *out_dir.parents) if not p.exists()]  # deepest first
    out_dir.mkdir(parents=True, exist_ok=True)  # output.write_files refuses existing files
    try:
        _write_tables(result, targets, overwrite)
    except BaseException:  # a failure or Ctrl-C leaves no folder either: "nothing was written"
        for folder in made:
            with contextlib.suppress(OSError):
                folder.rmdir()
        raise
    return targets


def _write_tables(result: dict[str, Any], targets: list[Path], overwrite: bool) -> None:
    # Numbers to TABLE_DIGITS significant digits, so that a rerun with the same seed writes
    # the same tables; the timings are in the JSON only.
    rows = [{k: (v if k == "seconds" else _rounded(v)) for k, v in row.items()} for row in result["rows"]]
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=SWEEP_COLUMNS, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: ("" if row.get(k) is None else row.get(k)) for k in SWEEP_COLUMNS})
    output.write_files({
        targets[0]: buf.getvalue().encode(),
        targets[1]: (json.dumps({**result, "rows": rows}, indent=2, allow_nan=False) + "\n").encode(),
        targets[2]: _plot(result, "epsilon", "nominal ε (--eps, " + result["budget"] + " budget)"),
        targets[3]: _plot(result, "record_epsilon", "certified per-record ε (log scale)"),
    }, overwrite, private=True)  # computed from the raw data ("sensitive"): its owner's only


def _rounded(value: Any) -> Any:
    """A float to TABLE_DIGITS significant digits (other values as they are)."""
    if isinstance(value, float) and math.isfinite(value):
        return float(f"{value:.{TABLE_DIGITS}g}")
    return value


def _plot(result: dict[str, Any], x_key: str, x_label: str) -> bytes:
    need("matplotlib")  # Figure without pyplot renders with Agg; no global backend change

    from matplotlib.figure import Figure

    has_f1 = result["reference"] is not None
    fig = Figure(figsize=(11 if has_f1 else 6, 4.2), dpi=100)
    axes = fig.subplots(1, 2 if has_f1 else 1, squeeze=False)[0]
    styles = {"TLDP-L": "o-", "TLDP-G": "s-", "Laplace": "^--", "Gaussian": "v--",
              "MVG": "D-.", "IDN": "x-.", "TLDP-L-w": "o:", "TLDP-G-w": "s:", "privunit": "*-"}
    panels = ([("f1", "weighted F1 (train perturbed, test clean)")] if has_f1 else []) + \
             [("mean_l2_error", "mean ‖Z‖₂ per record (log scale)")]
    for ax, (key, title) in zip(axes, panels):
        for method in result["methods"]:
            rows = [r for r in result["rows"] if r["method"] == method]
            spread = ([r["f1_std"] or 0.0 for r in rows] if key == "f1" and result.get("repeats", 1) > 1
                      else None)
            ax.errorbar([r[x_key] for r in rows], [r[key] for r in rows], yerr=spread,
                        fmt=styles.get(method, "o-"), capsize=2, label=method)
        if key == "f1":
            ref = result["reference"]
            ax.axhline(ref["f1_clean"], color="k", lw=1, label="clean training data")
            ax.axhline(ref["f1_majority_class"], color="grey", lw=1, ls=":", label="majority class")
            ax.set_ylim(0, 1.02)
        else:
            ax.set_yscale("log")
        ax.set_xscale("log")
        ax.set_xlabel(x_label)
        ax.set_title(title, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{Path(result['original']).name}: {result['records']} records × "
                 f"{result['elements_per_record']} elements", fontsize=10)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()

