"""`evaluate(...)`: the report of `tldp evaluate`, from pairing and integrity
(integrity.py), the recomputed parameters (recompute.py), the noise statistics (noise.py)
and, with labels, the task utility (utility.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tldp_cli import __version__
from tldp_cli.errors import InputError, UsageError
from tldp_cli.evaluate.common import SENSITIVE, Progress, finite
from tldp_cli.evaluate.integrity import (check_hashes, input_named, is_clipped, name_map_of, open_original, pair_up,
                                         read_manifest, shape_check, user_basis_of)
from tldp_cli.evaluate.noise import (ALPHA, Measured, concatenated, error_check, gof_check, measure,
                                     noise_summary, privunit_checks, retained_check)
from tldp_cli.evaluate.recompute import recompute_calibration
from tldp_cli.evaluate.utility import (LABELS_FROM_FOLDERS, check_task, check_task_options, folder_labels,
                                       load_labels, load_records, task_utility)
from tldp_cli.run.calibration import missing_fills

REPORT_SCHEMA = "tldp-evaluation/1"
PER_RECORD_LIMIT = 100_000  # records above this: per-record lists are left out of the report


def evaluate(original: Path, perturbed: Path, manifest_path: Path | None = None, *,
             labels: Path | str | None = None, test: Path | None = None,
             test_labels: Path | str | None = None,
             model: str = "logistic", progress: Progress | None = None,
             per_record: bool = False, name_map: Path | None = None,
             input_format: str | None = None, basis: Path | None = None) -> dict[str, Any]:
    """`per_record`: add each record's MSE, MAE, relative L2 and ||Z|| (PSNR, SSIM) to the
    report (at most PER_RECORD_LIMIT records); by default only their summaries. `name_map`:
    that of a perturb --anonymize-names run (default: beside ORIGINAL). `input_format`: the
    format NAME of ORIGINAL and PERTURBED (--format), None: detected. `basis`: the user basis
    of a privunit --basis FILE.npy run (default: the manifest's privunit.basis.path, or that
    path beside the manifest); its sha256 must be the manifest's."""
    original, perturbed = Path(original), Path(perturbed)
    check_task_options(labels, test, test_labels, model)
    if not perturbed.exists():
        raise InputError(f"{perturbed}: no such file or directory")
    m, manifest_path = read_manifest(perturbed, manifest_path)
    renamed = name_map_of(m, original, name_map, manifest_path)
    m = input_named(m, renamed)
    user_basis = user_basis_of(m, manifest_path, None if basis is None else Path(basis))
    lo, hi = (float(v) for v in m["value_range"])

    checks: list[dict] = list(check_hashes(m, perturbed))
    module, reader = open_original(original, m, input_format)
    try:
        jobs = reader.arrays()
        calibrated, records_of = recompute_calibration(m, jobs, original, manifest_path,
                                                       reader.records_are_tensors, checks,
                                                       None if user_basis is None else user_basis.path,
                                                       reader.keeps_dtypes)
        if calibrated.in_range_markers and "public_missing" not in m:
            reader.markers_are_data(calibrated.in_range_markers)  # values perturb read as data, as it did
        fills = missing_fills(calibrated, jobs)
        if fills:  # missing positions hold what perturb read there
            reader.missing_fill(fills)
        pairing_issues: list[dict] = []
        pairs = pair_up(module, reader, perturbed, m, calibrated.calib_of, pairing_issues, renamed,
                        input_format, user_basis)
        checks.extend(pairing_issues)
        checks.append(shape_check(m, jobs, pairs))
        measured = measure(pairs, m, calibrated, bool(labels), progress)
    finally:
        reader.close()

    stats, done = measured.stats, measured.records
    clipped = is_clipped(m)
    weighted = bool(m.get("weights"))
    p = stats.expected_kept / stats.elements if stats.elements else 0.0
    if m.get("mechanism") == "privunit":
        checks.extend(privunit_checks(stats))
    else:
        checks.append(error_check(stats, list(records_of), weighted, clipped, done))
        checks.append(retained_check(stats, p, weighted, clipped))
        checks.append(gof_check(stats, clipped))
    by_record, noise = noise_summary(stats, measured.data_range, clipped)

    integrity_ok = all(c["passed"] for c in checks if c["check"] in
                       ("parameters", "sha256", "unlisted_files", "pairing", "shapes"))
    statistics_ok = all(c["passed"] is not False for c in checks if c["check"] in
                        ("noise_norm", "retained_fraction", "noise_distribution"))
    report: dict[str, Any] = {
        "schema": REPORT_SCHEMA,
        "sensitive": SENSITIVE,
        "tool": {"name": "tldp", "version": __version__},
        "original": str(original), "perturbed": str(perturbed), "manifest": str(manifest_path),
        "format": module.name,
        **_run_stated(m, (lo, hi), done),
        "ok": integrity_ok and statistics_ok,
        "integrity_ok": integrity_ok,
        "statistics_ok": statistics_ok,
        "alpha": ALPHA,
        "checks": checks,
        "error": noise,
        "per_record": ({k: [finite(v) for v in vals.tolist()] for k, vals in by_record.items()}
                       if per_record and done <= PER_RECORD_LIMIT else None),
        "utility": None,
    }
    if labels:
        report["utility"] = _utility(module, original, pairs, measured, labels, test, test_labels,
                                     model, (lo, hi))
    return report


def _run_stated(m: dict, value_range: tuple[float, float], records: int) -> dict[str, Any]:
    """The report's account of the run, from its manifest: mechanism, budget and guarantee,
    and the records measured."""
    acc = m.get("accounting") or {}
    return {
        "mechanism": m.get("mechanism"), "noise": m.get("noise"), "budget": m.get("budget"),
        "epsilon": m.get("epsilon"), "epsilon_scope": epsilon_scope(m), "value_range": list(value_range),
        "records": records, "elements_per_record": m.get("elements_per_record"),
        "record_sizes": len({c.get("elements_per_record") for c in m.get("calibrations") or []}) or 1,
        "row_records": m.get("row_records"),
        "accounting": {scope: {"epsilon": (acc.get(scope) or {}).get("epsilon"),
                               "delta": (acc.get(scope) or {}).get("delta")}
                       for scope in ("per_element", "per_record")},
    }


def _utility(module, original: Path, pairs: list, measured: Measured, labels, test, test_labels,
             model: str, value_range: tuple[float, float]) -> dict[str, Any]:
    if str(labels) == LABELS_FROM_FOLDERS and module.records_are_files:
        y = folder_labels([p.job.name for p in pairs if p.perturbed_shape == p.job.shape], original)
    else:
        y = load_labels(labels, original)
    test_x, test_y = load_records(test), load_labels(test_labels, test, "--test-labels")
    one_shape = len({p.job.record_shape for p in pairs}) == 1  # said before stacking them fails
    clean = concatenated(measured.clean if one_shape else [])
    noisy = concatenated(measured.noisy if one_shape else [])
    if len(noisy) == 0:
        raise UsageError(f"{original}: task utility needs records of one shape")
    check_task(len(noisy), y, test_x, test_y, pairs[0].job.record_shape, labels, test)
    return task_utility(clean, noisy, y, test_x, test_y, model, value_range)


def epsilon_scope(m: dict) -> str:
    """What the manifest's --eps covers, in words: each element only for TLDP under
    --budget element; the whole record under --budget record and for the baselines, which
    the paper calibrates to the record (MVG and IDN with --dp-delta, by their own design)."""
    eps = f"eps={_g(m.get('epsilon'))}"
    if m.get("budget") == "record":
        return f"{eps} per record (--budget record)"
    if m.get("mechanism") == "tldp":
        return f"{eps} per element"
    if m.get("mechanism") in ("mvg", "idn"):
        delta = (m.get("accounting") or {}).get("dp_delta")
        return f"{eps}, delta={_g(delta)} per record by the mechanism's own design"
    return f"{eps} per record (the paper's calibration of the baseline)"


def _g(value: Any) -> str:
    return "?" if value is None else format(value, "g")

