"""Zarr stores written by xarray (to_zarr, Zarr formats 2 and 3) get the CF handling netCDF
files get: coordinates left alone, missing values (fill values, NaN) kept missing, packed
variables unpacked, value bounds dropped, the _FillValue rewritten for the output dtype.
Every output is read back with xarray."""

import json
from pathlib import Path

import numpy as np
import pytest

from tldp_cli.formats import leftovers
from tldp_cli.run.pipeline import PerturbOptions, perturb as perturb_file

xr = pytest.importorskip("xarray")

# zarr warns that consolidated metadata is not part of the format 3 spec.
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

FORMATS = [2, 3]


def era_store(path: Path, zarr_format: int) -> tuple[Path, xr.Dataset]:
    """t2m packed as int16 (K = code * 0.01 + 265, _FillValue -9999, a valid_range) and tp
    float32 with _FillValue -1.0 and values near 0 (so noisy values land on -1), each with
    missing values; 2-D lat/lon coordinates named in `coordinates`, a time axis with bounds."""
    rng = np.random.default_rng(3)
    t2m = np.round(rng.uniform(250, 290, (10, 100, 100)), 2)
    tp = (0.01 * rng.random((10, 100, 100))).astype(np.float32)
    t2m[0, 0, :3] = np.nan
    tp[4, 5, 6] = np.nan
    y, x = np.meshgrid(np.arange(100.0), np.arange(100.0), indexing="ij")
    time = np.arange(10.0)
    ds = xr.Dataset(
        {"t2m": (("time", "y", "x"), t2m, {"units": "K", "valid_range": [200.0, 330.0]}),
         "tp": (("time", "y", "x"), tp, {"units": "m"}),
         "time_bnds": (("time", "nv"), np.stack([time - 0.5, time + 0.5], axis=1))},
        coords={"time": ("time", time, {"bounds": "time_bnds"}),
                "lat": (("y", "x"), 40 + y / 10), "lon": (("y", "x"), x / 10)})
    ds.to_zarr(path, zarr_format=zarr_format, encoding={
        "t2m": {"dtype": "int16", "scale_factor": 0.01, "add_offset": 265.0, "_FillValue": -9999},
        "tp": {"_FillValue": np.float32(-1.0)}})
    return path, ds


def perturb(cli, src: Path, out: Path, *more) -> tuple[dict, str]:
    result = cli("perturb", src, "--out", out, "--eps", "1", "--seed", "7", "--allow-weak-seed",
                 "--allow-raw-release", *more)
    assert result.exit_code == 0, result.stderr
    return json.loads(Path(f"{out}.manifest.json").read_text()), result.stderr


@pytest.mark.parametrize("zarr_format", FORMATS)
def test_xarray_stores_are_perturbed_as_cf_variables(cli, tmp_path, zarr_format):
    src, ds = era_store(tmp_path / "era.zarr", zarr_format)
    out = tmp_path / "out.zarr"
    manifest, stderr = perturb(cli, src, out, "--range", "t2m=200:330", "--range", "tp=0:0.5")
    assert [entry["dataset"] for entry in manifest["inputs"]] == ["t2m", "tp"]  # not lat, lon, time_bnds
    # Not perturbed, and copied (the line once said "left out", which means not written)
    assert "not perturbing the coordinate arrays lat, lon" in stderr and "left out the coordinate" not in stderr
    assert {"lat", "lon"} == {u["name"] for u in manifest["unperturbed"] if u["reason"] == "coordinate"}
    # The records run along time: time(time) and its bounds hold a value per record, left out
    dropped = {d["name"]: d["reason"] for d in manifest["dropped"]}
    assert dropped["time"] == dropped["time_bnds"] == leftovers.RECORD_COORDINATE_REASON
    assert manifest["unpacked"]["t2m"]["stored_dtype"] == "int16"
    assert manifest["dropped_attributes"]["t2m"] == ["valid_range", "scale_factor", "add_offset"]
    assert manifest["missing_values"]["tp"]["moved_off_markers"] > 0  # the seed lands noisy values on -1
    before = xr.open_zarr(src)
    after = xr.open_zarr(out)
    for name in ("lat", "lon"):
        np.testing.assert_array_equal(after[name].values, before[name].values)
    assert "time_bnds" not in after and "time" not in after.variables  # a default index
    np.testing.assert_array_equal(after.get_index("time"), np.arange(10))
    for name in ("t2m", "tp"):
        np.testing.assert_array_equal(after[name].isnull().values, np.isnan(ds[name].values))
        assert after[name].dtype.kind == "f"
    assert after["t2m"].attrs == {"units": "K"}
    assert after["t2m"].encoding["_FillValue"] == -9999 and "scale_factor" not in after["t2m"].encoding
    error = (after["t2m"] - ds["t2m"]).values
    scale = manifest["value_ranges"]["t2m"][1] - manifest["value_ranges"]["t2m"][0]  # b = range / eps
    assert abs(np.nanmedian(error)) < 0.1 * scale and np.nanmedian(np.abs(error)) < scale


@pytest.mark.parametrize("zarr_format", FORMATS)
def test_a_float_output_of_packed_codes_opens_in_xarray(cli, tmp_path, zarr_format):
    """--sampler float writes float32: the _FillValue attribute follows (xarray decodes a
    float one from base64 in Zarr 3, and refused the int it was)."""
    src, ds = era_store(tmp_path / "era.zarr", zarr_format)
    out = tmp_path / "out.zarr"
    perturb(cli, src, out, "--dataset", "t2m", "--sampler", "float", "--range", "200:330", "--keep", "tp")
    after = xr.open_zarr(out)
    assert after["t2m"].dtype == np.float32
    assert int(after["t2m"].isnull().sum()) == 3
    np.testing.assert_array_equal(after["tp"].values, xr.open_zarr(src)["tp"].values)  # kept raw


def test_nan_in_an_xarray_store_is_missing_data(cli, tmp_path):
    values = np.random.default_rng(1).random((6, 4, 5)).astype(np.float32)
    values[2, 1, 1] = np.nan
    src = tmp_path / "nan.zarr"
    xr.Dataset({"v": (("t", "y", "x"), values)}).to_zarr(src, zarr_format=3)
    out = tmp_path / "out.zarr"
    result = cli("perturb", src, "--out", out, "--eps", "1", "--range", "0:1", "--allow-raw-release")
    assert result.exit_code == 0, result.stderr
    after = xr.open_zarr(out)["v"].values
    np.testing.assert_array_equal(np.isnan(after), np.isnan(values))


@pytest.mark.parametrize("zarr_format", FORMATS)
def test_a_fill_value_the_output_dtype_cannot_hold_stays_missing(cli, tmp_path, zarr_format):
    """netCDF's default int fill (-2147483647) on int32 codes of small values: the int16
    output's fill value used to wrap to 1 in Zarr 2's metadata (where xarray reads the
    _FillValue), so xarray masked every noisy 1 and showed the missing cells as -32768."""
    values = np.arange(10000.0).reshape(200, 50) % 7
    values[0, 0] = np.nan
    src = tmp_path / "codes.zarr"
    xr.Dataset({"v": (("t", "x"), values)}).to_zarr(src, zarr_format=zarr_format, encoding={
        "v": {"dtype": "int32", "_FillValue": -2147483647}})
    out = tmp_path / "out.zarr"
    manifest, _ = perturb(cli, src, out, "--range", "0:100")
    assert manifest["missing_values"]["v"]["output"] == [-32768]
    after = xr.open_zarr(out)["v"]
    assert after.encoding["_FillValue"] == -32768
    np.testing.assert_array_equal(after.isnull().values, np.isnan(values))


def test_a_null_fill_value_attribute_is_kept_beside_the_markers_rewritten(cli, tmp_path):
    """A packed Zarr 2 array whose _FillValue attribute is JSON null (no fill value) and whose
    missing_value marks the missing codes: the null stays, the marker is rewritten and still
    marks them (the null crashed the run)."""
    zarr = pytest.importorskip("zarr")
    src = tmp_path / "packed.zarr"
    codes = np.arange(30, dtype=np.int16).reshape(10, 3)
    codes[0, 0] = -1
    array = zarr.open_array(src, mode="w", shape=codes.shape, dtype="i2", zarr_format=2, fill_value=None)
    array[:] = codes
    array.attrs.update({"_ARRAY_DIMENSIONS": ["t", "x"], "scale_factor": 0.5, "_FillValue": None,
                        "missing_value": -1})
    out = tmp_path / "out.zarr"
    perturb(cli, src, out, "--range", "0:20")
    after = zarr.open_array(out, mode="r")
    assert after.attrs["_FillValue"] is None
    marker = after.attrs["missing_value"]
    assert after[0, 0] == marker and np.count_nonzero(after[:] == marker) == 1


@pytest.mark.parametrize("zarr_format", FORMATS)
def test_coordinates_along_the_record_axis_are_left_out(cli, tmp_path, zarr_format):
    """xarray's elev(station) and subject_id(station) hold a value per record, not a grid: left
    out and listed as dropped unless --keep names them; time, a dimension coordinate, stays."""
    src = tmp_path / "stations.zarr"
    xr.Dataset({"temp": (("station", "time"), np.random.default_rng(1).uniform(0, 1, (5, 3)))},
               coords={"time": np.arange(3), "elev": ("station", np.arange(5.0) * 100),
                       "subject_id": ("station", np.arange(1001, 1006))}).to_zarr(src, zarr_format=zarr_format)
    manifest, _ = perturb(cli, src, tmp_path / "out.zarr", "--range", "0:1")
    assert [u["name"] for u in manifest["unperturbed"]] == ["time"]
    assert {d["name"] for d in manifest["dropped"]} == {"elev", "subject_id"}
    with xr.open_zarr(tmp_path / "out.zarr") as ds:
        assert set(ds.variables) == {"temp", "time"}
        np.testing.assert_array_equal(ds["time"].values, np.arange(3))
    manifest, _ = perturb(cli, src, tmp_path / "kept.zarr", "--range", "0:1", "--keep", "subject_id")
    assert {u["name"]: u["reason"] for u in manifest["unperturbed"]} == {"subject_id": "kept by --keep",
                                                                         "time": "coordinate"}
    with xr.open_zarr(tmp_path / "kept.zarr") as ds:
        np.testing.assert_array_equal(ds["subject_id"].values, np.arange(1001, 1006))
        assert "elev" not in ds.variables


@pytest.mark.parametrize("zarr_format", FORMATS)
def test_the_coordinates_attribute_names_no_array_left_out(cli, tmp_path, zarr_format):
    """temp's `coordinates` named elev and subject_id after the run left them out (CF readers
    look for each): it names what is written, and is left out when nothing it names is."""
    import zarr

    src = tmp_path / "stations.zarr"
    xr.Dataset({"temp": (("station", "time"), np.random.default_rng(1).uniform(0, 1, (5, 3)))},
               coords={"time": np.arange(3), "elev": ("station", np.arange(5.0) * 100),
                       "subject_id": ("station", np.arange(1001, 1006))}).to_zarr(src, zarr_format=zarr_format)
    perturb(cli, src, tmp_path / "out.zarr", "--range", "0:1")
    perturb(cli, src, tmp_path / "kept.zarr", "--range", "0:1", "--keep", "elev")
    assert "coordinates" not in zarr.open_array(tmp_path / "out.zarr/temp", mode="r").attrs
    assert zarr.open_array(tmp_path / "kept.zarr/temp", mode="r").attrs["coordinates"] == "elev"
    with xr.open_zarr(tmp_path / "kept.zarr", decode_coords="all") as ds:
        assert set(ds.coords) == {"time", "elev"}


@pytest.mark.parametrize("zarr_format", FORMATS)
def test_a_trajectorys_track_is_left_out(cli, tmp_path, zarr_format):
    """xarray's CF trajectories (discrete sampling geometry): time, lat and lon (trajectory, obs)
    hold each record's track and trajectory(trajectory) its identifier (cf_role): left out and
    listed as dropped unless --keep names them, the data's coordinates attribute naming the rest;
    x(x), a dimension coordinate, and a grid not along the record axis, stay."""
    src, rng = tmp_path / "tracks.zarr", np.random.default_rng(2)
    start = np.datetime64("2026-01-01T00:00")
    xr.Dataset({"temp": (("trajectory", "obs"), rng.uniform(270, 290, (3, 4)), {"units": "K"}),
                "depth": (("trajectory", "obs", "x"), rng.uniform(0, 1, (3, 4, 2)))},
               coords={"trajectory": ("trajectory", [1001, 1002, 1003], {"cf_role": "trajectory_id"}),
                       "time": (("trajectory", "obs"), start + np.arange(12).reshape(3, 4) * np.timedelta64(1, "m")),
                       "lat": (("trajectory", "obs"), 48 + rng.uniform(0, 1, (3, 4)), {"units": "degrees_north"}),
                       "lon": (("trajectory", "obs"), 2 + rng.uniform(0, 1, (3, 4)), {"units": "degrees_east"}),
                       "x": ("x", [0.5, 1.5]), "x_edge": (("x",), [0.0, 1.0])},
               attrs={"featureType": "trajectory"}).to_zarr(src, zarr_format=zarr_format)
    manifest, _ = perturb(cli, src, tmp_path / "out.zarr", "--range", "0:300")
    assert [i["dataset"] for i in manifest["inputs"]] == ["depth", "temp"]
    assert {u["name"]: u["reason"] for u in manifest["unperturbed"]} == {"x": "coordinate", "x_edge": "coordinate"}
    assert {d["name"] for d in manifest["dropped"] if d["kind"] == "array"} == {"trajectory", "time", "lat", "lon"}
    with xr.open_zarr(tmp_path / "out.zarr") as ds:
        assert set(ds.variables) == {"temp", "depth", "x", "x_edge"}
        assert set(ds["temp"].coords) == set() and ds["temp"].shape == (3, 4)
        np.testing.assert_array_equal(ds["x_edge"].values, [0.0, 1.0])
    manifest, _ = perturb(cli, src, tmp_path / "kept.zarr", "--range", "0:300", "--keep", "time")
    assert {"name": "time", "kind": "array", "shape": [3, 4], "dtype": "int64",
            "reason": "kept by --keep"} in manifest["unperturbed"]
    with xr.open_zarr(tmp_path / "kept.zarr") as ds:
        assert set(ds["temp"].coords) == {"time"}
        assert ds["time"].values[2, 3] == start + np.timedelta64(11, "m")


@pytest.mark.parametrize("zarr_format", FORMATS)
def test_a_parent_groups_coordinates_along_the_record_axis_are_left_out(cli, tmp_path, zarr_format):
    """xarray's DataTree: elev(station) in the root group, named by the root's own coordinates
    attribute, runs along the record dimension of /child/temp(station, time), which the child
    takes from its parent: left out, the root's coordinates attribute left out with it."""
    src = tmp_path / "tree.zarr"
    xr.DataTree.from_dict({"/": xr.Dataset(coords={"elev": ("station", np.arange(5.0) * 100)}),
                           "/child": xr.Dataset({"temp": (("station", "time"), np.random.default_rng(4).uniform(
                               0, 1, (5, 3)))})}).to_zarr(src, zarr_format=zarr_format)
    manifest, _ = perturb(cli, src, tmp_path / "out.zarr", "--range", "0:1")
    assert [i["dataset"] for i in manifest["inputs"]] == ["child/temp"]
    assert "unperturbed" not in manifest
    assert {d["name"]: d["reason"] for d in manifest["dropped"]}["elev"].startswith("a coordinate along the record")
    tree = xr.open_datatree(tmp_path / "out.zarr", engine="zarr")
    assert "elev" not in tree.variables and "coordinates" not in tree.attrs
    assert tree["child/temp"].shape == (5, 3)


@pytest.mark.parametrize("zarr_format", FORMATS)
def test_privunit_releases_a_record_with_missing_values_from_its_own_values(tmp_path, zarr_format):
    """privunit projects whole records: record 3's missing positions held its block's first
    present value, record 0's, so its release depended on record 0's raw value and on the
    blocks. Two stores that differ in that value alone, cut into one block or into blocks of
    one record (one chunk each) on two threads, now give record 3 the same release."""
    values = np.random.default_rng(1).uniform(0, 1, (8, 16, 16)).astype(np.float32)
    values[3, :8] = np.nan
    written = []
    for first in (0.1, 0.9):
        values[0, 0, 0] = first
        src = tmp_path / f"in{first}.zarr"
        xr.Dataset({"v": (("t", "y", "x"), values)}).to_zarr(
            src, zarr_format=zarr_format, encoding={"v": {"chunks": (1, 16, 16)}})
        for cut in ({}, {"block_elements": 256, "workers": 2}):
            for seed in ("1", "2", "3"):
                out = tmp_path / f"out{first}-{len(cut)}-{seed}.zarr"
                perturb_file(PerturbOptions(input=src, out=out, mechanism="privunit", eps=4.0, value_range=(0.0, 1.0),
                                            seed=seed, allow_weak_seed=True, **cut))
                written.append(xr.open_zarr(out)["v"].values)
    for seed in range(3):
        runs = written[seed::3]
        for after in runs:
            np.testing.assert_array_equal(np.isnan(after), np.isnan(values))  # the markers come back
            np.testing.assert_array_equal(after[1:], runs[0][1:])  # every record but record 0


@pytest.mark.parametrize("zarr_format", FORMATS)
def test_ancillary_variables_and_formula_terms_name_no_array_left_out(cli, tmp_path, zarr_format):
    """As in netCDF (test_netcdf.py): temp's ancillary_variables names only what is written,
    lev's formula_terms naming arrays left out is left out whole, and xarray decodes the
    store without a warning."""
    import warnings

    import zarr

    from tests.formats.test_netcdf import sigma_dataset

    src = tmp_path / "sigma.zarr"
    sigma_dataset().to_zarr(src, zarr_format=zarr_format)
    perturb(cli, src, tmp_path / "out.zarr", "--dataset", "temp", "--range", "200:330")
    perturb(cli, src, tmp_path / "kept.zarr", "--dataset", "temp", "--range", "200:330", "--keep", "temp_qc")
    assert "ancillary_variables" not in zarr.open_array(tmp_path / "out.zarr/temp", mode="r").attrs
    assert "formula_terms" not in zarr.open_array(tmp_path / "out.zarr/lev", mode="r").attrs
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with xr.open_zarr(tmp_path / "out.zarr", decode_coords="all", consolidated=False) as ds:
            assert set(ds.variables) == {"temp", "lev"}
            assert ds["lev"].attrs["standard_name"] == "atmosphere_sigma_coordinate"
        with xr.open_zarr(tmp_path / "kept.zarr", decode_coords="all", consolidated=False) as ds:
            assert ds["temp"].attrs["ancillary_variables"] == "temp_qc" and "temp_qc" in ds.variables
