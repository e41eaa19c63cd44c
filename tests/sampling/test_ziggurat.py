"""The vectorised Gaussian ziggurat (tldp_cli/sampling/ziggurat.py): its tables, its distribution
against the normal (KS, chi-square per layer region, tail mass, symmetry), each test also
rejecting a wrong sampler, and the contract the engine relies on (float32, never 0.0,
bit-for-bit reproducible, the draws it consumes)."""

from fractions import Fraction

import numpy as np
import pytest
from randomgen import AESCounter
from scipy import special, stats

from tldp_cli.sampling import ziggurat
from tldp_cli.sampling.ziggurat import LAYERS, K, R, V, X

ALPHA = 1e-3  # a correct sampler fails a test with about this probability
N = 1 << 22
TAIL = 2 * stats.norm.sf(R)  # P(|z| > r)


def aes(key: int) -> np.random.Generator:
    return np.random.Generator(AESCounter(key=key, counter=0))


def pcg(seed: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(seed))


@pytest.fixture(scope="module")
def unit():
    return ziggurat.standard_normal(aes(1), N)


def f(x):
    return np.exp(-0.5 * x * x)


# --------------------------------------------------------------------------- tables
def test_every_layer_has_area_v_and_the_ziggurat_closes_at_the_top():
    assert X[1] == R and X[LAYERS] == 0.0 and np.all(np.diff(X) < 0)
    areas = X[1:LAYERS] * (f(X[2:LAYERS + 1]) - f(X[1:LAYERS]))  # layers 1..255, the top one ends at f(0) = 1
    np.testing.assert_allclose(areas[:-1], V, rtol=1e-12)  # set by the recursion
    np.testing.assert_allclose(areas[-1], V, rtol=1e-8)  # the recursion's end: how well r and v match
    base = R * f(R) + np.sqrt(np.pi / 2) * special.erfc(R / np.sqrt(2))  # box [0, r] x [0, f(r)] + tail
    np.testing.assert_allclose(base, V, rtol=1e-11)
    assert X[0] * f(R) == pytest.approx(V, rel=1e-15)


def test_fast_path_bounds_are_conservative_and_tight():
    # rabs < K[k] accepts x = rabs x_k / 2^23: it must lie below x_{k+1} (under the curve),
    # and K[k] + 1 would not.
    for k in range(LAYERS):
        xk, xnext = Fraction(X[k]), Fraction(X[k + 1]) * 2**23
        assert (int(K[k]) - 1) * xk < xnext or K[k] == 0
        assert (int(K[k]) + 1) * xk > xnext


def test_tables_agree_with_numpys_float32_ziggurat():
    # numpy/random/src/distributions/ziggurat_constants.h numbers the layers the other way
    # round (its index i >= 1 is layer 256 - i here): wi_float[0], [1], [255]; fi_float[1].
    np.testing.assert_allclose(X[[0, 255, 1]] / 2**23,
                               [4.66198677960027669255e-07, 2.56588335019207033255e-08,
                                4.35608969373823260746e-07], rtol=1e-9)  # computed another way
    assert f(X[255]) == pytest.approx(9.77101701267671596263e-01, rel=1e-7)
    # ki_float[0] and ki_float[255] exactly; NumPy rounds some others up by one unit in 2^23
    assert (K[0], K[1]) == (0x007799EC, 0x0078D2D2)
    assert K[254] == 0x006045F5 - 1


# --------------------------------------------------------------------------- distribution
def test_ks_against_the_normal_and_rejects_a_wrong_scale(unit):
    assert unit.dtype == np.float32 and unit.shape == (N,)
    assert stats.kstest(unit, "norm").pvalue > ALPHA
    scaled = ziggurat.standard_normal(aes(2), N, 37.5)
    assert stats.kstest(scaled, "norm", args=(0, 37.5)).pvalue > ALPHA
    wrong = ziggurat.standard_normal(aes(3), N, 37.5 * 1.01)
    assert stats.kstest(wrong, "norm", args=(0, 37.5)).pvalue < 1e-6


def layer_counts(sample: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Observed and expected counts in the 512 layer regions: (-inf, -r), [-x_k, -x_{k+1}),
    ..., [x_{k+1}, x_k), ..., [r, inf)."""
    edges = np.concatenate([-X[1:LAYERS + 1], X[LAYERS - 1:0:-1]])
    observed = np.bincount(np.searchsorted(edges, sample, side="right"), minlength=edges.size + 1)
    cdf = np.concatenate([[0.0], stats.norm.cdf(edges), [1.0]])
    return observed, np.diff(cdf) * sample.size


def test_chi_square_per_layer_region_including_the_tails(unit):
    observed, expected = layer_counts(unit)
    assert expected.min() > 400
    assert stats.chisquare(observed, expected).pvalue > ALPHA
    assert stats.chisquare(*layer_counts(unit * np.float32(1.01))).pvalue < 1e-6


def test_chi_square_rejects_a_sampler_that_skips_the_wedge_test(monkeypatch):
    monkeypatch.setattr(ziggurat, "_f", lambda x: np.full_like(x, 2.0))  # every wedge point accepted
    assert stats.chisquare(*layer_counts(ziggurat.standard_normal(aes(4), N))).pvalue < 1e-6


def tail_count(gen: np.random.Generator, n: int) -> tuple[int, int]:
    """(|z| > r, z < -r) over n draws, in pieces."""
    beyond = negative = 0
    for _ in range(n >> 21):
        z = ziggurat.standard_normal(gen, 1 << 21)
        beyond += int(np.count_nonzero(np.abs(z) > R))
        negative += int(np.count_nonzero(z < -R))
    return beyond, negative


def test_tail_mass_and_symmetry(unit):
    n = 1 << 25
    beyond, negative = tail_count(aes(5), n)
    assert stats.binomtest(beyond, n, TAIL).pvalue > ALPHA
    assert stats.binomtest(negative, beyond, 0.5).pvalue > ALPHA
    assert stats.binomtest(int(np.count_nonzero(unit < 0)), N, 0.5).pvalue > ALPHA


def restart_on_tail_rejection(gen, size):
    """A wrong tail: one round of Marsaglia's method, a rejection restarting the whole
    ziggurat (returned as the offset |z| - r of a fresh draw z, which gets the candidate's
    sign: the same in distribution)."""
    u = gen.random(2 * size)
    a = -np.log1p(-u[:size]) / R
    ok = -2.0 * np.log1p(-u[size:]) > a * a
    fresh = np.abs(ziggurat.standard_normal(gen, size)).astype(float) - R
    return np.where(ok, a, fresh)


def test_tail_mass_rejects_a_dropped_tail_and_a_restarted_tail(monkeypatch):
    n = 1 << 26  # the restarted tail is expected 8 standard deviations short
    with monkeypatch.context() as m:
        m.setattr(ziggurat, "_tail", lambda gen, size: np.zeros(size))  # tail candidates land on r
        beyond, _ = tail_count(aes(6), 1 << 21)
        assert beyond == 0
    # Restarting the ziggurat when the tail's own test rejects (instead of repeating the
    # tail) loses the 6% of the tail that its rejection rate stands for.
    monkeypatch.setattr(ziggurat, "_tail", restart_on_tail_rejection)
    beyond, _ = tail_count(aes(7), n)
    assert stats.binomtest(beyond, n, TAIL).pvalue < 1e-4


def test_tail_sampler_follows_the_normal_beyond_r():
    a = ziggurat._tail(aes(8), 200_000)
    assert a.min() >= 0

    def cdf(t, r=R):
        return 1 - stats.norm.sf(r + t) / stats.norm.sf(r)

    assert stats.kstest(a, cdf).pvalue > ALPHA
    assert stats.kstest(a, lambda t: cdf(t, R * 1.02)).pvalue < 1e-6


def test_pcg64_generators_give_the_same_distribution():
    sample = ziggurat.standard_normal(pcg(9), 1 << 20, 2.5)
    assert sample.dtype == np.float32
    assert stats.kstest(sample, "norm", args=(0, 2.5)).pvalue > ALPHA
    assert stats.chisquare(*layer_counts(sample / np.float32(2.5))).pvalue > ALPHA


# --------------------------------------------------------------------------- contract
def test_never_zero_even_when_a_candidate_is_zero():
    assert np.all(ziggurat.standard_normal(aes(10), 1 << 20, 1e-3) != 0)
    # A uint32 candidate with rabs == 0 would give exactly 0.0 on NumPy's fast path: find
    # one in a PCG64 stream and start the generator right before it.
    words = pcg(11).bit_generator.random_raw(1 << 24).view(np.uint32)
    zeros = np.flatnonzero(words >> 9 == 0)
    assert zeros.size
    for at in zeros[:4]:
        gen = pcg(11)
        gen.bit_generator.advance(int(at) // 2)
        z = ziggurat.standard_normal(gen, 2)
        assert z[at % 2] != 0 and np.isfinite(z).all()


def test_same_key_same_bits_different_key_different_bits():
    a = ziggurat.standard_normal(aes(12), 100_001, 3.0)
    b = ziggurat.standard_normal(aes(12), 100_001, 3.0)
    c = ziggurat.standard_normal(aes(13), 100_001, 3.0)
    assert np.array_equal(a.view(np.uint32), b.view(np.uint32))
    assert np.mean(a != c) > 0.99
    p, q = pcg(12), pcg(12)
    assert np.array_equal(ziggurat.standard_normal(p, 1001), ziggurat.standard_normal(q, 1001))
    assert p.bit_generator.state == q.bit_generator.state


@pytest.mark.parametrize("size, scale", [(100_003, 0.7), (1 << 19, 181.0), (7, 1.0)])
def test_output_does_not_depend_on_the_chunk_size(monkeypatch, size, scale):
    expected = ziggurat.standard_normal(aes(14), size, scale)
    for chunk in (4096, 1 << 15):
        monkeypatch.setattr(ziggurat, "CHUNK", chunk)
        assert np.array_equal(ziggurat.standard_normal(aes(14), size, scale).view(np.uint32),
                              expected.view(np.uint32))


def test_the_scale_is_one_rounding_away_from_scaling_the_unit_draws():
    unit = ziggurat.standard_normal(aes(15), 100_000).astype(np.float64)
    scaled = ziggurat.standard_normal(aes(15), 100_000, 37.5).astype(np.float64)
    np.testing.assert_allclose(scaled, unit * 37.5, rtol=2.0**-21, atol=0)


def test_draws_consumed_sizes_zero_and_one():
    empty = ziggurat.standard_normal(aes(16), 0)
    assert empty.dtype == np.float32 and empty.shape == (0,)
    one = ziggurat.standard_normal(aes(16), 1)
    assert one.dtype == np.float32 and one.shape == (1,) and one[0] != 0
    # Without a slow-path candidate a call reads exactly ceil(size / 2) 64-bit words.
    for size in (1, 5, 6):
        seed = next(s for s in range(100) if _all_fast(pcg(s), size))
        gen, reference = pcg(seed), pcg(seed)
        ziggurat.standard_normal(gen, size)
        reference.bit_generator.random_raw((size + 1) // 2)
        assert gen.bit_generator.state == reference.bit_generator.state


def _all_fast(gen, size):
    words = gen.bit_generator.random_raw((size + 1) // 2).view(np.uint32)[:size]
    rabs = words >> 9
    return bool(np.all((rabs > 0) & (rabs < K[words & 0xFF])))


@pytest.mark.parametrize("scale", [0.0, -1.0, float("nan"), float("inf"), 1e38, 1e-45])
def test_rejects_a_scale_float32_cannot_carry(scale):
    with pytest.raises(ValueError, match="scale"):
        ziggurat.standard_normal(aes(17), 10, scale)


def test_rejects_a_negative_size():
    with pytest.raises(ValueError, match="size"):
        ziggurat.standard_normal(aes(17), -1)
