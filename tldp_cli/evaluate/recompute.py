"""The manifest's parameters recomputed: the calibration perturb made for the original's arrays,
rebuilt from the options the manifest states (run_manifest.options_of_manifest), and every
figure it states (scale, p, expected error, the certified figures) checked against a
fresh calibration (mechanisms.calibrate) and certification (accounting.certify_all)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import numpy as np

from tldp_cli.errors import InputError, UsageError, reason_of
from tldp_cli.evaluate.common import finite
from tldp_cli.privacy.mechanisms import Calibration, calibrate
from tldp_cli.run import manifest as manifest_mod
from tldp_cli.run.calibration import Calibrated, calibrate_run
from tldp_cli.run.run_manifest import options_of_manifest
from tldp_cli.sampling import discrete


def _close(a: Any, b: Any, rel: float = 1e-6) -> bool:
    if a is None or b is None:
        return a is None and b is None
    if isinstance(a, (bool, str, list, dict)):  # a stated figure that is no number (a damaged manifest)
        return False
    a, b = float(a), float(b)
    if math.isinf(a) or math.isinf(b):
        return a == b
    return math.isclose(a, b, rel_tol=rel, abs_tol=1e-300)


def _dtype(name: Any) -> np.dtype:
    """A manifest input's dtype; names NumPy lacks (bfloat16) are floating point."""
    try:
        return np.dtype(name)
    except TypeError:
        return np.dtype(np.float32)


def _grid(m: dict, dtypes: list[np.dtype] | None, where: object) -> discrete.Grid | None:
    """The discrete noises' grid, resolved as the pipeline does from the declared range, the
    data's dtypes (None: the manifest's inputs) and --granularity (None when the manifest says
    it was automatic); None for the continuous noises."""
    if not discrete.is_discrete(m["noise"]):
        return None
    lo, hi = (float(v) for v in m["value_range"])
    # Several declared ranges: each range group has its own grid, from its own arrays'
    # dtypes; the top-level fields describe the group of the largest record.
    groups = [g for g in m.get("range_groups") or []
              if isinstance(g, dict) and g.get("value_range") == m["value_range"]]
    if groups:
        dtypes = [_dtype(d) for g in groups for d in g.get("input_dtypes") or []]
    elif dtypes is None:
        dtypes = [_dtype(i.get("dtype")) for i in m.get("inputs") or [] if isinstance(i, dict)]
    automatic = str((m.get("grid") or {}).get("rule", "")).startswith("automatic")
    return discrete.resolve_grid(lo, hi, dtypes, None if automatic else m.get("granularity"),
                                 float(m["epsilon"]), where)


def _range_width(m: dict, grid: discrete.Grid | None) -> float:
    """What calibrate takes as range_width: hi - lo, or the grid's width (discrete noises)."""
    lo, hi = (float(v) for v in m["value_range"])
    return hi - lo if grid is None else grid.range_width


def _recomputed(m: dict, calibrations: list[tuple[Calibration, int]] | None, grid: discrete.Grid | None,
                records: list[list[Calibration]] | None = None
                ) -> tuple[Calibration, list[tuple[Calibration, int]], dict]:
    """The largest record's calibration, every calibration with its records, and their
    certification as a manifest's accounting states it. `calibrations`: those of the
    original's arrays; None: one record size, the manifest's elements_per_record."""
    if not calibrations:
        acc = m.get("accounting") or {}
        calib = calibrate(mechanism=m["mechanism"], noise=m["noise"], budget=m["budget"],
                          epsilon=float(m["epsilon"]), range_width=_range_width(m, grid),
                          elements=int(m["elements_per_record"]),
                          dp_delta=float(acc.get("dp_delta", 1e-5)),
                          rows=(acc.get("designed") or {}).get("rows"),
                          granularity=grid.granularity if grid is not None else None)
        calibrations = [(calib, int(m.get("records") or 0))]
    largest = max((c for c, _ in calibrations), key=lambda c: (c.elements, -c.scale))
    from tldp_cli.privacy import accounting  # here: usage and path errors never import it
    certified = accounting.certify_all([c for c, _ in calibrations], records or None)
    return largest, calibrations, manifest_mod.accounting_entry(certified)


def _row_datasets(m: dict, jobs: list) -> list[list[str]]:
    """The arrays each subject's record spans, as the manifest states them; refuses names
    the original does not have."""
    rows = m.get("row_datasets") or []
    names = {job.name for job in jobs}
    if not (isinstance(rows, list) and all(isinstance(row, list) and set(row) <= names for row in rows)):
        raise InputError(f"the manifest's row_datasets {rows!r} do not name arrays of the original")
    return rows


def _mismatch(field: str, stated: Any, expected: Any, exact: bool = False) -> list[dict]:
    """[the mismatch] where the manifest's `stated` value is not the recomputed `expected`
    (equal if `exact`, else within _close's tolerance), else []."""
    same = stated == expected if exact else _close(stated, expected)
    return [] if same else [{"field": field, "manifest": stated, "recomputed": expected}]


def _calibration_mismatches(stated: list, expected: list[dict]) -> list[dict]:
    """The manifest's `calibrations` against the recomputed entries, field by field."""
    found = [] if len(stated) == len(expected) else _mismatch("calibrations", len(stated), len(expected))
    for i, (stated_entry, entry) in enumerate(zip(stated, expected)):
        stated_entry = stated_entry or {}
        for key, value in entry.items():
            if isinstance(value, dict):  # privunit: its split, field by field
                for sub, expected_value in value.items():
                    found += _mismatch(f"calibrations[{i}].{key}.{sub}", (stated_entry.get(key) or {}).get(sub),
                                       expected_value, exact=isinstance(expected_value, list))
            else:
                found += _mismatch(f"calibrations[{i}].{key}", stated_entry.get(key), value)
    return found


def _scope_mismatches(stated: dict, cert: dict, calibrations: list[tuple[Calibration, int]]) -> list[dict]:
    """The manifest's accounting per element, per record and per file against the
    recomputed certificate `cert` and the file's figures certified afresh."""
    figures = ("epsilon", "delta", "rho", "point_mass_delta")
    found: list[dict] = []
    for scope in ("per_element", "per_record"):
        found += _figure_mismatches(f"accounting.{scope}", stated.get(scope) or {}, cert[scope], figures)
    # Everything the run released, all its records composed (perturb always states it).
    from tldp_cli.privacy import accounting  # here: usage and path errors never import it
    per_file = manifest_mod.file_entry(
        accounting.certify_file([(str(i), c, n) for i, (c, n) in enumerate(calibrations)]).per_file)
    return found + _figure_mismatches("accounting.per_file", stated.get("per_file") or {}, per_file,
                                      (*figures, "records", "elements"))


def _figure_mismatches(where: str, stated: dict, recomputed: dict, keys: tuple[str, ...]) -> list[dict]:
    """One scope's `keys` and its approx epsilon and delta, stated against recomputed."""
    found: list[dict] = []
    for key in keys:
        found += _mismatch(f"{where}.{key}", stated.get(key), recomputed[key])
    for key in ("epsilon", "delta"):
        found += _mismatch(f"{where}.approx.{key}", (stated.get("approx") or {}).get(key), recomputed["approx"][key])
    return found


def check_parameters(m: dict, calibrations: list[tuple[Calibration, int]] | None = None,
                     dtypes: list[np.dtype] | None = None,
                     records: list[list[Calibration]] | None = None) -> dict:
    """The manifest's figures against a fresh calibration and certification. `calibrations`:
    each record size's calibration (from the original's arrays) and its number of records;
    `dtypes`: the original's arrays' (None: the manifest's inputs'); `records`: the
    calibrations of the arrays each subject's record spans (accounting.certify_all)."""
    mismatches: list[dict] = []

    def compare(field: str, stated: Any, expected: Any):
        mismatches.extend(_mismatch(field, stated, expected))

    try:
        grid = _grid(m, dtypes, "the manifest")
        compare("range_width", m["range_width"], _range_width(m, grid))
        if grid is not None:
            compare("granularity", m.get("granularity"), grid.granularity)
        calib, calibrations, cert = _recomputed(m, calibrations, grid, records)
    except (KeyError, TypeError, ValueError, UsageError) as exc:
        return {"check": "parameters", "passed": False,
                "detail": f"the manifest's mechanism cannot be recomputed ({reason_of(exc)})", "mismatches": []}
    weights = m.get("weights")
    factor = 1 - float((weights or {}).get("min") or 0.0)  # min may be withheld (data-derived mask)
    compare("noise_scale", m.get("noise_scale"), calib.scale)
    compare("calibration_epsilon", m.get("calibration_epsilon"), calib.element_epsilon)
    compare("retain_probability", m.get("retain_probability"), max(c.p for c, _ in calibrations) * factor)
    logs = [c.p_log10 for c, _ in calibrations if c.p_log10 is not None]
    log10 = None if not logs or factor <= 0 else max(logs) + math.log10(factor)
    compare("retain_probability_log10", m.get("retain_probability_log10"), log10)
    compare("expected_l2_error_per_record", m.get("expected_l2_error_per_record"),
            finite(calib.expected_l2_error()))
    if len(calibrations) > 1 or "calibrations" in m:
        mismatches += _calibration_mismatches(m.get("calibrations") or [],
                                              manifest_mod.calibration_entries(calibrations, weights))
    stated = m.get("accounting") or {}
    mismatches += _scope_mismatches(stated, cert, calibrations)
    if "privunit" in stated or "privunit" in cert:  # the split and its certified figures
        for key in ("k", "gamma", "p", "epsilon0", "q", "q_lower", "q_upper", "nominal_epsilon", "epsilon",
                    "margin", "expected_alignment"):
            compare(f"accounting.privunit.{key}", (stated.get("privunit") or {}).get(key),
                    (cert.get("privunit") or {}).get(key))
        for key in ("k", "gamma", "p", "reference"):
            compare(f"privunit.{key}", (m.get("privunit") or {}).get(key), getattr(calib.privunit, key, None))
        mismatches += _mismatch("privunit.basis.sha256", ((m.get("privunit") or {}).get("basis") or {}).get("sha256"),
                                calib.privunit.basis_sha256 if calib.privunit else None, exact=True)
    if "designed" in stated or "designed" in cert:  # MVG, IDN
        for key in ("epsilon", "delta"):
            compare(f"accounting.designed.{key}", (stated.get("designed") or {}).get(key),
                    (cert.get("designed") or {}).get(key))
    detail = ("scale, p, expected error and certified figures agree with the mechanism"
              if not mismatches else
              "inconsistent with its mechanism: " + ", ".join(
                  f"{x['field']} {x['manifest']!r} (recomputed {x['recomputed']!r})" for x in mismatches[:4]))
    return {"check": "parameters", "passed": not mismatches, "detail": detail, "mismatches": mismatches}


def recompute_calibration(m: dict, jobs: list, original: Path, manifest_path: Path, per_tensor: bool,
                          checks: list[dict], basis: Path | None = None,
                          keeps_dtypes: bool = False) -> tuple[Calibrated, dict[Calibration, int]]:
    """The calibration perturb made for the original's arrays, recomputed from the manifest's
    options (calibration.calibrate_run: one calibration per record size and declared range), the
    records of each calibration, and, first among `checks`, whether the manifest's figures
    hold for them. `basis`: where a privunit run's user basis is (integrity.user_basis_of),
    instead of the path the manifest records."""
    rows = _row_datasets(m, jobs)
    # an evaluation judges a release, whatever consent it took
    options = dataclasses.replace(options_of_manifest(m, original), allow_raw_release=True)
    if basis is not None:
        options = dataclasses.replace(options, basis=str(basis))
    try:
        calibrated = calibrate_run(options, jobs, rows=rows, per_tensor=per_tensor, keeps_dtypes=keeps_dtypes)
    except UsageError as exc:
        raise InputError(f"{manifest_path}: its parameters cannot be calibrated ({reason_of(exc)})") from None
    records_of = calibrated.records_of(jobs)
    checks.insert(0, check_parameters(m, list(records_of.items()), [job.dtype for job in jobs],
                                      [[calibrated.calib_of[name] for name in row] for row in rows]))
    return calibrated, records_of

