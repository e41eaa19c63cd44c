"""Rows are subjects: arrays perturbed together that share axis 0 form one record per row."""

import json

import h5py
import numpy as np
import pytest
import zarr

from tldp_cli.privacy import accounting
from tldp_cli.privacy.mechanisms import calibrate

RNG = np.random.default_rng(4)
IMAGES = RNG.integers(0, 256, (20, 8, 8), dtype=np.uint8)
MASKS = RNG.integers(0, 256, (20, 8, 8), dtype=np.uint8)


def two_datasets(path, second_records=20):
    with h5py.File(path, "w") as f:
        f["a"] = IMAGES
        f["b"] = MASKS[:second_records]
    return path


def run(cli, src, *args):
    result = cli("perturb", src, "--json", "-q", *args)
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


def test_a_row_across_two_datasets_is_one_record(cli, tmp_path):
    """Two 8x8 datasets at --eps 1 reported 64 per record where row i loses 128."""
    m = run(cli, two_datasets(tmp_path / "two.h5"), "--eps", "1")
    assert m["row_datasets"] == [["/a", "/b"]]
    # the default exact sampler on uint8: discrete Laplace of b = 256 / eps over a sensitivity of
    # 255 steps, so each element costs 255/256 and the row 128 of them
    assert m["noise"] == "discrete-laplace"
    assert m["accounting"]["per_element"]["epsilon"] == pytest.approx(255 / 256)
    assert m["accounting"]["per_record"]["epsilon"] == pytest.approx(128 * 255 / 256)
    evaluated = cli("evaluate", tmp_path / "two.h5", tmp_path / "two.tldp.h5")
    assert evaluated.exit_code == 0, evaluated.stderr


@pytest.mark.parametrize("noise, mechanism", [("laplace", "baseline"), ("gaussian", "baseline"),
                                              ("discrete-gaussian", "baseline"), ("gaussian", "tldp"),
                                              ("discrete-laplace", "tldp")])
def test_record_budget_is_met_by_the_row_not_each_dataset(cli, tmp_path, noise, mechanism):
    # laplace and gaussian: the continuous noises (--sampler float), against their calibration
    sampler = () if noise.startswith("discrete") else ("--sampler", "float")
    m = run(cli, two_datasets(tmp_path / "two.h5"), "--eps", "20", "--budget", "record",
            "--noise", noise, "--mechanism", mechanism, "--allow-raw-release", *sampler)
    assert m["noise"] == noise
    record = m["accounting"]["per_record"]
    assert record["epsilon"] <= 20
    assert record["epsilon"] == pytest.approx(20, rel=1e-3)  # tight: the noise of one 128-element record
    whole = calibrate(mechanism=mechanism, noise=noise, budget="record", epsilon=20.0,
                      range_width=256.0 if not noise.startswith("discrete") else 256, elements=128)
    assert m["noise_scale"] == pytest.approx(whole.scale, rel=1e-3)
    evaluated = cli("evaluate", tmp_path / "two.h5", tmp_path / "two.tldp.h5")
    assert evaluated.exit_code == 0, evaluated.stderr


# b = I Delta / eps over the row's 128 elements: Delta = 255 grid steps for the default exact
# sampler's discrete Laplace on uint8, the range width 256 for continuous Laplace.
@pytest.mark.parametrize("sampler, delta", [("exact", 255), ("float", 256)])
def test_laplace_record_budget_splits_by_elements_exactly(cli, tmp_path, sampler, delta):
    m = run(cli, two_datasets(tmp_path / "two.h5"), "--eps", "20", "--budget", "record",
            "--mechanism", "baseline", "--sampler", sampler)
    assert m["noise_scale"] == pytest.approx(128 * delta / 20)
    assert m["accounting"]["per_record"]["epsilon"] == pytest.approx(20)


def test_unrelated_first_axes_stay_separate_scopes(cli, tmp_path):
    src = two_datasets(tmp_path / "two.h5", second_records=12)
    m = run(cli, src, "--eps", "1", "--dataset", "a", "--dataset", "b")
    assert "row_datasets" not in m
    # 64 elements of 255/256 each (discrete Laplace on uint8, the default exact sampler), not 128
    assert m["accounting"]["per_record"]["epsilon"] == pytest.approx(64 * 255 / 256)


def test_zarr_arrays_sharing_rows_compose_too(cli, tmp_path):
    group = zarr.open_group(tmp_path / "s.zarr", mode="w", zarr_format=3)
    group.create_array("x", shape=IMAGES.shape, dtype="uint8", chunks=(5, 8, 8))[:] = IMAGES
    group.create_array("y", shape=(20, 4), dtype="uint8", chunks=(5, 4))[:] = MASKS[:, 0, :4]
    m = run(cli, tmp_path / "s.zarr", "--eps", "1", "--noise", "gaussian", "--allow-raw-release")
    assert m["row_datasets"] == [["x", "y"]]
    # the default exact sampler: discrete Gaussian on the integers (W = 256 values, 255 steps)
    assert m["noise"] == "discrete-gaussian"
    x = calibrate(mechanism="tldp", noise="discrete-gaussian", budget="element", epsilon=1.0,
                  range_width=256, elements=64)
    y = calibrate(mechanism="tldp", noise="discrete-gaussian", budget="element", epsilon=1.0,
                  range_width=256, elements=4)
    expected = accounting.compose([(x, 1), (y, 1)])
    # rho = 255^2 / (2 sigma^2) per element, sigma = 256 / sqrt(2 eps): 68 elements of (255/256)^2
    assert m["accounting"]["per_record"]["rho"] == pytest.approx(68 * (255 / 256) ** 2)
    assert m["accounting"]["per_record"]["epsilon"] == pytest.approx(expected.epsilon)


@pytest.mark.parametrize("writer", ["netcdf4", "h5netcdf", "zarr2", "zarr3"])
def test_named_dimensions_decide_which_arrays_share_rows(cli, tmp_path, writer):
    """xarray's v(time=10, ...) and orog(y=10, x) have 10 rows each, but time step i and
    latitude row i are not one subject: each is a record scope of its own. t2m(time, ...)
    shares v's rows, and the summary counts one record per time step of both."""
    xr = pytest.importorskip("xarray")
    values = RNG.random((10, 10, 4))
    ds = xr.Dataset({"v": (("time", "y", "x"), values), "t2m": (("time", "y", "x"), values),
                     "orog": (("y", "x"), values[0])})
    src = tmp_path / ("eq.zarr" if writer.startswith("zarr") else "eq.nc")
    if src.suffix == ".nc":
        ds.to_netcdf(src, engine=writer)
    else:
        ds.to_zarr(src, zarr_format=int(writer[-1]))
    result = cli("perturb", src, "--eps", "1", "--range", "0:1", "--allow-raw-release", "--json")
    assert result.exit_code == 0, result.stderr
    m = json.loads(result.stdout)
    rows = [sorted(name.strip("/") for name in row) for row in m["row_datasets"]]
    assert rows == [["t2m", "v"]]
    assert m["row_records"]["records"] == 10 + 10  # the time steps, and orog's rows
    assert m["row_records"]["elements_per_record"] == 80  # one time step of v and of t2m
    assert "20 records of up to 80 elements" in result.stderr
    # pure discrete Laplace at --eps 1: a record's epsilon is at most 80 x 1 (with orog's row, 84 x 1.05)
    assert 79 < m["accounting"]["per_record"]["epsilon"] <= 80


@pytest.mark.parametrize("store", ["hdf5", "zarr"])
def test_an_unnamed_first_axis_shares_the_rows_of_a_named_one_of_its_length(cli, tmp_path, store):
    """A plain HDF5 file where h5py's dims API named one dataset's axis 0 (a time scale) and not
    the other's, and a Zarr store where xarray named one array's dimensions and zarr-python
    added another: nothing says row i of the unnamed one is not subject i of the named one,
    so the row composes both (128 per record at --eps 1), not 64 each."""
    if store == "hdf5":
        src = tmp_path / "mixed.h5"
        with h5py.File(src, "w") as f:
            f["a"] = IMAGES
            f["t"] = np.arange(20.0)
            f["t"].make_scale("t")
            f["a"].dims[0].attach_scale(f["t"])
            f["b"] = MASKS
        names = [["/a", "/b"]]
    else:
        xr = pytest.importorskip("xarray")
        src = tmp_path / "mixed.zarr"
        xr.Dataset({"a": (("time", "y", "x"), IMAGES)}).to_zarr(src, zarr_format=3, consolidated=False)
        zarr.open_group(src, mode="a").create_array("b", data=MASKS)
        names = [["a", "b"]]
    m = run(cli, src, "--eps", "1")
    assert m["row_datasets"] == names
    assert m["accounting"]["per_record"]["epsilon"] == pytest.approx(128 * 255 / 256)
