"""The engine's central promise, as properties: a seeded run's output depends on the data,
the options and the seed alone, never on how the records are cut into blocks, on how
many threads run them (--workers) or on the scheduler (threads or Dask).

Hypothesis draws the data's shape, the seed, the cuts, the block size and the number of
workers, for TLDP-L and TLDP-G (exact discrete samplers and the float ones) and privunit:
- in memory: the engine run block by block, at any cuts (inside a stream unit too),
  equals perturb_array on the whole array, raw values kept under per-record weights
  included; a record larger than a stream unit (a model's tensor), cut into parts
  anywhere, equals the record perturbed whole;
- through files: a Zarr store chunked anywhere and a .npy of one-unit records, cut into
  blocks of any size and run on 1 to 3 threads, equal the one-block serial run, and the
  .npy output equals perturb_array on the same records;
- on Dask (marked dask): the same output as on threads.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pytest
import zarr
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tldp_cli.formats import ArrayJob
from tldp_cli.run.arrays import ARRAY_NAME, perturb_array
from tldp_cli.run.calibration import calibrate_run
from tldp_cli.run.pipeline import PerturbOptions, checked_options, perturb
from tldp_cli.sampling import engine
from tldp_cli.sampling.rng import STREAM_UNIT_ELEMENTS, Streams

# Few examples and no deadline: each runs the whole plan and accounting (and, through
# files, a run or two); derandomized, so a run of the suite is repeatable.
PROPERTY = settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
FILES = settings(PROPERTY, max_examples=8)

MECHANISMS = {  # perturb_array's options for each: eps comes from the test
    "TLDP-L": {"noise": "laplace"},
    "TLDP-G": {"noise": "gaussian"},
    "TLDP-L float": {"noise": "laplace", "sampler": "float"},
    "TLDP-G float": {"noise": "gaussian", "sampler": "float"},
    "privunit": {"mechanism": "privunit"},
}
FILE_MECHANISMS = ("TLDP-L", "TLDP-G", "privunit")  # the default exact samplers, and privunit

# Any 128-bit key; drawn keys can follow a pattern (all zeros), which only --allow-weak-seed takes.
seeds = st.binary(min_size=16, max_size=16).map(bytes.hex)


def cuts(n: int) -> st.SearchStrategy[list[tuple[int, int]]]:
    """Record ranges [a, b) that cover 0..n in order, cut anywhere."""
    return st.sets(st.integers(1, max(1, n - 1)), max_size=6).map(
        lambda inner: list(zip([0, *sorted(c for c in inner if c < n)], [*sorted(c for c in inner if c < n), n])))


@st.composite
def arrays(draw, shapes=((5,), (3, 4), (4, 4, 3)), dtypes=("uint8", "float32")):
    """1 to 40 records: 8-bit integers (range from the dtype) or floats in (-1, 1)."""
    n = draw(st.integers(1, 40))
    record = draw(st.sampled_from(shapes))
    values = np.random.default_rng(draw(st.integers(0, 2**32)))
    if draw(st.sampled_from(dtypes)) == "uint8":
        return values.integers(0, 256, (n, *record), dtype=np.uint8)
    return values.uniform(-1, 1, (n, *record)).astype(np.float32)


def array_options(x: np.ndarray, mechanism: str, eps: float) -> dict:
    return {"eps": eps, "value_range": None if x.dtype == np.uint8 else (-1.0, 1.0), "allow_raw_release": True,
            **({"budget": "record"} if mechanism == "privunit" else {}), **MECHANISMS[mechanism]}


def _blockwise(x: np.ndarray, options: dict, seed: str, rng: str, weights: np.ndarray | None,
               cut: list[tuple[int, int]]) -> np.ndarray:
    """The plan perturb_array makes, then the engine on each block [a, b) at its position."""
    run_options = checked_options(PerturbOptions(
        input=Path(ARRAY_NAME), eps=options["eps"], value_range=options["value_range"], seed=seed,
        allow_weak_seed=True, rng=rng, allow_raw_release=True, noise=options.get("noise"),
        mechanism=options.get("mechanism", "tldp"), budget=options.get("budget"),
        sampler=options.get("sampler", "exact")))
    job = ArrayJob(ARRAY_NAME, x.shape, x.dtype, lambda a, b: x[a:b], {"format": "array"})
    calibrated = calibrate_run(run_options, [job])
    streams = Streams(rng, seed, allow_weak_seed=True)
    return np.concatenate([
        engine.perturb_records(x[a:b], a, ARRAY_NAME, calibrated.calib_of[ARRAY_NAME], streams,
                               None if weights is None else weights[a:b].reshape(b - a, -1),
                               calibrated.out_dtype, calibrated.grid, len(x),
                               calibrated.bases.get(ARRAY_NAME))
        for a, b in cut])


@PROPERTY
@given(x=arrays(), mechanism=st.sampled_from(list(MECHANISMS)), eps=st.sampled_from([0.1, 0.5, 2.0, 8.0]),
       seed=seeds, rng=st.sampled_from(["secure", "fast"]), data=st.data())
def test_perturb_array_equals_the_engine_block_by_block_at_any_cuts(x, mechanism, eps, seed, rng, data):
    options = array_options(x, mechanism, eps)
    whole = perturb_array(x, seed=seed, allow_weak_seed=True, rng=rng, **options)
    blocks = _blockwise(x, options, seed, rng, None, data.draw(cuts(len(x)), label="cuts"))
    np.testing.assert_array_equal(blocks, whole.array)


@PROPERTY
@given(x=arrays(shapes=((6,), (4, 5)), dtypes=("float32",)),
       noise=st.sampled_from(["laplace", "gaussian"]), seed=seeds, data=st.data())
def test_kept_values_under_per_record_weights_do_not_depend_on_cuts(x, noise, seed, data):
    """The float samplers at eps 0.05 on (-1, 1) keep a few percent of the values raw (p),
    each with probability 1 - w of its record's weight: the kept ones and the weights they
    are thinned by follow each record wherever the cuts fall."""
    options = {"eps": 0.05, "value_range": (-1.0, 1.0), "noise": noise, "sampler": "float",
               "allow_raw_release": True}
    weights = np.random.default_rng(len(x)).random(x.shape)
    whole = perturb_array(x, seed=seed, allow_weak_seed=True, weights=weights, **options)
    blocks = _blockwise(x, options, seed, "secure", weights, data.draw(cuts(len(x)), label="cuts"))
    np.testing.assert_array_equal(blocks, whole.array)


def part_cuts(n: int) -> st.SearchStrategy[list[tuple[int, int]]]:
    """Element ranges [a, b) that cover 0..n in order, cut anywhere (segment boundaries too)."""
    edges = st.integers(1, n - 1) | st.sampled_from([k * STREAM_UNIT_ELEMENTS for k in range(1, n // STREAM_UNIT_ELEMENTS + 1)
                                                     if k * STREAM_UNIT_ELEMENTS < n])
    return st.sets(edges, max_size=5).map(lambda inner: list(zip([0, *sorted(inner)], [*sorted(inner), n])))


@settings(PROPERTY, max_examples=12)
@given(extra=st.integers(1, 2 * STREAM_UNIT_ELEMENTS), mechanism=st.sampled_from(list(MECHANISMS)[:4]),
       weighted=st.booleans(), seed=seeds, data=st.data())
def test_a_record_larger_than_a_unit_cut_into_parts_equals_it_whole(extra, mechanism, weighted, seed, data):
    """A tensor-sized record (more than rng.STREAM_UNIT_ELEMENTS elements) draws in segments,
    so a model file's tensor can be perturbed part by part in flat memory: the parts, at any
    cuts, give the record perturbed whole. A record this large keeps no raw value (log p is
    about -I), so the retain decisions of parts are checked with a forced p in
    tests/sampling/test_engine.py (test_a_record_cut_anywhere_keeps_the_values_it_keeps_whole)."""
    elements = STREAM_UNIT_ELEMENTS + extra
    x = np.random.default_rng(extra).uniform(-1, 1, (1, elements)).astype(np.float32)
    options = {**array_options(x, mechanism, 0.05 if weighted else 2.0)}
    weights = np.random.default_rng(extra + 1).random(x.shape) if weighted else None
    whole = _blockwise(x, options, seed, "secure", weights, [(0, 1)])
    assert not np.array_equal(whole, x)
    run_options = checked_options(PerturbOptions(
        input=Path(ARRAY_NAME), eps=options["eps"], value_range=(-1.0, 1.0), allow_raw_release=True,
        noise=options["noise"], sampler=options.get("sampler", "exact"), seed=seed, allow_weak_seed=True))
    calibrated = calibrate_run(run_options, [ArrayJob(ARRAY_NAME, x.shape, x.dtype, lambda a, b: x[a:b], {})])
    streams = Streams("secure", seed, allow_weak_seed=True)
    parts = [engine.perturb_records(x[:, a:b], 0, ARRAY_NAME, calibrated.calib_of[ARRAY_NAME], streams,
                                    None if weights is None else weights[0, a:b], calibrated.out_dtype,
                                    calibrated.grid, 1, first_element=a)
             for a, b in data.draw(part_cuts(elements), label="parts")]
    np.testing.assert_array_equal(np.concatenate(parts, axis=1), whole)


@pytest.fixture(scope="module")
def workdir():
    with tempfile.TemporaryDirectory() as folder:
        yield Path(folder)


def _file_options(mechanism: str, eps: float = 2.0) -> dict:
    return {"eps": eps, "allow_weak_seed": True, **({"mechanism": "privunit"} if mechanism == "privunit" else
                               {"noise": MECHANISMS[mechanism]["noise"]}), "allow_raw_release": True}


def _zarr_run(folder: Path, src: Path, name: str, options: dict) -> np.ndarray:
    out = folder / f"{name}.zarr"
    perturb(PerturbOptions(input=src, out=out, **options))
    return zarr.open_array(str(out), mode="r")[...]


@st.composite
def chunked_stores(draw):
    n = draw(st.integers(2, 40))
    record = draw(st.sampled_from([(4, 4), (3, 5)]))
    x = np.random.default_rng(draw(st.integers(0, 2**32))).integers(0, 256, (n, *record), dtype=np.uint8)
    return x, draw(st.integers(1, n))  # records per chunk: blocks are whole chunks, cut inside units


def _store(folder: Path, x: np.ndarray, chunk: int) -> Path:
    src = folder / "in.zarr"
    zarr.create_array(str(src), shape=x.shape, dtype=x.dtype, chunks=(chunk, *x.shape[1:]), zarr_format=3)[:] = x
    return src


@FILES
@given(store=chunked_stores(), mechanism=st.sampled_from(FILE_MECHANISMS), seed=seeds, data=st.data())
def test_a_chunked_store_s_output_does_not_depend_on_blocks_or_workers(workdir, store, mechanism, seed, data):
    x, chunk = store
    folder = Path(tempfile.mkdtemp(dir=workdir))
    src = _store(folder, x, chunk)
    options = {**_file_options(mechanism), "seed": seed}
    reference = _zarr_run(folder, src, "one-block", options)  # one block on one thread
    block = data.draw(st.integers(1, 3 * x[0].size * chunk), label="block_elements")
    workers = data.draw(st.integers(1, 3), label="workers")
    cut = _zarr_run(folder, src, "cut", {**options, "block_elements": block, "workers": workers})
    np.testing.assert_array_equal(cut, reference)
    assert not np.array_equal(reference, x)


UNIT_RECORD = (64, STREAM_UNIT_ELEMENTS // 64)  # one record per stream unit: a .npy's blocks cut anywhere


@FILES
@given(n=st.integers(2, 5), mechanism=st.sampled_from(FILE_MECHANISMS), seed=seeds, data=st.data())
def test_a_npy_output_is_perturb_array_s_at_any_blocks_and_workers(workdir, n, mechanism, seed, data):
    x = np.random.default_rng(n).integers(0, 256, (n, *UNIT_RECORD), dtype=np.uint8)
    folder = Path(tempfile.mkdtemp(dir=workdir))
    np.save(folder / "in.npy", x)
    block = data.draw(st.integers(1, 3 * x[0].size), label="block_elements")
    workers = data.draw(st.integers(1, 3), label="workers")
    out = folder / "out.npy"
    perturb(PerturbOptions(input=folder / "in.npy", out=out, seed=seed, block_elements=block,
                           workers=workers, **_file_options(mechanism, eps=50.0)))
    expected = perturb_array(x, seed=seed, allow_weak_seed=True, eps=50.0, allow_raw_release=True,
                             **({"mechanism": "privunit"} if mechanism == "privunit" else MECHANISMS[mechanism]))
    np.testing.assert_array_equal(np.load(out), expected.array)


@pytest.fixture(scope="module")
def cluster():
    distributed = pytest.importorskip("distributed")
    with distributed.LocalCluster(processes=False, n_workers=1, threads_per_worker=2,
                                  dashboard_address="127.0.0.1:0") as local:
        yield local


@pytest.mark.dask
@settings(PROPERTY, max_examples=4)
@given(store=chunked_stores(), mechanism=st.sampled_from(FILE_MECHANISMS), seed=seeds, data=st.data())
def test_dask_writes_what_threads_write(workdir, cluster, store, mechanism, seed, data):
    x, chunk = store
    folder = Path(tempfile.mkdtemp(dir=workdir))
    src = _store(folder, x, chunk)
    options = {**_file_options(mechanism), "seed": seed,
               "block_elements": data.draw(st.integers(1, 3 * x[0].size * chunk), label="block_elements")}
    threads = _zarr_run(folder, src, "threads", {**options, "workers": 2})
    dask = _zarr_run(folder, src, "dask", {**options, "scheduler": "dask",
                                            "dask_address": cluster.scheduler_address})
    np.testing.assert_array_equal(dask, threads)


TENSOR_SEED = "7c1822e9253f14f03f5423c622a036fa"
LARGE_RECORD = 2 * STREAM_UNIT_ELEMENTS + 12345  # two segments and a short third (a model's tensor)
LARGE_RUNS = [{"block_elements": 1 << 24}, {"block_elements": 100, "workers": 2},
              {"block_elements": STREAM_UNIT_ELEMENTS, "workers": 2}, {"block_elements": 3 * STREAM_UNIT_ELEMENTS}]


def _large_record_input(folder: Path, fmt: str) -> Path:
    """A .npy of two records larger than a stream unit, or a model file whose largest tensor is
    one (written by numpy or safetensors), beside a small tensor that draws as a unit."""
    x = np.random.default_rng(6).uniform(-0.1, 0.1, (2, LARGE_RECORD)).astype(np.float32)
    if fmt == "npy":
        np.save(folder / "in.npy", x)
        return folder / "in.npy"
    tensors = {"embed.weight": x[0], "head.weight": x[1], "norm.weight": x[0, :64].copy()}
    if fmt == "safetensors":
        from tests.builders import write_safetensors

        return write_safetensors(folder / "in.safetensors", tensors)
    np.savez(folder / "in.npz", **tensors)
    return folder / "in.npz"


def _large_record_runs(folder: Path, src: Path, runs: list[dict]) -> list[bytes]:
    outputs = []
    for i, run in enumerate(runs):
        out = folder / f"out{i}{src.suffix}"
        perturb(PerturbOptions(input=src, out=out, eps=1.0, clip=0.1, seed=TENSOR_SEED, **run))
        outputs.append(out.read_bytes())
    return outputs


def test_a_npy_of_records_larger_than_a_unit_is_the_same_bytes_at_any_blocks_and_workers(workdir):
    """Records larger than a stream unit in a .npy (read whole, drawn in segments): the same
    bytes at any block size and on 1 or 2 threads, and perturb_array's values."""
    folder = Path(tempfile.mkdtemp(dir=workdir))
    src = _large_record_input(folder, "npy")
    outputs = _large_record_runs(folder, src, LARGE_RUNS)
    assert outputs[1:] == outputs[:-1]
    expected = perturb_array(np.load(src), seed=TENSOR_SEED, eps=1.0, clip=0.1)
    np.testing.assert_array_equal(np.load(folder / "out0.npy"), expected.array)


@pytest.mark.dask
@pytest.mark.parametrize("fmt", ["npy", "safetensors", "npz"])
def test_records_larger_than_a_unit_are_the_same_bytes_on_dask(workdir, cluster, fmt):
    """A model file's tensors larger than a block (read, perturbed and written in parts on
    threads) and a .npy's large records: Dask's workers write the bytes threads write."""
    folder = Path(tempfile.mkdtemp(dir=workdir))
    src = _large_record_input(folder, fmt)
    dask = {"scheduler": "dask", "dask_address": cluster.scheduler_address}
    outputs = _large_record_runs(folder, src, [LARGE_RUNS[0], LARGE_RUNS[2], {**dask, "block_elements": 1 << 24},
                                               {**dask, "block_elements": STREAM_UNIT_ELEMENTS}])
    assert outputs[1:] == outputs[:-1]
