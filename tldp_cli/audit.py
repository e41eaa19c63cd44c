"""Statistical privacy audit: a lower bound on the privacy loss, from samples.

The audit runs the real code path (a Calibration from mechanisms.calibrate through
engine.perturb_records, fresh random streams) on a pair of neighbouring inputs and
looks for an event E whose probabilities under the two outputs are too far apart
for the certified figure. For any event, (eps, delta)-DP implies
P(M(x) in E) <= e^eps P(M(x') in E) + delta, so

    eps >= ln((P(M(x) in E) - delta) / P(M(x') in E)).

The samples of each input are split in two halves. The first half chooses, for
each certified (eps, delta) pair, the event that gives the largest bound; the
second half evaluates that one event with exact Clopper-Pearson bounds (a lower
bound on the first probability, an upper bound on the second). The bound therefore
holds with the stated confidence whatever the selection did; the confidence is
split (Bonferroni) over every pair audited in one call, so the whole report holds
at once. Like DP-Auditorium's hockey-stick tester (a classifier trained on half the
samples, its accuracy bounded on the other half), only with threshold events
instead of a trained classifier.

Events are thresholds on five statistics of an output record y (I elements) of the
neighbours x = (a, ..., a) and x' = (b, ..., b), a and b the ends of the range:
the sum of y, the sum of y clipped to [a, b], both again ordered first by
#(y == b) - #(y == a), the count of raw values that came through unchanged (that is
where a retained raw value, the point mass of TLDP, shows up), and the sum ordered
first by #(y in F_b) - #(y in F_a), where F_v = {fl(v + z): z a float} is the set of
floating-point values noise added to v can give. With exact noise on a grid both
sets hold every output; with float noise they differ (Mironov 2012: 0 + z takes
values 1 + z cannot), and this statistic shows the leak.

Scopes:
- element: every element of the all-a and all-b records is one draw of the pair
  (a, b) in that element: the records' other elements are independent of it under
  every mechanism here (the noise and the retain decisions are drawn per element),
  so the pair is two records that differ in one element.
- record: each record is one draw of the pair (all a, all b).

A lower bound is never a certificate: "consistent" means these samples found no
violation, not that the figure holds. A bound from n draws cannot exceed about
ln(n): the report states that reach, and certified figures above it cannot be
contradicted at that sample size.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from tldp_cli.sampling import engine
from tldp_cli.sampling.discrete import is_discrete
from tldp_cli.errors import UsageError
from tldp_cli.privacy.mechanisms import (PRIVUNIT, Calibration, calibrate, calibrate_privunit,
                                         check_parameters, matrix_rows, resolve_budget, sampled_noise)
from tldp_cli.sampling.rng import Streams, records_per_unit
if TYPE_CHECKING:
    from tldp_cli.privacy.certificates import Certificate, Guarantee

SCOPES = ("element", "record")
DEFAULT_SAMPLES = 1_000_000
DEFAULT_CONFIDENCE = 0.95
MAX_SAMPLES = 20_000_000
MIN_SAMPLES = 100
# Elements per engine call, rounded to whole stream units.
BLOCK_ELEMENTS = 1 << 20
# Candidate thresholds per statistic: order statistics spaced geometrically from
# both ends, so the tails (where the privacy loss is largest) are finely covered.
THRESHOLDS_PER_SIDE = 200
STATISTICS = ("sum", "clipped sum", "raw kept, then sum", "raw kept, then clipped sum",
              "float grid, then sum")
# --mechanism privunit: statistics of the released direction V against the neighbours'
# directions u and u' (see audit_privunit).
PRIVUNIT_STATISTICS = ("<V,u>", "<V,u'>", "<V,u> - <V,u'>", "cap(u) - cap(u'), then <V,u> - <V,u'>")
# Statistics ordered first by a count (levels 2k, thresholds 2k +- 1 between them).
LEVELLED = ("raw kept, then sum", "raw kept, then clipped sum", "float grid, then sum",
            PRIVUNIT_STATISTICS[3])


def neighbours(calib: Calibration, value_range: tuple[float, float]) -> tuple[float, float]:
    """The two input values at the ends of the range, as the output shows a kept raw
    value: lo and hi for continuous noise; for discrete noise the integers lo and
    lo + W - 1 (integer data, W = range_width values) or the grid points nearest lo
    and hi (float data snapped to a granularity G)."""
    lo, hi = value_range
    if not is_discrete(calib.noise):
        return lo, hi
    granularity = calib.granularity
    if granularity is None:
        return lo, lo + calib.range_width - 1
    return granularity * float(np.rint(lo / granularity)), granularity * float(np.rint(hi / granularity))


def _spread(calib: Calibration, elements: int, a: float, b: float) -> float:
    """Scale of the sum of `elements` outputs; fixed by the parameters, never by the
    samples, so the statistics are one function of the output for both neighbours."""
    return math.sqrt(elements) * (b - a + calib.scale)


def _float_grid_level(y: np.ndarray, a: float, b: float) -> np.ndarray:
    """Per record, #(y in F_b) - #(y in F_a) in y's own dtype: y is in F_v when v plus the
    nearest float to y - v gives y back (always for integers)."""
    if y.dtype.kind != "f":
        return np.zeros(y.shape[0])
    level = np.zeros(y.shape[0])
    for value, sign in ((b, 1.0), (a, -1.0)):
        v = y.dtype.type(value)
        level += sign * np.count_nonzero((y - v) + v == y, axis=1)
    return level


def _statistics(y: np.ndarray, a: float, b: float, spread: float) -> np.ndarray:
    """(n, 5) statistics of n output records y (n, I); see STATISTICS."""
    float_level = 2.0 * _float_grid_level(y, a, b)
    y = y.astype(np.float64, copy=False)
    elements = y.shape[1]
    mid, width = (a + b) / 2, b - a
    if elements == 1:  # the element scope: reductions over one column are slow
        total = y[:, 0]
        clipped = np.clip(total, a, b)
        level = 2.0 * ((total == b).astype(np.float64) - (total == a))
    else:
        total = y.sum(axis=1)
        clipped = np.clip(y, a, b).sum(axis=1)
        level = 2.0 * (np.count_nonzero(y == b, axis=1) - np.count_nonzero(y == a, axis=1))
    out = np.empty((y.shape[0], 5))
    out[:, 0] = total
    out[:, 1] = clipped
    # Within a level the squashed values stay inside (-0.9, 0.9) and (-0.5, 0.5), so
    # the thresholds 2k +- 1 separate the levels exactly.
    squashed = 0.9 * np.arctan((total - elements * mid) / spread) / (math.pi / 2)
    out[:, 2] = level + squashed
    out[:, 3] = level + (clipped - elements * mid) / (elements * width)
    out[:, 4] = float_level + squashed
    return out


def _draw(calib: Calibration, value: float, records: int, name: str, streams: Streams,
          dtype: np.dtype) -> np.ndarray:
    """`records` outputs of the record (value, ..., value), from the stream `name`."""
    elements = calib.elements
    unit = records_per_unit(elements)
    per_block = max(1, BLOCK_ELEMENTS // (unit * elements)) * unit
    parts = []
    for start in range(0, records, per_block):
        stop = min(start + per_block, records)
        block = np.full((stop - start, elements), value, dtype=np.asarray(value).dtype)
        parts.append(engine.perturb_records(block, start, name, calib, streams, dtype=dtype,
                                            array_records=records))
    return np.concatenate(parts)


def clopper_pearson(k: np.ndarray, n: int, alpha: float) -> tuple[np.ndarray, np.ndarray]:
    """One-sided exact binomial bounds: P(p >= lower) >= 1 - alpha, P(p <= upper) >= 1 - alpha."""
    from scipy.special import betaincinv

    k = np.asarray(k, dtype=np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        lower = np.where(k > 0, betaincinv(k, n - k + 1, alpha), 0.0)
        upper = np.where(k < n, betaincinv(k + 1, n - k, 1 - alpha), 1.0)
    return lower, upper


def _epsilon_bound(p_lower, q_upper, delta: float):
    with np.errstate(divide="ignore", invalid="ignore"):
        bound = np.log((p_lower - delta) / q_upper)
    return np.where(p_lower > delta, np.maximum(bound, 0.0), 0.0)


def _thresholds(pooled: np.ndarray) -> np.ndarray:
    """Candidate thresholds from the sorted pooled values: all distinct values when they
    are few, else order statistics spaced geometrically from both ends (the tails, where
    the privacy loss is largest, get the finest steps)."""
    values = pooled[np.concatenate([[True], pooled[1:] != pooled[:-1]])]
    if values.size > 2 * THRESHOLDS_PER_SIDE:
        n = values.size
        ranks = np.unique(np.geomspace(1, n // 2, THRESHOLDS_PER_SIDE).astype(np.int64) - 1)
        values = values[np.concatenate([ranks, n - 1 - ranks])]
    return values


def _level_thresholds(pooled: np.ndarray) -> np.ndarray:
    levels = np.unique(np.round(pooled / 2))
    return np.unique(np.concatenate([2 * levels - 1, 2 * levels + 1]))


def _counts(sorted_values: np.ndarray, thresholds: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """#(s <= t) and #(s >= t) for each threshold t."""
    le = np.searchsorted(sorted_values, thresholds, side="right")
    ge = sorted_values.size - np.searchsorted(sorted_values, thresholds, side="left")
    return le, ge


def _selection_table(s0: np.ndarray, s1: np.ndarray, alpha: float,
                     names: tuple[str, ...]) -> list[dict[str, Any]]:
    """Every candidate event on the selection half, with Clopper-Pearson bounds of its
    probability under each neighbour."""
    n = s0.shape[0]
    table = []
    for column, statistic in enumerate(names):
        x0, x1 = np.sort(s0[:, column]), np.sort(s1[:, column])
        pooled = np.concatenate([x0, x1])
        pooled.sort(kind="stable")  # merges the two sorted runs in linear time
        thresholds = _thresholds(pooled)
        if statistic in LEVELLED:
            thresholds = np.unique(np.concatenate([thresholds, _level_thresholds(pooled)]))
        le0, ge0 = _counts(x0, thresholds)
        le1, ge1 = _counts(x1, thresholds)
        for direction, k0, k1 in (("<=", le0, le1), (">=", ge0, ge1)):
            table.append({"statistic": statistic, "column": column, "direction": direction,
                          "thresholds": thresholds, "x": clopper_pearson(k0, n, alpha),
                          "x'": clopper_pearson(k1, n, alpha)})
    return table


def _best_event(table: list[dict[str, Any]], delta: float) -> dict[str, Any]:
    """The candidate with the largest bound at delta (on the selection half)."""
    best: dict[str, Any] = {"bound": -1.0}
    for entry in table:
        for reference, other in (("x", "x'"), ("x'", "x")):
            bounds = _epsilon_bound(entry[reference][0], entry[other][1], delta)
            i = int(np.argmax(bounds))
            if bounds[i] > best["bound"]:
                best = {"bound": float(bounds[i]), "statistic": entry["statistic"],
                        "column": entry["column"], "direction": entry["direction"],
                        "threshold": float(entry["thresholds"][i]), "reference": reference}
    return best


def _in_event(values: np.ndarray, direction: str, threshold: float) -> int:
    return int(np.count_nonzero(values <= threshold if direction == "<=" else values >= threshold))


def lower_bounds(s0: np.ndarray, s1: np.ndarray, claims: list[tuple[float, float]], alpha: float,
                 names: tuple[str, ...] = STATISTICS) -> list[dict[str, Any]]:
    """The statistical core: for each certified (eps, delta), a lower bound on the eps
    that M must have at that delta, from the statistics s0, s1 ((n, k), column j named
    names[j]) of n independent draws of M(x) and of M(x').

    The first half of the draws chooses the event, the second bounds it: each
    epsilon_lower_bound holds with probability at least 1 - 2 alpha.
    """
    if s0.shape != s1.shape or s0.shape[0] < 2:
        raise ValueError("lower_bounds needs the same number (at least 2) of draws of each input")
    half = s0.shape[0] // 2
    n_eval = s0.shape[0] - half
    # the largest bound n_eval draws can give: every draw in E under one input, none under the other
    all_in, _ = clopper_pearson(np.array([n_eval]), n_eval, alpha)
    _, none_in = clopper_pearson(np.array([0]), n_eval, alpha)
    # A stricter level for the selection prefers events with enough draws to hold up on
    # the evaluation half; it does not enter the stated confidence.
    table = _selection_table(s0[:half], s1[:half], alpha / 10, names)
    rows = []
    for epsilon, delta in claims:
        event = _best_event(table, delta)
        row: dict[str, Any] = {"certified_epsilon": epsilon, "delta": delta,
                               "reach": float(_epsilon_bound(all_in, none_in, delta)[0]),
                               "epsilon_lower_bound": 0.0, "hockey_stick_lower_bound": 0.0,
                               "event": None}
        if event["bound"] > 0:
            col = event["column"]
            k0 = _in_event(s0[half:, col], event["direction"], event["threshold"])
            k1 = _in_event(s1[half:, col], event["direction"], event["threshold"])
            kp, kq = (k0, k1) if event["reference"] == "x" else (k1, k0)
            p_lower, _ = clopper_pearson(np.array([kp]), n_eval, alpha)
            _, q_upper = clopper_pearson(np.array([kq]), n_eval, alpha)
            row["epsilon_lower_bound"] = float(_epsilon_bound(p_lower, q_upper, delta)[0])
            # the delta this event demands at the certified eps (same confidence)
            row["hockey_stick_lower_bound"] = max(
                0.0, float(p_lower[0] - math.exp(min(epsilon, 700.0)) * q_upper[0]))
            row["event"] = {"statistic": event["statistic"], "column": col,
                            "direction": event["direction"], "threshold": event["threshold"],
                            "reference": event["reference"], "count_x": k0, "count_x_prime": k1,
                            "draws": n_eval}
        rows.append(row)
    return rows


def _describe(event: dict[str, Any], a: float, b: float, scope: str, spread: float,
              elements: int) -> str:
    y = "y" if scope == "element" else "sum(y)"
    yc = f"clip(y, {a:g}, {b:g})" if scope == "element" else f"sum(clip(y, {a:g}, {b:g}))"
    op, t, column = event["direction"], event["threshold"], event["column"]
    if column < 2:
        return f"{y if column == 0 else yc} {op} {t:.6g}"
    count = f"#(y=={b:g}) - #(y=={a:g})" if scope == "record" else f"[y=={b:g}] - [y=={a:g}]"
    if column == 4:
        count = (f"#(y in F_{b:g}) - #(y in F_{a:g})" if scope == "record"
                 else f"[y in F_{b:g}] - [y in F_{a:g}]") + " (F_v: the floats v + noise can give)"
    if abs(t - round(t)) < 1e-12 and round(t) % 2:  # a level boundary 2k +- 1
        k = (round(t) - 1) // 2 if op == "<=" else (round(t) + 1) // 2
        return f"{count} {op} {k}"
    level = round(t / 2)
    frac = t - 2 * level
    mid = elements * (a + b) / 2
    if column in (2, 4):
        inner = mid + spread * math.tan(min(max(frac / 0.9, -1.0), 1.0) * math.pi / 2)
        return f"({count}, {y}) {op} ({level}, {inner:.6g}) in lexicographic order"
    inner = mid + frac * elements * (b - a)
    return f"({count}, {yc}) {op} ({level}, {inner:.6g}) in lexicographic order"


def _claims(scope: Guarantee) -> list[tuple[float, float]]:
    """The certified (eps, delta) pairs of a scope, less those another pair implies
    (no smaller eps, no smaller delta): each pair audited costs confidence."""
    pairs = {(float(scope.epsilon), float(scope.delta)), (float(scope.approx_epsilon), float(scope.approx_delta))}
    pairs = {(e, d) for e, d in pairs if math.isfinite(e) and d < 1}
    return sorted((e, d) for e, d in pairs
                  if not any((e2, d2) != (e, d) and e2 <= e and d2 <= d for e2, d2 in pairs))


def check_options(*, samples: int, confidence: float, scopes: tuple[str, ...] | list[str]) -> None:
    if not MIN_SAMPLES <= samples <= MAX_SAMPLES:
        raise UsageError(f"--samples must lie in [{MIN_SAMPLES}, {MAX_SAMPLES}], not {samples}")
    if not 0 < confidence < 1:
        raise UsageError(f"--confidence must lie in (0, 1), not {confidence}")
    unknown = [s for s in scopes if s not in SCOPES]
    if unknown or not scopes:
        raise UsageError(f"--scope must be one of {', '.join(SCOPES)} or both, not {unknown or 'none'}")


def audit(calib: Calibration, *, value_range: tuple[float, float] | None = None,
          samples: int = DEFAULT_SAMPLES, confidence: float = DEFAULT_CONFIDENCE,
          scopes: tuple[str, ...] | list[str] = SCOPES, streams: Streams | None = None,
          dtype: np.dtype | type | str = np.float32, claimed: Calibration | None = None,
          basis=None) -> dict[str, Any]:
    """Audit `calib`'s mechanism against the certified figures of `claimed` (default: calib).
    --mechanism privunit: audit_privunit (`basis`: a user's, as the engine takes it).

    `samples`: draws of each neighbour per scope, counted in elements (the record scope
    draws samples // I records, at least 2). `streams`: fresh secure streams by default.
    Returns a JSON-ready report; report["verdict"] is "consistent", "VIOLATION" (a sampled
    lower bound above a certified figure) or "MISCALIBRATED" (certified figures above what
    the request implies: see check_request).
    """
    check_options(samples=samples, confidence=confidence, scopes=scopes)
    claimed = claimed or calib
    if calib.privunit is not None:
        return audit_privunit(calib, samples=samples, confidence=confidence, scopes=scopes,
                              streams=streams or Streams("secure"), claimed=claimed, basis=basis)
    value_range = value_range or (0.0, calib.range_width)
    a, b = neighbours(calib, value_range)
    streams = streams or Streams("secure")
    dtype = np.dtype(dtype)
    if is_discrete(calib.noise) and calib.granularity is None:
        # integer data stays integer: int64 values, as perturb's output before narrowing
        a, b, dtype = int(a), int(b), np.dtype(np.int64)
    # a kept raw value, as the output dtype holds it (0.1 is not a float32)
    ya, yb = (float(np.asarray(v).astype(dtype)) for v in (a, b))
    from tldp_cli.privacy import accounting  # here: usage and path errors never import it
    certified = accounting.certify(claimed)
    plan = [(scope, _claims(getattr(certified, f"per_{scope}"))) for scope in SCOPES if scope in scopes]
    pairs = sum(len(claims) for _, claims in plan)
    # Each pair's bound uses two one-sided intervals: the miss probability is split evenly.
    alpha = (1 - confidence) / max(pairs, 1) / 2

    results = []
    for scope, claims in plan:
        if scope == "element":
            records = -(-samples // calib.elements)
        else:
            records = max(2, samples // calib.elements)
        y0 = _draw(calib, a, records, f"audit/{scope}/x", streams, dtype)
        y1 = _draw(calib, b, records, f"audit/{scope}/x'", streams, dtype)
        if scope == "element":
            y0, y1 = y0.reshape(-1, 1)[:samples], y1.reshape(-1, 1)[:samples]
        n_elements = y0.shape[1]
        spread = _spread(calib, n_elements, a, b)
        s0, s1 = _statistics(y0, ya, yb, spread), _statistics(y1, ya, yb, spread)
        del y0, y1
        rows = lower_bounds(s0, s1, claims, alpha)
        for row in rows:
            row["violation"] = row["epsilon_lower_bound"] > row["certified_epsilon"]
            if row["event"]:
                row["event"]["description"] = _describe(row["event"], a, b, scope, spread, n_elements)
        n_eval = s0.shape[0] - s0.shape[0] // 2
        results.append({"scope": scope, "draws": int(s0.shape[0]), "evaluation_draws": n_eval,
                        "claims": rows})
        del s0, s1

    violation = any(row["violation"] for r in results for row in r["claims"])
    request = check_request(claimed, certified)
    return {
        "schema": "tldp-audit/1",
        "mechanism": calib.mechanism, "noise": calib.noise, "budget": calib.budget,
        "epsilon": calib.epsilon, "value_range": [float(value_range[0]), float(value_range[1])],
        "range_width": calib.range_width, "elements_per_record": calib.elements,
        "dp_delta": calib.dp_delta, "noise_scale": calib.scale,
        "retain_probability": calib.p, "retain_probability_log10": calib.p_log10,
        "neighbours": {"x": a, "x_prime": b},
        "samples": samples, "confidence": confidence, "dtype": str(dtype),
        "rng": streams.kind, "seeded": streams.seeded, "weak_seed": streams.weak_seed,
        "scopes": results,
        "request": request,
        "verdict": ("VIOLATION" if violation else "MISCALIBRATED" if not request["consistent"]
                    else "consistent"),
        "method": ("events chosen on one half of the draws, eps >= ln((P_lo(E) - delta) / Q_hi(E)) "
                   "with Clopper-Pearson bounds on the other half; confidence split over "
                   f"{pairs} certified pairs"),
    }


def check_request(calib: Calibration, certified: Certificate) -> dict[str, Any]:
    """The figures the request itself implies (its mechanism, noise, budget, --eps, range
    and record size, calibrated afresh) against the ones certified for the audited
    calibration: a calibration with too little noise certifies its own, larger, figures,
    which the sampled bounds alone would call consistent."""
    if calib.privunit is not None:
        params = calib.privunit
        fresh = calibrate_privunit(epsilon=calib.epsilon, record_shape=params.record_shape,
                                   value_range=(params.low, params.high), dp_delta=calib.dp_delta,
                                   k=params.k, basis=params.basis, basis_sha256=params.basis_sha256)
    else:
        fresh = calibrate(
            mechanism=calib.mechanism, noise=calib.noise, budget=calib.budget, epsilon=calib.epsilon,
            range_width=calib.range_width, elements=calib.elements, dp_delta=calib.dp_delta,
            rows=calib.rows, granularity=calib.granularity)
    from tldp_cli.privacy import accounting  # here: usage and path errors never import it
    requested = accounting.certify(fresh)
    rows = []
    for scope in ("per_element", "per_record"):
        stated, implied = getattr(certified, scope).epsilon, getattr(requested, scope).epsilon
        rows.append({"scope": scope, "certified_epsilon": stated, "requested_epsilon": implied,
                     "consistent": stated <= implied * (1 + 1e-9)})
    return {"epsilon": calib.epsilon, "budget": calib.budget, "scopes": rows,
            "consistent": all(row["consistent"] for row in rows)}


def privunit_neighbours(calib: Calibration, basis, scope: str) -> tuple[np.ndarray, np.ndarray, str]:
    """Two records of the declared range whose directions are far apart, and what they are.

    record: when the reference point lies inside the range, ref + s f and ref - s f, f the
    first basis vector written back (their directions are opposite: the pair that costs
    the most); when it is an end of the range, the record at the reference (direction e_1)
    and the record at the far end wherever the second basis vector is positive. element:
    the record at the reference and the same with its first element at the far end."""
    params = calib.privunit_params()
    lo, hi, ref = params.low, params.high, params.reference
    far = hi if hi - ref >= ref - lo else lo
    unit = np.zeros((2, params.k))
    unit[0, 0], unit[1, 1 % params.k] = 1.0, 1.0
    first, second = basis.synthesize(unit)
    at_ref = np.full(params.record_shape, ref)
    if scope == "element":
        other = at_ref.copy()
        other.flat[0] = far
        return at_ref, other, f"the record at {ref:g} and the same with its first element at {far:g}"
    if lo < ref < hi:
        step = min(hi - ref, ref - lo) / np.abs(first).max()
        return (ref + step * first, ref - step * first,
                f"{ref:g} plus and minus {step:.4g} times the first basis vector (opposite directions)")
    return (at_ref, np.where(second > 0, far, ref),
            f"the record at {ref:g}, and the record at {far:g} where the second basis vector is positive")


def audit_privunit(calib: Calibration, *, samples: int, confidence: float, scopes, streams: Streams,
                   claimed: Calibration, basis=None) -> dict[str, Any]:
    """audit() for --mechanism privunit: the real projection, normalisation and sampler
    (engine.record_directions and sample_directions) on each scope's neighbours
    (privunit_neighbours), max(2, samples // I) releases of each. The events are
    thresholds on <V,u>, <V,u'>, their difference, and membership of the two caps
    (cap(u) without cap(u') is where the privacy loss reaches epsilon). The released V
    is audited before the write-back, which is a function of it."""
    basis = engine.privunit_basis(calib, basis)
    params = calib.privunit_params()
    from tldp_cli.privacy import accounting  # here: usage and path errors never import it
    certified = accounting.certify(claimed)
    plan = [(scope, _claims(getattr(certified, f"per_{scope}"))) for scope in SCOPES if scope in scopes]
    alpha = (1 - confidence) / max(sum(len(c) for _, c in plan), 1) / 2
    records = max(2, samples // calib.elements)
    results: list[dict[str, Any]] = []
    pairs: dict[str, dict[str, Any]] = {}
    for scope, claims in plan:
        x, x_prime, described = privunit_neighbours(calib, basis, scope)
        directions = engine.record_directions(np.stack([x, x_prime]), calib, basis)
        u, u_prime = directions
        drawn = [engine.sample_directions(np.repeat(d[None], records, axis=0), 0, f"audit/{scope}/{name}",
                                          calib, streams) for d, name in ((u, "x"), (u_prime, "x'"))]
        s0, s1 = (_privunit_statistics(v, u, u_prime, params.gamma) for v in drawn)
        rows = lower_bounds(s0, s1, claims, alpha, PRIVUNIT_STATISTICS)
        for row in rows:
            row["violation"] = row["epsilon_lower_bound"] > row["certified_epsilon"]
            if row["event"]:
                row["event"]["description"] = (f"{row['event']['statistic']} {row['event']['direction']} "
                                               f"{row['event']['threshold']:.6g}")
        pairs[scope] = {"described": described, "cosine": float(u @ u_prime)}
        results.append({"scope": scope, "draws": records, "evaluation_draws": records - records // 2,
                        "claims": rows})
    violation = any(row["violation"] for r in results for row in r["claims"])
    request = check_request(claimed, certified)
    return {
        "schema": "tldp-audit/1", "mechanism": calib.mechanism, "noise": calib.noise, "budget": calib.budget,
        "epsilon": calib.epsilon, "value_range": [params.low, params.high], "range_width": calib.range_width,
        "elements_per_record": calib.elements, "dp_delta": calib.dp_delta, "noise_scale": calib.scale,
        "retain_probability": 0.0, "retain_probability_log10": None, "neighbours": pairs,
        "privunit": {"k": params.k, "gamma": params.gamma, "p": params.p, "basis": params.basis},
        "samples": samples, "confidence": confidence, "dtype": "float64", "rng": streams.kind,
        "seeded": streams.seeded, "weak_seed": streams.weak_seed, "scopes": results, "request": request,
        "verdict": ("VIOLATION" if violation else "MISCALIBRATED" if not request["consistent"]
                    else "consistent"),
        "method": ("PrivUnit directions of two neighbouring records; events chosen on one half of the "
                   "draws, eps >= ln((P_lo(E) - delta) / Q_hi(E)) with Clopper-Pearson bounds on the "
                   "other half; confidence split over the certified pairs"),
    }


def _privunit_statistics(v: np.ndarray, u: np.ndarray, u_prime: np.ndarray, gamma: float) -> np.ndarray:
    """(n, 4) statistics of released directions (PRIVUNIT_STATISTICS): the last is the level
    2 ([<V,u> >= gamma] - [<V,u'> >= gamma]) plus the difference squashed into (-0.9, 0.9)."""
    a, b = v @ u, v @ u_prime
    out = np.empty((v.shape[0], 4))
    out[:, 0], out[:, 1], out[:, 2] = a, b, a - b
    out[:, 3] = 2.0 * ((a >= gamma).astype(np.float64) - (b >= gamma)) + (a - b) / 2.5
    return out


def parse_shape(text: str) -> tuple[int, ...]:
    """'784' -> (784,); '28x28' -> (28, 28): I, or the record's shape (MVG needs its rows)."""
    try:
        shape = tuple(int(part) for part in text.lower().replace("*", "x").split("x"))
    except ValueError:
        raise UsageError(f"--elements must be a count I or a record shape like 28x28, not {text!r}") from None
    if not shape or min(shape) < 1:
        raise UsageError(f"--elements must be positive, not {text!r}")
    if math.prod(shape) >= 2**63:  # NumPy counts elements in int64
        raise UsageError(f"--elements {text}: more elements per record than an array can hold (2^63)")
    return shape


def run(*, mechanism: str, noise: str, budget: str, epsilon: float,
        value_range: tuple[float, float], shape: tuple[int, ...], dp_delta: float = 1e-5,
        granularity: float | None = None, samples: int = DEFAULT_SAMPLES,
        confidence: float = DEFAULT_CONFIDENCE, scopes: tuple[str, ...] | list[str] = SCOPES,
        seed: str | int | None = None, rng: str = "secure", dtype: str = "float32",
        allow_weak_seed: bool = False, sampler: str = "exact", basis: str | None = None) -> dict[str, Any]:
    """Calibrate as `tldp perturb` would for records of `shape` in `value_range`, then audit.
    `budget` None: the mechanism's own (resolve_budget); `basis`: privunit's --basis.

    `sampler` exact (perturb's default): laplace and gaussian as perturb draws them for
    float data, discrete noise on the automatic grid (or multiples of `granularity`).
    --noise discrete-*: integer data (an integer range) unless `granularity` G, float data
    snapped to multiples of G. `sampler` float: the continuous samplers.
    """
    from tldp_cli.sampling import discrete

    check_options(samples=samples, confidence=confidence, scopes=scopes)
    if dtype not in ("float32", "float64"):
        raise UsageError(f"--dtype must be float32 or float64, not {dtype}")
    # The audit holds float64 arrays of a record's values (privunit: pairs of them), and NumPy
    # counts an array's bytes in int64: past 2^56 values that count overflows.
    if math.prod(shape) >= 2**56:
        raise UsageError(f"--elements: {math.prod(shape)} elements per record are more than the "
                         "audit's arrays can hold (2^56)")
    budget = resolve_budget(mechanism, budget)
    if mechanism == PRIVUNIT:
        return _run_privunit(epsilon=epsilon, value_range=value_range, shape=shape, dp_delta=dp_delta,
                             samples=samples, confidence=confidence, scopes=scopes,
                             streams=Streams(rng, seed, allow_weak_seed), sampler=sampler, noise=noise,
                             basis=basis)
    if basis is not None:
        raise UsageError("--basis applies to --mechanism privunit")
    rows = matrix_rows(mechanism, shape, "--elements")
    lo, hi = value_range
    width = hi - lo
    float_data = not discrete.is_discrete(noise) or granularity is not None
    noise = sampled_noise(noise, sampler, mechanism)
    if discrete.is_discrete(noise):
        data = np.dtype(dtype) if float_data else np.dtype(np.int64)
        grid = discrete.resolve_grid(lo, hi, [data], granularity, epsilon, f"--range {lo:g}:{hi:g}")
        width, granularity = grid.range_width, grid.granularity
    calib = calibrate(mechanism=mechanism, noise=noise, budget=budget, epsilon=epsilon,
                      range_width=width, elements=math.prod(shape), dp_delta=dp_delta, rows=rows,
                      granularity=granularity)
    return audit(calib, value_range=value_range, samples=samples, confidence=confidence,
                 scopes=scopes, streams=Streams(rng, seed, allow_weak_seed), dtype=dtype)


def _run_privunit(*, epsilon: float, value_range: tuple[float, float], shape: tuple[int, ...],
                  dp_delta: float, samples: int, confidence: float, scopes, streams: Streams,
                  sampler: str, noise: str, basis: str | None) -> dict[str, Any]:
    from tldp_cli.run import bases

    check_parameters(mechanism=PRIVUNIT, noise=noise, budget="record", epsilon=epsilon, dp_delta=dp_delta)
    sampled_noise(noise, sampler, PRIVUNIT)
    if math.prod(shape) < 2:  # --elements defaults to 1: say which option to give
        raise UsageError(f"--mechanism privunit releases a direction, which needs records of 2 or more "
                         f"elements: give --elements I or a shape such as --elements 8x8 (not "
                         f"{'x'.join(map(str, shape))})")
    choice = bases.parse_basis(basis)
    user = bases.load_basis(choice.path) if choice.path is not None else None  # kind FILE: a path
    matrix = user.for_records(shape, "--elements") if user else None
    calib = calibrate_privunit(epsilon=epsilon, record_shape=shape, value_range=value_range,
                               dp_delta=dp_delta, k=user.k if user else choice.k, basis=choice.kind,
                               basis_sha256=user.sha256 if user else None)
    return audit(calib, samples=samples, confidence=confidence, scopes=scopes, streams=streams,
                 basis=matrix)


def format_report(report: dict[str, Any]) -> list[str]:
    """The human table: one line per certified (eps, delta) pair."""
    lo, hi = report["value_range"]
    # privunit adds no noise (its noise is named privunit too) and draws whole records
    mechanism = " ".join(dict.fromkeys((report["mechanism"], report["noise"])))
    draws = (f"{report['scopes'][0]['draws']} releases ({report['samples']} // I)"
             if "privunit" in report and report["scopes"] else f"{report['samples']} draws")
    lines = [
        f"audit of {mechanism} (budget {report['budget']}, "
        f"eps={report['epsilon']:g}, range {lo:g}:{hi:g}, I={report['elements_per_record']}): "
        f"{draws} per neighbour and scope, confidence {report['confidence']:g} "
        f"for the whole table",
        f"  {'scope':<9}{'delta':>10}{'certified eps':>15}{'audited eps >=':>16}{'reach':>8}  "
        f"{'verdict':<11}event",
    ]
    for scope in report["scopes"]:
        for row in scope["claims"]:
            event = row["event"]["description"] if row["event"] else "none found"
            lines.append(
                f"  {scope['scope']:<9}{row['delta']:>10.4g}{row['certified_epsilon']:>15.4g}"
                f"{row['epsilon_lower_bound']:>16.4g}{row['reach']:>8.3g}  "
                f"{'VIOLATION' if row['violation'] else 'ok':<11}{event}")
    for row in report["request"]["scopes"]:
        lines.append(f"  request  {row['scope']:<12} --eps {report['epsilon']:g} ({report['budget']} budget) "
                     f"implies eps {row['requested_epsilon']:.4g}, certified {row['certified_epsilon']:.4g}: "
                     f"{'ok' if row['consistent'] else 'MISCALIBRATED'}")
    return lines
