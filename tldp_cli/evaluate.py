"""`tldp evaluate`: what survived the noise, checked against the manifest, and the
paper's privacy-utility comparison (Type I: train on perturbed records, test on
clean ones, weighted F1).

Plain functions returning dicts; the CLI only parses options and prints.

- `evaluate(...)` pairs ORIGINAL with PERTURBED the way `perturb` wrote them,
  checks integrity (sha256 of every output, shapes and record counts, the
  manifest's parameters recomputed by mechanisms.calibrate and
  accounting.certify_all), measures the noise (per-record MSE, MAE, relative L2,
  PSNR and SSIM for image-shaped records, the empirical norm of the noise
  against Table 5, the retained fraction against p, a Kolmogorov-Smirnov test
  against the manifest's noise distribution) and, with labels, the task utility.
- `sweep(...)` perturbs in memory over a grid of epsilons for TLDP-L, TLDP-G
  and the paper's Laplace, Gaussian, MVG and IDN baselines (and weighted TLDP), and,
  with --budget record, privunit (its default basis and k rule), and
  `write_sweep(...)` writes a CSV, a JSON table and PNG plots.

Statistical checks fail only at ALPHA = 1e-6, so a correct run essentially
never fails one while a wrong scale or distribution fails at once.

Reports and sweeps are computed from the raw data and say so (`sensitive`); the
per-record lists, which give each record's exact norm, are left out unless asked for.
"""

from __future__ import annotations

import csv
import io
import json
import math
from dataclasses import dataclass
import os
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import numpy as np

from tldp_cli import __version__, formats
from tldp_cli.privacy import accounting
from tldp_cli.privacy.distributions import chi_square, density_at_zero, moments
from tldp_cli.sampling import discrete, engine
from tldp_cli.files import output
from tldp_cli.run import manifest as manifest_mod
from tldp_cli.run.pipeline import Plan, PerturbOptions, plan, resolve_range
from tldp_cli.errors import InputError, OutputError, TldpError, UsageError, reason_of
from tldp_cli.formats import FormatOptions
from tldp_cli.privacy.mechanisms import Calibration, calibrate, calibrate_privunit
from tldp_cli.sampling.rng import Streams

REPORT_SCHEMA = "tldp-evaluation/1"
SWEEP_SCHEMA = "tldp-sweep/1"
ALPHA = 1e-6  # significance level of every statistical check
GOF_MAX_SAMPLES = 200_000  # noise values the KS test sees at most (evenly subsampled)
GOF_MIN_SAMPLES = 20
Z_LIMIT = 5.0  # |z| of the noise's squared norm against Table 5 (two-sided ALPHA ~ 6e-7)
PER_RECORD_LIMIT = 100_000  # records above this: per-record lists are left out of the report
# Every report and sweep is computed from the raw data (a record's error and relative
# error give its exact norm), so it says so in its first field.
SENSITIVE = "computed from the raw data: keep it with the raw data, never with the release"
SSIM_WINDOW = 7
BLOCK_ELEMENTS = 1 << 22
MODELS = ("logistic", "mlp")
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

Progress = Callable[[int, int], None]


# --------------------------------------------------------------------------- helpers

def _close(a: Any, b: Any, rel: float = 1e-6) -> bool:
    if a is None or b is None:
        return a is None and b is None
    a, b = float(a), float(b)
    if math.isinf(a) or math.isinf(b):
        return a == b
    return math.isclose(a, b, rel_tol=rel, abs_tol=1e-300)


def _finite(x: float | None) -> float | None:
    """JSON has no NaN/Inf: they become null."""
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else None


def _summary(values: np.ndarray) -> dict[str, float | None]:
    values = np.asarray(values, np.float64)
    finite = values[np.isfinite(values)]
    if finite.size == 0:
        return {"mean": None, "median": None, "min": None, "max": None}
    return {"mean": float(finite.mean()), "median": float(np.median(finite)),
            "min": float(finite.min()), "max": float(finite.max())}


def is_image_shaped(record_shape: tuple[int, ...]) -> bool:
    """(H, W) or (H, W, C) with C in 1, 3, 4 and both sides at least the SSIM window."""
    if len(record_shape) == 2 or (len(record_shape) == 3 and record_shape[-1] in (1, 3, 4)):
        return min(record_shape[:2]) >= SSIM_WINDOW
    return False


def _box_mean(a: np.ndarray, w: int) -> np.ndarray:
    """Mean over every full w x w window of axes 1 and 2 (a 'valid' uniform filter)."""
    c = np.cumsum(np.cumsum(a, axis=1), axis=2)
    c = np.pad(c, [(0, 0), (1, 0), (1, 0)] + [(0, 0)] * (a.ndim - 3))
    s = c[:, w:, w:] - c[:, :-w, w:] - c[:, w:, :-w] + c[:, :-w, :-w]
    return s / (w * w)


def ssim(x: np.ndarray, y: np.ndarray, data_range: float, window: int = SSIM_WINDOW) -> np.ndarray:
    """Mean SSIM per record (Wang et al. 2004) with a uniform window, as scikit-image's
    default: 7 x 7 window, K1 = 0.01, K2 = 0.03, sample covariance, the mean over the
    windows that lie wholly inside the image, averaged over channels.

    x, y: (n, H, W) or (n, H, W, C).
    """
    x = np.asarray(x, np.float64)
    y = np.asarray(y, np.float64)
    c1, c2 = (0.01 * data_range) ** 2, (0.03 * data_range) ** 2
    n_pix = window * window
    cov_norm = n_pix / (n_pix - 1)
    ux, uy = _box_mean(x, window), _box_mean(y, window)
    vx = cov_norm * (_box_mean(x * x, window) - ux * ux)
    vy = cov_norm * (_box_mean(y * y, window) - uy * uy)
    vxy = cov_norm * (_box_mean(x * y, window) - ux * uy)
    s = ((2 * ux * uy + c1) * (2 * vxy + c2)) / ((ux * ux + uy * uy + c1) * (vx + vy + c2))
    return s.reshape(s.shape[0], -1).mean(axis=1)


# --------------------------------------------------------------------------- pairing

class _Pair:
    """One array (or one image) of the original and its perturbed counterpart."""

    def __init__(self, name, job, perturbed_shape, read_perturbed, calib):
        self.name = name
        self.job = job
        self.perturbed_shape = tuple(perturbed_shape)
        self.read_perturbed = read_perturbed
        self.calib = calib


def _image_format(m: dict) -> str:
    """How an image folder's output was written (the manifest's image_output)."""
    return (m.get("image_output") or {}).get("format", "png")


def _is_clipped(m: dict) -> bool:
    """Whether the writer rounded and clipped the noisy values (8/16-bit PNG)."""
    return bool((m.get("image_output") or {}).get("clipped"))


def _open_original(original: Path, m: dict, input_format: str | None):
    module = formats.detect(original, input_format)
    datasets = [i["dataset"] for i in m.get("inputs", []) if isinstance(i, dict) and "dataset" in i]
    options = FormatOptions(datasets=datasets if module.selects_arrays else [],
                            image_format=_image_format(m) if module.records_are_files else "png",
                            skip_bad=bool(m.get("skipped_bad_images")),
                            anonymize_names=module.name_map and bool(m.get("anonymized_names")))
    return module, module.open_reader(original, options)


def _read_output_image(path: Path, has_alpha: bool) -> np.ndarray:
    from tldp_cli.formats import images

    if path.suffix.lower() in (".tif", ".tiff"):
        import tifffile

        pixels = tifffile.imread(path)
        if has_alpha:
            pixels = pixels[..., :-1]
            if pixels.shape[-1] == 1:
                pixels = pixels[..., 0]
        return pixels
    return images._decode(path).colour


def _pairs(module, reader, perturbed: Path, m: dict, calibs: dict[str, Calibration],
           issues: list[dict], renamed: dict[str, str] | None = None,
           input_format: str | None = None) -> list[_Pair]:
    """`renamed`: an --anonymize-names run's name map, original name -> output name;
    `input_format`: --format, which the perturbed data shares with the original."""
    jobs = reader.arrays()
    if module.records_are_files:
        from tldp_cli.formats import images

        fmt = _image_format(m)
        if not perturbed.is_dir():
            raise InputError(f"{perturbed}: the original is a folder of images, so the perturbed "
                             "data must be a folder too")
        pairs = []
        for image in reader.images:
            job = next(j for j in jobs if j.name == image.rel)
            if renamed is not None and image.rel not in renamed:
                issues.append({"check": "pairing", "passed": False,
                               "detail": f"{image.rel}: not in the name map"})
                continue
            out_path = perturbed / (renamed[image.rel] if renamed is not None
                                    else images._output_name(image.rel, fmt))
            if not out_path.is_file():
                issues.append({"check": "pairing", "passed": False,
                               "detail": f"{out_path}: missing (perturbed copy of {image.rel})"})
                continue
            try:
                shape = (1, *_read_output_image(out_path, image.has_alpha).shape)
            except Exception as exc:
                issues.append({"check": "pairing", "passed": False,
                               "detail": f"{out_path}: cannot be read ({reason_of(exc)})"})
                continue

            def read(start, stop, p=out_path, a=image.has_alpha):
                return _read_output_image(p, a)[None]

            pairs.append(_Pair(image.rel, job, shape, read, calibs[job.name]))
        return pairs

    out_module = formats.detect(perturbed, input_format)
    if out_module.name != module.name:
        raise InputError(f"{perturbed}: is {out_module.name} but the original is {module.name}")
    datasets = [j.source["dataset"] for j in jobs if "dataset" in j.source]
    out_reader = out_module.open_reader(perturbed, FormatOptions(datasets=datasets))
    out_jobs = {j.name: j for j in out_reader.arrays()}
    pairs = []
    for job in jobs:
        out = out_jobs.get(job.name)
        if out is None:
            issues.append({"check": "pairing", "passed": False,
                           "detail": f"{perturbed}: has no array {job.name}"})
            continue
        pairs.append(_Pair(job.name, job, out.shape, out.read, calibs[job.name]))
    return pairs


# --------------------------------------------------------------------------- integrity

def _output_root(entries: list[str], perturbed: Path) -> Path | None:
    """The output path the manifest recorded for a folder output (Zarr, images)."""
    name = perturbed.resolve().name
    common = Path(os.path.commonpath(entries)) if entries else None
    if len(entries) == 1:
        common = Path(entries[0]).parent
    while common is not None and common.name and common.name != name:
        common = common.parent if common != common.parent else None
    return common if common is not None and common.name == name else None


def _check_hashes(m: dict, perturbed: Path) -> list[dict]:
    checks = []
    entries = [o.get("path", "") for o in m.get("outputs", []) if isinstance(o, dict)]
    if not entries:
        return [{"check": "sha256", "passed": False, "detail": "the manifest lists no outputs"}]
    if perturbed.is_file():
        located = {Path(entries[0]): perturbed} if len(entries) == 1 else {}
        if len(entries) != 1:
            return [{"check": "sha256", "passed": False,
                     "detail": f"the manifest lists {len(entries)} outputs but {perturbed} is one file"}]
    else:
        root = _output_root(entries, perturbed)
        if root is None:
            return [{"check": "sha256", "passed": False,
                     "detail": f"the manifest's outputs do not lie under a folder named {perturbed.name}"}]
        located = {Path(e): perturbed / Path(e).relative_to(root) for e in entries}
    bad, missing = [], []
    for entry in m["outputs"]:
        actual = located[Path(entry["path"])]
        if not actual.is_file():
            missing.append(str(actual))
        elif manifest_mod.sha256_file(actual) != entry.get("sha256"):
            bad.append(str(actual))
    checks.append({"check": "sha256", "passed": not bad and not missing, "files": len(entries),
                   "mismatched": bad, "missing": missing,
                   "detail": (f"{len(bad)} file(s) differ from the manifest's sha256"
                              + (f", {len(missing)} missing" if missing else "")) if bad or missing
                   else f"all {len(entries)} output file(s) match"})
    if perturbed.is_dir():
        listed = {a.resolve() for a in located.values()}
        extra = sorted(str(p) for p in perturbed.rglob("*") if p.is_file() and p.resolve() not in listed)
        checks.append({"check": "unlisted_files", "passed": not extra, "files": extra,
                       "detail": f"{len(extra)} file(s) not in the manifest" if extra
                       else "no file outside the manifest"})
    return checks


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
    if dtypes is None:
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
    certification. `calibrations`: those of the original's arrays; None: one record size,
    the manifest's elements_per_record."""
    if not calibrations:
        acc = m.get("accounting") or {}
        calib = calibrate(mechanism=m["mechanism"], noise=m["noise"], budget=m["budget"],
                          epsilon=float(m["epsilon"]), range_width=_range_width(m, grid),
                          elements=int(m["elements_per_record"]),
                          dp_delta=float(acc.get("dp_delta", 1e-5)),
                          rows=(acc.get("designed") or {}).get("rows"), granularity=grid and grid.granularity)
        calibrations = [(calib, int(m.get("records") or 0))]
    largest = max((c for c, _ in calibrations), key=lambda c: (c.elements, -c.scale))
    return largest, calibrations, accounting.certify_all([c for c, _ in calibrations], records or None)


def _row_datasets(m: dict, jobs: list) -> list[list[str]]:
    """The arrays each subject's record spans, as the manifest states them; refuses names
    the original does not have."""
    rows = m.get("row_datasets") or []
    names = {job.name for job in jobs}
    if not (isinstance(rows, list) and all(isinstance(row, list) and set(row) <= names for row in rows)):
        raise InputError(f"the manifest's row_datasets {rows!r} do not name arrays of the original")
    return rows


def check_parameters(m: dict, calibrations: list[tuple[Calibration, int]] | None = None,
                     dtypes: list[np.dtype] | None = None,
                     records: list[list[Calibration]] | None = None) -> dict:
    """The manifest's figures against a fresh calibration and certification. `calibrations`:
    each record size's calibration (from the original's arrays) and its number of records;
    `dtypes`: the original's arrays' (None: the manifest's inputs'); `records`: the
    calibrations of the arrays each subject's record spans (accounting.certify_all)."""
    mismatches = []

    def compare(field: str, stated: Any, expected: Any):
        if not _close(stated, expected):
            mismatches.append({"field": field, "manifest": stated, "recomputed": expected})

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
            _finite(calib.expected_l2_error()))
    if len(calibrations) > 1 or "calibrations" in m:
        stated_list = m.get("calibrations") or []
        expected_list = manifest_mod.calibration_entries(calibrations, weights)
        if len(stated_list) != len(expected_list):
            compare("calibrations", len(stated_list), len(expected_list))
        for i, (s, r) in enumerate(zip(stated_list, expected_list)):
            for key, value in r.items():
                if isinstance(value, dict):  # privunit: its split, field by field
                    for sub, expected in value.items():
                        stated_value = ((s or {}).get(key) or {}).get(sub)
                        if isinstance(expected, list):
                            if stated_value != expected:
                                mismatches.append({"field": f"calibrations[{i}].{key}.{sub}",
                                                   "manifest": stated_value, "recomputed": expected})
                        else:
                            compare(f"calibrations[{i}].{key}.{sub}", stated_value, expected)
                else:
                    compare(f"calibrations[{i}].{key}", (s or {}).get(key), value)
    stated = m.get("accounting") or {}
    for scope in ("per_element", "per_record"):
        s, r = stated.get(scope) or {}, cert[scope]
        for key in ("epsilon", "delta", "rho", "point_mass_delta"):
            compare(f"accounting.{scope}.{key}", s.get(key), r[key])
        for key in ("epsilon", "delta"):
            compare(f"accounting.{scope}.approx.{key}", (s.get("approx") or {}).get(key), r["approx"][key])
    # Everything the run released, all its records composed (perturb always states it).
    s = stated.get("per_file") or {}
    r = accounting.certify_file([(str(i), c, n) for i, (c, n) in enumerate(calibrations)])["per_file"]
    for key in ("epsilon", "delta", "rho", "point_mass_delta", "records", "elements"):
        compare(f"accounting.per_file.{key}", s.get(key), r[key])
    for key in ("epsilon", "delta"):
        compare(f"accounting.per_file.approx.{key}", (s.get("approx") or {}).get(key), r["approx"][key])
    if "privunit" in stated or "privunit" in cert:  # the split and its certified figures
        for key in ("k", "gamma", "p", "epsilon0", "q", "q_lower", "q_upper", "nominal_epsilon", "epsilon",
                    "margin", "expected_alignment"):
            compare(f"accounting.privunit.{key}", (stated.get("privunit") or {}).get(key),
                    (cert.get("privunit") or {}).get(key))
        for key in ("k", "gamma", "p", "reference"):
            compare(f"privunit.{key}", (m.get("privunit") or {}).get(key), getattr(calib.privunit, key, None))
        stated_sha = ((m.get("privunit") or {}).get("basis") or {}).get("sha256")
        actual_sha = calib.privunit.basis_sha256 if calib.privunit else None
        if stated_sha != actual_sha:
            mismatches.append({"field": "privunit.basis.sha256", "manifest": stated_sha, "recomputed": actual_sha})
    if "designed" in stated or "designed" in cert:  # MVG, IDN
        for key in ("epsilon", "delta"):
            compare(f"accounting.designed.{key}", (stated.get("designed") or {}).get(key),
                    (cert.get("designed") or {}).get(key))
    detail = ("scale, p, expected error and certified figures agree with the mechanism"
              if not mismatches else
              "inconsistent with its mechanism: " + ", ".join(
                  f"{x['field']} {x['manifest']!r} (recomputed {x['recomputed']!r})" for x in mismatches[:4]))
    return {"check": "parameters", "passed": not mismatches, "detail": detail, "mismatches": mismatches}


# --------------------------------------------------------------------------- noise

class _NoiseStats:
    def __init__(self, total_elements: int):
        self.step = max(1, total_elements // GOF_MAX_SAMPLES)
        self.mse, self.mae, self.rel, self.l2, self.psnr, self.ssim = [], [], [], [], [], []
        self.kept = 0
        self.expected_kept = 0.0  # sum of p over the elements: records of several sizes differ in p
        self.elements = 0
        self.rounding = 0.0  # expected coincidental equalities from float rounding
        self.sum_sq = 0.0
        self.expected_sq = 0.0
        self.var_sq = 0.0
        # noise samples by scale: continuous noises pooled at the first scale (rescaled),
        # discrete noises one group per scale (integer noise cannot be rescaled)
        self.gof: dict[float, list[np.ndarray]] = {}
        self.noise_name: str | None = None
        self.noise_scale: float | None = None
        self.alignment: list[np.ndarray] = []  # privunit: cosines of released and true coefficients

    def add(self, x: np.ndarray, y: np.ndarray, calib: Calibration, data_range: float | None,
            basis=None):
        n = x.shape[0]
        if calib.granularity:  # discrete noise on float data: the noise is added to the snapped values
            x = np.rint(x.astype(np.float64) / calib.granularity) * calib.granularity
        if calib.privunit is not None:
            self._metrics(x, y, data_range)
            self._add_alignment(x, y, calib, basis)
            return
        sq, z, elements = self._metrics(x, y, data_range)
        # retained: exact equality in the output dtype
        equal = y.reshape(n, -1) == x.reshape(n, -1).astype(y.dtype)
        self._add_noise(x, y, z, sq, elements, equal, calib)

    def _add_alignment(self, x: np.ndarray, y: np.ndarray, calib: Calibration, basis) -> None:
        """privunit: the cosine between each released record's coefficients (divided by the
        write-back's public weights) and the raw record's, both measured from the reference
        point (the written values are clipped to the range, so it is a measurement, not
        E<V, u> itself)."""
        basis = engine.privunit_basis(calib, basis)
        weights = engine.write_back_weights(calib, basis)
        released = engine.record_directions(y.astype(np.float64), calib, basis,
                                            None if weights is None else 1.0 / weights)
        raw = engine.record_directions(x.astype(np.float64), calib, basis)
        self.alignment.append(np.einsum("ij,ij->i", released, raw))

    def _metrics(self, x: np.ndarray, y: np.ndarray, data_range: float | None):
        """Each record's error measures; returns (|z|^2 per record, z, elements)."""
        n = x.shape[0]
        xf = x.reshape(n, -1).astype(np.float64)
        yf = y.reshape(n, -1).astype(np.float64)
        z = yf - xf
        sq = (z * z).sum(axis=1)
        elements = xf.shape[1]
        self.mse.append(sq / elements)
        self.mae.append(np.abs(z).mean(axis=1))
        self.l2.append(np.sqrt(sq))
        with np.errstate(divide="ignore", invalid="ignore"):
            self.rel.append(np.sqrt(sq) / np.sqrt((xf * xf).sum(axis=1)))
        if data_range is not None:
            with np.errstate(divide="ignore"):
                self.psnr.append(10 * np.log10(data_range**2 / (sq / elements)))
            self.ssim.append(ssim(x.astype(np.float64), y.astype(np.float64), data_range))
        return sq, z, elements

    def _add_noise(self, x, y, z, sq, elements, equal, calib: Calibration) -> None:
        """The noise's statistics: kept values, the squared norm against Table 5, a sample for
        the goodness-of-fit test."""
        n = x.shape[0]
        self.kept += int(equal.sum())
        self.elements += equal.size
        (m2, m4), f0 = moments(calib.noise, calib.scale), density_at_zero(calib.noise, calib.scale)
        if calib.noise.startswith("discrete-"):  # discrete noise is 0 with probability f0
            self.rounding += equal.size * f0
        elif y.dtype.kind == "f":
            ulp = np.spacing(np.abs(x.reshape(n, -1).astype(y.dtype))).astype(np.float64)
            self.rounding += float(np.minimum(ulp * f0, 1.0).sum())
        q = 1 - calib.p
        if calib.granularity:  # noise in grid steps
            m2, m4 = m2 * calib.granularity**2, m4 * calib.granularity**4
        self.sum_sq += float(sq.sum())
        self.expected_sq += n * elements * q * m2
        self.var_sq += n * elements * (q * m4 - (q * m2) ** 2)
        sample = z.reshape(-1)[~equal.reshape(-1)][:: self.step]
        if calib.granularity:  # discrete noise: in grid steps, whatever the array's grid
            sample = np.rint(sample / calib.granularity)
        if self.noise_name is None:
            self.noise_name, self.noise_scale = calib.noise, calib.scale
        scale = calib.scale
        if scale != self.noise_scale and not calib.noise.startswith("discrete-"):
            # Records of another size (model tensors, --budget record): same family, rescaled.
            sample, scale = sample * (self.noise_scale / scale), self.noise_scale
        self.gof.setdefault(scale, []).append(sample)
        self.expected_kept += equal.size * calib.p


def _privunit_checks(stats: _NoiseStats, m: dict) -> list[dict]:
    """privunit: no noise is added, so the noise checks do not apply; the alignment of the
    released records with the raw ones is measured (not tested: the written values are
    clipped to the range, which moves their direction)."""
    skipped = [{"check": name, "passed": None, "status": "skipped",
                "detail": "privunit releases each record's direction (one PrivUnit draw written back), "
                          "not the record plus noise"}
               for name in ("noise_norm", "retained_fraction", "noise_distribution")]
    cosines = np.concatenate(stats.alignment) if stats.alignment else np.empty(0)
    expected = ((m.get("accounting") or {}).get("privunit") or {}).get("expected_alignment")
    mean = float(cosines.mean()) if cosines.size else None
    measured = {"check": "privunit_alignment", "passed": None, "status": "measured",
                "records": int(cosines.size), "mean_cosine": mean, "expected_alignment": expected,
                "detail": (f"mean cosine {mean:.3g} between the released and the raw records' coefficients "
                           f"(from the reference point); E<V,u> of the mechanism {expected:.3g} (the "
                           "written records are clipped to the range, which moves them)"
                           if mean is not None and expected is not None else "no records compared")}
    return skipped + [measured]


def _retained_check(stats: _NoiseStats, p: float, weighted: bool, clipped: bool) -> dict:
    from scipy import stats as st

    n, k = stats.elements, stats.kept
    allowance = stats.rounding / n if n else 0.0
    p_eff = min(1.0, p + (1 - p) * allowance)
    ci = st.binomtest(k, n, p_eff).proportion_ci(0.95) if n else None
    out = {"check": "retained_fraction", "retained": k, "elements": n,
           "fraction": k / n if n else None, "retain_probability": p,
           "float_rounding_allowance": allowance, "expected_fraction": p_eff,
           "ci95": [ci.low, ci.high] if ci else None}
    if clipped:
        out.update(passed=None, status="skipped",
                   detail="output rounded and clipped: equal values also come from rounding and "
                          "clipping, so the retained fraction is not observable")
        return out
    if n == 0:
        out.update(passed=None, status="skipped", detail="no elements")
        return out
    alternative = "greater" if weighted else "two-sided"  # weights only lower p
    pvalue = float(st.binomtest(k, n, p_eff, alternative=alternative).pvalue)
    passed = pvalue >= ALPHA
    out.update(pvalue=pvalue, passed=passed, status="passed" if passed else "failed",
               detail=f"{k} of {n} values kept unchanged; p = {p:.3g}"
                      + (" (w = 0; weights lower it)" if weighted else ""))
    return out


def _error_check(stats: _NoiseStats, calibs: list[Calibration], weighted: bool, clipped: bool,
                 records: int) -> dict:
    records = max(records, 1)
    rms = math.sqrt(stats.sum_sq / records)
    expected_rms = math.sqrt(stats.expected_sq / records)
    mean_l2 = float(np.concatenate(stats.l2).mean()) if stats.l2 else None
    z = (stats.sum_sq - stats.expected_sq) / math.sqrt(stats.var_sq) if stats.var_sq > 0 else None
    out = {"check": "noise_norm", "mean_l2": mean_l2, "rms_l2": rms,
           "expected_l2": expected_rms, "expected_l2_per_record": sorted({c.expected_l2_error() for c in calibs}),
           "ratio": rms / expected_rms if expected_rms > 0 else None, "z": _finite(z)}
    if clipped:
        out.update(passed=None, status="skipped",
                   detail="output rounded and clipped: clipping lowers the error below Table 5's "
                          "figure, rounding adds up to 0.5 per value; reported, not tested")
        return out
    if z is None:
        out.update(passed=None, status="skipped", detail="no noise expected")
        return out
    limit = Z_LIMIT
    passed = z <= limit if weighted else abs(z) <= limit
    out.update(passed=passed, status="passed" if passed else "failed",
               detail=f"sqrt(mean ||Z||^2) = {rms:.4g} against Table 5's {expected_rms:.4g} "
                      f"(z = {z:+.2f}" + ("; weights keep more values, so only an excess fails)"
                                           if weighted else ")"))
    return out


def _gof_check(stats: _NoiseStats, clipped: bool) -> dict:
    from scipy import stats as st

    groups = {scale: np.concatenate(parts) for scale, parts in stats.gof.items()}
    sample = np.concatenate(list(groups.values())) if groups else np.empty(0)
    out = {"check": "noise_distribution", "test": "Kolmogorov-Smirnov",
           "distribution": stats.noise_name, "scale": stats.noise_scale, "samples": int(sample.size)}
    if clipped:
        out.update(passed=None, status="skipped",
                   detail="output rounded and clipped to integers: the noise is not observed "
                          "exactly, so no goodness-of-fit test")
        return out
    if sample.size < GOF_MIN_SAMPLES:
        out.update(passed=None, status="skipped",
                   detail=f"only {sample.size} perturbed values (fewer than {GOF_MIN_SAMPLES})")
        return out
    if stats.noise_name.startswith("discrete-"):
        return _chi_square_check(stats, groups, out)
    name = "laplace" if stats.noise_name == "laplace" else "norm"
    result = st.kstest(sample, name, args=(0.0, stats.noise_scale))
    passed = bool(result.pvalue >= ALPHA)
    out.update(statistic=float(result.statistic), pvalue=float(result.pvalue), passed=passed,
               status="passed" if passed else "failed",
               detail=f"KS D = {result.statistic:.4f}, p-value = {result.pvalue:.3g} "
                      f"against {stats.noise_name}(scale {stats.noise_scale:.4g})")
    return out


def _chi_square_check(stats: _NoiseStats, groups: dict[float, np.ndarray], out: dict) -> dict:
    """Discrete noises: a chi-square test per noise scale (records of several sizes under
    --budget record or the baselines get different scales), each against its own exact pmf;
    the run fails if the smallest p-value, times the number of scales tested (Bonferroni),
    is below ALPHA. Scales with fewer than GOF_MIN_SAMPLES perturbed values are not tested."""
    results = []
    for scale, sample in sorted(groups.items()):
        entry = {"scale": scale, "samples": int(sample.size)}
        if sample.size >= GOF_MIN_SAMPLES:
            statistic, pvalue, dof = chi_square(sample, stats.noise_name, scale,
                                                exclude_zero=True)
            entry.update(statistic=statistic, dof=dof, pvalue=pvalue)
        results.append(entry)
    tested = [r for r in results if "pvalue" in r]
    out.update(test="chi-square", groups=results)
    if not tested:
        out.update(passed=None, status="skipped",
                   detail=f"fewer than {GOF_MIN_SAMPLES} perturbed values at every noise scale")
        return out
    worst = min(tested, key=lambda r: r["pvalue"])
    pvalue = min(1.0, worst["pvalue"] * len(tested))
    passed = bool(pvalue >= ALPHA)
    out.update(statistic=worst["statistic"], pvalue=pvalue, passed=passed,
               status="passed" if passed else "failed")
    if len(results) == 1:
        out["detail"] = (f"chi-square = {worst['statistic']:.4g} ({worst['dof']} dof), p-value = "
                         f"{pvalue:.3g} against {stats.noise_name}(scale {worst['scale']:.4g}) without 0")
    else:
        out["detail"] = (f"chi-square per noise scale ({len(tested)} of {len(results)} scales tested), "
                         f"smallest p-value {worst['pvalue']:.3g} (scale {worst['scale']:.4g}; "
                         f"Bonferroni {pvalue:.3g}) against {stats.noise_name} without 0")
    return out


# --------------------------------------------------------------------------- utility

def load_records(path: Path, dataset: str | None = None, input_format: str | None = None) -> np.ndarray:
    """Every record of a dataset tldp can read, in memory (records along axis 0).

    Image folders are stacked in the readers' order (sorted relative paths); they
    must share one shape. HDF5/Zarr inputs with several arrays need `dataset`.
    """
    path = Path(path)
    module = formats.detect(path, input_format)
    reader = module.open_reader(path, FormatOptions(datasets=[dataset] if dataset else []))
    try:
        jobs = reader.arrays()
        if module.records_are_files:
            shapes = {j.shape for j in jobs}
            if len(shapes) > 1:
                raise InputError(f"{path}: the images have different shapes; cannot stack them")
            return np.concatenate([j.read(0, 1) for j in jobs])
        if len(jobs) > 1:
            names = ", ".join(j.name for j in jobs)
            raise UsageError(f"{path}: holds several arrays ({names}); name one with --dataset")
        return jobs[0].read(0, jobs[0].records)
    finally:
        reader.close()


LABELS_FROM_FOLDERS = "subfolders"
LABELS_DATASET_PREFIX = "dataset="


def load_labels(spec: Path | str, data: Path | None = None, option: str = "--labels") -> np.ndarray:
    """Class labels, one per record of `data`, in the order tldp reads the records.

    `spec` is a 1-D array file (.npy, or an HDF5/Zarr file holding one array),
    "dataset=NAME" for the array NAME inside `data` (HDF5/Zarr), or "subfolders"
    for the name of the top-level subfolder each image of the folder `data` is in.
    """
    text = str(spec)
    if text == LABELS_FROM_FOLDERS:
        return _folder_labels(data, option)
    if text.startswith(LABELS_DATASET_PREFIX):
        name = text[len(LABELS_DATASET_PREFIX):]
        if not name:
            raise UsageError(f"{option} dataset=NAME needs the name of an array")
        if data is None or not formats.detect(Path(data)).shares_rows:
            raise UsageError(f"{option} {text}: {data} is not an HDF5 file or Zarr store")
        labels, where = load_records(Path(data), name), f"{data}: dataset {name}"
    else:
        path = Path(spec)
        if not path.exists():
            raise InputError(f"{path}: no such file or directory")
        where = str(path)
        if path.suffix == ".npy":
            try:
                labels = np.load(path, allow_pickle=False)
            except Exception as exc:
                raise InputError(f"{path}: not a readable .npy array ({reason_of(exc)})") from None
        else:
            labels = load_records(path)
    if labels.ndim != 1:
        raise InputError(f"{where}: labels must be a 1-D array, not shape {labels.shape}")
    return labels


def _folder_labels(data: Path | None, option: str) -> np.ndarray:
    if data is None or not formats.detect(Path(data)).records_are_files:
        raise UsageError(f"{option} subfolders: {data} is not a folder of images")
    reader = formats.detect(Path(data)).open_reader(Path(data), FormatOptions())
    try:
        return folder_labels([job.name for job in reader.arrays()], Path(data))
    finally:
        reader.close()


def folder_labels(names: list[str], folder: Path) -> np.ndarray:
    """The top-level subfolder of each image path (relative to `folder`)."""
    labels = []
    for name in names:
        parts = Path(name).parts
        if len(parts) < 2:
            raise InputError(f"{folder / name}: not inside a subfolder, so it has no label "
                             "(labels from subfolders need every image in one)")
        labels.append(parts[0])
    return np.array(labels)


def _need(module: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise TldpError(f"this needs {module.split('.')[0]}; install the evaluation extra: "
                        "pip install 'tldp-tensors[eval]'") from None


def _classifier(model: str):
    _need("sklearn")
    if model == "logistic":
        from sklearn.linear_model import LogisticRegression

        return LogisticRegression(max_iter=300)
    if model == "mlp":
        from sklearn.neural_network import MLPClassifier

        return MLPClassifier(hidden_layer_sizes=(128,), max_iter=200, random_state=0)
    raise UsageError(f"--model must be one of {', '.join(MODELS)}, not {model!r}")


def weighted_f1(train_x: np.ndarray, train_y: np.ndarray, test_x: np.ndarray, test_y: np.ndarray,
                model: str, value_range: tuple[float, float]) -> float:
    """Fit `model` on train, return the weighted F1 on test (the paper's formula).

    Features are the flattened records scaled by the declared range, (x - lo) / width,
    the same map for training and test: nothing is fitted on the test data.
    """
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.metrics import f1_score

    lo, hi = value_range

    def features(x):
        return (np.asarray(x, np.float64).reshape(len(x), -1) - lo) / (hi - lo)

    clf = _classifier(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        warnings.simplefilter("ignore", RuntimeWarning)
        clf.fit(features(train_x), train_y)
        predicted = clf.predict(features(test_x))
    return float(f1_score(test_y, predicted, average="weighted"))


def _check_task(train_records: int, labels: np.ndarray, test_x: np.ndarray, test_y: np.ndarray,
                record_shape: tuple[int, ...], labels_path, test_path) -> None:
    if len(labels) != train_records:
        raise UsageError(f"{labels_path}: {len(labels)} labels for {train_records} records")
    if len(test_y) != len(test_x):
        raise UsageError(f"{test_path}: {len(test_x)} test records but {len(test_y)} test labels")
    if tuple(test_x.shape[1:]) != tuple(record_shape):
        raise UsageError(f"{test_path}: test records have shape {tuple(test_x.shape[1:])}, "
                         f"the training records {tuple(record_shape)}")


def task_utility(clean: np.ndarray, perturbed: np.ndarray, labels: np.ndarray, test_x: np.ndarray,
                 test_y: np.ndarray, model: str, value_range: tuple[float, float]) -> dict:
    """The paper's Type I metric: train on perturbed records, test on clean ones."""
    t0 = time.perf_counter()
    f1_perturbed = weighted_f1(perturbed, labels, test_x, test_y, model, value_range)
    f1_clean = weighted_f1(clean, labels, test_x, test_y, model, value_range)
    classes = np.unique(test_y)
    return {"model": model, "metric": "weighted F1 (sklearn f1_score, average='weighted')",
            "f1_perturbed": f1_perturbed, "f1_clean": f1_clean,
            "f1_majority_class": _majority_f1(test_y),
            "train_records": int(len(labels)), "test_records": int(len(test_y)),
            "classes": [c.item() for c in classes], "seconds": time.perf_counter() - t0}


def _majority_f1(test_y: np.ndarray) -> float:
    """Weighted F1 of always predicting the most frequent class: a chance reference."""
    from sklearn.metrics import f1_score

    classes, counts = np.unique(test_y, return_counts=True)
    return float(f1_score(test_y, np.full_like(test_y, classes[counts.argmax()]), average="weighted",
                          zero_division=0))


# --------------------------------------------------------------------------- evaluate

def evaluate(original: Path, perturbed: Path, manifest_path: Path | None = None, *,
             labels: Path | str | None = None, test: Path | None = None,
             test_labels: Path | str | None = None,
             model: str = "logistic", progress: Progress | None = None,
             per_record: bool = False, name_map: Path | None = None,
             input_format: str | None = None) -> dict[str, Any]:
    """`per_record`: add each record's MSE, MAE, relative L2 and ||Z|| (PSNR, SSIM) to the
    report (at most PER_RECORD_LIMIT records); by default only their summaries. `name_map`:
    that of a perturb --anonymize-names run (default: beside ORIGINAL). `input_format`: the
    format NAME of ORIGINAL and PERTURBED (--format), None: detected."""
    original, perturbed = Path(original), Path(perturbed)
    task = [labels, test, test_labels]
    if any(task) and not all(task):
        raise UsageError("task utility needs all of --labels, --test and --test-labels")
    if model not in MODELS:
        raise UsageError(f"--model must be one of {', '.join(MODELS)}, not {model!r}")
    if not perturbed.exists():
        raise InputError(f"{perturbed}: no such file or directory")
    m, manifest_path = _read_manifest(perturbed, manifest_path)
    renamed = _renamed(m, original, name_map, manifest_path)
    lo, hi = (float(v) for v in m["value_range"])

    checks: list[dict] = list(_check_hashes(m, perturbed))
    module, reader = _open_original(original, m, input_format)
    try:
        jobs = reader.arrays()
        run, records_of = _calibrations(m, jobs, original, manifest_path, reader.records_are_tensors,
                                        checks)
        if run.in_range_markers and "public_missing" not in m:
            reader.markers_are_data(run.in_range_markers)  # values perturb read as data, as it did
        pairing_issues: list[dict] = []
        pairs = _pairs(module, reader, perturbed, m, run.calib_of, pairing_issues, renamed, input_format)
        checks.extend(pairing_issues)
        checks.append(_shape_check(m, jobs, pairs))
        measured = _measure(pairs, m, run, bool(labels), progress)
    finally:
        reader.close()

    stats, done = measured.stats, measured.records
    clipped = _is_clipped(m)
    weighted = bool(m.get("weights"))
    p = stats.expected_kept / stats.elements if stats.elements else 0.0
    if m.get("mechanism") == "privunit":
        checks.extend(_privunit_checks(stats, m))
    else:
        checks.append(_error_check(stats, list(records_of), weighted, clipped, done))
        checks.append(_retained_check(stats, p, weighted, clipped))
        checks.append(_gof_check(stats, clipped))
    by_record, noise = _noise_summary(stats, measured.data_range, clipped)

    integrity_ok = all(c["passed"] for c in checks if c["check"] in
                       ("parameters", "sha256", "unlisted_files", "pairing", "shapes"))
    statistics_ok = all(c["passed"] is not False for c in checks if c["check"] in
                        ("noise_norm", "retained_fraction", "noise_distribution"))
    acc = m.get("accounting") or {}
    report: dict[str, Any] = {
        "schema": REPORT_SCHEMA,
        "sensitive": SENSITIVE,
        "tool": {"name": "tldp", "version": __version__},
        "original": str(original), "perturbed": str(perturbed), "manifest": str(manifest_path),
        "format": module.name,
        "mechanism": m.get("mechanism"), "noise": m.get("noise"), "budget": m.get("budget"),
        "epsilon": m.get("epsilon"), "epsilon_scope": epsilon_scope(m), "value_range": [lo, hi],
        "records": done, "elements_per_record": m.get("elements_per_record"),
        "record_sizes": len({c.get("elements_per_record") for c in m.get("calibrations") or []}) or 1,
        "accounting": {scope: {"epsilon": (acc.get(scope) or {}).get("epsilon"),
                               "delta": (acc.get(scope) or {}).get("delta")}
                       for scope in ("per_element", "per_record")},
        "ok": integrity_ok and statistics_ok,
        "integrity_ok": integrity_ok,
        "statistics_ok": statistics_ok,
        "alpha": ALPHA,
        "checks": checks,
        "error": noise,
        "per_record": ({k: [_finite(v) for v in vals.tolist()] for k, vals in by_record.items()}
                       if per_record and done <= PER_RECORD_LIMIT else None),
        "utility": None,
    }
    if labels:
        report["utility"] = _utility(module, original, pairs, measured, labels, test, test_labels,
                                     model, (lo, hi))
    return report


PREVIEW_RECORDS = 8
PREVIEW_MIN_SIDE = 64  # small records (a 28 x 28 digit) are enlarged to about this many pixels


def preview(original: Path, perturbed: Path, manifest_path: Path | None = None, *,
            records: int = PREVIEW_RECORDS, name_map: Path | None = None,
            input_format: str | None = None) -> bytes:
    """A PNG strip: the first `records` raw records of ORIGINAL (top row) over their
    copies in PERTURBED as written (bottom row), each value mapped from its array's
    declared range to 0..255 (values outside it shown clipped). It shows raw records: a
    file to keep with the raw data, never with the release."""
    m, manifest_path = _read_manifest(Path(perturbed), manifest_path)
    renamed = _renamed(m, Path(original), name_map, manifest_path)
    ranges = {name: tuple(float(v) for v in r) for name, r in (m.get("value_ranges") or {}).items()}
    default = tuple(float(v) for v in m["value_range"])
    module, reader = _open_original(Path(original), m, input_format)
    raw, released = [], []
    try:
        jobs = reader.arrays()
        pairs = _pairs(module, reader, Path(perturbed), m, {job.name: None for job in jobs}, [],
                       renamed, input_format)
        for pair in pairs:
            take = min(records - len(raw), pair.job.records, pair.perturbed_shape[0])
            if take <= 0:
                break
            lo, hi = ranges.get(pair.name, default)
            raw += [_preview_tile(r, lo, hi) for r in pair.job.read(0, take)]
            released += [_preview_tile(r, lo, hi) for r in pair.read_perturbed(0, take)]
    finally:
        reader.close()
    if not raw:
        raise InputError(f"{original}: no records to preview")
    return _preview_png(raw, released)


def _preview_tile(record: np.ndarray, lo: float, hi: float) -> np.ndarray:
    """One record as an (H, W, 3) uint8 picture: an image as it is (alpha dropped), a
    1-D record as a bar, other records the middle 2-D slice of their last two axes."""
    values = np.asarray(record, np.float64)
    if values.ndim == 3 and values.shape[-1] in (1, 3, 4):
        values = values[..., :3] if values.shape[-1] != 1 else values[..., 0]
    elif values.ndim <= 1:
        values = np.repeat(values.reshape(1, -1), 8, axis=0)
    while values.ndim > 2 and not (values.ndim == 3 and values.shape[-1] == 3):
        values = values[values.shape[0] // 2]
    scaled = np.clip((values - lo) / (hi - lo) * 255.0, 0, 255)
    scaled = np.nan_to_num(scaled, nan=0.0)
    grey = scaled.ndim == 2
    return np.repeat(scaled[..., None], 3, axis=2).astype(np.uint8) if grey else scaled.astype(np.uint8)


def _preview_png(top: list[np.ndarray], bottom: list[np.ndarray]) -> bytes:
    """Two rows of tiles on a white ground, 4 pixels apart, small tiles enlarged."""
    from PIL import Image

    h = max(t.shape[0] for t in top + bottom)
    w = max(t.shape[1] for t in top + bottom)
    zoom = max(1, PREVIEW_MIN_SIDE // max(h, w))
    gap = 4
    canvas = np.full((2 * h * zoom + 3 * gap, len(top) * (w * zoom + gap) + gap, 3), 255, np.uint8)
    for row, tiles in enumerate((top, bottom)):
        for col, tile in enumerate(tiles):
            big = tile.repeat(zoom, axis=0).repeat(zoom, axis=1)
            y, x = gap + row * (h * zoom + gap), gap + col * (w * zoom + gap)
            canvas[y:y + big.shape[0], x:x + big.shape[1]] = big
    buf = io.BytesIO()
    Image.fromarray(canvas).save(buf, format="PNG")
    return buf.getvalue()


def _read_manifest(perturbed: Path, manifest_path: Path | None) -> tuple[dict, Path]:
    manifest_path = Path(manifest_path) if manifest_path else manifest_mod.default_path(perturbed)
    if not manifest_path.is_file():
        raise InputError(f"{manifest_path}: manifest not found (give it with --manifest)")
    m = manifest_mod.read(manifest_path)  # InputError naming it when it is not JSON
    manifest_mod.check(m, manifest_path)
    return m, manifest_path


def _calibrations(m: dict, jobs: list, original: Path, manifest_path: Path, per_tensor: bool,
                  checks: list[dict]) -> tuple[Plan, dict[Calibration, int]]:
    """The plan perturb made for the original's arrays, recomputed from the manifest's
    options (pipeline.plan: one calibration per record size and declared range), the
    records of each calibration, and, first among `checks`, whether the manifest's figures
    hold for them."""
    acc = m.get("accounting") or {}
    rows = _row_datasets(m, jobs)
    automatic = str((m.get("grid") or {}).get("rule", "")).startswith("automatic")
    float_dtype = m.get("output_dtype") if m.get("output_dtype") in ("float32", "float64") else "float32"
    options = PerturbOptions(
        input=original, epsilon=float(m["epsilon"]), mechanism=m["mechanism"], noise=m["noise"],
        budget=m["budget"], value_range=tuple(float(v) for v in m["value_range"]),
        ranges={name: (float(lo), float(hi)) for name, (lo, hi) in (m.get("value_ranges") or {}).items()},
        granularity=None if automatic else m.get("granularity"), dtype=float_dtype,
        dp_delta=float(acc.get("dp_delta", 1e-5)), basis=_privunit_basis(m),
        allow_raw_release=True)  # an evaluation judges a release, whatever consent it took
    try:
        run = plan(options, jobs, rows=rows, per_tensor=per_tensor)
    except UsageError as exc:
        raise InputError(f"{manifest_path}: its parameters cannot be calibrated ({reason_of(exc)})") from None
    records_of: dict[Calibration, int] = {}
    for job in jobs:
        calib = run.calib_of[job.name]
        records_of[calib] = records_of.get(calib, 0) + job.records
    checks.insert(0, check_parameters(m, list(records_of.items()), [job.dtype for job in jobs],
                                      [[run.calib_of[name] for name in row] for row in rows]))
    return run, records_of


def _privunit_basis(m: dict) -> str | None:
    """--basis as the privunit run had it: its file (checked against the manifest's sha256
    when loaded), dct:K where K was given, else dct (the default rule, recomputed)."""
    unit = m.get("privunit")
    if m.get("mechanism") != "privunit" or not isinstance(unit, dict):
        return None
    basis = unit.get("basis") or {}
    if basis.get("kind") == "file":
        return str(basis.get("path"))
    return f"dct:{unit.get('k')}" if str(unit.get("k_rule", "")).startswith("--basis") else "dct"


@dataclass
class _Measured:
    stats: _NoiseStats
    records: int  # records compared
    data_range: float | None  # image metrics' data range; None: not images
    clean: list[np.ndarray]  # with labels: the records, for the task
    noisy: list[np.ndarray]


def _measure(pairs: list, m: dict, run: Plan, keep_for_task: bool, progress: Progress | None) -> _Measured:
    """Read every pair of records block by block and gather the noise statistics."""
    lo, hi = run.lo, run.hi
    total_records = sum(p.job.records for p in pairs)
    stats = _NoiseStats(sum(p.job.records * p.job.elements for p in pairs))
    image_like = all(is_image_shaped(p.job.record_shape) for p in pairs) and bool(pairs)
    integer = all(p.job.dtype.kind in "iu" for p in pairs)
    data_range = ((hi - lo - 1) if integer else (hi - lo)) if image_like else None
    clipped_input = any(step in ("clip", "clip_input") for step in m.get("preprocessing") or [])
    measured = _Measured(stats, 0, data_range, [], [])
    for pair in pairs:
        if pair.perturbed_shape != pair.job.shape:
            continue
        step = max(1, BLOCK_ELEMENTS // max(1, pair.job.elements))
        for start in range(0, pair.job.records, step):
            stop = min(start + step, pair.job.records)
            x = pair.job.read(start, stop)
            if clipped_input:  # the noise was added to the clipped values (in the array's range)
                x = np.clip(x, *run.bounds.get(pair.job.name, (lo, hi, None))[:2])
            y = np.asarray(pair.read_perturbed(start, stop))
            stats.add(x, y, pair.calib, data_range, run.bases.get(pair.job.name))
            if keep_for_task:
                measured.clean.append(x)
                measured.noisy.append(y)
            measured.records += stop - start
            if progress:
                progress(stop - start, total_records)
    return measured


def _concatenated(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts) if parts else np.empty(0)


def _noise_summary(stats: _NoiseStats, data_range: float | None,
                   clipped: bool) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Each record's error measures, and the report's summary of them."""
    by_record = {"mse": _concatenated(stats.mse), "mae": _concatenated(stats.mae),
                 "relative_l2": _concatenated(stats.rel), "l2": _concatenated(stats.l2)}
    if data_range is not None:
        by_record.update(psnr=_concatenated(stats.psnr), ssim=_concatenated(stats.ssim))
    noise: dict[str, Any] = {name: _summary(values) for name, values in by_record.items()}
    noise["image_metrics"] = (
        {"data_range": data_range, "ssim": f"mean SSIM, {SSIM_WINDOW}x{SSIM_WINDOW} uniform window, "
                                           "K1=0.01, K2=0.03"} if data_range is not None
        else None)
    noise["clipped_output"] = clipped
    return by_record, noise


def _utility(module, original: Path, pairs: list, measured: _Measured, labels, test, test_labels,
             model: str, value_range: tuple[float, float]) -> dict[str, Any]:
    if str(labels) == LABELS_FROM_FOLDERS and module.records_are_files:
        y = folder_labels([p.job.name for p in pairs if p.perturbed_shape == p.job.shape], original)
    else:
        y = load_labels(labels, original)
    test_x, test_y = load_records(test), load_labels(test_labels, test, "--test-labels")
    clean, noisy = _concatenated(measured.clean), _concatenated(measured.noisy)
    if len(noisy) == 0 or len({p.job.record_shape for p in pairs}) > 1:
        raise UsageError(f"{original}: task utility needs records of one shape")
    _check_task(len(noisy), y, test_x, test_y, pairs[0].job.record_shape, labels, test)
    return task_utility(clean, noisy, y, test_x, test_y, model, value_range)


def _renamed(m: dict, original: Path, name_map: Path | None, manifest_path: Path) -> dict[str, str] | None:
    """An --anonymize-names run's name map (original name -> output name); None otherwise."""
    from tldp_cli.formats import images

    anonymized = m.get("anonymized_names")
    if not anonymized:
        if name_map is not None:
            raise UsageError(f"--name-map applies to outputs of perturb --anonymize-names; "
                             f"{manifest_path} says the names were kept")
        return None
    if not isinstance(anonymized, dict) or not isinstance(anonymized.get("name_map_id"), str):
        raise InputError(f"{manifest_path}: damaged manifest: 'anonymized_names' lacks its name_map_id")
    return images.read_name_map(name_map or images.default_name_map(original), anonymized["name_map_id"])


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


def _shape_check(m: dict, jobs, pairs: list[_Pair]) -> dict:
    problems = []
    for pair in pairs:
        if pair.perturbed_shape != pair.job.shape:
            problems.append(f"{pair.name}: perturbed shape {pair.perturbed_shape}, original {pair.job.shape}")
    records = sum(j.records for j in jobs)
    if m.get("records") != records:
        problems.append(f"manifest says {m.get('records')} records, the original has {records}")
    elements = max((j.elements for j in jobs), default=0)
    if m.get("elements_per_record") != elements:
        problems.append(f"manifest says {m.get('elements_per_record')} elements per record, "
                        f"the original has {elements}")
    stated = sorted(tuple(i.get("shape", [])) for i in m.get("inputs", []) if isinstance(i, dict))
    actual = sorted(tuple(j.source["shape"]) for j in jobs)
    if stated != actual:
        problems.append("the manifest's input shapes differ from the original's")
    return {"check": "shapes", "passed": not problems,
            "detail": "; ".join(problems[:3]) if problems
            else f"{len(pairs)} array(s), {records} records, shapes agree"}


# --------------------------------------------------------------------------- sweep

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
          named: list[str] | None = None) -> dict[str, Any]:
    """Perturb ORIGINAL in memory for every (method, epsilon) and measure error and F1.

    `named`: table names of SWEEP_METHODS to run (None: every one that applies); a
    named method that does not apply (weighted TLDP without weights, MVG on vectors,
    privunit under the element budget) is listed in skipped_methods with the reason.

    `repeats`: independent noise draws per point (stream keys sweep/METHOD/EPS, then
    sweep/METHOD/EPS/1, /2, ...); a row gives the mean over them and F1's sample standard
    deviation, min and max."""
    from tldp_cli.run.masks import load_mask

    original = Path(original)
    task = [labels, test, test_labels]
    if any(task) and not all(task):
        raise UsageError("task utility needs all of --labels, --test and --test-labels")
    if model not in MODELS:
        raise UsageError(f"--model must be one of {', '.join(MODELS)}, not {model!r}")
    if not epsilons:
        raise UsageError("--sweep needs --eps with at least one value")
    if repeats < 1:
        raise UsageError(f"--repeat must be at least 1, not {repeats}")
    streams = Streams(rng, seed, allow_weak_seed)  # a bad seed fails before the data are read
    x = load_records(original, dataset, input_format)
    if x.dtype.kind not in "iuf":
        raise InputError(f"{original}: {x.dtype} data cannot be perturbed")
    job = formats.ArrayJob("array", tuple(x.shape), x.dtype, lambda a, b: x[a:b], {})
    lo, hi = resolve_range(value_range, [job], original)
    if x.size and (x.min() < lo or x.max() > hi):
        raise InputError(f"{original}: values lie outside the declared range [{lo:g}, {hi:g}]")
    elements = job.elements
    mask = load_mask(Path(weights), job.record_shape, job.records) if weights else None
    methods, skipped = _sweep_methods(mask is not None, job.record_shape, budget, elements, named)
    rows_mvg = job.record_shape[0] if len(job.record_shape) >= 2 else None
    reference = None
    if labels:
        y = load_labels(labels, original)
        test_x, test_y = load_records(test), load_labels(test_labels, test, "--test-labels")
        _check_task(len(x), y, test_x, test_y, job.record_shape, labels, test)
        reference = {"f1_clean": weighted_f1(x, y, test_x, test_y, model, (lo, hi)),
                     "f1_majority_class": _majority_f1(test_y), "model": model,
                     "train_records": int(len(x)), "test_records": int(len(test_y))}
    rows = []
    total = len(methods) * len(epsilons) * repeats
    xf = x.reshape(len(x), -1).astype(np.float64)
    for label, mechanism, noise, weighted in methods:
        for eps in epsilons:
            t0 = time.perf_counter()
            if mechanism == "privunit":
                calib = calibrate_privunit(epsilon=eps, record_shape=job.record_shape,
                                           value_range=(lo, hi), dp_delta=dp_delta)
            else:
                calib = calibrate(mechanism=mechanism, noise=noise, budget=budget, epsilon=eps,
                                  range_width=hi - lo, elements=elements, dp_delta=dp_delta,
                                  rows=rows_mvg if mechanism == "mvg" else None)
            cert = accounting.certify(calib)
            norms, mses, f1s = [], [], []
            for r in range(repeats):
                key = f"sweep/{label}/{eps!r}" + (f"/{r}" if r else "")
                noisy = engine.perturb_records(x, 0, key, calib, streams,
                                               mask.values if weighted else None, np.float32)
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
            "reference": reference, "rows": rows}


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


def _sweep_row(calib: Calibration, cert: dict[str, Any], norms: np.ndarray, mses: list[float],
               f1s: list[float]) -> dict[str, Any]:
    """One (method, epsilon) point of a sweep: its calibration, certified figures, the
    noise's measured size over every draw and F1's mean and spread (None without labels)."""
    row = {"method": None, "mechanism": calib.mechanism, "noise": calib.noise, "weighted": None,
           "epsilon": calib.epsilon, "budget": calib.budget,
           "element_epsilon": cert["per_element"]["epsilon"],
           "record_epsilon": cert["per_record"]["epsilon"],
           "record_delta": cert["per_record"]["delta"], "noise_scale": calib.scale,
           "retain_probability_log10": _finite(calib.p_log10),
           "mean_l2_error": float(norms.mean()),
           "rms_l2_error": float(math.sqrt((norms**2).mean())),
           "expected_l2_error": _finite(calib.expected_l2_error()),
           "mse": float(np.mean(mses)), "f1": None, "f1_std": None, "f1_min": None,
           "f1_max": None, "repeats": None}
    if f1s:
        row.update(f1=float(np.mean(f1s)), f1_min=min(f1s), f1_max=max(f1s),
                   f1_std=float(np.std(f1s, ddof=1)) if len(f1s) > 1 else None)
    return row


def write_sweep(result: dict[str, Any], out_dir: Path, overwrite: bool = False) -> list[Path]:
    """sweep.csv, sweep.json and two PNGs (against the nominal and the certified per-record eps)."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise OutputError(f"{out_dir}: exists and is not a folder")
    targets = [out_dir / name for name in SWEEP_FILES]
    out_dir.mkdir(parents=True, exist_ok=True)  # output.write_files refuses existing files
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
    }, overwrite)
    return targets


def _rounded(value: Any) -> Any:
    """A float to TABLE_DIGITS significant digits (other values as they are)."""
    if isinstance(value, float) and math.isfinite(value):
        return float(f"{value:.{TABLE_DIGITS}g}")
    return value


def _plot(result: dict[str, Any], x_key: str, x_label: str) -> bytes:
    _need("matplotlib")  # Figure without pyplot renders with Agg; no global backend change

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
