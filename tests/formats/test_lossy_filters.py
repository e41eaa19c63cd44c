"""Lossy filters are left off perturbed outputs (issue "Certified means the bytes on
disk", item 6): HDF5 scale-offset and the registered lossy plugins, Zarr Quantize,
BitRound, FixedScaleOffset and AsType, in format 2 and 3. The noisy values are stored
exactly (multiples of the manifest's grid step), lossless filters stay, the manifest
lists what was dropped, and evaluate passes.
"""

import json
import warnings
from pathlib import Path

import h5py
import numcodecs
import numpy as np
import pytest
import zarr
from h5py import h5d, h5p, h5s, h5t, h5z

from tests.builders import SEED, siblings

RNG = np.random.default_rng(11)
DATA = RNG.uniform(0, 255, (40, 8, 8)).astype(np.float32)  # float "images" in 0:256
STORED_EXACTLY = ("store the noisy values exactly: the input's lossy filters are not applied to "
                  "the perturbed arrays (dropped_filters)")

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # "numcodecs codecs are not in the Zarr version 3 spec"
    from numcodecs import zarr3


def ok(result):
    assert result.exit_code == 0, result.stderr
    return result


def manifest_of(out: Path) -> dict:
    return json.loads(Path(str(out) + ".manifest.json").read_text())


GRANULARITY = "0.001953125"  # 2^-9: finer than the filters' precision (0.01, 2^-7, 6 bits)


def perturb(cli, src, out, *args):
    return ok(cli("perturb", src, "--eps", "1", "--range", "0:256", "--out", out, "--seed", SEED, *args))


def perturb_on_fine_grid(cli, src, out, *args):
    return perturb(cli, src, out, "--granularity", GRANULARITY, *args)


def assert_on_the_grid(values: np.ndarray, manifest: dict) -> None:
    """Exact discrete noise on float data: every stored value is a multiple of the grid
    step (rounding to 0.01 or to tenths breaks that; quantizing to a coarser power of
    two does not, hence exact_reference)."""
    steps = values.astype(np.float64) / manifest["granularity"]
    assert np.array_equal(steps, np.rint(steps))


def exact_reference(cli, tmp_path, values: np.ndarray, zarr_format: int | None, name: str, *args):
    """What the run stores for `values` given in an input without filters (the same seed,
    options and array name give the same noise): a lossy filter on the output would
    make the output differ from it. zarr_format None: HDF5."""
    if zarr_format is None:
        src, out = tmp_path / "plain.h5", tmp_path / "plain.tldp.h5"
        with h5py.File(src, "w") as f:
            f.create_dataset(name, data=values)
        perturb_on_fine_grid(cli, src, out, *args)
        with h5py.File(out, "r") as f:
            return f[name][()]
    src, out = tmp_path / "plain.zarr", tmp_path / "plain.tldp.zarr"
    if name == "/":
        zarr.create_array(src, shape=values.shape, dtype=values.dtype, zarr_format=zarr_format)[:] = values
    else:
        group = zarr.open_group(src, mode="w", zarr_format=zarr_format)
        group.create_array(name, shape=values.shape, dtype=values.dtype)[:] = values
    perturb_on_fine_grid(cli, src, out, *args)
    return zarr.open_array(out, path="" if name == "/" else name, mode="r")[:]


def filters_of(ds: h5py.Dataset) -> list[int]:
    plist = ds.id.get_create_plist()
    return [plist.get_filter(i)[0] for i in range(plist.get_nfilters())]


def evaluate_passes(cli, src, out):
    result = ok(cli("evaluate", src, out))
    assert "every check passed" in result.stderr


# ------------------------------------------------------------------ HDF5

def test_hdf5_float_scale_offset_is_dropped_and_compression_kept(cli, tmp_path):
    src = tmp_path / "s.h5"
    with h5py.File(src, "w") as f:
        f.create_dataset("x", data=DATA, chunks=(10, 8, 8), scaleoffset=2, compression="gzip",
                         compression_opts=4, shuffle=True)
        f.create_dataset("aux", data=DATA[:, 0, 0], chunks=(10,), scaleoffset=2)  # not perturbed
    out = tmp_path / "o.h5"
    result = perturb_on_fine_grid(cli, src, out, "--dataset", "x", "--keep", "aux")
    assert "/x: written without the source's scale-offset filter (lossy)" in result.stderr
    m = manifest_of(out)
    assert m["dropped_filters"] == {"/x": ["scale-offset"]}
    assert STORED_EXACTLY in m["postprocessing"]
    with h5py.File(out, "r") as f:
        x = f["x"]
        assert x.scaleoffset is None and x.chunks == (10, 8, 8)
        assert (x.compression, x.compression_opts, x.shuffle) == ("gzip", 4, True)
        assert_on_the_grid(x[()], m)
        noisy = x[()]
        assert f["aux"].scaleoffset == 2  # kept: copied unchanged, filter and all
    with h5py.File(src, "r") as f:
        decoded = f["x"][()]
    np.testing.assert_array_equal(noisy, exact_reference(cli, tmp_path, decoded, None, "x"))
    evaluate_passes(cli, src, out)


def test_hdf5_integer_scale_offset_is_dropped(cli, tmp_path):
    src = tmp_path / "i.h5"
    with h5py.File(src, "w") as f:
        f.create_dataset("x", data=DATA.astype(np.uint8), chunks=(10, 8, 8), scaleoffset=4)
    out = tmp_path / "o.h5"
    result = perturb(cli, src, out, "--allow-raw-release")
    assert "scale-offset" in result.stderr
    assert manifest_of(out)["dropped_filters"] == {"/x": ["scale-offset"]}
    with h5py.File(out, "r") as f:
        assert f["x"].scaleoffset is None and f["x"].dtype.kind == "i"


def test_hdf5_lossy_plugin_is_dropped(cli, tmp_path):
    """SZ (32017) as an optional filter this HDF5 lacks: HDF5 stores the chunks unfiltered,
    and the output leaves it off while keeping deflate."""
    src = tmp_path / "sz.h5"
    with h5py.File(src, "w") as f:
        dcpl = h5p.create(h5p.DATASET_CREATE)
        dcpl.set_chunk((10, 8, 8))
        dcpl.set_filter(32017, h5z.FLAG_OPTIONAL, (0,))
        dcpl.set_deflate(4)
        dsid = h5d.create(f.id, b"x", h5t.py_create(np.dtype(np.float32)), h5s.create_simple(DATA.shape),
                          dcpl=dcpl)
        h5py.Dataset(dsid)[...] = DATA
    with h5py.File(src, "r") as f:
        assert filters_of(f["x"]) == [32017, h5z.FILTER_DEFLATE]
    out = tmp_path / "o.h5"
    result = perturb_on_fine_grid(cli, src, out)
    assert "SZ filter (lossy)" in result.stderr
    m = manifest_of(out)
    assert m["dropped_filters"] == {"/x": ["SZ"]}
    with h5py.File(out, "r") as f:
        assert filters_of(f["x"]) == [h5z.FILTER_DEFLATE]
        noisy = f["x"][()]
    np.testing.assert_array_equal(noisy, exact_reference(cli, tmp_path, DATA, None, "x"))
    evaluate_passes(cli, src, out)


def test_hdf5_lossless_filters_are_kept_and_nothing_is_recorded(cli, tmp_path):
    src = tmp_path / "l.h5"
    with h5py.File(src, "w") as f:
        f.create_dataset("x", data=DATA, chunks=(10, 8, 8), compression="lzf", shuffle=True, fletcher32=True)
    out = tmp_path / "o.h5"
    result = perturb(cli, src, out)
    assert "lossy" not in result.stderr
    m = manifest_of(out)
    assert "dropped_filters" not in m and STORED_EXACTLY not in m["postprocessing"]
    with h5py.File(out, "r") as f:
        assert filters_of(f["x"]) == [h5z.FILTER_SHUFFLE, h5z.FILTER_LZF, h5z.FILTER_FLETCHER32]


# ------------------------------------------------------------------ Zarr

def test_zarr2_quantize_bitround_and_fixedscaleoffset_are_dropped(cli, tmp_path):
    src = tmp_path / "q.zarr"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        array = zarr.create_array(src, shape=DATA.shape, dtype="float32", chunks=(10, 8, 8), zarr_format=2,
                                  filters=[numcodecs.Quantize(digits=2, dtype="f4"),
                                           numcodecs.BitRound(keepbits=6),
                                           numcodecs.Delta(dtype="f4")],
                                  compressors=numcodecs.Zstd(level=3))
    array[:] = DATA
    out = tmp_path / "o.zarr"
    result = perturb_on_fine_grid(cli, src, out)
    assert "array /: written without the input's lossy filters quantize, bitround" in result.stderr
    m = manifest_of(out)
    assert m["dropped_filters"] == {"/": ["quantize", "bitround"]}
    meta = json.loads((out / ".zarray").read_text())
    assert meta["filters"] == [{"id": "delta", "dtype": "<f4", "astype": "<f4"}]  # lossless: kept
    assert meta["compressor"] == {"id": "zstd", "level": 1}  # kept, at the level noise is worth
    assert m["codec_levels"] == {"/": [{"codec": "zstd", "input_level": 3, "output_level": 1}]}
    noisy = zarr.open_array(out, mode="r")[:]
    assert noisy.dtype == np.float32
    decoded = zarr.open_array(src, mode="r")[:]
    np.testing.assert_array_equal(noisy, exact_reference(cli, tmp_path, decoded, 2, "/"))
    evaluate_passes(cli, src, out)


def test_zarr2_fixedscaleoffset_to_another_type_no_longer_stops_the_run(cli, tmp_path):
    src = tmp_path / "f.zarr"
    array = zarr.create_array(src, shape=DATA.shape, dtype="float32", chunks=(10, 8, 8), zarr_format=2,
                              filters=[numcodecs.FixedScaleOffset(offset=0, scale=10, dtype="f4", astype="u2"),
                                       numcodecs.AsType(encode_dtype="u2", decode_dtype="u2")],
                              compressors=None)
    array[:] = DATA
    out = tmp_path / "o.zarr"
    perturb_on_fine_grid(cli, src, out)
    m = manifest_of(out)
    assert m["dropped_filters"] == {"/": ["fixedscaleoffset", "astype"]}
    assert json.loads((out / ".zarray").read_text())["filters"] is None
    assert_on_the_grid(zarr.open_array(out, mode="r")[:], m)


@pytest.mark.parametrize("shards", [None, (20, 8, 8)])
def test_zarr3_quantize_is_dropped(cli, tmp_path, shards):
    src = tmp_path / "q3.zarr"
    group = zarr.open_group(src, mode="w", zarr_format=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        array = group.create_array("images", shape=DATA.shape, dtype="float32", chunks=(10, 8, 8),
                                   shards=shards, filters=[zarr3.Quantize(digits=2, dtype="f4"),
                                                           zarr3.BitRound(keepbits=6)],
                                   compressors=zarr.codecs.ZstdCodec(level=3))
        array[:] = DATA
        group.create_array("labels", shape=(40,), dtype="float32", chunks=(40,),
                           filters=[zarr3.Quantize(digits=1, dtype="f4")])[:] = np.arange(40)
    out = tmp_path / "o.zarr"
    result = perturb_on_fine_grid(cli, src, out, "--dataset", "images", "--keep", "labels")
    assert "array images: written without the input's lossy filters" in result.stderr
    m = manifest_of(out)
    assert m["dropped_filters"] == {"images": ["numcodecs.quantize", "numcodecs.bitround"]}
    codecs = json.loads((out / "images" / "zarr.json").read_text())["codecs"]
    if shards:
        assert [c["name"] for c in codecs] == ["sharding_indexed"]
        codecs = codecs[0]["configuration"]["codecs"]
    assert [c["name"] for c in codecs] == ["bytes", "zstd"]
    # The array not perturbed (kept) keeps its own filter.
    labels = json.loads((out / "labels" / "zarr.json").read_text())["codecs"]
    assert labels[0]["name"] == "numcodecs.quantize"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        noisy = zarr.open_array(out, path="images", mode="r")[:]
        decoded = zarr.open_array(src, path="images", mode="r")[:]
    np.testing.assert_array_equal(noisy, exact_reference(cli, tmp_path, decoded, 3, "images",
                                                         "--dataset", "images"))
    evaluate_passes(cli, src, out)


def test_zarr_lossless_codecs_are_kept_and_nothing_is_recorded(cli, tmp_path):
    src = tmp_path / "l.zarr"
    zarr.create_array(src, shape=DATA.shape, dtype="float32", chunks=(10, 8, 8), zarr_format=3,
                      compressors=zarr.codecs.BloscCodec(cname="lz4"))[:] = DATA
    out = tmp_path / "o.zarr"
    perturb(cli, src, out)
    assert "dropped_filters" not in manifest_of(out)
    codecs = json.loads((out / "zarr.json").read_text())["codecs"]
    assert [c["name"] for c in codecs] == ["bytes", "blosc"]
    assert siblings(tmp_path) == {"l.zarr", "o.zarr", "o.zarr.manifest.json"}
