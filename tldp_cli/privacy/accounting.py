"""Certified privacy figures (docs/guarantee.md), per element and per record.

Every number a manifest states about the guarantee comes from `certify` (one
calibration), `certify_all` (records of several sizes: the worst case over them),
`compose` and `certify_file` (everything a run released), `certify_run` (a run's:
certify_all with certify_file's); `compose_releases` what several releases spend
together on one subject (the release ledger). They return the typed results of
certificates.py (`Certificate`, `Guarantee`, ...); the manifest (run/manifest.py) and the
command line (cli/summary.py) render them, and no figure is computed outside this module.

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
- MVG and IDN (identity covariances) add i.i.d. Gaussian noise: their per-element and
  per-record figures are the Gaussian ones above; `designed` adds the (eps, delta)
  that the mechanism's own condition states for the record at that sigma.
- PrivUnit (privunit_epsilon) is pure eps per record, with the sampler's floating-point
  margin included; an element is covered by the record's figure, no smaller one.
"""

from __future__ import annotations

import math
import dataclasses
from typing import TYPE_CHECKING, NamedTuple, Sequence

from tldp_cli.privacy import mvg_idn, privunit
from tldp_cli.privacy.certificates import (Certificate, Designed, FileCertificate, FileGuarantee, Guarantee,
                                           PrivUnitFigures, TensorFigures)
from tldp_cli.privacy.types import PRIVUNIT, Calibration

if TYPE_CHECKING:  # NumPy is imported where used: the CLI starts without it
    import numpy as np

LN10 = math.log(10)
# What a manifest says of figures computed for float-sampled (continuous) noise.
FLOAT_SAMPLER_NOTE = ("float sampler: the noise is computed in floating point, whose low-order bits "
                      "depend on the input (Mironov 2012), so these figures hold for the real-valued "
                      "mechanism only, not for the bytes written")
# --rng fast (the manifest's accounting.notes, run/manifest.py): the figures assume ideal randomness.
FAST_RNG_NOTE = ("--rng fast: the noise comes from PCG64, which is not cryptographic: its output predicts "
                 "the rest of its stream, so whoever recovers its state from the release can predict the "
                 "noise. The figures assume ideal randomness (--rng secure, AES-CTR) and hold only against "
                 "an observer who cannot.")


class _Scope(NamedTuple):
    """A Guarantee (certificates.py) while it is computed: in certify_all over many record
    sizes, its epsilon and approx epsilon may still be Deferred (see Deferred)."""

    epsilon: float | Deferred
    delta: float
    delta_log10: float | None
    rho: float | None
    approx_delta: float
    approx_epsilon: float | Deferred
    point_mass_delta: float
    point_mass_delta_log10: float | None

    def final(self) -> Guarantee:
        """The Guarantee, every Deferred figure computed."""
        return Guarantee(_value(self.epsilon), self.delta, self.delta_log10, self.rho, self.approx_delta,
                         _value(self.approx_epsilon), self.point_mass_delta, self.point_mass_delta_log10)


def _pure(epsilon: float, approx_epsilon: float | Deferred, approx_delta: float,
          point_mass: tuple[float, float | None] = (0.0, None)) -> _Scope:
    """Laplace noise: pure epsilon, whose delta is the point mass of kept values."""
    pm_delta, pm_log10 = point_mass
    return _Scope(epsilon, pm_delta, pm_log10, None, approx_delta, approx_epsilon, pm_delta, pm_log10)


def _approximate(epsilon: float | Deferred, delta: float, rho: float | None,
                 point_mass: tuple[float, float | None]) -> _Scope:
    """Gaussian noise: (epsilon, delta), delta including the point mass of kept values."""
    return _Scope(epsilon, delta, math.log10(delta), rho, delta, epsilon, *point_mass)


def gaussian_sigma_for(epsilon: float, delta: float) -> float:
    """Std of a sensitivity-1 Gaussian mechanism that is exactly (epsilon, delta)-DP."""
    import dp_accounting

    return float(dp_accounting.get_sigma_gaussian(epsilon, delta))


def gaussian_epsilon(noise_multiplier: float, delta: float) -> float:
    """Tight epsilon of a Gaussian mechanism with std/sensitivity = noise_multiplier."""
    import dp_accounting
    import numpy as np

    # Its search takes log1p(-1) on the way for very large multipliers (MVG); the result
    # stays exact (checked against Balle and Wang's delta in tests), only numpy warns.
    with np.errstate(divide="ignore"):
        return float(dp_accounting.get_epsilon_gaussian(noise_multiplier, delta))


# Above this many Laplace releases the PLD accountant is slower and looser than RDP
# (measured: 3e6 releases, PLD 6% above RDP and 2 s; 1e6, PLD 6% below and 0.9 s).
PLD_MAX_RELEASES = 2_000_000
# Beyond this privacy loss per release the loss distribution's probabilities (e^-eps)
# underflow float64: dp-accounting's discretisation degenerates (an empty array after
# its tail truncation), and the pure and RDP bounds are as tight anyway.
PLD_MAX_ELEMENT_EPSILON = 500.0
# What dp-accounting raises when its discretised distribution over- or underflows.
_PLD_FAILURES = (OverflowError, IndexError, ValueError, FloatingPointError, ZeroDivisionError)


def rdp_orders() -> list[float]:
    """Renyi orders for the RDP accountant: dp-accounting's defaults stop at 1024, but a
    small rho (a record budget of 0.001) is tightest at orders in the millions, where the
    defaults overstate epsilon 40-fold. Every order gives a valid bound."""
    import numpy as np

    return sorted(set(np.geomspace(1.001, 1e10, 300).tolist()) | {1.25, 1.5, 2.0, 3.0, 4.0, 8.0, 16.0,
                                                                     32.0, 64.0, 128.0, 256.0})


def pld_bound(compute) -> list[float]:
    """[compute()], the privacy-loss-distribution bound, or [] where the accountant's
    numerics fail: it is one of several valid bounds, and every caller keeps the others
    (pure epsilon, RDP), so a failure can only make the stated figure more pessimistic."""
    try:
        with _quiet_numpy():
            return [float(compute())]
    except _PLD_FAILURES:
        return []


def _quiet_numpy():
    """NumPy's overflow warnings from inside dp-accounting (exp of large losses, which it
    then handles): not the user's business, and they would break --quiet."""
    import numpy as np

    return np.errstate(over="ignore", under="ignore", divide="ignore", invalid="ignore")


def laplace_composed_epsilon(noise_multiplier: float, count: int, delta: float) -> float:
    """Epsilon at delta of `count` Laplace mechanisms with scale/sensitivity = noise_multiplier.

    Each accountant gives a valid upper bound, so the smallest is reported: the
    privacy-loss-distribution accountant (pessimistic discretisation; its grid grows
    with the spread of the composed loss so large records stay fast), the RDP
    accountant (better for very many elements) and the pure figure. Beyond
    PLD_MAX_RELEASES the PLD is skipped: it takes seconds and comes out above RDP there
    (a whole file, a large tensor).
    """
    from dp_accounting import LaplaceDpEvent
    from dp_accounting.pld.pld_privacy_accountant import PLDAccountant
    from dp_accounting.rdp import RdpAccountant

    event = LaplaceDpEvent(noise_multiplier=noise_multiplier)
    bounds = [count / noise_multiplier]
    rdp = RdpAccountant(rdp_orders())
    rdp.compose(event, count)
    bounds.append(rdp.get_epsilon(delta))
    if count <= PLD_MAX_RELEASES and 1 / noise_multiplier <= PLD_MAX_ELEMENT_EPSILON:
        def composed() -> float:
            pld = PLDAccountant(
                value_discretization_interval=max(1e-4, math.sqrt(count) / noise_multiplier / 2000))
            pld.compose(event, count)
            return pld.get_epsilon(delta)

        bounds += pld_bound(composed)
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


def noise_delta(target: float, pm_delta: float) -> tuple[float, float]:
    """(delta the noise's epsilon is taken at, the scope's total delta).

    The kept raw values cost pm_delta outright (the event that one is kept), so the noise
    gets what is left of the target and the total is the target itself. A point mass at
    or above the target leaves nothing: the noise keeps the target and the total exceeds
    it (a raw release, which perturb refuses without --allow-raw-release)."""
    if pm_delta < target:
        return target - pm_delta, target
    return target, min(1.0, target + pm_delta)


def scope_epsilon(calib: Calibration, count: int) -> float:
    """The `epsilon` of `count` elements' scope (certify's per_record for count = I), alone:
    what --budget record calibrates to, without running the approx accountants."""
    if calib.privunit is not None:  # an element, or any part of a record: the record's figure
        return privunit_record_epsilon(calib)
    if calib.noise == "laplace":
        return count * calib.range_width / calib.scale
    at_delta, _ = noise_delta(calib.dp_delta, point_mass_delta(calib.log_p, count)[0])
    if calib.noise == "gaussian":
        return gaussian_epsilon(calib.scale / (calib.range_width * math.sqrt(count)), at_delta)
    d = calib.grid_steps
    if calib.noise == "discrete-laplace":
        return count * discrete_laplace_element_epsilon(d, calib.scale, calib.log_p)
    return discrete_gaussian_epsilon(calib.scale, d, count, at_delta)


def subject_scopes(certified: Certificate) -> list[tuple[str, Guarantee]]:
    """The scopes of one subject, by their names in Certificate: an element and a record,
    and in a model file (one client's tensors, per_tensor) the whole file; not the file of
    a dataset, which holds many subjects."""
    scopes = [("per_element", certified.per_element), ("per_record", certified.per_record)]
    if certified.per_tensor is not None and certified.per_file is not None:
        scopes.append(("per_file", certified.per_file))
    return scopes


def raw_release_scopes(certified: Certificate) -> list[tuple[str, float]]:
    """The scopes of one subject (subject_scopes) whose kept raw values alone cost more
    than --dp-delta: (name, their delta)."""
    return [(name, scope.point_mass_delta) for name, scope in subject_scopes(certified)
            if scope.point_mass_delta > certified.dp_delta]


def _scope(calib: Calibration, count: int, deferred: bool = False) -> _Scope:
    """Guarantee of `count` elements perturbed together (1: an element; I: a record).
    `deferred` (certify_all over many record sizes): the figure that takes an accountant's
    run is a Deferred, computed only if it can be the worst case."""
    if calib.privunit is not None:
        return _privunit_scope(calib, 1)
    if calib.noise.startswith("discrete-"):
        return _discrete_scope(calib, count, deferred)
    D, scale, target = calib.range_width, calib.scale, calib.dp_delta
    pm_delta, pm_log10 = point_mass_delta(calib.log_p, count)
    at_delta, total = noise_delta(target, pm_delta)  # a union bound; a total of 1 says nothing
    if calib.noise == "laplace":
        pure = scope_epsilon(calib, count)
        approx_eps = (Deferred(count / (scale / D), lambda: laplace_composed_epsilon(scale / D, count, at_delta))
                      if deferred else laplace_composed_epsilon(scale / D, count, at_delta))
        return _pure(pure, approx_eps, total, (pm_delta, pm_log10))
    rho = count * D**2 / (2 * scale**2)
    epsilon = (Deferred(_zcdp_epsilon(rho, at_delta), lambda: scope_epsilon(calib, count)) if deferred
               else scope_epsilon(calib, count))
    return _approximate(epsilon, total, rho, (pm_delta, pm_log10))


def designed_guarantee(calib: Calibration) -> Designed | None:
    """MVG, IDN: the (eps, delta) per record that the mechanism's design gives its sigma.

    The calibration formulas of mvg_idn solved for eps (--eps itself under the element
    budget): MVG, P = sqrt(I)/sigma^2 and eps = (alpha P + beta sqrt(P))/2; IDN,
    u = s2/sigma and eps = u^2/2 + zeta u. Both hold at delta = dp_delta.
    """

    I, D, sigma, delta = calib.elements, calib.range_width, calib.scale, calib.dp_delta
    if calib.mechanism == "mvg":
        assert calib.rows is not None  # calibrate refuses MVG without its rows
        params = mvg_idn.mvg_parameters(calib.rows, I, D, delta)
        budget = math.sqrt(I) / sigma**2
        eps = (params.alpha * budget + params.beta * math.sqrt(budget)) / 2
        return Designed("mvg", eps, delta, "MVG sufficient condition (Chanyaswad et al., CCS 2018, "
                        "Theorem 3) with identity covariances", precision_budget=budget, mvg=params)
    if calib.mechanism == "idn":
        z, s2 = mvg_idn.zeta(I, delta), mvg_idn.sensitivity(I, D)
        u = s2 / sigma
        return Designed("idn", u * u / 2 + z * u, delta,
                        "IDN with W = identity: sigma = s2/(-zeta + sqrt(zeta^2 + 2 eps))", s2=s2, zeta=z)
    return None


class _Draft(NamedTuple):
    """A Certificate of one calibration while it is computed (its scopes may be Deferred)."""

    per_element: _Scope
    per_record: _Scope
    accountant: str
    notes: list[str]
    designed: Designed | None = None
    privunit: PrivUnitFigures | None = None

    def final(self, dp_delta: float) -> Certificate:
        return Certificate(self.per_element.final(), self.per_record.final(), dp_delta, self.accountant,
                           tuple(self.notes), designed=self.designed, privunit=self.privunit)


def certify(calib: Calibration) -> Certificate:
    """The certified figures of one calibration: per element, per record, and what applies
    (MVG and IDN's designed figure, PrivUnit's split)."""
    return _certify(calib, deferred=False).final(calib.dp_delta)


def _certify(calib: Calibration, deferred: bool) -> _Draft:
    """certify(calib); `deferred`: see _scope."""
    if calib.privunit is not None:
        return _privunit_draft(calib)
    notes = discrete_notes(calib) if calib.noise.startswith("discrete-") else []
    if calib.log_p != -math.inf and calib.noise != "discrete-laplace":
        notes.append(
            "TLDP keeps each raw value with probability p; no pure bound covers that point "
            "mass, so every delta includes point_mass_delta (p per element, 1-(1-p)^I per record)."
        )
        if calib.noise in ("gaussian", "discrete-gaussian"):
            notes.append("rho is the zCDP of the Gaussian noise applied to values that are not kept.")
    if calib.noise == "gaussian":
        notes.append("Gaussian noise has no pure epsilon; epsilon/delta is the analytic Gaussian "
                     "bound at dp_delta plus the point-mass delta.")
    if calib.noise in ("laplace", "gaussian"):
        notes.append("The " + FLOAT_SAMPLER_NOTE + ".")
    designed = designed_guarantee(calib)
    if designed is not None:
        notes.append(f"{calib.mechanism.upper()} adds i.i.d. Gaussian noise to every element; "
                     "designed is the (epsilon, delta) per record its own analysis states for "
                     "that noise, looser than the tight per_record figure.")
    return _Draft(_scope(calib, 1, deferred), _scope(calib, calib.elements, deferred),
                  "closed form (pure eps, zCDP); dp-accounting (Laplace: min of PLD and RDP; analytic Gaussian)",
                  notes, designed)


def _top(values: list[float | None]) -> float | None:
    live = [v for v in values if v is not None]
    return max(live) if live else None


def worst_scope(scopes: Sequence[Guarantee | _Scope]) -> Guarantee:
    """Field by field the weakest of several scopes' figures: the largest epsilon, delta,
    rho, approx epsilon and delta, and point-mass delta. Each is a valid bound for every
    one of them (an (eps_t, delta_t) guarantee implies (max eps, max delta)); rho is None
    (no zCDP bound) when any scope has none."""
    rhos = [s.rho for s in scopes]
    return Guarantee(
        epsilon=_worst([s.epsilon for s in scopes]),
        delta=max(s.delta for s in scopes),
        delta_log10=_top([s.delta_log10 for s in scopes]),
        rho=None if any(r is None for r in rhos) else max(r for r in rhos if r is not None),
        approx_delta=max(s.approx_delta for s in scopes),
        approx_epsilon=_worst([s.approx_epsilon for s in scopes]),
        point_mass_delta=max(s.point_mass_delta for s in scopes),
        point_mass_delta_log10=_top([s.point_mass_delta_log10 for s in scopes]),
    )


# --------------------------------------------------------------------------- many record sizes
# A folder of images of thousands of sizes has a calibration per size, and certify_all states
# the worst case over them, field by field. The figures that take an accountant's run (the
# privacy-loss distribution of I elements, the analytic Gaussian) are Deferred there: each
# carries a cheap upper bound on the very number the accountant would return, and _worst
# runs the accountant in decreasing order of the bounds, only while a bound exceeds the
# largest figure found. The result is the same maximum as computing every one (a figure
# skipped is at most its bound, which is at most that maximum), in the time of a few.

class Deferred:
    """A figure not computed yet (compute()), and `upper`, an upper bound on it."""

    __slots__ = ("upper", "_compute", "_value")

    def __init__(self, upper: float, compute) -> None:
        self.upper, self._compute = float(upper), compute
        self._value: float | None = None

    def value(self) -> float:
        if self._value is None:
            self._value = self._compute()
        return self._value


def _value(figure: float | Deferred) -> float:
    return figure.value() if isinstance(figure, Deferred) else figure


def _worst(values: list) -> float:
    """max(values), where any may be a Deferred (see above)."""
    known = [v for v in values if not isinstance(v, Deferred)]
    worst = max(known) if known else -math.inf
    pending = {id(v): v for v in values if isinstance(v, Deferred)}
    for figure in sorted(pending.values(), key=lambda v: v.upper, reverse=True):
        if figure.upper <= worst:
            break  # this bound and every later one: no figure above the worst found
        worst = max(worst, figure.value())
    return worst


_BOUND_MARGIN = 1e-9  # relative: the bounds below, raised past their own rounding


def _zcdp_epsilon(rho: float, delta: float) -> float:
    """rho + 2 sqrt(rho ln(1/delta)): above the analytic Gaussian epsilon of a Gaussian
    mechanism of zCDP rho (Bun and Steinke 2016, Proposition 1.3), which is exact."""
    return (rho + 2 * math.sqrt(rho * math.log(1 / delta))) * (1 + 1e-6) + 1e-9


def _gaussian_rdp_upper(rho: float, delta: float) -> float:
    """At least what discrete_gaussian_epsilon returns for a total rho: its RDP accountant's
    epsilon is, at each order a > 1.01 of rdp_orders, r + ln((a-1)/a) - ln(delta a)/(a-1)
    <= a rho + ln(1/delta)/(a-1) (r = a rho), and it takes the least over the orders."""
    import numpy as np

    orders = np.array([a for a in rdp_orders() if a > 1.01])
    return float(np.min(orders * rho + math.log(1 / delta) / (orders - 1))) * (1 + _BOUND_MARGIN)


CHERNOFF_MAX_ELEMENT_EPSILON = 50.0
_CHERNOFF_STEPS = tuple(40.0 ** (k / 20) for k in range(-20, 21))  # the t grid, around its centre


def _pld_chernoff(log_upper, log_lower, interval: float, count: int, delta: float) -> float:
    """An upper bound on what _composed_pld_epsilon returns (when the accountant's numerics
    hold): the composed loss L of `count` elements of the same pessimistic pair (losses
    rounded up to multiples of `interval`, as _pld_from_log_pmfs) has hockey-stick
    delta(eps) <= P(L > eps) <= exp(count K(t) - t eps) for every t > 0 (Chernoff; K the log
    moment generating function of one element's rounded loss), so eps is at most
    (count K(t) + ln(1/delta'))/t. delta' leaves delta/1000 for what the accountant's tail
    truncation (1e-15) and floating point add to its delta."""
    import numpy as np

    losses = pessimistic_bins(log_upper, log_lower, interval) * interval
    log_delta = math.log(1 / (delta * (1 - 1e-3)))
    # Any t gives a bound; the best is near sqrt(2 ln(1/delta) / (count var)) (the loss is
    # nearly normal once composed), so the grid spans a factor 40 either side of that.
    weights = np.exp(log_upper)
    mean = float(weights @ losses) / float(weights.sum())
    spread = math.sqrt(max(float(weights @ (losses - mean) ** 2) / float(weights.sum()), 1e-300))
    centre = min(max(math.sqrt(2 * log_delta / count) / spread, 1e-7), 1e5)
    t = centre * np.array(_CHERNOFF_STEPS)[:, None]
    exponents = log_upper + t * losses  # ln(p_k) + t l_k, p_k the mass (before its bin's sum)
    top = exponents.max(axis=1, keepdims=True)
    K = (top + np.log(np.exp(exponents - top).sum(axis=1, keepdims=True)))[:, 0]
    bounds = (count * K + log_delta) / t[:, 0]
    return float(np.min(bounds)) * (1 + _BOUND_MARGIN) + _BOUND_MARGIN


def _deferred_discrete_laplace(sensitivity: int, scale: float, log_p: float, count: int, delta: float):
    """discrete_laplace_approx_epsilon, Deferred where it runs the accountant."""
    if not (sensitivity + 3 <= DISCRETE_PLD_MAX_OUTCOMES and count <= PLD_MAX_RELEASES):
        return discrete_laplace_approx_epsilon(sensitivity, scale, log_p, count, delta)  # the pure bound
    element = discrete_laplace_element_epsilon(sensitivity, scale, log_p)
    bound = count * element
    # One element: its accountant's run is short, and kept for equal elements. Above
    # CHERNOFF_MAX_ELEMENT_EPSILON the bound is the pure one alone: where the accountant's
    # numerics fail, its figure is the pure bound, which a Chernoff bound need not reach.
    if count > 1 and element <= CHERNOFF_MAX_ELEMENT_EPSILON:
        upper, lower = discrete_laplace_log_pmfs(sensitivity, scale, log_p)
        bound = min(bound, _pld_chernoff(upper, lower, _interval(count, element), count, delta))
    return Deferred(bound, lambda: discrete_laplace_approx_epsilon(sensitivity, scale, log_p, count, delta))


def certify_all(calibrations: list[Calibration],
                records: list[list[Calibration]] | None = None) -> Certificate:
    """`certify` for a run whose records have several calibrations (records of different
    sizes: images, the arrays of an HDF5 or Zarr group, the tensors of a model file).

    A smaller record has a larger retain probability and, under --budget record, a larger
    per-element epsilon, so no single calibration's figures hold for every record:
    per_element and per_record are the worst case over all of them (worst_scope), and
    `designed` (MVG, IDN) the one of the largest epsilon. One calibration: exactly
    certify(calibration).

    `records`: when a subject's record spans several arrays (row i of every array that
    shares axis 0), the calibrations each kind of record spans, one entry per array;
    per_record is then the worst of their compositions.
    """
    result = _certify_each(calibrations)
    if records:
        # Each kind of record once: a WebDataset's thousands of samples are a few kinds.
        kinds = list(dict.fromkeys(tuple(row) for row in records))
        result = dataclasses.replace(
            result, per_record=worst_scope([compose([(c, 1) for c in row]) if len(row) > 1
                                            else certify(row[0]).per_record for row in kinds]),
            notes=result.notes + (
                "A record spans row i of every array that shares the first axis (one subject): "
                "per_record composes one row of each (row_datasets lists them).",))
    return result


def _certify_each(calibrations: list[Calibration]) -> Certificate:
    distinct = list(dict.fromkeys(calibrations))
    if not distinct:
        raise ValueError("certify_all needs at least one calibration")
    if len(distinct) == 1:
        return certify(distinct[0])
    drafts = [_certify(c, deferred=True) for c in distinct]
    notes = list(dict.fromkeys(note for draft in drafts for note in draft.notes))
    notes.append(f"The records have {len(distinct)} calibrations (record sizes): per_element and "
                 "per_record are the worst case over them, field by field (the largest epsilon, "
                 "delta, rho, approx and point_mass_delta of any), each a bound for every element "
                 "and every record.")
    designed = [d.designed for d in drafts if d.designed is not None]
    split = [d.privunit for d in drafts if d.privunit is not None]
    return Certificate(
        per_element=worst_scope([d.per_element for d in drafts]),
        per_record=worst_scope([d.per_record for d in drafts]),
        dp_delta=distinct[0].dp_delta,
        accountant=drafts[0].accountant,
        notes=tuple(notes),
        worst_case_of=len(distinct),
        designed=max(designed, key=lambda d: d.epsilon) if designed else None,
        # the record size of the largest figure (calibrations lists each)
        privunit=max(split, key=lambda d: d.epsilon) if split else None)


def laplace_mixture_epsilon(events: list[tuple[float, int]], delta: float) -> float:
    """Epsilon at delta of Laplace mechanisms of several scales released together.

    `events` holds (scale/sensitivity, count) pairs. One scale is laplace_composed_epsilon;
    several are composed by the same accountants, and the smallest valid bound wins.
    """
    groups: dict[float, int] = {}
    for multiplier, count in events:
        groups[multiplier] = groups.get(multiplier, 0) + int(count)
    if len(groups) == 1:
        ((multiplier, count),) = groups.items()
        return laplace_composed_epsilon(multiplier, count, delta)
    from dp_accounting import ComposedDpEvent, LaplaceDpEvent, SelfComposedDpEvent
    from dp_accounting.pld.pld_privacy_accountant import PLDAccountant
    from dp_accounting.rdp import RdpAccountant

    event = ComposedDpEvent([SelfComposedDpEvent(LaplaceDpEvent(noise_multiplier=m), c)
                             for m, c in groups.items()])
    bounds = [sum(c / m for m, c in groups.items())]
    rdp = RdpAccountant(rdp_orders())
    rdp.compose(event)
    bounds.append(rdp.get_epsilon(delta))
    spread = math.sqrt(sum(c / m**2 for m, c in groups.items()))
    if sum(groups.values()) <= PLD_MAX_RELEASES and max(1 / m for m in groups) <= PLD_MAX_ELEMENT_EPSILON:
        def composed() -> float:
            pld = PLDAccountant(value_discretization_interval=max(1e-4, spread / 2000))
            pld.compose(event)
            return pld.get_epsilon(delta)

        bounds += pld_bound(composed)
    return float(min(bounds))


def composed_point_mass_delta(items: list[tuple[float, int]]) -> tuple[float, float | None]:
    """1 - prod_t (1 - p_t)^{n_t} for (log p_t, n_t) pairs, and its log10 (first order,
    log10 sum n_t p_t, when the delta underflows)."""
    live = [(log_p, n) for log_p, n in items if log_p != -math.inf and n > 0]
    if not live:
        return 0.0, None
    delta = 0.0 - math.expm1(sum(n * math.log1p(-math.exp(log_p)) for log_p, n in live))  # never -0.0
    if delta > 1e-300:
        return delta, math.log10(delta)
    terms = [log_p + math.log(n) for log_p, n in live]
    top = max(terms)
    return delta, (top + math.log(sum(math.exp(t - top) for t in terms))) / LN10


def compose(parts: list[tuple[Calibration, int]]) -> Guarantee:
    """Guarantee of several records released together: all the tensors of a model file,
    all the records of a file, every round of a training run.

    `parts` holds (calibration, number of records) pairs, all at one dp_delta; every
    element of every record is one release. Laplace: pure eps sums, (eps, delta) from
    dp-accounting. Gaussian: rho sums and the composition is exactly a Gaussian of
    noise multiplier 1/sqrt(2 rho) (analytic Gaussian). Discrete Laplace: the exact pure
    eps of the mixtures sums, and (eps, delta) is the composed privacy-loss distribution
    of the mixtures (or the zCDP that pure eps implies). Discrete Gaussian: rho sums, and
    eps at delta comes from the RDP bound of the continuous Gaussian of that rho (the
    privacy-loss distribution too, for one noise scale). Point masses combine as
    1 - prod (1 - p_t)^{n_t I_t} (a union term beside the Gaussians' delta).
    """
    parts = [(c, int(n)) for c, n in parts if n > 0]
    if not parts:
        raise ValueError("compose needs at least one record")
    target = parts[0][0].dp_delta
    if any(c.dp_delta != target for c, _ in parts):
        raise ValueError("compose needs one dp_delta for all parts")
    releases = [(c, n * c.elements) for c, n in parts]
    pm_delta, pm_log10 = composed_point_mass_delta([(c.log_p, m) for c, m in releases])
    noises = {c.noise for c, _ in parts}
    at_delta, total = noise_delta(target, pm_delta)
    if noises == {PRIVUNIT}:
        return _privunit_composed([(c, n) for c, n in parts], target).final()
    if noises == {"laplace"}:
        pure = sum(m * c.range_width / c.scale for c, m in releases)
        approx_eps = laplace_mixture_epsilon([(c.scale / c.range_width, m) for c, m in releases], at_delta)
        return _pure(pure, approx_eps, total, (pm_delta, pm_log10)).final()
    if noises == {"gaussian"}:
        rho = sum(m * c.range_width**2 / (2 * c.scale**2) for c, m in releases)
        approx_eps = gaussian_epsilon(1 / math.sqrt(2 * rho), at_delta)
        return _approximate(approx_eps, total, rho, (pm_delta, pm_log10)).final()
    if noises == {"discrete-laplace"}:
        # the pure bound covers the kept values: no point-mass delta
        items = [(c.grid_steps, c.scale, c.log_p, m) for c, m in releases]
        pure = sum(m * discrete_laplace_element_epsilon(d, b, log_p) for d, b, log_p, m in items)
        return _pure(pure, discrete_laplace_composed_epsilon(items, target), target).final()
    if noises == {"discrete-gaussian"}:
        groups: dict[tuple[float, int], int] = {}
        for c, m in releases:
            key = (c.scale, c.grid_steps)
            groups[key] = groups.get(key, 0) + m
        rho = sum(m * d**2 / (2 * sigma**2) for (sigma, d), m in groups.items())
        if len(groups) == 1:
            ((sigma, d), m), = groups.items()
            eps = discrete_gaussian_epsilon(sigma, d, m, at_delta)
        else:
            eps = discrete_gaussian_rdp_epsilon(rho, at_delta)
        return _approximate(eps, total, rho, (pm_delta, pm_log10)).final()
    # Basic composition of each record's (eps, delta) as its own scope states them.
    records = [(certify(c).per_record, n) for c, n in parts]
    delta, delta_log10 = _union_delta([(r.delta, r.delta_log10, n) for r, n in records])
    pm_delta, pm_log10 = _union_delta([(r.point_mass_delta, r.point_mass_delta_log10, n) for r, n in records])
    rhos = [(r.rho, n) for r, n in records]
    return Guarantee(
        epsilon=sum(n * r.epsilon for r, n in records), delta=delta, delta_log10=delta_log10,
        rho=None if any(rho is None for rho, _ in rhos) else sum(n * (rho or 0.0) for rho, n in rhos),
        approx_delta=_union_delta([(r.approx_delta, None, n) for r, n in records])[0],
        approx_epsilon=sum(n * r.approx_epsilon for r, n in records),
        point_mass_delta=pm_delta, point_mass_delta_log10=pm_log10,
    )


def _union_delta(items: list[tuple[float, float | None, int]]) -> tuple[float, float | None]:
    """1 - prod (1 - delta_t)^{n_t} for (delta_t, log10 delta_t, n_t), and its log10
    (first order from the log10s when the delta underflows)."""
    delta = 0.0 - math.expm1(sum(n * math.log1p(-min(1.0, d)) for d, _, n in items))
    if delta > 1e-300:
        return delta, math.log10(delta)
    logs = [lg + math.log10(n) for _, lg, n in items if lg is not None and n > 0]
    if not logs:
        return delta, None
    top = max(logs)
    return delta, top + math.log10(sum(10 ** (lg - top) for lg in logs))


def certify_file(arrays: list[tuple[str, Calibration, int]], *, per_tensor: bool = False) -> FileCertificate:
    """Figures for everything one run released: `arrays` holds (name, calibration,
    records) per array. `per_file` composes every record and, with per_tensor (model
    files: each tensor is one record), `per_tensor` holds each tensor's calibration and
    per-record figures."""
    composed = compose([(calib, records) for _, calib, records in arrays])
    per_file = FileGuarantee(**dataclasses.asdict(composed), records=sum(n for _, _, n in arrays),
                             elements=sum(n * c.elements for _, c, n in arrays))
    if not per_tensor:
        return FileCertificate(per_file)
    scopes: dict[Calibration, Guarantee] = {}
    for _, calib, _ in arrays:
        if calib not in scopes:
            scopes[calib] = _scope(calib, calib.elements).final()
    return FileCertificate(per_file, tuple(TensorFigures(name, calib, scopes[calib]) for name, calib, _ in arrays))


def certify_run(calibrations: list[Calibration], records: list[list[Calibration]] | None,
                arrays: list[tuple[str, Calibration, int]], *, per_tensor: bool = False) -> Certificate:
    """What a run states: certify_all over its calibrations (`records`: the calibrations
    each kind of subject's record spans) with certify_file's per_file and per_tensor over
    its arrays (name, calibration, records)."""
    file = certify_file(arrays, per_tensor=per_tensor)
    return dataclasses.replace(certify_all(calibrations, records), per_file=file.per_file,
                               per_tensor=file.per_tensor)


# A subject's certified epsilon above which perturb and plan warn (docs/choosing-eps.md).
# e^eps bounds how much more likely the release makes any output under one record than
# under another: at 100 that factor is 2.7e43, so no prior belief an attacker could hold
# about a record is protected; in practice the data comes out recognisable long before.
# Local DP deployments use single digits per record, and the projection mechanism gives
# useful data there; 100 flags figures that protect nothing without flagging any of those.
RECORD_EPSILON_WARNING = 100.0


def subject_scope(certified: Certificate) -> tuple[str, Guarantee]:
    """The scope of one subject's data, by its name in Certificate: a record (an image, a
    row of the arrays that share it), or in a model file (one party's tensors, as
    subject_scopes counts it) the whole file."""
    return subject_scopes(certified)[-1]


def large_record_epsilon(certified: Certificate) -> float | None:
    """The subject's certified epsilon (subject_scope) when it exceeds
    RECORD_EPSILON_WARNING, else None."""
    epsilon = subject_scope(certified)[1].epsilon
    return epsilon if epsilon > RECORD_EPSILON_WARNING else None


# --------------------------------------------------------------------------- discrete noises
# Integer-valued noise on a grid of W values (discrete.py): the sensitivity is d = W - 1
# grid steps. The dominating pair of inputs is the two ends of the range, 0 and d: every
# closer pair has a hockey-stick curve below theirs (tests/sampling/test_discrete.py checks it).

def discrete_laplace_element_epsilon(sensitivity: int, scale: float, log_p: float) -> float:
    """Exact pure epsilon of one element: keep the value with probability p, else add
    two-sided geometric noise with a = e^(-1/b), on inputs {0..d} (docs/guarantee.md, "Discrete noise"):
    d/b + ln(1 + p (1 + a) / ((1 - p)(1 - a))). The worst output is the kept value."""
    t = 1.0 / scale
    pure = sensitivity * t
    if log_p == -math.inf:
        return pure
    log_ratio = (log_p + math.log1p(math.exp(-t)) - math.log(-math.expm1(-t))
                 - math.log1p(-math.exp(log_p)))
    # ln(1 + e^x), without overflow for large x
    return pure + (log_ratio + math.log1p(math.exp(-log_ratio)) if log_ratio > 0
                   else math.log1p(math.exp(log_ratio)))


def discrete_laplace_log_pmfs(sensitivity: int, scale: float, log_p: float) -> tuple[np.ndarray, np.ndarray]:
    """log P(y | x = 0) and log P(y | x = d) of the TLDP mixture with discrete Laplace noise.

    Outcomes: y = 0..d, then y < 0 and y > d lumped (the privacy loss is constant on
    each lump, so the lumps change nothing but the size)."""
    import numpy as np

    d = sensitivity
    log_a = -1.0 / scale
    log_1ma = math.log(-math.expm1(log_a))
    log_q = math.log1p(-math.exp(log_p)) if log_p != -math.inf else 0.0  # log(1 - p)
    log_c = log_q + log_1ma - math.log1p(math.exp(log_a))  # (1 - p)(1 - a)/(1 + a)
    y = np.arange(d + 1, dtype=np.float64)
    upper = np.empty(d + 3)
    upper[:d + 1] = log_c + y * log_a
    upper[d + 1] = log_c + log_a - log_1ma  # y < 0
    upper[d + 2] = log_c + (d + 1) * log_a - log_1ma  # y > d
    lower = np.concatenate([upper[d::-1], upper[[d + 2, d + 1]]])
    if log_p != -math.inf:
        upper[0] = np.logaddexp(log_p, upper[0])
        lower[d] = np.logaddexp(log_p, lower[d])
    return upper, lower


def pessimistic_bins(log_upper, log_lower, interval: float):
    """The privacy losses log_upper - log_lower rounded up to multiples of `interval` (as
    integers k: the loss is at most k * interval). Each loss is first raised past its
    floating-point error (a few ulps of the log-probabilities it is the difference of) and
    the quotient by one ulp, so a loss on a bin edge goes to the bin above, never below."""
    import numpy as np

    loss = log_upper - log_lower
    error = 8 * np.finfo(np.float64).eps * (np.abs(log_upper) + np.abs(log_lower))
    return np.ceil(np.nextafter((loss + error) / interval, np.inf)).astype(np.int64)


def _pld_from_log_pmfs(log_upper, log_lower, interval: float, infinity_mass: float = 0.0):
    """dp-accounting's pessimistic privacy-loss distribution of a pair of distributions on
    the same outcomes (both positive everywhere), built with NumPy: each loss is rounded
    up to a multiple of `interval`. Symmetric: the pair is its own mirror image."""
    import numpy as np
    from dp_accounting.pld.privacy_loss_distribution import PrivacyLossDistribution

    bins = pessimistic_bins(log_upper, log_lower, interval)
    low = int(bins.min())
    masses = np.bincount(bins - low, weights=np.exp(log_upper))
    rounded = {low + int(i): float(masses[i]) for i in np.flatnonzero(masses)}
    return PrivacyLossDistribution.create_from_rounded_probability(
        rounded, infinity_mass, interval, pessimistic_estimate=True)


DISCRETE_PLD_MAX_OUTCOMES = 1 << 22  # beyond: the pure (Laplace) or RDP (Gaussian) bound alone


def _composed_pld_epsilon(log_upper, log_lower, interval: float, count: int, delta: float,
                          infinity_mass: float = 0.0) -> list[float]:
    """[eps at delta of `count` releases of one mechanism given by its two log pmfs], or []
    where the privacy-loss distribution's numerics fail (pld_bound). Kept by the exact
    bytes of its inputs: records of different sizes whose retain probability is below
    float64's resolution (every image of a folder) share one element's computation."""
    import hashlib

    key = (hashlib.blake2b(log_upper.tobytes() + b"|" + log_lower.tobytes(), digest_size=20).digest(),
           len(log_upper), interval, count, delta, infinity_mass)
    if key in _PLD_EPSILONS:
        return list(_PLD_EPSILONS[key])

    def composed() -> float:
        pld = _pld_from_log_pmfs(log_upper, log_lower, interval, infinity_mass)
        if count > 1:
            pld = pld.self_compose(count)
        return pld.get_epsilon_for_delta(delta)

    found = pld_bound(composed)
    if len(_PLD_EPSILONS) >= 4096:
        _PLD_EPSILONS.clear()
    _PLD_EPSILONS[key] = tuple(found)
    return found


_PLD_EPSILONS: dict[tuple, tuple[float, ...]] = {}


def _interval(count: int, spread: float) -> float:
    """Discretisation of the PLD: fine for one element, coarser as the composed loss spreads."""
    return max(1e-12, math.sqrt(count) * spread / 2000)


def _lru(function):
    import functools

    return functools.lru_cache(maxsize=256)(function)


@_lru
def discrete_laplace_approx_epsilon(sensitivity: int, scale: float, log_p: float, count: int,
                                    delta: float) -> float:
    """Epsilon at delta of `count` elements of the discrete Laplace TLDP mixture: the
    smaller of the pure bound and the composed privacy-loss distribution."""
    element = discrete_laplace_element_epsilon(sensitivity, scale, log_p)
    bounds = [count * element]
    if sensitivity + 3 <= DISCRETE_PLD_MAX_OUTCOMES and count <= PLD_MAX_RELEASES:
        upper, lower = discrete_laplace_log_pmfs(sensitivity, scale, log_p)
        bounds += _composed_pld_epsilon(upper, lower, _interval(count, element), count, delta)
    return float(min(bounds))


def discrete_laplace_composed_epsilon(items: list[tuple[int, float, float, int]], delta: float) -> float:
    """Epsilon at delta of discrete Laplace TLDP mixtures released together; `items` holds
    (sensitivity, scale, log p, elements) per kind. The smallest of: the pure bound (sum of
    the elements' exact pure eps), the zCDP that pure eps implies (eps-DP is eps^2/2-zCDP;
    Bun and Steinke 2016, Propositions 1.3 and 1.4), and the composed privacy-loss
    distributions (one per kind, self-composed, then composed together)."""
    groups: dict[tuple[int, float, float], int] = {}
    for d, b, log_p, count in items:
        groups[(d, b, log_p)] = groups.get((d, b, log_p), 0) + int(count)
    elements = {key: discrete_laplace_element_epsilon(*key) for key in groups}
    pure = sum(n * elements[key] for key, n in groups.items())
    rho = sum(n * elements[key] * elements[key] / 2 for key, n in groups.items())  # inf, not OverflowError, past float64
    bounds = [pure, rho + 2 * math.sqrt(rho * math.log(1 / delta))]
    if len(groups) == 1:
        ((key, n),) = groups.items()
        bounds.append(discrete_laplace_approx_epsilon(*key, n, delta))
    elif (sum(groups.values()) <= PLD_MAX_RELEASES
          and all(d + 3 <= DISCRETE_PLD_MAX_OUTCOMES for d, _, _ in groups)):
        interval = max(1e-4, math.sqrt(2 * rho) / 2000)  # as _interval, for the composed spread

        def composed() -> float:
            pld = None
            for (d, b, log_p), n in groups.items():
                part = _pld_from_log_pmfs(*discrete_laplace_log_pmfs(d, b, log_p), interval)
                part = part.self_compose(n) if n > 1 else part
                pld = part if pld is None else pld.compose(part)
            assert pld is not None  # more than one kind here (one alone took the branch above)
            return pld.get_epsilon_for_delta(delta)

        bounds += pld_bound(composed)
    return float(min(bounds))


def discrete_gaussian_rdp_epsilon(rho: float, delta: float) -> float:
    """Epsilon at delta of discrete Gaussian mechanisms of total rho: the RDP bound of one
    continuous Gaussian of noise multiplier 1/sqrt(2 rho), whose Renyi divergences bound
    theirs (CKS20, Proposition 5) and compose additively."""
    from dp_accounting import GaussianDpEvent
    from dp_accounting.rdp import RdpAccountant

    rdp = RdpAccountant(rdp_orders())
    rdp.compose(GaussianDpEvent(noise_multiplier=1 / math.sqrt(2 * rho)))
    return float(rdp.get_epsilon(delta))


def compose_releases(releases: list[tuple[Guarantee, float]]) -> tuple[float, float]:
    """(epsilon, delta) that several releases spend together on one subject, from each
    release's per-record scope (a manifest's `per_record`, read back) and its --dp-delta.

    Pure epsilons and deltas add (basic composition, valid for every release). When every
    release states a zCDP rho, the rhos add too, and the epsilon of their sum (the RDP
    bound, valid for continuous and discrete Gaussian noise) with the kept values' deltas
    is used where it is smaller. That epsilon is stated at the smallest --dp-delta of the
    releases: a release with a larger one cannot trade the others' delta for a smaller
    epsilon under an epsilon cap."""
    if not releases:
        return 0.0, 0.0
    scopes = [scope for scope, _ in releases]
    basic = (sum(s.epsilon for s in scopes), min(1.0, sum(s.delta for s in scopes)))
    rhos = [s.rho for s in scopes]
    if any(rho is None for rho in rhos):
        return basic
    dp_delta = min(delta for _, delta in releases)
    kept = sum(s.point_mass_delta for s in scopes)
    by_rho = (discrete_gaussian_rdp_epsilon(sum(rho or 0.0 for rho in rhos), dp_delta),
              min(1.0, dp_delta + kept))
    return by_rho if by_rho[0] < basic[0] else basic


def epsilon_left(cap: float, spent: float) -> float:
    """What a subject that has spent `spent` (compose_releases) has left under an epsilon
    cap: the epsilon of a further pure release that basic composition keeps under the cap
    (never below 0; composing Gaussian releases through zCDP can leave more)."""
    return max(0.0, cap - spent)


def discrete_gaussian_log_pmfs(sigma: float, sensitivity: int):
    """log P(y | x = 0), log P(y | x = d) of discrete Gaussian noise N_Z(0, sigma^2) on
    y = -T..T + d, and a bound on the upper distribution's mass outside (|y| > T)."""
    import numpy as np

    T = math.ceil(sigma * math.sqrt(2 * 80 * math.log(2))) + 1
    y = np.arange(-T, T + sensitivity + 1, dtype=np.float64)
    inv = 1.0 / (2 * sigma**2)
    core = np.arange(-T, T + 1, dtype=np.float64)
    log_norm = math.log(float(np.exp(-core**2 * inv).sum()))  # at most the full sum: pessimistic
    upper = -y**2 * inv - log_norm
    lower = -(y - sensitivity) ** 2 * inv - log_norm
    # sum over |y| > T of exp(-y^2/(2 sigma^2)), over a normaliser >= 1
    tail = 2 * sigma**2 / T * math.exp(-T**2 * inv)
    return upper, lower, tail


@_lru
def discrete_gaussian_epsilon(sigma: float, sensitivity: int, count: int, delta: float) -> float:
    """Epsilon at delta of `count` discrete Gaussian mechanisms N_Z(0, sigma^2) of
    sensitivity d: the smaller of the composed privacy-loss distribution and the RDP
    bound of the continuous Gaussian of the same sigma/d (the discrete Gaussian's Renyi
    divergences are at most the continuous one's: CKS20, Proposition 5)."""
    from dp_accounting import GaussianDpEvent
    from dp_accounting.rdp import RdpAccountant

    rdp = RdpAccountant(rdp_orders())
    rdp.compose(GaussianDpEvent(noise_multiplier=sigma / sensitivity), count)
    bounds = [rdp.get_epsilon(delta)]
    if 21 * sigma + sensitivity <= DISCRETE_PLD_MAX_OUTCOMES and count <= PLD_MAX_RELEASES:
        upper, lower, tail = discrete_gaussian_log_pmfs(sigma, sensitivity)
        bounds += _composed_pld_epsilon(upper, lower, _interval(count, sensitivity / sigma), count,
                                        delta, tail)
    return float(min(bounds))


def _discrete_scope(calib: Calibration, count: int, deferred: bool = False) -> _Scope:
    d, scale, target = calib.grid_steps, calib.scale, calib.dp_delta
    if calib.noise == "discrete-laplace":
        approx = (_deferred_discrete_laplace(d, scale, calib.log_p, count, target) if deferred
                  else discrete_laplace_approx_epsilon(d, scale, calib.log_p, count, target))
        return _pure(scope_epsilon(calib, count), approx, target)
    pm_delta, pm_log10 = point_mass_delta(calib.log_p, count)
    at_delta, total = noise_delta(target, pm_delta)
    epsilon = (Deferred(_gaussian_rdp_upper(count * d**2 / (2 * scale**2), at_delta),
                        lambda: scope_epsilon(calib, count)) if deferred else scope_epsilon(calib, count))
    return _approximate(epsilon, total, count * d**2 / (2 * scale**2), (pm_delta, pm_log10))


def discrete_notes(calib: Calibration) -> list[str]:
    grid = ("the integers" if calib.granularity is None
            else f"the grid {calib.granularity:g}*Z (input rounded to it; one more grid value in the range)")
    notes = [f"Discrete noise on {grid}: W = {calib.grid_values} values, sensitivity W-1 = "
             f"{calib.grid_steps} steps; noise_scale is in grid steps. Exact samplers: "
             "nothing is added to delta for sampling error."]
    if calib.noise == "discrete-laplace":
        notes.append("Discrete Laplace (a = e^(-1/b)): the kept raw value is covered by the exact "
                     "pure bound per element (W-1)/b + ln(1 + p(1+a)/((1-p)(1-a))), I times that per "
                     "record (delta 0); approx is the privacy-loss distribution of the same mixture.")
    else:
        notes.append("Discrete Gaussian: rho = (W-1)^2/(2 sigma^2) zCDP per element (Canonne, Kamath "
                     "and Steinke 2020), I times that per record; epsilon at dp_delta is the smaller "
                     "of the privacy-loss distribution and the RDP bound, plus the point-mass delta.")
    return notes


# --------------------------------------------------------------------------- PrivUnit
# A record is released as one unit vector V (privacy/privunit.py, sampling/privunit.py);
# docs/guarantee.md ("PrivUnit") derives the figure below.

def privunit_epsilon(k: int, gamma: float, p_numerator: int) -> float:
    """The certified pure epsilon of one record released by the PrivUnit sampler as
    implemented: candidates drawn independently of the record, the first one on the
    chosen side of the cap (probability p = p_numerator / 2^53 for the cap) released.

    Its output has density p / q_f(u) on the computed cap C_f(u) and (1 - p)/(1 - q_f(u))
    off it, against the law of one candidate, where q_f(u) is that law's share of C_f(u)
    and lies in [q_lo, q_hi] for every input (privunit.cap_probability_bounds: the
    floating-point margin). So the privacy loss is at most
    ln max(p/q_lo, (1-p)/(1-q_hi)) - ln min(p/q_hi, (1-p)/(1-q_lo)), which is
    eps0 + ln((1 - q_lo)/q_lo) when q_hi <= 1/2 <= p. Rounded up."""
    if not 2 <= k <= privunit.MAX_K or not 0 < p_numerator < 2**53:
        return math.inf
    q_lo, q_hi = privunit.cap_probability_bounds(gamma, k)
    if not (0 < q_lo and q_hi < 1):
        return math.inf
    log_p = math.log(p_numerator) - 53 * math.log(2)
    log_1mp = math.log(2**53 - p_numerator) - 53 * math.log(2)
    top = max(log_p - math.log(q_lo), log_1mp - math.log1p(-q_hi))
    bottom = min(log_p - math.log(q_hi), log_1mp - math.log1p(-q_lo))
    epsilon = top - bottom
    return epsilon * (1 + 16 * privunit.UNIT_ROUNDOFF) + 1e-15  # above the logs' rounding


def privunit_record_epsilon(calib: Calibration) -> float:
    params = calib.privunit_params()
    return privunit_epsilon(params.k, params.gamma, params.p_numerator)


def privunit_figures(calib: Calibration) -> PrivUnitFigures:
    """The figures of the PrivUnit split (the manifest's accounting.privunit): the cap's
    exact share q, its bounds for the sampler as implemented, the nominal epsilon
    eps0 + ln((1-q)/q) of the real-valued mechanism, the certified one and the margin
    between them, and the expected alignment E<V, u>."""
    params = calib.privunit_params()
    k, gamma, p = params.k, params.gamma, params.p
    q = privunit.cap_probability(gamma, k)
    q_lo, q_hi = privunit.cap_probability_bounds(gamma, k)
    margin = privunit.float_margin(k)
    nominal = params.epsilon0 + math.log1p(-q) - math.log(q)
    certified = privunit_record_epsilon(calib)
    return PrivUnitFigures(k=k, gamma=gamma, p=p, p_numerator=params.p_numerator, epsilon0=params.epsilon0,
                           q=q, q_lower=q_lo, q_upper=q_hi, inner_product_error=margin.inner,
                           excluded_probability=margin.excluded, nominal_epsilon=nominal, epsilon=certified,
                           margin=certified - nominal,
                           expected_alignment=privunit.expected_alignment(k, gamma, p))


def _privunit_scope(calib: Calibration, records: int) -> _Scope:
    """`records` records released by PrivUnit: pure epsilons add; (eps, delta) at dp_delta
    is the smaller of that and the zCDP that pure eps implies (eps^2/2 per record; Bun and
    Steinke 2016, Propositions 1.3 and 1.4)."""
    return _privunit_composed([(calib, records)], calib.dp_delta)


def _privunit_composed(parts: list[tuple[Calibration, int]], delta: float) -> _Scope:
    epsilons = [(privunit_record_epsilon(c), n) for c, n in parts]
    pure = sum(n * e for e, n in epsilons)
    rho = sum(n * e * e / 2 for e, n in epsilons)
    approx = min(pure, rho + 2 * math.sqrt(rho * math.log(1 / delta)))
    return _pure(pure, approx, delta)


def _privunit_draft(calib: Calibration) -> _Draft:
    """certify(calib) for --mechanism privunit: per_record is the certified pure epsilon;
    per_element is the same figure (changing one element can move the record's direction
    anywhere, so no smaller bound is claimed for it)."""
    record = _privunit_scope(calib, 1)
    notes = [
        "PrivUnit (Bhowmick et al. 2018): the record is projected on a public basis, normalised "
        "to a unit vector u, and released as one unit vector V, from the cap {<v,u> >= gamma} "
        "with probability p, else from the rest; pure epsilon = eps0 + ln((1-q)/q) for the "
        "real-valued mechanism (privunit.nominal_epsilon).",
        "The figures hold for the bytes written: the sampler draws candidates independently "
        "of the record and keeps the first on the chosen side of its floating-point cap test, "
        "whose share lies in [q_lower, q_upper] for every record; epsilon uses those bounds "
        "(privunit.margin above the nominal figure). The written values are a function of V "
        "alone (post-processing).",
        "per_element is the record's figure: an element is part of its record, and no smaller "
        "bound is claimed for it. approx is the smaller of the pure figure and the zCDP it "
        "implies, at dp_delta.",
    ]
    return _Draft(record, record, "closed form (PrivUnit, pure eps, with the sampler's floating-point margin)",
                  notes, privunit=privunit_figures(calib))
