"""Calibration of TLDP (paper, Algorithm 1 and 2) and of the paper's baselines
(Laplace and Gaussian, Theorem 2; MVG and IDN, see mvg_idn.py).

One place turns (mechanism, noise, budget, epsilon, range width, elements per
record) into a noise scale and a retain probability. The retain probability is
kept in log space: for real tensors it underflows float64 (I = 784, eps = 1 gives
log p ~ -789).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Callable

import functools

from tldp_cli.privacy import privunit
from tldp_cli.errors import OutOfReach, UsageError, reason_of
from tldp_cli.privacy.types import DISCRETE_NOISES, PRIVUNIT, Calibration, PrivUnitParams

MECHANISMS = ("tldp", "baseline", "mvg", "idn", PRIVUNIT)
GAUSSIAN_ONLY = ("mvg", "idn")  # (eps, delta) designs for Gaussian noise only
NOISES = ("laplace", "gaussian", *DISCRETE_NOISES, PRIVUNIT)
BUDGETS = ("element", "record")
# What a per-record --eps that TLDP cannot meet can use instead (--budget element would
# keep --eps but make it each element's: a per-record figure hundreds of times larger).
RECORD_LEVEL_MECHANISMS = ("--mechanism privunit (useful from a few units per record: docs/choosing-eps.md) "
                           "or --mechanism baseline (noise on every element, no value kept raw)")

# What to do when TLDP's retain probability, which depends on the data's units, is too large.
def raw_release_advice(noise: str) -> str:
    """What to do when TLDP's retain probability, which depends on the data's units, makes
    the kept raw values cost too much (`noise`: the one drawn)."""
    instead = ("--noise laplace with the default --sampler exact" if noise in ("laplace", "gaussian")
               else "--noise laplace (exact discrete Laplace)")
    return (f"Use {instead}, whose pure bound covers kept values, --mechanism baseline (keeps "
            "none), or a wider --range in smaller units (0:255 rather than 0:1)")


def is_number(value: object) -> bool:
    """A real number (int, float, a NumPy or torch scalar), not a str, a bool or None: what the
    library's eps=, dp_delta= and clip= must be before math.isfinite, whose TypeError ("must be
    real number, not str") names no parameter."""
    if isinstance(value, (str, bytes, bool)):
        return False
    try:
        float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return False
    return True


def shown(value: object) -> str:
    """A value in a message: a number as it prints, anything else as its repr ('1', None)."""
    return str(value) if is_number(value) else repr(value)


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


def default_noise(mechanism: str) -> str:
    """The noise when none is asked for: gaussian for MVG and IDN, laplace otherwise
    (PrivUnit adds none: what it draws is named privunit)."""
    if mechanism == PRIVUNIT:
        return PRIVUNIT
    return "gaussian" if mechanism in GAUSSIAN_ONLY else "laplace"


def resolve_budget(mechanism: str, budget: str | None) -> str:
    """--budget as given, or the mechanism's own when it is left out: record for PrivUnit
    (a record-level mechanism: --eps is what each whole record gets), element otherwise."""
    if budget is None:
        return "record" if mechanism == PRIVUNIT else "element"
    if mechanism == PRIVUNIT and budget != "record":
        raise UsageError("--mechanism privunit releases each record as a whole: its --eps is what "
                         "each record gets; leave out --budget or give --budget record")
    return budget


SAMPLERS = ("exact", "float")


def sampled_noise(noise: str, sampler: str, mechanism: str) -> str:
    """The noise a run draws. exact (the default): Laplace and Gaussian noise realised as their
    discrete counterparts on a grid (integers, or a power-of-two step for float data), whose
    figures hold for the bytes written. float: the continuous samplers, by request."""
    _check("sampler", sampler, SAMPLERS)
    if mechanism == PRIVUNIT:
        if sampler != "exact":
            raise UsageError("--mechanism privunit adds no noise and its figures always hold for the "
                             "bytes written; --sampler applies to the noise of the other mechanisms")
        return noise
    if sampler == "float":
        if noise in DISCRETE_NOISES:
            raise UsageError(f"--noise {noise} is exact noise; --sampler float applies to laplace "
                             "and gaussian")
        return noise
    if mechanism in GAUSSIAN_ONLY:
        raise UsageError(f"--mechanism {mechanism} adds real-valued Gaussian noise, which has no "
                         "exact sampler here: pass --sampler float (its figures then hold for the "
                         "real-valued mechanism only)")
    return {"laplace": "discrete-laplace", "gaussian": "discrete-gaussian"}.get(noise, noise)


def matrix_rows(mechanism: str, record_shape: tuple[int, ...], where: object) -> int | None:
    """MVG: the rows of the mode-1 unfolding of a record (its first axis); None otherwise."""
    if mechanism != "mvg":
        return None
    if len(record_shape) < 2:
        raise UsageError(f"{where}: --mechanism mvg needs matrix-shaped records (2 or more axes "
                         f"after the record axis), not records of shape {tuple(record_shape)}")
    return int(record_shape[0])


def check_parameters(*, mechanism: str, noise: str, budget: str, epsilon: float,
                     dp_delta: float) -> None:
    """Refuses option values no calibration can use (a usage error)."""
    _check("mechanism", mechanism, MECHANISMS)
    _check("noise", noise, NOISES)
    _check("budget", budget, BUDGETS)
    if (mechanism == PRIVUNIT) != (noise == PRIVUNIT):
        raise UsageError("--mechanism privunit adds no noise: leave out --noise" if mechanism == PRIVUNIT
                         else f"--noise privunit is --mechanism privunit's; --mechanism {mechanism} "
                              "adds laplace or gaussian noise")
    if mechanism == PRIVUNIT and budget != "record":
        resolve_budget(mechanism, budget)
    if mechanism in GAUSSIAN_ONLY and noise != "gaussian":
        raise UsageError(f"--mechanism {mechanism} adds Gaussian noise only; leave out --noise "
                         f"or give --noise gaussian, not {noise}")
    if not (is_number(epsilon) and math.isfinite(epsilon) and epsilon > 0):
        raise UsageError(f"--eps must be a finite number > 0, not {shown(epsilon)}")
    if not (is_number(dp_delta) and 0 < dp_delta < 1):
        raise UsageError(f"--dp-delta must lie in (0, 1), not {shown(dp_delta)}")


def calibrate(*, mechanism: str, noise: str, budget: str, epsilon: float,
              range_width: float, elements: int, dp_delta: float = 1e-5,
              rows: int | None = None, granularity: float | None = None) -> Calibration:
    """The noise scale and retain probability for the options (see _calibrate); refuses,
    as usage errors, parameters whose arithmetic leaves float64 and calibrations that
    keep every value. --mechanism privunit is calibrated per record shape: calibrate_privunit."""
    if mechanism == PRIVUNIT:
        raise UsageError("--mechanism privunit is calibrated from the record's shape and value range "
                         "(calibrate_privunit), not from its number of elements")
    try:
        calib = _calibrate(mechanism=mechanism, noise=noise, budget=budget, epsilon=epsilon,
                           range_width=range_width, elements=elements, dp_delta=dp_delta, rows=rows,
                           granularity=granularity)
    except (ZeroDivisionError, OverflowError) as exc:
        raise UsageError(f"a value range of width {range_width:g} with --eps {epsilon:g} is beyond "
                         f"float64 arithmetic ({reason_of(exc)}); express the values in other units") from None
    if math.exp(calib.log_p) >= 1.0:
        # Algorithm 1's p weighs a density against a probability, so it depends on the units
        # of the values: a narrow enough range makes it round to 1, every value kept.
        raise UsageError(f"with a value range of width {range_width:g} and --eps {epsilon:g}, TLDP "
                         "would keep every value (retain probability 1): no privacy; express the "
                         "values in larger units (a wider range) or lower --eps")
    return calib


def _calibrate(*, mechanism: str, noise: str, budget: str, epsilon: float,
               range_width: float, elements: int, dp_delta: float,
               rows: int | None, granularity: float | None) -> Calibration:
    """`rows`: MVG only, the record's first axis (see matrix_rows).

    Discrete noises count in grid steps. Integer data (granularity None): range_width is
    W, the number of integer values (hi - lo for [lo, hi)). Float data snapped to the grid
    G*Z (granularity G): range_width is the grid-aligned width G (W - 1). Either way the
    sensitivity is W - 1 steps and the paper's formulas take W as Delta.
    """
    check_parameters(mechanism=mechanism, noise=noise, budget=budget, epsilon=epsilon,
                     dp_delta=dp_delta)
    if noise in DISCRETE_NOISES:
        return _calibrate_discrete(mechanism=mechanism, noise=noise, budget=budget, epsilon=epsilon,
                                   range_width=range_width, elements=elements, dp_delta=dp_delta,
                                   granularity=granularity)
    from tldp_cli.privacy import accounting  # here: discrete noises' calibration never imports it

    if granularity is not None:
        raise UsageError("--granularity applies to the discrete noises (discrete-laplace, "
                         "discrete-gaussian)")
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
    elif mechanism in GAUSSIAN_ONLY:
        # Identity covariances: i.i.d. Gaussian noise on every element. element: the
        # mechanism's own design, (--eps, --dp-delta) for the record; record: the tight
        # analytic Gaussian, the same sigma as the Gaussian baseline.
        if mechanism == "mvg" and (rows is None or rows < 1 or I % rows):
            raise UsageError(f"--mechanism mvg needs the record's first axis, which must divide "
                             f"its {I} elements (got {rows})")
        if budget == "record":
            scale = D * math.sqrt(I) * accounting.gaussian_sigma_for(epsilon, dp_delta)
        elif mechanism == "mvg":
            from tldp_cli.privacy import mvg_idn  # NumPy: imported by the calibration that needs it

            assert rows is not None  # refused above
            scale = mvg_idn.mvg_sigma(rows, I, D, epsilon, dp_delta)
        else:
            from tldp_cli.privacy import mvg_idn

            scale = mvg_idn.idn_sigma(I, D, epsilon, dp_delta)
        eps_e = D**2 / (2 * scale**2)
        log_p = -math.inf
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
    return _within_budget(Calibration(mechanism, noise, budget, float(epsilon), float(D), int(I),
                                      float(dp_delta), float(eps_e), float(scale), float(log_p),
                                      rows if mechanism == "mvg" else None))


def calibrated_each(keys: list[Any], calibrate_one: Callable[[Any], Any]) -> dict[Any, Any]:
    """{key: calibrate_one(key)} for each key (a record size, a range group). Where the
    --eps of several keys is out of reach (OutOfReach), the refusal of the one whose least
    figure is largest: a folder of photos of several sizes is told once the --eps that
    serves every size, not the first size's, which would be refused again at the next."""
    done, refused = {}, []
    for key in keys:
        try:
            done[key] = calibrate_one(key)
        except OutOfReach as exc:
            refused.append(exc)
    if refused:
        raise max(refused, key=lambda exc: exc.least)
    return done


def calibrate_arrays(*, mechanism: str, noise: str, budget: str, epsilon: float, range_width: float,
                     dp_delta: float, granularity: float | None,
                     arrays: dict[str, tuple[int, int | None]],
                     rows: list[list[str]] | None = None) -> dict[str, Calibration]:
    """The calibration of each array of a run, by name. `arrays`: each array's elements per
    record and, for MVG, the rows of its unfolding (matrix_rows). Arrays of one record size
    share one calibration.

    `rows`: the arrays each subject's record spans (row i of each). Under --budget record
    such a row is one record of all their elements: every array in it gets the noise scale
    of that record, so the composed per-record figure is --eps (raised by the least step
    where the arrays' own retain probabilities would push it above)."""
    def one(elements: int, unfolding: int | None) -> Calibration:
        return calibrate(mechanism=mechanism, noise=noise, budget=budget, epsilon=epsilon,
                         range_width=range_width, elements=elements, dp_delta=dp_delta,
                         rows=unfolding, granularity=granularity)

    by_shape = calibrated_each(list(dict.fromkeys(arrays.values())), lambda shape: one(*shape))
    result = {name: by_shape[shape] for name, shape in arrays.items()}
    if budget != "record":
        return result
    solved: dict[tuple, list[Calibration]] = {}  # rows of the same record sizes: solved once
    for row in rows or []:
        if len(row) < 2:
            continue
        sizes = tuple(arrays[name] for name in row)
        if sizes in solved:
            result.update(zip(row, solved[sizes]))
            continue
        whole = one(sum(arrays[name][0] for name in row), 1 if mechanism == "mvg" else None)
        shared = {name: replace(whole, elements=arrays[name][0], rows=arrays[name][1]) for name in row}

        def row_at(scale: float) -> dict[str, Calibration]:
            return {name: _rescaled(c, scale) for name, c in shared.items()}

        # The least step up from the whole record's scale, then coarser ones: the arrays'
        # own retain probabilities (smaller records keep more) can cost more than it.
        steps = [1 + 2.0 ** (k - 52) for k in range(53)] + [1.1**k for k in range(1, 300)]
        for factor in steps:
            calibs = row_at(whole.scale * factor)
            if _row_epsilon(list(calibs.values())) <= epsilon:
                break
        else:
            least = min(_row_epsilon(list(row_at(whole.scale * f).values())) for f in steps[::10])
            raise UsageError(f"--budget record: a record spans {', '.join(row)} (one row of each); "
                             f"TLDP certifies no less than about {least:.4g} for it, above --eps "
                             f"{epsilon:g}; use a larger --eps, {RECORD_LEVEL_MECHANISMS}")
        result.update(calibs)
        solved[sizes] = [calibs[name] for name in row]
    return result


def _row_epsilon(calibs: list[Calibration]) -> float:
    """The per-record epsilon of one row of each of several arrays (what --budget record
    calibrates to): pure epsilons add; Gaussians compose."""
    from tldp_cli.privacy import accounting  # here: option checks never import it

    if calibs[0].noise in ("laplace", "discrete-laplace"):
        return sum(accounting.scope_epsilon(c, c.elements) for c in calibs)
    return accounting.compose([(c, 1) for c in calibs]).epsilon


def _rescaled(calib: Calibration, scale: float) -> Calibration:
    """The calibration with another noise scale: its element epsilon and p follow from it."""
    grid_values = calib.grid_values  # None unless the noise is discrete
    width = calib.range_width if grid_values is None else grid_values
    family = "laplace" if calib.noise.endswith("laplace") else "gaussian"
    eps_e = width / scale if family == "laplace" else width**2 / (2 * scale**2)
    log_p = (tldp_log_retain_probability(family, eps_e, scale, width, calib.elements)
             if calib.mechanism == "tldp" else -math.inf)
    return replace(calib, scale=float(scale), element_epsilon=float(eps_e), log_p=float(log_p))


def _within_budget(calib: Calibration) -> Calibration:
    """--budget record: the certified per-record epsilon must not exceed --eps, and rounding
    (I d / eps and back; a Gaussian's sigma and back) can put it a few ulps above. Then the
    scale is raised by the least relative step, doubled until it holds."""
    if calib.budget != "record":
        return calib
    from tldp_cli.privacy import accounting  # here: the element budget never imports it

    adjusted = calib
    for k in range(64):
        if accounting.scope_epsilon(adjusted, adjusted.elements) <= calib.epsilon:
            return adjusted
        adjusted = _rescaled(calib, calib.scale * (1 + 2.0 ** (k - 52)))
    raise ValueError(f"no scale near {calib.scale} certifies eps {calib.epsilon} per record")


def _boundary(ok, good: float, bad: float, tolerance: float = 1e-13) -> float:
    """Bisects between ok(good) and not ok(bad) (ok monotone between them); returns the
    point nearest the boundary where ok holds."""
    for _ in range(200):
        mid = (good + bad) / 2
        if not min(good, bad) < mid < max(good, bad) or abs(bad - good) <= tolerance * abs(mid):
            break
        if ok(mid):
            good = mid
        else:
            bad = mid
    return good


def _argmin_convex(f, lo: float, hi: float) -> float:
    """Golden-section search of a convex function of log x on [lo, hi]."""
    a, b = math.log(lo), math.log(hi)
    g = (math.sqrt(5) - 1) / 2
    for _ in range(200):
        if b - a <= 1e-12:
            break
        c, d = b - g * (b - a), a + g * (b - a)
        if f(math.exp(c)) <= f(math.exp(d)):
            b = d
        else:
            a = c
    return math.exp((a + b) / 2)


def _grid_values(range_width: float, granularity: float | None) -> int:
    """W, the number of values on the grid discrete noise is drawn on: the integers of an
    integer range [lo, lo + width), or the multiples of --granularity from lo to hi."""
    if granularity is None:
        W = round(range_width)
        if W != range_width:
            raise UsageError(f"discrete noise on integer data needs an integer range width, not {range_width}")
    else:
        if not (math.isfinite(granularity) and granularity > 0):
            raise UsageError(f"--granularity must be a finite number > 0, not {granularity}")
        steps = range_width / granularity
        if not (math.isfinite(steps) and abs(steps - round(steps)) <= 1e-9 * max(1.0, steps)):
            raise UsageError(f"the range width {range_width} is not a whole number of grid steps "
                             f"of {granularity}")
        W = round(steps) + 1
    if not 2 <= W <= 2**52:
        raise UsageError(f"discrete noise needs between 2 and 2^52 grid values in the range, not {W}")
    return W


def _calibrate_discrete(*, mechanism: str, noise: str, budget: str, epsilon: float,
                        range_width: float, elements: int, dp_delta: float,
                        granularity: float | None) -> Calibration:
    """Discrete Laplace and discrete Gaussian on W grid values (sensitivity d = W - 1).

    element budget: the continuous calibration with Delta = W (b = W/eps, sigma^2 =
    W^2/(2 eps); baselines b = I W/eps, sigma^2 = I W^2/(2 eps)). record budget: the
    scale whose certified per-record figure (accounting.py) equals --eps, solved by
    bisection where there is no closed form.
    """
    if mechanism not in ("tldp", "baseline"):
        raise UsageError(f"--noise {noise} applies to --mechanism tldp and baseline, not {mechanism}")
    W = _grid_values(range_width, granularity)
    if elements < 1:
        raise UsageError("a record must have at least one element")
    I, d = elements, W - 1
    family = "laplace" if noise == "discrete-laplace" else "gaussian"

    def sigma_for_record() -> float:
        """The smallest sigma whose certified per-record epsilon at dp_delta is at most --eps."""
        from tldp_cli.privacy import accounting

        def ok(sigma: float) -> bool:
            return accounting.discrete_gaussian_epsilon(sigma, d, I, dp_delta) <= epsilon
        # The continuous Gaussian's sigma is close; each step runs the PLD accountant.
        lo = d * math.sqrt(I) * accounting.gaussian_sigma_for(epsilon, dp_delta)
        hi = lo * 1.01
        while ok(lo):
            lo /= 1.25
        while not ok(hi):
            hi *= 1.25
        return _boundary(ok, hi, lo, tolerance=1e-9)

    log_p = -math.inf
    if mechanism == "tldp":
        if budget == "element":
            eps_e = epsilon
        elif noise == "discrete-laplace":
            def record_eps(e: float) -> float:
                from tldp_cli.privacy import accounting

                b = W / e
                return I * accounting.discrete_laplace_element_epsilon(
                    d, b, tldp_log_retain_probability(family, e, b, W, I))
            # Convex in log e: the noise term grows with e; the kept value's term, about
            # ln(1 + e^(-e (I - 1))), falls. Solve on the rising side of the minimum.
            hi = epsilon * W / (d * I)  # the noise term alone reaches --eps there
            # The least figure may lie above hi (then --eps is out of reach, and the message
            # must state the true least): widen until the function rises, as it does past
            # its minimum (convex in log e).
            top = hi
            while record_eps(2 * top) < record_eps(top):
                top *= 2
            best = _argmin_convex(record_eps, hi * 1e-12, 2 * top)
            if record_eps(best) > epsilon:
                raise OutOfReach(
                    f"--budget record: TLDP with discrete-laplace noise certifies at least "
                    f"{record_eps(best):.4g} per record of {I} elements (the paper's retain probability "
                    f"alone costs that much), above --eps {epsilon:g}; use a larger --eps, "
                    f"{RECORD_LEVEL_MECHANISMS}", record_eps(best))
            eps_e = _boundary(lambda e: record_eps(e) <= epsilon, best, hi)
        else:
            eps_e = W**2 / (2 * sigma_for_record() ** 2)
        scale = W / eps_e if noise == "discrete-laplace" else W / math.sqrt(2 * eps_e)
        log_p = tldp_log_retain_probability(family, eps_e, scale, W, I)
    elif noise == "discrete-laplace":
        scale = I * W / epsilon if budget == "element" else I * d / epsilon
        eps_e = W / scale
    else:
        scale = W * math.sqrt(I / (2 * epsilon)) if budget == "element" else sigma_for_record()
        eps_e = W**2 / (2 * scale**2)
    return _within_budget(Calibration(mechanism, noise, budget, float(epsilon), float(range_width), int(I),
                                      float(dp_delta), float(eps_e), float(scale), float(log_p), None,
                                      None if granularity is None else float(granularity)))


# --------------------------------------------------------------------------- PrivUnit

def calibrate_privunit(*, epsilon: float, record_shape: tuple[int, ...], value_range: tuple[float, float],
                       dp_delta: float = 1e-5, k: int | None = None, basis: str = "dct",
                       basis_sha256: str | None = None, reference: str | float | None = None,
                       min_cap: float = privunit.MIN_CAP_PROBABILITY) -> Calibration:
    """--mechanism privunit for records of `record_shape` in `value_range`: k coefficients
    (`k`, else the public default rule), the PrivUnit split of the record's --eps that
    maximises E<V, u> with a certified figure at most --eps (privunit_split), and the
    public reference point (--reference `reference`, None: auto) and output scale. Everything
    depends on the options and the record's shape, never on the data."""
    from tldp_cli.privacy import accounting  # here: option checks never import it

    check_parameters(mechanism=PRIVUNIT, noise=PRIVUNIT, budget="record", epsilon=epsilon,
                     dp_delta=dp_delta)
    lo, hi = value_range
    if not (math.isfinite(lo) and math.isfinite(hi) and hi > lo):
        raise UsageError(f"the value range must be finite and not empty, not {lo:g}:{hi:g}")
    elements = math.prod(record_shape)
    # A record's coefficients reach sqrt(I) (hi - lo), and the written deviation c B^T (w * V)
    # c max(w) <= c sqrt(k) <= (hi - lo) I / 8 (c = output_scale; w's mean square is 1); past
    # float64's largest value they would be inf, and an inf or NaN direction is never
    # accepted by the cap test.
    if not math.isfinite(4 * elements * (hi - lo)):
        raise UsageError(f"the value range {lo:g}:{hi:g} is too wide for --mechanism privunit's float64 "
                         f"arithmetic on records of {elements} elements; express the values in larger units")
    if elements < 2:
        raise UsageError(f"--mechanism privunit releases a direction, which needs records of 2 or more "
                         f"elements, not records of shape {tuple(record_shape)}")
    if k is None:
        k = max(2, privunit.default_k(epsilon, elements))
    if not 2 <= k <= elements:
        raise UsageError(f"--basis: k = {k} coefficients; PrivUnit needs 2 <= k <= {elements} (the "
                         f"record's elements) for records of shape {tuple(record_shape)}")
    if k > privunit.MAX_K:
        raise UsageError(f"--basis: k = {k} coefficients; PrivUnit's figures are certified for k up to "
                         f"{privunit.MAX_K} (docs/guarantee.md); give --basis dct:K with a smaller K")
    option = parse_reference(reference)
    rule = privunit.reference_choice(option, tuple(record_shape))
    if rule == "value" and not lo <= float(option) <= hi:
        raise UsageError(f"--reference {option:g} lies outside the declared range {lo:g}:{hi:g}")
    gamma, p_numerator = privunit_split(float(epsilon), int(k), float(min_cap))
    alignment = privunit.expected_alignment(int(k), gamma, p_numerator / 2.0**53)
    params = PrivUnitParams(k=int(k), gamma=gamma, p_numerator=p_numerator, basis=basis,
                            record_shape=tuple(int(n) for n in record_shape),
                            reference=privunit.reference_point(lo, hi, tuple(record_shape), option),
                            reference_rule=rule, reference_option=reference_text(option),
                            output_scale=privunit.output_scale(lo, hi, elements), low=float(lo),
                            high=float(hi), basis_sha256=basis_sha256,
                            alignment=alignment,
                            prior_exponent=privunit.prior_exponent(basis, record_shape, alignment),
                            emphasis_exponent=privunit.emphasis_exponent(basis, record_shape))
    calib = Calibration(PRIVUNIT, PRIVUNIT, "record", float(epsilon), float(hi - lo), int(elements),
                        float(dp_delta), 0.0, params.output_scale, -math.inf, privunit=params)
    certified = accounting.privunit_record_epsilon(calib)
    return replace(calib, element_epsilon=certified)


def parse_reference(reference: str | float | None) -> str | float:
    """--reference, parsed: auto (also for None), zero, low, mid, or a finite number."""
    if reference is None:
        return "auto"
    if isinstance(reference, str):
        if reference in privunit.REFERENCE_CHOICES:
            return reference
        try:
            value = float(reference)
        except ValueError:
            raise UsageError(f"--reference {reference}: give auto, zero, low, mid or a number") from None
    else:
        value = float(reference)
    if not math.isfinite(value):
        raise UsageError(f"--reference {reference}: give a finite number")
    return value


def reference_text(option: str | float) -> str:
    """--reference as the manifest states it (parse_reference's inverse)."""
    return option if isinstance(option, str) else repr(float(option))


def _largest_p(epsilon: float, k: int, gamma: float) -> int | None:
    """The largest p_numerator (p >= 1/2) whose certified figure at gamma is at most
    epsilon, or None when even p = 1/2 is above it."""
    from tldp_cli.privacy import accounting  # here: option checks never import it

    q_lo, _ = privunit.cap_probability_bounds(gamma, k)
    if q_lo <= 0:
        return None
    epsilon0 = epsilon - (math.log1p(-q_lo) - math.log(q_lo))
    half = 2**52
    if epsilon0 < 0:
        return half if accounting.privunit_epsilon(k, gamma, half) <= epsilon else None
    numerator = min(2**53 - 1, max(half, math.floor(2.0**53 / (1 + math.exp(-epsilon0)))))
    step = 1
    while accounting.privunit_epsilon(k, gamma, numerator) > epsilon:
        if numerator == half:
            return None
        numerator = max(half, numerator - step)
        step *= 2
    return numerator


@functools.lru_cache(maxsize=256)
def privunit_split(epsilon: float, k: int, min_cap: float = privunit.MIN_CAP_PROBABILITY) -> tuple[float, int]:
    """(gamma, p_numerator) of PrivUnit in dimension k that maximises the expected alignment
    E<V, u> among the splits whose certified epsilon (accounting.privunit_epsilon, with
    the floating-point margin) is at most `epsilon` and whose cap holds at least `min_cap`
    of the sphere (the sampler's cost is about 1/q candidates; privunit.MIN_CAP_PROBABILITY).

    gamma runs over [0, gamma_max] (the cap's share at most 1/2): a grid of 48 points,
    then golden-section search around the best; p is the largest the budget allows at
    each gamma (_largest_p). Deterministic: the same options give the same split."""
    from scipy.special import betaincinv

    from tldp_cli.privacy import accounting  # here: option checks never import it

    gamma_max = math.sqrt(1 - float(betaincinv((k - 1) / 2, 0.5, 2 * min_cap)))

    def alignment(gamma: float) -> float:
        numerator = _largest_p(epsilon, k, gamma)
        return -1.0 if numerator is None else privunit.expected_alignment(k, gamma, numerator / 2.0**53)

    grid = [gamma_max * i / 48 for i in range(49)]
    values = [alignment(g) for g in grid]
    best = max(range(len(grid)), key=lambda i: values[i])
    if values[best] < 0:
        least = accounting.privunit_epsilon(k, 0.0, 2**52)
        raise UsageError(f"--mechanism privunit cannot certify --eps {epsilon:g} in {k} dimensions "
                         f"(its floating-point margin alone costs {least:.3g}); give a larger --eps")
    a, b = grid[max(0, best - 1)], grid[min(len(grid) - 1, best + 1)]
    ratio = (math.sqrt(5) - 1) / 2
    c, d = b - ratio * (b - a), a + ratio * (b - a)
    fc, fd = alignment(c), alignment(d)
    for _ in range(40):
        if fc >= fd:
            b, d, fd = d, c, fc
            c = b - ratio * (b - a)
            fc = alignment(c)
        else:
            a, c, fc = c, d, fd
            d = a + ratio * (b - a)
            fd = alignment(d)
    gamma = max([(values[best], grid[best]), (fc, c), (fd, d)])[1]
    numerator = _largest_p(epsilon, k, gamma)
    assert numerator is not None  # gamma's alignment is at least values[best] >= 0: some p fits
    return float(gamma), int(numerator)
