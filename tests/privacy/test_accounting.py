"""Calibration and certified figures against the closed forms of docs/guarantee.md."""

import math

import numpy as np
import pytest

from tests.builders import analytic_gaussian_delta
from tldp_cli.errors import UsageError
from tldp_cli.privacy import accounting
from tldp_cli.privacy.certificates import Guarantee
from tldp_cli.privacy.mechanisms import calibrate


def cal(**kw):
    args = dict(mechanism="tldp", noise="laplace", budget="element", epsilon=1.0,
                range_width=256.0, elements=784, dp_delta=1e-5)
    args.update(kw)
    return calibrate(**args)


def test_laplace_retain_probability_is_one_third_for_unit_range():
    c = cal(range_width=1.0, elements=1)
    assert c.scale == 1.0
    assert c.p == pytest.approx(1 / 3, rel=1e-12)


def test_gaussian_retain_probability_matches_paper_formula_for_small_records():
    for eps, delta_range, elements in [(1.0, 1.0, 1), (2.0, 3.0, 2), (0.5, 1.0, 4)]:
        c = cal(noise="gaussian", epsilon=eps, range_width=delta_range, elements=elements)
        sigma = math.sqrt(delta_range**2 / (2 * eps))
        top = math.exp(eps - elements * delta_range**2 / (2 * sigma**2))
        assert c.scale == pytest.approx(sigma)
        assert c.p == pytest.approx(top / (sigma * math.sqrt(2 * math.pi) + top), rel=1e-12)


@pytest.mark.parametrize("noise", ["laplace", "gaussian"])
def test_retain_probability_underflows_but_its_log_is_recorded(noise):
    c = cal(noise=noise)
    assert c.p == 0.0
    assert math.isfinite(c.log_p)
    normaliser = 2 * c.scale if noise == "laplace" else c.scale * math.sqrt(2 * math.pi)
    expected_log_p = -783.0 - math.log(normaliser)  # a = eps (1 - I) is far below log(normaliser)
    assert c.log_p == pytest.approx(expected_log_p, rel=1e-12)
    assert c.p_log10 == pytest.approx(expected_log_p / math.log(10))


def test_no_overflow_for_huge_epsilon_on_one_element():
    c = cal(epsilon=1e6, range_width=1.0, elements=1)
    assert 0 < c.p < 1 and math.isfinite(c.log_p)


def test_baseline_scales_are_the_papers():
    lap = cal(mechanism="baseline", epsilon=2.0)
    assert lap.scale == pytest.approx(784 * 256 / 2.0) and lap.p == 0.0
    gau = cal(mechanism="baseline", noise="gaussian", epsilon=2.0)
    assert gau.scale**2 == pytest.approx(784 * 256**2 / (2 * 2.0))


@pytest.mark.parametrize("bad", [0.0, -1.0, math.inf, math.nan])
def test_bad_epsilon_is_a_usage_error(bad):
    with pytest.raises(UsageError):
        cal(epsilon=bad)


def test_laplace_per_element_and_per_record_pure_figures():
    c = cal(epsilon=0.5)
    acc = accounting.certify(c)
    assert acc.per_element.epsilon == pytest.approx(0.5)
    assert acc.per_record.epsilon == pytest.approx(784 * 0.5)
    assert acc.per_element.rho is None
    # the point mass: delta underflows, its log10 is log10(p) and log10(I p) to first order
    assert acc.per_element.delta_log10 == pytest.approx(c.p_log10)
    assert acc.per_record.delta_log10 == pytest.approx(c.p_log10 + math.log10(784))


def test_point_mass_delta_for_a_non_negligible_p():
    c = cal(range_width=1.0, elements=3, epsilon=3.0)
    acc = accounting.certify(c)
    assert acc.per_element.delta == pytest.approx(c.p)
    assert acc.per_record.delta == pytest.approx(1 - (1 - c.p) ** 3)
    assert acc.per_record.approx_delta == pytest.approx(1e-5 + 1 - (1 - c.p) ** 3)


def test_laplace_approx_matches_the_closed_form_for_one_element():
    # One Laplace mechanism of pure eps0 is (eps0 + 2 ln(1 - delta), delta)-DP, tightly.
    for eps in [0.1, 1.0, 4.0]:
        acc = accounting.certify(cal(epsilon=eps, elements=1, range_width=1e6))
        closed = eps + 2 * math.log(1 - 1e-5)
        assert acc.per_element.approx_epsilon == pytest.approx(closed, abs=2e-3)


def test_laplace_composed_approx_is_below_pure_and_near_rdp():
    from dp_accounting import LaplaceDpEvent
    from dp_accounting.rdp import RdpAccountant

    acc = accounting.certify(cal())
    pld = acc.per_record.approx_epsilon
    rdp = RdpAccountant()
    rdp.compose(LaplaceDpEvent(noise_multiplier=1.0), 784)
    assert pld < 784
    assert 0.9 * rdp.get_epsilon(1e-5) < pld <= rdp.get_epsilon(1e-5)


@pytest.mark.parametrize("eps,elements", [(1.0, 784), (0.3, 64), (5.0, 1)])
def test_gaussian_figures_against_analytic_gaussian_and_zcdp(eps, elements):
    c = cal(noise="gaussian", epsilon=eps, elements=elements)
    acc = accounting.certify(c)
    rec, el = acc.per_record, acc.per_element
    assert el.rho == pytest.approx(eps)
    assert rec.rho == pytest.approx(eps * elements)
    for scope, count in [(el, 1), (rec, elements)]:
        # the reported eps is exactly where the analytic Gaussian reaches dp_delta
        got = analytic_gaussian_delta(scope.approx_epsilon, c.scale, 256 * math.sqrt(count))
        assert got == pytest.approx(1e-5, rel=1e-3)
        rho = scope.rho
        assert scope.epsilon <= rho + 2 * math.sqrt(rho * math.log(1e5))


def test_mnist_gaussian_record_figure_is_about_952():
    acc = accounting.certify(cal(noise="gaussian"))
    assert acc.per_record.epsilon == pytest.approx(952, abs=1.0)


def test_record_budget_laplace_gives_the_record_eps():
    c = cal(budget="record", epsilon=2.0)
    assert c.scale == pytest.approx(784 * 256 / 2.0)
    assert accounting.certify(c).per_record.epsilon == pytest.approx(2.0)


@pytest.mark.parametrize("mechanism", ["tldp", "baseline"])
def test_record_budget_gaussian_gives_the_record_eps(mechanism):
    c = cal(noise="gaussian", budget="record", epsilon=3.0, mechanism=mechanism)
    rec = accounting.certify(c).per_record
    assert rec.approx_epsilon == pytest.approx(3.0, rel=1e-6)
    assert analytic_gaussian_delta(3.0, c.scale, 256 * math.sqrt(784)) == pytest.approx(1e-5, rel=1e-3)


def test_baseline_has_no_point_mass_and_composes_to_the_record_eps():
    acc = accounting.certify(cal(mechanism="baseline", epsilon=2.0))
    assert acc.per_record.epsilon == pytest.approx(2.0)
    assert acc.per_element.epsilon == pytest.approx(2.0 / 784)
    assert acc.per_record.delta == 0.0 and acc.per_record.delta_log10 is None


def test_expected_error_table5():
    c = cal()
    assert c.expected_l2_error() == pytest.approx(256 * math.sqrt(2 * 784))
    g = cal(noise="gaussian")
    assert g.expected_l2_error() == pytest.approx(256 / math.sqrt(2) * math.sqrt(784))
    b = cal(mechanism="baseline")
    assert b.expected_l2_error() == pytest.approx(256 * 784 * math.sqrt(2 * 784))
    assert np.isfinite(c.expected_l2_error())


def _scope(epsilon, delta, rho=None, point_mass=0.0):
    """A release's per-record scope (what the ledger reads back)."""
    return Guarantee(epsilon, delta, None, rho, delta, epsilon, point_mass, None)


def _gaussian_scope(rho, dp_delta=1e-5, point_mass=0.0):
    """A Gaussian release's per-record scope: its analytic (eps, delta) at dp_delta and its rho."""
    sigma = 1 / math.sqrt(2 * rho)  # sensitivity 1
    eps = accounting.gaussian_epsilon(sigma, dp_delta)
    return _scope(eps, dp_delta + point_mass, rho, point_mass)


def test_releases_compose_pure_figures_by_addition():
    laplace = [(_scope(e, d), 1e-5) for e, d in [(1.5, 0.0), (2.25, 1e-7), (4.0, 3e-7)]]
    assert accounting.compose_releases(laplace) == (pytest.approx(7.75), pytest.approx(4e-7))
    assert accounting.compose_releases([]) == (0.0, 0.0)
    assert accounting.compose_releases([(_scope(1.0, 0.7), 1e-5)] * 2)[1] == 1.0


@pytest.mark.parametrize("rhos, dp_delta", [([0.5] * 4, 1e-5), ([0.1, 2.0, 0.4], 1e-9), ([3.0] * 10, 1e-6)])
def test_gaussian_releases_compose_through_zcdp(rhos, dp_delta):
    """The summed rho's RDP epsilon lies between the exact epsilon of one Gaussian of that rho
    (Balle and Wang) and the zCDP conversion rho + 2 sqrt(rho ln(1/delta)) (Bun and Steinke)."""
    point_mass = 1e-12
    eps, delta = accounting.compose_releases([(_gaussian_scope(r, dp_delta, point_mass), dp_delta) for r in rhos])
    rho = sum(rhos)
    assert analytic_gaussian_delta(eps, 1 / math.sqrt(2 * rho), 1.0) <= dp_delta
    assert eps <= rho + 2 * math.sqrt(rho * math.log(1 / dp_delta))
    assert eps < sum(_gaussian_scope(r, dp_delta).epsilon for r in rhos)  # below basic composition
    assert delta == pytest.approx(dp_delta + len(rhos) * point_mass)


def test_one_release_composes_to_its_own_figure_and_a_mix_adds():
    scope = _gaussian_scope(0.5)
    assert accounting.compose_releases([(scope, 1e-5)]) == (scope.epsilon, scope.delta)
    laplace = _scope(2.0, 0.0)
    assert accounting.compose_releases([(scope, 1e-5), (laplace, 1e-5)]) == (
        pytest.approx(scope.epsilon + 2.0), pytest.approx(scope.delta))


def test_gaussian_releases_are_stated_at_their_smallest_dp_delta():
    """A release with a larger --dp-delta cannot lower what the others spend under an eps cap."""
    small = [(_gaussian_scope(0.5, 1e-9), 1e-9)] * 4
    eps, delta = accounting.compose_releases(small + [(_gaussian_scope(0.5, 1e-3), 1e-3)])
    assert eps == pytest.approx(accounting.compose_releases(small + [(_gaussian_scope(0.5, 1e-9), 1e-9)])[0])
    assert eps > accounting.compose_releases(small)[0] and delta == pytest.approx(1e-9)
