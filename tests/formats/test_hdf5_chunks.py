"""Deflated HDF5 chunks read and written outside HDF5 (formats/hdf5_chunks.py): files
made by h5py and netCDF-C (netCDF4-python), read back by h5py, netCDF4 and xarray, and
the same output values as HDF5's own filters give."""

import dataclasses
import json
import tracemalloc
import zlib
from pathlib import Path

import h5py
import numpy as np
import pytest

from tests.builders import assert_one_line_error, run_measured, siblings
from tldp_cli.formats import hdf5_chunks
from tldp_cli.run.pipeline import PerturbOptions, perturb

netCDF4 = pytest.importorskip("netCDF4")
xr = pytest.importorskip("xarray")

SHAPE = (23, 6, 5)
RNG = np.random.default_rng(4)
SEED = "dccedd2507739bac4ef8defb161db7ff"


def values(dtype) -> np.ndarray:
    return (RNG.normal(100, 20, SHAPE)).astype(dtype)


# name -> (dtype, create_dataset keyword arguments)
DEFLATED = {
    "gzip 4 shuffle f4": ("f4", dict(chunks=(4, 6, 5), compression="gzip", compression_opts=4, shuffle=True)),
    "gzip 1 i2": ("i2", dict(chunks=(5, 6, 5), compression="gzip", compression_opts=1)),
    "gzip 9 shuffle big-endian f8": (">f8", dict(chunks=(1, 6, 5), compression="gzip", compression_opts=9,
                                                 shuffle=True)),
    "gzip u1 one chunk": ("u1", dict(chunks=(23, 6, 5), compression="gzip", shuffle=True)),
}
OTHER = {
    "chunks split records": dict(chunks=(4, 3, 5), compression="gzip"),
    "fletcher32": dict(chunks=(4, 6, 5), compression="gzip", fletcher32=True),
    "lzf": dict(chunks=(4, 6, 5), compression="lzf"),
    "shuffle only": dict(chunks=(4, 6, 5), shuffle=True),
    "contiguous": dict(),
}


def make(path: Path, dtype, kwargs, data=None) -> np.ndarray:
    data = values(dtype) if data is None else data
    with h5py.File(path, "w") as f:
        f.create_dataset("x", data=data, dtype=dtype, **kwargs)
    return data


@pytest.mark.parametrize("name", DEFLATED)
def test_reads_what_hdf5_wrote(tmp_path, name):
    dtype, kwargs = DEFLATED[name]
    data = make(tmp_path / "a.h5", dtype, kwargs)
    with h5py.File(tmp_path / "a.h5", "r") as f:
        layout = hdf5_chunks.deflated(f["x"])
        assert layout is not None
        for start, stop in [(0, 23), (0, 1), (3, 9), (20, 23), (22, 40)]:
            got = layout.read(f["x"], start, stop)
            assert got.dtype.isnative
            np.testing.assert_array_equal(got, data[start:stop], err_msg=f"{name} {start}:{stop}")


@pytest.mark.parametrize("huffman_only", [False, True])
@pytest.mark.parametrize("name", DEFLATED)
def test_writes_chunks_hdf5_and_netcdf4_read(tmp_path, name, huffman_only):
    dtype, kwargs = DEFLATED[name]
    data = values(dtype)
    path = tmp_path / "out.h5"
    with h5py.File(path, "w") as f:
        ds = f.create_dataset("x", shape=SHAPE, dtype=dtype, **kwargs)
        layout = dataclasses.replace(hdf5_chunks.deflated(ds, allocated=False), huffman_only=huffman_only)
        step = 2 * layout.chunk_records
        for start in range(0, SHAPE[0], step):  # blocks of two chunks, the last cut by the end
            assert layout.aligned(start, len(data[start:start + step]))
            for offset, chunk in layout.encoded(start, data[start:start + step]):
                ds.id.write_direct_chunk(offset, chunk)
    with h5py.File(path, "r") as f:
        np.testing.assert_array_equal(f["x"][:], data)
        assert (f["x"].compression, f["x"].compression_opts, f["x"].shuffle) == \
            ("gzip", kwargs.get("compression_opts", 4), kwargs.get("shuffle", False))
    with netCDF4.Dataset(path) as nc:  # netCDF-C reads it through HDF5's own filters
        np.testing.assert_array_equal(nc["x"][:], data)


def test_a_chunk_stored_without_its_deflate_is_read(tmp_path):
    """HDF5 skips an optional filter that fails and says so in the chunk's filter mask."""
    data = values("f4")
    path = tmp_path / "a.h5"
    with h5py.File(path, "w") as f:
        ds = f.create_dataset("x", shape=SHAPE, dtype="f4", chunks=(23, 6, 5), compression="gzip", shuffle=True)
        shuffled = np.ascontiguousarray(data.view(np.uint8).reshape(-1, 4).T).tobytes()
        ds.id.write_direct_chunk((0, 0, 0), shuffled, filter_mask=2)  # deflate skipped
    with h5py.File(path, "r") as f:
        np.testing.assert_array_equal(f["x"][:], data)
        np.testing.assert_array_equal(hdf5_chunks.deflated(f["x"]).read(f["x"], 0, 23), data)


@pytest.mark.parametrize("name", OTHER)
def test_other_layouts_are_left_to_hdf5(tmp_path, name):
    make(tmp_path / "a.h5", "f4", OTHER[name])
    with h5py.File(tmp_path / "a.h5", "r") as f:
        assert hdf5_chunks.deflated(f["x"]) is None


def test_unwritten_chunks_are_left_to_hdf5(tmp_path):
    with h5py.File(tmp_path / "a.h5", "w") as f:
        ds = f.create_dataset("x", shape=SHAPE, dtype="f4", chunks=(4, 6, 5), compression="gzip")
        ds[:8] = 1.0
        assert hdf5_chunks.deflated(ds) is None
        assert hdf5_chunks.deflated(ds, allocated=False) is not None


def netcdf_file(path: Path) -> np.ndarray:
    """A netCDF-4 file as netCDF-C writes it: zlib and shuffle, one time step per chunk."""
    data = np.round(RNG.uniform(250, 300, (12, 20, 30)), 1).astype("f4")
    with netCDF4.Dataset(path, "w") as nc:
        for name, size in zip(("time", "lat", "lon"), data.shape):
            nc.createDimension(name, size)
        var = nc.createVariable("t2m", "f4", ("time", "lat", "lon"), zlib=True, complevel=4, shuffle=True,
                                chunksizes=(1, 20, 30), fill_value=np.float32(-999.0))
        var.units = "K"
        data[3, 4, 5] = -999.0  # missing
        var[:] = np.ma.masked_equal(data, -999.0)
    return data


def test_netcdf_output_equals_hdf5s_filters_and_opens_in_netcdf4_and_xarray(tmp_path, monkeypatch):
    data = netcdf_file(tmp_path / "era.nc")
    options = dict(input=tmp_path / "era.nc", eps=1.0, seed=SEED, value_range=(200.0, 350.0), workers=2)
    perturb(PerturbOptions(out=tmp_path / "here.nc", **options))
    monkeypatch.setattr(hdf5_chunks, "deflated", lambda *args, **kwargs: None)
    perturb(PerturbOptions(out=tmp_path / "hdf5.nc", **options))
    with netCDF4.Dataset(tmp_path / "here.nc") as here, netCDF4.Dataset(tmp_path / "hdf5.nc") as theirs:
        np.testing.assert_array_equal(here["t2m"][:].filled(np.nan), theirs["t2m"][:].filled(np.nan))
        assert here["t2m"].filters() == theirs["t2m"].filters()
        assert here["t2m"].filters()["zlib"] and here["t2m"].filters()["shuffle"]
        assert here["t2m"][3, 4, 5] is np.ma.masked  # missing stays missing
    after = xr.open_dataset(tmp_path / "here.nc")["t2m"].values
    assert np.isnan(after[3, 4, 5]) and np.isnan(after).sum() == 1
    noise = after - data
    assert 1 < np.nanstd(noise) < 1000  # perturbed, on the declared range's scale
    manifest = json.loads(Path(f"{tmp_path / 'here.nc'}.manifest.json").read_text())
    assert manifest["missing_values"]["/t2m"]["moved_off_markers"] >= 0
    assert manifest["deflate_huffman_only"] == ["/t2m"]


def expanding_file(path: Path, expands_to: int) -> None:
    """A deflated dataset h5py wrote, whose chunk of records 4-8 (600 bytes) h5py's direct
    chunk write replaced by a deflate stream of `expands_to` zero bytes."""
    make(path, "u1", dict(chunks=(4, 6, 5), compression="gzip"))
    with h5py.File(path, "r+") as f:
        f["x"].id.write_direct_chunk((4, 0, 0), zlib.compress(bytes(expands_to), 1))


def test_a_chunk_that_inflates_beyond_its_chunk_is_refused_before_it_is(cli, tmp_path):
    """Issue 27, item 11: zlib.decompress inflated the whole stream (16 MB here, gigabytes
    in the review) before its size was compared with the chunk's 120 bytes."""
    expanding_file(tmp_path / "a.h5", 16 << 20)
    with h5py.File(tmp_path / "a.h5", "r") as f:
        layout = hdf5_chunks.deflated(f["x"])
        tracemalloc.start()
        try:
            with pytest.raises(ValueError, match="its chunk of records 4-8: it expands to more than the 120 "
                                                 "bytes a chunk holds"):
                layout.read(f["x"], 0, 23)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert peak < 1 << 20, f"{peak} bytes allocated to refuse it"
    before = siblings(tmp_path)
    assert_one_line_error(cli("perturb", tmp_path / "a.h5", "--eps", "1", "--range", "0:255"), 1,
                          f"{tmp_path / 'a.h5'}: cannot read records", "dataset /x",
                          "its chunk of records 4-8: it expands to more than the 120 bytes")
    assert siblings(tmp_path) == before


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the peak memory from /proc")
def test_a_run_over_an_inflating_chunk_stays_small(tmp_path):
    expanding_file(tmp_path / "a.h5", 512 << 20)
    code, stderr, peak = run_measured(tmp_path, "perturb", tmp_path / "a.h5", "--eps", "1", "--range", "0:255",
                                      "--out", tmp_path / "out.h5", "--workers", "1")
    lines = stderr.strip().splitlines()
    assert code == 1 and len(lines) == 1 and "cannot read records" in lines[0], stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.h5"]
    assert peak < 300 << 20, f"peak RSS {peak >> 20} MB"
