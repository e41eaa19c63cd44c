"""The direct-chunk path (formats/hdf5_chunks.py): files on which
it must give what HDF5's own filters give (the same run with hdf5_chunks.deflated
switched off), or leave the dataset to HDF5.

- the padding of a last chunk cut by the dataset's end: HDF5 fills it with the dataset's
  fill value, which records appended later (netCDF's unlimited dimension) show;
- HDF5 number types whose stored bytes are not NumPy's (an integer of 12 bits at bit
  offset 4, a 16-bit float that h5py reads as float32): HDF5 converts them;
- a deflate level HDF5's optional filter fails at (the chunk is then stored raw);
- H5D_CHUNK_DONT_FILTER_PARTIAL_CHUNKS: the last, partial chunk is stored unfiltered.
"""

import ctypes
import glob
import os
from pathlib import Path

import h5py
import numpy as np
import pytest
from h5py import h5d, h5p, h5s, h5t, h5z

from tldp_cli.formats import hdf5_chunks
from tldp_cli.run.pipeline import PerturbOptions, perturb

SEED = "dccedd2507739bac4ef8defb161db7ff"
RNG = np.random.default_rng(12)


def run_both(tmp_path: Path, monkeypatch, source: Path, value_range) -> tuple[Path, Path]:
    """The output of the direct-chunk path and of HDF5's filters, same seed."""
    options = {"input": source, "eps": 1.0, "seed": SEED, "value_range": value_range, "workers": 2}
    perturb(PerturbOptions(out=tmp_path / "direct.h5", **options))
    with monkeypatch.context() as m:
        m.setattr(hdf5_chunks, "deflated", lambda *args, **kwargs: None)
        perturb(PerturbOptions(out=tmp_path / "filters.h5", **options))
    return tmp_path / "direct.h5", tmp_path / "filters.h5"


def assert_same_values(a: Path, b: Path, name: str = "x") -> None:
    with h5py.File(a, "r") as fa, h5py.File(b, "r") as fb:
        np.testing.assert_array_equal(fa[name][()], fb[name][()])


def test_padding_of_the_last_chunk_is_the_fill_value(tmp_path, monkeypatch):
    """10 records in chunks of 4, _FillValue -999: records the dataset later grows by
    are missing (the fill value) in the output as in the input, not zeros."""
    netCDF4 = pytest.importorskip("netCDF4")
    source = tmp_path / "edge.nc"
    with netCDF4.Dataset(source, "w") as nc:
        nc.createDimension("time", None)
        nc.createDimension("lat", 8)
        var = nc.createVariable("x", "f4", ("time", "lat"), zlib=True, chunksizes=(4, 8),
                                fill_value=np.float32(-999.0))
        var[:] = RNG.uniform(0, 1, (10, 8))
    outputs = run_both(tmp_path, monkeypatch, source, (0.0, 1.0))
    assert_same_values(*outputs)
    for path in (source, *outputs):
        with netCDF4.Dataset(path, "a") as nc:
            nc["x"][11] = np.ones(8)  # record 10 is never written
        with netCDF4.Dataset(path) as nc:
            assert np.ma.count_masked(nc["x"][10]) == 8, path.name


def make_typed(path: Path, tid: h5t.TypeID, data: np.ndarray, level: int = 4, flags: int = 0) -> Path:
    with h5py.File(path, "w") as f:
        plist = h5p.create(h5p.DATASET_CREATE)
        plist.set_chunk((3, *data.shape[1:]))
        plist.set_shuffle()
        plist.set_filter(h5z.FILTER_DEFLATE, flags, (level,))
        ds = h5d.create(f.id, b"x", tid, h5s.create_simple(data.shape), dcpl=plist)
        ds.write(h5s.ALL, h5s.ALL, data)
    return path


def test_integer_with_a_bit_offset_is_converted_as_hdf5_does(tmp_path, monkeypatch):
    tid = h5t.STD_I16LE.copy()
    tid.set_precision(12)
    tid.set_offset(4)
    data = RNG.integers(-2000, 2000, (12, 5, 4)).astype("i2")
    source = make_typed(tmp_path / "prec.h5", tid, data)
    with h5py.File(source, "r") as f:
        np.testing.assert_array_equal(f["x"][()], data)  # what HDF5 reads
    assert_same_values(*run_both(tmp_path, monkeypatch, source, (-32768.0, 32768.0)))


def test_a_16_bit_float_h5py_reads_as_float32(tmp_path, monkeypatch):
    tid = h5t.IEEE_F32LE.copy()  # bfloat16: float32's exponent, 7 mantissa bits
    tid.set_fields(15, 7, 8, 0, 7)
    tid.set_offset(0)
    tid.set_size(2)
    tid.set_ebias(127)
    source = make_typed(tmp_path / "bf16.h5", tid, RNG.uniform(0, 100, (12, 5, 4)).astype("f4"))
    with h5py.File(source, "r") as f:
        assert f["x"].dtype == np.float32
    assert_same_values(*run_both(tmp_path, monkeypatch, source, (0.0, 100.0)))


def test_a_deflate_level_hdf5_fails_at_is_left_to_hdf5(tmp_path, monkeypatch):
    """An optional deflate filter at level 12: HDF5's filter fails, the chunks are stored
    raw (filter mask), and the output is written the same way; no unexpected error."""
    source = make_typed(tmp_path / "level12.h5", h5t.NATIVE_FLOAT, RNG.uniform(0, 1, (12, 5, 4)).astype("f4"),
                        level=12, flags=h5z.FLAG_OPTIONAL)
    assert_same_values(*run_both(tmp_path, monkeypatch, source, (0.0, 1.0)))


def _hdf5_library():
    libs = glob.glob(os.path.join(os.path.dirname(h5py.__file__), os.pardir, "h5py.libs", "libhdf5-*.so*"))
    if not libs:
        pytest.skip("h5py's own libhdf5 not found (H5Pset_chunk_opts is not in h5py's API)")
    lib = ctypes.CDLL(libs[0])
    lib.H5Pset_chunk_opts.argtypes = [ctypes.c_int64, ctypes.c_uint]
    return lib


def test_an_unfiltered_partial_edge_chunk_is_read(tmp_path, monkeypatch):
    lib = _hdf5_library()
    data = RNG.uniform(0, 1, (10, 6, 5)).astype("f4")
    source = tmp_path / "partial.h5"
    with h5py.File(source, "w", libver="latest") as f:
        plist = h5p.create(h5p.DATASET_CREATE)
        plist.set_chunk((4, 6, 5))
        plist.set_shuffle()
        plist.set_deflate(4)
        assert lib.H5Pset_chunk_opts(plist.id, 0x0002) >= 0  # H5D_CHUNK_DONT_FILTER_PARTIAL_CHUNKS
        ds = h5py.Dataset(h5d.create(f.id, b"x", h5t.NATIVE_FLOAT, h5s.create_simple(data.shape), dcpl=plist))
        ds[...] = data
    with h5py.File(source, "r") as f:
        np.testing.assert_array_equal(f["x"][()], data)
    assert_same_values(*run_both(tmp_path, monkeypatch, source, (0.0, 1.0)))
