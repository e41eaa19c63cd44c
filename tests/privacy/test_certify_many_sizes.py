"""certify_all over records of many sizes (issue 30): the same figures as certifying every
size and taking the worst field by field, with the accountant run for a few sizes only.

Property tests run a bounded number of examples; TLDP_HYPOTHESIS_EXAMPLES raises it.
"""

import dataclasses
import math
import os

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from tldp_cli.errors import UsageError
from tldp_cli.privacy import accounting
from tldp_cli.privacy.mechanisms import calibrate

EXAMPLES = int(os.environ.get("TLDP_HYPOTHESIS_EXAMPLES", "25"))
PROPERTY = settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])


def reference_certify_all(calibrations):
    """certify_all as it was before issue 30: every distinct calibration certified in full,
    then the worst of each field (accounting.worst_scope over plain figures is max)."""
    distinct = list(dict.fromkeys(calibrations))
    if len(distinct) == 1:
        return accounting.certify(distinct[0])
    certs = [accounting.certify(c) for c in distinct]
    notes = list(dict.fromkeys(note for cert in certs for note in cert.notes))
    notes.append(f"The records have {len(distinct)} calibrations (record sizes): per_element and "
                 "per_record are the worst case over them, field by field (the largest epsilon, "
                 "delta, rho, approx and point_mass_delta of any), each a bound for every element "
                 "and every record.")
    designed = [c.designed for c in certs if c.designed is not None]
    return dataclasses.replace(
        certs[0], per_element=accounting.worst_scope([c.per_element for c in certs]),
        per_record=accounting.worst_scope([c.per_record for c in certs]), notes=tuple(notes),
        worst_case_of=len(distinct), designed=max(designed, key=lambda d: d.epsilon) if designed else None)


def forget_computed_figures():
    """So that certify_all computes what it states, not what the reference left in a cache."""
    accounting.discrete_laplace_approx_epsilon.cache_clear()
    accounting.discrete_gaussian_epsilon.cache_clear()
    getattr(accounting, "_PLD_EPSILONS", {}).clear()  # the cache of issue 30's accounting


def calibrations(noise, budget, epsilon, sizes, mechanism="tldp", width=256.0):
    try:
        return [calibrate(mechanism=mechanism, noise=noise, budget=budget, epsilon=epsilon,
                          range_width=width, elements=size) for size in sizes]
    except UsageError:  # --budget record out of reach for some size: perturb refuses it
        assume(False)


def assert_same_as_reference(cs):
    expected = reference_certify_all(cs)
    forget_computed_figures()
    got = accounting.certify_all(cs)
    assert got == expected
    # bit for bit, not just ==: the manifest's JSON is the same
    for scope in ("per_element", "per_record"):
        for key in ("epsilon", "delta", "rho", "point_mass_delta", "approx_epsilon", "approx_delta"):
            assert repr(getattr(getattr(got, scope), key)) == repr(getattr(getattr(expected, scope), key)), \
                (scope, key)


@pytest.mark.slow  # the reference certifies every size of every example in full (about 40 s)
@PROPERTY
@given(noise=st.sampled_from(["discrete-laplace", "discrete-gaussian", "laplace", "gaussian"]),
       mechanism=st.sampled_from(["tldp", "baseline"]),
       budget=st.sampled_from(["element", "record"]),
       epsilon=st.floats(0.05, 40),
       sizes=st.lists(st.integers(1, 4000), min_size=2, max_size=12, unique=True))
def test_the_worst_case_over_many_sizes_is_the_figure_of_every_size_computed(
        noise, mechanism, budget, epsilon, sizes):
    assert_same_as_reference(calibrations(noise, budget, epsilon, sizes, mechanism))


@PROPERTY
@given(noise=st.sampled_from(["discrete-laplace", "discrete-gaussian"]),
       epsilon=st.floats(0.1, 10), low=st.integers(2000, 30_000),
       steps=st.lists(st.integers(1, 400), min_size=3, max_size=8, unique=True))
def test_sizes_close_together_give_the_same_figures(noise, epsilon, low, steps):
    """The sizes a bound cannot tell apart from the largest: each is computed, and the
    worst is still the reference's (photos of nearly the same size)."""
    assert_same_as_reference(calibrations(noise, "element", epsilon, [low + s for s in steps]))


@pytest.mark.parametrize("noise", ["discrete-laplace", "discrete-gaussian", "laplace", "gaussian"])
def test_photo_sizes_give_the_same_figures(noise):
    """RGB photos of 40 distinct sizes from 60x60 to 90x90 pixels, as a folder of images has them."""
    sizes = sorted({h * w * 3 for h in range(60, 91, 3) for w in range(60, 91, 7)})[:40]
    assert_same_as_reference(calibrations(noise, "element", 1.0, sizes))


@pytest.mark.parametrize("noise", ["discrete-laplace", "discrete-gaussian"])
def test_many_sizes_run_the_accountant_for_a_few(monkeypatch, noise):
    """200 distinct record sizes: the privacy-loss distribution of a whole record is composed
    for a few of them (the ones that can be the worst case), not for each (it takes 0.1 to
    0.6 s a record size)."""
    cs = calibrations(noise, "element", 1.0, range(20_000, 30_000, 50))
    composed = []
    real = accounting._composed_pld_epsilon

    def counting(log_upper, log_lower, interval, count, delta, infinity_mass=0.0):
        if count > 1:
            composed.append(count)
        return real(log_upper, log_lower, interval, count, delta, infinity_mass)

    forget_computed_figures()
    monkeypatch.setattr(accounting, "_composed_pld_epsilon", counting)
    worst = accounting.certify_all(cs)
    assert worst.worst_case_of == 200
    assert 1 <= len(composed) <= 10, composed
    assert max(composed) == max(c.elements for c in cs)  # the largest record is among them


def test_a_bound_is_never_below_the_figure_it_stands_for():
    """Each Deferred's upper bound, for every noise and many sizes and budgets, is at least
    the figure the accountant computes."""
    for noise in ("discrete-laplace", "discrete-gaussian", "laplace", "gaussian"):
        for epsilon in (0.3, 1.0, 8.0):
            for size in (1, 2, 7, 100, 784, 5000):
                calib = calibrations(noise, "element", epsilon, [size])[0]
                for count in (1, size):
                    scope = accounting._scope(calib, count, deferred=True)
                    for figure in (scope.epsilon, scope.approx_epsilon):
                        if isinstance(figure, accounting.Deferred):
                            assert figure.upper >= figure.value() and math.isfinite(figure.upper)
