"""PrivUnit's mathematics (privacy/privunit.py), its certified figure (accounting.py) and
its calibration (mechanisms.py), each against an independent computation: the cap's
share in closed form where it is elementary (k = 2, 3, 4) and by high-precision
quadrature of the marginal density otherwise, the first moment likewise, and the
certified epsilon against the two-valued density ratio written out by hand."""

import math

import mpmath
import pytest

from tldp_cli.errors import UsageError
from tldp_cli.privacy import accounting, mechanisms, privunit
from tldp_cli.privacy.types import PRIVUNIT

GAMMAS = (0.0, 0.05, 0.2, 0.5, 0.8, 0.95)


def mp_density(k):
    """The density of <V, u> for V uniform on S^{k-1}, normalised by quadrature (mpmath)."""
    mpmath.mp.dps = 40
    norm = mpmath.quad(lambda t: (1 - t * t) ** (mpmath.mpf(k - 3) / 2), [-1, 0, 1])
    return lambda t: (1 - t * t) ** (mpmath.mpf(k - 3) / 2) / norm


@pytest.mark.parametrize("gamma", GAMMAS + (-0.3, -0.9))
def test_cap_share_in_closed_form_for_k_2_3_4(gamma):
    # k = 2: t = cos(theta), theta uniform; k = 3: t uniform on [-1, 1] (Archimedes);
    # k = 4: density (2/pi) sqrt(1 - t^2).
    assert privunit.cap_probability(gamma, 2) == pytest.approx(math.acos(gamma) / math.pi, rel=1e-13)
    assert privunit.cap_probability(gamma, 3) == pytest.approx((1 - gamma) / 2, rel=1e-13)
    k4 = (math.acos(gamma) - gamma * math.sqrt(1 - gamma * gamma)) / math.pi
    assert privunit.cap_probability(gamma, 4) == pytest.approx(k4, rel=1e-12)


@pytest.mark.parametrize("k", [5, 16, 64, 200])
def test_cap_share_and_first_moment_against_quadrature(k):
    density = mp_density(k)
    for gamma in GAMMAS:
        q = mpmath.quad(density, [gamma, 1])
        moment = mpmath.quad(lambda t: t * density(t), [gamma, 1])
        assert privunit.cap_probability(gamma, k) == pytest.approx(float(q), rel=1e-11)
        assert privunit.cap_first_moment(gamma, k) == pytest.approx(float(moment), rel=1e-11)


def test_the_incomplete_beta_function_is_within_its_stated_error():
    """BETAINC_ERROR is the relative error the bounds allow scipy (mpmath), at the cap shares
    the calibration uses (2^-11 to 1/2), for every k up to MAX_K: scipy's error grows with k
    (2e-10 at 2^20, more than the 1e-10 once allowed)."""
    from scipy.special import betaincinv

    mpmath.mp.dps = 40
    worst = 0.0
    for k in (2, 7, 50, 400, 3000, 2**17, privunit.MAX_K):
        shares = [2.0**-11, 0.01, 0.1, 0.3, 0.5] if k < 2**17 else [2.0**-11 * 4**i for i in range(6)]
        gammas = {math.sqrt(1 - float(betaincinv((k - 1) / 2, 0.5, 2 * q))) for q in shares}
        if k < 2**17:
            gammas |= {0.01, 0.1, 0.3, 0.6, 0.9, 0.99}
        for gamma in gammas:
            a = mpmath.mpf(k - 1) / 2
            exact = mpmath.betainc(a, 0.5, 0, (1 - gamma) * (1 + gamma), regularized=True) / 2
            if exact > 1e-300:
                worst = max(worst, abs(privunit.cap_probability(gamma, k) / float(exact) - 1))
    assert worst < privunit.BETAINC_ERROR / 4


def test_k_beyond_where_the_figures_are_certified_is_refused():
    """Past MAX_K scipy's incomplete beta function is not measured (it errs by 1e-9 at
    k = 10^7): no split is certified there."""
    k = privunit.MAX_K + 1
    with pytest.raises(UsageError, match="certified for k up to"):
        mechanisms.calibrate_privunit(epsilon=8, record_shape=(1025, 1024), value_range=(0, 1), k=k)
    assert accounting.privunit_epsilon(k, 0.002, 2**52 + 2**50) == math.inf
    assert accounting.privunit_epsilon(privunit.MAX_K, 0.002, 2**52 + 2**50) < math.inf


def nominal_epsilon(k, gamma, p):
    """eps0 + ln((1 - q)/q): the density ratio (p/q) / ((1-p)/(1-q)) of the real mechanism."""
    q = privunit.cap_probability(gamma, k)
    return math.log(p / q) - math.log((1 - p) / (1 - q))


@pytest.mark.parametrize("k,gamma", [(2, 0.3), (16, 0.1), (64, 0.2), (300, 0.15)])
def test_certified_epsilon_is_the_density_ratio_at_the_bounds_of_the_cap_share(k, gamma):
    numerator = 3 * 2**51  # p = 3/4
    p = 0.75
    q_lo, q_hi = privunit.cap_probability_bounds(gamma, k)
    by_hand = math.log(p / q_lo) - math.log((1 - p) / (1 - q_lo))  # q_hi <= 1/2 <= p here
    certified = accounting.privunit_epsilon(k, gamma, numerator)
    assert certified == pytest.approx(by_hand, rel=1e-12)
    assert certified >= by_hand
    nominal = nominal_epsilon(k, gamma, p)
    assert 0 < certified - nominal < 1e-3  # the floating-point margin, small but there


def test_certified_epsilon_at_gamma_0_takes_the_larger_side():
    """gamma = 0: q_hi exceeds 1/2, and the general formula max/min is what holds."""
    k, numerator = 32, 2**52 + 2**48
    p = numerator / 2**53
    q_lo, q_hi = privunit.cap_probability_bounds(0.0, k)
    assert q_lo < 0.5 < q_hi
    top = max(p / q_lo, (1 - p) / (1 - q_hi))
    bottom = min(p / q_hi, (1 - p) / (1 - q_lo))
    assert accounting.privunit_epsilon(k, 0.0, numerator) == pytest.approx(math.log(top / bottom), rel=1e-12)


def test_margin_bounds_cover_the_exact_share_and_stay_close():
    for k in (2, 3, 10, 101, 1000):
        margin = privunit.float_margin(k)
        assert 0 < margin.inner < 1e-5 and 0 < margin.excluded < 1e-5
        for gamma in (0.5 / math.sqrt(k), min(0.9, 2 / math.sqrt(k))):  # shares of about 0.3 and 0.02
            q = privunit.cap_probability(gamma, k)
            lo, hi = privunit.cap_probability_bounds(gamma, k)
            assert lo < q < hi and (hi - lo) / q < 1e-3


@pytest.mark.parametrize("k", [2, 3, 16, 64, 200])
@pytest.mark.parametrize("epsilon", [0.5, 2, 4, 8, 16])
def test_calibration_certifies_at_most_the_request_and_keeps_the_cap_affordable(k, epsilon):
    calib = mechanisms.calibrate_privunit(epsilon=epsilon, record_shape=(k * 2,), value_range=(0, 1), k=k)
    figures = accounting.privunit_figures(calib)
    assert figures.epsilon <= epsilon
    assert calib.element_epsilon == figures.epsilon
    assert figures.epsilon > epsilon - 1e-3  # the budget is spent, not wasted
    assert figures.q >= privunit.MIN_CAP_PROBABILITY * (1 - 1e-9)
    assert calib.privunit.p >= 0.5 and 0 <= calib.privunit.gamma < 1
    assert calib.budget == "record" and calib.mechanism == PRIVUNIT and calib.log_p == -math.inf


@pytest.mark.parametrize("k,epsilon", [(16, 2), (64, 4), (100, 8)])
def test_the_split_maximises_the_expected_alignment(k, epsilon):
    """Any other gamma, with the largest p the budget allows there, aligns less."""
    gamma, numerator = mechanisms.privunit_split(float(epsilon), k)
    best = privunit.expected_alignment(k, gamma, numerator / 2**53)
    for factor in (0.5, 0.8, 0.95, 1.05, 1.25, 1.6):
        other = gamma * factor
        p = mechanisms._largest_p(float(epsilon), k, other)
        if p is not None and privunit.cap_probability(other, k) >= privunit.MIN_CAP_PROBABILITY:
            assert privunit.expected_alignment(k, other, p / 2**53) <= best + 1e-12


def test_alignment_matches_bhowmick_et_al_in_the_hemisphere_case():
    """gamma = 0 (the hemisphere): E<V,u> = (2p - 1) E|t|, E|t| = 2 m(0)."""
    k, p = 10, 0.7
    mean_abs = 2 * float(mpmath.quad(lambda t: t * mp_density(k)(t), [0, 1]))
    assert privunit.expected_alignment(k, 0.0, p) == pytest.approx((2 * p - 1) * mean_abs, rel=1e-12)


def test_default_k_is_a_public_rule_of_eps_and_size():
    # min(I, 128) at every eps (docs/choosing-eps.md, "How the default k was chosen")
    for eps in (0.01, 1, 4, 16, 100):
        assert privunit.default_k(eps, 784) == 128
        assert privunit.default_k(eps, 64) == 64  # scikit-learn's 8x8 digits: every coefficient
        assert privunit.default_k(eps, 28 * 28 * 3 * 100) == 128
    assert privunit.default_k(8, 10) == 10
    assert privunit.DEFAULT_K_RULE == "min(I, 128)"


def test_reference_point_and_output_scale_are_public_rules_of_the_range():
    assert privunit.reference_point(0, 256) == 0
    assert privunit.reference_point(-1, 1) == 0
    assert privunit.reference_point(10, 20) == 10
    assert privunit.reference_point(-20, -10) == -10
    assert privunit.output_scale(0, 256, 784) == 256 * 28 / privunit.OUTPUT_SCALE_DIVISOR


def test_reference_is_a_public_rule_of_the_option_the_shape_and_the_range():
    """--reference: auto is mid-range for colour images (H, W, 3 or 4) and the zero rule for
    every other record; zero, low, mid and a value mean the same for every shape."""
    ref = privunit.reference_point
    assert ref(0, 256, (28, 28), "auto") == ref(0, 256, (28, 28), None) == 0  # a digit: unchanged
    assert ref(0, 256, (107, 160, 3), "auto") == ref(0, 256, (32, 32, 4), "auto") == 128  # colour photos
    for shape in ((64,), (28, 28, 1), (3, 32, 32), (200, 32, 32), (1, 5, 3), (28, 28, 2)):
        assert ref(0, 256, shape, "auto") == 0, shape  # grayscale, channels first, volumes, vectors
    assert ref(10, 20, (28, 28), "auto") == 10 and ref(-20, -10, (64,), "auto") == -10
    assert ref(-1, 3, (107, 160, 3), "auto") == 1
    for shape in ((28, 28), (107, 160, 3), (64,)):
        assert ref(0, 256, shape, "zero") == 0 and ref(-1, 1, shape, "low") == -1
        assert ref(0, 256, shape, "mid") == 128 and ref(0, 256, shape, 37.5) == 37.5
    assert privunit.reference_choice("auto", (107, 160, 3)) == "mid"
    assert privunit.reference_choice(None, (28, 28)) == "zero"
    assert privunit.reference_choice(3.0, (28, 28)) == "value"


@pytest.mark.parametrize("shape", [(28, 28), (24, 36, 3)])
def test_the_reference_changes_no_figure(shape):
    """The reference moves the written records only: k, the split and every certified figure
    are those of the default, whatever --reference says."""
    base = mechanisms.calibrate_privunit(epsilon=4, record_shape=shape, value_range=(0, 256))
    for option in ("auto", "zero", "low", "mid", "200", 12.5):
        calib = mechanisms.calibrate_privunit(epsilon=4, record_shape=shape, value_range=(0, 256),
                                              reference=option)
        a, b = calib.privunit_params(), base.privunit_params()
        assert (a.k, a.gamma, a.p_numerator, a.output_scale) == (b.k, b.gamma, b.p_numerator, b.output_scale)
        assert calib.element_epsilon == base.element_epsilon
        assert accounting.certify(calib).per_record == accounting.certify(base).per_record
    mid = mechanisms.calibrate_privunit(epsilon=4, record_shape=shape, value_range=(0, 256), reference="mid")
    assert mid.privunit_params().reference == 128 and mid.privunit_params().reference_rule == "mid"


@pytest.mark.parametrize("option,fragment", [("bright", "give auto, zero, low, mid or a number"),
                                             ("nan", "a finite number"), ("300", "outside the declared range"),
                                             ("-1", "outside the declared range")])
def test_a_bad_reference_is_refused(option, fragment):
    with pytest.raises(UsageError, match=fragment):
        mechanisms.calibrate_privunit(epsilon=4, record_shape=(28, 28), value_range=(0, 256), reference=option)


def test_write_back_weights_are_a_wiener_filter_of_a_public_spectral_prior():
    """w_j = m^2 P_j / (m^2 P_j + (1 - m^2)/k), P_j proportional to (1 + f_j)^-2, mean square 1:
    the low frequencies weigh more the noisier V is, and an exact direction (m = 1) is
    written unweighted."""
    f = [0.0, 0.5, 0.5, 0.7071, 1.0, 3.0, 10.0]
    k = len(f)
    for m in (0.05, 0.2, 0.6):
        w = privunit.write_back_weights(f, m)
        assert math.fsum(x * x for x in w) / k == pytest.approx(1.0, rel=1e-12)
        assert all(a >= b for a, b in zip(w, w[1:]))  # falls with the frequency
        prior = [(1 + x) ** -2.0 for x in f]
        raw = [m * m * (p / sum(prior)) / (m * m * (p / sum(prior)) + (1 - m * m) / k) for p in prior]
        scale = math.sqrt(math.fsum(x * x for x in raw) / k)
        assert list(w) == pytest.approx([x / scale for x in raw], rel=1e-12)
    assert w[0] / w[-1] < privunit.write_back_weights(f, 0.05)[0] / privunit.write_back_weights(f, 0.05)[-1]
    assert list(privunit.write_back_weights(f, 1.0)) == pytest.approx([1.0] * k, rel=1e-12)


def test_a_calibration_carries_its_write_back_rule():
    calib = mechanisms.calibrate_privunit(epsilon=2, record_shape=(28, 28), value_range=(0, 256))
    params = calib.privunit
    assert params.prior_exponent == privunit.SPECTRAL_PRIOR_EXPONENT == 2
    assert params.alignment == pytest.approx(privunit.expected_alignment(params.k, params.gamma, params.p))
    assert params.alignment < privunit.WEIGHTED_BELOW_ALIGNMENT == 0.1
    # from m = 0.1 up (eps 3 at k = 128) the write-back is unweighted
    for eps in (3, 4, 8, 32):
        assert mechanisms.calibrate_privunit(epsilon=eps, record_shape=(28, 28), value_range=(0, 256)) \
            .privunit.prior_exponent is None
    user = mechanisms.calibrate_privunit(epsilon=2, record_shape=(28, 28), value_range=(0, 256), k=16,
                                         basis="file", basis_sha256="ab" * 32)
    assert user.privunit.prior_exponent is None  # a user's basis has no frequencies: unweighted
    for shape in ((784,), (1, 784), (28, 1)):  # 1-D records: the prior is an image statistic
        assert mechanisms.calibrate_privunit(epsilon=1, record_shape=shape, value_range=(0, 256)).privunit \
            .prior_exponent is None


def test_the_pre_emphasis_is_a_public_rule_of_the_shape_and_leaves_the_figure_alone():
    """d = (1 + f)^a for the DCT basis over two axes of images, whatever the eps and the data;
    none for 1-D records or a user's basis. The record enters only through its direction, so the
    split and the certified figure are those of the same calibration without pre-emphasis."""
    from dataclasses import replace

    assert privunit.EMPHASIS_EXPONENT > 0
    for shape in ((28, 28), (28, 28, 3), (3, 8, 8), (8, 8)):
        assert privunit.emphasis_exponent("dct", shape) == privunit.EMPHASIS_EXPONENT
    for shape in ((784,), (1, 784), (28, 1)):
        assert privunit.emphasis_exponent("dct", shape) is None
    assert privunit.emphasis_exponent("file", (28, 28)) is None
    assert list(privunit.emphasis([0.0, 1.0, 3.0], 0.5)) == pytest.approx([1.0, math.sqrt(2), 2.0], rel=1e-15)
    for eps in (1, 4, 8, 16):
        calib = mechanisms.calibrate_privunit(epsilon=eps, record_shape=(28, 28), value_range=(0, 256))
        assert calib.privunit.emphasis_exponent == privunit.EMPHASIS_EXPONENT
        plain = replace(calib, privunit=replace(calib.privunit, emphasis_exponent=None))
        assert accounting.privunit_record_epsilon(calib) == accounting.privunit_record_epsilon(plain) <= eps


def test_under_pre_emphasis_the_wiener_prior_is_that_of_the_emphasised_direction():
    """w = Wiener(m, P_j proportional to d_j^2 (1 + f_j)^-2) / d_j, mean square 1."""
    f = [0.0, 0.5, 0.5, 0.7071, 1.0, 3.0, 10.0]
    k, a, m = len(f), 0.5, 0.07
    d = [(1 + x) ** a for x in f]
    prior = [dj * dj * (1 + x) ** -2.0 for dj, x in zip(d, f)]
    raw = [m * m * (p / sum(prior)) / (m * m * (p / sum(prior)) + (1 - m * m) / k) / dj for p, dj in zip(prior, d)]
    scale = math.sqrt(math.fsum(x * x for x in raw) / k)
    assert list(privunit.write_back_weights(f, m, emphasis_exponent=a)) == pytest.approx([x / scale for x in raw],
                                                                                         rel=1e-12)
    inverse = [1 / dj for dj in d]
    scale = math.sqrt(math.fsum(x * x for x in inverse) / k)
    assert list(privunit.write_back_weights(f, m, None, a)) == pytest.approx([x / scale for x in inverse], rel=1e-12)


def test_the_spatial_axes_are_the_projections():
    from tldp_cli.sampling import projection

    for shape in ((784,), (28, 28), (1, 784), (28, 28, 3), (28, 28, 1), (3, 28, 28), (2, 5, 7, 9), (9, 9, 4)):
        _, h, w, _ = projection.layout(shape)
        assert privunit.spatial_axes(shape)[-2:] == ((h, w) if len(shape) > 1 else (w,))[-2:]
        assert (privunit.prior_exponent("dct", shape, 0.05) is not None) == (h > 1 and w > 1)
        assert privunit.prior_exponent("dct", shape, 0.1) is None


def test_refusals():
    with pytest.raises(UsageError, match="2 or more elements"):
        mechanisms.calibrate_privunit(epsilon=1, record_shape=(1,), value_range=(0, 1))
    with pytest.raises(UsageError, match="2 <= k <= 4"):
        mechanisms.calibrate_privunit(epsilon=1, record_shape=(2, 2), value_range=(0, 1), k=5)
    with pytest.raises(UsageError, match="record budget|releases each record as a whole"):
        mechanisms.resolve_budget(PRIVUNIT, "element")
    with pytest.raises(UsageError, match="calibrate_privunit"):
        mechanisms.calibrate(mechanism=PRIVUNIT, noise=PRIVUNIT, budget="record", epsilon=1, range_width=1,
                             elements=4)
    with pytest.raises(UsageError, match="cannot certify"):
        mechanisms.calibrate_privunit(epsilon=1e-7, record_shape=(64,), value_range=(0, 1), k=64)
    assert mechanisms.resolve_budget(PRIVUNIT, None) == "record"
    assert mechanisms.resolve_budget("tldp", None) == "element"


def test_scopes_compose_by_addition():
    calib = mechanisms.calibrate_privunit(epsilon=2, record_shape=(8, 8), value_range=(0, 1))
    certified = accounting.certify(calib)
    assert certified.per_element.epsilon == certified.per_record.epsilon <= 2
    assert certified.per_record.delta == 0 and certified.per_record.rho is None
    file = accounting.certify_file([("a", calib, 10)]).per_file
    assert file.epsilon == pytest.approx(10 * certified.per_record.epsilon)
    assert file.delta == 0
    # the zCDP that pure eps implies (eps^2/2 per record) is the tighter (eps, delta) for many records
    small = mechanisms.calibrate_privunit(epsilon=0.5, record_shape=(8, 8), value_range=(0, 1))
    many = accounting.compose([(small, 10_000)])
    rho = 10_000 * small.element_epsilon ** 2 / 2
    assert many.epsilon == pytest.approx(10_000 * small.element_epsilon)
    assert many.approx_epsilon == pytest.approx(rho + 2 * math.sqrt(rho * math.log(1e5)))


@pytest.mark.parametrize("k,epsilon", [(8, 1), (64, 4), (200, 6)])
def test_the_optimal_threshold_is_its_own_alignment(k, epsilon):
    """With p the largest the budget allows, E<V,u> = (e^eps - 1) m(gamma) / (1 + (e^eps - 1) q(gamma));
    setting its derivative to 0 (m' = -gamma f, q' = -f) gives gamma = E<V,u>: the split found
    numerically must be that fixed point (up to the floating-point margin)."""
    gamma, numerator = mechanisms.privunit_split(float(epsilon), k)
    assert privunit.cap_probability(gamma, k) > privunit.MIN_CAP_PROBABILITY  # an interior optimum
    assert privunit.expected_alignment(k, gamma, numerator / 2**53) == pytest.approx(gamma, rel=1e-4)
