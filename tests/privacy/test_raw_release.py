"""Consent for raw releases: TLDP's kept raw values never cost more than --dp-delta unasked."""

import json
import math

import numpy as np
import pytest

from tests.builders import siblings
from tldp_cli.privacy import accounting
from tldp_cli.privacy.mechanisms import calibrate


@pytest.fixture
def scaled_digits(tmp_path, digits):
    """MNIST scaled to [0, 1): TLDP's retain probability is in data units, so it grows."""
    path = tmp_path / "mnist01.npy"
    np.save(path, (digits[:50] / 256).astype(np.float32))
    return path


def test_scalar_records_in_unit_range_are_refused(cli, tmp_path):
    """1000 x 1 float records at --eps 1 --range 0:1 kept a third of the values raw (the
    continuous Laplace of --sampler float)."""
    np.save(tmp_path / "x.npy", np.random.default_rng(0).random((1000, 1), np.float32))
    result = cli("perturb", tmp_path / "x.npy", "--eps", "1", "--range", "0:1", "--sampler", "float")
    assert result.exit_code == 2, result.stderr
    line = result.stderr.strip()
    assert len(line.splitlines()) == 1
    assert "probability 0.333" in line and "--allow-raw-release" in line and "--sampler exact" in line
    assert siblings(tmp_path) == {"x.npy"}
    # the advised discrete Laplace is the default (exact) sampler's: its pure bound covers the
    # kept values, so no consent is needed
    result = cli("perturb", tmp_path / "x.npy", "--eps", "1", "--range", "0:1", "--json", "-q")
    assert result.exit_code == 0, result.stderr
    m = json.loads(result.stdout)
    assert m["noise"] == "discrete-laplace" and "raw_release_allowed" not in m
    assert m["accounting"]["per_element"]["delta"] == 0 and m["retain_probability"] > 0


def test_consent_is_recorded_and_the_figure_stays_honest(cli, tmp_path):
    np.save(tmp_path / "x.npy", np.random.default_rng(0).random((1000, 1), np.float32))
    # continuous Laplace (--sampler float): p in closed form, outputs equal to inputs only if kept
    result = cli("perturb", tmp_path / "x.npy", "--eps", "1", "--range", "0:1", "--allow-raw-release",
                 "--sampler", "float", "--json", "-q")
    assert result.exit_code == 0, result.stderr
    m = json.loads(result.stdout)
    p = m["retain_probability"]
    assert p == pytest.approx(1 / 3, rel=1e-6)  # e^0 / (2 * 1 + e^0) with I = 1
    assert m["raw_release_allowed"] == {"per_element": pytest.approx(p), "per_record": pytest.approx(p)}
    assert m["accounting"]["per_element"]["delta"] == pytest.approx(p)
    kept = np.load(tmp_path / "x.tldp.npy") == np.load(tmp_path / "x.npy")
    assert abs(kept.mean() - p) < 5 * math.sqrt(p * (1 - p) / kept.size)  # the raw values really kept


def test_record_budget_on_scaled_digits_is_refused(cli, scaled_digits):
    """Was: 'each record (eps=1, delta=0.944)', exit 0 (continuous Gaussian: --sampler float)."""
    result = cli("perturb", scaled_digits, "--eps", "1", "--range", "0:1", "--budget", "record",
                 "--noise", "gaussian", "--sampler", "float")
    assert result.exit_code == 2
    assert "--eps 1 per record cannot be met at --dp-delta 1e-05" in result.stderr
    assert "0.944" in result.stderr


@pytest.mark.parametrize("eps, args", [("10", ("--noise", "discrete-laplace", "--granularity", "0.00390625")),
                                       # the record budget's noise is ~8e5 grid steps of 2^-10 here:
                                       # float32 cannot hold the grid, float64 can
                                       ("1", ("--mechanism", "baseline", "--dtype", "float64"))])
def test_the_advised_alternatives_run(cli, scaled_digits, eps, args):
    result = cli("perturb", scaled_digits, "--eps", eps, "--range", "0:1", "--budget", "record", *args,
                 "--json", "-q")
    assert result.exit_code == 0, result.stderr
    record = json.loads(result.stdout)["accounting"]["per_record"]
    assert record["epsilon"] <= float(eps) and record["point_mass_delta"] == 0


def test_the_default_element_budget_on_uint8_images_needs_no_consent(cli, tmp_path, digits):
    np.save(tmp_path / "digits.npy", digits[:50])
    result = cli("perturb", tmp_path / "digits.npy", "--eps", "1", "--json", "-q")
    assert result.exit_code == 0, result.stderr
    assert "raw_release_allowed" not in json.loads(result.stdout)


@pytest.mark.parametrize("noise", ["gaussian", "discrete-gaussian"])
def test_a_small_point_mass_comes_out_of_the_noise_delta(noise):
    """Total delta = dp_delta: the Gaussian's epsilon is taken at dp_delta - point mass."""
    calib = calibrate(mechanism="tldp", noise=noise, budget="element", epsilon=1.0,
                      range_width=256.0 if noise == "gaussian" else 256, elements=10)
    record = accounting.certify(calib).per_record
    pm = record.point_mass_delta
    assert 0 < pm < 1e-5
    assert record.delta == pytest.approx(1e-5)
    def eps_at(delta):
        if noise == "gaussian":
            return accounting.gaussian_epsilon(calib.scale / (256 * math.sqrt(10)), delta)
        return accounting.discrete_gaussian_epsilon(calib.scale, 255, 10, delta)

    assert record.epsilon == pytest.approx(eps_at(1e-5 - pm), rel=1e-12)
    assert record.epsilon > eps_at(1e-5)  # the kept values' share really is paid for


def test_noise_delta_splits_the_target():
    assert accounting.noise_delta(1e-5, 4e-6) == (pytest.approx(6e-6), 1e-5)
    assert accounting.noise_delta(1e-5, 3e-5) == (1e-5, pytest.approx(4e-5))
    assert accounting.noise_delta(1e-5, 1.0) == (1e-5, 1.0)
