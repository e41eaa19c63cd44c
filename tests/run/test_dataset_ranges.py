"""--range NAME=LO:HI: one declared range per dataset or tensor (issue 17), for variables in
different units in one run. Inputs are written with netCDF4 and safetensors, outputs read
back with them."""

import json

import numpy as np
import pytest

from tests.builders import SEED, assert_one_line_error, siblings, write_safetensors
from tldp_cli.privacy import accounting
from tldp_cli.privacy.mechanisms import calibrate
from tldp_cli.run import manifest

netCDF4 = pytest.importorskip("netCDF4")

RNG = np.random.default_rng(17)
T2M = RNG.uniform(230, 310, (40, 3, 4)).astype(np.float32)  # kelvin
TP = RNG.uniform(0, 0.3, (40, 3, 4)).astype(np.float32)  # metres of rain


def write_weather(path):
    with netCDF4.Dataset(path, "w") as nc:
        for dim, size in zip(("time", "lat", "lon"), T2M.shape):
            nc.createDimension(dim, size)
        for name, values in (("t2m", T2M), ("tp", TP)):
            nc.createVariable(name, "f4", ("time", "lat", "lon"))[:] = values
    return path


def test_each_variable_gets_its_own_range(cli, tmp_path):
    src = write_weather(tmp_path / "era.nc")
    result = cli("perturb", src, "--eps", "2", "--sampler", "float", "--range", "t2m=200:330",
                 "--range", "tp=0:0.5", "--json")
    assert result.exit_code == 0, result.stderr
    m = json.loads(result.stdout)
    assert m["value_ranges"] == {"/t2m": [200.0, 330.0], "/tp": [0.0, 0.5]}
    # each variable calibrated to its own width: Laplace b = W / eps, one calibration per range
    expected = {calibrate(mechanism="tldp", noise="laplace", budget="element", epsilon=2.0, range_width=w,
                          elements=12).scale for w in (130.0, 0.5)}
    assert sorted(c["noise_scale"] for c in m["calibrations"]) == pytest.approx(sorted(expected))
    calibs = [calibrate(mechanism="tldp", noise="laplace", budget="element", epsilon=2.0, range_width=w,
                        elements=12) for w in (130.0, 0.5)]
    # row i of t2m and of tp is one subject's record: the two compose
    certified = accounting.certify_all(calibs, [calibs])
    assert m["row_datasets"] == [["/t2m", "/tp"]]
    assert m["accounting"]["per_record"]["epsilon"] == pytest.approx(certified.per_record.epsilon)
    with netCDF4.Dataset(tmp_path / "era.tldp.nc") as nc:
        t2m, tp = nc["t2m"][:].filled(np.nan), nc["tp"][:].filled(np.nan)
    # kept values are the raw ones; the noise on tp is on the scale of 0.5, not of 130
    assert np.isfinite(t2m).all() and np.isfinite(tp).all()
    assert np.median(np.abs(tp - TP)) < 1 and np.median(np.abs(t2m - T2M)) > 5


def test_a_bare_range_is_the_default_for_the_others(cli, tmp_path):
    src = write_weather(tmp_path / "era.nc")
    result = cli("plan", src, "--eps", "1", "--range", "t2m=200:330", "--range", "0:0.5", "--json")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["value_ranges"] == {"/t2m": [200.0, 330.0], "/tp": [0.0, 0.5]}


def test_values_outside_a_variables_range_name_it(cli, tmp_path):
    src = write_weather(tmp_path / "era.nc")
    before = siblings(tmp_path)
    assert_one_line_error(cli("perturb", src, "--eps", "1", "--range", "t2m=200:330", "--range", "tp=0:0.1"),
                          1, "dataset /tp", "outside the declared range [0, 0.1]")
    assert siblings(tmp_path) == before


@pytest.mark.parametrize("args,fragment", [
    (("--range", "nope=0:1", "--range", "0:1"), "--range nope=0:1 names no array this run perturbs"),
    (("--range", "t2m=200:330"), "float32 data needs --range"),
    (("--range", "0:1", "--range", "0:2"), "a second LO:HI"),
    (("--range", "t2m=1:0", "--range", "0:1"), "empty or inverted"),
    (("--range", "t2m=200:330", "--range", "tp=0:1", "--budget", "record"), "different declared ranges"),
    (("--range", "t2m=200:330", "--clip", "1"), "not both")])
def test_usage_errors(cli, tmp_path, args, fragment):
    src = write_weather(tmp_path / "era.nc")
    for command in ("perturb", "plan"):
        assert_one_line_error(cli(command, src, "--eps", "1", *args), 2, fragment)


def test_tensor_ranges_in_a_model_file(cli, tmp_path):
    from safetensors.numpy import load_file

    src = write_safetensors(tmp_path / "m.safetensors", {"w": np.full((8, 8), 0.5, np.float32),
                                                         "b": np.full(64, 50.0, np.float32)})
    result = cli("perturb", src, "--eps", "4", "--range", "w=-1:1", "--range", "b=0:100", "--json")
    assert result.exit_code == 0, result.stderr
    m = json.loads(result.stdout)
    assert m["value_ranges"] == {"w": [-1.0, 1.0], "b": [0.0, 100.0]}
    assert len({t["noise_scale"] for t in m["accounting"]["per_tensor"]}) == 2
    out = load_file(str(tmp_path / "m.tldp.safetensors"))
    assert out["w"].dtype == np.float32 and np.isfinite(out["b"]).all()


@pytest.mark.damaged_manifests
@pytest.mark.parametrize("sampler", ["exact", "float"])
def test_evaluate_checks_each_variable_against_its_own_range(cli, tmp_path, sampler):
    """evaluate recomputes the run's plan with each variable's range and grid: every check
    passes on a true manifest, and the parameters check fails when a range is changed."""
    src = write_weather(tmp_path / "era.nc")
    result = cli("perturb", src, "--eps", "2", "--sampler", sampler, "--range", "t2m=200:330",
                 "--range", "tp=0:0.5", "--seed", "5", "--allow-weak-seed")
    assert result.exit_code == 0, result.stderr
    out = tmp_path / "era.tldp.nc"
    report = cli("evaluate", src, out, "--json")
    assert report.exit_code == 0, report.stderr
    checks = {c["check"]: c["passed"] for c in json.loads(report.stdout)["checks"]}
    assert checks["parameters"] and checks["noise_norm"] and checks["noise_distribution"] is not False
    manifest = tmp_path / "era.tldp.nc.manifest.json"
    m = json.loads(manifest.read_text())
    m["value_ranges"]["/tp"] = [0.0, 5.0]
    manifest.write_text(json.dumps(m))
    tampered = cli("evaluate", src, out, "--json")
    assert tampered.exit_code == 1
    assert not {c["check"]: c["passed"] for c in json.loads(tampered.stdout)["checks"]}["parameters"]


def test_evaluate_passes_a_run_of_integer_and_float_arrays(cli, tmp_path):
    """Regression: an 8-bit array at its dtype's range beside a float one with --range NAME
    (a dataset of images and embeddings) made evaluate's parameters check fail on a true
    manifest: it resolved the top-level grid from every array's dtype, not from the largest
    record's range group's (granularity None, recomputed 0.25)."""
    h5py = pytest.importorskip("h5py")
    with h5py.File(tmp_path / "m.h5", "w") as f:
        f["img"] = RNG.integers(0, 256, (5, 4, 4), dtype=np.uint8)
        f["emb"] = RNG.random((5, 3)).astype(np.float32)
    result = cli("perturb", tmp_path / "m.h5", "--eps", "1", "--range", "emb=0:1")
    assert result.exit_code == 0, result.stderr
    report = cli("evaluate", tmp_path / "m.h5", tmp_path / "m.tldp.h5", "--json")
    assert report.exit_code == 0, report.stdout + report.stderr
    assert {c["check"]: c["passed"] for c in json.loads(report.stdout)["checks"]}["parameters"]


@pytest.mark.parametrize("dtypes,float_dtype,expected", [
    (["int16", "int32"], "float32", "int32"),  # all integer: widened as needed
    (["int16", "float32"], "float32", "float32"),  # int16 values are exact in float32
    (["int32", "float32"], "float32", "float64"),  # int32 values are not
    (["int8", "float32"], "float64", "float64"),  # --dtype float64
    (["float32", "float64"], "float32", "float64"),
])
def test_arrays_perturbed_together_share_one_output_dtype(dtypes, float_dtype, expected):
    from tldp_cli.run.calibration import _shared_dtype

    assert _shared_dtype([np.dtype(d) for d in dtypes], np.dtype(float_dtype)) == np.dtype(expected)


def test_integer_datasets_of_two_dtypes_need_no_range(cli, tmp_path):
    """uint8 and uint16 datasets sharing rows (h5py): each at its dtype's range, without
    --range; a record (one row of each) composes its two parts, which the run says."""
    h5py = pytest.importorskip("h5py")
    a = np.full((10, 8, 8), 128, np.uint8)
    with h5py.File(tmp_path / "two.h5", "w") as f:
        f["a"] = a
        f["b"] = RNG.integers(0, 4000, (10, 8, 8)).astype(np.uint16)
    result = cli("perturb", tmp_path / "two.h5", "--eps", "1", "--json", "--seed", SEED)
    assert result.exit_code == 0, result.stderr
    m = json.loads(result.stdout)
    assert m["value_ranges"] == {"/a": [0, 256], "/b": [0, 65536]}
    assert [g["value_range"] for g in m["range_groups"]] == [[0, 256], [0, 65536]]
    calibs = [calibrate(mechanism="tldp", noise="discrete-laplace", budget="element", epsilon=1.0,
                        range_width=w, elements=64) for w in (256, 65536)]
    assert m["accounting"]["per_record"] == manifest.scope_entry(accounting.certify_all(calibs, [calibs]).per_record)
    assert "A record spanning several ranges (a row of /a, /b) composes its parts" in result.stderr
    with h5py.File(tmp_path / "two.tldp.h5") as f:  # the uint8 dataset's noise is of scale 256
        noise = f["a"][()].astype(np.int64) - a  # median |Laplace| = b ln 2 (640 values: within 15%)
    assert abs(np.median(np.abs(noise)) / (256 * np.log(2)) - 1) < 0.15
    assert_one_line_error(cli("perturb", tmp_path / "two.h5", "--eps", "1", "--budget", "record"), 2,
                          "different declared ranges")


def test_an_array_without_a_range_is_named_where_there_are_several(cli, tmp_path):
    """Regression: "era.nc: float32 data needs --range LO:HI" did not say which of the arrays
    (a WebDataset's .npy member, a variable) needs one, nor the --range NAME=LO:HI naming it."""
    src = write_weather(tmp_path / "era.nc")
    for command in ("perturb", "plan"):
        assert_one_line_error(cli(command, src, "--eps", "1", "--range", "t2m=200:330"), 2,
                              "era.nc: /tp: float32 data needs --range LO:HI (or --range /tp=LO:HI")


def test_privunit_over_a_row_of_two_ranges_does_not_suggest_an_element_budget(cli, tmp_path):
    """Regression: privunit on a record spanning two declared ranges (a WebDataset sample's
    image and float embedding) said "or use --budget element", which privunit refuses."""
    src = write_weather(tmp_path / "era.nc")
    result = cli("perturb", src, "--eps", "4", "--mechanism", "privunit", "--range", "t2m=200:330",
                 "--range", "tp=0:0.5")
    assert_one_line_error(result, 2, "--mechanism privunit: a record spans", "different declared ranges")
    assert "--budget element" not in result.stderr
