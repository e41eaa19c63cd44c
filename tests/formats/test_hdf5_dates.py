"""HDF5 objects carry dates: with time tracking on (HDF5's own default, which PyTables,
MATLAB's -v7.3 files and C programs keep), each dataset's object header holds when it was
created and modified. The output never carries the input's dates (docs/guarantee.md, "What
the figures do not cover"): the datasets copied raw (--keep, coordinates, a model file's
unperturbed tensors) are written anew, without the input's dates (the output stores none).

Every test works on real HDF5 files written with h5py (track_times=True, as those writers do).
"""

import time
from pathlib import Path

import h5py
import numpy as np
import pytest

from tests.builders import validate_manifest  # noqa: F401  (the autouse schema check uses it)

DATA = np.random.default_rng(7).random((12, 5)).astype(np.float32)


def _dates(obj) -> tuple[int, int, int, int]:
    info = h5py.h5o.get_info(obj.id)
    return info.ctime, info.mtime, info.atime, info.btime


def _dated_input(path: Path, **kept_layout) -> Path:
    """A file whose every dataset carries its creation date: the data, a dataset to keep
    (with a free-text attribute the run leaves out), a coordinate named by the data's
    `coordinates` attribute, and a label dataset."""
    with h5py.File(path, "w") as f:
        f.create_dataset("lat", data=np.linspace(-2, 2, 5), track_times=True)
        data = f.create_dataset("data", data=DATA, track_times=True)
        data.attrs["coordinates"] = "lat"
        kept = f.create_dataset("calibration", data=np.arange(30.0).reshape(10, 3), track_times=True,
                                **kept_layout)
        kept.attrs["units"] = "m"
        kept.attrs["history"] = "measured on the ward"
        f.create_dataset("table", data=np.arange(8, dtype=np.int32), track_times=True)
    return path


def _after_a_second_boundary() -> int:
    """The current second, once the clock has passed into a new one: an object dated before
    this call has a smaller date."""
    start = int(time.time())
    while int(time.time()) == start:
        time.sleep(0.02)
    return int(time.time())


@pytest.mark.parametrize("kept_layout", [{}, {"chunks": (4, 3), "compression": "gzip", "shuffle": True}],
                         ids=["contiguous", "chunked"])
def test_copied_datasets_carry_the_runs_dates_not_the_inputs(cli, tmp_path, kept_layout):
    src = _dated_input(tmp_path / "in.h5", **kept_layout)
    with h5py.File(src) as f:
        input_dates = {name: _dates(f[name]) for name in ("lat", "calibration", "table")}
    assert all(dates[0] > 0 for dates in input_dates.values())  # the input is dated
    run_started = _after_a_second_boundary()

    out = tmp_path / "out.h5"
    result = cli("perturb", src, "--eps", "1", "--range", "0:1", "--dataset", "data",
                 "--keep", "calibration", "--keep", "table", "--out", out)
    assert result.exit_code == 0, result.output

    with h5py.File(out) as f:
        assert {"data", "lat", "calibration", "table"} <= set(f)
        for name in ("data", "lat", "calibration", "table"):
            ctime, mtime, atime, btime = _dates(f[name])
            for date in (ctime, mtime, atime, btime):
                assert date == 0 or date >= run_started, (name, _dates(f[name]), input_dates.get(name))
        # Written anew, not changed: the values, layout, filters and attributes are the input's.
        with h5py.File(src) as g:
            for name in ("lat", "calibration", "table"):
                np.testing.assert_array_equal(f[name][()], g[name][()])
                assert f[name].dtype == g[name].dtype
                assert f[name].chunks == g[name].chunks
                assert f[name].compression == g[name].compression
                assert f[name].shuffle == g[name].shuffle
            assert dict(f["calibration"].attrs) == {"units": "m"}  # history left out
            assert f["data"].attrs["coordinates"] in ("lat", b"lat")


def test_every_kind_of_dated_dataset_is_copied_whole(cli, tmp_path):
    """Written anew, a dated dataset keeps its values, type, shape, fill value and attributes,
    whatever it holds: strings, a compound type, a named type, object references, a scalar,
    an empty dataset, a resizable chunked one with an unwritten chunk."""
    src = tmp_path / "in.h5"
    with h5py.File(src, "w") as f:
        f.create_dataset("data", data=DATA, track_times=True)
        f.create_dataset("names", data=[f"item {i}" for i in range(12)], dtype=h5py.string_dtype(),
                         track_times=True)
        pair = np.dtype([("id", "<i4"), ("weight", "<f8")])
        f.create_dataset("pairs", data=np.array([(i, i / 4) for i in range(12)], dtype=pair),
                         track_times=True)
        f["kind"] = np.dtype("<f4")  # a named type
        f.create_dataset("typed", data=np.arange(6, dtype="<f4"), dtype=f["kind"], track_times=True)
        f.create_dataset("scalar", data=np.float64(2.5), track_times=True)
        f.create_dataset("empty", data=np.zeros((0, 3)), track_times=True)
        grow = f.create_dataset("grow", shape=(10, 4), maxshape=(None, 4), chunks=(4, 4), dtype="<i2",
                                fillvalue=-7, compression="gzip", track_times=True)
        grow[:4] = np.arange(16, dtype="<i2").reshape(4, 4)  # chunks 1 and 2 never written
        refs = f.create_dataset("refs", shape=(2,), dtype=h5py.ref_dtype, track_times=True)
        refs[0], refs[1] = f["scalar"].ref, f["pairs"].ref
        f["names"].attrs["units"] = "1"
    kept = ["names", "pairs", "typed", "scalar", "empty", "grow", "refs"]
    out = tmp_path / "out.h5"
    keep = [arg for name in kept for arg in ("--keep", name)]
    result = cli("perturb", src, "--eps", "1", "--range", "0:1", "--dataset", "data", "--out", out, *keep)
    assert result.exit_code == 0, result.output
    with h5py.File(src) as g, h5py.File(out) as f:
        for name in kept:
            assert f[name].dtype == g[name].dtype and f[name].shape == g[name].shape, name
            assert f[name].fillvalue == g[name].fillvalue, name
            assert f[name].maxshape == g[name].maxshape and f[name].chunks == g[name].chunks, name
            assert dict(f[name].attrs) == dict(g[name].attrs), name
        for name in ("names", "pairs", "typed", "scalar", "empty", "grow"):
            np.testing.assert_array_equal(f[name][()], g[name][()])
        assert f["grow"].compression == "gzip" and f["grow"][9, 0] == -7
        assert f[f["refs"][0]].name == "/scalar" and f[f["refs"][1]].name == "/pairs"  # into the output
        assert f[f["refs"][1]].file == f
