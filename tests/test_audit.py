"""The statistical privacy audit (tldp_cli/audit.py and `tldp audit`).

Every mechanism and noise that mechanisms.calibrate accepts is audited through the
real engine: the audited lower bound stays below the certified figure, and broken
variants (half the noise scale; a retained branch far more likely) are caught.
Continuous noise (the float sampler) is audited there as the real-valued mechanism its
figures are for, blind to the float grid; with the float grid its float32 output is a
VIOLATION, and the exact sampler (the default) is consistent. The
statistical core is checked against exact binomial intervals and for its coverage:
its bounds exceed the truth no more often than the stated confidence allows.
"""

import json
import math
from contextlib import nullcontext
from dataclasses import replace
from unittest import mock

import numpy as np
import pytest
from scipy import stats

from tldp_cli import audit as audit_mod
from tldp_cli.errors import UsageError
from tldp_cli.privacy import accounting, mechanisms
from tldp_cli.sampling.discrete import is_discrete
from tldp_cli.sampling.rng import Streams

# Records of 2x2 elements in [0, 4] calibrated for eps = 8 per record: every mechanism
# then certifies figures that 200k draws resolve (per element about 2), so halving the
# noise or raising p shows, and the real mechanisms sit just below their figures.
SHAPE = (2, 2)
RANGE = (0.0, 4.0)
EPSILON = 8.0
SAMPLES = 200_000
CONFIDENCE = 0.95


def calibrated(mechanism: str, noise: str) -> mechanisms.Calibration:
    return mechanisms.calibrate(
        mechanism=mechanism, noise=noise, budget="record", epsilon=EPSILON,
        range_width=RANGE[1] - RANGE[0], elements=math.prod(SHAPE),
        rows=mechanisms.matrix_rows(mechanism, SHAPE, "test"))


def _accepted(mechanism: str, noise: str) -> bool:
    """MVG and IDN take Gaussian noise only; calibrate refuses the other pairs."""
    try:
        calibrated(mechanism, noise)
    except UsageError:
        return False
    return True


COMBINATIONS = [(m, n) for m in mechanisms.MECHANISMS for n in mechanisms.NOISES if _accepted(m, n)]


def _blind_to_the_float_grid():
    """The audit without its fifth statistic's level (#(y in F_b) - #(y in F_a) always 0):
    that column is then the plain sum again, so the audit sees what the four others see."""
    return mock.patch.object(audit_mod, "_float_grid_level", lambda y, a, b: np.zeros(y.shape[0]))


def run(calib, claimed=None, seed=1, *, float_grid=None, **kw):
    """Audit calib through the real engine. Continuous noise (laplace, gaussian: the float
    sampler) is audited as the real-valued mechanism its figures are certified for, blind to
    the float grid, unless float_grid=True: its float output leaks through the grid (the
    fifth statistic finds that at these settings whatever the calibration, see
    test_float_sampler_output_is_caught_by_the_float_grid), which would make the verdicts of
    the tests below VIOLATION for reasons other than theirs. Discrete noise is always audited
    with every statistic."""
    kw.setdefault("samples", SAMPLES)
    blind = not is_discrete(calib.noise) if float_grid is None else not float_grid
    with _blind_to_the_float_grid() if blind else nullcontext():
        return audit_mod.audit(calib, claimed=claimed, value_range=RANGE, confidence=CONFIDENCE,
                               streams=Streams("secure", seed, allow_weak_seed=True), **kw)


def rows(report):
    return [(s["scope"], row) for s in report["scopes"] for row in s["claims"]]


def test_clopper_pearson_matches_the_exact_binomial_interval():
    n = 1000
    for k in (0, 1, 37, 500, 999, 1000):
        lower, upper = audit_mod.clopper_pearson(np.array([k]), n, 0.025)
        ci = stats.binomtest(k, n).proportion_ci(confidence_level=0.95, method="exact")
        assert lower[0] == pytest.approx(ci.low, abs=1e-12)
        assert upper[0] == pytest.approx(ci.high, abs=1e-12)


def test_bounds_exceed_the_truth_no_more_often_than_the_confidence_allows():
    # Laplace(0, 1) against Laplace(1, 1) is exactly 1-DP, with the likelihood ratio e^1
    # on a whole half-line: the bound's selection can overfit the tails, and must not
    # pay for it in coverage.
    confidence, trials = 0.8, 100
    above_truth = above_understated = 0
    for seed in range(trials):
        rng = np.random.default_rng(seed)
        s0, s1 = rng.laplace(0, 1, (20_000, 1)), rng.laplace(1, 1, (20_000, 1))
        (row,) = audit_mod.lower_bounds(s0, s1, [(1.0, 0.0)], (1 - confidence) / 2, names=("y",))
        above_truth += row["epsilon_lower_bound"] > 1.0
        above_understated += row["epsilon_lower_bound"] > 0.8
    # At most 1 - confidence of the trials may exceed the truth: more than 33 of 100 has
    # probability < 1e-3 when the rate is 0.2 (point estimates would give about 50).
    assert above_truth <= 33
    assert stats.binom.sf(above_truth - 1, trials, 1 - confidence) > 1e-3
    # An understated figure (0.8 for a 1-DP mechanism) is contradicted almost every time.
    assert above_understated >= 90


@pytest.mark.parametrize("mechanism,noise", COMBINATIONS)
def test_real_mechanism_stays_below_its_certified_figures(mechanism, noise):
    calib = calibrated(mechanism, noise)
    report = run(calib)
    assert report["verdict"] == "consistent"
    for scope, row in rows(report):
        assert row["epsilon_lower_bound"] <= row["certified_epsilon"], (scope, row)
        assert row["reach"] > row["epsilon_lower_bound"]
    # the audit sees the mechanism at all: every scope finds some privacy loss
    assert all(row["epsilon_lower_bound"] > 0 for _, row in rows(report))


@pytest.mark.parametrize("mechanism,noise", [(m, n) for m, n in COMBINATIONS if not is_discrete(n)])
def test_float_sampler_output_is_caught_by_the_float_grid(mechanism, noise):
    # The calibrations the test above finds consistent as real-valued mechanisms, audited on
    # the float32 values the float sampler writes: the floats 0 + z can give are not those
    # 4 + z can give, and the fifth statistic turns that into a violation.
    report = run(calibrated(mechanism, noise), float_grid=True)
    assert report["verdict"] == "VIOLATION"
    violations = [row for _, row in rows(report) if row["violation"]]
    assert violations and all(row["event"]["statistic"] == "float grid, then sum" for row in violations)


@pytest.mark.parametrize("mechanism", ["tldp", "baseline"])
@pytest.mark.parametrize("noise", ["laplace", "gaussian"])
def test_exact_sampler_on_float_data_stays_below_its_certified_figures(mechanism, noise):
    # What perturb draws by default for float data in RANGE: discrete noise on the automatic
    # grid, audited with all five statistics (the float grid holds every output here).
    report = audit_mod.run(mechanism=mechanism, noise=noise, budget="record", epsilon=EPSILON,
                           value_range=RANGE, shape=SHAPE, samples=SAMPLES, confidence=CONFIDENCE,
                           seed=1, allow_weak_seed=True)
    assert report["noise"] == f"discrete-{noise}" and report["dtype"] == "float32"
    assert report["neighbours"] == {"x": RANGE[0], "x_prime": RANGE[1]}
    assert report["verdict"] == "consistent" and report["request"]["consistent"]
    for scope, row in rows(report):
        assert row["epsilon_lower_bound"] <= row["certified_epsilon"], (scope, row)
        assert row["reach"] > row["epsilon_lower_bound"]
    assert all(row["epsilon_lower_bound"] > 0 for _, row in rows(report))


@pytest.mark.parametrize("mechanism,noise", COMBINATIONS)
def test_half_the_noise_scale_is_caught(mechanism, noise):
    calib = calibrated(mechanism, noise)
    report = run(replace(calib, scale=calib.scale / 2), claimed=calib, seed=2)
    assert report["verdict"] == "VIOLATION"
    # judged against the real figures, not the broken calibration's
    certified = accounting.certify(calib)
    for scope, row in rows(report):
        figures = getattr(certified, f"per_{scope}")
        assert row["certified_epsilon"] in (figures.epsilon, figures.approx_epsilon)


@pytest.mark.parametrize("mechanism,noise", COMBINATIONS)
def test_a_far_more_likely_retained_branch_is_caught(mechanism, noise):
    calib = calibrated(mechanism, noise)
    # Most raw values come through: a far larger point mass than any figure covers, even
    # where discrete noise of a large scale often lands on the raw value too.
    broken = replace(calib, log_p=math.log(0.9))
    assert broken.p >= 10 * calib.p
    report = run(broken, claimed=calib, seed=3)
    assert report["verdict"] == "VIOLATION"
    # the point mass shows: the best event counts raw values that came through
    element = [row for scope, row in rows(report) if scope == "element"]
    assert any(row["violation"] and row["event"]["statistic"].startswith("raw kept") for row in element)


def test_audit_is_sharp_on_pure_laplace():
    # Laplace noise is tight for its pure figure: a sound but blunt audit would pass the
    # tests above and fail this one.
    calib = calibrated("baseline", "laplace")
    report = run(calib, scopes=("element",), seed=4)
    bounds = [row["epsilon_lower_bound"] for _, row in rows(report)]
    certified = min(row["certified_epsilon"] for _, row in rows(report))
    assert max(bounds) >= 0.9 * certified


def test_same_seed_same_report_and_the_seed_is_nowhere():
    calib = calibrated("tldp", "laplace")
    a = run(calib, seed=8675309, samples=20_000)
    b = run(calib, seed=8675309, samples=20_000)
    assert a == b
    assert a["seeded"] is True and "8675309" not in json.dumps(a)
    assert run(calib, seed=1, samples=20_000) != a


def test_bad_options_are_usage_errors():
    calib = calibrated("tldp", "laplace")
    with pytest.raises(UsageError, match="--samples"):
        audit_mod.audit(calib, samples=10)
    with pytest.raises(UsageError, match="--confidence"):
        audit_mod.audit(calib, confidence=1.0)
    with pytest.raises(UsageError, match="--scope"):
        audit_mod.audit(calib, scopes=("tensor",))
    with pytest.raises(UsageError, match="--elements"):
        audit_mod.parse_shape("28y28")


# ---------------------------------------------------------------------------- CLI
def test_cli_prints_a_table_and_json(cli):
    result = cli("audit", "--eps", "1", "--elements", "4", "--range", "0:1", "--samples", "50000",
                 "--seed", "8675309", "--allow-weak-seed", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["verdict"] == "consistent" and report["seeded"] is True
    assert report["elements_per_record"] == 4 and report["value_range"] == [0.0, 1.0]
    assert {s["scope"] for s in report["scopes"]} == {"element", "record"}
    assert "audited eps >=" in result.stderr and "consistent" in result.stderr
    assert "8675309" not in result.stdout + result.stderr


def test_cli_scope_and_matrix_shape(cli):
    # MVG has no exact sampler (--sampler float is required), and its float32 output leaks
    # through the float grid: exit 1, with the report on stdout and one error line on stderr.
    result = cli("audit", "--eps", "2", "--mechanism", "mvg", "--sampler", "float", "--elements", "2x2",
                 "--range", "0:4", "--scope", "record", "--samples", "20000", "--seed", "1",
                 "--allow-weak-seed", "--json", "--quiet")
    assert result.exit_code == 1, result.output
    report = json.loads(result.stdout)
    assert [s["scope"] for s in report["scopes"]] == ["record"] and report["noise"] == "gaussian"
    assert report["mechanism"] == "mvg" and report["elements_per_record"] == 4
    assert report["verdict"] == "VIOLATION"
    assert all(row["event"]["statistic"] == "float grid, then sum"
               for _, row in rows(report) if row["violation"])
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("tldp: error: audit found a privacy VIOLATION")


def test_cli_float_sampler_is_a_violation_and_the_default_exact_sampler_is_not(cli):
    args = ("audit", "--eps", "1", "--elements", "1", "--range", "0:1", "--samples", "200000",
            "--seed", "1", "--allow-weak-seed", "--json")
    exact = cli(*args)
    assert exact.exit_code == 0, exact.output
    report = json.loads(exact.stdout)
    assert report["noise"] == "discrete-laplace" and report["verdict"] == "consistent"
    assert all(row["epsilon_lower_bound"] > 0 for _, row in rows(report))  # the audit saw noise

    floating = cli(*args, "--sampler", "float")
    assert floating.exit_code == 1, floating.output
    report = json.loads(floating.stdout)
    assert report["noise"] == "laplace" and report["verdict"] == "VIOLATION"
    assert report["request"]["consistent"]  # the calibration is right: the floats leak
    violations = [row for _, row in rows(report) if row["violation"]]
    assert violations and all(row["event"]["statistic"] == "float grid, then sum" for row in violations)
    assert "audit found a privacy VIOLATION" in floating.stderr


@pytest.mark.parametrize("args,neighbours,dtype", [
    (["--noise", "discrete-gaussian", "--range", "0:4"], {"x": 0, "x_prime": 3}, "int64"),
    (["--noise", "discrete-laplace", "--range", "0:1", "--granularity", "0.25"],
     {"x": 0.0, "x_prime": 1.0}, "float32"),
])
def test_cli_discrete_noise_on_integers_and_on_a_grid(cli, args, neighbours, dtype):
    result = cli("audit", "--eps", "1", "--elements", "4", "--samples", "20000", "--seed", "1",
                 "--allow-weak-seed", "--json", *args)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["neighbours"] == neighbours and report["dtype"] == dtype
    assert report["verdict"] == "consistent"


@pytest.mark.parametrize("args,needle", [
    (["--noise", "discrete-laplace", "--range", "0:1.5"], "integer --range"),
    (["--granularity", "0.25", "--sampler", "float"], "--granularity"),
    (["--noise", "discrete-laplace", "--sampler", "float"], "exact noise"),
    (["--mechanism", "mvg", "--elements", "2x2"], "--sampler float"),
    (["--samples", "5"], "--samples"),
    (["--confidence", "1.5"], "--confidence"),
    (["--elements", "0"], "--elements"),
    (["--range", "1:0"], "--range"),
    (["--mechanism", "mvg", "--elements", "4"], "matrix-shaped"),
    # privunit needs 2 or more elements, and --elements defaults to 1: the line names it
    (["--mechanism", "privunit"], "give --elements"),
])
def test_cli_usage_errors_exit_2_on_one_line(cli, args, needle):
    result = cli("audit", "--eps", "1", *args)
    assert result.exit_code == 2
    assert needle in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert "Traceback" not in result.output


def test_cli_exits_1_on_a_violation(cli, monkeypatch):
    real_audit = audit_mod.audit

    def halved(calib, **kw):  # the engine with half the noise, judged against the real figures
        return real_audit(replace(calib, scale=calib.scale / 2), claimed=calib, **kw)

    monkeypatch.setattr(audit_mod, "audit", halved)
    result = cli("audit", "--eps", "1", "--elements", "4", "--range", "0:1", "--samples", "50000",
                 "--seed", "1", "--allow-weak-seed", "--json")
    assert result.exit_code == 1
    assert json.loads(result.stdout)["verdict"] == "VIOLATION"
    assert result.stderr.strip().splitlines()[-1].startswith("tldp: error: audit found a privacy VIOLATION")


def test_cli_help_has_examples_and_says_what_a_lower_bound_is(cli):
    result = cli("audit", "--help")
    assert result.exit_code == 0
    assert "Examples:" in result.stdout and "never a certificate" in result.stdout
    assert "discrete-laplace" in result.stdout and "--granularity" in result.stdout


# --------------------------------------------------------------------------- privunit

def privunit_calibration(epsilon, value_range=(-1.0, 1.0), k=16):
    return mechanisms.calibrate_privunit(epsilon=epsilon, record_shape=(4, 4), value_range=value_range, k=k)


@pytest.mark.parametrize("value_range", [(-1.0, 1.0), (0.0, 256.0)])
def test_privunit_stays_below_its_certified_figure_and_comes_close(value_range):
    """The real projection and sampler: consistent, and, with antipodal neighbours (the
    reference point inside the range), the audited bound nears the certified epsilon."""
    calib = privunit_calibration(3.0, value_range)
    report = audit_mod.audit(calib, samples=16 * 6000, streams=Streams("secure", 1, allow_weak_seed=True))
    assert report["verdict"] == "consistent"
    bounds = [row["epsilon_lower_bound"] for scope in report["scopes"] for row in scope["claims"]]
    assert max(bounds) <= calib.element_epsilon
    if value_range[0] < 0 < value_range[1]:
        assert report["neighbours"]["record"]["cosine"] < -0.999
        assert max(bounds) > 2.5


def test_privunit_claiming_a_smaller_epsilon_is_caught():
    """The same releases audited against the figures of eps 1: a VIOLATION."""
    real, claimed = privunit_calibration(4.0), privunit_calibration(1.0)
    report = audit_mod.audit(real, samples=16 * 4000, scopes=("record",), claimed=claimed,
                             streams=Streams("secure", 2, allow_weak_seed=True))
    assert report["verdict"] == "VIOLATION"


def test_cli_audits_privunit(cli):
    result = cli("audit", "--eps", "2", "--mechanism", "privunit", "--elements", "4x4", "--range", "-1:1",
                 "--samples", "32000", "--basis", "dct:8", "--json", "-q")
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["verdict"] == "consistent" and report["privunit"]["k"] == 8
    assert report["request"]["consistent"]


def test_cli_privunit_header_names_the_mechanism_once_and_counts_releases(cli):
    """The header said "audit of privunit privunit" and "32000 draws" where privunit draws
    32000 // I whole releases per neighbour."""
    result = cli("audit", "--eps", "2", "--mechanism", "privunit", "--elements", "4x4", "--range", "-1:1",
                 "--samples", "32000", "--basis", "dct:8")
    assert result.exit_code == 0, result.stderr
    header = result.stderr.splitlines()[0]
    assert header.startswith("tldp: audit of privunit (budget record, eps=2, ") and "privunit privunit" not in header
    assert "2000 releases (32000 // I) per neighbour and scope" in header


@pytest.mark.parametrize("mechanism", ["tldp", "privunit"])
def test_a_record_too_large_for_the_audits_arrays_is_a_usage_error(mechanism):
    """--elements just under 2^63 passed the count check, then failed as "unexpected error
    (ValueError: array is too big)" (privunit: "cannot reshape array of size 0")."""
    with pytest.raises(UsageError, match=r"more than the audit's arrays can hold \(2\^56\)"):
        audit_mod.run(mechanism=mechanism, noise="laplace", budget=None, epsilon=1.0, value_range=(0.0, 1.0),
                      shape=audit_mod.parse_shape(str(2**63 - 1)))
