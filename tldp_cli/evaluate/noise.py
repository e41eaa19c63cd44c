"""Noise statistics: per-record MSE, MAE, relative L2 (PSNR and SSIM for image-shaped
records), the empirical norm of the noise against Table 5, the retained fraction against
p, and a Kolmogorov-Smirnov (continuous) or chi-square (discrete) test against the
manifest's noise distribution (values stored as bfloat16 or float16: a KS test of the
randomized PIT under the law rounded to their steps); privunit's alignment instead.

Statistical checks fail only at ALPHA = 1e-6, so a correct run essentially never fails
one while a wrong scale or distribution fails at once."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from tldp_cli.evaluate.common import Progress, finite
from tldp_cli.privacy.distributions import abs_cdf, chi_square, density_at_zero, moments
from tldp_cli.privacy.mechanisms import Calibration
from tldp_cli.run.calibration import Calibrated
from tldp_cli.sampling import engine

ALPHA = 1e-6  # significance level of every statistical check
GOF_MAX_SAMPLES = 200_000  # noise values the KS test sees at most (evenly subsampled)
GOF_MIN_SAMPLES = 20
Z_LIMIT = 5.0  # |z| of the noise's squared norm against Table 5 (two-sided ALPHA ~ 6e-7)
SSIM_WINDOW = 7
BLOCK_ELEMENTS = 1 << 22


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


class NoiseStats:
    def __init__(self, total_elements: int):
        self.step = max(1, total_elements // GOF_MAX_SAMPLES)
        # per block, each record's figure
        self.mse: list[np.ndarray] = []
        self.mae: list[np.ndarray] = []
        self.rel: list[np.ndarray] = []
        self.l2: list[np.ndarray] = []
        self.psnr: list[np.ndarray] = []
        self.ssim: list[np.ndarray] = []
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
        # values stored as 16-bit floats: each noisy value's randomized probability integral
        # transform under the noise law rounded to the stored dtype (uniform when it is right)
        self.pit: list[np.ndarray] = []
        self.jitter = np.random.default_rng(0)  # the PIT's uniform draws: a test's, not privacy's
        self.noise_name: str | None = None
        self.noise_scale: float | None = None
        # privunit: cosines of released and true coefficients, by the records' (k, E<V, u>):
        # records of several sizes have a k each, and an expected alignment each
        self.alignment: dict[tuple[int, float], list[np.ndarray]] = {}

    def add(self, x: np.ndarray, y: np.ndarray, calib: Calibration, data_range: float | None,
            basis=None, missing: np.ndarray | None = None, stored: str | None = None):
        """`missing`: where the output held a missing-data marker (copied, not perturbed), y
        holding there the public value perturb read, as x (measure): those positions hold no
        noise and are left out. `stored`: the dtype the output stores y in where it is not
        y's ("bfloat16", which NumPy reads as float32): its rounding leaves values equal."""
        n = x.shape[0]
        if calib.granularity:  # discrete noise on float data: the noise is added to the snapped values
            x = np.rint(x.astype(np.float64) / calib.granularity) * calib.granularity
            if missing is not None:  # y as the snapped x there too: no noise, no distance
                y = np.where(missing, x.astype(y.dtype), y)
        present = None if missing is None else ~missing.reshape(n, -1)
        if calib.privunit is not None:
            self._metrics(x, y, data_range, present)
            self._add_alignment(x, y, calib, basis)
            return
        sq, z, elements = self._metrics(x, y, data_range, present)
        # retained: exact equality in the output dtype
        equal = y.reshape(n, -1) == x.reshape(n, -1).astype(y.dtype)
        self._add_noise(x, y, z, sq, elements, equal, calib, present, stored)

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
        params = calib.privunit_params()
        self.alignment.setdefault((params.k, params.alignment), []).append(np.einsum("ij,ij->i", released, raw))

    def _metrics(self, x: np.ndarray, y: np.ndarray, data_range: float | None,
                 present: np.ndarray | None = None):
        """Each record's error measures, over its `present` elements (default: all); returns
        (|z|^2 per record, z, elements)."""
        n = x.shape[0]
        xf = x.reshape(n, -1).astype(np.float64)
        yf = y.reshape(n, -1).astype(np.float64)
        z = yf - xf
        sq = (z * z).sum(axis=1)
        elements = xf.shape[1]
        counts = elements if present is None else present.sum(axis=1)
        with np.errstate(divide="ignore", invalid="ignore"):  # a record wholly missing: NaN, left out
            self.mse.append(sq / counts)
            self.mae.append(np.abs(z).sum(axis=1) / counts)
        self.l2.append(np.sqrt(sq))
        with np.errstate(divide="ignore", invalid="ignore"):
            self.rel.append(np.sqrt(sq) / np.sqrt((xf * xf).sum(axis=1)))
        if data_range is not None:
            with np.errstate(divide="ignore"):
                self.psnr.append(10 * np.log10(data_range**2 / (sq / elements)))
            self.ssim.append(ssim(x.astype(np.float64), y.astype(np.float64), data_range))
        return sq, z, elements

    def _add_noise(self, x, y, z, sq, elements, equal, calib: Calibration,
                   present: np.ndarray | None = None, stored: str | None = None) -> None:
        """The noise's statistics over the `present` elements (default: all): kept values,
        the squared norm against Table 5, a sample for the goodness-of-fit test."""
        n = x.shape[0]
        if present is not None:
            equal = equal & present
        count = n * elements if present is None else int(present.sum())
        self.kept += int(equal.sum())
        self.elements += count
        (m2, m4), f0 = moments(calib.noise, calib.scale), density_at_zero(calib.noise, calib.scale)
        if y.dtype.kind == "f":  # noise that rounds away in the stored dtype leaves a value equal
            below, above = _gaps(x.reshape(n, -1), y.dtype, stored)
            if calib.noise.startswith("discrete-"):
                equal_anyway = _rounded_away(x.reshape(n, -1), below, above, calib)
            else:
                equal_anyway = np.minimum((below + above) / 2 * f0, 1.0)
            self.rounding += float((equal_anyway if present is None else equal_anyway[present]).sum())
        elif calib.noise.startswith("discrete-"):  # discrete noise is 0 with probability f0
            self.rounding += count * f0
        q = 1 - calib.p
        if calib.granularity:  # noise in grid steps
            m2, m4 = m2 * calib.granularity**2, m4 * calib.granularity**4
        self.sum_sq += float(sq.sum())
        self.expected_sq += count * q * m2
        self.var_sq += count * (q * m4 - (q * m2) ** 2)
        noisy = (~equal if present is None else present & ~equal).reshape(-1)
        if self.noise_name is None or self.noise_scale is None:  # (set together)
            self.noise_name, self.noise_scale = calib.noise, calib.scale
        self.expected_kept += count * calib.p
        if y.dtype.kind == "f" and (stored == "bfloat16" or y.dtype.itemsize == 2):
            # the stored noise is the law rounded to the dtype's steps, which can be coarser than it
            xs, ys = x.reshape(-1)[noisy][:: self.step], y.reshape(-1)[noisy][:: self.step]
            self.pit.append(rounded_pit(xs, ys, calib, stored, self.jitter))
            return
        sample = z.reshape(-1)[noisy][:: self.step]
        if calib.granularity:  # discrete noise: in grid steps, whatever the array's grid
            sample = np.rint(sample / calib.granularity)
        scale = calib.scale
        if scale != self.noise_scale and not calib.noise.startswith("discrete-"):
            # Records of another size (model tensors, --budget record): same family, rescaled.
            sample, scale = sample * (self.noise_scale / scale), self.noise_scale
        self.gof.setdefault(scale, []).append(sample)


def _gaps(x: np.ndarray, dtype: np.dtype, stored: str | None) -> tuple[np.ndarray, np.ndarray]:
    """The distances (float64) from |x| to its neighbours below and above in the dtype the
    output stores: `dtype`, or bfloat16 (read as float32, whose gaps at bfloat16 values are
    2^16 times smaller)."""
    a = np.abs(x).astype(dtype)
    above = np.spacing(a).astype(np.float64)
    below = np.where(a > 0, (a - np.nextafter(a, np.zeros((), dtype))).astype(np.float64), above)
    widen = 2.0**16 if stored == "bfloat16" else 1.0
    return below * widen, above * widen


def _rounded_away(x: np.ndarray, below: np.ndarray, above: np.ndarray, calib: Calibration) -> np.ndarray:
    """Each value's probability that discrete noise K (in grid steps) leaves it equal once
    x + K g is rounded to the stored dtype (nearest even): K between the halfway points to
    its neighbours (`below`, `above`), which round to x where x is even. P(-a <= K <= b) =
    (P(|K| <= a) + P(|K| <= b)) / 2. Where the dtype holds x +- g exactly, P(K = 0)."""
    g = calib.granularity or 1.0
    if above.size and float(above.max()) <= g:  # below <= above: only noise of 0 rounds away
        return np.full(x.shape, density_at_zero(calib.noise, calib.scale))
    even = np.fmod(np.abs(x.astype(np.float64)) / above, 2) == 0

    def steps(gap: np.ndarray) -> np.ndarray:
        half = gap / (2 * g)
        return np.ceil(half) - 1 + ((half == np.ceil(half)) & even)

    return (abs_cdf(calib.noise, calib.scale, steps(below)) + abs_cdf(calib.noise, calib.scale, steps(above))) / 2


def _cell(v: np.ndarray, stored: str | None) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The values that round to each `v` (float64) in the dtype the output stores (`v`'s own
    dtype, or bfloat16 read as float32), nearest even: from v - down to v + up, the ends
    included where v is even (a tie rounds to it). Also whether v is a value of that dtype."""
    below, above = _gaps(v, v.dtype, stored)
    d = v.astype(np.float64)
    negative = d < 0
    down, up = np.where(negative, above, below) / 2, np.where(negative, below, above) / 2
    return down, up, np.fmod(np.abs(d) / above, 2) == 0, np.fmod(np.abs(d), above) == 0


def _noise_cdf(noise: str, scale: float, k: np.ndarray) -> np.ndarray:
    """P(noise <= k): continuous noises at any k, discrete ones at integers k (grid steps)."""
    if noise.startswith("discrete-"):  # symmetric: P(K <= k) = (1 + P(|K| <= k)) / 2 for k >= 0
        return np.where(k >= 0, (1 + abs_cdf(noise, scale, np.maximum(k, 0))) / 2,
                        (1 - abs_cdf(noise, scale, np.maximum(-k - 1, 0))) / 2)
    from scipy import stats as st

    return (st.laplace if noise == "laplace" else st.norm).cdf(k, scale=scale)


def _interval_cdf(calib: Calibration, lo: np.ndarray, hi: np.ndarray, closed: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray]:
    """(P(noise below the interval), P(noise in it)) for noise intervals lo..hi (data units),
    their ends included where `closed` (they only matter for discrete noise)."""
    if calib.noise.startswith("discrete-"):
        g = calib.granularity or 1.0
        first = np.where(closed, np.ceil(lo / g), np.floor(lo / g) + 1)
        last = np.where(closed, np.floor(hi / g), np.ceil(hi / g) - 1)
        below = _noise_cdf(calib.noise, calib.scale, first - 1)
        return below, np.maximum(_noise_cdf(calib.noise, calib.scale, last) - below, 0.0)
    below = _noise_cdf(calib.noise, calib.scale, lo)
    return below, _noise_cdf(calib.noise, calib.scale, hi) - below


def rounded_pit(x: np.ndarray, y: np.ndarray, calib: Calibration, stored: str | None,
                rng: np.random.Generator) -> np.ndarray:
    """The randomized probability integral transform of each noisy value y (y != x) stored in
    a 16-bit float dtype: the noise that produced y is any value rounding to it, so u is
    uniform over that interval's share of the noise law given that the noise did not round
    back to x (then y would equal x). u is uniform on (0, 1) when the law is right."""
    x = x.astype(np.float64)
    down, up, even, _ = _cell(y, stored)
    yd = y.astype(np.float64)
    below, mass = _interval_cdf(calib, yd - down - x, yd + up - x, even)
    x_down, x_up, x_even, held = _cell(x.astype(y.dtype), stored)
    _, at_x = _interval_cdf(calib, -x_down, x_up, x_even)
    # noise that rounds back to x leaves y equal (left out); x not a stored value: y never equals it
    at_x = np.where(held & (x.astype(y.dtype).astype(np.float64) == x), at_x, 0.0)
    below = below - np.where(yd > x, at_x, 0.0)  # x's own cell lies below y's where y > x
    with np.errstate(divide="ignore", invalid="ignore"):
        u = (below + rng.random(x.size) * mass) / (1 - at_x)
    return np.clip(u[np.isfinite(u)], 0.0, 1.0)


def _raw_pit(groups: dict[float, np.ndarray], noise: str, rng: np.random.Generator) -> list[np.ndarray]:
    """The PIT of the noise samples of values stored exactly enough (float32 and wider): the
    samples as they are (continuous, rescaled to the first scale) or in grid steps without
    0 (discrete), each group at its scale."""
    out = []
    for scale, sample in groups.items():
        if not noise.startswith("discrete-"):
            out.append(_noise_cdf(noise, scale, sample))
            continue
        zero = density_at_zero(noise, scale)
        before = _noise_cdf(noise, scale, sample - 1)
        mass = _noise_cdf(noise, scale, sample) - before
        below = before - np.where(sample > 0, zero, 0.0)
        out.append((below + rng.random(sample.size) * mass) / (1 - zero))
    return out


def privunit_checks(stats: NoiseStats) -> list[dict]:
    """privunit: no noise is added, so the noise checks do not apply; the alignment of the
    released records with the raw ones is measured (not tested: the written values are
    clipped to the range, which moves their direction)."""
    skipped = [{"check": name, "passed": None, "status": "skipped",
                "detail": "privunit releases each record's direction (one PrivUnit draw written back), "
                          "not the record plus noise"}
               for name in ("noise_norm", "retained_fraction", "noise_distribution")]
    groups = [(k, expected, np.concatenate(parts)) for (k, expected), parts in sorted(stats.alignment.items())]
    records = sum(cosines.size for _, _, cosines in groups)
    mean = float(sum(cosines.sum() for _, _, cosines in groups) / records) if records else None
    # the pooled mean's expectation: each size's E<V, u>, weighted by its records
    expected = sum(e * cosines.size for _, e, cosines in groups) / records if records else None
    detail = "no records compared"
    if mean is not None and expected is not None:
        over = (f" (the mean over {len(groups)} calibrations of their own k, each weighted by its records)"
                if len(groups) > 1 else "")
        detail = (f"mean cosine {mean:.3g} between the released and the raw records' coefficients (from the "
                  f"reference point); E<V,u> of the mechanism {expected:.3g}{over} (the written records are "
                  "clipped to the range, which moves them)")
    measured: dict[str, Any] = {"check": "privunit_alignment", "passed": None, "status": "measured",
                                "records": records, "mean_cosine": mean, "expected_alignment": expected,
                                "detail": detail}
    if len(groups) > 1:
        measured["calibrations"] = [{"k": k, "records": int(cosines.size), "mean_cosine": float(cosines.mean()),
                                     "expected_alignment": e} for k, e, cosines in groups]
    return skipped + [measured]


def retained_check(stats: NoiseStats, p: float, weighted: bool, clipped: bool) -> dict:
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
    # Values equal to the input are not all kept ones: noise of 0 (discrete noise draws it
    # often) and float rounding leave some equal too, and the test counts them in.
    equal_anyway = (f", plus {allowance:.3g} of the values left equal by noise of 0 or float rounding"
                    if allowance > 0 else "")
    out.update(pvalue=pvalue, passed=passed, status="passed" if passed else "failed",
               detail=f"{k} of {n} values unchanged, {n * p_eff:.4g} expected (kept with p = {p:.3g}"
                      + (", w = 0: weights lower it" if weighted else "") + f"{equal_anyway})")
    return out


def error_check(stats: NoiseStats, calibs: list[Calibration], weighted: bool, clipped: bool,
                 records: int) -> dict:
    records = max(records, 1)
    rms = math.sqrt(stats.sum_sq / records)
    expected_rms = math.sqrt(stats.expected_sq / records)
    mean_l2 = float(np.concatenate(stats.l2).mean()) if stats.l2 else None
    z = (stats.sum_sq - stats.expected_sq) / math.sqrt(stats.var_sq) if stats.var_sq > 0 else None
    out = {"check": "noise_norm", "mean_l2": mean_l2, "rms_l2": rms,
           "expected_l2": expected_rms, "expected_l2_per_record": sorted({c.expected_l2_error() for c in calibs}),
           "ratio": rms / expected_rms if expected_rms > 0 else None, "z": finite(z)}
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


def gof_check(stats: NoiseStats, clipped: bool) -> dict:
    from scipy import stats as st

    groups = {scale: np.concatenate(parts) for scale, parts in stats.gof.items()}
    sample = np.concatenate(list(groups.values())) if groups else np.empty(0)
    rounded = concatenated(stats.pit)  # values stored as 16-bit floats
    size = sample.size + rounded.size
    out = {"check": "noise_distribution", "test": "Kolmogorov-Smirnov",
           "distribution": stats.noise_name, "scale": stats.noise_scale, "samples": int(size)}
    if clipped:
        out.update(passed=None, status="skipped",
                   detail="output rounded and clipped to integers: the noise is not observed "
                          "exactly, so no goodness-of-fit test")
        return out
    if size < GOF_MIN_SAMPLES:
        out.update(passed=None, status="skipped",
                   detail=f"only {size} perturbed values (fewer than {GOF_MIN_SAMPLES})")
        return out
    assert stats.noise_name is not None and stats.noise_scale is not None  # set with the first sample
    if rounded.size:
        return _rounded_check(stats, groups, rounded, out)
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


def _rounded_check(stats: NoiseStats, groups: dict[float, np.ndarray], rounded: np.ndarray, out: dict) -> dict:
    """Outputs with values stored as 16-bit floats (bfloat16, float16): their steps can be
    coarser than the noise, so the stored noise follows the law rounded to them. One KS test
    that the randomized PIT of every noisy value (rounded_pit; the others' from their
    samples) is uniform, whatever the scales."""
    from scipy import stats as st

    assert stats.noise_name is not None and stats.noise_scale is not None
    u = np.concatenate([rounded, *_raw_pit(groups, stats.noise_name, stats.jitter)])
    result = st.kstest(u, "uniform")
    passed = bool(result.pvalue >= ALPHA)
    steps = " grid steps" if stats.noise_name.startswith("discrete-") else ""
    out.update(test="Kolmogorov-Smirnov (randomized PIT)", statistic=float(result.statistic),
               pvalue=float(result.pvalue), passed=passed, status="passed" if passed else "failed",
               detail=f"KS D = {result.statistic:.4f}, p-value = {result.pvalue:.3g} of the noise's randomized "
                      f"PIT against {stats.noise_name}(scale {stats.noise_scale:.4g}{steps}) rounded as stored "
                      f"({rounded.size} of {u.size} values in 16-bit floats, whose steps can be coarser "
                      "than the noise)")
    return out


def _chi_square_check(stats: NoiseStats, groups: dict[float, np.ndarray], out: dict) -> dict:
    """Discrete noises: a chi-square test per noise scale (records of several sizes under
    --budget record or the baselines get different scales), each against its own exact pmf;
    the run fails if the smallest p-value, times the number of scales tested (Bonferroni),
    is below ALPHA. Scales with fewer than GOF_MIN_SAMPLES perturbed values are not tested."""
    assert stats.noise_name is not None  # set with the first sample
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


@dataclass
class Measured:
    stats: NoiseStats
    records: int  # records compared
    data_range: float | None  # image metrics' data range; None: not images
    clean: list[np.ndarray]  # with labels: the records, for the task
    noisy: list[np.ndarray]


def measure(pairs: list, m: dict, calibrated: Calibrated, keep_for_task: bool, progress: Progress | None) -> Measured:
    """Read every pair of records block by block and gather the noise statistics."""
    lo, hi = calibrated.lo, calibrated.hi
    total_records = sum(p.job.records for p in pairs)
    stats = NoiseStats(sum(p.job.records * p.job.elements for p in pairs))
    image_like = all(is_image_shaped(p.job.record_shape) for p in pairs) and bool(pairs)
    integer = all(p.job.dtype.kind in "iu" for p in pairs)
    data_range = ((hi - lo - 1) if integer else (hi - lo)) if image_like else None
    clipped_input = any(step in ("clip", "clip_input") for step in m.get("preprocessing") or [])
    measured = Measured(stats, 0, data_range, [], [])
    markers = _output_markers(m)
    for pair in pairs:
        if pair.perturbed_shape != pair.job.shape:
            continue
        step = max(1, BLOCK_ELEMENTS // max(1, pair.job.elements))
        for start in range(0, pair.job.records, step):
            stop = min(start + step, pair.job.records)
            x = pair.job.read(start, stop)
            if clipped_input:  # the noise was added to the clipped values (in the array's range)
                x = np.clip(x, *calibrated.bounds.get(pair.job.name, (lo, hi, None))[:2])
            y = np.asarray(pair.read_perturbed(start, stop))
            missing = _at_markers(y, markers.get(pair.job.name))
            if missing is not None:  # the statistics and the task see the public value perturb read there
                y = np.where(missing, x.astype(y.dtype), y)
            stats.add(x, y, pair.calib, _pair_range(calibrated, pair, data_range, integer),
                      calibrated.bases.get(pair.job.name), missing, pair.job.source.get("dtype"))
            if keep_for_task:
                measured.clean.append(x)
                measured.noisy.append(y)
            measured.records += stop - start
            if progress:
                progress(stop - start, total_records)
    return measured


def _output_markers(m: dict) -> dict[str, list[float]]:
    """By array, the markers its output holds where values are missing (copied, not
    perturbed: the manifest's missing_values; noisy values were moved off them)."""
    return {name: [float(v) for v in entry.get("output") or []]
            for name, entry in (m.get("missing_values") or {}).items()}


def _at_markers(y: np.ndarray, markers: list[float] | None) -> np.ndarray | None:
    """Where `y` holds one of `markers` (NaN matching NaN); None when it holds none."""
    if not markers:
        return None
    at = np.zeros(y.shape, bool)
    for marker in markers:
        at |= np.isnan(y) if math.isnan(marker) else y == marker
    return at if at.any() else None


def _pair_range(calibrated: Calibrated, pair, data_range: float | None, integer: bool) -> float | None:
    """The image metrics' data range of one pair: its own declared range where arrays have
    ranges of their own (8- and 16-bit images in one folder), else the run's."""
    if data_range is None or pair.job.name not in calibrated.bounds:
        return data_range
    lo, hi = calibrated.bounds[pair.job.name][:2]
    return (hi - lo - 1) if integer else (hi - lo)


def concatenated(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts) if parts else np.empty(0)


def noise_summary(stats: NoiseStats, data_range: float | None,
                   clipped: bool) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Each record's error measures, and the report's summary of them."""
    by_record = {"mse": concatenated(stats.mse), "mae": concatenated(stats.mae),
                 "relative_l2": concatenated(stats.rel), "l2": concatenated(stats.l2)}
    if data_range is not None:
        by_record.update(psnr=concatenated(stats.psnr), ssim=concatenated(stats.ssim))
    noise: dict[str, Any] = {name: _summary(values) for name, values in by_record.items()}
    noise["image_metrics"] = (
        {"data_range": data_range, "ssim": f"mean SSIM, {SSIM_WINDOW}x{SSIM_WINDOW} uniform window, "
                                           "K1=0.01, K2=0.03"} if data_range is not None
        else None)
    noise["clipped_output"] = clipped
    return by_record, noise

