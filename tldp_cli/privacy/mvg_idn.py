"""The paper's two (eps, delta) baselines for tensors, MVG and IDN, as the paper uses them.

Both add Gaussian noise to every element. With identity covariances (MVG) and the
utility subspace W = identity (IDN) that noise is i.i.d. N(0, sigma^2); the two
differ only in how sigma follows from (eps, delta). This module holds the
parameters of each design and the sigma it gives; the privacy figures stated
about a sigma come from accounting.py.

The query is the identity on one record: s2(f) = sup ||X - X'||_F = Delta sqrt(I)
for values in a range of width Delta (the paper's Type I/II setting, range (-1, 1),
gives s2(f) = 2 sqrt(I)).

MVG (Chanyaswad, Dytso, Poor, Mittal, "MVG Mechanism: Differential Privacy under
Matrix-Valued Query", CCS 2018, Theorem 3 and Table 1): a record is an m x n
matrix; a tensor record of shape (I1, I2, ..., IN) is unfolded along mode 1
(m = I1 rows, n = I2...IN columns). r = min(m, n), H_r = sum_{i<=r} 1/i and
H_{r,1/2} = sum_{i<=r} 1/sqrt(i) (generalized harmonic numbers), gamma =
sup ||f(X)||_F. MVG(Sigma, Psi) is (eps, delta)-DP if
    ||sigma(Sigma^-1)||_2 ||sigma(Psi^-1)||_2 <= P = (-beta + sqrt(beta^2 + 8 alpha eps))^2 / (4 alpha^2),
    alpha = (H_r + H_{r,1/2}) gamma^2 + 2 H_r gamma s2(f),
    beta  = 2 (mn)^(1/4) H_r s2(f) zeta(delta).
With Sigma = a I_m and Psi = b I_n the left side is sqrt(mn)/(ab) and every element
gets variance ab, so the smallest noise is sigma^2 = sqrt(I)/P.
- zeta(delta) is the (1 - delta) bound on the Frobenius norm of an m x n standard
  Gaussian matrix (Laurent and Massart's chi-square tail):
  zeta(delta)^2 = mn + 2 sqrt(-mn ln delta) - 2 ln delta, the form the TLDP paper
  writes for IDN. (The MVG authors' published helper, compute_precision_budget in
  mvg_mechanism.py, leaves out the square root; that only gives more noise.)
- gamma: the additive noise does not depend on where the range sits, so the data
  are taken centred on the middle of the range, gamma = (Delta/2) sqrt(I): the
  paper's (-1, 1) setting, gamma = sqrt(I).
- Expected error: E||Z||_F^2 = I sigma^2 = I^(3/2)/P. The TLDP paper writes
  I1 I / P (its expression below Table 5), the same value for square records
  (I1^2 = I), which is what it evaluates.

IDN (the TLDP paper's section on expected error, W = identity): per element
    sigma = s2(f) / (-zeta(delta) + sqrt(zeta(delta)^2 + 2 eps)),
with zeta(delta)^2 = -2 ln delta + 2 sqrt(-I ln delta) + I; E||Z||_F^2 = I sigma^2.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

MODE = 1  # MVG unfolds a tensor record along its first axis


def harmonic(r: int, power: float = 1.0) -> float:
    """Generalized harmonic number H_{r,power} = sum_{i=1}^{r} i^-power."""
    return math.fsum((1.0 / np.arange(1, r + 1, dtype=np.float64) ** power).tolist())


def zeta(elements: int, delta: float) -> float:
    """zeta(delta) = sqrt(I + 2 sqrt(-I ln delta) - 2 ln delta)."""
    log_inv = -math.log(delta)
    return math.sqrt(elements + 2 * math.sqrt(elements * log_inv) + 2 * log_inv)


def sensitivity(elements: int, range_width: float) -> float:
    """s2(f) of the identity query: Delta sqrt(I)."""
    return range_width * math.sqrt(elements)


@dataclass(frozen=True)
class MvgParameters:
    rows: int  # m: the record's first axis
    columns: int  # n: the product of the other axes
    r: int
    h_r: float
    h_r_half: float
    gamma: float
    s2: float
    zeta: float
    alpha: float
    beta: float


def mvg_parameters(rows: int, elements: int, range_width: float, delta: float) -> MvgParameters:
    columns = elements // rows
    r = min(rows, columns)
    h_r, h_r_half = harmonic(r, 1.0), harmonic(r, 0.5)
    s2 = sensitivity(elements, range_width)
    gamma = range_width / 2 * math.sqrt(elements)
    z = zeta(elements, delta)
    alpha = (h_r + h_r_half) * gamma**2 + 2 * h_r * gamma * s2
    beta = 2 * elements**0.25 * h_r * s2 * z
    return MvgParameters(rows, columns, r, h_r, h_r_half, gamma, s2, z, alpha, beta)


def mvg_precision_budget(params: MvgParameters, epsilon: float) -> float:
    """P of Theorem 3, as (4 eps / (beta + sqrt(beta^2 + 8 alpha eps)))^2: the same value
    without the cancellation of -beta + sqrt(...) when beta^2 >> 8 alpha eps."""
    root = math.hypot(params.beta, math.sqrt(8 * params.alpha) * math.sqrt(epsilon))
    return (4 * epsilon / (params.beta + root)) ** 2


def mvg_sigma(rows: int, elements: int, range_width: float, epsilon: float, delta: float) -> float:
    """Per-element std of MVG with identity covariances at the (eps, delta) of Theorem 3."""
    budget = mvg_precision_budget(mvg_parameters(rows, elements, range_width, delta), epsilon)
    return math.sqrt(math.sqrt(elements) / budget)


def idn_sigma(elements: int, range_width: float, epsilon: float, delta: float) -> float:
    """Per-element std of IDN (W = identity), written as s2 (zeta + sqrt(zeta^2 + 2 eps)) / (2 eps),
    the same value as s2 / (-zeta + sqrt(zeta^2 + 2 eps)) without its cancellation."""
    z = zeta(elements, delta)
    root = math.hypot(z, math.sqrt(2 * epsilon))
    return sensitivity(elements, range_width) * (z + root) / (2 * epsilon)
