"""The types every layer shares: a calibrated mechanism and the names of the noises.

It imports only the noise distributions (where a figure needs them: the option checks
load without NumPy), so calibration (mechanisms.py), accounting and the engine can all
use `Calibration` without importing each other.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


DISCRETE_NOISES = ("discrete-laplace", "discrete-gaussian")
PRIVUNIT = "privunit"  # the mechanism, and the name of what it draws (no additive noise)


def is_discrete(noise: str) -> bool:
    return noise in DISCRETE_NOISES


@dataclass(frozen=True)
class PrivUnitParams:
    """--mechanism privunit (privacy/privunit.py): the public basis, the PrivUnit split and
    the write-back. Hashable, like Calibration; the basis matrix itself is not held here
    (a DCT basis follows from `record_shape` and `k`; a user's basis is identified by its
    sha256 and passed to the engine beside the calibration)."""

    k: int  # coefficients: rows of the basis
    gamma: float  # the cap {v : <v, u> >= gamma}
    p_numerator: int  # P(V from the cap) = p_numerator / 2^53 exactly
    basis: str  # "dct" or "file"
    record_shape: tuple[int, ...]
    reference: float  # a record is measured from this value; the output written is reference + c B^T (w * V)
    output_scale: float  # c
    low: float  # the declared range, which the written values are clipped to
    high: float
    basis_sha256: str | None = None  # a user's basis file
    alignment: float = 0.0  # m = E<V, u> of the split (the write-back's weights use it)
    prior_exponent: float | None = None  # the write-back's spectral prior (None: unweighted, a user's basis)
    emphasis_exponent: float | None = None  # pre-emphasis d_j = (1 + f_j)^a before normalising (None: none)
    reference_rule: str = "zero"  # which --reference rule gave `reference` (privunit.REFERENCE_RULES)
    reference_option: str = "auto"  # --reference as given: auto, zero, low, mid or a number

    @property
    def p(self) -> float:
        return self.p_numerator / 2.0**53

    @property
    def epsilon0(self) -> float:
        """ln(p / (1 - p)): the part of the budget spent on the choice between cap and rest."""
        return math.log(self.p_numerator) - math.log(2**53 - self.p_numerator)


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
    rows: int | None = None  # MVG: rows of the record's mode-1 unfolding (its first axis)
    granularity: float | None = None  # discrete noise on float data: the grid step G
    privunit: PrivUnitParams | None = None  # --mechanism privunit (scale: its output scale c)

    @property
    def grid_values(self) -> int | None:
        """Discrete noises: W, the grid values in the range (see calibrate); None otherwise."""
        if self.noise not in DISCRETE_NOISES:
            return None
        if self.granularity is None:
            return round(self.range_width)
        return round(self.range_width / self.granularity) + 1

    @property
    def grid_steps(self) -> int:
        """Discrete noises: W - 1, the sensitivity in grid steps."""
        if self.grid_values is None:
            raise ValueError(f"{self.noise} noise has no grid")
        return self.grid_values - 1

    @property
    def p(self) -> float:
        return math.exp(self.log_p)

    def privunit_params(self) -> PrivUnitParams:
        """The PrivUnit parameters, for code that serves --mechanism privunit only."""
        if self.privunit is None:
            raise ValueError(f"a {self.mechanism} calibration has no PrivUnit parameters")
        return self.privunit

    @property
    def p_log10(self) -> float | None:
        return None if self.log_p == -math.inf else self.log_p / math.log(10)

    def expected_l2_error(self) -> float:
        """Paper Table 5 bound sqrt(E||Z||^2) for one record (w = 0).

        Laplace: b * sqrt(2 (1-p) I). Gaussian: sigma * sqrt((1-p) I), with the sigma
        of Algorithm 1 (Table 5's Gaussian line assumes a different sigma). PrivUnit:
        infinite (stated as null): its error depends on the record's norm, never released.
        """
        if self.privunit is not None:
            return math.inf
        try:
            if self.noise == "discrete-gaussian":  # at most sigma^2 (CKS20), in grid steps
                variance = (self.scale * (self.granularity or 1.0)) ** 2
            else:  # discrete Laplace: in grid steps
                from tldp_cli.privacy.distributions import moments  # NumPy: not for the option checks

                variance = moments(self.noise, self.scale)[0] * (
                    (self.granularity or 1.0) ** 2 if self.noise == "discrete-laplace" else 1.0)
            return math.sqrt(variance * (1 - self.p) * self.elements)
        except OverflowError:  # a scale near float64's limit: the error is beyond it too
            return math.inf
