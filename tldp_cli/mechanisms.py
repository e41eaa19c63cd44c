"""Calibration of TLDP (paper, Algorithm 1 and 2) and of the paper's baselines.

One place turns (mechanism, noise, budget, epsilon, range width, elements per
record) into a noise scale and a retain probability. The retain probability is
kept in log space: for real tensors it underflows float64 (I = 784, eps = 1 gives
log p ~ -789).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tldp_cli import accounting
from tldp_cli.errors import UsageError

MECHANISMS = ("tldp", "baseline")
NOISES = ("laplace", "gaussian")
BUDGETS = ("element", "record")


@dataclass(frozen=True)
class Calibration:
    mechanism: str
    noise: str
    budget: str
    epsilon: float  # the --eps the user gave
    range_width: float  # Delta
    elements: int  # I, elements per record
    dp_delta: float  # delta at which (eps, delta) conversions are reported
    element_epsilon: float  # the eps that enters the paper's formulas
    scale: float  # Laplace b or Gaussian sigma
    log_p: float  # natural log of the retain probability; -inf when nothing is kept

    @property
    def p(self) -> float:
        return math.exp(self.log_p)

    @property
    def p_log10(self) -> float | None:
        return None if self.log_p == -math.inf else self.log_p / math.log(10)

    def expected_l2_error(self) -> float:
        """Paper Table 5 bound sqrt(E||Z||^2) for one record (w = 0).

        Laplace: b * sqrt(2 (1-p) I). Gaussian: sigma * sqrt((1-p) I), with the sigma
        of Algorithm 1 (Table 5's Gaussian line assumes a different sigma).
        """
        variance = 2 * self.scale**2 if self.noise == "laplace" else self.scale**2
        return math.sqrt(variance * (1 - self.p) * self.elements)


def _check(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise UsageError(f"--{name} must be one of {', '.join(allowed)}, not {value!r}")


def tldp_log_retain_probability(noise: str, element_epsilon: float, scale: float,
                                range_width: float, elements: int) -> float:
    """log p from Algorithm 1, evaluated with logaddexp so it never overflows."""
    if noise == "laplace":
        a = element_epsilon - elements * range_width / scale
        return a - _logaddexp(math.log(2 * scale), a)
    a = element_epsilon - elements * range_width**2 / (2 * scale**2)
    return a - _logaddexp(math.log(scale * math.sqrt(2 * math.pi)), a)


def _logaddexp(x: float, y: float) -> float:
    hi, lo = max(x, y), min(x, y)
    return hi + math.log1p(math.exp(lo - hi))


def check_parameters(*, mechanism: str, noise: str, budget: str, epsilon: float,
                     dp_delta: float) -> None:
    """Refuses option values no calibration can use (a usage error)."""
    _check("mechanism", mechanism, MECHANISMS)
    _check("noise", noise, NOISES)
    _check("budget", budget, BUDGETS)
    if not (math.isfinite(epsilon) and epsilon > 0):
        raise UsageError(f"--eps must be a finite number > 0, not {epsilon}")
    if not 0 < dp_delta < 1:
        raise UsageError(f"--dp-delta must lie in (0, 1), not {dp_delta}")


def calibrate(*, mechanism: str, noise: str, budget: str, epsilon: float,
              range_width: float, elements: int, dp_delta: float = 1e-5) -> Calibration:
    check_parameters(mechanism=mechanism, noise=noise, budget=budget, epsilon=epsilon,
                     dp_delta=dp_delta)
    if not (math.isfinite(range_width) and range_width > 0):
        raise UsageError(f"the value range must have a finite width > 0, not {range_width}")
    if elements < 1:
        raise UsageError("a record must have at least one element")
    I, D = elements, range_width

    if mechanism == "tldp":
        if budget == "element":
            eps_e = epsilon
        elif noise == "laplace":
            eps_e = epsilon / I  # I-fold composition of eps_e is the record's pure eps
        else:
            sigma = D * math.sqrt(I) * accounting.gaussian_sigma_for(epsilon, dp_delta)
            eps_e = D**2 / (2 * sigma**2)
        scale = D / eps_e if noise == "laplace" else D / math.sqrt(2 * eps_e)
        log_p = tldp_log_retain_probability(noise, eps_e, scale, D, I)
    else:
        # Paper, Theorem 2: noise on every element, calibrated to the whole record.
        if noise == "laplace":
            scale = I * D / epsilon  # same under both budgets: the record gets eps
        elif budget == "element":
            scale = D * math.sqrt(I / (2 * epsilon))  # sigma_1^2 = I Delta^2 / (2 eps)
        else:
            scale = D * math.sqrt(I) * accounting.gaussian_sigma_for(epsilon, dp_delta)
        eps_e = D / scale if noise == "laplace" else D**2 / (2 * scale**2)
        log_p = -math.inf
    return Calibration(mechanism, noise, budget, float(epsilon), float(D), int(I),
                       float(dp_delta), float(eps_e), float(scale), float(log_p))
