"""Certified privacy figures (DESIGN section 2), per element and per record.

Every number a manifest states about the guarantee comes from `certify`.

- Laplace noise of scale b on values of range width Delta is pure (Delta/b)-DP per
  element and pure I*Delta/b per record (basic composition, tight for product
  Laplace).
- Gaussian noise of std sigma is rho-zCDP with rho = Delta^2/(2 sigma^2) per element
  and I*rho per record; its (eps, delta) figure is the analytic Gaussian mechanism
  (Balle and Wang 2018) with L2 sensitivity Delta*sqrt(I), from Google's
  dp-accounting.
- TLDP keeps the raw value with probability p: a point mass that no pure bound
  covers. It adds p per element and 1 - (1 - p)^I per record to every delta.
- Weights only lower p, so the certified figures use w = 0.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tldp_cli.mechanisms import Calibration

LN10 = math.log(10)


def gaussian_sigma_for(epsilon: float, delta: float) -> float:
    """Std of a sensitivity-1 Gaussian mechanism that is exactly (epsilon, delta)-DP."""
    import dp_accounting

    return float(dp_accounting.get_sigma_gaussian(epsilon, delta))


def gaussian_epsilon(noise_multiplier: float, delta: float) -> float:
    """Tight epsilon of a Gaussian mechanism with std/sensitivity = noise_multiplier."""
    import dp_accounting

    return float(dp_accounting.get_epsilon_gaussian(noise_multiplier, delta))


def laplace_composed_epsilon(noise_multiplier: float, count: int, delta: float) -> float:
    """Epsilon at delta of `count` Laplace mechanisms with scale/sensitivity = noise_multiplier.

    Each accountant gives a valid upper bound, so the smallest is reported: the
    privacy-loss-distribution accountant (pessimistic discretisation; its grid grows
    with the spread of the composed loss so large records stay fast), the RDP
    accountant (better for very many elements) and the pure figure.
    """
    from dp_accounting import LaplaceDpEvent
    from dp_accounting.pld.pld_privacy_accountant import PLDAccountant
    from dp_accounting.rdp import RdpAccountant

    event = LaplaceDpEvent(noise_multiplier=noise_multiplier)
    bounds = [count / noise_multiplier]
    rdp = RdpAccountant()
    rdp.compose(event, count)
    bounds.append(rdp.get_epsilon(delta))
    try:
        pld = PLDAccountant(
            value_discretization_interval=max(1e-4, math.sqrt(count) / noise_multiplier / 2000))
        pld.compose(event, count)
        bounds.append(pld.get_epsilon(delta))
    except OverflowError:  # the PLD overflows for enormous eps; the other bounds still hold
        pass
    return float(min(bounds))


def point_mass_delta(log_p: float, elements: int) -> tuple[float, float | None]:
    """delta = 1 - (1 - p)^I that the kept raw values add, and its log10.

    The log10 stays finite when delta underflows float64 (then it is the first-order
    value log10(I p), an upper bound).
    """
    if log_p == -math.inf:
        return 0.0, None
    p = math.exp(log_p)
    delta = -math.expm1(elements * math.log1p(-p)) if p > 0 else 0.0
    if delta > 1e-300:
        return delta, math.log10(delta)
    return delta, (log_p + math.log(elements)) / LN10


def _scope(calib: "Calibration", count: int) -> dict[str, Any]:
    """Guarantee of `count` elements perturbed together (1: an element; I: a record)."""
    D, scale, target = calib.range_width, calib.scale, calib.dp_delta
    pm_delta, pm_log10 = point_mass_delta(calib.log_p, count)
    if calib.noise == "laplace":
        pure = count * D / scale
        approx_eps = laplace_composed_epsilon(scale / D, count, target)
        return {
            "epsilon": pure, "delta": pm_delta, "delta_log10": pm_log10, "rho": None,
            "approx": {"delta": target + pm_delta, "epsilon": approx_eps},
            "point_mass_delta": pm_delta, "point_mass_delta_log10": pm_log10,
        }
    rho = count * D**2 / (2 * scale**2)
    approx_eps = gaussian_epsilon(scale / (D * math.sqrt(count)), target)
    total = target + pm_delta
    return {
        "epsilon": approx_eps, "delta": total,
        "delta_log10": math.log10(total), "rho": rho,
        "approx": {"delta": total, "epsilon": approx_eps},
        "point_mass_delta": pm_delta, "point_mass_delta_log10": pm_log10,
    }


def certify(calib: "Calibration") -> dict[str, Any]:
    notes = []
    if calib.log_p != -math.inf:
        notes.append(
            "TLDP keeps each raw value with probability p; no pure bound covers that point "
            "mass, so every delta includes point_mass_delta (p per element, 1-(1-p)^I per record)."
        )
        if calib.noise == "gaussian":
            notes.append("rho is the zCDP of the Gaussian noise applied to values that are not kept.")
    if calib.noise == "gaussian":
        notes.append("Gaussian noise has no pure epsilon; epsilon/delta is the analytic Gaussian "
                     "bound at dp_delta plus the point-mass delta.")
    return {
        "per_element": _scope(calib, 1),
        "per_record": _scope(calib, calib.elements),
        "dp_delta": calib.dp_delta,
        "accountant": "closed form (pure eps, zCDP); dp-accounting (Laplace: min of PLD and RDP; analytic Gaussian)",
        "notes": notes,
    }


def summary_line(accounting: dict[str, Any], noise: str) -> str:
    """The one-line statement of the guarantee the CLI prints after a run."""
    def fmt(scope: dict[str, Any]) -> str:
        delta = scope["delta"]
        if delta == 0:
            d = "0" if scope["delta_log10"] is None else f"1e{scope['delta_log10']:.0f}"
        else:
            d = f"{delta:.3g}"
        text = f"eps={scope['epsilon']:.4g}, delta={d}"
        if noise == "gaussian":
            text += f"; rho={scope['rho']:.4g} zCDP"
        return text
    return (f"guarantee: each element ({fmt(accounting['per_element'])}); "
            f"each record ({fmt(accounting['per_record'])})")
