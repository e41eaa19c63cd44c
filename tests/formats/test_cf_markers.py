"""CF missing-data markers inside the declared range (a _FillValue or missing_value of 0 on
uint8 data, zarr-python's default fill_value 0 on an xarray-style Zarr 2 array) are
ordinary values: perturbed like every other, and left off the output, so that no reader
takes a noisy value for a missing one; --public-missing keeps them missing, and the
manifest records it. Markers outside the range stay missing, and the run says so only
when the data has missing values.

Every input is written by the library people use for it (h5py, xarray with netCDF4,
zarr-python, xarray's to_zarr), and every output is read back with xarray and with
h5py, netCDF4 or zarr-python.
"""

import json
from pathlib import Path

import h5py
import numpy as np
import pytest

from tldp_cli.privacy import distributions

netCDF4 = pytest.importorskip("netCDF4")
xr = pytest.importorskip("xarray")
zarr = pytest.importorskip("zarr")

# zarr warns that consolidated metadata is not part of the format 3 spec.
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

ROWS, COLS = 4000, 20
X = np.tile(np.array([0, 200], np.uint8), (ROWS, COLS // 2))  # every other element 0, the marker


def h5py_fill(path: Path) -> Path:
    with h5py.File(path, "w") as f:
        f.create_dataset("v", data=X).attrs["_FillValue"] = np.uint8(0)
    return path


def h5py_missing_value(path: Path) -> Path:
    with h5py.File(path, "w") as f:
        f.create_dataset("v", data=X).attrs["missing_value"] = np.uint8(0)
    return path


def xarray_netcdf(path: Path) -> Path:
    xr.Dataset({"v": (("r", "c"), X)}).to_netcdf(path, engine="netcdf4",
                                                encoding={"v": {"_FillValue": np.uint8(0)}})
    return path


def zarr_python_v2(path: Path) -> Path:
    """An xarray-style Zarr 2 array (dimension names) that zarr-python made with its default
    fill_value, 0, which xarray reads as the _FillValue."""
    group = zarr.open_group(path, mode="w", zarr_format=2)
    array = group.create_array("v", shape=X.shape, dtype="uint8", chunks=(1000, COLS),
                               attributes={"_ARRAY_DIMENSIONS": ["r", "c"]})
    array[:] = X
    assert array.fill_value == 0
    return path


def xarray_zarr_v3(path: Path) -> Path:
    xr.Dataset({"v": (("r", "c"), X)}).to_zarr(path, zarr_format=3, encoding={"v": {"_FillValue": 0}})
    return path


# writer -> (builder, file name, the marker's name in the manifest)
WRITERS = {
    "h5py-_FillValue": (h5py_fill, "in.h5", "/v/_FillValue"),
    "h5py-missing_value": (h5py_missing_value, "in.h5", "/v/missing_value"),
    "xarray-netcdf4": (xarray_netcdf, "in.nc", "/v/_FillValue"),
    "zarr-python-v2": (zarr_python_v2, "in.zarr", "v/fill_value"),
    "xarray-zarr-v3": (xarray_zarr_v3, "in.zarr", "v/_FillValue"),
}


def perturb(cli, src: Path, out: Path, *more) -> tuple[dict, str]:
    result = cli("perturb", src, "--out", out, "--eps", "1", "--seed", "7", "--allow-weak-seed", *more)
    assert result.exit_code == 0, result.stderr
    return json.loads(Path(f"{out}.manifest.json").read_text()), result.stderr


def raw_output(out: Path) -> np.ndarray:
    """The output's values as stored, read with the writer's own library."""
    if out.suffix == ".zarr":
        return zarr.open_array(out / "v", mode="r")[:]
    with h5py.File(out, "r") as f:
        return f["v"][:]


def xarray_output(out: Path) -> xr.DataArray:
    """The output as xarray decodes it (masking what its CF attributes mark missing)."""
    if out.suffix == ".zarr":
        return xr.open_zarr(out, consolidated=False)["v"].load()
    with xr.open_dataset(out, engine="netcdf4") as ds:
        return ds["v"].load()


def declared_markers(out: Path) -> dict:
    """What the output declares as missing-data markers."""
    if out.suffix == ".zarr":
        array = zarr.open_array(out / "v", mode="r")
        found = {k: v for k, v in array.attrs.asdict().items() if k in ("_FillValue", "missing_value")}
        if array.metadata.zarr_format == 2 and array.fill_value is not None:
            found["fill_value"] = array.fill_value
        return found
    with h5py.File(out, "r") as f:
        return {k: f["v"].attrs[k] for k in ("_FillValue", "missing_value") if k in f["v"].attrs}


@pytest.mark.parametrize("writer", list(WRITERS))
def test_a_marker_inside_the_range_is_perturbed_like_any_value(cli, tmp_path, writer):
    """P(out = 0 | x = 0) was 1 (every 0 copied raw under a certified eps of 1.309): now it
    is the mechanism's, retain probability plus the noise's pmf at 0."""
    build, name, marker = WRITERS[writer]
    src, out = build(tmp_path / name), tmp_path / f"out{Path(name).suffix}"
    manifest, stderr = perturb(cli, src, out)
    noisy = raw_output(out).astype(np.int64)
    at_zero = noisy[X == 0]
    p, scale = manifest["retain_probability"], manifest["noise_scale"]
    assert manifest["noise"] == "discrete-laplace" and manifest["value_range"] == [0, 256]
    expected = at_zero.size * (p + (1 - p) * distributions.density_at_zero(manifest["noise"], scale))
    assert abs(np.count_nonzero(at_zero == 0) - expected) < 5 * np.sqrt(expected)  # about 108 of 40,000
    # The noise at the marker is the noise everywhere else, around the marker's own value (a
    # value standing in for it, 200, would show in the mean).
    for values in (at_zero, noisy[X == 200] - 200):
        assert distributions.chi_square(values, manifest["noise"], scale)[1] > 1e-3
        spread = np.sqrt(distributions.moments(manifest["noise"], scale)[0] / values.size)
        assert abs(values.mean()) < 5 * spread
    assert declared_markers(out) == {}
    assert manifest["dropped"] == [{"name": marker, "kind": "attribute", "reason": manifest["dropped"][0]["reason"]}]
    assert "inside the declared range" in manifest["dropped"][0]["reason"]
    assert "public_missing" not in manifest and "missing_values" not in manifest
    assert "missing-data markers inside the declared range are data" in stderr
    assert "released as is" not in stderr
    decoded = xarray_output(out)
    assert int(decoded.isnull().sum()) == 0  # no noisy value read as missing
    np.testing.assert_array_equal(decoded.values, noisy)
    if out.suffix != ".zarr":
        with netCDF4.Dataset(out) as ds:
            assert np.ma.count_masked(ds["v"][:]) == 0
    # evaluate reads the input's markers as data too: standing 200 in for them, its noise
    # checks failed
    result = cli("evaluate", src, out)
    assert result.exit_code == 0, result.stdout + result.stderr


@pytest.mark.parametrize("writer", list(WRITERS))
def test_public_missing_keeps_them_missing_and_says_what_the_figures_cover(cli, tmp_path, writer):
    build, name, marker = WRITERS[writer]
    src, out = build(tmp_path / name), tmp_path / f"out{Path(name).suffix}"
    plain, _ = perturb(cli, src, tmp_path / f"plain{Path(name).suffix}")
    manifest, stderr = perturb(cli, src, out, "--public-missing")
    noisy = raw_output(out)
    assert np.all(noisy[X == 0] == 0)  # copied, as declared
    assert np.count_nonzero(noisy[X == 200] == 200) < 0.01 * noisy.size
    public = manifest["public_missing"]
    assert public["markers"] == [{"name": marker}]
    assert "conditional on which elements are missing" in public["figures_cover"]
    assert "dropped" not in manifest
    assert manifest["accounting"]["per_element"] == plain["accounting"]["per_element"]
    assert "--public-missing: values equal to the missing-data markers inside the declared range" in stderr
    assert "released as is" in stderr  # the data holds missing values
    assert declared_markers(out)
    decoded = xarray_output(out)
    np.testing.assert_array_equal(decoded.isnull().values, X == 0)


@pytest.mark.parametrize("writer", ["h5py-missing_value", "zarr-python-v2"])
def test_plan_states_what_perturb_does(cli, tmp_path, writer):
    build, name, marker = WRITERS[writer]
    src = build(tmp_path / name)
    for more, key in (((), "dropped"), (("--public-missing",), "public_missing")):
        result = cli("plan", src, "--eps", "1", "--json", *more)
        assert result.exit_code == 0, result.stderr
        plan = json.loads(result.stdout)
        manifest, _ = perturb(cli, src, tmp_path / f"out{len(more)}{Path(name).suffix}", *more)
        assert plan[key] == manifest[key] and marker in json.dumps(plan[key])
        assert "inside the declared range" in result.stderr
        assert any("inside the declared range" in line for line in plan["messages"])


def test_a_public_missing_run_is_refused_where_no_marker_can_be(cli, tmp_path):
    src = tmp_path / "x.npy"
    np.save(src, X)
    result = cli("perturb", src, "--eps", "1", "--public-missing")
    assert result.exit_code == 2
    assert "--public-missing applies to" in result.stderr


def test_only_the_values_inside_the_range_stop_being_markers(cli, tmp_path):
    """missing_value [-9999, 0] on int16 counts in --range 0:100: 0 is data, -9999 stays a
    marker (its values copied and declared)."""
    counts = np.random.default_rng(2).integers(0, 100, (200, 30)).astype(np.int16)
    counts[:, 0] = 0
    counts[5, 3] = counts[7, 9] = -9999
    src = tmp_path / "in.h5"
    with h5py.File(src, "w") as f:
        f.create_dataset("counts", data=counts).attrs["missing_value"] = np.array([-9999, 0], np.int16)
    out = tmp_path / "out.h5"
    manifest, stderr = perturb(cli, src, out, "--range", "0:100", "--allow-raw-release")
    assert [entry["name"] for entry in manifest["dropped"]] == ["/counts/missing_value"]
    assert manifest["missing_values"]["/counts"]["input"] == [-9999]
    with h5py.File(out, "r") as f:
        assert f["counts"].attrs["missing_value"].tolist() == [-9999]
        noisy = f["counts"][:]
    assert noisy[5, 3] == noisy[7, 9] == -9999
    assert np.count_nonzero(noisy[:, 0] == 0) < 20  # 200 zeros, perturbed
    assert "released as is" in stderr
    with xr.open_dataset(out, engine="netcdf4") as ds:
        assert int(ds["counts"].isnull().sum()) == 2


@pytest.mark.parametrize("code, scale, inside", [(10, 0.5, True), (4, 4.0, False)])
def test_the_range_is_compared_in_unpacked_units(cli, tmp_path, code, scale, inside):
    """A packed _FillValue is inside --range 0:8 when its unpacked value is (code 10 * 0.5 = 5),
    whatever its code (code 4 * 4.0 = 16 is outside)."""
    values = np.arange(6000, dtype=np.int16).reshape(200, 30) % 2
    values[:, 0] = code
    src = tmp_path / "in.nc"
    with netCDF4.Dataset(src, "w") as ds:
        ds.createDimension("r", 200)
        ds.createDimension("c", 30)
        var = ds.createVariable("v", "i2", ("r", "c"), fill_value=np.int16(code))
        var.scale_factor = np.float32(scale)
        var.set_auto_maskandscale(False)
        var[:] = values
    out = tmp_path / "out.nc"
    manifest, _ = perturb(cli, src, out, "--range", "0:8", "--allow-raw-release")
    assert ("dropped" in manifest) == inside
    with xr.open_dataset(out, engine="netcdf4") as ds:
        assert int(ds["v"].isnull().sum()) == (0 if inside else 200)


@pytest.mark.parametrize("zarr_format", [None, 2, 3])
def test_the_missing_values_line_only_when_values_are_missing(cli, tmp_path, zarr_format):
    """xarray gives float data a NaN _FillValue: the run said the missing values were
    released as is even when none was missing."""
    data = np.random.default_rng(4).random((50, 4)).astype(np.float32)
    for holes in (False, True):
        if holes:
            data[3, 1] = np.nan
        ds = xr.Dataset({"t": (("time", "x"), data)})
        src = tmp_path / f"in{holes}.{'nc' if zarr_format is None else 'zarr'}"
        if zarr_format is None:
            ds.to_netcdf(src)
        else:
            ds.to_zarr(src, zarr_format=zarr_format)
        out = tmp_path / f"out{holes}{src.suffix}"
        manifest, stderr = perturb(cli, src, out, "--range", "0:1")
        assert stderr.count("released as is") == (1 if holes else 0)
        assert "dropped" not in manifest  # NaN lies in no range
        assert list(manifest["missing_values"].values())[0]["input"] == ["nan"]


def test_the_ledger_counts_both_readings_as_the_same_data(cli, tmp_path):
    """--public-missing reads the markers otherwise: the data's fingerprint must not change with
    it, or toggling the option would start a fresh count under --max-record-eps."""
    src, ledger = h5py_fill(tmp_path / "in.h5"), tmp_path / "ledger.db"
    perturb(cli, src, tmp_path / "a.h5", "--ledger", ledger)
    _, stderr = perturb(cli, src, tmp_path / "b.h5", "--ledger", ledger, "--public-missing")
    assert "2 releases: each record" in stderr


@pytest.mark.parametrize("option", [[], ["--public-missing"]], ids=["as data", "public"])
def test_a_packed_marker_is_named_not_decoded(cli, tmp_path, option):
    """ERA5-style packing maps a variable's own range onto int16 codes -32766..32767 (the
    scale_factor and add_offset come from its minimum and maximum) with _FillValue -32767,
    which decodes to just below the raw minimum: the marker lies inside a wide declared range,
    and the manifest and messages name it, never its decoded value."""
    import netCDF4

    physical = np.random.default_rng(11).normal(280, 10, (8, 4, 5))
    physical[0, 0, 0] = np.nan
    low, high = np.nanmin(physical), np.nanmax(physical)
    src = tmp_path / "era.nc"
    with netCDF4.Dataset(src, "w") as ds:
        for name, size in zip(("time", "y", "x"), physical.shape):
            ds.createDimension(name, size)
        t = ds.createVariable("t", "i2", ("time", "y", "x"), fill_value=np.int16(-32767))
        t.scale_factor = (high - low) / 65533
        t.add_offset = high - 32767 * t.scale_factor
        t.units = "K"
        t[:] = np.ma.masked_invalid(physical)
        scale, decoded = float(t.scale_factor), float(t.add_offset - 32767 * t.scale_factor)
    assert low - decoded == pytest.approx(scale)  # one code below the raw minimum
    out = tmp_path / "out.nc"
    result = cli("perturb", src, "--out", out, "--eps", "1", "--range", "200:350", *option)
    assert result.exit_code == 0, result.stderr
    text = Path(f"{out}.manifest.json").read_text()
    manifest = json.loads(text)
    if option:
        assert manifest["public_missing"]["markers"] == [{"name": "/t/_FillValue"}]
        assert manifest["missing_values"]["/t"]["input"] == [-32767]  # as stored
    else:
        assert [d["name"] for d in manifest["dropped"]] == ["/t/_FillValue"]
    for value in (decoded, low):
        assert f"{value:g}" not in result.stderr and f"{value:g}" not in text and repr(value)[:8] not in text
