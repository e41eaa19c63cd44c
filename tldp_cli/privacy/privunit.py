"""PrivUnit on the unit sphere: the mathematics, with no randomness and no I/O.

PrivUnit2 (Bhowmick, Duchi, Freudiger, Kapoor and Rogers, "Protection Against
Reconstruction and Its Applications in Private Federated Learning", 2018, Algorithm 1):
a unit vector u in R^k is released as a unit vector V drawn, with probability p, uniformly
from the cap {v : <v, u> >= gamma} and otherwise uniformly from its complement. Its
output density (against the uniform measure of the sphere) takes two values, p/q on the
cap and (1 - p)/(1 - q) off it, where q is the cap's share of the sphere; the release is
pure eps-LDP with eps = ln(p/(1-p)) + ln((1-q)/q) (docs/guarantee.md, "PrivUnit").
Asi, Feldman and Talwar ("Optimal Algorithms for Mean Estimation under Local Differential
Privacy", ICML 2022) show it optimal for mean estimation and give the same
parametrisation; `tldp` chooses (p, gamma) by maximising E<V, u> (`expected_alignment`)
numerically (privacy/mechanisms.py), against the certified figure of accounting.py.

Here: the law of t = <V, u> for V uniform on S^{k-1} (its density, the cap's share q,
the cap's first moment), the expected alignment, the bound on the floating-point error of
the sampler's cap test (`float_margin`, the argument is in docs/guarantee.md), and the
public rules of the mechanism (the default dimension k, the pre-emphasis, the reference
point, the output scale, the write-back's weights), which depend on the options and the
record's shape only, never on the data.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Float64's unit roundoff.
UNIT_ROUNDOFF = 2.0**-53
# The sampler draws uniform candidates until one falls on the chosen side of the cap, so
# a cap of share q costs about 1/q candidates (k Gaussian values each). The calibration
# never chooses a cap smaller than this share: at most about 1000 candidates per record.
# It binds from about eps 10 at k = 128 (E<V, u> stays at 0.293), which is why eps 16 and 32
# give eps 10's utility: on cross-validation of the 2000 MNIST training digits a floor of
# 2^-20 (a million candidates per record with this sampler) would raise F1 at eps 16 from
# 0.957 to 0.969 (docs/choosing-eps.md, "Issue 28's gap").
MIN_CAP_PROBABILITY = 2.0**-10
# Candidates are Gaussians from Marsaglia's polar method on 53-bit uniforms. The error
# analysis (float_margin) excludes the accepted pairs whose exact s = v1^2 + v2^2 lies
# below 2^-SMALL_S_BITS or above 1 - 2^(LARGE_S_BITS - 52), the pairs on which the float
# and the exact acceptance tests disagree, and (odd k) the draws whose exact Gaussian
# vector has a squared norm below its 2^-NORM_BITS quantile; their probability is charged
# to the cap's share.
SMALL_S_BITS = 30
LARGE_S_BITS = 23
NORM_BITS = 40
# The libm function the sampler relies on (log) is taken to err by less than this
# relative amount (NumPy's errs by a few units in 2^-53; tests/sampling/test_privunit.py checks).
LIBM_ERROR = 2.0**-44
# scipy's regularised incomplete beta function (the cap's share) is taken to err by less
# than this relative amount. Its error grows with k: about 1e-13 at k = 3000, 2e-11 at
# 2^17, 2e-10 at 2^20 and 1e-9 at 10^7 (the tests check it against mpmath up to MAX_K).
BETAINC_ERROR = 1e-9
# The largest k the figures are certified for: where the stated error of the incomplete
# beta function is measured. (Each candidate costs k Gaussians, and the excluded
# probability of float_margin grows with k: 1.5e-3 at 2^20, more than the smallest cap.)
MAX_K = 2**20


# --------------------------------------------------------------------------- the law of <V, u>

def _log_beta_half(k: int) -> float:
    """ln B(1/2, (k-1)/2), the normaliser of the density of t = <V, u> for V uniform on
    S^{k-1} (k >= 2), which is proportional to (1 - t^2)^((k-3)/2) on (-1, 1)."""
    a = (k - 1) / 2
    return math.lgamma(0.5) + math.lgamma(a) - math.lgamma(a + 0.5)


def cap_probability(gamma: float, k: int) -> float:
    """q = P(<V, u> >= gamma) for V uniform on S^{k-1}: 1/2 I_{1-gamma^2}((k-1)/2, 1/2) for
    gamma >= 0 (the regularised incomplete beta function), 1 - q(-gamma) below 0. k = 1:
    the sphere is {-1, 1}."""
    if gamma > 1:
        return 0.0
    if gamma <= -1:
        return 1.0
    if k == 1:
        return 0.5 if gamma > -1 else 1.0
    if gamma < 0:
        return 1.0 - cap_probability(-gamma, k)
    from scipy.special import betainc

    return 0.5 * float(betainc((k - 1) / 2, 0.5, (1 - gamma) * (1 + gamma)))


def cap_first_moment(gamma: float, k: int) -> float:
    """E[t; t >= gamma] for t = <V, u>: (1 - gamma^2)^((k-1)/2) / ((k - 1) B(1/2, (k-1)/2))
    (k >= 2), the integral of t times the density; k = 1: 1/2 (t = 1 with probability 1/2)."""
    if gamma >= 1:
        return 0.0
    if k == 1:
        return 0.5
    g = max(gamma, -1.0)
    return math.exp((k - 1) / 2 * math.log1p(-g * g) - math.log(k - 1) - _log_beta_half(k))


def expected_alignment(k: int, gamma: float, p: float) -> float:
    """E<V, u> of PrivUnit with cap threshold gamma and cap probability p: by symmetry
    E[V] = E<V, u> u, and E<V, u> = (p/q - (1 - p)/(1 - q)) E[t; t >= gamma] (the
    complement's mean is minus the cap's, since E t = 0)."""
    q = cap_probability(gamma, k)
    return (p / q - (1 - p) / (1 - q)) * cap_first_moment(gamma, k)


# --------------------------------------------------------------------------- floating point

def gamma_n(n: int) -> float:
    """Higham's gamma_n = n u / (1 - n u): the relative error bound of n floating-point
    operations in sequence (an inner product of length n, in any order of summation)."""
    return n * UNIT_ROUNDOFF / (1 - n * UNIT_ROUNDOFF)


def pair_square_error() -> float:
    """e_s: a bound on |s - s*| for s = fl(fl(v1^2) + fl(v2^2)) with v = 2U - 1 (exact in
    float64) from 53-bit uniforms U, against the exact s* of the real uniforms U* in
    [U, U + 2^-53) that U truncates (v* in [v, v + 2^-52)), for |v1|, |v2| <= 1."""
    # |v*^2 - v^2| <= 2^-52 (2|v| + 2^-52) per coordinate, |v1| + |v2| <= sqrt(2) when s < 1
    # (and the bound holds with 2 in place of sqrt(2) for the rejected pairs near 1);
    # rounding: gamma_2 s <= gamma_2.
    return 1.01 * (2.0**-52 * (2 * 2 + 2 * 2.0**-52) + gamma_n(2))


def factor_error() -> float:
    """A bound on |f - f*| / f* for the polar factor f = fl(sqrt(fl(fl(-2 fl(ln s)) / s)))
    against f* = sqrt(-2 ln s* / s*), for accepted pairs with s* in
    [2^-SMALL_S_BITS, 1 - 2^(LARGE_S_BITS-52)] (docs/guarantee.md, "The figure holds for
    the bytes")."""
    e_s = pair_square_error()
    small, large = 2.0**-SMALL_S_BITS, 2.0 ** (LARGE_S_BITS - 52)
    # |ln s - ln s*| <= e_s / min(s, s*), relative to |ln s*|: above 1/2, min(s, s*) >= 1/2 - e_s
    # and |ln s*| >= 1 - s* >= 2^(LARGE-52); below 1/2, |ln s*| >= ln 2 and min(s, s*) >= small - e_s.
    log = max(e_s / ((0.5 - e_s) * large), e_s / ((small - e_s) * math.log(2)))
    quotient = log + e_s / (small - e_s) + log * e_s / (small - e_s)  # ln s / s against ln s* / s*
    exact = 0.5 * quotient * (1 + quotient)  # |sqrt(1 + x) - 1| <= |x| (1 + |x|) / 2
    rounding = LIBM_ERROR / 2 + 2 * UNIT_ROUNDOFF  # log's error halved by sqrt; /, sqrt
    return (1 + exact) * (1 + rounding) - 1


def pair_error() -> float:
    """A bound on |g - g*| / |g*| for one Gaussian pair g = fl(v fl(f)) against the exact
    pair g* = v* f*, outside the excluded pairs: the factor's relative error, the
    discretisation of v (|v - v*| <= sqrt(2) 2^-52 against |v*| = sqrt(s*) >= 2^-15), and
    the product's rounding."""
    f = factor_error()
    grid = math.sqrt(2) * 2.0**-52 / math.sqrt(2.0**-SMALL_S_BITS - pair_square_error())
    return (f + (grid + UNIT_ROUNDOFF) * (1 + f)) * 1.01


def least_norm(k: int) -> float:
    """rho: the exact Gaussian vector of k values has a norm below rho with probability at
    most 2^-NORM_BITS (rho^2 at 0.99 times the chi-square's quantile, below it whatever
    scipy's error)."""
    from scipy.special import gammaincinv

    return math.sqrt(0.99 * 2 * float(gammaincinv(k / 2, 2.0**-NORM_BITS)))


@dataclass(frozen=True)
class FloatMargin:
    """What floating point does to the cap test [fl(<V, u>) >= gamma] in dimension k.

    Outside an excluded set of draws of probability at most `excluded` (which does not
    depend on u), the computed candidate V and the exact uniform V* it is coupled with
    satisfy |fl(<V, u>) - <V*, u/|u|>| <= `inner`: the test says yes when
    <V*, u/|u|> >= gamma + inner and no when it is below gamma - inner. So the sampler's
    cap share lies in [q(gamma + inner) - excluded, q(gamma - inner) + excluded]."""

    inner: float
    excluded: float


def float_margin(k: int) -> FloatMargin:
    """The sampler's floating-point margin in dimension k (sampling/privunit.py computes
    exactly what this bounds; docs/guarantee.md gives the argument line by line)."""
    g_k, g_k4 = gamma_n(k), gamma_n(k + 4)
    pairs = (k + 1) // 2
    # |g - g*| <= e |g*| over whole pairs (pair_error). Odd k keeps one value of the last pair,
    # g_k = fl(v1 f): |g_k - g*_k| <= |v1 - v1*| f + |v1*| |f - f*| <= 2^-52 f_max + e |g*_k|,
    # f_max = f at the least s*, against |g*| >= rho outside the draws of |g*| < rho.
    relative = pair_error()
    if k % 2:
        small = 2.0**-SMALL_S_BITS - pair_square_error()
        f_max = math.sqrt(-2 * math.log(small) / small) * (1 + factor_error())
        relative += 1.01 * 2.0**-52 * f_max / least_norm(k)
    direction = g_k4 + 2 * relative  # |V - V*|: |g/|g| - g*/|g*|| <= 2 |g - g*| / |g*|, and rounding
    # |fl(<V,u>) - <V,u>| <= g_k |V||u|; |<V - V*, u>| <= |V - V*||u|; |<V*, u - u/|u|>|
    # <= ||u| - 1| <= g_{k+4}, with |V|, |u| <= 1 + g_{k+4}; 1e-300: squares that underflow.
    inner = g_k * (1 + g_k4) ** 2 + direction * (1 + g_k4) + g_k4 + 1e-300
    # Per pair used: s* below 2^-SMALL or above 1 - 2^(LARGE-52) (of an accepted pair's s*, which
    # is uniform on (0, 1)), or a disagreement of the two acceptance tests, |s* - 1| <= e_s, on
    # one of the pairs examined before it (4/pi per pair used on average, each of probability
    # at most (pi/4) 2 e_s: s* has density at most pi/4 near 1).
    per_pair = 2.0**-SMALL_S_BITS + 2.0 ** (LARGE_S_BITS - 52) + 2 * pair_square_error()
    excluded = pairs * per_pair + (2.0**-NORM_BITS if k % 2 else 0.0)
    return FloatMargin(1.0001 * inner, excluded)


def cap_probability_bounds(gamma: float, k: int) -> tuple[float, float]:
    """(q_lo, q_hi): the sampler's cap share for any input lies between them (see
    FloatMargin), with the incomplete beta function's error allowed for."""
    margin = float_margin(k)
    lo = cap_probability(gamma + margin.inner, k) * (1 - BETAINC_ERROR) - margin.excluded
    hi = cap_probability(gamma - margin.inner, k) * (1 + BETAINC_ERROR) + margin.excluded
    return lo, min(1.0, hi)


# --------------------------------------------------------------------------- public rules

# The default number of basis coefficients: DEFAULT_K, or all I when the record is smaller.
# Chosen without the data any target is measured on (docs/choosing-eps.md, "How the
# default k was chosen", and its research script docs/choosing-eps/k_rule.py): F1 of
# logistic regression trained on releases (tldp evaluate's protocol) over a grid of k and
# per-record eps 1 to 16, on scikit-learn's 8x8 digits (1200 training records, 10 classes)
# and on 5-fold cross-validation of the 400 shipped MNIST *training* digits, with this
# module's display scale and clipping. On the 8x8 digits k = I = 64 was best or within
# one standard error of the best at every eps, and smaller k (16, 24) lost up to 0.3 of
# F1; on the 28x28 digits the best k was 64 or 128 at every eps, and 256 and 784 lost
# 0.01-0.1. The best k did not move with eps over 1 to 16 (above about eps 10 the cap's
# floor MIN_CAP_PROBABILITY binds, so more budget raises p but not the alignment a larger
# k would need), so the rule has no eps term: k = min(I, 128). A larger k also costs
# time: the sampler draws about 1/q candidates of k values per record.
# Re-examined for issue 28 with the package's own pipeline (docs/choosing-eps.md, "Issue 28's
# gap", and docs/choosing-eps/k_eps.py) on 5-fold cross-validation of the 2000 MNIST *training*
# digits (1600 training records per fold, 2 releases): at eps 2, 4 and 8 every k from 64 to 256
# was within 0.021, 0.008 and 0.005 of the best (k = 128: 0.839, 0.920, 0.952), so no eps
# term there either; at eps 1 k = 192 led by 0.08, but lost 0.08 on the 400 shipped digits'
# folds (320 training records), and at eps 16 k = 96 led by 0.005. Without noise (V = u) the
# pipeline at k = 128 scores 0.984 on those folds, the clean records' F1: what caps utility is
# the alignment E<V, u>, not k, the display scale or the clipping.
# Volumes (the 3-D DCT) keep it: on eight scans of nibabel's test data, k = 64, 256 and 512 against
# 128 at eps 2, 4, 8 (docs/choosing-eps.md, "Volumes: the default reference and k", and
# docs/choosing-eps/volume_defaults.py, its protocol fixed before the runs), no k was clearly
# better at every eps (k = 256 at eps 4 only; k = 64 won the voxels' correlation but not the
# per-slice profiles).
DEFAULT_K = 128
DEFAULT_K_RULE = f"min(I, {DEFAULT_K})"


def default_k(epsilon: float, elements: int) -> int:
    """The number of coefficients k when --basis does not give it: a public rule of --eps
    and the record's size only, DEFAULT_K_RULE (it does not use eps: see DEFAULT_K)."""
    return int(min(elements, DEFAULT_K))


# --reference: the value a record is measured from (the record projected is x - r, the record
# written r + c B^T (w * V)). A public rule of the option, the declared range and the record's
# shape, never of the data; the guarantee does not depend on it (PrivUnit's figure holds for
# every direction u, docs/guarantee.md). zero: 0, or the end of the range nearest 0 when the range
# does not hold 0 (what a digit's black background wants: the F1 tables of docs/choosing-eps.md
# and docs/reproduction.md were measured with it); low: the range's lower end; mid: its middle
# (a photo's prior mean: written from 0 a photo comes out dark, its mean brightness about a tenth
# of the input's); a number: that value, inside the declared range. auto (the default): mid for
# colour images, records of shape (H, W, 3) or (H, W, 4) (the channels-last layout the DCT basis
# recognises), zero for every other record (grayscale images, volumes, vectors). Measured on
# scikit-learn's sample photos (docs/choosing-eps.md, "Photos: the reference point"). For volumes
# mid was measured against zero on eight scans (docs/choosing-eps.md, "Volumes: the default
# reference and k"): mid won the per-slice profiles, but the voxels' correlation went to zero on
# scans mostly at the bottom of the range and to mid on the others, a property of the data, not
# of the shape, so auto keeps zero for them.
REFERENCE_CHOICES = ("auto", "zero", "low", "mid")
REFERENCE_RULES = {
    "zero": "0, or the end of the declared range nearest to 0 when it does not hold 0",
    "low": "the declared range's lower end",
    "mid": "the middle of the declared range, (lo + hi) / 2",
    "value": "the value --reference gave",
}
COLOUR_CHANNELS = (3, 4)


def is_colour_image(record_shape: tuple[int, ...]) -> bool:
    """A colour image record: (H, W, 3) or (H, W, 4), H and W at least 2, or a stack of them
    (pages, H, W, 3 or 4: a multi-page RGB TIFF) (its shape only)."""
    shape = tuple(record_shape)
    return (len(shape) == 3 and shape[2] in COLOUR_CHANNELS and min(shape[:2]) >= 2) or is_colour_stack(shape)


def reference_choice(option: str | float | None, record_shape: tuple[int, ...]) -> str:
    """The rule --reference `option` picks for records of `record_shape`: zero, low, mid or
    value (auto, or None: mid for a colour image, zero otherwise)."""
    if option is None or option == "auto":
        return "mid" if is_colour_image(record_shape) else "zero"
    if isinstance(option, str) and option in REFERENCE_CHOICES:
        return option
    return "value"


def reference_point(lo: float, hi: float, record_shape: tuple[int, ...] = (),
                    option: str | float | None = "zero") -> float:
    """The value a record is measured from, by --reference `option` (see REFERENCE_RULES; public:
    the option, the range and the record's shape only). The record projected is x - reference,
    and the output is reference + c B^T (w * V). The default `option` is the zero rule."""
    rule = reference_choice(option, record_shape)
    if rule == "zero":
        return min(max(0.0, lo), hi)
    if rule == "low":
        return float(lo)
    if rule == "mid":
        return (lo + hi) / 2.0
    assert option is not None  # "value": a number (run/options.py checked it and the range)
    return float(option)


# The display scale: the written record's deviation from the reference has a root mean
# square of (hi - lo) / OUTPUT_SCALE_DIVISOR per element (before clipping). Measured with
# the k rule (docs/choosing-eps/k_rule.py): on the cross-validation folds of the shipped
# MNIST training digits at k = 128 this divisor with clipping gave the highest F1 at
# eps 2 to 16 (within 0.01 of the best at eps 1) of the divisors 8 and 2, clipped or not,
# and the unbiased scale (hi - lo) sqrt(I) / (2 E<V,u>), whose large values at small eps
# let the classifier fit the noise; on scikit-learn's 8x8 digits the larger scales did
# better above eps 4 (by up to 0.1). It keeps the written values mostly inside the range.
# Re-measured with the weighted write-back's predecessor (reference + c B^T V, clipped) at
# D = 4, 16 and 32: within the noise of D = 8 on both data sets (k_rule.py, clip/D).
# Re-measured for issue 28 (docs/choosing-eps.md, "Issue 28's gap"; k_eps.py): on the 2000
# MNIST training digits' folds at eps 2, D = 16 gave 0.859 and D = 4 0.774 against 0.839; on
# scikit-learn's 8x8 digits D = 2 gave 0.02-0.1 more than D = 8 and D = 16 0.02-0.12 less at
# every eps from 2 to 16. The data sets pull D opposite ways: it stays 8.
OUTPUT_SCALE_DIVISOR = 8


def output_scale(lo: float, hi: float, elements: int) -> float:
    """c, the norm of the written deviation c B^T V (|B^T V| = 1 for orthonormal rows; with the
    write-back's weights w, of mean square 1, c B^T (w * V) has about that norm): a public
    display scale, (hi - lo) sqrt(I) / OUTPUT_SCALE_DIVISOR, so that values land mostly inside
    the declared range. The record's own norm is never released."""
    return (hi - lo) * math.sqrt(elements) / OUTPUT_SCALE_DIVISOR


# The write-back's weights (post-processing: a public function of V). The written record is
# reference + c B^T (w * V), where w_j is the Wiener filter of the released coefficient j under
# a public prior: the record's direction u spreads its energy over the DCT's frequencies as a
# natural image does, u_j^2 proportional to (1 + f_j)^-SPECTRAL_PRIOR_EXPONENT (f_j: the
# coefficient's spatial frequency in cycles per record; a power spectrum falling as 1/f^2 is
# the textbook statistic of natural images), and V = m u + noise of about 1/k per coefficient
# (m = E<V, u>, a function of eps and k). So w_j = m^2 P_j / (m^2 P_j + (1 - m^2) / k), scaled to
# a mean square of 1 over the k coefficients: the written deviation keeps a norm of about c,
# while the high frequencies, where V is almost all noise, are damped. Measured without the
# MNIST test digits (docs/choosing-eps.md, "How the write-back was chosen", and
# docs/choosing-eps/k_rule.py, scales clip/8 and wiener/8/A): on 5-fold cross-validation of the
# 400 shipped MNIST training digits at k = 128 it raised the mean F1 over 3 releases from
# 0.556/0.842/0.856 to 0.645/0.850/0.932 at eps 2/4/8, and on scikit-learn's 8x8 digits at k = 64
# (5 releases) from 0.305/0.623/0.800 to 0.297/0.682/0.820; exponent 1 did no better (0.646/
# 0.824/0.931 and 0.385/0.608/0.805). Also measured and rejected: writing from mid-range,
# (lo + hi)/2 + c B^T V, which clips fewer values but moves every release's mean away from the
# clean records' (F1 0.196 and 0.385 at eps 1 and 2 on the MNIST folds, against 0.409 and 0.616;
# for colour photos, whose prior mean is mid-grey, --reference auto does write from mid-range:
# REFERENCE_CHOICES above), and other display scales (hi - lo)/D with D = 4, 16, 32 (within the noise of D = 8).
# A user's basis (--basis FILE.npy) has no frequencies: its coefficients are written unweighted.
# Only records the DCT runs over two axes of (an image's rows and columns, per channel) or over
# three (a volume, with the frequencies of its 3-D DCT) are weighted: the prior is a statistic of
# images, and the constants were chosen on digits; on three real scans (docs/choosing-eps.md,
# "Volumes: the 3-D basis", docs/choosing-eps/volumes.py) the same weights raised the
# correlation of the releases with their records in 23 of 24 cases. A 1-D record (a feature
# vector, a series) is written unweighted.
#
# And only while the alignment m is below WEIGHTED_BELOW_ALIGNMENT (at k = 128: eps below
# about 3). The weights were first chosen for every eps on the folds above (320 and 1200
# training records). Measured then on the 800 MNIST test digits with 2000 training records
# (docs/reproduction.md, section 3), they raised F1 at eps 1 and 2 (0.648 -> 0.749,
# 0.866 -> 0.872) and lowered it at eps 4 to 32 (by 0.009 to 0.011). The same comparison on
# 5-fold cross-validation of the 2000 MNIST *training* digits (1600 training records per fold,
# no test digit; k_rule.py, data mnist2000, 3 releases) gave +0.08 and +0.03 at eps 1 and 2,
# -0.014 at eps 4 and -0.002 at eps 8: with more records to learn from, the classifier
# averages the noise itself, and the filter's smoothing then costs more detail than it
# removes noise. The threshold, between m(eps 2) = 0.070 and m(eps 4) = 0.134 at k = 128,
# follows that cross-validation (it was run after the test digits' figures were seen, which
# docs/choosing-eps.md says).
SPECTRAL_PRIOR_EXPONENT = 2.0
WEIGHTED_BELOW_ALIGNMENT = 0.1
WRITE_BACK_RULE = ("w_j = m^2 P_j / (m^2 P_j + (1 - m^2)/k), P_j proportional to (1 + f_j)^-2, "
                   "mean square 1 (f_j: coefficient j's frequency in cycles per record)")


# An image's channel counts (grey, RGB, RGBA): an axis of this length, last or first in a record
# of three axes, holds channels, not a spatial axis (spatial_axes; sampling/projection.py).
IMAGE_CHANNELS = (1, 3, 4)


def is_colour_stack(record_shape: tuple[int, ...]) -> bool:
    """A stack of colour images stored channels last, (D, H, W, 3 or 4), each axis but the
    channels' at least 2 (its shape only): a volume whose channels are the last axis."""
    shape = tuple(record_shape)
    return len(shape) == 4 and shape[3] in COLOUR_CHANNELS and min(shape[:3]) >= 2


def spatial_axes(record_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The axes' lengths the DCT basis runs over (sampling/projection.py's is_volume and layout
    follow it): the first two of a (H, W, C) record with C in 1, 3, 4 (channels last), the first
    three of a (D, H, W, C) record with C in 3, 4 (a stack of colour images, channels last: a
    multi-page RGB TIFF), the last two of a (C, H, W) record with C in 1, 3, 4 and of a 2-D
    record (the last one of a 1-D record), else the last three (a volume: any other record of
    three axes or more)."""
    shape = tuple(record_shape)
    if len(shape) == 3 and shape[2] in IMAGE_CHANNELS:
        return shape[:2]
    if is_colour_stack(shape):
        return shape[:3]
    if len(shape) < 3 or (len(shape) == 3 and shape[0] in IMAGE_CHANNELS):
        return shape[-2:]
    return shape[-3:]


# Pre-emphasis (a public weight per coefficient before the normalisation): the direction
# released is that of d * z, d_j = (1 + f_j)^EMPHASIS_EXPONENT (f_j: coefficient j's frequency in
# cycles per record), and the write-back divides it out again (the weights w below carry 1/d), so
# the written record's expected coefficients are those of the record itself, up to a scale.
# The record enters only through u = d z / |d z|, a fixed public function of it (d > 0, so
# d z = 0 only when z = 0), and PrivUnit's figure holds for every u: the guarantee is that of
# the same mechanism without d (docs/guarantee.md). What it changes is how PrivUnit's fixed
# alignment is shared among the coefficients: a digit's (or a photo's) energy lies mostly in the
# lowest frequencies (mean brightness, broad shape), so |z| is dominated by them and the finer
# detail that tells records apart gets little of the released direction; d evens the spectrum
# out. Chosen without the MNIST test digits (docs/choosing-eps.md, "Pre-emphasis", and its
# research script docs/choosing-eps/emphasis.py): on two folds of the 2000 MNIST *training*
# digits (1600 training records, 2 paired releases) a = 0.5 raised the mean F1 from 0.839/0.923/
# 0.956 to 0.852/0.936/0.959 at eps 2/4/8, and on scikit-learn's 8x8 digits (k = 64, 5 releases)
# from 0.603/0.815 to 0.687/0.839 at eps 4/8; a = 1 did better on the 8x8 digits but lost at eps 2
# on the MNIST folds (0.830), a < 0 (the low frequencies emphasised) lost everywhere. Measured once
# afterwards on the 800 MNIST test digits, the gain did not carry over (-0.003 to +0.005 from eps 2
# on, within the releases' spread; -0.037 at eps 1).
EMPHASIS_EXPONENT = 0.5
EMPHASIS_RULE = "d_j = (1 + f_j)^a (f_j: coefficient j's frequency in cycles per record)"


def emphasis_exponent(basis: str, record_shape: tuple[int, ...]) -> float | None:
    """The pre-emphasis exponent a of the DCT basis over two or three axes (spatial_axes) of
    more than one element (the records the spectral statistics are about: images, and volumes,
    measured in docs/choosing-eps.md), None (no pre-emphasis) otherwise."""
    spatial = spatial_axes(record_shape)
    if basis != "dct" or len(spatial) < 2 or min(spatial) < 2:
        return None
    return EMPHASIS_EXPONENT


def emphasis(frequencies, exponent: float):
    """d: the pre-emphasis of each coefficient, (1 + f_j)^exponent (public values only)."""
    import numpy as np

    return (1.0 + np.asarray(frequencies, dtype=np.float64)) ** float(exponent)


def prior_exponent(basis: str, record_shape: tuple[int, ...], alignment: float) -> float | None:
    """The write-back's spectral prior exponent: SPECTRAL_PRIOR_EXPONENT for the DCT basis
    over two or three axes of more than one element at an alignment m = E<V, u> below
    WEIGHTED_BELOW_ALIGNMENT, None (unweighted) otherwise."""
    spatial = spatial_axes(record_shape)
    if basis != "dct" or len(spatial) < 2 or min(spatial) < 2 or alignment >= WEIGHTED_BELOW_ALIGNMENT:
        return None
    return SPECTRAL_PRIOR_EXPONENT


def write_back_weights(frequencies, alignment: float, exponent: float | None = SPECTRAL_PRIOR_EXPONENT,
                       emphasis_exponent: float | None = None):
    """w: the write-back's weight of each coefficient, from the coefficients' spatial
    frequencies (cycles per record) and m = E<V, u>: public values only. The Wiener filter of
    SPECTRAL_PRIOR_EXPONENT's prior when `exponent` is given (with pre-emphasis d, the prior of
    the emphasised direction, d_j^2 (1 + f_j)^-exponent), times 1/d when `emphasis_exponent`
    is given (EMPHASIS_EXPONENT), scaled to a mean square of 1."""
    import numpy as np

    f = np.asarray(frequencies, dtype=np.float64)
    d = np.ones_like(f) if emphasis_exponent is None else emphasis(f, emphasis_exponent)
    w = 1.0 / d
    if exponent is not None:
        prior = d * d * (1.0 + f) ** -float(exponent)
        prior /= prior.sum()
        signal = alignment * alignment * prior
        w = w * signal / (signal + (1.0 - alignment * alignment) / f.size)
    return w / math.sqrt(float(np.mean(w * w)))
