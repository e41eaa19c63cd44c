"""Certified figures: grid snapping in narrow float dtypes, worst-case accounting over the
calibrations of one run, pessimistic PLD rounding, record budgets that never exceed
--eps, and composition of discrete noises."""

import json
import math

import numpy as np
import pytest

from tests.builders import (
    composed_losses,
    exact_delta,
    exact_epsilon,
    mixture_loss_atoms,
)
from tldp_cli.privacy import accounting
from tldp_cli.run import manifest
from tldp_cli.privacy.mechanisms import calibrate
from tldp_cli.sampling import discrete


def _run(cli, *args):
    result = cli("perturb", *args, "--seed", "1", "--allow-weak-seed", "--json", "--quiet")
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


def _assert_on_grid(out: np.ndarray, manifest: dict) -> np.ndarray:
    """Every output finite, a multiple of G, within the noise's 2^-64 tail bound of the grid."""
    G, grid = manifest["granularity"], manifest["grid"]
    assert np.isfinite(out).all()
    units = np.rint(out.astype(np.float64) / G)
    # G * units, rounded to the output dtype
    np.testing.assert_allclose(out, units * G, rtol=np.finfo(out.dtype).eps, atol=0)
    tail = discrete.tail_bound(manifest["noise"], manifest["noise_scale"])
    assert grid["low"] - tail <= units.min() and units.max() <= grid["high"] + tail
    return units


# --------------------------------------------------------------------------- 1. snapping
def test_snap_divides_in_float64_and_clips_into_the_grid():
    G = 2.0**-17
    half = np.array([[0.5, 1.0, 0.25]], np.float16)
    np.testing.assert_array_equal(discrete.snap(half, G), [[2**16, 2**17, 2**15]])  # float16: inf
    grid = discrete.resolve_grid(0.0, 0.35, [np.dtype(np.float32)], 0.1, 1.0, "x")
    assert (grid.low, grid.high) == (0, 3)
    np.testing.assert_array_equal(discrete.snap(np.array([[0.35, 0.0]], np.float32), 0.1), [[3, 0]])
    # float32(0.1) lies above 0.1 and passes the range check (made in float32); its grid point
    # would be past the last one
    G = 0.0666666667333
    grid = discrete.resolve_grid(0.0, 0.1, [np.dtype(np.float32)], G, 1.0, "x")
    assert grid.high == 1 and discrete.snap(np.array([[0.1]], np.float32), G)[0, 0] == 2
    assert discrete.snap(np.array([[0.1]], np.float32), G, grid)[0, 0] == 1


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_values_at_the_top_of_the_range_stay_on_the_grid(cli, tmp_path, dtype):
    """--eps 100 on 4 grid values: the noise is 0 but with probability ~1e-11, so the
    output is the snapped input, which must be the last grid point (index 3), not past it."""
    np.save(tmp_path / "x.npy", np.full((2000, 1), 0.35, dtype))
    m = _run(cli, tmp_path / "x.npy", "--eps", "100", "--range", "0:0.35", "--granularity", "0.1",
             "--noise", "discrete-laplace", "--dtype", "float64")
    assert m["grid"]["high"] == 3 and m["grid"]["sensitivity_steps"] == 3
    units = _assert_on_grid(np.load(tmp_path / "x.tldp.npy"), m)
    np.testing.assert_array_equal(units, 3)


def test_input_rounding_above_hi_is_clipped_into_the_grid(cli, tmp_path):
    np.save(tmp_path / "x.npy", np.full((500, 2), 0.1, np.float32))
    m = _run(cli, tmp_path / "x.npy", "--eps", "100", "--range", "0:0.1", "--granularity", "0.0666666667333",
             "--noise", "discrete-laplace", "--dtype", "float64")
    assert (m["grid"]["low"], m["grid"]["high"]) == (0, 1)
    np.testing.assert_array_equal(_assert_on_grid(np.load(tmp_path / "x.tldp.npy"), m), 1)


@pytest.mark.parametrize("noise", ["discrete-laplace", "discrete-gaussian"])
def test_float16_with_a_fine_automatic_grid_stays_finite(cli, tmp_path, noise):
    """G = 2^-17: in float16 x / G overflows for x >= 0.5 (the old output was +-7e13)."""
    values = np.random.default_rng(0).random((300, 4)).astype(np.float16)
    values[0] = [0.0, 0.5, 0.75, 1.0]
    np.save(tmp_path / "x.npy", values)
    m = _run(cli, tmp_path / "x.npy", "--eps", "100", "--range", "0:1", "--noise", noise)
    assert m["granularity"] == 2.0**-17
    _assert_on_grid(np.load(tmp_path / "x.tldp.npy"), m)


def test_bfloat16_safetensors_stay_finite_and_on_the_grid(cli, tmp_path):
    from tests.builders import read_safetensors, write_safetensors

    w = np.array([[1.0, -1.0, 0.5, 0.75], [-0.5, 0.0, 0.25, 0.9375]], np.float32)  # bfloat16-exact
    write_safetensors(tmp_path / "m.safetensors", {"h": np.full(3, 0.5, np.float16)}, bf16={"w": w})
    m = _run(cli, tmp_path / "m.safetensors", "--eps", "200", "--clip", "1", "--noise", "discrete-gaussian")
    _, _, out = read_safetensors(tmp_path / "m.tldp.safetensors")
    for name in ("w", "h"):
        _assert_on_grid(out[name].astype(np.float32), m)
        assert np.abs(out[name].astype(np.float64)).max() < 1.5


def test_float16_model_file_stays_finite_and_on_the_grid(cli, tmp_path):
    rng = np.random.default_rng(1)
    np.savez(tmp_path / "m.npz", w=rng.uniform(-1, 1, (8, 8)).astype(np.float16),
             b=np.array([1.0, -1.0, 0.5, -0.5, 0.75, 0.0, 0.9, -0.9], np.float16))
    m = _run(cli, tmp_path / "m.npz", "--eps", "200", "--clip", "1", "--noise", "discrete-laplace")
    with np.load(tmp_path / "m.tldp.npz") as out:
        for name in ("w", "b"):
            assert out[name].dtype == np.float16
            _assert_on_grid(out[name], m)
            assert np.abs(out[name].astype(np.float64)).max() < 1.5


# --------------------------------------------------------------------------- 2. records of several sizes
def _cal(**kw):
    args = {"mechanism": "tldp", "noise": "laplace", "budget": "element", "epsilon": 5.0,
            "range_width": 2.0, "elements": 1, "dp_delta": 1e-5}
    args.update(kw)
    return calibrate(**args)


def laplace_p(eps: float, width: float, elements: int) -> float:
    """The paper's retain probability (docs/guarantee.md): p = e^{eps - I Delta/b} / (2b + e^{eps - I Delta/b}), b = Delta/eps."""
    b = width / eps
    a = math.exp(eps - elements * width / b)
    return a / (2 * b + a)


def test_one_calibration_is_exactly_certify():
    for noise in ("laplace", "gaussian", "discrete-laplace"):
        c = _cal(noise=noise, elements=7, range_width=4.0)
        assert accounting.certify_all([c, c]) == accounting.certify(c)


@pytest.mark.parametrize("noise, budget", [("laplace", "element"), ("laplace", "record"),
                                           ("gaussian", "element"), ("gaussian", "record"),
                                           ("discrete-gaussian", "element")])
def test_every_scope_field_is_the_worst_over_the_calibrations(noise, budget):
    width = 3.0 if noise.startswith("discrete") else 2.0
    cs = [_cal(noise=noise, budget=budget, elements=i, range_width=width, epsilon=3.0) for i in (1, 2, 40)]
    worst = accounting.certify_all(cs)
    assert worst.worst_case_of == 3
    for scope in ("per_element", "per_record"):
        each = [getattr(accounting.certify(c), scope) for c in cs]
        for key in ("epsilon", "delta", "point_mass_delta", "approx_epsilon", "approx_delta"):
            assert getattr(getattr(worst, scope), key) == max(getattr(e, key) for e in each), (scope, key)
        if noise != "laplace":
            assert getattr(worst, scope).rho == max(e.rho for e in each)
    # the figures differ between the calibrations, so no single one would do
    first = accounting.certify(cs[0]).per_element
    last = accounting.certify(cs[-1]).per_element
    assert first != last


def test_record_budget_per_element_is_that_of_the_smallest_record(cli, tmp_path):
    """--budget record, Laplace: b = I Delta / eps, so an element of a 3-element record is
    eps/3-DP and one of a 12-element record eps/12-DP; each element gets the former.
    (Unrelated first axes: each dataset's rows are records of their own.)"""
    import h5py

    rng = np.random.default_rng(2)
    with h5py.File(tmp_path / "g.h5", "w") as f:
        f.create_dataset("small", data=rng.uniform(0, 1, (20, 3)))
        f.create_dataset("large", data=rng.uniform(0, 1, (30, 3, 4)))
    # continuous Laplace (--sampler float), whose b = I Delta / eps gives these closed forms
    result = cli("perturb", tmp_path / "g.h5", "--eps", "6", "--range", "0:1", "--budget", "record",
                 "--dataset", "small", "--dataset", "large", "--sampler", "float",
                 "--seed", "1", "--allow-weak-seed", "--allow-raw-release", "--json")
    assert result.exit_code == 0, result.stderr
    m = json.loads(result.stdout)
    acc = m["accounting"]
    assert acc["per_element"]["epsilon"] == pytest.approx(2.0)  # 6 / 3, not 6 / 12
    assert acc["per_record"]["epsilon"] == pytest.approx(6.0)
    assert "row_datasets" not in m
    assert m["elements_per_record"] == 12 and m["noise_scale"] == pytest.approx(2.0)
    assert [(c["elements_per_record"], c["records"], c["noise_scale"]) for c in m["calibrations"]] == [
        (3, 20, pytest.approx(0.5)), (12, 30, pytest.approx(2.0))]
    assert "guarantee (the worst of 2 record sizes): each element (eps=2," in result.stderr
    ev = cli("evaluate", tmp_path / "g.h5", tmp_path / "g.tldp.h5", "--json")
    assert ev.exit_code == 0, ev.output
    assert json.loads(ev.stdout)["integrity_ok"]


def _evaluate_checks(cli, original, perturbed, manifest=None):
    args = ["--manifest", manifest] if manifest else []
    result = cli("evaluate", original, perturbed, "--json", *args)
    report = json.loads(result.stdout)
    return result.exit_code, {c["check"]: c for c in report["checks"]}


def test_images_of_several_sizes_state_the_largest_p_and_evaluate(cli, tmp_path):
    from PIL import Image

    folder = tmp_path / "photos"
    folder.mkdir()
    rng = np.random.default_rng(3)
    for name, shape in (("tiny.png", (1, 1)), ("pair.png", (1, 2)), ("big.png", (6, 5))):
        Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8)).save(folder / name)
    # The 1-pixel image's visible p is the point: a raw release, which needs consent
    # (tests/privacy/test_raw_release.py). Continuous Laplace (--sampler float): p in closed form.
    result = cli("perturb", folder, "--eps", "300", "--seed", "2", "--allow-weak-seed", "--image-format", "tiff",
                 "--sampler", "float", "--json", "--allow-raw-release")
    assert result.exit_code == 0, result.stderr
    m = json.loads(result.stdout)
    p_tiny = laplace_p(300.0, 256.0, 1)
    assert p_tiny > 0.2 and m["retain_probability"] == pytest.approx(p_tiny)
    assert m["accounting"]["per_element"]["delta"] == pytest.approx(p_tiny)
    assert m["accounting"]["per_record"]["delta"] == pytest.approx(p_tiny)
    code, checks = _evaluate_checks(cli, folder, tmp_path / "photos.tldp")
    assert checks["parameters"]["passed"], checks["parameters"]
    assert code == 0
    # the old statement, the largest image's figures, is refused
    old = accounting.certify(_cal(epsilon=300.0, range_width=256.0, elements=30))
    m["accounting"]["per_element"] = manifest.scope_entry(old.per_element)
    (tmp_path / "old.json").write_text(json.dumps(m))
    code, checks = _evaluate_checks(cli, folder, tmp_path / "photos.tldp", tmp_path / "old.json")
    assert code == 1 and not checks["parameters"]["passed"]
    assert "accounting.per_element.delta" in checks["parameters"]["detail"]


@pytest.mark.parametrize("noise", ["laplace", "gaussian", "discrete-laplace"])
def test_model_file_with_several_tensor_sizes_passes_evaluate(cli, tmp_path, noise):
    rng = np.random.default_rng(4)
    np.savez(tmp_path / "m.npz", w=rng.uniform(-1, 1, (16, 8)).astype(np.float32),
             b=rng.uniform(-1, 1, 8).astype(np.float32), s=np.array([0.25], np.float32))
    # Tensors of 1 and 8 values keep raw values with probability above dp_delta, which needs
    # consent (tests/privacy/test_raw_release.py); this test is about the several sizes' figures.
    result = cli("perturb", tmp_path / "m.npz", "--eps", "2", "--clip", "1", "--noise", noise,
                 "--seed", "5", "--allow-weak-seed", "--dtype", "float64", "--json", "--allow-raw-release")
    assert result.exit_code == 0, result.stderr
    m = json.loads(result.stdout)
    per_tensor = m["accounting"]["per_tensor"]
    for scope in ("epsilon", "delta"):
        assert m["accounting"]["per_record"][scope] == max(t[scope] for t in per_tensor)
    assert m["retain_probability"] == max(t["retain_probability"] for t in per_tensor)
    code, checks = _evaluate_checks(cli, tmp_path / "m.npz", tmp_path / "m.tldp.npz")
    assert checks["parameters"]["passed"], checks["parameters"]
    assert code == 0, checks


def test_single_size_manifest_is_unchanged(cli, tmp_path):
    """One calibration: no calibrations list, no worst_case_of, the figures of certify."""
    np.save(tmp_path / "x.npy", np.random.default_rng(5).uniform(0, 1, (30, 4)))
    result = cli("perturb", tmp_path / "x.npy", "--eps", "2", "--range", "0:1", "--json",
                 "--allow-raw-release")
    assert result.exit_code == 0, result.stderr
    m = json.loads(result.stdout)
    # the default exact sampler: discrete Laplace on the automatic grid of the range 0:1
    assert m["noise"] == "discrete-laplace" and m["range_width"] == 1.0
    c = _cal(noise="discrete-laplace", epsilon=2.0, range_width=1.0, elements=4,
             granularity=m["granularity"])
    assert "calibrations" not in m and "worst_case_of" not in m["accounting"]
    m["accounting"].pop("per_file")
    assert m["accounting"] == json.loads(json.dumps(manifest.accounting_entry(accounting.certify(c))))
    assert m["retain_probability"] == c.p and m["retain_probability_log10"] == c.p_log10
    element_epsilon = accounting.certify(c).per_element.epsilon  # 2.0015: W - 1 steps
    assert f"guarantee: each element (eps={element_epsilon:.4g}, " in result.stderr


# --------------------------------------------------------------------------- 3. PLD rounding
def test_pld_bins_never_round_a_loss_down():
    """Intervals that put the loss on a bin edge (loss / k): float subtraction and division
    land on either side of it; the bin must hold the exact loss of the given log-probabilities
    (old: np.ceil(loss / interval) fell short in about a quarter of these)."""
    from fractions import Fraction

    rng = np.random.default_rng(0)
    upper, lower = -rng.uniform(0, 30, (2, 400))
    steps = rng.integers(1, 3000, 400)
    short = 0
    for u, low, k in zip(upper, lower, steps):
        interval = abs(u - low) / k
        bins = accounting.pessimistic_bins(np.array([u, low]), np.array([low, u]), interval)
        for b, loss in zip(bins, (Fraction(u) - Fraction(low), Fraction(low) - Fraction(u))):
            short += Fraction(int(b)) * Fraction(interval) < loss
            assert int(b) <= math.ceil(loss / Fraction(interval)) + 1  # at most one bin up
    assert short == 0


# --------------------------------------------------------------------------- 4. record budget <= --eps
def _record_cases():
    for noise in ("laplace", "gaussian", "discrete-laplace"):
        for mechanism in ("tldp", "baseline", "mvg", "idn"):
            for W in (2, 3, 16, 256):
                for I in (1, 7, 100):
                    for eps in (0.3, 1.0, 2.7, 10.0):
                        yield noise, mechanism, W, I, eps
    for W, I, eps in ((2, 1, 2.7), (16, 7, 1.0), (256, 100, 0.3)):  # each a slow bisection
        for mechanism in ("tldp", "baseline"):
            yield "discrete-gaussian", mechanism, W, I, eps


def test_record_budget_never_certifies_more_than_eps():
    """I d / eps, a Gaussian's sigma and back: rounding used to certify a few ulps above
    --eps (discrete-laplace baseline, W = 16, I = 7, --eps 1: 1.0000000000000002)."""
    from tldp_cli.errors import UsageError

    checked = over = 0
    for noise, mechanism, W, I, eps in _record_cases():
        try:
            c = calibrate(mechanism=mechanism, noise=noise, budget="record", epsilon=eps, range_width=W,
                          elements=I, rows=1 if mechanism == "mvg" else None)
        except UsageError:  # mvg/idn with non-Gaussian noise; TLDP discrete-laplace whose p costs more
            continue
        checked += 1
        certified = accounting.certify(c).per_record.epsilon if checked % 25 == 0 else None
        record = accounting.scope_epsilon(c, I)
        assert certified is None or certified == record
        over += record > eps
        assert record == pytest.approx(eps, rel=1e-9) or noise == "discrete-gaussian"
    assert checked > 300 and over == 0


# --------------------------------------------------------------------------- 5. composing discrete noises
def test_discrete_gaussian_records_compose_by_rho():
    """100 records of 784 elements, baseline, each record eps 1 at 1e-5: basic composition
    said eps 100; rho adds up, and the RDP bound of that rho (the continuous Gaussian's
    analytic figure is 14.4) is what holds."""
    from dp_accounting import GaussianDpEvent
    from dp_accounting.rdp import RdpAccountant

    c = calibrate(mechanism="baseline", noise="discrete-gaussian", budget="record", epsilon=1.0,
                  range_width=256, elements=784)
    one = calibrate(mechanism="baseline", noise="discrete-gaussian", budget="element", epsilon=1.0,
                    range_width=256, elements=100)
    rho = 255**2 / (2 * c.scale**2)
    f = accounting.compose([(c, 100)])
    assert f.rho == pytest.approx(100 * 784 * rho, rel=1e-12)
    assert f.epsilon == accounting.discrete_gaussian_epsilon(c.scale, 255, 100 * 784, 1e-5)
    closed = f.rho + 2 * math.sqrt(f.rho * math.log(1e5))  # zCDP to (eps, delta)
    assert 13 < f.epsilon < min(closed, 16) and f.delta == 1e-5
    # two noise scales: the RDP of one Gaussian of the summed rho
    mixed = accounting.compose([(c, 100), (one, 30)])
    total = f.rho + 30 * 100 * 255**2 / (2 * one.scale**2)
    assert mixed.rho == pytest.approx(total, rel=1e-12)
    rdp = RdpAccountant(accounting.rdp_orders())  # more orders than dp-accounting's defaults
    rdp.compose(GaussianDpEvent(1 / math.sqrt(2 * total)))
    assert mixed.epsilon == pytest.approx(rdp.get_epsilon(1e-5), rel=1e-12)
    default = RdpAccountant()
    default.compose(GaussianDpEvent(1 / math.sqrt(2 * total)))
    assert mixed.epsilon <= default.get_epsilon(1e-5)  # the extra orders only tighten it
    assert mixed.epsilon <= total + 2 * math.sqrt(total * math.log(1e5))


def test_discrete_gaussian_composition_keeps_the_point_mass_as_a_union_term():
    cs = [calibrate(mechanism="tldp", noise="discrete-gaussian", budget="element", epsilon=2.0,
                    range_width=4, elements=i) for i in (1, 3)]
    f = accounting.compose([(cs[0], 5), (cs[1], 2)])
    closed = 1 - (1 - cs[0].p) ** 5 * (1 - cs[1].p) ** 6
    assert cs[0].p > 0.05 and f.point_mass_delta == pytest.approx(closed, rel=1e-12)
    assert f.delta == pytest.approx(1e-5 + closed, rel=1e-12)


def test_discrete_laplace_records_compose_against_brute_force():
    """Records of 2 and 3 elements (W = 3, p far from 0), 3 and 2 of them: pure eps adds up
    exactly; the (eps, delta) holds for the exact loss distribution of all 12 elements and
    is tight to a bin per element."""

    cs = [calibrate(mechanism="tldp", noise="discrete-laplace", budget="element", epsilon=1.0,
                    range_width=3, elements=i) for i in (2, 3)]
    f = accounting.compose([(cs[0], 3), (cs[1], 2)])
    elements = [accounting.discrete_laplace_element_epsilon(2, c.scale, c.log_p) for c in cs]
    assert cs[0].p > 0.05 and f.delta == 0 and f.point_mass_delta == 0
    assert f.epsilon == pytest.approx(6 * elements[0] + 6 * elements[1], rel=1e-12)
    dist = composed_losses([mixture_loss_atoms(2, c.scale, c.p) for c in cs for _ in range(6)])
    certified, exact = f.approx_epsilon, exact_epsilon(dist, 1e-5)
    assert exact_delta(dist, certified) <= 1e-5
    rho = sum(6 * e**2 / 2 for e in elements)
    interval = max(1e-4, math.sqrt(2 * rho) / 2000)
    assert exact <= certified <= exact + 2 * 12 * interval < 0.95 * f.epsilon


def test_many_discrete_laplace_records_compose_below_basic_composition():
    """Baseline, each record of 784 elements eps 1: 2000 records were 2000 by basic
    composition; the composed privacy-loss distribution is far lower, and at most the
    zCDP bound that pure eps implies."""
    c = calibrate(mechanism="baseline", noise="discrete-laplace", budget="record", epsilon=1.0,
                  range_width=256, elements=784)
    f = accounting.compose([(c, 2000)])
    element = accounting.discrete_laplace_element_epsilon(255, c.scale, c.log_p)
    rho = 2000 * 784 * element**2 / 2
    assert f.epsilon == pytest.approx(2000.0, rel=1e-9)
    assert f.approx_epsilon <= rho + 2 * math.sqrt(rho * math.log(1e5)) < 100
