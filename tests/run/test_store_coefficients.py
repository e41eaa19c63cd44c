"""--mechanism privunit --store coefficients: each record written as its k released
coefficients (V, the released unit vector) instead of the record written back. The formats
that take a (records, k) array (.npy, HDF5, netCDF, Zarr), read back with the libraries people use;
the rows are unit vectors; the manifest's privunit.stored rebuilds the records a --store
records run of the same seed writes; the refusals, in one line, with nothing left behind."""

import json

import h5py
import numpy as np
import pytest
import zarr

from tests.builders import (DATA, SEED, assert_one_line_error, make_hdf5, make_images, make_npy, make_zarr,
                            perturb_on_threads_and_dask)
from tldp_cli import perturb_array
from tldp_cli.run.pipeline import RESUME_COMPARED, PerturbOptions, perturb


def run(cli, src, out, *args, store="coefficients"):
    result = cli("perturb", src, "--mechanism", "privunit", "--eps", "4", "--out", out, "--store", store,
                 "--seed", SEED, *args)
    assert result.exit_code == 0, result.stderr
    return json.loads((out.parent / (out.name + ".manifest.json")).read_text()), result


def rebuilt(m, V, basis=None):
    """The records --store records writes, from the stored rows and the manifest alone (the
    rule of privunit.stored, as docs/choosing-eps.md's snippet applies it)."""
    unit, stored = m["privunit"], m["privunit"]["stored"]
    if basis is None:
        layout = stored["layout"]
        rows = []
        for c, i, j in stored["coefficient_order"]:
            def dct(n, f):
                x = np.arange(n)
                return np.sqrt((1 if f == 0 else 2) / n) * np.cos(np.pi * (2 * x + 1) * f / (2 * n))
            b = np.zeros((layout["channels"], layout["height"], layout["width"]))
            b[c] = np.outer(dct(layout["height"], i), dct(layout["width"], j))
            rows.append(np.moveaxis(b, 0, 2) if layout["channels_last"] else b)
        basis = np.stack(rows).reshape(len(rows), -1)
    w = np.asarray(stored["write_back_weights"])
    lo, hi = m["value_range"]
    out = np.clip(unit["reference"] + unit["output_scale"]["c"] * (w * V.astype(np.float64)) @ basis, lo, hi)
    return out.reshape(len(V), *unit["record_shape"])


def check_rows(V, records, k):
    assert V.shape == (records, k) and V.dtype == np.float32
    assert np.allclose(np.linalg.norm(V.astype(np.float64), axis=1), 1, atol=1e-6)


def test_npy_rows_are_the_released_unit_vectors_and_rebuild_the_records(cli, tmp_path):
    src, read = make_npy(tmp_path)
    m, result = run(cli, src, tmp_path / "coef.npy", "--basis", "dct:20")
    V = np.load(tmp_path / "coef.npy")
    k = m["privunit"]["k"]
    check_rows(V, len(DATA), k)
    assert k == 20
    assert "stored as" in result.stderr and f"{k} float32 coefficients" in result.stderr
    stored = m["privunit"]["stored"]
    assert stored["kind"] == "coefficients" and stored["dtype"] == "float32" and m["output_dtype"] == "float32"
    assert len(stored["write_back_weights"]) == len(stored["coefficient_order"]) == k
    assert stored["coefficient_order"][0] == [0, 0, 0]
    assert any("no write-back" in step for step in m["postprocessing"]) and "no write-back" in m["privunit"]["written"]
    assert m["accounting"]["per_record"]["epsilon"] <= 4 and m["accounting"]["per_record"]["delta"] == 0
    # the same seed draws the same V: the records run is the write-back of these rows
    records_m, _ = run(cli, src, tmp_path / "rec.npy", "--basis", "dct:20", store="records")
    written = read(tmp_path / "rec.npy")
    assert "stored" not in records_m["privunit"]
    assert np.abs(rebuilt(m, V) - written).max() < 1e-3  # float32 rounding of V and of the records
    assert not np.allclose(rebuilt(m, np.roll(V, 1, axis=0)), written, atol=1)  # it tells records apart


def test_records_is_the_default_and_unchanged(cli, tmp_path):
    src, read = make_npy(tmp_path)
    run(cli, src, tmp_path / "a.npy", store="records")
    result = cli("perturb", src, "--mechanism", "privunit", "--eps", "4", "--out", tmp_path / "b.npy",
                 "--seed", SEED)
    assert result.exit_code == 0, result.stderr
    assert (tmp_path / "a.npy").read_bytes() == (tmp_path / "b.npy").read_bytes()
    assert read(tmp_path / "b.npy").shape == DATA.shape


def test_hdf5_dataset_becomes_records_by_k(cli, tmp_path):
    src, read = make_hdf5(tmp_path)
    m, _ = run(cli, src, tmp_path / "coef.h5")
    with h5py.File(tmp_path / "coef.h5", "r") as f:
        V = f["x"][...]
        assert not f["x"].attrs.keys()
    check_rows(V, len(DATA), m["privunit"]["k"])
    run(cli, src, tmp_path / "rec.h5", store="records")
    assert np.abs(rebuilt(m, V) - read(tmp_path / "rec.h5")).max() < 1e-3


def make_netcdf(tmp_path):
    import xarray as xr

    path = tmp_path / "t.nc"
    values = DATA[:, :, :6].astype(np.float32)
    time = np.arange(len(values), dtype=np.float64)
    xr.Dataset({"t2m": (("time", "lat", "lon"), values, {"units": "K"})},
               coords={"time": ("time", time, {"units": "days since 2000-01-01"}),
                       "lat": ("lat", np.linspace(-10, 10, 8)), "lon": ("lon", np.linspace(0, 5, 6))},
               attrs={"Conventions": "CF-1.8"}).to_netcdf(path, engine="netcdf4")
    return path, values, time


def test_netcdf_keeps_the_record_dimension_and_adds_a_coefficient_dimension(cli, tmp_path):
    import netCDF4
    import xarray as xr

    src, values, time = make_netcdf(tmp_path)
    m, _ = run(cli, src, tmp_path / "coef.nc", "--range", "0:256", "--keep", "time")  # time(time): a value per record
    k = m["privunit"]["k"]
    with xr.open_dataset(tmp_path / "coef.nc", engine="netcdf4") as ds:
        assert ds["t2m"].dims == ("time", "coefficient")
        assert ds.sizes["coefficient"] == k and list(ds["coefficient"].values) == list(range(k))
        assert ds["t2m"].dtype == np.float32
        V = ds["t2m"].values
        assert ds["time"].encoding["units"] == "days since 2000-01-01"  # decoded to dates: the units kept
    with netCDF4.Dataset(tmp_path / "coef.nc") as nc:
        assert nc.variables["t2m"].dimensions == ("time", "coefficient")
        assert np.array_equal(nc.variables["time"][:], time)
        assert np.array_equal(nc.variables["t2m"][:], V)
    check_rows(V, len(values), k)
    run(cli, src, tmp_path / "rec.nc", "--range", "0:256", store="records")
    with xr.open_dataset(tmp_path / "rec.nc", engine="netcdf4") as ds:
        written = ds["t2m"].values
    assert np.abs(rebuilt(m, V) - written).max() < 1e-3


@pytest.mark.parametrize("grouped", [False, True])
def test_netcdf_dimension_scales_list_only_the_axes_attached(cli, tmp_path, grouped):
    """Each dimension scale's REFERENCE_LIST names the (dataset, axis) pairs it is attached to,
    each once: time's listed t2m's axis 0 twice (copied from the input, then attached again),
    and lat and lon t2m's axes 1 and 2, which the coefficients do not have (axis 2 does not
    exist). Grouped: netCDF4's variable in a group on the root's dimensions, beside another
    group's variable not written."""
    import netCDF4
    from h5py import h5ds

    if grouped:
        src, var, group = tmp_path / "groups.nc", "/forecast/t2m", "forecast/"
        with netCDF4.Dataset(src, "w") as nc:
            for name, size in (("time", None), ("lat", 8), ("lon", 6)):
                nc.createDimension(name, size)
            nc.createVariable("time", "f8", ("time",))[:] = np.arange(len(DATA))
            nc.createGroup("forecast").createVariable("t2m", "f4", ("time", "lat", "lon"))[:] = DATA[:, :, :6]
            nc.createGroup("obs").createVariable("n", "u1", ("time", "lat", "lon"))[:] = DATA[:, :, :6]
        run(cli, src, tmp_path / "coef.nc", "--range", "0:256", "--dataset", var)
    else:
        src, var, group = make_netcdf(tmp_path)[0], "/t2m", ""
        run(cli, src, tmp_path / "coef.nc", "--range", "0:256")
    with h5py.File(tmp_path / "coef.nc") as f:
        listed = {}
        for name in ("time", "lat", "lon", group + "coefficient"):
            refs = f[name].attrs.get("REFERENCE_LIST")
            listed[name] = [] if refs is None else [(f[ref].name, int(axis)) for ref, axis in refs]
            for dataset, axis in listed[name]:
                assert axis < f[dataset].ndim and h5ds.is_attached(f[dataset].id, f[name].id, axis)
        assert listed == {"time": [(var, 0)], "lat": [], "lon": [], group + "coefficient": [(var, 1)]}
    with netCDF4.Dataset(tmp_path / "coef.nc") as nc:
        assert nc[var.strip("/")].dimensions == ("time", "coefficient")


def make_stations():
    """xarray's dataset of stations: t(station, y, x) with a per-station elev(station) and a grid
    lat(y, x), both named by t's coordinates attribute."""
    import xarray as xr

    values = DATA[:, :, :6].astype(np.float32)
    elev = np.arange(len(values), dtype=np.float64) * 10
    return xr.Dataset({"t": (("station", "y", "x"), values, {"units": "K"})},
                      coords={"elev": ("station", elev, {"units": "m"}), "lat": (("y", "x"), np.ones((8, 6))),
                              "y": np.arange(8.0), "x": np.arange(6.0)}), elev


def test_netcdf_kept_record_coordinates_stay_coordinates_of_the_coefficients(cli, tmp_path):
    import netCDF4
    import xarray as xr

    ds, elev = make_stations()
    ds.to_netcdf(tmp_path / "s.nc", engine="netcdf4")
    run(cli, tmp_path / "s.nc", tmp_path / "kept.nc", "--range", "0:256", "--keep", "elev")
    with xr.open_dataset(tmp_path / "kept.nc", engine="netcdf4", decode_coords="all") as out:
        assert "elev" in out.coords and "elev" not in out.data_vars
        assert np.array_equal(out["t"].coords["elev"].values, elev) and out["t"].dims == ("station", "coefficient")
    with netCDF4.Dataset(tmp_path / "kept.nc") as nc:  # lat(y, x) is on no dimension of t now
        assert nc.variables["t"].getncattr("coordinates") == "elev" and "lat" in nc.variables
    run(cli, tmp_path / "s.nc", tmp_path / "dropped.nc", "--range", "0:256")  # elev left out: named by nothing
    with netCDF4.Dataset(tmp_path / "dropped.nc") as nc:
        assert "elev" not in nc.variables and "coordinates" not in nc.variables["t"].ncattrs()


@pytest.mark.parametrize("zarr_format", [2, 3])
def test_xarray_zarr_kept_record_coordinates_stay_coordinates_of_the_coefficients(cli, tmp_path, zarr_format):
    import xarray as xr

    ds, elev = make_stations()
    ds.to_zarr(tmp_path / "s.zarr", zarr_format=zarr_format, consolidated=zarr_format == 2)
    run(cli, tmp_path / "s.zarr", tmp_path / "kept.zarr", "--range", "0:256", "--keep", "elev")
    with xr.open_zarr(tmp_path / "kept.zarr", consolidated=zarr_format == 2, decode_coords="all") as out:
        assert "elev" in out.coords and "elev" not in out.data_vars
        assert np.array_equal(out["t"].coords["elev"].values, elev) and out["t"].dims == ("station", "coefficient")
    assert zarr.open_array(str(tmp_path / "kept.zarr" / "t"), mode="r").attrs["coordinates"] == "elev"
    run(cli, tmp_path / "s.zarr", tmp_path / "dropped.zarr", "--range", "0:256")
    assert "coordinates" not in zarr.open_array(str(tmp_path / "dropped.zarr" / "t"), mode="r").attrs


def test_a_user_basis_is_rebuilt_from_its_file(cli, tmp_path):
    src, read = make_npy(tmp_path)
    q, _ = np.linalg.qr(np.random.default_rng(3).normal(size=(64, 10)))
    np.save(tmp_path / "basis.npy", q.T)
    m, _ = run(cli, src, tmp_path / "coef.npy", "--basis", tmp_path / "basis.npy")
    stored = m["privunit"]["stored"]
    assert "layout" not in stored and "coefficient_order" not in stored and stored["write_back_weights"] == [1.0] * 10
    V = np.load(tmp_path / "coef.npy")
    check_rows(V, len(DATA), 10)
    run(cli, src, tmp_path / "rec.npy", "--basis", tmp_path / "basis.npy", store="records")
    assert np.abs(rebuilt(m, V, np.load(tmp_path / "basis.npy")) - read(tmp_path / "rec.npy")).max() < 1e-3
    import tldp_cli
    from tldp_cli.errors import InputError

    assert np.abs(tldp_cli.rebuild_records(m, V, q.T) - read(tmp_path / "rec.npy")).max() < 1e-3
    for wrong in (q.T[:, :60], q.T[:9]):  # another record size, another k: named, not a NumPy error
        with pytest.raises(InputError, match=r"the basis has shape .*need \(10, 64\)"):
            tldp_cli.rebuild_records(m, V, wrong)
    # Without the basis, the message names the keyword that takes it (it said "give its rows").
    with pytest.raises(InputError, match=r"pass basis=np\.load\(privunit\.basis\.path\)"):
        tldp_cli.rebuild_records(m, V)


def test_dtype_float64_stores_v_unrounded(cli, tmp_path):
    src, _ = make_npy(tmp_path)
    m, _ = run(cli, src, tmp_path / "c64.npy", "--dtype", "float64")
    run(cli, src, tmp_path / "c32.npy")
    V64, V32 = np.load(tmp_path / "c64.npy"), np.load(tmp_path / "c32.npy")
    assert V64.dtype == np.float64 and m["privunit"]["stored"]["dtype"] == "float64"
    assert np.array_equal(V64.astype(np.float32), V32)  # one rounding of the same V
    assert np.allclose(np.linalg.norm(V64, axis=1), 1, atol=1e-12)
    # V is float64 already: the manifest claims no rounding (it did: "rounded once to float64")
    assert "rounded" not in m["privunit"]["stored"]["values"]
    assert "no rounding" in m["postprocessing"][0] and "one rounding" not in m["postprocessing"][0]
    assert "rounded once to float32" in run(cli, src, tmp_path / "again.npy")[0]["privunit"]["stored"]["values"]


def test_workers_and_blocking_do_not_change_the_rows(cli, tmp_path):
    src, _ = make_npy(tmp_path)
    run(cli, src, tmp_path / "a.npy", "--workers", "1")
    run(cli, src, tmp_path / "b.npy", "--workers", "2", "--block-elements", "300")
    assert (tmp_path / "a.npy").read_bytes() == (tmp_path / "b.npy").read_bytes()


def test_perturb_array_returns_the_rows_perturb_writes(cli, tmp_path):
    src, _ = make_npy(tmp_path)
    run(cli, src, tmp_path / "coef.npy")
    result = perturb_array(DATA, eps=4, mechanism="privunit", store="coefficients", seed=SEED)
    assert np.array_equal(result.array, np.load(tmp_path / "coef.npy"))
    options = PerturbOptions(input=src, eps=4, mechanism="privunit", store="coefficients", seed=SEED,
                             out=tmp_path / "lib.npy")
    assert perturb(options).manifest["privunit"]["stored"]["kind"] == "coefficients"
    assert np.array_equal(np.load(tmp_path / "lib.npy"), result.array)


def test_perturb_array_s_rows_rebuild_its_records_run(tmp_path):
    """perturb_array(..., store="coefficients") has no manifest: its Perturbed carries the
    manifest's privunit object, so rebuild_records(result, result.array) gives the records
    store="records" of the same seed returns (the DCT default and a user's basis)."""
    import tldp_cli
    from tldp_cli.errors import InputError

    q, _ = np.linalg.qr(np.random.default_rng(3).normal(size=(64, 10)))
    np.save(tmp_path / "basis.npy", q.T)
    for basis, rows in ((None, None), ("dct:20", None), (str(tmp_path / "basis.npy"), q.T)):
        coef, records = (perturb_array(DATA, eps=4, mechanism="privunit", basis=basis, store=store, seed=SEED)
                         for store in ("coefficients", "records"))
        assert coef.privunit["stored"]["kind"] == "coefficients" and "stored" not in records.privunit
        assert np.abs(tldp_cli.rebuild_records(coef, coef.array, rows) - records.array).max() < 1e-3
    assert perturb_array(DATA, eps=4, seed=SEED).privunit is None
    with pytest.raises(InputError, match="not of perturb_array"):
        tldp_cli.rebuild_records(records, coef.array)


def test_plan_says_what_is_stored(cli, tmp_path):
    src, _ = make_npy(tmp_path)
    result = cli("plan", src, "--mechanism", "privunit", "--eps", "4", "--store", "coefficients", "--json")
    assert result.exit_code == 0, result.stderr
    plan = json.loads(result.stdout)
    k = plan["privunit"]["k"]
    assert plan["privunit"]["stored"]["kind"] == "coefficients"
    assert f"stored as {k} float32 coefficients per record" in result.stderr
    assert "stored" not in json.loads(cli("plan", src, "--mechanism", "privunit", "--eps", "4",
                                          "--json").stdout)["privunit"]


def test_resume_compares_the_option():
    assert "store" in RESUME_COMPARED


def test_zarr_array_becomes_records_by_k(cli, tmp_path):
    src, read = make_zarr(tmp_path)  # Zarr 3, sharded
    m, _ = run(cli, src, tmp_path / "coef.zarr")
    array = zarr.open_array(str(tmp_path / "coef.zarr"), mode="r")
    V = array[...]
    check_rows(V, len(DATA), m["privunit"]["k"])
    assert array.metadata.zarr_format == 3 and not dict(array.attrs)
    run(cli, src, tmp_path / "rec.zarr", store="records")
    assert np.abs(rebuilt(m, V) - read(tmp_path / "rec.zarr")).max() < 1e-3


@pytest.mark.parametrize("zarr_format", [2, 3])
def test_xarray_zarr_keeps_the_record_dimension_and_adds_a_coefficient_dimension(cli, tmp_path, zarr_format):
    import xarray as xr

    values = DATA[:, :, :6].astype(np.float32)
    time = np.arange(len(values), dtype=np.float64)
    xr.Dataset({"t2m": (("time", "lat", "lon"), values, {"units": "K"})},
               coords={"time": time, "lat": np.linspace(-10, 10, 8), "lon": np.linspace(0, 5, 6)}
               ).to_zarr(tmp_path / "t.zarr", zarr_format=zarr_format, consolidated=zarr_format == 2)
    m, _ = run(cli, tmp_path / "t.zarr", tmp_path / "coef.zarr", "--range", "0:256")
    with xr.open_zarr(tmp_path / "coef.zarr", consolidated=zarr_format == 2) as ds:
        assert ds["t2m"].dims == ("time", "coefficient") and ds["t2m"].dtype == np.float32
        assert np.array_equal(ds["time"].values, time) and "units" not in ds["t2m"].attrs
        V = ds["t2m"].values
    check_rows(V, len(values), m["privunit"]["k"])


def test_resume_is_refused_for_coefficients(cli, tmp_path):
    src, _ = make_zarr(tmp_path)
    result = cli("perturb", src, "--mechanism", "privunit", "--eps", "4", "--store", "coefficients", "--resume")
    assert_one_line_error(result, 2, "--resume", "--store coefficients run is written whole")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.zarr"]


def test_an_image_folder_is_refused(cli, tmp_path):
    src, _ = make_images(tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    result = cli("perturb", src, "--mechanism", "privunit", "--eps", "4", "--store", "coefficients")
    assert_one_line_error(result, 2, "--store coefficients does not apply to images (folder of images)",
                          "npy (.npy array), hdf5 (HDF5 file), zarr (Zarr store)")
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_model_files_and_tables_are_refused(cli, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from safetensors.numpy import save_file

    save_file({"w": np.zeros((4, 4), np.float32)}, tmp_path / "m.safetensors")
    np.savez(tmp_path / "m.npz", w=np.zeros((4, 4), np.float32))
    pq.write_table(pa.table({"x": [[0.5, 0.25]] * 3}), tmp_path / "t.parquet")
    before = sorted(p.name for p in tmp_path.iterdir())
    for name, fmt in (("m.safetensors", "safetensors"), ("m.npz", "npz"), ("t.parquet", "parquet")):
        result = cli("perturb", tmp_path / name, "--mechanism", "privunit", "--eps", "4", "--clip", "1",
                     "--store", "coefficients")
        assert_one_line_error(result, 2, "--store coefficients does not apply to", f"{fmt} (")
    assert sorted(p.name for p in tmp_path.iterdir()) == before


@pytest.mark.parametrize("args,fragment", [
    ((), "--store coefficients applies to --mechanism privunit"),
    (("--mechanism", "mvg", "--sampler", "float", "--noise", "gaussian"), "--mechanism mvg writes records"),
])
def test_coefficients_need_privunit(cli, tmp_path, args, fragment):
    src, _ = make_npy(tmp_path)
    result = cli("perturb", src, "--eps", "4", "--store", "coefficients", *args)
    assert_one_line_error(result, 2, fragment)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.npy"]


def test_several_record_shapes_are_refused(cli, tmp_path):
    with h5py.File(tmp_path / "two.h5", "w") as f:
        f["a"] = DATA
        f["b"] = DATA[:, :4, :4]
    result = cli("perturb", tmp_path / "two.h5", "--mechanism", "privunit", "--eps", "4",
                 "--store", "coefficients", "--dataset", "a", "--dataset", "b")
    assert_one_line_error(result, 2, "--store coefficients", "one --dataset at a time")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["two.h5"]


def test_evaluate_compares_the_records_the_rows_rebuild(cli, tmp_path):
    src, _ = make_npy(tmp_path)
    run(cli, src, tmp_path / "coef.npy")
    run(cli, src, tmp_path / "rec.npy", store="records")
    reports = {}
    for name in ("coef.npy", "rec.npy"):
        result = cli("evaluate", src, tmp_path / name, "--json", "--per-record")
        assert result.exit_code == 0, result.stderr
        reports[name] = json.loads(result.stdout)
    coef, rec = reports["coef.npy"], reports["rec.npy"]
    checks = {c["check"]: c for c in coef["checks"]}
    assert coef["ok"] and checks["shapes"]["passed"] and checks["coefficients"]["passed"]
    assert "coefficients" not in {c["check"] for c in rec["checks"]}
    assert np.allclose(coef["per_record"]["mse"], rec["per_record"]["mse"], rtol=1e-4)
    assert checks["privunit_alignment"]["mean_cosine"] == pytest.approx(
        next(c for c in rec["checks"] if c["check"] == "privunit_alignment")["mean_cosine"], abs=1e-4)


def test_the_preview_shows_the_rebuilt_records(cli, tmp_path):
    from PIL import Image

    src, _ = make_npy(tmp_path)
    preview = tmp_path / "p.png"
    run(cli, src, tmp_path / "coef.npy", "--preview", preview)
    run(cli, src, tmp_path / "rec.npy", "--preview", tmp_path / "q.png", store="records")
    shown, expected = (np.asarray(Image.open(p), dtype=np.int16) for p in (preview, tmp_path / "q.png"))
    assert shown.shape == expected.shape and np.abs(shown - expected).max() <= 1


def test_rebuild_records_is_the_library_s(cli, tmp_path):
    import tldp_cli
    from tldp_cli.errors import InputError

    src, read = make_npy(tmp_path)
    m, _ = run(cli, src, tmp_path / "coef.npy")
    records_m, _ = run(cli, src, tmp_path / "rec.npy", store="records")
    rows = np.load(tmp_path / "coef.npy")
    assert np.abs(tldp_cli.rebuild_records(m, rows) - read(tmp_path / "rec.npy")).max() < 1e-3
    assert np.allclose(tldp_cli.rebuild_records(m, rows), rebuilt(m, rows), atol=1e-9)
    with pytest.raises(InputError, match="not of a --store coefficients run"):
        tldp_cli.rebuild_records(records_m, rows)
    with pytest.raises(InputError, match=r"shape \(200, 3\)"):
        tldp_cli.rebuild_records(m, rows[:, :3])


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")
def test_a_multiscale_image_is_refused_with_nothing_left(cli, tmp_path):
    from ome_zarr.format import FormatV05

    from tests.formats.test_ome_zarr import make_ome

    src = make_ome(tmp_path / "cells.ome.zarr", FormatV05(), labels=False)
    result = cli("perturb", src, "--mechanism", "privunit", "--eps", "4", "--store", "coefficients",
                 "--range", "0:256")
    assert_one_line_error(result, 2, "--store coefficients applies to arrays of records, not to multiscale images")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cells.ome.zarr"]


@pytest.mark.dask
@pytest.mark.parametrize("make,suffix", [(make_npy, ".npy"), (make_zarr, ".zarr"), (make_hdf5, ".h5")])
def test_dask_equals_threads(tmp_path, make, suffix):
    pytest.importorskip("distributed")
    src, read = make(tmp_path)
    threads, dask = (read(p) for p in perturb_on_threads_and_dask(tmp_path, src, suffix, mechanism="privunit",
                                                                   store="coefficients"))
    assert threads.ndim == 2 and threads.dtype == np.float32
    np.testing.assert_array_equal(threads, dask)


def test_keras_weights_are_refused_by_plan_and_perturb(cli, tmp_path):
    from tests.formats.test_model_checkpoints import write_keras_weights

    src = write_keras_weights(tmp_path / "model.weights.h5")
    for command in ("plan", "perturb"):
        result = cli(command, src, "--mechanism", "privunit", "--eps", "4", "--clip", "0.5",
                     "--store", "coefficients")
        assert_one_line_error(result, 2, "--store coefficients", "each tensor is one record")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.weights.h5"]


def test_netcdf4_unlimited_dimension_without_a_coordinate_variable(cli, tmp_path):
    import netCDF4
    import xarray as xr

    with netCDF4.Dataset(tmp_path / "bare.nc", "w") as nc:
        nc.createDimension("sample", None)
        nc.createDimension("y", 8)
        nc.createDimension("x", 8)
        nc.createVariable("img", "f4", ("sample", "y", "x"))[:] = DATA / 256
    m, _ = run(cli, tmp_path / "bare.nc", tmp_path / "coef.nc", "--range", "0:1")
    with netCDF4.Dataset(tmp_path / "coef.nc") as nc:
        assert nc.variables["img"].dimensions == ("sample", "coefficient")
        assert nc.dimensions["sample"].isunlimited() and len(nc.dimensions["sample"]) == len(DATA)
    with xr.open_dataset(tmp_path / "coef.nc", engine="netcdf4") as ds:
        check_rows(ds["img"].values, len(DATA), m["privunit"]["k"])


def test_a_coefficients_run_removes_an_interrupted_run_s_partial(cli, tmp_path):
    from tests.run.test_resume import BLOCK, interrupted
    from tldp_cli.run.resume import partial_path

    src, out = interrupted(tmp_path)
    assert partial_path(out).is_dir()
    result = cli("perturb", src, "--mechanism", "privunit", "--eps", "4", "--store", "coefficients", "--out", out,
                 "--block-elements", BLOCK)
    assert result.exit_code == 0, result.stderr
    assert "partial output of an interrupted run" in result.stderr
    assert not partial_path(out).exists() and zarr.open_array(str(out), mode="r").ndim == 2


def test_a_volume_s_rows_rebuild_from_the_manifest_s_3d_order(cli, tmp_path):
    """Volumes take the 3-D DCT (projection.VolumeDctBasis): the manifest's layout has a depth
    and its coefficient order [c, i, j, l], from which B is built as for images."""
    rng = np.random.default_rng(3)
    src = tmp_path / "vol.npy"
    np.save(src, rng.integers(0, 256, size=(12, 6, 8, 10)).astype(np.uint8))
    m, _ = run(cli, src, tmp_path / "coef.npy", "--basis", "dct:30")
    stored = m["privunit"]["stored"]
    layout = stored["layout"]
    assert (layout["depth"], layout["height"], layout["width"]) == (6, 8, 10)
    assert all(len(entry) == 4 for entry in stored["coefficient_order"])
    V = np.load(tmp_path / "coef.npy")
    check_rows(V, 12, 30)

    def dct(n, f):
        x = np.arange(n)
        return np.sqrt((1 if f == 0 else 2) / n) * np.cos(np.pi * (2 * x + 1) * f / (2 * n))

    basis = np.stack([np.einsum("a,b,c->abc", dct(6, i), dct(8, j), dct(10, l)).ravel()
                      for c, i, j, l in stored["coefficient_order"]])
    run(cli, src, tmp_path / "rec.npy", "--basis", "dct:30", store="records")
    written = np.load(tmp_path / "rec.npy").astype(np.float64)
    import tldp_cli

    assert np.abs(rebuilt(m, V, basis) - written).max() <= 0.5 + 1e-3  # the uint8 write rounds
    assert np.abs(tldp_cli.rebuild_records(m, V) - written).max() <= 0.5 + 1e-3
