"""Discrete Laplace and discrete Gaussian noise (issue 7): exact samplers, the integer
engine, grid snapping, accounting against closed forms and dp-accounting, every format."""

import json
import math
from decimal import Context, Decimal
from fractions import Fraction
from pathlib import Path

import h5py
import numpy as np
import pytest
import tifffile
import zarr
from PIL import Image
from scipy import stats

from tests.builders import (
    RoundTrip,
    composed_losses,
    exact_delta,
    exact_epsilon,
    mixture_loss_atoms,
    siblings,
    tree_digest,
)
from tldp_cli.errors import DataError, UsageError
from tldp_cli.privacy import accounting, distributions
from tldp_cli.privacy.mechanisms import calibrate
from tldp_cli.sampling import discrete, engine
from tldp_cli.sampling.rng import Streams

ALPHA = 1e-4  # a correct sampler fails a test with this probability


def draw(sampler, n: int, seed: int = 0) -> np.ndarray:
    return sampler.sample(Streams("secure", seed, allow_weak_seed=True).generator("test", 0), n)


def cal(**kw):
    args = dict(mechanism="tldp", noise="discrete-laplace", budget="element", epsilon=1.0,
                range_width=256, elements=784, dp_delta=1e-5)
    args.update(kw)
    return calibrate(**args)


# --------------------------------------------------------------------------- samplers
@pytest.mark.parametrize("scale", [0.4, 3.0, 256.0, 1e5, 3e9])  # 1e5, 3e9: two and three digit levels
def test_discrete_laplace_matches_its_pmf_and_not_a_wrong_scale(scale):
    sample = draw(discrete.DiscreteLaplace(scale), 200_000)
    assert sample.dtype == np.int64
    assert distributions.chi_square(sample, "discrete-laplace", scale)[1] > ALPHA
    assert distributions.chi_square(sample, "discrete-laplace", scale * 1.03)[1] < 1e-6


@pytest.mark.parametrize("sigma", [0.3, 2.5, 181.0, 5069.0, 2e4])  # 2e4: beyond the table, CKS20
def test_discrete_gaussian_matches_its_pmf_and_not_a_wrong_sigma(sigma):
    sample = draw(discrete.DiscreteGaussian(sigma), 200_000, seed=1)
    assert distributions.chi_square(sample, "discrete-gaussian", sigma)[1] > ALPHA
    assert distributions.chi_square(sample, "discrete-gaussian", sigma * 1.03)[1] < 1e-6


def test_small_values_one_by_one_against_the_pmf():
    for noise, scale, top in (("discrete-laplace", 1.5, 8), ("discrete-gaussian", 1.2, 4)):
        sampler = discrete.sampler(noise, scale)
        sample = draw(sampler, 300_000, seed=2)
        values = np.arange(-top, top + 1)
        observed = np.array([(sample == v).sum() for v in values] + [(np.abs(sample) > top).sum()])
        pmf = distributions.noise_pmf(noise, scale, values)
        expected = np.append(pmf, 1 - pmf.sum()) * sample.size
        assert stats.chisquare(observed, expected).pvalue > ALPHA


def test_exact_paths_give_the_same_distribution():
    """Ties with table entries (12-bit tables make them frequent) and acceptance decisions
    inside the float margin (a margin of 0.3 sends most there) go to exact arithmetic."""
    coarse = draw(discrete.DiscreteLaplace(2.5, bits=12), 100_000, seed=3)
    assert distributions.chi_square(coarse, "discrete-laplace", 2.5)[1] > ALPHA
    wide = draw(discrete.DiscreteGaussian(1.3, margin=0.3, tabulated=False), 30_000, seed=4)
    assert distributions.chi_square(wide, "discrete-gaussian", 1.3)[1] > ALPHA
    # the float and the exact decisions agree: same stream, same values
    a = draw(discrete.DiscreteGaussian(4.0, tabulated=False), 20_000, seed=5)
    b = draw(discrete.DiscreteGaussian(4.0, margin=0.3, tabulated=False), 20_000, seed=5)
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("scale", [3.0, 256.0, 1e5])
def test_guide_table_and_search_give_the_same_values(scale, monkeypatch):
    """The guide table settles most uniforms; with a 16-entry guide nearly all go to the
    search instead. Same stream, same values: each path is checked against the other."""
    fast = draw(discrete.DiscreteLaplace(scale), 50_000, seed=6)
    monkeypatch.setattr(discrete, "GUIDE_BITS", 4)
    searched = discrete.DiscreteLaplace(scale)
    assert (searched.absolute or searched.magnitude.levels[0]).guide.size == 16
    np.testing.assert_array_equal(draw(searched, 50_000, seed=6), fast)


@pytest.mark.parametrize("sigma", [1.3, 181.0])
def test_acceptance_table_and_per_candidate_thresholds_agree(sigma, monkeypatch):
    """CKS20's rejection sampler (sigmas too large for a table of |Z|): acceptance
    thresholds from the table over |y| and computed per candidate (what sigmas too large
    for that table get) decide alike, and match the distribution."""
    table = draw(discrete.DiscreteGaussian(sigma, tabulated=False), 50_000, seed=7)
    assert distributions.chi_square(table, "discrete-gaussian", sigma)[1] > ALPHA
    monkeypatch.setattr(discrete, "ACCEPT_TABLE_MAX", 0)
    computed = discrete.DiscreteGaussian(sigma, tabulated=False)
    assert computed.lo is None
    np.testing.assert_array_equal(draw(computed, 50_000, seed=7), table)


def test_discrete_laplace_table_entries_are_proven_floors():
    """floor(2^31 P(|Z| <= m)), P(|Z| <= m) = 1 - 2 a^(m+1) / (1 + a), against decimal arithmetic."""
    level = discrete.DiscreteLaplace(7.0).absolute
    ctx = Context(prec=80)
    a = ctx.exp(ctx.divide(-1, 7))
    for m in (0, 1, 50, level.entries - 1):
        cdf = ctx.subtract(1, ctx.divide(ctx.multiply(2, ctx.power(a, m + 1)), ctx.add(1, a)))
        assert int(level.c[m]) == int(ctx.multiply(cdf, 2**discrete.BITS))


def test_discrete_laplace_tail_beyond_the_table(monkeypatch):
    """A table cut short (TAIL_BITS 2) sends values past it to the geometric tail."""
    monkeypatch.setattr(discrete, "TAIL_BITS", 2)
    sampler = discrete.DiscreteLaplace(20.0)
    sample = draw(sampler, 200_000, seed=9)
    assert (np.abs(sample) >= sampler.absolute.entries).mean() > 0.1
    assert distributions.chi_square(sample, "discrete-laplace", 20.0)[1] > ALPHA
    assert distributions.chi_square(sample, "discrete-laplace", 20.0 * 1.03)[1] < 1e-6


def test_discrete_gaussian_table_entries_are_proven_floors():
    """floor(2^31 P(|Z| <= m)) against a direct sum in decimal arithmetic."""
    sigma = 3.7
    level = discrete.DiscreteGaussian(sigma).magnitude
    ctx = Context(prec=80)
    terms = [ctx.exp(ctx.divide(-(k * k), ctx.multiply(2, Decimal(sigma) ** 2))) for k in range(400)]
    total = ctx.add(1, ctx.multiply(2, sum(terms[1:], Decimal(0))))
    for m in (0, 1, 5, level.entries - 1):
        cdf = ctx.divide(ctx.add(1, ctx.multiply(2, sum(terms[1:m + 1], Decimal(0)))), total)
        assert int(level.c[m]) == int(ctx.multiply(cdf, 2**discrete.BITS))


def test_discrete_gaussian_tail_beyond_the_table(monkeypatch):
    """A table cut short (GAUSS_TAIL_BITS 3) sends one value in forty through the exact
    rejection sampler of the tail: the values still follow the distribution."""
    monkeypatch.setattr(discrete, "GAUSS_TAIL_BITS", 3)
    sampler = discrete.DiscreteGaussian(6.0)
    assert sampler.magnitude.entries < 6 * 3
    sample = draw(sampler, 100_000, seed=8)
    assert (np.abs(sample) >= sampler.magnitude.entries).mean() > 0.015
    assert distributions.chi_square(sample, "discrete-gaussian", 6.0)[1] > ALPHA
    assert distributions.chi_square(sample, "discrete-gaussian", 6.0 * 1.03)[1] < 1e-6


def test_table_entries_are_proven_floors():
    level = discrete.Geometric(Fraction(1, 7)).levels[0]
    for m in (0, 1, 50, level.entries - 1):
        ctx = Context(prec=80)
        exact = ctx.subtract(1, ctx.exp(ctx.divide(-(m + 1), 7)))
        assert int(level.c[m]) == int(ctx.multiply(exact, 2**discrete.BITS))


def test_numpy_exp_is_well_within_the_acceptance_margin():
    x = np.random.default_rng(0).uniform(0, 60, 20_000)
    ctx = Context(prec=40)
    exact = np.array([float(ctx.exp(Decimal(-v))) for v in x.tolist()])
    assert np.max(np.abs(np.exp(-x) - exact)) < discrete.ACCEPT_MARGIN / 2**5


def test_exp_interval_brackets_the_value():
    for q in (Fraction(0), Fraction(1, 3), Fraction(123456789, 1000)):
        lo, hi = discrete.exp_neg_interval(q, 100)
        ctx = Context(prec=80)
        exact = ctx.multiply(ctx.exp(ctx.divide(-Decimal(q.numerator), Decimal(q.denominator))), 2**100)
        assert lo <= exact <= hi and hi - lo <= 4


def test_retain_mask_keeps_exactly_p():
    rng = Streams("secure", 3, allow_weak_seed=True).generator("keep", 0)
    for p in (0.3, 1e-3, 2.0**-70):
        kept = discrete.retain_mask(rng, p, 400_000)
        assert stats.binomtest(kept.size, 400_000, p).pvalue > ALPHA
    assert discrete.retain_mask(rng, 0.0, 10).size == 0


def test_retain_mask_breaks_ties_with_further_bits():
    """A word equal to floor(p 2^64), with p not a multiple of 2^-64, is decided by the next
    word against p's remaining bits. A seeded stream has small words (< 2^51, one in 2^13)
    to put p right there: p = (w + f) 2^-64, so the element is kept exactly when the next
    word is below f 2^64."""
    decided = {True: 0, False: 0}
    for seed in range(24):
        words = Streams("secure", seed, allow_weak_seed=True).generator("tie", 0).bit_generator.random_raw(1 << 17)
        i = int(np.flatnonzero(words < np.uint64(1 << 51))[0])
        fraction = (0.25, 0.5, 0.75)[seed % 3]
        p = (int(words[i]) + fraction) * 2.0**-64
        assert Fraction(p) * 2**64 == int(words[i]) + Fraction(fraction)  # exact: a tie, not a floor
        kept = discrete.retain_mask(Streams("secure", seed, allow_weak_seed=True).generator("tie", 0), p, i + 1)
        expected = int(words[i + 1]) < fraction * 2**64
        assert (i in kept) == expected, seed
        decided[expected] += 1
    assert min(decided.values()) >= 5  # both outcomes seen


# --------------------------------------------------------------------------- engine
def test_retained_fraction_matches_p():
    """I = 1, W = 4: p is large. Unchanged values are the kept ones plus noise 0."""
    calib = cal(range_width=4, elements=1)
    assert 0.1 < calib.p < 0.12
    block = np.full((200_000, 1), 2, np.uint8)
    out = engine.perturb_records(block, 0, "x", calib, Streams("secure", 6, allow_weak_seed=True), dtype=np.int16)
    zero = distributions.noise_pmf("discrete-laplace", calib.scale, 0)
    unchanged = int((out == 2).sum())
    assert stats.binomtest(unchanged, out.size, calib.p + (1 - calib.p) * zero).pvalue > ALPHA
    assert stats.binomtest(unchanged, out.size, 0.9 * calib.p + (1 - 0.9 * calib.p) * zero).pvalue < 1e-6
    # the values that moved follow the noise
    moved = out[out != 2].astype(np.int64) - 2
    assert distributions.chi_square(moved, "discrete-laplace", calib.scale, exclude_zero=True)[1] > ALPHA


def test_weights_lower_the_retained_fraction():
    calib = cal(range_width=4, elements=1)
    block = np.full((100_000, 1), 1, np.uint8)
    out = engine.perturb_records(block, 0, "x", calib, Streams("secure", 7, allow_weak_seed=True),
                                 np.array([0.75]), np.int16)
    zero = distributions.noise_pmf("discrete-laplace", calib.scale, 0)
    p = 0.25 * calib.p
    assert stats.binomtest(int((out == 1).sum()), out.size, p + (1 - p) * zero).pvalue > ALPHA


def test_blocks_do_not_change_the_values():
    calib = cal(noise="discrete-gaussian", range_width=16, elements=12)
    data = np.random.default_rng(1).integers(0, 16, (9000, 12)).astype(np.int32)
    streams = Streams("secure", 8, allow_weak_seed=True)
    whole = engine.perturb_records(data, 0, "a", calib, streams, dtype=np.int16)
    parts = np.concatenate([engine.perturb_records(data[s:s + 1234], s, "a", calib, streams, dtype=np.int16)
                            for s in range(0, 9000, 1234)])
    np.testing.assert_array_equal(whole, parts)


def test_integer_output_never_wraps():
    grid = discrete.Grid(None, 0, 255)
    assert discrete.output_dtype(grid, "discrete-laplace", 256.0, "float32") == np.int16
    assert discrete.output_dtype(grid, "discrete-laplace", 2560.0, "float32") == np.int32
    assert discrete.output_dtype(discrete.Grid(None, 0, 1), "discrete-laplace", 0.5, "float32") == np.int8
    assert discrete.output_dtype(discrete.Grid(None, 0, 65535), "discrete-gaussian", 46341.0, "float32") == np.int32
    assert discrete.output_dtype(discrete.Grid(None, -2**40, 2**40), "discrete-laplace", 2.0**50, "f") == np.int64
    with pytest.raises(UsageError, match="int64"):
        discrete.output_dtype(discrete.Grid(None, -2**40, 2**40), "discrete-laplace", 2.0**60, "f")
    # saturation, not wrap-around, should a value ever pass the tail bound
    np.testing.assert_array_equal(engine._to_output(np.array([40_000, -40_000, 7]), None, np.dtype(np.int16)),
                                  [32767, -32768, 7])
    # extreme inputs: the ends of uint8 and int8, noise of both signs around them
    calib = cal(epsilon=0.5, elements=6)
    for dtype, values in ((np.uint8, [0, 255]), (np.int8, [-128, 127])):
        block = np.tile(np.array(values, dtype), (2000, 3))
        out = engine.perturb_records(block, 0, "e", calib, Streams("secure", 9, allow_weak_seed=True),
                                     dtype=np.int16)
        noise = out.astype(np.int64) - block
        assert out.dtype == np.int16 and noise.min() < -600 and noise.max() > 600
        assert distributions.chi_square(noise.ravel(), "discrete-laplace", calib.scale)[1] > ALPHA


def test_float_values_without_a_grid_must_be_integers():
    calib = cal(range_width=4, elements=2)
    ok = engine.perturb_records(np.array([[1.0, 3.0]]), 0, "f", calib, Streams("secure", 1, allow_weak_seed=True))
    assert ok.dtype == np.float32 and np.all(ok == np.round(ok))
    with pytest.raises(DataError, match="integer values"):
        engine.perturb_records(np.array([[1.5, 3.0]]), 0, "f", calib, Streams("secure", 1, allow_weak_seed=True))


# --------------------------------------------------------------------------- accounting
@pytest.mark.parametrize("W, I, eps", [(256, 784, 1.0), (4, 1, 1.0), (4, 3, 2.0), (16, 2, 0.3)])
def test_discrete_laplace_pure_bound_is_the_largest_privacy_loss(W, I, eps):
    """docs/guarantee.md's formula against the loss computed outcome by outcome, for the pair
    of range ends; closer pairs lose less."""
    c = cal(range_width=W, elements=I, epsilon=eps)
    upper, lower = accounting.discrete_laplace_log_pmfs(W - 1, c.scale, c.log_p)
    element = accounting.discrete_laplace_element_epsilon(W - 1, c.scale, c.log_p)
    assert np.max(upper - lower) == pytest.approx(element, rel=1e-12)
    a = math.exp(-1 / c.scale)
    closed = (W - 1) / c.scale + math.log1p(c.p * (1 + a) / ((1 - c.p) * (1 - a)))
    assert element == pytest.approx(closed, rel=1e-12)
    acc = accounting.certify(c)
    assert acc.per_element.epsilon == element and acc.per_element.delta == 0
    assert acc.per_record.epsilon == pytest.approx(I * element, rel=1e-12)


def test_closer_pairs_are_dominated():
    """Hockey-stick divergence of the discrete Laplace mixture for inputs k apart, k < d."""
    b, log_p, d = 3.0, math.log(0.2), 6
    ends = accounting.discrete_laplace_log_pmfs(d, b, log_p)

    def delta(pair, eps):
        upper, lower = np.exp(pair[0]), np.exp(pair[1])
        return float(np.maximum(upper - math.exp(eps) * lower, 0).sum())

    for k in range(1, d):
        # the pair (0, k) on the same outcomes: y < 0, 0..d, y > d
        full_upper = np.exp(accounting.discrete_laplace_log_pmfs(k, b, log_p)[0])
        full_lower = np.exp(accounting.discrete_laplace_log_pmfs(k, b, log_p)[1])
        pair = (np.log(full_upper), np.log(full_lower))
        for eps in (0.0, 0.5, 1.0, 2.0):
            assert delta(pair, eps) <= delta(ends, eps) + 1e-15


def test_discrete_laplace_approx_matches_dp_accounting():
    from dp_accounting.pld import privacy_loss_distribution as pld

    for count in (1, 784):
        ours = accounting.discrete_laplace_approx_epsilon(255, 256.0, -math.inf, count, 1e-5)
        interval = accounting._interval(count, 255 / 256)
        theirs = pld.from_discrete_laplace_mechanism(1 / 256, sensitivity=255, value_discretization_interval=interval)
        if count > 1:
            theirs = theirs.self_compose(count)
        expected = min(count * 255 / 256, theirs.get_epsilon_for_delta(1e-5))
        # a loss on a bin edge (the largest, for one element) goes one bin up: at most that
        assert expected * (1 - 1e-6) <= ours <= expected + interval
    c = cal()
    acc = accounting.certify(c)
    assert acc.per_record.approx_epsilon < 0.6 * acc.per_record.epsilon


@pytest.mark.parametrize("W, I, eps, budget", [
    (2, 1, 1.0, "element"), (4, 3, 1.0, "element"), (3, 4, 0.7, "element"), (8, 2, 2.0, "record"),
    (16, 1, 1.0, "record"), (5, 3, 3.0, "record"),
])
def test_discrete_laplace_mixture_approx_against_brute_force(W, I, eps, budget):
    """p far from 0: the certified (eps at 1e-5) of a record against the exact loss
    distribution of the mixture, enumerated outcome by outcome: it holds (the exact delta
    there is at most 1e-5) and is tight (at most one PLD bin per element above the exact)."""
    c = cal(budget=budget, epsilon=eps, range_width=W, elements=I)
    assert c.p > 0.01
    dist = composed_losses([mixture_loss_atoms(W - 1, c.scale, c.p)] * I)
    record = accounting.certify(c).per_record
    certified = record.approx_epsilon
    exact = exact_epsilon(dist, 1e-5)
    interval = accounting._interval(I, accounting.discrete_laplace_element_epsilon(W - 1, c.scale, c.log_p))
    assert exact_delta(dist, certified) <= 1e-5
    assert exact <= certified <= exact + 2 * I * interval
    assert record.epsilon == pytest.approx(max(dist.keys() - {math.inf}), rel=1e-8)  # pure: the largest loss


def cks_delta(eps, sigma, d):
    """Canonne, Kamath and Steinke (2020), Theorem 7: the exact delta of the discrete Gaussian."""
    z = np.arange(-math.ceil(40 * sigma), math.ceil(40 * sigma) + 1)
    pmf = np.exp(-z.astype(float) ** 2 / (2 * sigma**2))
    pmf /= pmf.sum()
    return float(pmf[z > eps * sigma**2 / d - d / 2].sum()
                 - math.exp(eps) * pmf[z > eps * sigma**2 / d + d / 2].sum())


def test_discrete_gaussian_element_against_closed_form_and_dp_accounting():
    from dp_accounting.pld import privacy_loss_distribution as pld

    c = cal(noise="discrete-gaussian")
    acc = accounting.certify(c).per_element
    assert acc.rho == pytest.approx(255**2 / (2 * c.scale**2), rel=1e-12)
    eps = acc.epsilon
    assert cks_delta(eps, c.scale, 255) <= 1e-5 < cks_delta(0.995 * eps, c.scale, 255)
    theirs = pld.from_discrete_gaussian_mechanism(c.scale, sensitivity=255).get_epsilon_for_delta(1e-5)
    assert eps == pytest.approx(theirs, rel=1e-3)


def test_discrete_gaussian_record_against_dp_accounting_and_rdp():
    from dp_accounting import GaussianDpEvent
    from dp_accounting.pld import privacy_loss_distribution as pld
    from dp_accounting.rdp import RdpAccountant

    sigma, d, count = 12.0, 15, 20
    ours = accounting.discrete_gaussian_epsilon(sigma, d, count, 1e-5)
    theirs = pld.from_discrete_gaussian_mechanism(sigma, sensitivity=d).self_compose(count)
    assert ours == pytest.approx(theirs.get_epsilon_for_delta(1e-5), rel=2e-3)
    rdp = RdpAccountant()
    rdp.compose(GaussianDpEvent(sigma / d), count)
    assert ours < 0.97 * rdp.get_epsilon(1e-5)  # the privacy-loss distribution decides here
    # exact: the loss of the pair (0, d) summed over count elements is linear in the sum of
    # count discrete Gaussians, whose pmf is a convolution
    span = math.ceil(14 * sigma) + d
    y = np.arange(-span, span + 1)
    pmf = np.exp(-y.astype(float) ** 2 / (2 * sigma**2))
    pmf /= pmf.sum()
    total = pmf
    for _ in range(count - 1):
        total = np.convolve(total, pmf)
    loss = (count * d * d - 2 * d * (np.arange(total.size) - count * span)) / (2 * sigma**2)

    def exact_delta(eps):
        above = loss > eps
        return float(np.sum(total[above] * -np.expm1(eps - loss[above])))

    assert exact_delta(ours) <= 1e-5 < exact_delta(0.99 * ours)


@pytest.mark.parametrize("mechanism, noise, eps", [
    ("tldp", "discrete-laplace", 400.0), ("baseline", "discrete-laplace", 1.0),
    ("tldp", "discrete-gaussian", 2.0), ("baseline", "discrete-gaussian", 2.0),
])
def test_record_budget_certifies_exactly_eps(mechanism, noise, eps):
    c = cal(mechanism=mechanism, noise=noise, budget="record", epsilon=eps, range_width=256, elements=50)
    record = accounting.certify(c).per_record
    assert record.epsilon <= eps and record.epsilon == pytest.approx(eps, rel=1e-6)


def test_record_budget_tldp_discrete_laplace_refuses_what_p_alone_exceeds():
    with pytest.raises(UsageError, match="retain probability"):
        cal(budget="record", epsilon=1.0)


def test_point_mass_of_the_discrete_gaussian_enters_delta():
    c = cal(noise="discrete-gaussian", range_width=4, elements=1)
    acc = accounting.certify(c).per_element
    assert c.p > 0.01 and acc.point_mass_delta == pytest.approx(c.p, rel=1e-12)
    assert acc.delta == pytest.approx(1e-5 + c.p, rel=1e-12)


def test_grid_calibration_uses_one_more_value():
    """Snapping [0, 1] to 1/64: 65 grid values, sensitivity 64 steps; the same figures as
    integer data of 65 values."""
    grid = cal(range_width=1.0, granularity=1 / 64, elements=10)
    ints = cal(range_width=65, elements=10)
    assert grid.grid_values == 65 and grid.scale == ints.scale
    assert accounting.certify(grid).per_record == accounting.certify(ints).per_record


# --------------------------------------------------------------------------- every format
class DiscreteRoundTrip(RoundTrip):
    extra_args = ("--noise", "discrete-laplace")


def _uint8(shape, seed=0):
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


class TestNpyDiscrete(DiscreteRoundTrip):
    def make_input(self, tmp_path):
        np.save(tmp_path / "data.npy", _uint8((50, 6, 5)))
        return tmp_path / "data.npy"

    def read_arrays(self, path):
        return {"array": np.load(path)}

    def assert_same_structure(self, original, perturbed):
        assert np.load(perturbed).dtype == np.int16


class TestHdf5Discrete(DiscreteRoundTrip):
    extra_args = ("--noise", "discrete-gaussian", "--keep", "labels")

    def make_input(self, tmp_path):
        with h5py.File(tmp_path / "data.h5", "w") as f:
            f.create_dataset("images", data=_uint8((40, 8, 8)), chunks=(10, 8, 8), compression="gzip")
            f.create_dataset("labels", data=np.arange(40))
        return tmp_path / "data.h5"

    def read_arrays(self, path):
        with h5py.File(path, "r") as f:
            return {"images": f["images"][()]}

    def assert_same_structure(self, original, perturbed):
        with h5py.File(original, "r") as a, h5py.File(perturbed, "r") as b:
            assert b["images"].dtype == np.int16 and b["images"].chunks == (10, 8, 8)
            np.testing.assert_array_equal(a["labels"][()], b["labels"][()])


@pytest.mark.parametrize("zarr_format", [2, 3])
class TestZarrDiscrete(DiscreteRoundTrip):
    @pytest.fixture(autouse=True)
    def _format(self, zarr_format):
        self.zarr_format = zarr_format

    def make_input(self, tmp_path):
        group = zarr.open_group(tmp_path / "data.zarr", mode="w", zarr_format=self.zarr_format)
        group.create_array("images", data=_uint8((30, 4, 4)), chunks=(10, 4, 4))
        return tmp_path / "data.zarr"

    def read_arrays(self, path):
        return {"images": zarr.open_group(path, mode="r")["images"][:]}

    def assert_same_structure(self, original, perturbed):
        array = zarr.open_group(perturbed, mode="r")["images"]
        assert array.dtype == np.int16 and array.chunks == (10, 4, 4) and array.fill_value == 0


class TestImagesDiscrete(DiscreteRoundTrip):
    """8-bit PNG output: the integer result is clipped to [0, 255] and recorded, as for the
    continuous noises; --image-format tiff keeps it whole (below)."""

    def make_input(self, tmp_path):
        folder = tmp_path / "photos"
        folder.mkdir()
        Image.fromarray(_uint8((6, 5))).save(folder / "gray.png")
        Image.fromarray(_uint8((4, 4, 3), 1)).save(folder / "rgb.png")
        return folder

    def read_arrays(self, path):
        return {p.name: np.asarray(Image.open(p)) for p in sorted(Path(path).glob("*.png"))}

    def assert_same_structure(self, original, perturbed):
        assert sorted(p.name for p in Path(perturbed).iterdir()) == ["gray.png", "rgb.png"]
        assert np.asarray(Image.open(Path(perturbed) / "gray.png")).dtype == np.uint8


class TestFloatGridDiscrete(DiscreteRoundTrip):
    extra_args = ("--noise", "discrete-laplace", "--range", "0:1", "--granularity", "0.125")

    def make_input(self, tmp_path):
        np.save(tmp_path / "data.npy", np.random.default_rng(0).random((40, 5)))
        return tmp_path / "data.npy"

    def read_arrays(self, path):
        return {"array": np.load(path)}

    def assert_same_structure(self, original, perturbed):
        out = np.load(perturbed)
        assert out.dtype == np.float32 and np.all(out * 8 == np.round(out * 8))


def test_png_tiff_output_keeps_integer_noise_unclipped(cli, tmp_path):
    folder = tmp_path / "photos"
    folder.mkdir()
    Image.fromarray(np.full((8, 8), 250, np.uint8)).save(folder / "a.png")
    result = cli("perturb", folder, "--eps", "1", "--noise", "discrete-laplace", "--seed", "1",
                 "--allow-weak-seed", "--image-format", "tiff", "--out", tmp_path / "out", "--json")
    assert result.exit_code == 0, result.stderr
    pixels = tifffile.imread(tmp_path / "out" / "a.tiff")
    assert pixels.dtype == np.int16 and pixels.max() > 255 and pixels.min() < 0
    manifest = json.loads(result.stdout)
    assert manifest["output_dtype"] == "int16" and manifest["postprocessing"][0].startswith("saturate")


# --------------------------------------------------------------------------- CLI: grid, manifest, errors
def test_granularity_snaps_and_is_recorded(cli, tmp_path):
    data = np.array([[0.1, 0.26, 0.5, 0.99]] * 300)
    np.save(tmp_path / "x.npy", data)
    # A 5-value grid on records of 4 keeps raw values with probability above dp_delta, which needs
    # consent (tests/privacy/test_raw_release.py); this test is about the grid.
    result = cli("perturb", tmp_path / "x.npy", "--eps", "2", "--range", "0:1", "--noise", "discrete-gaussian",
                 "--granularity", "0.25", "--seed", "3", "--allow-weak-seed", "--dtype", "float64", "--json",
                 "--allow-raw-release")
    assert result.exit_code == 0, result.stderr
    m = json.loads(result.stdout)
    assert m["granularity"] == 0.25 and m["grid"]["low"] == 0 and m["grid"]["high"] == 4
    assert m["grid"]["values"] == 5 and m["output_dtype"] == "float64" and m["range_width"] == 1.0
    out = np.load(tmp_path / "x.tldp.npy")
    steps = out / 0.25
    assert np.array_equal(steps, np.round(steps))
    noise = np.round(steps - np.rint(data / 0.25)).astype(np.int64)  # snapped: 0, 1, 2, 4
    assert distributions.chi_square(noise.ravel(), "discrete-gaussian", m["noise_scale"])[1] > ALPHA
    assert m["accounting"]["per_element"]["rho"] == pytest.approx(4**2 / (2 * m["noise_scale"] ** 2))


def test_automatic_granularity_is_a_power_of_two(cli, tmp_path):
    np.save(tmp_path / "x.npy", np.zeros((4, 3), np.float32))
    result = cli("perturb", tmp_path / "x.npy", "--eps", "4", "--range", "-1:1", "--noise", "discrete-laplace",
                 "--json", "--quiet")
    assert result.exit_code == 0, result.stderr
    m = json.loads(result.stdout)
    assert m["granularity"] == 2.0**-11 and m["grid"]["rule"].startswith("automatic")  # 2 / (1024 * 4)
    assert m["grid"]["values"] == 2**12 + 1


def test_integer_run_manifest_and_summary(cli, tmp_path):
    np.save(tmp_path / "x.npy", _uint8((10, 4)))
    result = cli("perturb", tmp_path / "x.npy", "--eps", "1", "--noise", "discrete-laplace", "--json")
    assert result.exit_code == 0, result.stderr
    m = json.loads(result.stdout)
    assert m["noise"] == "discrete-laplace" and m["noise_scale_kind"] == "b" and m["granularity"] is None
    # I = 4: p = e^(1-4) / (2*256 + ...) is not negligible; the exact bound covers it
    b, p = 256.0, 10 ** m["retain_probability_log10"]
    a = math.exp(-1 / b)
    element = 255 / b + math.log1p(p * (1 + a) / ((1 - p) * (1 - a)))
    assert m["accounting"]["per_element"]["epsilon"] == pytest.approx(element, rel=1e-9)
    assert element > 1.04 and m["accounting"]["per_record"]["delta"] == 0
    assert f"each record (eps={4 * element:.4g}, delta=0)" in result.stderr


@pytest.mark.parametrize("args, message", [
    (("--range", "0:1"), None),  # float data needs --range: checked with the next one
    ((), "needs --range"),
    (("--range", "0:1", "--granularity", "0"), "--granularity must be"),
    (("--range", "0:1", "--granularity", "4"), "single grid value"),
    (("--range", "0:1", "--granularity", "1e-9"), "float32 cannot hold"),
])
def test_float_data_errors(cli, tmp_path, args, message):
    np.save(tmp_path / "x.npy", np.full((3, 2), 0.5))
    before = tree_digest(tmp_path)
    result = cli("perturb", tmp_path / "x.npy", "--eps", "1", "--noise", "discrete-laplace", *args)
    if message is None:
        assert result.exit_code == 0, result.stderr
        return
    assert result.exit_code == 2 and message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert tree_digest(tmp_path) == before


@pytest.mark.parametrize("args, message", [
    (("--range", "0:10.5"), "integer --range"),
    (("--granularity", "0.5"), "applies to float data"),
    # continuous noise has no grid (the default exact sampler would draw laplace on the integers)
    (("--noise", "laplace", "--sampler", "float", "--granularity", "0.5"), "applies to the discrete noises"),
    (("--mechanism", "mvg"), "mvg"),
])
def test_integer_data_usage_errors(cli, tmp_path, args, message):
    np.save(tmp_path / "x.npy", np.zeros((3, 2, 2), np.uint8))
    result = cli("perturb", tmp_path / "x.npy", "--eps", "1", "--noise", "discrete-laplace", *args)
    assert result.exit_code == 2 and message in result.stderr, result.stderr
    assert siblings(tmp_path) == {"x.npy"}


def test_integer_value_at_the_open_end_of_the_range_is_refused(cli, tmp_path):
    np.save(tmp_path / "x.npy", np.array([[0, 5], [10, 3]], np.int32))
    before = tree_digest(tmp_path)
    result = cli("perturb", tmp_path / "x.npy", "--eps", "1", "--noise", "discrete-laplace", "--range", "0:10")
    assert result.exit_code == 1 and "x.npy" in result.stderr and "[0, 10)" in result.stderr
    assert tree_digest(tmp_path) == before and siblings(tmp_path) == {"x.npy"}
    clipped = cli("perturb", tmp_path / "x.npy", "--eps", "1", "--noise", "discrete-laplace", "--range", "0:10",
                  "--clip-input", "--seed", "1", "--allow-weak-seed", "--json")
    assert clipped.exit_code == 0, clipped.stderr


def test_an_array_smaller_than_a_stream_unit_draws_only_its_own_noise(monkeypatch):
    """A 28x28 image (one record of its own array) drew the noise of a whole stream unit,
    256 records, and used one: 256 times the sampling work on a folder of small images."""
    drawn = []
    real = discrete.DiscreteLaplace.sample

    def sample(self, rng, size):
        drawn.append(size)
        return real(self, rng, size)

    monkeypatch.setattr(discrete.DiscreteLaplace, "sample", sample)
    calib = cal()
    image = np.random.default_rng(2).integers(0, 256, (1, 784)).astype(np.uint8)
    streams = Streams("secure", 3, allow_weak_seed=True)
    engine.perturb_records(image, 0, "img", calib, streams, dtype=np.int16, array_records=1)
    engine.perturb_records(image, 0, "img", calib, streams, dtype=np.int16)  # no size given: a unit
    assert drawn == [784, 256 * 784]


def test_blocks_of_an_array_smaller_than_a_unit_do_not_change_the_values():
    calib = cal(noise="discrete-gaussian", range_width=16, elements=12)
    data = np.random.default_rng(1).integers(0, 16, (900, 12)).astype(np.int32)  # a unit: 16384 records
    streams = Streams("secure", 8, allow_weak_seed=True)
    whole = engine.perturb_records(data, 0, "a", calib, streams, dtype=np.int16, array_records=900)
    parts = np.concatenate([engine.perturb_records(data[s:s + 123], s, "a", calib, streams, dtype=np.int16,
                                                   array_records=900) for s in range(0, 900, 123)])
    np.testing.assert_array_equal(whole, parts)


@pytest.mark.parametrize("noise", ["discrete-laplace", "discrete-gaussian"])
def test_one_record_arrays_get_noise_of_the_right_distribution(noise):
    """Many one-record arrays (a folder of small images): their noise, pooled, follows the
    pmf, and not that of a 3 % wrong scale (each array's own stream, one unit of one
    record)."""
    calib = cal(noise=noise, elements=784)
    streams = Streams("secure", 4, allow_weak_seed=True)
    zeros = np.zeros((1, 784), np.int32)
    noise_values = np.concatenate([
        engine.perturb_records(zeros, 0, f"img{i}", calib, streams, dtype=np.int64, array_records=1).ravel()
        for i in range(300)])
    assert distributions.chi_square(noise_values, noise, calib.scale)[1] > ALPHA
    assert distributions.chi_square(noise_values, noise, calib.scale * 1.03)[1] < 1e-6
