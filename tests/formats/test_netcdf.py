"""netCDF-4 files made by real tools (xarray with either engine, netCDF4 itself) come out
valid: attributes byte for byte, creation order kept (netCDF-C can open the output for
writing), coordinates left alone, CF value attributes (valid_range, _FillValue,
missing_value, packing) honoured.

Every test writes its input with the tool named and reads the output back with netCDF4
and with xarray on both engines.
"""

import json
from pathlib import Path

import h5py
import numpy as np
import pytest

from tests.builders import assert_one_line_error
from tldp_cli.formats import FormatOptions, hdf5, hdf5_reader, leftovers
from tldp_cli.run.pipeline import PerturbOptions, perturb

netCDF4 = pytest.importorskip("netCDF4")
xr = pytest.importorskip("xarray")
pytest.importorskip("h5netcdf")

ENGINES = ["netcdf4", "h5netcdf"]
RNG = np.random.default_rng(5)
TEMPERATURES = RNG.uniform(255, 305, (12, 4, 5)).astype(np.float32)


def run(cli, src, out, *more):
    result = cli("perturb", src, "--out", out, "--eps", "1", "--seed", "7", "--allow-weak-seed",
                 "--allow-raw-release", *more)
    assert result.exit_code == 0, result.stderr
    return json.loads(Path(f"{out}.manifest.json").read_text())


def plain(value):
    """An attribute value as something == compares, NaN included."""
    array = np.asarray(value)
    if array.dtype.kind in "US":
        return (type(value).__name__, array.tolist())
    return (array.dtype.str, repr(array.tolist()))


def nc_attributes(path) -> dict[str, list]:
    """Every group's and variable's attributes as netCDF4 reads them, in its order."""
    found = {}

    def walk(group, prefix):
        found[prefix or "/"] = [(k, plain(group.getncattr(k))) for k in group.ncattrs()]
        for name, var in group.variables.items():
            found[f"{prefix}/{name}"] = [(k, plain(var.getncattr(k))) for k in var.ncattrs()]
        for name, sub in group.groups.items():
            walk(sub, f"{prefix}/{name}")

    with netCDF4.Dataset(path) as ds:
        walk(ds, "")
    return found


def xr_attributes(path, engine) -> dict[str, dict]:
    with xr.open_dataset(path, engine=engine, mask_and_scale=False) as ds:
        found = {"/": {k: plain(v) for k, v in ds.attrs.items()}}
        for name, var in ds.variables.items():
            found[name] = {k: plain(v) for k, v in var.attrs.items()}
    return found


def without(attributes, dropped: dict[str, tuple[str, ...]]):
    """`attributes` (either reader's) less the attributes `dropped` names per variable."""
    out = {}
    for where, attrs in attributes.items():
        gone = dropped.get(where.lstrip("/"), ())
        out[where] = ([(k, v) for k, v in attrs if k not in gone] if isinstance(attrs, list)
                      else {k: v for k, v in attrs.items() if k not in gone})
    return out


def cf_dataset():
    """Text attributes of every kind netCDF writers make: one character, trailing blanks,
    UTF-8, empty, long; numbers; a coordinate with a CF bounds variable."""
    time = np.arange(12.0)
    return xr.Dataset(
        {"T2": (("time", "y", "x"), TEMPERATURES,
                {"units": "K", "long_name": "temperature at 2 m", "MemoryOrder": "XY ",
                 "comment": "température, °C ↔ K", "stagger": "", "FieldType": np.int32(104),
                 "description": "x" * 300}),
         "time_bnds": (("time", "nv"), np.stack([time - 0.5, time + 0.5], axis=1))},
        coords={"time": ("time", time, {"units": "hours since 2000-01-01", "bounds": "time_bnds"})},
        attrs={"Conventions": "CF-1.8", "title": "T", "history": "made by a test ü", "version": 3})


@pytest.fixture(params=ENGINES)
def xarray_file(request, tmp_path):
    path = tmp_path / f"in.{request.param}.nc"
    cf_dataset().to_netcdf(path, engine=request.param)
    return path


def test_text_attributes_come_through_byte_for_byte(cli, tmp_path, xarray_file):
    out = tmp_path / "out.nc"
    # Attributes kept (--keep '*@*'; by default the free-text ones are left out, test_leftovers.py),
    # and the record axis's time(time) with its bounds (left out by default: a value per record)
    manifest = run(cli, xarray_file, out, "--range", "250:310", "--keep", "*@*", "--keep", "time", "--keep", "time_bnds")
    assert [i["dataset"] for i in manifest["inputs"]] == ["/T2"]
    assert nc_attributes(out) == nc_attributes(xarray_file)
    with netCDF4.Dataset(out) as ds:
        assert ds.Conventions == "CF-1.8" and ds["T2"].units == "K" and ds["T2"].MemoryOrder == "XY "
        assert ds["T2"].comment == "température, °C ↔ K"
    for engine in ENGINES:
        assert xr_attributes(out, engine) == xr_attributes(xarray_file, engine), engine
    with h5py.File(xarray_file, "r") as a, h5py.File(out, "r") as b:
        for name in ["/", "/T2", "/time", "/time_bnds"]:
            assert list(a[name].attrs) == list(b[name].attrs), name
            for key in a[name].attrs:
                assert a[name].attrs.get_id(key).get_type() == b[name].attrs.get_id(key).get_type(), key
                assert a[name].attrs.get_id(key).shape == b[name].attrs.get_id(key).shape, key


def netcdf4_file(path: Path) -> Path:
    """Written by netCDF4 directly: NC_CHAR and NC_STRING attributes, groups, variables and
    attributes in an order that is not alphabetical."""
    with netCDF4.Dataset(path, "w") as ds:
        ds.title = "made with netCDF4"
        ds.Conventions = "CF-1.8"
        ds.setncattr_string("institution", "Institut für Tests")
        ds.author = "A"
        ds.createDimension("time", None)
        ds.createDimension("station", 6)
        zeta = ds.createVariable("zeta", "f4", ("time", "station"))
        zeta.units = "m"
        zeta.long_name = "sea surface height"
        zeta.axis = "Z"
        zeta.setncattr_string("flags", ["a", "bc"])
        zeta[:] = RNG.uniform(0, 1, (10, 6))
        alpha = ds.createVariable("alpha", "i2", ("station",))
        alpha.units = "1"
        alpha[:] = np.arange(6)
        obs = ds.createGroup("obs")
        obs.source = "buoy"
        obs.createDimension("n", 3)
        w = obs.createVariable("w", "f8", ("n",))
        w.units = "m s-1"
        w.comment = "z"
        w[:] = [1.0, 2.0, 3.0]
        b = obs.createVariable("b", "f8", ("n",))
        b[:] = [4.0, 5.0, 6.0]
    return path


def test_a_dimension_without_a_variable_is_not_a_dataset_kept(cli, tmp_path):
    """Regression: netCDF-C stores a dimension without a coordinate variable (station, obs/n) as
    an HDF5 dataset holding no value; --keep '*' listed them under `unperturbed` as datasets
    kept raw (float32 of the dimension's length), and --keep /station matched one. They are
    structure: written as they are, never listed, and a --keep naming one alone matches nothing."""
    src = netcdf4_file(tmp_path / "in.nc")
    manifest = run(cli, src, tmp_path / "out.nc", "--range", "0:1", "--dataset", "zeta", "--keep", "*")
    assert {u["name"] for u in manifest["unperturbed"] if u["kind"] == "dataset"} == {"/alpha", "/obs/w", "/obs/b"}
    with netCDF4.Dataset(tmp_path / "out.nc") as ds:
        assert ds.dimensions["station"].size == 6 and ds["obs"].dimensions["n"].size == 3
    refused = cli("perturb", src, "--out", tmp_path / "o.nc", "--eps", "1", "--range", "0:1", "--keep", "/station")
    assert_one_line_error(refused, 2, "--keep /station matches no dataset")


def test_netcdf4_opens_the_output_for_writing_and_keeps_the_order(cli, tmp_path):
    src = netcdf4_file(tmp_path / "in.nc")
    out = tmp_path / "out.nc"
    run(cli, src, out, "--range", "0:1", "--dataset", "zeta", "--keep", "*")  # all kept: the order
    assert nc_attributes(out) == nc_attributes(src)
    with netCDF4.Dataset(out) as ds:
        assert list(ds.variables) == ["zeta", "alpha"]
        assert ds.ncattrs() == ["title", "Conventions", "institution", "author"]
        assert ds["zeta"].ncattrs() == ["units", "long_name", "axis", "flags"]
        assert list(ds["obs"].variables) == ["w", "b"] and ds["obs"]["w"].ncattrs() == ["units", "comment"]
        assert ds.institution == "Institut für Tests" and list(ds["zeta"].flags) == ["a", "bc"]
    with netCDF4.Dataset(out, "a") as ds:  # netCDF-C refuses a root without creation order
        ds.added = "yes"
        ds.createVariable("new", "f4", ("station",))[:] = np.ones(6)
    with netCDF4.Dataset(out) as ds:
        assert ds.added == "yes" and list(ds.variables) == ["zeta", "alpha", "new"]
    for engine in ENGINES:
        with xr.open_dataset(out, engine=engine) as ds:
            assert list(ds.data_vars) == ["zeta", "alpha", "new"]


def wrf_file(path: Path, time_axis: bool = True) -> Path:
    """WRF's layout: 2-D coordinates with a Time axis (wrfout files; without one, a grid like
    geo_em's), named by the data's coordinates."""
    with netCDF4.Dataset(path, "w") as ds:
        ds.TITLE = " OUTPUT FROM WRF V4.5 MODEL"
        ds.createDimension("Time", None)
        ds.createDimension("DateStrLen", 19)
        ds.createDimension("south_north", 4)
        ds.createDimension("west_east", 5)
        times = ds.createVariable("Times", "S1", ("Time", "DateStrLen"))
        times[:] = netCDF4.stringtochar(np.array([f"2000-01-01_{h:02d}:00:00" for h in range(12)], "S19"))
        for name, low, units in [("XLAT", 30, "degree_north"), ("XLONG", -100, "degree_east")]:
            var = ds.createVariable(name, "f4", ("Time", "south_north", "west_east")[not time_axis:])
            var.FieldType = np.int32(104)
            var.MemoryOrder = "XY "
            var.units = units
            var.stagger = ""
            var[:] = low + RNG.uniform(0, 10, (12, 4, 5)[not time_axis:])
        t2 = ds.createVariable("T2", "f4", ("Time", "south_north", "west_east"))
        t2.MemoryOrder = "XY "
        t2.units = "K"
        t2.coordinates = "XLONG XLAT"
        t2[:] = TEMPERATURES
    return path


@pytest.mark.parametrize("time_axis", [False, True])
def test_wrf_coordinates_are_not_perturbed_by_default(cli, tmp_path, time_axis):
    """XLAT(south_north, west_east), a grid, is copied raw as a coordinate; XLAT(Time, ...)
    runs along the record axis (a value per record), so it is copied only where --keep names it."""
    src = wrf_file(tmp_path / "wrfout.nc", time_axis)
    out = tmp_path / "out.nc"
    keep = ["--keep", "XLAT", "--keep", "XLONG"] if time_axis else []
    result = cli("perturb", src, "--out", out, "--eps", "1", "--range", "250:310", "--seed", "7",
                 "--allow-weak-seed", "--allow-raw-release", *keep)
    assert result.exit_code == 0, result.stderr
    # Not perturbed: copied as a grid, or left out along the record axis unless --keep (the
    # line once said "left out" of coordinates it copied)
    assert "not perturbing the coordinate datasets /XLAT, /XLONG" in result.stderr
    assert "left out the coordinate" not in result.stderr
    manifest = json.loads(Path(f"{out}.manifest.json").read_text())
    assert [i["dataset"] for i in manifest["inputs"]] == ["/T2"]
    reason = "kept by --keep" if time_axis else "coordinate"
    assert {u["name"]: u["reason"] for u in manifest["unperturbed"]} == {"/XLAT": reason, "/XLONG": reason}
    assert "/Times" in {d["name"] for d in manifest["dropped"]}  # text, not perturbed: left out
    # The structural attributes stay; WRF's free-text and statistical ones are left out.
    assert nc_attributes(out) == {"/": [], "/XLAT": [("units", plain("degree_north"))],
                                  "/XLONG": [("units", plain("degree_east"))],
                                  "/T2": [("units", plain("K")), ("coordinates", plain("XLONG XLAT"))]}
    with h5py.File(src, "r") as a, h5py.File(out, "r") as b:
        for name in ["XLAT", "XLONG"]:
            assert a[name][()].tobytes() == b[name][()].tobytes(), name
        assert not np.array_equal(a["T2"][()], b["T2"][()]) and "Times" not in b
    for engine in ENGINES:
        with xr.open_dataset(out, engine=engine) as ds:
            assert {"XLAT", "XLONG"} <= set(ds["T2"].coords)  # from its coordinates attribute
            np.testing.assert_array_equal(ds["XLAT"].values, netCDF4.Dataset(src)["XLAT"][:])


def test_coordinates_can_still_be_named(cli, tmp_path):
    src = wrf_file(tmp_path / "wrfout.nc")
    manifest = run(cli, src, tmp_path / "out.nc", "--range", "-100:40", "--dataset", "XLAT")
    assert [i["dataset"] for i in manifest["inputs"]] == ["/XLAT"]


def test_valid_range_no_longer_masks_noisy_values(cli, tmp_path):
    src = tmp_path / "in.nc"
    with netCDF4.Dataset(src, "w") as ds:
        ds.createDimension("time", 12)
        ds.createDimension("cell", 20)
        t = ds.createVariable("t", "f4", ("time", "cell"))
        t.valid_range = np.array([250, 310], np.float32)
        t.actual_range = np.array([TEMPERATURES.min(), TEMPERATURES.max()], np.float32)
        t.units = "K"
        t[:] = TEMPERATURES.reshape(12, 20)
    out = tmp_path / "out.nc"
    manifest = run(cli, src, out, "--range", "250:310", "--sampler", "float")
    assert manifest["dropped_attributes"] == {"/t": ["valid_range", "actual_range"]}
    assert any("dropped_attributes" in step for step in manifest["postprocessing"])
    with netCDF4.Dataset(out) as ds:
        assert ds["t"].ncattrs() == ["units"]
        values = ds["t"][:]
        assert np.ma.count_masked(values) == 0
        assert values.min() < 250 or values.max() > 310  # noise at --eps 1 leaves the range


def test_missing_values_stay_missing(cli, tmp_path):
    """xarray writes NaN as the _FillValue of float data; netCDF4 an integer _FillValue and a
    missing_value; the first records are all missing (their block has no value to stand in)."""
    data = TEMPERATURES.copy()
    data[:2] = np.nan
    data[5, 1, 2] = data[9, 3, 0] = np.nan
    src = tmp_path / "in.nc"
    xr.Dataset({"T2": (("time", "y", "x"), data, {"units": "K"})}).to_netcdf(src, engine="h5netcdf")
    with netCDF4.Dataset(src, "a") as ds:
        counts = ds.createVariable("counts", "i2", ("time", "y", "x"), fill_value=np.int16(-999))
        counts.missing_value = np.int16(-1)
        codes = RNG.integers(0, 50, (12, 4, 5)).astype(np.int16)
        codes[3, 0, 0], codes[4, 0, 0] = -999, -1
        counts.set_auto_mask(False)
        counts[:] = codes
    out = tmp_path / "out.nc"
    manifest = run(cli, src, out, "--range", "0:310")
    assert manifest["missing_values"]["/T2"] == {"input": ["nan"], "output": ["nan"],
                                                 "action": "copied, not perturbed", "moved_off_markers": 0}
    counts_out = manifest["missing_values"]["/counts"]
    assert counts_out["input"] == [-999, -1]
    assert any("missing_values" in step for step in manifest["postprocessing"])
    with netCDF4.Dataset(out) as ds:
        t2 = ds["T2"][:]
        np.testing.assert_array_equal(np.ma.getmaskarray(t2), np.isnan(data))
        counts = ds["counts"]
        assert counts._FillValue.dtype == counts.dtype and counts.missing_value.dtype == counts.dtype
        assert [counts._FillValue.item(), counts.missing_value.item()] == counts_out["output"]
        mask = np.ma.getmaskarray(counts[:])
        assert mask.sum() == 2 and mask[3, 0, 0] and mask[4, 0, 0]
    for engine in ENGINES:
        with xr.open_dataset(out, engine=engine) as ds:
            np.testing.assert_array_equal(np.isnan(ds["T2"].values), np.isnan(data))
            assert np.isnan(ds["counts"].values).sum() == 2


def fill_on_grid_file(path: Path, writer: str) -> tuple[Path, dict[str, int]]:
    """A float variable with _FillValue -1.0 and a uint8-packed one (i1, _Unsigned, _FillValue
    -1, scale_factor 1), both with their values near 0: -1 lies on the noise's grid a few noise
    scales below the ranges declared (0:0.5, 0:250), where noisy values land (q's fill, read
    unsigned, is 255: outside 0:250, so it stays a marker). Written by
    xarray on `writer`'s engine, or by netCDF4 itself; returns the missing count of each."""
    rng = np.random.default_rng(11)
    tp = (0.01 * rng.random((10, 100, 100))).astype(np.float32)
    q = rng.integers(0, 3, (20, 50, 50)).astype(np.float32)
    tp.flat[rng.choice(tp.size, 25, replace=False)] = np.nan
    q.flat[rng.choice(q.size, 10, replace=False)] = np.nan
    if writer == "netCDF4":
        with netCDF4.Dataset(path, "w") as ds:
            for name, size in (("time", 10), ("step", 20), ("y", 100), ("x", 100), ("b", 50), ("a", 50)):
                ds.createDimension(name, size)
            ds.createVariable("tp", "f4", ("time", "y", "x"), fill_value=np.float32(-1.0))[:] = \
                np.ma.masked_invalid(tp)
            var = ds.createVariable("q", "i1", ("step", "b", "a"), fill_value=np.int8(-1))
            var._Unsigned, var.scale_factor = "true", np.float32(1.0)
            var[:] = np.ma.array(np.nan_to_num(q), mask=np.isnan(q))
    else:
        xr.Dataset({"tp": (("time", "y", "x"), tp), "q": (("step", "b", "a"), q)}).to_netcdf(
            path, engine=writer, encoding={
                "tp": {"_FillValue": np.float32(-1.0)},
                "q": {"dtype": "i1", "_Unsigned": "true", "_FillValue": np.int8(-1), "scale_factor": 1.0}})
    return path, {"tp": 25, "q": 10}


@pytest.mark.parametrize("writer", [*ENGINES, "netCDF4"])
def test_noisy_values_never_land_on_the_fill_value(cli, tmp_path, writer):
    """A noisy value equal to the output's _FillValue would read as missing: it is moved one
    grid step toward the range, and the manifest counts the moves."""
    src, missing = fill_on_grid_file(tmp_path / "in.nc", writer)
    out = tmp_path / "out.nc"
    manifest = run(cli, src, out, "--dataset", "tp", "--dataset", "q",
                   "--range", "tp=0:0.5", "--range", "q=0:250")
    for engine in ENGINES:
        with xr.open_dataset(src, engine=engine) as before, xr.open_dataset(out, engine=engine) as after:
            for name, count in missing.items():
                assert int(before[name].isnull().sum()) == count
                assert int(after[name].isnull().sum()) == count
                np.testing.assert_array_equal(after[name].isnull(), before[name].isnull())
                assert after[name].encoding["_FillValue"] == -1
    with netCDF4.Dataset(out) as ds:
        for name, count in missing.items():
            assert np.ma.count_masked(ds[name][:]) == count
    moved = {name.strip("/"): entry["moved_off_markers"] for name, entry in manifest["missing_values"].items()}
    assert moved["tp"] > 0 and moved["q"] > 0  # the seed makes noisy values land on -1
    assert any("move noisy values off the missing-data markers" in s for s in manifest["postprocessing"])
    if writer == "netCDF4":
        result = cli("evaluate", src, out)
        assert result.exit_code == 0, result.stderr


def test_a_dataset_of_missing_values_only_comes_back_missing(cli, tmp_path):
    """Missing positions hold a public value, so a variable with no value present perturbs
    like any other (it was refused: no value of its own to stand in) and stays all missing."""
    src, out = tmp_path / "in.nc", tmp_path / "out.nc"
    xr.Dataset({"T2": (("time", "y"), np.full((4, 3), np.nan, np.float32))}).to_netcdf(src)
    reader = hdf5.open_reader(src, FormatOptions(datasets=["T2"]))
    try:
        (job,) = reader.arrays()
        assert np.isnan(job.read(0, 2)).all()  # untold, the markers as stored
    finally:
        reader.close()
    for mechanism in ("tldp", "privunit"):
        manifest = run(cli, src, out, "--range", "0:1", "--mechanism", mechanism, "--overwrite")
        assert manifest["missing_values"]["/T2"]["input"] == ["nan"]
        with netCDF4.Dataset(out) as ds:
            assert np.ma.getmaskarray(ds["T2"][:]).all()


def records_with_gaps(path: Path, writer: str, first: float) -> Path:
    """8 records of 16 x 16, record 3 half missing, the first value of record 0 (which the
    records missing values took from their block) `first`. xarray: float32, NaN as its
    _FillValue, chunked one record per chunk; netCDF4: int16 codes 0..50 with _FillValue -999."""
    rng = np.random.default_rng(1)
    if writer == "xarray":
        data = rng.uniform(0, 1, (8, 16, 16)).astype(np.float32)
        data[3, :8] = np.nan
        data[0, 0, 0] = first
        xr.Dataset({"v": (("t", "y", "x"), data)}).to_netcdf(
            path, engine="h5netcdf", encoding={"v": {"chunksizes": (1, 16, 16)}})
        return path
    codes = rng.integers(0, 51, (8, 16, 16)).astype(np.int16)
    codes[3, :8] = -999
    codes[0, 0, 0] = first
    with netCDF4.Dataset(path, "w") as ds:
        for name, size in (("t", 8), ("y", 16), ("x", 16)):
            ds.createDimension(name, size)
        var = ds.createVariable("v", "i2", ("t", "y", "x"), fill_value=np.int16(-999))
        var.set_auto_mask(False)
        var[:] = codes
    return path


PRIVUNIT_GAPS = {"xarray": ("--range", "0:1"),
                 # the reference 25.5 is no int16: the blocks with missing values read as float64
                 "netCDF4": ("--range", "0:51", "--reference", "mid")}


@pytest.mark.parametrize("writer", list(PRIVUNIT_GAPS))
def test_privunit_releases_a_record_with_missing_values_from_its_own_values(cli, tmp_path, writer):
    """privunit projects whole records: missing positions held the block's first present value,
    another record's, so that record 3's release depended on record 0's raw value (outside
    record 0's certificate). Now they hold privunit's public reference point."""
    outputs = {}
    for first in (0.1, 0.9) if writer == "xarray" else (2, 48):
        src = records_with_gaps(tmp_path / f"in{first}.nc", writer, first)
        for seed in ("1", "2", "3"):
            out = tmp_path / f"out{first}-{seed}.nc"
            result = cli("perturb", src, "--out", out, "--mechanism", "privunit", "--eps", "4", "--seed", seed,
                         "--allow-weak-seed", *PRIVUNIT_GAPS[writer])
            assert result.exit_code == 0, result.stderr
            with netCDF4.Dataset(out) as ds:
                outputs[first, seed] = ds["v"][:]
    for seed in ("1", "2", "3"):
        a, b = (value for (_, s), value in outputs.items() if s == seed)
        for values in (a, b):  # the markers come back where values were missing, and only there
            assert np.ma.getmaskarray(values)[3, :8].all() and np.ma.count_masked(values) == 128
        np.testing.assert_array_equal(a[1:].filled(-1), b[1:].filled(-1))  # every record but record 0


def test_privunit_with_missing_values_does_not_depend_on_blocks_or_workers(tmp_path):
    """One record per chunk: blocks of one record each on two threads gave record 3 its own
    first present value, one block record 0's."""
    src = records_with_gaps(tmp_path / "in.nc", "xarray", 0.9)
    written = []
    for name, more in (("whole", {}), ("cut", {"block_elements": 256, "workers": 2})):
        out = tmp_path / f"{name}.nc"
        perturb(PerturbOptions(input=src, out=out, mechanism="privunit", eps=4.0, value_range=(0.0, 1.0),
                               seed="3", allow_weak_seed=True, **more))
        with xr.open_dataset(out) as ds:
            written.append(ds["v"].values)
    np.testing.assert_array_equal(written[0], written[1])
    assert np.isnan(written[0][3, :8]).all() and not np.isnan(written[0][3, 8:]).any()


def packed_file(path: Path) -> tuple[Path, np.ndarray]:
    """int16 codes of temperatures (K = code * 0.01 + 280), a fill code and a valid_range in codes."""
    physical = np.round(TEMPERATURES.astype(np.float64) * 100) / 100
    physical[0, 0, 0] = np.nan
    xr.Dataset({"t": (("time", "y", "x"), physical, {"units": "K"})}).to_netcdf(
        path, encoding={"t": {"dtype": "int16", "scale_factor": np.float32(0.01),
                              "add_offset": np.float32(280.0), "_FillValue": np.int16(-32767)}})
    with netCDF4.Dataset(path, "a") as ds:
        ds["t"].valid_range = np.array([-3000, 3000], np.int16)
    return path, physical


def test_a_classic_model_file_of_int64_output_comes_out_netcdf4(cli, tmp_path):
    """Regression: int32 counts of a NETCDF4_CLASSIC file, perturbed over a 2^31-wide range, come
    out int64, which netCDF's classic model does not hold; the output still declared the classic
    model (_nc3_strict). It is now plain netCDF-4, and the manifest says so; a classic file whose
    output fits the model (float32) stays classic."""
    src = tmp_path / "counts.nc"
    with netCDF4.Dataset(src, "w", format="NETCDF4_CLASSIC") as ds:
        ds.createDimension("n", None)
        ds.createDimension("x", 4)
        ds.createVariable("counts", "i4", ("n", "x"))[:] = RNG.integers(0, 2**30, (10, 4))
        ds.createVariable("t", "f4", ("n", "x"))[:] = TEMPERATURES[:10, 0, :4]
    out = tmp_path / "out.nc"
    manifest = run(cli, src, out, "--range", f"0:{2**31}", "--dataset", "counts")
    assert any("classic model" in step for step in manifest["postprocessing"])
    with netCDF4.Dataset(out) as ds:
        assert ds.data_model == "NETCDF4" and ds["counts"].dtype == np.int64
    floats = run(cli, src, tmp_path / "floats.nc", "--range", "250:310", "--dataset", "t")
    assert not any("classic model" in step for step in floats["postprocessing"])
    with netCDF4.Dataset(tmp_path / "floats.nc") as ds:
        assert ds.data_model == "NETCDF4_CLASSIC" and ds["t"].dtype == np.float32


@pytest.mark.parametrize("command", ["perturb", "plan"])
def test_packed_data_without_a_range_says_it_is_unpacked(cli, tmp_path, command):
    """Regression: int16 codes asked for a range as "in.nc: float32 data needs --range", naming
    neither the variable nor why int16 data (whose dtype range is the default) needs one: its
    codes are unpacked, and the range is in the unpacked units."""
    src, _ = packed_file(tmp_path / "in.nc")
    assert_one_line_error(cli(command, src, "--eps", "1"), 2, "in.nc: /t: float32 data needs --range LO:HI",
                          "stored int16 values are scaled to float32", "in whose units the range is")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.nc"]


def test_packed_data_is_perturbed_in_physical_units(cli, tmp_path):
    src, physical = packed_file(tmp_path / "in.nc")
    out = tmp_path / "out.nc"
    result = cli("perturb", src, "--out", out, "--eps", "8", "--range", "250:310", "--seed", "7",
                 "--allow-weak-seed", "--allow-raw-release")
    assert result.exit_code == 0, result.stderr
    assert "/t: unpacking its int16 codes" in result.stderr
    manifest = json.loads(Path(f"{out}.manifest.json").read_text())
    assert manifest["value_range"] == [250, 310]
    assert manifest["unpacked"] == {"/t": {"stored_dtype": "int16", "unsigned": False}}
    assert manifest["dropped_attributes"] == {"/t": ["valid_range", "scale_factor", "add_offset"]}
    with netCDF4.Dataset(out) as ds:
        t = ds["t"]
        assert t.dtype == np.float32
        assert set(t.ncattrs()) == {"_FillValue", "units"}
        assert t._FillValue.dtype == np.float32 and t._FillValue == -32767
        noisy = t[:]
    mask = np.ma.getmaskarray(noisy)
    np.testing.assert_array_equal(mask, np.isnan(physical))
    error = noisy.compressed() - physical[~np.isnan(physical)]
    scale = manifest["noise_scale"] * manifest["granularity"]  # in K (noise_scale counts grid steps)
    assert scale == pytest.approx(60 / 8, rel=0.01)  # the physical range / eps, not the codes' (6000 / 8)
    assert np.median(np.abs(error)) < 3 * scale
    assert abs(np.mean(error)) < 3 * scale
    assert 250 - 40 * scale < noisy.min() and noisy.max() < 310 + 40 * scale
    for engine in ENGINES:
        with xr.open_dataset(out, engine=engine) as ds:
            values = ds["t"].values
            assert values.dtype == np.float32
            np.testing.assert_array_equal(np.isnan(values), np.isnan(physical))
            np.testing.assert_array_equal(values[~np.isnan(values)], noisy.compressed())


def test_unsigned_bytes_are_read_as_unsigned(cli, tmp_path):
    src = tmp_path / "in.nc"
    with netCDF4.Dataset(src, "w") as ds:
        ds.createDimension("n", 10)
        ds.createDimension("k", 4)
        var = ds.createVariable("v", "i1", ("n", "k"))
        var.set_auto_maskandscale(False)
        var._Unsigned = "true"
        var[:] = np.full((10, 4), 200, np.uint8).view(np.int8)
    out = tmp_path / "out.nc"
    manifest = run(cli, src, out, "--range", "0:256", "--eps", "8")
    assert manifest["unpacked"]["/v"]["unsigned"] is True
    with netCDF4.Dataset(out) as ds:
        assert "_Unsigned" not in ds["v"].ncattrs()
        assert abs(np.median(np.asarray(ds["v"][:])) - 200) < 30


@pytest.mark.parametrize("engine", ENGINES)
def test_every_output_opens_in_xarray(cli, tmp_path, engine):
    inputs = [netcdf4_file(tmp_path / "a.nc"), wrf_file(tmp_path / "b.nc"), packed_file(tmp_path / "c.nc")[0]]
    for i, src in enumerate(inputs):
        out = tmp_path / f"out{i}.nc"
        run(cli, src, out, "--range", "-100:400")
        with xr.open_dataset(src, engine=engine) as before, xr.open_dataset(out, engine=engine) as after:
            # What is not perturbed is left out but coordinates and structural metadata.
            assert set(after.variables) <= set(before.variables)
            assert after.attrs == {k: v for k, v in before.attrs.items() if k == "Conventions"}
            after.load()
        run(cli, src, tmp_path / f"all{i}.nc", "--range", "-100:400", "--keep", "*")
        with xr.open_dataset(src, engine=engine) as before, \
                xr.open_dataset(tmp_path / f"all{i}.nc", engine=engine) as after:
            assert list(after.variables) == list(before.variables)
            assert after.attrs == before.attrs
            after.load()


def station_file(path: Path, engine: str) -> Path:
    """xarray's stations: a dimension coordinate (time) and per-station ones (elev, subject_id)."""
    xr.Dataset({"temp": (("station", "time"), RNG.uniform(0, 1, (5, 3)))},
               coords={"time": np.arange(3), "elev": ("station", np.arange(5.0) * 100),
                       "subject_id": ("station", np.arange(1001, 1006))}).to_netcdf(path, engine=engine)
    return path


@pytest.mark.parametrize("engine", ENGINES)
def test_coordinates_along_the_record_axis_are_left_out(cli, tmp_path, engine):
    """elev(station) and subject_id(station) hold a value per record, not a grid: left out and
    listed as dropped unless --keep names them; time, a dimension's own coordinate, stays."""
    src = station_file(tmp_path / "stations.nc", engine)
    manifest = run(cli, src, tmp_path / "out.nc", "--range", "0:1")
    assert [u["name"] for u in manifest["unperturbed"]] == ["/time"]
    assert {d["name"] for d in manifest["dropped"]} == {"/elev", "/subject_id"}
    for read in ENGINES:
        with xr.open_dataset(tmp_path / "out.nc", engine=read) as ds:
            assert set(ds.variables) == {"temp", "time"}
            np.testing.assert_array_equal(ds["time"].values, np.arange(3))
    manifest = run(cli, src, tmp_path / "kept.nc", "--range", "0:1", "--keep", "elev")
    assert {u["name"]: u["reason"] for u in manifest["unperturbed"]} == {"/elev": "kept by --keep",
                                                                         "/time": "coordinate"}
    with xr.open_dataset(tmp_path / "kept.nc") as ds:
        np.testing.assert_array_equal(ds["elev"].values, np.arange(5.0) * 100)
        assert "subject_id" not in ds.variables


@pytest.mark.parametrize("engine", ENGINES)
def test_the_coordinates_attribute_names_no_dataset_left_out(cli, tmp_path, engine):
    """temp's `coordinates` named elev and subject_id after the run left them out (CF readers
    look for each): it names what is written, and is left out when nothing it names is."""
    import netCDF4

    src = station_file(tmp_path / "stations.nc", engine)
    run(cli, src, tmp_path / "out.nc", "--range", "0:1")
    run(cli, src, tmp_path / "kept.nc", "--range", "0:1", "--keep", "elev")
    with netCDF4.Dataset(tmp_path / "out.nc") as ds:
        assert "coordinates" not in ds["temp"].ncattrs()
    with netCDF4.Dataset(tmp_path / "kept.nc") as ds:
        assert ds["temp"].getncattr("coordinates") == "elev"
    with xr.open_dataset(tmp_path / "kept.nc", decode_coords="all") as ds:
        assert set(ds.coords) == {"time", "elev"}


@pytest.mark.parametrize("engine", ENGINES)
def test_a_global_coordinates_attribute_names_record_coordinates_too(cli, tmp_path, engine):
    """xarray writes the coordinates a variable's own `coordinates` leaves unnamed in the root
    group's (here lat, lon): they are the track along the record axis, left out (not taken as
    data and perturbed), and the root's attribute names only what is written."""
    src = tmp_path / "tracks.nc"
    data = xr.Dataset({"temp": (("trajectory", "obs"), RNG.uniform(270, 290, (3, 4)))},
                      coords={"lat": (("trajectory", "obs"), RNG.uniform(40, 50, (3, 4))),
                              "lon": (("trajectory", "obs"), RNG.uniform(0, 5, (3, 4))),
                              "time": (("trajectory", "obs"), np.arange(12.0).reshape(3, 4))})
    data["temp"].encoding["coordinates"] = "time"
    data.to_netcdf(src, engine=engine)
    with netCDF4.Dataset(src) as ds:
        assert ds.getncattr("coordinates") == "lat lon"  # the file is what this test is about
    manifest = run(cli, src, tmp_path / "out.nc", "--range", "270:290")
    assert [i["dataset"] for i in manifest["inputs"]] == ["/temp"]
    assert {d["name"]: d["reason"] for d in manifest["dropped"]} == dict.fromkeys(
        ["/lat", "/lon", "/time"], leftovers.RECORD_COORDINATE_REASON)
    assert nc_attributes(tmp_path / "out.nc")["/"] == []
    manifest = run(cli, src, tmp_path / "kept.nc", "--range", "270:290", "--keep", "lon")
    assert {u["name"]: u["reason"] for u in manifest["unperturbed"]} == {"/lon": "kept by --keep"}
    assert nc_attributes(tmp_path / "kept.nc")["/"] == [("coordinates", plain("lon"))]
    with xr.open_dataset(tmp_path / "kept.nc", decode_coords="all") as ds, xr.open_dataset(src) as before:
        assert set(ds.variables) == {"temp", "lon"} and set(ds.coords) == {"lon"}
        np.testing.assert_array_equal(ds["lon"].values, before["lon"].values)


def trajectory_file(path: Path) -> Path:
    """A CF discrete sampling geometry as netCDF4 writes it (CF H.4.1, trajectories of one
    length): each trajectory's identifier (cf_role), its track time, lat, lon (trajectory, obs)
    with the bounds of lat, and a cell measure (trajectory, obs), all named by the data."""
    with netCDF4.Dataset(path, "w") as ds:
        ds.Conventions, ds.featureType = "CF-1.8", "trajectory"
        ds.createDimension("trajectory", 3)
        ds.createDimension("obs", 4)
        ds.createDimension("nv", 2)
        ident = ds.createVariable("trajectory", "i4", ("trajectory",))
        ident.cf_role = "trajectory_id"
        ident[:] = [1001, 1002, 1003]
        for name, units, values in [("time", "seconds since 2026-01-01", np.arange(12.0).reshape(3, 4) * 60),
                                    ("lat", "degrees_north", 48 + RNG.uniform(0, 1, (3, 4))),
                                    ("lon", "degrees_east", 2 + RNG.uniform(0, 1, (3, 4))),
                                    ("area", "m2", RNG.uniform(1, 2, (3, 4)))]:
            var = ds.createVariable(name, "f8", ("trajectory", "obs"))
            var.units = units
            var[:] = values
        ds["lat"].bounds = "lat_bnds"
        ds.createVariable("lat_bnds", "f8", ("trajectory", "obs", "nv"))[:] = 48 + RNG.uniform(0, 1, (3, 4, 2))
        temp = ds.createVariable("temp", "f4", ("trajectory", "obs"))
        temp.units, temp.coordinates, temp.cell_measures = "K", "trajectory time lat lon", "area: area"
        temp[:] = RNG.uniform(270, 290, (3, 4))
    return path


def test_a_trajectorys_track_is_left_out(cli, tmp_path):
    """lat, lon and time (trajectory, obs) hold each record's track, lat_bnds and area its cells,
    trajectory its identifier: left out and listed as dropped, the data's coordinates and
    cell_measures attributes naming none of them, unless --keep names them."""
    src = trajectory_file(tmp_path / "tracks.nc")
    track = {"/time", "/lat", "/lon", "/lat_bnds", "/area", "/trajectory"}
    manifest = run(cli, src, tmp_path / "out.nc", "--range", "270:290")
    assert [i["dataset"] for i in manifest["inputs"]] == ["/temp"]
    assert "unperturbed" not in manifest
    assert {d["name"] for d in manifest["dropped"] if d["kind"] == "dataset"} == track
    assert all(d["reason"].startswith(leftovers.RECORD_COORDINATE_REASON) for d in manifest["dropped"]
               if d["name"] in track)
    assert nc_attributes(tmp_path / "out.nc")["/temp"] == [("units", plain("K"))]
    for engine in ENGINES:
        with xr.open_dataset(tmp_path / "out.nc", engine=engine, decode_coords="all") as ds:
            assert set(ds.variables) == {"temp"} and ds["temp"].shape == (3, 4)
    manifest = run(cli, src, tmp_path / "kept.nc", "--range", "270:290", "--keep", "lat", "--keep", "lon")
    assert {u["name"]: u["reason"] for u in manifest["unperturbed"]} == {"/lat": "kept by --keep",
                                                                         "/lon": "kept by --keep"}
    kept = nc_attributes(tmp_path / "kept.nc")
    assert kept["/temp"] == [("units", plain("K")), ("coordinates", plain("lat lon"))]
    assert kept["/lat"] == [("units", plain("degrees_north"))]  # its bounds, lat_bnds, left out
    with xr.open_dataset(tmp_path / "kept.nc") as ds, netCDF4.Dataset(src) as before:
        assert set(ds["temp"].coords) == {"lat", "lon"}
        np.testing.assert_array_equal(ds["lat"].values, before["lat"][:])


def subject_file(path: Path) -> Path:
    """A scan per subject as netCDF4 writes it: subject(subject) holds each record's hospital
    number, lat(lat) a grid; a second variable (visit) names subject in its coordinates."""
    with netCDF4.Dataset(path, "w") as ds:
        ds.Conventions = "CF-1.8"
        ds.createDimension("subject", 3)
        ds.createDimension("lat", 4)
        ds.createVariable("subject", "i8", ("subject",))[:] = [830112, 830577, 831904]
        lat = ds.createVariable("lat", "f8", ("lat",))
        lat.units, lat[:] = "degrees_north", [40.0, 41.0, 42.0, 43.0]
        scan = ds.createVariable("scan", "f4", ("subject", "lat"))
        scan.units, scan[:] = "K", RNG.uniform(270, 290, (3, 4))
        visit = ds.createVariable("visit", "f8", ("subject",))
        visit.units, visit.coordinates, visit[:] = "days since 2020-01-01", "subject", [3.0, 9.0, 27.0]
    return path


def test_the_record_dimensions_own_coordinate_is_left_out(cli, tmp_path):
    """subject(subject) holds a value per record (hospital numbers): left out and listed as
    dropped, its dimension staying, so netCDF4 and xarray open the output (xarray with a
    default index); lat(lat), another dimension's coordinate, stays; --keep copies it raw."""
    src = subject_file(tmp_path / "scans.nc")
    manifest = run(cli, src, tmp_path / "out.nc", "--dataset", "scan", "--range", "270:290", "--keep", "visit")
    assert {d["name"]: d["reason"] for d in manifest["dropped"] if d["kind"] == "dataset"} == {
        "/subject": leftovers.RECORD_COORDINATE_REASON + "; " + hdf5_reader.SCALE_STAYS}
    assert {u["name"]: u["reason"] for u in manifest["unperturbed"]} == {"/lat": "coordinate",
                                                                         "/visit": "kept by --keep"}
    assert ("coordinates", plain("subject")) not in nc_attributes(tmp_path / "out.nc")["/visit"]
    with netCDF4.Dataset(tmp_path / "out.nc") as ds:
        assert "subject" not in ds.variables and len(ds.dimensions["subject"]) == 3
        assert ds["scan"].shape == (3, 4) and list(ds["lat"][:]) == [40.0, 41.0, 42.0, 43.0]
    for engine in ENGINES:
        with xr.open_dataset(tmp_path / "out.nc", engine=engine) as ds:
            assert "subject" not in ds.variables and ds["scan"].dims == ("subject", "lat")
            assert list(ds.get_index("subject")) == [0, 1, 2] and list(ds["lat"].values) == [40, 41, 42, 43]
    manifest = run(cli, src, tmp_path / "kept.nc", "--dataset", "scan", "--range", "270:290", "--keep", "subject")
    assert {u["name"]: u["reason"] for u in manifest["unperturbed"]}["/subject"] == "kept by --keep"
    with xr.open_dataset(tmp_path / "kept.nc") as ds:
        assert list(ds["subject"].values) == [830112, 830577, 831904]


def test_wrf_coordinates_along_the_time_axis_are_left_out(cli, tmp_path):
    """wrfout's XLAT(Time, south_north, west_east) has a value per record (per time step)."""
    manifest = run(cli, wrf_file(tmp_path / "wrfout.nc"), tmp_path / "out.nc", "--range", "250:310")
    assert "unperturbed" not in manifest
    reasons = {d["name"]: d["reason"] for d in manifest["dropped"]}
    assert reasons["/XLAT"] == reasons["/XLONG"] == leftovers.RECORD_COORDINATE_REASON
    for engine in ENGINES:
        with xr.open_dataset(tmp_path / "out.nc", engine=engine) as ds:
            assert set(ds.variables) == {"T2"} and ds["T2"].shape == (12, 4, 5)


@pytest.mark.parametrize("engine", ENGINES)
def test_a_trajectory_dimension_of_text_identifiers_stays_a_dimension(cli, tmp_path, engine):
    """xarray's trajectories named by text (cf_role): the names are left out, their dimension
    stays, so every reader opens the output with the data's shape."""
    src = tmp_path / "tracks.nc"
    xr.Dataset({"temp": (("trajectory", "obs"), RNG.uniform(270, 290, (3, 4)))},
               coords={"trajectory": ("trajectory", ["alice", "bob", "carol"], {"cf_role": "trajectory_id"}),
                       "lat": (("trajectory", "obs"), RNG.uniform(40, 50, (3, 4)))}).to_netcdf(src, engine=engine)
    manifest = run(cli, src, tmp_path / "out.nc", "--range", "270:290")
    assert {d["name"] for d in manifest["dropped"] if d["kind"] == "dataset"} == {"/trajectory", "/lat"}
    for read in ENGINES:
        with xr.open_dataset(tmp_path / "out.nc", engine=read) as ds:
            assert set(ds.variables) == {"temp"} and dict(ds.sizes) == {"trajectory": 3, "obs": 4}
    with netCDF4.Dataset(tmp_path / "out.nc") as ds:
        assert set(ds.variables) == {"temp"} and ds["temp"].dimensions == ("trajectory", "obs")


@pytest.mark.parametrize("kind", ["NETCDF3_CLASSIC", "NETCDF3_64BIT"])
def test_a_classic_netcdf_file_is_refused_with_the_way_to_convert_it(cli, tmp_path, kind):
    """netCDF-3 (CDF-1, CDF-2) is not HDF5: it was refused as "not a dataset tldp can read",
    though its name ends .nc and the table lists .nc files. It says what it is and how to
    make the netCDF-4 file tldp reads."""
    from tests.builders import assert_one_line_error, siblings

    src = tmp_path / "classic.nc"
    cf_dataset().to_netcdf(src, format=kind, engine="netcdf4")
    before = siblings(tmp_path)
    for command in ("perturb", "plan"):
        assert_one_line_error(cli(command, src, "--eps", "1", "--range", "0:400"), 1, str(src),
                              "a classic netCDF file (netCDF-3)", "nccopy -k nc4")
    assert siblings(tmp_path) == before


def test_packing_derived_from_the_data_is_not_stated(cli, tmp_path):
    """ncpdq (and ERA5's files) pack each variable with a scale_factor and add_offset
    computed from its own minimum and maximum, which they give back exactly: the manifest
    names the packed dtype, never the two numbers (docs/guarantee.md)."""
    physical = np.random.default_rng(11).normal(280, 10, (8, 4, 5))
    low, high = physical.min(), physical.max()
    src = tmp_path / "packed.nc"
    with netCDF4.Dataset(src, "w") as ds:
        for name, size in zip(("time", "y", "x"), physical.shape):
            ds.createDimension(name, size)
        t = ds.createVariable("t", "i2", ("time", "y", "x"))
        t.scale_factor = (high - low) / 65534  # ncpdq's default packing policy
        t.add_offset = (high + low) / 2
        t.units = "K"
        t[:] = physical
        scale, offset = float(t.scale_factor), float(t.add_offset)
    assert offset - 32767 * scale == pytest.approx(low) and offset + 32767 * scale == pytest.approx(high)
    out = tmp_path / "out.nc"
    result = cli("perturb", src, "--out", out, "--eps", "1", "--range", "200:350")
    assert result.exit_code == 0, result.stderr
    text = Path(f"{out}.manifest.json").read_text()
    assert json.loads(text)["unpacked"] == {"/t": {"stored_dtype": "int16", "unsigned": False}}
    for value in (scale, offset, low, high):
        assert repr(value)[:8] not in text and f"{value:g}" not in result.stderr


def sigma_dataset() -> xr.Dataset:
    """temp on a parametric vertical coordinate (CF's atmosphere_sigma_coordinate, whose
    formula_terms names ps and ptop) with a quality flag as its ancillary variable."""
    lev = xr.DataArray(np.linspace(0.1, 0.9, 4), dims="lev", attrs={
        "standard_name": "atmosphere_sigma_coordinate", "formula_terms": "sigma: lev ps: ps ptop: ptop"})
    return xr.Dataset({"temp": (("time", "lev"), RNG.uniform(200, 330, (6, 4)),
                                {"ancillary_variables": "temp_qc", "units": "K"}),
                       "temp_qc": (("time", "lev"), np.zeros((6, 4), np.int8)),
                       "ps": ("time", RNG.uniform(9e4, 1e5, 6)), "ptop": ((), 1000.0)},
                      coords={"lev": lev})


def test_ancillary_variables_and_formula_terms_name_no_variable_left_out(cli, tmp_path):
    """temp's ancillary_variables named temp_qc, and lev's formula_terms ps and ptop, after the
    run left them out: the first names only what is written, the second (a formula missing a
    term) is left out whole; xarray decodes the output without a warning."""
    import warnings

    src = tmp_path / "sigma.nc"
    sigma_dataset().to_netcdf(src)
    run(cli, src, tmp_path / "out.nc", "--dataset", "temp", "--range", "200:330")
    run(cli, src, tmp_path / "kept.nc", "--dataset", "temp", "--range", "200:330", "--keep", "temp_qc")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with xr.open_dataset(tmp_path / "out.nc", decode_coords="all") as ds:
            assert set(ds.variables) == {"temp", "lev"}
            assert "ancillary_variables" not in ds["temp"].attrs and "formula_terms" not in ds["lev"].attrs
            assert ds["lev"].attrs["standard_name"] == "atmosphere_sigma_coordinate"
        with xr.open_dataset(tmp_path / "kept.nc", decode_coords="all") as ds:
            assert ds["temp"].attrs["ancillary_variables"] == "temp_qc" and "temp_qc" in ds.variables
