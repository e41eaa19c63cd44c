"""Interrupted runs and --resume: nothing at the destination, and a resumed Zarr run
equals an uninterrupted one with the same seed."""

import dataclasses
import fcntl
import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import zarr

from tests.builders import DATA, SEED, assert_one_line_error, make_hdf5, make_images, make_npy, siblings
from tldp_cli import __version__
from tldp_cli.errors import Interrupted, OutputError, UsageError
from tldp_cli.run.pipeline import (OPTION_FLAGS, RESUME_COMPARED, RESUME_COMPARED_AS, RESUME_NOT_COMPARED,
                                   PerturbOptions, perturb)
from tldp_cli.run.resume import partial_path
from tldp_cli.sampling import rng

# zarr warns that consolidated metadata is not part of the format 3 spec.
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

BLOCK = 640  # 10 records of 8 x 8: shard-aligned blocks of 20 records, 10 blocks


def make_store(tmp_path, consolidated=False, sharded=True):
    """A sharded array, or a consolidated group holding it and an untouched array; or an
    array of plain chunk files (formats/zarr_chunks.py writes those)."""
    path = tmp_path / "in.zarr"
    if not sharded:
        zarr.create_array(store=str(path), shape=DATA.shape, dtype=DATA.dtype, chunks=(20, 8, 8),
                          zarr_format=2)[:] = DATA
    elif consolidated:
        group = zarr.open_group(str(path), mode="w", zarr_format=3)
        group.create_array("x", shape=DATA.shape, dtype=DATA.dtype, chunks=(10, 8, 8),
                           shards=(20, 8, 8))[:] = DATA
        group.create_array("labels", shape=(200,), dtype="int8", chunks=(50,))[:] = np.arange(200) % 4
        zarr.consolidate_metadata(str(path))
    else:
        zarr.create_array(store=str(path), shape=DATA.shape, dtype=DATA.dtype, chunks=(10, 8, 8),
                          shards=(20, 8, 8), zarr_format=3)[:] = DATA
    return path


def read_store(path):
    return zarr.open_array(str(path), path="x", mode="r")[...] if (path / "x").is_dir() \
        else zarr.open_array(str(path), mode="r")[...]


def stop_after(blocks):
    """A progress callback that interrupts the run after `blocks` blocks, as Ctrl-C would."""
    seen = []

    def progress(done, total):
        seen.append(done)
        if len(seen) == blocks:
            raise KeyboardInterrupt
    return progress


def options(src, out, **more):
    return PerturbOptions(input=src, out=out, block_elements=BLOCK, **{"eps": 1.0, "seed": SEED, **more})


def journal_blocks(out):
    lines = (partial_path(out) / "journal.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines[1:]]


@pytest.mark.parametrize("consolidated", [False, True])
@pytest.mark.parametrize("first, second", [
    ({"workers": 1}, {"workers": 1}),
    ({"workers": 3}, {"workers": 2}),
    ({"scheduler": "dask", "workers": 1}, {"workers": 2}),
], ids=["serial", "threads", "dask-then-threads"])
def test_resume_equals_an_uninterrupted_run(tmp_path, consolidated, first, second):
    if first.get("scheduler") == "dask":
        distributed = pytest.importorskip("distributed")
        cluster = distributed.LocalCluster(processes=False, n_workers=1, threads_per_worker=2,
                                           dashboard_address="127.0.0.1:0")
        first = {**first, "dask_address": cluster.scheduler_address}
    else:
        cluster = None
    src = make_store(tmp_path, consolidated)
    reference = tmp_path / "reference.zarr"
    perturb(options(src, reference))
    out = tmp_path / "out.zarr"
    try:
        with pytest.raises(Interrupted, match=r"--resume"):
            perturb(options(src, out, **first), progress=stop_after(4))
    finally:
        if cluster is not None:
            cluster.close()
    assert not out.exists()
    assert not (tmp_path / "out.zarr.manifest.json").exists()
    written = journal_blocks(out)
    assert 4 <= len(written) < 10  # finished blocks are journaled; the rest are not done

    result = perturb(options(src, out, resume=True, **second))
    np.testing.assert_array_equal(read_store(out), read_store(reference))
    assert not partial_path(out).exists()
    assert {p.name for p in tmp_path.iterdir()} == {"in.zarr", "reference.zarr", "reference.zarr.manifest.json",
                                                     "out.zarr", "out.zarr.manifest.json"}
    if consolidated:  # rebuilt at the end, so readers that trust it see the perturbed array
        # uint8 data, the default exact sampler: integer noise in int16
        assert zarr.open_consolidated(str(out), mode="r")["x"].dtype == np.int16
    files = {entry["path"] for entry in result.manifest["outputs"]}
    assert files == {str(p) for p in out.rglob("*") if p.is_file()}


def test_killed_run_resumes(tmp_path):
    """SIGKILL part way through (no cleanup at all, blocks in flight in two threads)."""
    src = make_store(tmp_path)
    out = tmp_path / "out.zarr"
    script = textwrap.dedent(f"""
        import os, signal
        from pathlib import Path
        from tldp_cli.run.pipeline import PerturbOptions, perturb
        seen = []
        def progress(done, total):
            seen.append(done)
            if len(seen) == 3:
                os.kill(os.getpid(), signal.SIGKILL)
        perturb(PerturbOptions(input=Path({str(src)!r}), eps=1.0, out=Path({str(out)!r}), seed={SEED!r},
                               workers=2, block_elements={BLOCK}), progress=progress)
    """)
    killed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert not out.exists() and len(journal_blocks(out)) >= 3
    perturb(options(src, out, resume=True, workers=2))
    reference = tmp_path / "reference.zarr"
    perturb(options(src, reference))
    np.testing.assert_array_equal(read_store(out), read_store(reference))


def test_plain_chunk_files_resume(tmp_path):
    src = make_store(tmp_path, sharded=False)
    out = tmp_path / "out.zarr"
    with pytest.raises(Interrupted):
        perturb(options(src, out, workers=2), progress=stop_after(4))
    assert 4 <= len(journal_blocks(out)) < 10
    result = perturb(options(src, out, resume=True, workers=2))
    reference = tmp_path / "reference.zarr"
    perturb(options(src, reference))
    np.testing.assert_array_equal(read_store(out), read_store(reference))
    for entry in result.manifest["outputs"]:  # hashed as written, or read back for the blocks kept
        assert entry["sha256"] == hashlib.sha256(open(entry["path"], "rb").read()).hexdigest()


def test_a_resumed_run_counts_the_values_moved_off_markers_before_it(tmp_path):
    """CF missing values: the blocks the interrupted run wrote count in the manifest."""
    src = tmp_path / "in.zarr"
    data = np.zeros((200, 8, 8), np.float32)  # values at 0, next to the marker -1: noise lands on it
    data[::7, 0, 0] = -1.0
    array = zarr.create_array(store=str(src), shape=data.shape, dtype=data.dtype, chunks=(20, 8, 8),
                              fill_value=-1.0, zarr_format=3,
                              attributes={"_FillValue": -1.0}, dimension_names=("time", "y", "x"))
    array[:] = data
    more = {"value_range": (0.0, 0.5)}
    reference = tmp_path / "reference.zarr"
    expected = perturb(options(src, reference, **more)).manifest["missing_values"]
    out = tmp_path / "out.zarr"
    with pytest.raises(Interrupted):
        perturb(options(src, out, **more), progress=stop_after(4))
    assert any("note" in entry for entry in journal_blocks(out))
    resumed = perturb(options(src, out, resume=True, **more)).manifest["missing_values"]
    assert resumed == expected
    assert list(expected.values())[0]["moved_off_markers"] > 0
    np.testing.assert_array_equal(read_store(out), read_store(reference))


def test_sigterm_through_the_cli_then_resume(cli, tmp_path):
    """SIGTERM stops the CLI as Ctrl-C does: one line, exit 130, the partial kept."""
    src = make_store(tmp_path)
    out = tmp_path / "out.zarr"
    args = ["perturb", str(src), "--eps", "1", "--seed", SEED, "--out", str(out),
            "--block-elements", str(BLOCK), "--workers", "1"]
    script = textwrap.dedent(f"""
        import os, signal, sys
        import tldp_cli.cli as cli
        calls = []
        def advance(done, total):
            calls.append(done)
            if len(calls) == 3:
                os.kill(os.getpid(), signal.SIGTERM)
        cli.perturb.Display.advance = lambda self, done, total: advance(done, total)
        sys.argv = ["tldp", *{args!r}]
        cli.main()
    """)
    stopped = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert stopped.returncode == 130, stopped.stderr
    assert stopped.stderr.strip() == (
        f"tldp: error: interrupted; the blocks written so far are kept in {partial_path(out)}: run the "
        "same command with --resume (and the same --seed) to continue")
    assert not out.exists()
    resumed = cli(*args, "--resume")
    assert resumed.exit_code == 0, resumed.stderr
    reference = tmp_path / "reference.zarr"
    perturb(options(src, reference))
    np.testing.assert_array_equal(read_store(out), read_store(reference))


def interrupted(tmp_path, **more):
    src = make_store(tmp_path)
    out = tmp_path / "out.zarr"
    with pytest.raises(Interrupted):
        perturb(options(src, out, **more), progress=stop_after(3))
    return src, out


@pytest.mark.parametrize("change, named", [
    ({"eps": 2.0}, "--eps 1.0 (now 2.0)"),
    # the noise drawn (the default exact sampler's)
    ({"noise": "gaussian"}, '--noise "discrete-laplace" (now "discrete-gaussian")'),
    ({"sampler": "float"}, '--noise "discrete-laplace" (now "laplace")'),
    ({"dtype": "float64"}, '--dtype "float32" (now "float64")'),
    ({"value_range": (0.0, 300.0)}, "--range [0.0, 256.0] (now [0.0, 300.0])"),
    ({"seed": None}, "--seed given (now not given)"),
])
def test_resume_refuses_other_options(tmp_path, change, named):
    src, out = interrupted(tmp_path)
    journal = (partial_path(out) / "journal.jsonl").read_text()
    assert SEED not in journal  # the seed is never written
    before = sorted(p.name for p in partial_path(out).rglob("*"))
    with pytest.raises(UsageError, match="--resume: the interrupted run") as error:
        perturb(PerturbOptions(**{**vars(options(src, out, resume=True)), **change}))
    assert named in str(error.value)
    assert sorted(p.name for p in partial_path(out).rglob("*")) == before  # kept for a correct rerun


def test_every_option_is_compared_or_not_by_decision():
    """Each PerturbOptions field is in exactly one of pipeline's lists of what --resume
    compares: a new option fails here until it is put in one (compared as given, in
    another form, or not compared), never compared or ignored by default."""
    lists = (RESUME_COMPARED, RESUME_COMPARED_AS, RESUME_NOT_COMPARED)
    listed = [name for names in lists for name in names]
    fields = [f.name for f in dataclasses.fields(PerturbOptions)]
    assert sorted(set(fields) - set(listed)) == [], "options neither compared nor declared not compared"
    assert sorted(set(listed) - set(fields)) == [], "listed names that are no option"
    assert len(listed) == len(set(listed)), "an option in two lists, or twice in one"


def test_the_journal_states_each_compared_option_and_no_other(tmp_path):
    """The options a journal records are RESUME_COMPARED's, by flag, beside the input, its
    format and arrays, whether a seed was given and the weights: nothing of
    RESUME_NOT_COMPARED (the output's paths, workers, the ledger)."""
    _, out = interrupted(tmp_path, workers=2)
    recorded = set(header(out)["options"])
    flags = {OPTION_FLAGS.get(name, "--" + name.replace("_", "-")) for name in RESUME_COMPARED}
    assert recorded == flags | {"input", "format", "arrays", "--seed", "--weights", "--ranges"}


def test_refusal_through_the_cli_is_one_line_exit_2(cli, tmp_path):
    src, out = interrupted(tmp_path)
    result = cli("perturb", src, "--eps", "3", "--seed", SEED, "--out", out, "--block-elements", BLOCK,
                 "--resume")
    assert result.exit_code == 2
    assert len(result.stderr.strip().splitlines()) == 1 and "--eps 1.0 (now 3.0)" in result.stderr


def test_a_new_run_removes_a_dead_partial_and_says_so(cli, tmp_path):
    src, out = interrupted(tmp_path)
    again = cli("perturb", src, "--eps", "1", "--out", out, "--block-elements", BLOCK)
    assert again.exit_code == 0, again.stderr
    assert "partial output of an interrupted run" in again.stderr and "--resume" in again.stderr
    assert out.is_dir() and not partial_path(out).exists()


def test_unseeded_resume_keeps_the_written_blocks_and_completes(tmp_path):
    src, out = interrupted(tmp_path, seed=None)
    kept = zarr.open_array(str(partial_path(out) / "store"), mode="r")
    done = journal_blocks(out)
    before = {(b["start"], b["stop"]): kept[b["start"]:b["stop"]] for b in done}
    result = perturb(options(src, out, seed=None, resume=True))
    final = read_store(out)
    for (start, stop), values in before.items():
        np.testing.assert_array_equal(final[start:stop], values)
    assert not np.array_equal(final, DATA) and result.manifest["seeded"] is False


def test_resume_with_nothing_to_resume_runs_from_the_start(tmp_path):
    src = make_store(tmp_path)
    out = tmp_path / "out.zarr"
    result = perturb(options(src, out, resume=True))
    assert any("no interrupted run" in m for m in result.messages)
    reference = tmp_path / "reference.zarr"
    perturb(options(src, reference))
    np.testing.assert_array_equal(read_store(out), read_store(reference))


def test_resume_of_a_complete_output_says_nothing_is_left_to_resume(cli, tmp_path):
    """--resume where the output is complete and no interrupted run is kept: it said only
    "output exists; pass --overwrite", as if --resume had not been given (exit 1 as before;
    nothing touched)."""
    src = make_store(tmp_path)
    out = tmp_path / "out.zarr"
    assert cli("perturb", src, "--eps", "1", "--out", out, "-q").exit_code == 0
    before = {p: p.read_bytes() for p in sorted(tmp_path.rglob("*")) if p.is_file()}
    result = cli("perturb", src, "--eps", "1", "--out", out, "--resume")
    assert_one_line_error(result, 1, str(out), "complete", "nothing left to resume", "--overwrite")
    assert {p: p.read_bytes() for p in sorted(tmp_path.rglob("*")) if p.is_file()} == before
    again = cli("perturb", src, "--eps", "1", "--out", out, "--resume", "--overwrite")  # as before: runs anew
    assert again.exit_code == 0, again.stderr


def test_a_partial_in_use_is_refused(tmp_path):
    src, out = interrupted(tmp_path)
    fd = os.open(partial_path(out), os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # as a running tldp holds it
        with pytest.raises(OutputError, match="another tldp run is writing it"):
            perturb(options(src, out, resume=True))
    finally:
        os.close(fd)


def test_bad_data_removes_the_partial(tmp_path):
    src = tmp_path / "in.zarr"
    values = np.zeros((100, 4), np.float32)
    values[60:] = 5.0  # outside --range 0:1 from the block at record 60
    zarr.create_array(store=str(src), shape=values.shape, dtype=values.dtype, chunks=(20, 4))[:] = values
    # Records of 4 floats in 0:1 keep raw values with probability above dp_delta: consent
    # (tests/privacy/test_raw_release.py), so the run reaches the bad block.
    with pytest.raises(Exception, match="outside the declared range"):
        perturb(PerturbOptions(input=src, eps=1.0, value_range=(0, 1), out=tmp_path / "o.zarr",
                               block_elements=80, allow_raw_release=True))
    assert siblings(tmp_path) == {"in.zarr"}


@pytest.mark.parametrize("failure, line", [
    (MemoryError(), "ran out of memory (MemoryError); nothing was written: free memory, or run with fewer --workers"),
    (RuntimeError("a bug"), "unexpected error (RuntimeError: a bug); please report it"),
], ids=["memory", "bug"])
def test_a_failure_that_a_rerun_will_not_fix_removes_the_partial(cli, tmp_path, monkeypatch, failure, line):
    """Memory running out in the fourth block (or a bug there): one line naming the input,
    exit 1, and the blocks written before are not left behind in .OUT.tldp-partial."""
    from tldp_cli.sampling import engine

    src = make_store(tmp_path)
    calls = []
    real = engine.perturb_records

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 4:
            raise failure
        return real(*args, **kwargs)

    monkeypatch.setattr(engine, "perturb_records", failing)
    result = cli("perturb", src, "--eps", "1", "--out", tmp_path / "o.zarr", "--workers", "1",
                 "--block-elements", str(BLOCK))
    assert result.exit_code == 1 and len(calls) == 4
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and line in lines[0], result.stderr
    assert lines[0].startswith(f"tldp: error: {src}: ran out" if isinstance(failure, MemoryError)
                               else "tldp: error: unexpected error")
    assert siblings(tmp_path) == {"in.zarr"}


@pytest.mark.parametrize("make", [make_npy, make_hdf5, make_images], ids=["npy", "hdf5", "images"])
def test_interrupted_run_leaves_nothing(tmp_path, make):
    src, _ = make(tmp_path)
    with pytest.raises(KeyboardInterrupt):
        perturb(PerturbOptions(input=src, eps=1.0, out=tmp_path / "out", block_elements=BLOCK, workers=2),
                progress=stop_after(1))
    assert siblings(tmp_path) == {src.name}


@pytest.mark.parametrize("make", [make_npy, make_hdf5, make_images], ids=["npy", "hdf5", "images"])
def test_resume_is_for_zarr_output_only(cli, tmp_path, make):
    """The line names the input whose format keeps nothing to resume from (it named none)."""
    src, _ = make(tmp_path)
    result = cli("perturb", src, "--eps", "1", "--resume")
    assert_one_line_error(result, 2, f"{src}: --resume applies to Zarr output, not ")
    assert siblings(tmp_path) == {src.name}


def test_resume_with_weights_checks_the_mask(tmp_path):
    src = make_store(tmp_path)
    masks = {}
    for name, seed in (("m1.npy", 1), ("m2.npy", 2)):
        masks[name] = tmp_path / name
        np.save(masks[name], np.random.default_rng(seed).random((200, 8, 8)))
    out, reference = tmp_path / "out.zarr", tmp_path / "reference.zarr"
    weighted = {"weights": masks["m1.npy"], "eps": 20.0}
    with pytest.raises(Interrupted):
        perturb(options(src, out, **weighted), progress=stop_after(3))
    with pytest.raises(UsageError, match="--weights"):
        perturb(options(src, out, resume=True, **{**weighted, "weights": masks["m2.npy"]}))
    perturb(options(src, out, resume=True, **weighted))
    perturb(options(src, reference, **weighted))
    np.testing.assert_array_equal(read_store(out), read_store(reference))


# --------------------------------------------------------------------------- provenance
# --resume refuses an interrupted run written by another tldp version or random-stream
# layout: its blocks may hold other noise for the same seed, or other record ranges.

def header(out):
    return json.loads((partial_path(out) / "journal.jsonl").read_text().splitlines()[0])


def rewrite_header(out, **fields):
    """Edit the journal's first line as another tldp would have written it."""
    journal = partial_path(out) / "journal.jsonl"
    first, *rest = journal.read_text().splitlines()
    entry = {k: v for k, v in {**json.loads(first), **fields}.items() if v is not None}
    journal.write_text("\n".join([json.dumps(entry), *rest]) + "\n")


def test_the_journal_records_version_and_layout_never_the_seed(tmp_path):
    _, out = interrupted(tmp_path)
    first = header(out)
    assert first["tldp"] == __version__
    assert first["stream_layout"] == rng.STREAM_LAYOUT
    assert first["stream_unit_elements"] == rng.STREAM_UNIT_ELEMENTS
    assert SEED not in (partial_path(out) / "journal.jsonl").read_text()


@pytest.mark.parametrize("fields, named", [
    ({"tldp": "0.0.1"}, f'tldp version "0.0.1" (now "{__version__}")'),
    ({"tldp": None}, f'tldp version unknown (now "{__version__}")'),  # a journal from before
    ({"stream_layout": 0}, f"random-stream layout 0 (now {rng.STREAM_LAYOUT})"),
    ({"stream_unit_elements": 1 << 16}, f"stream unit elements 65536 (now {rng.STREAM_UNIT_ELEMENTS})"),
], ids=["version", "no-version", "layout", "unit-elements"])
def test_resume_refuses_another_version_or_layout(tmp_path, fields, named):
    src, out = interrupted(tmp_path)
    rewrite_header(out, **fields)
    journal = (partial_path(out) / "journal.jsonl").read_bytes()
    with pytest.raises(UsageError, match="the interrupted run .* was written by another tldp") as error:
        perturb(options(src, out, resume=True))
    assert named in str(error.value)
    assert str(error.value).count("(now ") == 1  # only what differs is named
    assert (partial_path(out) / "journal.jsonl").read_bytes() == journal  # kept for that tldp
    assert not out.exists()


def test_a_layout_bump_in_this_tldp_is_refused(tmp_path, monkeypatch):
    src, out = interrupted(tmp_path)
    monkeypatch.setattr(rng, "STREAM_LAYOUT", rng.STREAM_LAYOUT + 1)
    with pytest.raises(UsageError, match=rf"random-stream layout {rng.STREAM_LAYOUT - 1} "
                                         rf"\(now {rng.STREAM_LAYOUT}\)"):
        perturb(options(src, out, resume=True))


def test_provenance_refusal_through_the_cli_is_one_line_exit_2(cli, tmp_path):
    src, out = interrupted(tmp_path)
    rewrite_header(out, tldp="0.0.1")
    args = ("perturb", src, "--eps", "1", "--seed", SEED, "--out", out, "--block-elements", BLOCK)
    result = cli(*args, "--resume")
    assert result.exit_code == 2
    assert len(result.stderr.strip().splitlines()) == 1
    assert 'tldp version "0.0.1"' in result.stderr and "without --resume" in result.stderr
    started_over = cli(*args)  # what the message offers
    assert started_over.exit_code == 0, started_over.stderr
    reference = tmp_path / "reference.zarr"
    perturb(options(src, reference))
    np.testing.assert_array_equal(read_store(out), read_store(reference))


def test_the_same_version_and_layout_still_resume(tmp_path):
    src, out = interrupted(tmp_path)
    perturb(options(src, out, resume=True))
    reference = tmp_path / "reference.zarr"
    perturb(options(src, reference))
    np.testing.assert_array_equal(read_store(out), read_store(reference))
