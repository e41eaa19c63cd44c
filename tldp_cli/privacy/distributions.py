"""The noise distributions: probability mass functions, moments and quantiles of the
discrete Laplace and discrete Gaussian (and the moments of their continuous
counterparts), and a chi-square test of a sample against them. Mathematics only: the
samplers are in sampling/discrete.py.
"""

from __future__ import annotations

import math

import numpy as np

_SUMMED_SIGMA = 1e5  # discrete Gaussian: sums term by term up to this sigma


def gaussian_norm(sigma: float) -> float:
    """sum over all integers y of exp(-y^2 / (2 sigma^2)); beyond sigma = 4 it equals
    sigma sqrt(2 pi) to within exp(-2 pi^2 sigma^2) (Poisson summation)."""
    if sigma >= 4:
        return sigma * math.sqrt(2 * math.pi)
    span = np.arange(1, math.ceil(40 * sigma) + 2, dtype=np.float64)
    return 1 + 2 * float(np.exp(-span**2 / (2 * sigma**2)).sum())


def noise_pmf(noise: str, scale: float, z: np.ndarray | int) -> np.ndarray:
    """The probability mass function (in float64) of the noise at integers z."""
    z = np.abs(np.asarray(z, dtype=np.float64))
    if noise == "discrete-laplace":
        a = math.exp(-1 / scale)
        return -math.expm1(-1 / scale) / (1 + a) * np.exp(-z / scale)
    return np.exp(-z**2 / (2 * scale**2)) / gaussian_norm(scale)


def moments(noise: str, scale: float) -> tuple[float, float]:
    """E z^2 and E z^4 of one noise draw of scale `scale` (discrete noises: in grid steps,
    from the exact pmf)."""
    if noise == "laplace":
        return 2 * scale**2, 24 * scale**4
    if noise == "gaussian":
        return scale**2, 3 * scale**4
    if noise == "discrete-laplace":
        a = math.exp(-1 / scale)
        q = -math.expm1(-1 / scale)  # 1 - a
        return 2 * a / q**2, 2 * a * (1 + 11 * a + 11 * a**2 + a**3) / ((1 + a) * q**4)
    if scale >= 4:  # Poisson summation again
        return scale**2, 3 * scale**4
    z = np.arange(-math.ceil(40 * scale) - 2, math.ceil(40 * scale) + 3, dtype=np.float64)
    pmf = noise_pmf(noise, scale, z)
    return float((pmf * z**2).sum()), float((pmf * z**4).sum())


def abs_cdf(noise: str, scale: float, k: np.ndarray) -> np.ndarray:
    """P(|Z| <= k) for integers k >= 0."""
    k = np.asarray(k, dtype=np.float64)
    if noise == "discrete-laplace":
        a = math.exp(-1 / scale)
        return 1 - 2 * np.exp(-(k + 1) / scale) / (1 + a)
    if scale > _SUMMED_SIGMA:  # the normal with continuity correction: relative error ~ 1/sigma^2
        from scipy.special import erf

        return erf((k + 0.5) / (scale * math.sqrt(2)))
    top = math.ceil(40 * scale) + 2
    mass = noise_pmf(noise, scale, np.arange(top + 1)) * 2
    mass[0] /= 2
    cdf = np.minimum(np.cumsum(mass), 1.0)
    return cdf[np.minimum(k, top).astype(np.int64)]


def abs_quantile(noise: str, scale: float, q: np.ndarray) -> np.ndarray:
    """The smallest integer k with P(|Z| <= k) >= q, for each q in (0, 1)."""
    q = np.asarray(q, dtype=np.float64)
    if noise == "discrete-laplace":
        a = math.exp(-1 / scale)
        k = np.ceil(-scale * np.log((1 - q) * (1 + a) / 2)) - 1
        return np.maximum(k, 0).astype(np.int64)
    if scale > _SUMMED_SIGMA:
        from scipy.special import erfinv

        return np.maximum(np.ceil(scale * math.sqrt(2) * erfinv(q) - 0.5), 0).astype(np.int64)
    grid = np.arange(math.ceil(40 * scale) + 3)
    return grid[np.minimum(np.searchsorted(abs_cdf(noise, scale, grid), q), grid.size - 1)]


def density_at_zero(noise: str, scale: float) -> float:
    """The density at 0 (discrete noises: P(z = 0))."""
    if noise == "laplace":
        return 1 / (2 * scale)
    if noise == "gaussian":
        return 1 / (scale * math.sqrt(2 * math.pi))
    return float(noise_pmf(noise, scale, 0))


def chi_square(sample: np.ndarray, noise: str, scale: float, exclude_zero: bool = False,
               bins: int = 40) -> tuple[float, float, int]:
    """Chi-square test of integer noise against its exact distribution: |z| in bins of about
    equal probability, and the sign. `exclude_zero`: the sample holds only nonzero values
    (z = 0 is where TLDP's kept values hide). Returns (statistic, p-value, degrees of freedom)."""
    from scipy import stats

    sample = np.asarray(sample, dtype=np.int64)
    bins = max(2, min(bins, sample.size // 20))  # about 20 or more expected per bin
    magnitude = np.abs(sample)
    start = 1 if exclude_zero else 0
    below = float(abs_cdf(noise, scale, np.array([start - 1]))[0]) if start else 0.0
    quantiles = below + (1 - below) * np.arange(1, bins) / bins
    edges = np.unique(np.maximum(abs_quantile(noise, scale, quantiles), start))
    upper = abs_cdf(noise, scale, edges)
    probs = np.diff(np.concatenate([[below], upper, [1.0]])) / (1 - below)
    observed = np.bincount(np.searchsorted(edges, magnitude, side="left"), minlength=edges.size + 1)
    keep = probs > 0
    expected = probs[keep] * sample.size
    observed = observed[keep]
    statistic = float(((observed - expected) ** 2 / expected).sum())
    # the sign: symmetric, each nonzero value negative with probability 1/2
    nonzero = magnitude > 0
    negative = int((sample < 0).sum())
    statistic += (2 * negative - int(nonzero.sum())) ** 2 / max(int(nonzero.sum()), 1)
    dof = int(keep.sum())  # bins - 1, and 1 for the sign
    return statistic, float(stats.chi2.sf(statistic, dof)), dof
