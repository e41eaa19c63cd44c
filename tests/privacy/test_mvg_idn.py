"""MVG and IDN (the paper's (eps, delta) baselines): calibration against hand-computed
values, the empirical noise norm against the expressions under the paper's Table 5,
the manifest's figures against closed forms, perturb and evaluate through the CLI,
and the refusals."""

import json
import math

import numpy as np
import pytest
from scipy import stats
from scipy.special import gammaln

from tests.builders import analytic_gaussian_delta, assert_one_line_error, siblings, tree_digest
from tldp_cli.errors import UsageError
from tldp_cli.privacy import accounting, mvg_idn
from tldp_cli.cli.summary import guarantee_line
from tldp_cli.run import manifest
from tldp_cli.privacy.mechanisms import calibrate
from tldp_cli.sampling.engine import perturb_records
from tldp_cli.sampling.rng import Streams

DELTA = 1e-5
Z_TOL = 5.0  # standard errors: a correct sigma fails with probability ~6e-7


def cal(mechanism, elements, rows=None, **kw):
    args = dict(mechanism=mechanism, noise="gaussian", budget="element", epsilon=1.0,
                range_width=2.0, elements=elements, dp_delta=DELTA, rows=rows)
    args.update(kw)
    return calibrate(**args)


def noise(calib, shape, n, seed=3, scale=1.0):
    """n records of zeros perturbed by the engine (float64); `scale` != 1 fakes a wrong sigma."""
    if scale != 1.0:
        calib = type(calib)(**{**calib.__dict__, "scale": calib.scale * scale})
    x = np.zeros((n, *shape))
    streams = Streams("fast", seed, allow_weak_seed=True)
    return perturb_records(x, 0, "array", calib, streams, None, np.float64).reshape(n, -1)


def z_of_mean_square(z, expected_rms):
    """z-score of the mean squared record norm against expected_rms^2, for i.i.d. Gaussian
    elements (||Z||^2 = sigma^2 chi^2_I: variance 2 I sigma^4 = 2 E^2 / I per record)."""
    n, elements = z.shape
    sq = (z * z).sum(axis=1)
    e2 = expected_rms**2
    return (sq.mean() - e2) / math.sqrt(2 * e2**2 / elements / n)


# --------------------------------------------------------------------------- hand-computed

def test_mvg_calibration_matches_hand_computation_for_a_2x3_record():
    # m = 2, n = 3, I = 6, r = 2, range (-1, 1): Delta = 2, s2 = 2 sqrt(6), gamma = sqrt(6)
    # H_2 = 3/2, H_{2,1/2} = 1 + 1/sqrt(2); alpha = (H_2 + H_{2,1/2}) * 6 + 2 * H_2 * 12
    # zeta^2 = 6 + 2 sqrt(6 ln 1e5) + 2 ln 1e5; beta = 2 * 6^(1/4) * H_2 * 2 sqrt(6) * zeta
    h2, h2_half = 1.5, 1 + 1 / math.sqrt(2)
    alpha = (h2 + h2_half) * 6 + 2 * h2 * 12
    zeta = math.sqrt(6 + 2 * math.sqrt(6 * math.log(1e5)) + 2 * math.log(1e5))
    beta = 2 * 6**0.25 * h2 * 2 * math.sqrt(6) * zeta
    budget = (-beta + math.sqrt(beta**2 + 8 * alpha * 1.0)) ** 2 / (4 * alpha**2)
    assert alpha == pytest.approx(55.24264068711929, rel=1e-13)
    assert zeta == pytest.approx(6.756362356522299, rel=1e-13)
    assert beta == pytest.approx(155.40952094960467, rel=1e-13)
    params = mvg_idn.mvg_parameters(2, 6, 2.0, DELTA)
    assert (params.rows, params.columns, params.r) == (2, 3, 2)
    assert (params.h_r, params.h_r_half) == pytest.approx((h2, h2_half), rel=1e-15)
    assert (params.alpha, params.beta, params.zeta) == pytest.approx((alpha, beta, zeta), rel=1e-13)
    assert mvg_idn.mvg_precision_budget(params, 1.0) == pytest.approx(1.6411879812743411e-4, rel=1e-9)
    c = cal("mvg", 6, rows=2)
    # identity covariances: sqrt(mn)/(ab) = P at the smallest noise, variance ab per element
    assert c.scale == pytest.approx(math.sqrt(math.sqrt(6) / budget), rel=1e-9)
    assert c.scale == pytest.approx(122.16833320525918, rel=1e-9)
    assert c.p == 0.0 and c.log_p == -math.inf and c.rows == 2


def test_idn_calibration_matches_hand_computation_for_six_elements():
    zeta = math.sqrt(-2 * math.log(DELTA) + 2 * math.sqrt(-6 * math.log(DELTA)) + 6)
    sigma = 2 * math.sqrt(6) / (-zeta + math.sqrt(zeta**2 + 2 * 1.0))
    c = cal("idn", 6)
    assert c.scale == pytest.approx(sigma, rel=1e-9)
    assert c.scale == pytest.approx(33.45793984328983, rel=1e-9)
    assert c.rows is None and c.p == 0.0


def test_stable_forms_agree_with_the_papers_at_large_eps_and_records():
    for eps in (0.01, 1.0, 1e4):
        params = mvg_idn.mvg_parameters(28, 784, 256.0, DELTA)
        a, b = params.alpha, params.beta
        literal = (-b + math.sqrt(b**2 + 8 * a * eps)) ** 2 / (4 * a**2)
        assert mvg_idn.mvg_precision_budget(params, eps) == pytest.approx(literal, rel=1e-6)
        z = mvg_idn.zeta(784, DELTA)
        literal = 256 * 28 / (-z + math.sqrt(z**2 + 2 * eps))
        assert mvg_idn.idn_sigma(784, 256.0, eps, DELTA) == pytest.approx(literal, rel=1e-6)


# --------------------------------------------------------------------------- Table 5

def paper_mvg_error(rows, elements, eps, delta_range=2.0):
    """sqrt(I1 I / (-beta0 + sqrt(beta0^2 + 8 alpha0 eps))^2 * 4 alpha0^2), the paper's
    expression below Table 5, with alpha0, beta0 from MVG's definitions (written out here)."""
    r = min(rows, elements // rows)
    h = sum(1 / i for i in range(1, r + 1))
    h_half = sum(1 / math.sqrt(i) for i in range(1, r + 1))
    s2, gamma = delta_range * math.sqrt(elements), delta_range / 2 * math.sqrt(elements)
    zeta = math.sqrt(-2 * math.log(DELTA) + 2 * math.sqrt(-elements * math.log(DELTA)) + elements)
    a = (h + h_half) * gamma**2 + 2 * h * gamma * s2
    b = 2 * elements**0.25 * h * s2 * zeta
    return math.sqrt(rows * elements / (-b + math.sqrt(b**2 + 8 * a * eps)) ** 2 * 4 * a**2)


def paper_idn_error(elements, eps, delta_range=2.0):
    zeta = math.sqrt(-2 * math.log(DELTA) + 2 * math.sqrt(-elements * math.log(DELTA)) + elements)
    s2 = delta_range * math.sqrt(elements)
    return math.sqrt(elements * s2**2 / (-zeta + math.sqrt(zeta**2 + 2 * eps)) ** 2)


N_ELEMENTS = 64000  # drawn per case: 5 standard errors are 2.8% of E||Z||^2, 1.4% of its root


@pytest.mark.parametrize("shape,eps", [((4, 4), 1.0), ((3, 3), 10.0), ((4, 2, 2), 0.5)])
def test_mvg_noise_norm_matches_the_papers_expression_for_square_records(shape, eps):
    """(4, 2, 2) unfolds along mode 1 to a 4 x 4 matrix."""
    rows, elements = shape[0], math.prod(shape)
    expected = paper_mvg_error(rows, elements, eps)
    c = cal("mvg", elements, rows=rows, epsilon=eps)
    assert c.expected_l2_error() == pytest.approx(expected, rel=1e-9)
    n = N_ELEMENTS // elements
    z = noise(c, shape, n)
    assert abs(z_of_mean_square(z, expected)) < Z_TOL
    # a sigma 3% too large (6% in E||Z||^2, ~11 standard errors) fails the same test
    assert abs(z_of_mean_square(noise(c, shape, n, scale=1.03), expected)) > Z_TOL
    # E||Z||_2 itself: the mean of a chi distribution, below the paper's root-mean-square figure
    norms = np.sqrt((z * z).sum(axis=1))
    chi_mean = math.sqrt(2) * math.exp(gammaln((elements + 1) / 2) - gammaln(elements / 2))
    sd = c.scale * math.sqrt(elements - chi_mean**2) / math.sqrt(len(norms))
    assert abs(norms.mean() - c.scale * chi_mean) < Z_TOL * sd
    assert norms.mean() < expected
    assert stats.kstest(z.ravel(), "norm", args=(0, c.scale)).pvalue > 1e-3
    assert stats.kstest(z.ravel(), "norm", args=(0, c.scale * 1.1)).pvalue < 1e-6


def test_mvg_non_square_record_follows_the_sufficient_condition_not_i1_times_i():
    """A 3 x 5 record: identity covariances give E||Z||^2 = I^(3/2)/P; the paper's I1 I / P
    (its expression, exact for square records) is 22% lower and is rejected."""
    c = cal("mvg", 15, rows=3)
    budget = mvg_idn.mvg_precision_budget(mvg_idn.mvg_parameters(3, 15, 2.0, DELTA), 1.0)
    ours, papers = math.sqrt(15**1.5 / budget), paper_mvg_error(3, 15, 1.0)
    assert papers == pytest.approx(math.sqrt(3 * 15 / budget), rel=1e-9)
    z = noise(c, (3, 5), N_ELEMENTS // 15)
    assert abs(z_of_mean_square(z, ours)) < Z_TOL
    assert abs(z_of_mean_square(z, papers)) > Z_TOL


@pytest.mark.parametrize("shape,eps", [((16,), 1.0), ((2, 3, 4), 5.0), ((), 1.0)])
def test_idn_noise_norm_matches_the_papers_expression(shape, eps):
    elements = math.prod(shape)
    c = cal("idn", elements, epsilon=eps)
    expected = paper_idn_error(elements, eps)
    assert c.expected_l2_error() == pytest.approx(expected, rel=1e-9)
    n = N_ELEMENTS // elements
    z = noise(c, shape, n)
    assert abs(z_of_mean_square(z, expected)) < Z_TOL
    assert abs(z_of_mean_square(noise(c, shape, n, scale=1.03), expected)) > Z_TOL
    assert stats.kstest(z.ravel(), "norm", args=(0, c.scale)).pvalue > 1e-3


# --------------------------------------------------------------------------- accounting

@pytest.mark.parametrize("mechanism,rows", [("mvg", 4), ("idn", None)])
@pytest.mark.parametrize("budget", ["element", "record"])
def test_manifest_figures_against_closed_forms(mechanism, rows, budget):
    I, D, eps = 24, 2.0, 3.0
    c = cal(mechanism, I, rows=rows, budget=budget, epsilon=eps)
    acc = accounting.certify(c)
    sigma = c.scale
    el, rec, designed = acc.per_element, acc.per_record, acc.designed
    assert el.rho == pytest.approx(D**2 / (2 * sigma**2), rel=1e-12)
    assert rec.rho == pytest.approx(I * D**2 / (2 * sigma**2), rel=1e-12)
    # the tight eps at dp_delta: Balle and Wang's exact delta of the Gaussian mechanism
    for scope, sens in ((el, D), (rec, D * math.sqrt(I))):
        assert scope.delta == DELTA and scope.point_mass_delta == 0.0
        assert scope.epsilon > 0
        assert analytic_gaussian_delta(scope.epsilon, sigma, sens) == pytest.approx(DELTA, rel=1e-3)
    assert designed.delta == DELTA and manifest.designed_entry(designed)["scope"] == "record"
    if budget == "element":  # the mechanism's design: --eps for the record at dp_delta
        assert designed.epsilon == pytest.approx(eps, rel=1e-9)
    else:  # tight calibration: the Gaussian baseline's sigma; the design claims more
        assert rec.epsilon == pytest.approx(eps, rel=1e-6)
        assert sigma == pytest.approx(cal("baseline", I, budget="record", epsilon=eps).scale)
    # the design's own claim is never tighter than the exact analysis of the same noise
    assert designed.epsilon > rec.epsilon
    if mechanism == "mvg":
        entry = manifest.designed_entry(designed)
        assert (entry["rows"], entry["columns"], entry["unfolding"]) == (4, 6, "mode-1")
    assert "as designed, each record (eps=" in guarantee_line(manifest.accounting_entry(acc), "gaussian")


def test_library_refusals():
    with pytest.raises(UsageError, match="Gaussian noise only"):
        cal("mvg", 16, rows=4, noise="laplace")
    with pytest.raises(UsageError, match="first axis"):
        cal("mvg", 16)
    with pytest.raises(UsageError, match="first axis"):
        cal("mvg", 16, rows=3)


# --------------------------------------------------------------------------- CLI

# MVG and IDN add real-valued Gaussian noise, which has no exact sampler: perturb needs this.
FLOAT = ("--sampler", "float")


@pytest.fixture
def matrices(tmp_path):
    path = tmp_path / "m.npy"
    np.save(path, np.random.default_rng(0).uniform(-1, 1, (200, 2, 3, 4)))
    return path


@pytest.mark.parametrize("mechanism", ["mvg", "idn"])
def test_perturb_round_trip_and_evaluate(cli, matrices, tmp_path, mechanism):
    before = tree_digest(matrices)
    r = cli("perturb", matrices, "--eps", "2", "--range", "-1:1", "--mechanism", mechanism, *FLOAT,
            "--seed", 424242, "--allow-weak-seed", "--json")
    assert r.exit_code == 0, r.stderr
    m = json.loads(r.stdout)
    out = tmp_path / "m.tldp.npy"
    assert np.load(out).shape == (200, 2, 3, 4) and tree_digest(matrices) == before
    assert m["mechanism"] == mechanism and m["noise"] == "gaussian" and m["budget"] == "element"
    assert m["sampler"] == "float" and np.load(out).dtype == np.float32
    rows = 2 if mechanism == "mvg" else None  # mode-1: the record's first axis
    c = cal(mechanism, 24, rows=rows, epsilon=2.0)
    assert m["noise_scale"] == pytest.approx(c.scale, rel=1e-12)
    assert m["retain_probability"] == 0.0 and m["retain_probability_log10"] is None
    assert m["accounting"]["designed"]["epsilon"] == pytest.approx(2.0)
    certified = json.loads(json.dumps(manifest.accounting_entry(accounting.certify(c))))
    for scope in ("per_element", "per_record", "designed", "dp_delta"):
        assert m["accounting"][scope] == certified[scope]
    if mechanism == "mvg":
        assert (m["accounting"]["designed"]["rows"], m["accounting"]["designed"]["columns"]) == (2, 12)
    assert "424242" not in (tmp_path / "m.tldp.npy.manifest.json").read_text()
    assert "as designed, each record (eps=2" in r.stderr
    r = cli("evaluate", matrices, out)
    assert r.exit_code == 0, r.stderr
    assert "every check passed" in r.stderr


def test_refusals_write_nothing(cli, matrices, tmp_path):
    vectors = tmp_path / "v.npy"
    np.save(vectors, np.zeros((10, 5)))
    mask = tmp_path / "w.npy"
    np.save(mask, np.zeros((2, 3, 4)))
    before, digest = siblings(tmp_path), tree_digest(matrices)
    for mechanism in ("mvg", "idn"):  # the default exact sampler has no real-valued Gaussian noise
        assert_one_line_error(cli("perturb", matrices, "--eps", "1", "--range", "-1:1", "--mechanism", mechanism),
                              2, f"--mechanism {mechanism}", "--sampler float")
    assert_one_line_error(cli("perturb", matrices, "--eps", "1", "--range", "-1:1", "--mechanism", "mvg", *FLOAT,
                              "--noise", "laplace"), 2, "--mechanism mvg adds Gaussian noise only")
    assert_one_line_error(cli("perturb", vectors, "--eps", "1", "--range", "-1:1", "--mechanism", "mvg", *FLOAT),
                          2, str(vectors), "matrix-shaped records", "(5,)")
    assert_one_line_error(cli("perturb", matrices, "--eps", "1", "--range", "-1:1", "--mechanism", "idn", *FLOAT,
                              "--weights", mask), 2, "--weights", "idn")
    assert siblings(tmp_path) == before and tree_digest(matrices) == digest
    # IDN takes any record shape
    assert cli("perturb", vectors, "--eps", "1", "--range", "-1:1", "--mechanism", "idn", *FLOAT,
               "-q").exit_code == 0


def test_sweep_has_mvg_and_idn_and_skips_mvg_for_vectors(cli, tmp_path):
    x = np.random.default_rng(1).uniform(-1, 1, (300, 4, 4))
    np.save(tmp_path / "x.npy", x)
    r = cli("sweep", tmp_path / "x.npy", "--eps", "1,10", "--range", "-1:1",
            "--seed", 0, "--allow-weak-seed", "--out", tmp_path / "s", "--json")
    assert r.exit_code == 0, r.stderr
    result = json.loads(r.stdout)
    rows = {(row["method"], row["epsilon"]): row for row in result["rows"]}
    for method, mechanism in (("MVG", "mvg"), ("IDN", "idn")):
        for eps in (1.0, 10.0):
            row = rows[method, eps]
            c = cal(mechanism, 16, rows=4 if mechanism == "mvg" else None, epsilon=eps)
            assert row["noise_scale"] == pytest.approx(c.scale)
            assert row["record_epsilon"] == pytest.approx(accounting.certify(c).per_record.epsilon)
            # 300 records x 16 elements: 5 standard errors of E||Z||^2 are 10%
            assert row["rms_l2_error"] ** 2 == pytest.approx(c.expected_l2_error() ** 2, rel=0.1)
    # an element sweep: only privunit, whose eps is per record, is left out
    assert [entry["method"] for entry in result["skipped_methods"]] == ["privunit"]
    np.save(tmp_path / "v.npy", x.reshape(300, 16))
    r = cli("sweep", tmp_path / "v.npy", "--eps", "1", "--range", "-1:1",
            "--out", tmp_path / "s2", "--json")
    assert r.exit_code == 0, r.stderr
    result = json.loads(r.stdout)
    assert "MVG" not in result["methods"] and "IDN" in result["methods"]
    assert result["skipped_methods"][0]["method"] == "MVG" and "MVG skipped" in r.stderr
