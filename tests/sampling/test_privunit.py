"""PrivUnit's sampler (sampling/privunit.py), the bases (sampling/projection.py) and the
engine's privunit path: the distributions the privacy argument assumes (fixed seeds,
tolerances that fail when the code is wrong), the floating-point error the margin bounds,
and what the written bytes may depend on."""

import math

import mpmath
import numpy as np
import pytest
import scipy.fft
from scipy import stats

from tldp_cli.privacy import mechanisms, privunit
from tldp_cli.sampling import engine, projection
from tldp_cli.sampling import privunit as sampler
from tldp_cli.sampling.rng import Streams
from tests.builders import SEED

ALPHA = 1e-6


def rng(seed=0):
    return Streams("secure", seed, allow_weak_seed=True).generator("test", 0)


def marginal_cdf(k):
    """P(<V, u> <= t) for V uniform on S^{k-1}."""
    return np.vectorize(lambda t: 1 - privunit.cap_probability(float(t), k))


def test_polar_gaussians_are_standard_normal():
    first, second = sampler.gaussian_pairs(rng(1), 100_000)
    for values in (first, second):
        assert stats.kstest(values, "norm").pvalue > ALPHA
    assert abs(np.corrcoef(first, second)[0, 1]) < 5 / math.sqrt(100_000)


@pytest.mark.parametrize("k", [2, 7, 32])
def test_candidates_are_uniform_on_the_sphere(k):
    v = sampler.candidates(rng(2), 20_000, k)
    assert np.abs(np.linalg.norm(v, axis=1) - 1).max() <= privunit.gamma_n(k + 4)
    for axis in (0, k - 1):
        assert stats.kstest(v[:, axis], marginal_cdf(k)).pvalue > ALPHA
    # a direction mixing the axes, as the cap test meets it
    d = np.linspace(1, 2, k)
    d /= np.linalg.norm(d)
    assert stats.kstest(v @ d, marginal_cdf(k)).pvalue > ALPHA


@pytest.mark.parametrize("k,epsilon", [(8, 2), (16, 6)])
def test_sample_follows_privunit(k, epsilon):
    """The side is the cap with probability p (binomial), <V,u> follows the marginal
    restricted to each side (KS), and the part of V orthogonal to u is uniform on the
    (k-2)-sphere of u's complement (KS of its projection on a fixed orthogonal direction)."""
    gamma, numerator = mechanisms.privunit_split(float(epsilon), k)
    p, q = numerator / 2**53, privunit.cap_probability(gamma, k)
    u = np.random.default_rng(3).standard_normal(k)
    u /= np.linalg.norm(u)
    draws = 6000
    generator = rng(4)
    v = np.array([sampler.sample(generator, u, gamma, numerator, q) for _ in range(draws)])
    t = v @ u
    in_cap = t >= gamma
    assert stats.binomtest(int(in_cap.sum()), draws, p).pvalue > ALPHA
    cap_cdf = np.vectorize(lambda s: (q - privunit.cap_probability(float(s), k)) / q)
    rest_cdf = np.vectorize(lambda s: (1 - privunit.cap_probability(float(s), k)) / (1 - q))
    assert stats.kstest(t[in_cap], cap_cdf).pvalue > ALPHA
    assert stats.kstest(t[~in_cap], rest_cdf).pvalue > ALPHA
    w = v - t[:, None] * u
    w /= np.linalg.norm(w, axis=1)[:, None]
    e = np.zeros(k)
    e[0] = 1.0
    e -= (e @ u) * u
    e /= np.linalg.norm(e)
    assert stats.kstest(w @ e, marginal_cdf(k - 1)).pvalue > ALPHA
    # and the mean alignment is E<V,u> (privunit.expected_alignment)
    assert abs(t.mean() - privunit.expected_alignment(k, gamma, p)) < 5 * t.std() / math.sqrt(draws)


def test_unit_directions_and_the_zero_record():
    z = np.array([[3.0, 4.0, 0.0], [0.0, 0.0, 0.0], [1e-310, 0.0, -1e-310], [1e300, 1e300, 0.0]])
    u = sampler.unit_directions(z)
    assert np.allclose(u[0], [0.6, 0.8, 0.0])
    assert u[1].tolist() == [1.0, 0.0, 0.0]  # the fixed public vector e_1
    assert np.allclose(u[2], [2**-0.5, 0.0, -(2**-0.5)])  # subnormal input: no underflow
    assert np.allclose(u[3], [2**-0.5, 2**-0.5, 0.0])  # no overflow
    assert np.abs(np.linalg.norm(u, axis=1) - 1).max() <= privunit.gamma_n(7)


def test_log_errs_far_less_than_the_margin_assumes():
    """LIBM_ERROR is what the margin allows NumPy's log; measured against mpmath on the
    values the polar method meets: s near 1, small s, and s spread over (0, 1)."""
    mpmath.mp.dps = 40
    near_one = 1 - np.arange(1, 2000) * 2.0**-52
    small = 2.0 ** -np.linspace(1, 40, 500)
    spread = np.random.default_rng(5).random(3000)
    s = np.concatenate([near_one, small, spread])
    computed = np.log(s)
    worst = max(abs(float(c) / float(mpmath.log(mpmath.mpf(float(x)))) - 1) for c, x in zip(computed, s))
    assert worst < privunit.LIBM_ERROR / 100


class Recording:
    """A generator that hands out the uniforms of a real one and keeps them."""

    def __init__(self, generator):
        self.generator, self.drawn = generator, []

    def random(self, size=None):
        values = self.generator.random(size)
        self.drawn.append(np.array(values))
        return values


@pytest.mark.parametrize("k", [5, 12])
def test_the_computed_cap_test_is_within_the_margin_of_the_exact_one(k):
    """The coupling float_margin bounds, checked on draws: the exact uniforms U* = U + W 2^-53
    (W uniform), the exact polar method and normalisation in 40 digits, against the float
    candidate and its float inner product with a float unit vector u."""
    mpmath.mp.dps = 40
    recording = Recording(rng(6))
    count = 60
    v = sampler.candidates(recording, count, k)
    u = sampler.unit_directions(np.random.default_rng(7).standard_normal((1, k)))[0]
    offsets = np.random.default_rng(8)
    exact_pairs = []
    for drawn in recording.drawn:  # each round: (2, n) uniforms, pairs in column order
        for a, b in drawn.T:
            v1 = 2 * (mpmath.mpf(float(a)) + mpmath.mpf(float(offsets.random())) * mpmath.mpf(2) ** -53) - 1
            v2 = 2 * (mpmath.mpf(float(b)) + mpmath.mpf(float(offsets.random())) * mpmath.mpf(2) ** -53) - 1
            s = v1 * v1 + v2 * v2
            if 0 < s < 1 and len(exact_pairs) < count * ((k + 1) // 2):
                factor = mpmath.sqrt(-2 * mpmath.log(s) / s)
                exact_pairs.append((v1 * factor, v2 * factor))
    margin = privunit.float_margin(k)
    norm_u = mpmath.sqrt(sum(mpmath.mpf(float(x)) ** 2 for x in u))
    pairs = (k + 1) // 2
    for j in range(count):
        g = [x for pair in exact_pairs[j * pairs:(j + 1) * pairs] for x in pair][:k]
        norm = mpmath.sqrt(sum(x * x for x in g))
        exact = sum(x / norm * mpmath.mpf(float(c)) for x, c in zip(g, u)) / norm_u
        assert abs(float(sampler.row_inner_products(v[j:j + 1], u)[0]) - float(exact)) <= margin.inner


def test_dct_basis_matches_scipy_and_is_orthonormal():
    x = np.random.default_rng(9).random((3, 12, 10))
    basis = projection.DctBasis((12, 10), 20)
    full = scipy.fft.dctn(x, axes=(1, 2), norm="ortho")
    _, i, j = basis.index
    assert np.allclose(basis.project(x), full[:, i, j])
    assert (i[0], j[0]) == (0, 0)
    eye = np.eye(20)
    assert np.abs(basis.project(basis.synthesize(eye)) - eye).max() < 1e-12
    assert np.allclose(basis.synthesize(basis.project(x))[0], scipy.fft.idctn(
        np.where(np.isin(np.arange(120).reshape(12, 10), i * 10 + j), full[0], 0), norm="ortho"))


def test_dct_basis_orders_by_frequency_then_channel():
    basis = projection.DctBasis((28, 28), 3)
    assert [(int(i), int(j)) for _, i, j in zip(*basis.index)] == [(0, 0), (0, 1), (1, 0)]
    colour = projection.DctBasis((6, 8, 3), 7)  # an RGB image, channels last
    channel, i, j = colour.index
    assert channel.tolist() == [0, 1, 2, 0, 1, 2, 0] and (i[3], j[3]) == (0, 1)
    x = np.random.default_rng(10).random((2, 6, 8, 3))
    full = scipy.fft.dctn(x, axes=(1, 2), norm="ortho")
    assert np.allclose(colour.project(x), full[:, i, j, channel])
    line = projection.DctBasis((50,), 5)
    y = np.random.default_rng(11).random((2, 50))
    assert np.allclose(line.project(y), scipy.fft.dct(y, axis=1, norm="ortho")[:, :5])
    assert projection.layout((4, 5, 6)) == (4, 5, 6, False)  # leading axes are channels


def test_matrix_basis():
    q, _ = np.linalg.qr(np.random.default_rng(12).standard_normal((16, 16)))
    basis = projection.MatrixBasis(q[:5], (4, 4), "ab" * 32)
    x = np.random.default_rng(13).random((3, 4, 4))
    assert np.allclose(basis.project(x), x.reshape(3, 16) @ q[:5].T)
    assert np.allclose(basis.synthesize(basis.project(x)).reshape(3, 16), x.reshape(3, 16) @ q[:5].T @ q[:5])
    assert projection.orthonormality_error(q[:5]) < 1e-12


def calibration(epsilon=4, shape=(28, 28), value_range=(0, 256), k=None):
    return mechanisms.calibrate_privunit(epsilon=epsilon, record_shape=shape, value_range=value_range, k=k)


def test_the_written_record_depends_on_its_direction_only(digits):
    """The write-back uses V alone: a record and twice it (the same direction, exactly, in
    float) give the same bytes under one seed and index; the norm is never released."""
    calib = calibration()
    x = digits[:20].astype(np.float64)
    streams = Streams("secure", SEED)
    once = engine.perturb_records(x, 0, "a", calib, streams)
    twice = engine.perturb_records(2 * x, 0, "a", calib, streams)
    assert once.tobytes() == twice.tobytes()
    other = engine.perturb_records(x[::-1].copy(), 0, "a", calib, streams)
    assert once.tobytes() != other.tobytes()


def test_seeded_output_does_not_depend_on_the_blocking(digits):
    calib = calibration(k=16)
    streams = Streams("secure", SEED)
    whole = engine.perturb_records(digits[:30], 0, "a", calib, streams)
    parts = np.concatenate([engine.perturb_records(digits[s:e], s, "a", calib, streams)
                            for s, e in ((0, 7), (7, 8), (8, 30))])
    assert whole.tobytes() == parts.tobytes()
    fresh = engine.perturb_records(digits[:30], 0, "a", calib, Streams("secure"))
    assert fresh.tobytes() != whole.tobytes()


def test_written_values_lie_in_the_range_in_the_output_dtype(digits):
    calib = calibration(value_range=(0, 256))
    out = engine.perturb_records(digits[:10], 0, "a", calib, Streams("secure"), dtype=np.float64)
    assert out.dtype == np.float64 and out.shape == (10, 28, 28)
    assert out.min() >= 0 and out.max() <= 256
    # the reference point and c: reference + c B^T V, before clipping, has norm c about it
    basis = engine.privunit_basis(calib)
    v = engine.sample_directions(engine.record_directions(digits[:10], calib, basis), 0, "a", calib,
                                 Streams("secure", SEED))
    raw = basis.synthesize(calib.privunit.output_scale * v)
    assert np.allclose(np.linalg.norm(raw.reshape(10, -1), axis=1), calib.privunit.output_scale)


def test_the_write_back_weighs_the_released_coefficients_by_the_public_rule(digits):
    """What is written is reference + c B^T (w * V), w the Wiener weights of the public
    spectral prior (privacy/privunit.write_back_weights of the basis's frequencies and
    E<V, u>): clip(reference + c B^T (w * V)) exactly, and on the records that clipping left
    alone, projecting the output back on the basis gives c w V, with the high frequencies
    damped (the unweighted write-back, c V, failed this)."""
    calib = calibration(epsilon=2, value_range=(-1e6, 1e6))
    params = calib.privunit
    basis = engine.privunit_basis(calib)
    streams = Streams("secure", SEED)
    out = engine.perturb_records(digits[:20], 0, "a", calib, streams, dtype=np.float64)
    v = engine.sample_directions(engine.record_directions(digits[:20], calib, basis), 0, "a", calib, streams)
    w = privunit.write_back_weights(np.hypot(basis.index[1], basis.index[2]) / 2, params.alignment,
                                    emphasis_exponent=privunit.EMPHASIS_EXPONENT)
    expected = np.clip(basis.synthesize((params.output_scale * w) * v) + params.reference, -1e6, 1e6)
    assert np.array_equal(out, expected)
    whole = np.flatnonzero((np.abs(out) < 1e6).reshape(20, -1).all(axis=1))  # records not clipped
    assert len(whole) >= 3
    assert np.allclose(basis.project(out[whole]) / params.output_scale, (w * v)[whole], rtol=0, atol=1e-9)
    assert w[0] > 2 and w[-1] < 0.5 and np.mean(w * w) == pytest.approx(1)
    # a function of V and public values only: the same V written by write_back gives the same bytes
    assert engine.write_back(v, calib, basis, np.float64).tobytes() == out.tobytes()


def test_the_weighted_write_back_points_closer_to_the_record(digits):
    """The write-back's Wiener weights denoise the direction: over 200 digits at eps 2 (a
    range wide enough that almost nothing is clipped) the written records' coefficients, with
    the public pre-emphasis d applied as to the raw records (record_directions), have a mean
    cosine with the raw records' directions u above E<V, u> (the unweighted V's; 0.08 against
    m = 0.070; 0.133 before the pre-emphasis, whose prior d^2 (1 + f)^-2 is flatter), and
    dividing the weights out (what tldp evaluate's privunit_alignment does) gives E<V, u> back."""
    calib = calibration(epsilon=2, value_range=(-3e4, 3e4))
    basis = engine.privunit_basis(calib)
    out = engine.perturb_records(digits[:200], 0, "a", calib, Streams("secure", SEED), dtype=np.float64)
    raw = engine.record_directions(digits[:200], calib, basis)
    weights = engine.write_back_weights(calib, basis)
    m = calib.privunit.alignment
    unweighted = np.einsum("ij,ij->i", engine.record_directions(out, calib, basis, 1 / weights), raw)
    weighted = np.einsum("ij,ij->i", engine.record_directions(out, calib, basis), raw)
    assert abs(unweighted.mean() - m) < 0.02
    assert (weighted - unweighted).mean() > 0.01


def test_from_the_threshold_alignment_up_the_write_back_only_undoes_the_pre_emphasis(digits):
    """At eps 4 (m = 0.134 at k = 128, above privunit.WEIGHTED_BELOW_ALIGNMENT) the written
    record is reference + c B^T (V / d), clipped, 1/d scaled to a mean square of 1: no Wiener
    filter, only the public pre-emphasis divided out."""
    calib = calibration(epsilon=4)
    assert calib.privunit.alignment > privunit.WEIGHTED_BELOW_ALIGNMENT
    assert calib.privunit.prior_exponent is None
    basis = engine.privunit_basis(calib)
    streams = Streams("secure", SEED)
    out = engine.perturb_records(digits[:5], 0, "a", calib, streams, dtype=np.float64)
    v = engine.sample_directions(engine.record_directions(digits[:5], calib, basis), 0, "a", calib, streams)
    d = (1 + basis.frequencies()) ** privunit.EMPHASIS_EXPONENT
    w = engine.write_back_weights(calib, basis)
    assert np.allclose(w, (1 / d) / np.sqrt(np.mean(d**-2.0)), rtol=1e-12, atol=0)
    assert np.array_equal(out, np.clip(basis.synthesize((calib.privunit.output_scale * w) * v), 0, 256))


def test_the_direction_released_is_that_of_the_pre_emphasised_coefficients(digits):
    """u = d z / |d z|, d_j = (1 + f_j)^a a public weight per coefficient (f_j its frequency,
    a = privunit.EMPHASIS_EXPONENT), for an image record; the write-back divides d out again,
    so the mean of many releases of one record points along the record's own coefficients z
    (cosine about 0.995 over 2000 releases at eps 8), not along d z (about 0.96: a digit's
    coefficients are mostly low frequencies, where d is near 1). A 1-D record and a user's
    basis get no pre-emphasis."""
    calib = calibration(epsilon=8, value_range=(-1e6, 1e6))
    basis = engine.privunit_basis(calib)
    z = basis.project(digits[:3].astype(np.float64))
    d = (1 + basis.frequencies()) ** privunit.EMPHASIS_EXPONENT
    u = engine.record_directions(digits[:3], calib, basis)
    assert np.allclose(u, (d * z) / np.linalg.norm(d * z, axis=1, keepdims=True), rtol=0, atol=1e-12)
    out = engine.perturb_records(np.repeat(digits[:1], 2000, axis=0), 0, "a", calib, Streams("secure", SEED),
                                 dtype=np.float64)
    mean = basis.project(out).mean(axis=0)

    def cosine(a, b):
        return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))

    assert cosine(mean, z[0]) > 0.985
    assert cosine(mean, d * z[0]) < 0.975
    flat = mechanisms.calibrate_privunit(epsilon=8, record_shape=(784,), value_range=(0, 256))
    assert flat.privunit.emphasis_exponent is None
    assert engine.emphasis_weights(flat, engine.privunit_basis(flat)) is None
    user = mechanisms.calibrate_privunit(epsilon=8, record_shape=(28, 28), value_range=(0, 256), k=16,
                                         basis="file", basis_sha256="ab" * 32)
    assert user.privunit.emphasis_exponent is None


def test_a_user_basis_is_written_back_unweighted(digits):
    q, _ = np.linalg.qr(np.random.default_rng(3).standard_normal((784, 784)))
    basis = projection.MatrixBasis(q[:16], (28, 28), "cd" * 32)
    calib = mechanisms.calibrate_privunit(epsilon=4, record_shape=(28, 28), value_range=(-1e6, 1e6), k=16,
                                          basis="file", basis_sha256="cd" * 32)
    streams = Streams("secure", SEED)
    out = engine.perturb_records(digits[:5], 0, "a", calib, streams, basis=basis, dtype=np.float64)
    v = engine.sample_directions(engine.record_directions(digits[:5], calib, basis), 0, "a", calib, streams)
    assert np.allclose(basis.project(out) / calib.privunit.output_scale, v, rtol=0, atol=1e-9)


def test_a_user_basis_must_match_the_calibration():
    calib = calibration(k=4)
    q, _ = np.linalg.qr(np.random.default_rng(14).standard_normal((784, 784)))
    with pytest.raises(ValueError):
        engine.privunit_basis(calib, projection.MatrixBasis(q[:4], (28, 28), "ab" * 32))


def test_utility_smoke_on_scikit_learns_digits():
    """An honest check of what the release keeps: on scikit-learn's 8x8 digits, the mean
    cosine between each released direction V and the record's true direction u matches
    the mechanism's E<V,u>, and a release says more about its own record than about
    another's: against a shuffled pairing the mean falls to E<V,u> times the mean cosine
    of two records' directions (E[V] = E<V,u> u)."""
    sklearn = pytest.importorskip("sklearn.datasets")
    x = sklearn.load_digits().images  # (1797, 8, 8), values 0..16
    calib = mechanisms.calibrate_privunit(epsilon=4, record_shape=(8, 8), value_range=(0, 17), k=16)
    basis = engine.privunit_basis(calib)
    u = engine.record_directions(x, calib, basis)
    v = engine.sample_directions(u, 0, "digits", calib, Streams("secure", SEED))
    cosines = np.einsum("ij,ij->i", u, v)
    expected = privunit.expected_alignment(16, calib.privunit.gamma, calib.privunit.p)
    assert abs(cosines.mean() - expected) < 5 * cosines.std() / math.sqrt(len(x))
    order = np.random.default_rng(15).permutation(len(x))
    shuffled = np.einsum("ij,ij->i", u, v[order])
    between = np.einsum("ij,ij->i", u, u[order]).mean()
    assert abs(shuffled.mean() - expected * between) < 5 * shuffled.std() / math.sqrt(len(x))
    assert cosines.mean() - shuffled.mean() > 0.5 * expected * (1 - between)


@pytest.mark.parametrize("k", [16, 64, 784])
def test_the_cap_test_of_a_candidate_does_not_depend_on_its_place_in_the_batch(k, monkeypatch):
    """The argument of docs/guarantee.md needs the cap test to be a function of the candidate
    and u alone (an accepted set C_f(u)): a BLAS product gives the same row different
    roundings at different places in the batch, which made a candidate at the threshold
    accepted in one place and refused in another. For a candidate y alone, the largest
    threshold at which the sampler accepts it is found by bisection; put at any place of a
    batch (the others far off the cap), y must be accepted at that threshold and refused
    at the next float."""
    generator = np.random.default_rng(15)
    u = generator.standard_normal(k)
    u /= np.linalg.norm(u)
    size = 23

    def accepts(batch, gamma):
        served = iter([batch, u[None, :]])  # then one deep in the cap, to end the search
        monkeypatch.setattr(sampler, "candidates", lambda rng, count, dims: next(served))
        released = sampler.sample(rng(16), u, gamma, 2**53 - 1, 0.5)  # the cap side but for 2^-53
        return released.tobytes() != u.tobytes()

    for _ in range(3):
        y = generator.standard_normal(k)
        y /= np.linalg.norm(y)
        lo, hi = float(y @ u) - 1e-9, float(y @ u) + 1e-9
        assert accepts(y[None, :], lo) and not accepts(y[None, :], hi)
        while lo < (mid := lo + (hi - lo) / 2) < hi:
            lo, hi = (mid, hi) if accepts(y[None, :], mid) else (lo, mid)
        assert hi == math.nextafter(lo, math.inf)
        for j in range(size):
            batch = np.tile(-u, (size, 1))
            batch[j] = y
            assert accepts(batch, lo) and not accepts(batch, hi), j
