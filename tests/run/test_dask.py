"""--scheduler dask: the same output as serial and threaded runs on every format.

Most tests share one in-process Dask cluster (threads, started once); one starts a real
local cluster of worker processes through the CLI (about 4 s).
"""

import sys
from pathlib import Path

import numpy as np
import pytest
import zarr

from tests.builders import DATA, SEED, make_hdf5, make_images, make_npy, make_zarr
from tldp_cli.errors import InputError
from tldp_cli.run.pipeline import PerturbOptions, perturb

pytestmark = pytest.mark.dask

distributed = pytest.importorskip("distributed")


@pytest.fixture(scope="module")
def cluster():
    with distributed.LocalCluster(processes=False, n_workers=1, threads_per_worker=2,
                                  dashboard_address="127.0.0.1:0") as local:
        yield local


def make_zarr_v2(tmp_path):
    path = tmp_path / "d2.zarr"
    zarr.create_array(store=str(path), shape=DATA.shape, dtype=DATA.dtype, chunks=(7, 8, 8),
                      zarr_format=2)[:] = DATA
    return path, lambda out: zarr.open_array(str(out), mode="r")[...]


def make_images_tiff(tmp_path):
    path, _ = make_images(tmp_path)
    return path, lambda out: np.stack([np.asarray(__import__("tifffile").imread(out / f"{i:02d}.tiff"))
                                       for i in range(30)])


RUNS = {
    "serial": {"workers": 1},
    "threads2": {"workers": 2},
    "threads3": {"workers": 3},
    "dask": {"scheduler": "dask"},
}


@pytest.mark.parametrize("make, extra", [
    (make_npy, {}), (make_hdf5, {}), (make_zarr, {}), (make_zarr_v2, {}), (make_images, {}),
    (make_images_tiff, {"image_format": "tiff"}),
], ids=["npy", "hdf5", "zarr-sharded", "zarr-v2", "png-folder", "tiff-folder"])
def test_dask_equals_serial_and_threads(tmp_path, cluster, make, extra):
    src, read = make(tmp_path)
    results = {}
    for name, how in RUNS.items():
        if how.get("scheduler") == "dask":
            how = {**how, "dask_address": cluster.scheduler_address}
        out = tmp_path / f"out-{name}{src.suffix}"
        perturb(PerturbOptions(input=src, eps=1.0, out=out, seed=SEED, block_elements=640, **how, **extra))
        results[name] = read(out)
    for name in RUNS:
        np.testing.assert_array_equal(results[name], results["serial"], err_msg=name)
    assert not np.array_equal(results["serial"], DATA[:len(results["serial"])])


def test_weights_and_several_arrays_on_dask(tmp_path, cluster):
    """Per-record masks are read inside the tasks; both arrays of a group are perturbed."""
    src = tmp_path / "g.zarr"
    group = zarr.open_group(str(src), mode="w", zarr_format=3)
    group.create_array("a", shape=DATA.shape, dtype=DATA.dtype, chunks=(10, 8, 8))[:] = DATA
    group.create_array("b", shape=DATA.shape, dtype=DATA.dtype, chunks=(25, 8, 8))[:] = DATA[::-1]
    mask = tmp_path / "mask.npy"
    np.save(mask, np.random.default_rng(1).random((200, 8, 8)))
    outputs = []
    for name, how in (("threads", {"workers": 2}),
                      ("dask", {"scheduler": "dask", "dask_address": cluster.scheduler_address})):
        out = tmp_path / f"{name}.zarr"
        # eps 20 on 64 elements: p is large enough that the weights decide real keep/noise choices
        perturb(PerturbOptions(input=src, eps=20.0, out=out, seed=SEED, weights=mask, block_elements=640,
                               **how))
        outputs.append({k: zarr.open_array(str(out), path=k, mode="r")[...] for k in ("a", "b")})
    for key in ("a", "b"):
        np.testing.assert_array_equal(outputs[0][key], outputs[1][key])


def test_worker_errors_reach_the_caller_and_nothing_is_left(tmp_path, cluster):
    src = tmp_path / "f.npy"
    values = np.zeros((100, 4), np.float32)
    values[77, 2] = np.nan
    np.save(src, values)
    out = tmp_path / "out.npy"
    # Records of 4 floats in 0:1 keep raw values with probability above dp_delta, which needs
    # consent (tests/privacy/test_raw_release.py); this test is about the worker's error.
    with pytest.raises(InputError, match=r"NaN or Inf at record 77, element 2"):
        perturb(PerturbOptions(input=src, eps=1.0, value_range=(0, 1), out=out, block_elements=40,
                               scheduler="dask", dask_address=cluster.scheduler_address,
                               allow_raw_release=True))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.npy"]


def test_task_keys_do_not_derive_from_the_arguments(tmp_path, cluster):
    """Dask names a task by a hash of its arguments unless told otherwise; ours hold the
    stream key (from the seed), so the names must be random."""
    src, _ = make_npy(tmp_path)
    perturb(PerturbOptions(input=src, eps=1.0, out=tmp_path / "o.npy", seed=SEED, block_elements=640,
                           scheduler="dask", dask_address=cluster.scheduler_address))
    prefixes = set(cluster.scheduler.task_prefixes)
    assert "tldp-block" in prefixes
    assert not [p for p in prefixes if "blocktask" in p.lower()]


def test_local_process_cluster_through_the_cli(cli, tmp_path):
    src, read = make_zarr(tmp_path)
    for name, more in (("threads", ()), ("dask", ("--scheduler", "dask", "--workers", "2"))):
        result = cli("perturb", src, "--eps", "1", "--seed", SEED, "--out", tmp_path / f"{name}.zarr",
                     "--block-elements", "640", *more)
        assert result.exit_code == 0, result.stderr
    np.testing.assert_array_equal(read(tmp_path / "threads.zarr"), read(tmp_path / "dask.zarr"))


def test_without_dask_installed_is_exit_1_naming_the_extra(cli, tmp_path, monkeypatch):
    """The command line is right, the installation lacks Dask: exit 1, as every missing extra."""
    src, _ = make_npy(tmp_path)
    monkeypatch.setitem(sys.modules, "distributed", None)  # makes `import distributed` fail
    result = cli("perturb", src, "--eps", "1", "--scheduler", "dask")
    assert result.exit_code == 1
    assert result.stderr.strip() == ("tldp: error: --scheduler dask needs Dask, an optional extra: "
                                     "pip install 'tldp-tensors[dask]'")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.npy"]


@pytest.mark.parametrize("args, words", [
    (("--dask-address", "127.0.0.1:8786"), "--dask-address applies to --scheduler dask"),
    (("--scheduler", "dask", "--dask-address", "no-port"), "--dask-address must be HOST:PORT"),
])
def test_address_usage_errors(cli, tmp_path, args, words):
    src, _ = make_npy(tmp_path)
    result = cli("perturb", src, "--eps", "1", *args)
    assert result.exit_code == 2 and words in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_paths_the_workers_cannot_see_are_named(tmp_path, cluster):
    from tldp_cli.run import dask_runner

    with distributed.Client(cluster.scheduler_address, set_as_default=False) as client:
        assert dask_runner.check_visible(client, [str(tmp_path)]) is None
        missing, worker = dask_runner.check_visible(client, [str(tmp_path), str(tmp_path / "gone")])
    assert missing == str(tmp_path / "gone") and worker in cluster.scheduler.workers


def test_the_task_shows_neither_seed_nor_key():
    from tldp_cli.run.pipeline import BlockTask
    from tldp_cli.sampling.rng import Streams

    streams = Streams("secure", SEED)
    task = BlockTask(calibrations={}, streams=streams, masks={}, lo=0.0, hi=1.0, clip_input=False,
                     dtype=np.dtype("float32"), source=Path("x.npy"), write=None)
    shown = repr(task) + str(task)
    assert SEED not in shown and streams._root.hex() not in shown and repr(streams._root) not in shown
