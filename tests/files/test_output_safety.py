"""A run touches nothing but its own output: destinations, races, killed runs, odd paths."""

import contextlib
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import zarr

from tests.builders import assert_one_line_error, make_hdf5, make_npy, one_line_error, siblings, tree_digest
from tldp_cli.errors import OutputError
from tldp_cli.files import output

DATA = np.random.default_rng(0).integers(0, 256, (50, 8, 8), dtype=np.uint8)


@pytest.fixture
def proj(tmp_path) -> Path:
    """proj/x.npy and another file the user keeps there."""
    folder = tmp_path / "proj"
    folder.mkdir()
    np.save(folder / "x.npy", DATA)
    (folder / "notes.txt").write_text("keep me")
    return folder


def make_store(path: Path) -> Path:
    group = zarr.open_group(path, mode="w", zarr_format=3)
    group.create_array("t2m", shape=DATA.shape, dtype="uint8", chunks=(10, 8, 8))[:] = DATA
    return path


# --- where --out points ----------------------------------------------------------------

def test_out_naming_the_folder_that_holds_the_input_writes_inside_it(cli, proj):
    before = tree_digest(proj)
    result = cli("perturb", proj / "x.npy", "--eps", "1", "--out", proj, "--overwrite", "-q")
    assert result.exit_code == 0, result.stderr
    after = tree_digest(proj)
    assert {k: v for k, v in after.items() if k in before} == before  # nothing replaced
    assert set(after) == set(before) | {"x.tldp.npy", "x.tldp.npy.manifest.json"}


def test_trailing_slash_means_inside_an_unrelated_folder(cli, proj, tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    (results / "old.csv").write_text("1,2")
    result = cli("perturb", proj / "x.npy", "--eps", "1", "--out", f"{results}/", "--overwrite", "-q")
    assert result.exit_code == 0, result.stderr
    assert siblings(results) == {"old.csv", "x.tldp.npy", "x.tldp.npy.manifest.json"}
    missing = cli("perturb", proj / "x.npy", "--eps", "1", "--out", f"{tmp_path}/nowhere/")
    assert "does not exist" in one_line_error(missing, 1)
    # Regression: --help's "any PATH ending in '/'" read as if tldp made the folder; it does not
    assert "tldp makes no folders: create it first" in one_line_error(missing, 1)
    assert not (tmp_path / "nowhere").exists()


def test_a_folder_output_never_replaces_the_folder_holding_its_input(cli, proj):
    store = make_store(proj / "s.zarr")
    before = tree_digest(proj)
    result = cli("perturb", store, "--eps", "1", "--out", proj, "--overwrite")
    assert "holds the input" in one_line_error(result, 2)
    assert tree_digest(proj) == before


def test_a_folder_output_replaces_only_an_earlier_output_of_its_kind(cli, proj, tmp_path):
    store = make_store(tmp_path / "s.zarr")
    unrelated = tmp_path / "photos"
    unrelated.mkdir()
    (unrelated / "me.jpg").write_bytes(b"not really")
    result = cli("perturb", store, "--eps", "1", "--out", unrelated, "--overwrite")
    assert "not an earlier output" in one_line_error(result, 2)
    assert (unrelated / "me.jpg").read_bytes() == b"not really"
    first = cli("perturb", store, "--eps", "1", "--out", tmp_path / "o.zarr", "-q")
    again = cli("perturb", store, "--eps", "1", "--out", tmp_path / "o.zarr", "--overwrite", "-q")
    assert first.exit_code == 0 and again.exit_code == 0, again.stderr
    assert zarr.open_group(tmp_path / "o.zarr", mode="r")["t2m"].shape == DATA.shape


def test_never_a_folder_for_a_file_nor_a_file_for_a_folder(cli, proj, tmp_path):
    store = make_store(tmp_path / "s.zarr")
    (tmp_path / "f.zarr").write_text("a file")
    result = cli("perturb", store, "--eps", "1", "--out", tmp_path / "f.zarr", "--overwrite")
    assert "not a folder" in one_line_error(result, 2)
    (tmp_path / "d.npy").mkdir()  # a file output into an existing folder goes inside it ...
    (tmp_path / "d.npy" / "x.tldp.npy").mkdir()  # ... where a folder of that name is in the way
    result = cli("perturb", proj / "x.npy", "--eps", "1", "--out", tmp_path / "d.npy", "--overwrite")
    assert "is a folder" in one_line_error(result, 2)


def test_an_array_inside_a_store_is_written_beside_the_store(cli, tmp_path):
    store = make_store(tmp_path / "era.zarr")
    before = tree_digest(store)
    result = cli("perturb", store / "t2m", "--eps", "1", "-q")
    assert result.exit_code == 0, result.stderr
    assert tree_digest(store) == before
    assert (tmp_path / "era.t2m.tldp.zarr").is_dir()
    assert (tmp_path / "era.t2m.tldp.zarr.manifest.json").is_file()
    inside = cli("perturb", store / "t2m", "--eps", "1", "--out", store / "noisy")
    assert "inside the Zarr store" in one_line_error(inside, 2)
    manifest_inside = cli("perturb", store / "t2m", "--eps", "1", "--out", tmp_path / "n.zarr",
                          "--manifest", store / "m.json")
    assert manifest_inside.exit_code == 2 and tree_digest(store) == before


def test_the_output_keeps_the_input_format(cli, proj):
    result = cli("perturb", proj / "x.npy", "--eps", "1", "--out", proj / "conv.h5")
    assert "HDF5" in one_line_error(result, 2)
    assert not (proj / "conv.h5").exists()


def test_dash_is_refused_and_creates_no_file(cli, proj, monkeypatch):
    monkeypatch.chdir(proj)
    result = cli("perturb", "x.npy", "--eps", "1", "--out", "-")
    assert "standard output" in one_line_error(result, 2)
    result = cli("perturb", "x.npy", "--eps", "1", "--manifest", "-")
    assert "--json" in one_line_error(result, 2)
    assert not (proj / "-").exists()


def test_special_files_are_refused_as_input(tmp_path):
    fifo = tmp_path / "pipe.npy"
    os.mkfifo(fifo)
    for source in (str(fifo), "/dev/stdin"):
        run = subprocess.run([sys.executable, "-m", "tldp_cli", "perturb", source, "--eps", "1"],
                             stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
        assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr
        assert source in run.stderr
    assert not Path("/dev/stdin.tldp.npy").exists()
    assert siblings(tmp_path) == {"pipe.npy"}


def test_symlink_loops_and_dot_are_one_line(cli, proj, monkeypatch):
    monkeypatch.chdir(proj)
    os.symlink("loop", proj / "loop")
    for args in (("--out", "loop"), ("--manifest", "loop"), ("--out", "loop/y.npy")):
        result = cli("perturb", "x.npy", "--eps", "1", *args)
        one_line_error(result, 1)
    result = cli("perturb", "x.npy", "--eps", "1", "--out", ".", "-q")
    assert result.exit_code == 0 and (proj / "x.tldp.npy").is_file()


# --- a failed run replaces nothing ---------------------------------------------------------

def test_a_failed_run_keeps_the_existing_output(cli, proj, tmp_path):
    out = tmp_path / "o.npy"
    assert cli("perturb", proj / "x.npy", "--eps", "1", "--out", out, "-q").exit_code == 0
    before = tree_digest(tmp_path)
    result = cli("perturb", proj / "x.npy", "--eps", "1", "--out", out, "--overwrite",
                 "--manifest", tmp_path / "missing" / "m.json")
    assert "does not exist" in one_line_error(result, 1)
    out_of_range = cli("perturb", proj / "x.npy", "--eps", "1", "--out", out, "--overwrite",
                       "--range", "0:10")
    assert out_of_range.exit_code == 1
    assert tree_digest(tmp_path) == before and siblings(tmp_path) == {"proj", "o.npy",
                                                                     "o.npy.manifest.json"}


def test_a_failed_commit_puts_the_old_files_back(tmp_path, monkeypatch):
    out, manifest = tmp_path / "o.bin", tmp_path / "o.json"
    out.write_text("old output")
    manifest.write_text("old manifest")
    staging = output.Staging()
    staging.temporary(out).write_text("new output")
    staging.temporary(manifest).write_text("new manifest")
    real_swap = output.swap
    calls = []

    def failing_swap(src, dst):
        calls.append(dst)
        if dst == manifest:
            raise OSError(5, "Input/output error", str(dst))
        real_swap(src, dst)

    monkeypatch.setattr(output, "swap", failing_swap)
    with pytest.raises(OSError):
        staging.commit(overwrite=True)
    staging.discard()
    assert out.read_text() == "old output" and manifest.read_text() == "old manifest"
    assert siblings(tmp_path) == {"o.bin", "o.json"}


# --- races -------------------------------------------------------------------------------

def test_place_new_never_replaces(tmp_path):
    for make in (lambda p: p.write_text("x"), lambda p: p.mkdir()):
        src, dst = tmp_path / "src", tmp_path / "dst"
        make(src)
        dst.write_text("theirs")
        with pytest.raises(FileExistsError):
            output.place_new(src, dst)
        assert dst.read_text() == "theirs"
        output.remove(src)
        dst.unlink()


def test_an_output_that_appears_during_the_run_is_not_replaced(tmp_path):
    out = tmp_path / "o.npy"
    staging = output.Staging()
    staging.temporary(out).write_text("mine")
    out.write_text("another run's")
    with pytest.raises(OutputError, match="appeared while tldp was writing"):
        staging.commit(overwrite=False)
    staging.discard()
    assert out.read_text() == "another run's" and siblings(tmp_path) == {"o.npy"}


@pytest.mark.slow  # four real tldp processes
def test_of_concurrent_runs_exactly_one_wins(tmp_path):
    np.save(tmp_path / "x.npy", np.random.default_rng(1).random((400, 32, 32), dtype=np.float32))
    runs = [subprocess.Popen([sys.executable, "-m", "tldp_cli", "perturb", tmp_path / "x.npy", "--eps", "1",
                              "--range", "0:1", "--out", tmp_path / "o.npy", "--workers", "1"],
                             stderr=subprocess.PIPE, text=True) for _ in range(4)]
    results = [(run.wait(timeout=120), run.stderr.read()) for run in runs]
    assert sorted(code for code, _ in results) == [0, 1, 1, 1], results
    for code, err in results:
        assert "Traceback" not in err
    assert siblings(tmp_path) == {"x.npy", "o.npy", "o.npy.manifest.json"}
    assert np.load(tmp_path / "o.npy").shape == (400, 32, 32)


# --- killed runs --------------------------------------------------------------------------

KILLED_RUN = textwrap.dedent("""
    import os, sys
    from pathlib import Path
    from tldp_cli.files import output
    staging = output.Staging()
    staging.temporary(Path(sys.argv[1])).write_text("half written")
    os._exit(0)  # as SIGKILL would: no clean-up
""")


def test_a_killed_runs_leftover_is_removed_by_the_next_run(cli, proj, tmp_path):
    out = tmp_path / "o.npy"
    subprocess.run([sys.executable, "-c", KILLED_RUN, str(out)], check=True, timeout=60)
    leftovers = [p for p in tmp_path.iterdir() if p.name.startswith(".o.npy.tldp-tmp-")]
    assert len(leftovers) == 1
    result = cli("perturb", proj / "x.npy", "--eps", "1", "--out", out)
    assert result.exit_code == 0, result.stderr
    assert "left by a tldp run that was killed" in result.stderr
    assert siblings(tmp_path) == {"proj", "o.npy", "o.npy.manifest.json"}


def test_a_live_runs_work_folder_is_left_alone(tmp_path):
    out = tmp_path / "o.npy"
    live = output.Staging()
    live.temporary(out).write_text("being written")
    assert output.remove_dead_work(out) == []
    assert len([p for p in tmp_path.iterdir() if ".tldp-tmp-" in p.name]) == 1
    live.discard()
    assert siblings(tmp_path) == set()


def test_a_killed_process_really_releases_its_lock(tmp_path):
    """SIGKILL mid-run, with a real perturb: the next run cleans up after it."""
    np.save(tmp_path / "x.npy", np.zeros((3000, 64, 64), np.float32))
    run = subprocess.Popen([sys.executable, "-m", "tldp_cli", "perturb", tmp_path / "x.npy", "--eps", "1",
                            "--range", "0:1", "--out", tmp_path / "o.npy", "--workers", "1"],
                           stderr=subprocess.DEVNULL)
    # Until the run is writing its output: a deadline, not a count of polls, since a loaded
    # machine (CI's workers side by side) can take many seconds to start the interpreter.
    deadline = time.monotonic() + 300
    while not any((p / "o.npy").exists() for p in tmp_path.iterdir() if ".tldp-tmp-" in p.name):
        if run.poll() is not None:
            pytest.skip("the run finished before it could be killed")
        if time.monotonic() > deadline:
            run.kill()
            pytest.fail("the run wrote nothing in 300 s")
        time.sleep(0.01)
    run.kill()
    run.wait()
    assert [p for p in tmp_path.iterdir() if ".tldp-tmp-" in p.name]
    assert output.remove_dead_work(tmp_path / "o.npy")
    assert siblings(tmp_path) == {"x.npy"}


# --- review fixes: half-done commits, concurrent --overwrite, protected files -------------

HALF_COMMITTED = textwrap.dedent("""
    import os, sys
    from pathlib import Path
    from tldp_cli.files import output
    out, manifest = Path(sys.argv[1]), Path(sys.argv[2])
    staging = output.Staging()
    staging.temporary(out).write_text("new output")
    staging.temporary(manifest).write_text("new manifest")
    real_swap = output.swap
    calls = []
    def swap_then_die(src, dst):
        real_swap(src, dst)
        if dst == manifest:
            return
        os._exit(0)  # killed between the output's move and the manifest's
    output.swap = swap_then_die
    staging.commit(overwrite=True)
""")


def test_a_commit_killed_half_way_is_finished_by_the_next_run(tmp_path):
    out, manifest = tmp_path / "o.npy", tmp_path / "o.npy.manifest.json"
    out.write_text("old output")
    manifest.write_text("old manifest")
    subprocess.run([sys.executable, "-c", HALF_COMMITTED, str(out), str(manifest)], check=True, timeout=60)
    assert out.read_text() == "new output" and manifest.read_text() == "old manifest"  # out of step
    notes = output.remove_dead_work(out)
    assert any("finished moving" in note for note in notes), notes
    assert out.read_text() == "new output" and manifest.read_text() == "new manifest"
    assert siblings(tmp_path) == {"o.npy", "o.npy.manifest.json"}


def test_concurrent_commits_to_one_folder_take_turns(tmp_path):
    import threading

    out = tmp_path / "o.npy"
    staging = output.Staging()
    staging.temporary(out).write_text("mine")
    done = threading.Event()
    with output._parents_locked([out]):  # another run moving its output and manifest into place
        thread = threading.Thread(target=lambda: (staging.commit(overwrite=True), done.set()))
        thread.start()
        assert not done.wait(0.5)  # waits for the other run's moves to finish
    thread.join(10)
    assert done.is_set() and out.read_text() == "mine"
    staging.close()


def test_devices_pipes_and_dev_are_never_replaced(cli, proj, tmp_path):
    os.mkfifo(tmp_path / "fifo")
    for target in (tmp_path / "fifo", Path("/dev/null")):
        result = cli("perturb", proj / "x.npy", "--eps", "1", "--out", target, "--overwrite")
        one_line_error(result, 2)
    assert Path("/dev/null").is_char_device() and not Path("/dev/null.manifest.json").exists()


def test_the_files_a_run_reads_are_never_overwritten(cli, proj, tmp_path):
    seed = tmp_path / "k.seed"
    seed.write_text("63988a96c9174c4d483c437d9ca578ff")
    seed.chmod(0o600)
    mask = tmp_path / "w.npy"
    np.save(mask, np.full((8, 8), 0.5))
    cases = [("--seed-file", seed, "--manifest", seed), ("--seed-file", seed, "--out", seed),
             ("--weights", mask, "--out", mask), ("--weights", mask, "--manifest", mask)]
    for case in cases:
        before = tree_digest(tmp_path)
        result = cli("perturb", proj / "x.npy", "--eps", "1", "--overwrite", *case)
        assert "same file" in one_line_error(result, 2), case
        assert tree_digest(tmp_path) == before


def test_a_folder_is_replaced_only_when_its_manifest_names_it(cli, tmp_path):
    store = make_store(tmp_path / "s.zarr")
    raw = make_store(tmp_path / "raw.zarr")  # a Zarr store, but no tldp output
    before = tree_digest(raw)
    refused = cli("perturb", store, "--eps", "1", "--out", raw, "--overwrite")
    assert "not an earlier output" in one_line_error(refused, 2)
    assert tree_digest(raw) == before


def test_a_manifest_path_ending_in_a_slash_is_refused(cli, proj):
    result = cli("perturb", proj / "x.npy", "--eps", "1", "--manifest", f"{proj}/x.npy/", "--overwrite")
    assert result.exit_code == 2 and (proj / "x.npy").is_file()


@pytest.mark.parametrize("name, expected", [
    ("model.weights.h5", "model.tldp.weights.h5"),  # Keras loads only *.weights.h5
    ("image.ome.zarr", "image.tldp.ome.zarr"),      # OME-Zarr readers look for .ome.zarr
    ("data.h5", "data.tldp.h5"), ("run.nc", "run.tldp.nc"), ("digits.zarr", "digits.tldp.zarr"),
    ("store", "store.tldp"), ("x.npy", "x.tldp.npy"), ("m.safetensors", "m.tldp.safetensors"),
])
def test_default_names_keep_compound_suffixes(name, expected):
    from tldp_cli.formats import hdf5, npy, safetensors_file, zarr_store

    module = {".h5": hdf5, ".nc": hdf5, ".zarr": zarr_store, ".npy": npy,
              ".safetensors": safetensors_file}.get(Path(name).suffix, zarr_store)
    assert module.default_output(Path("d") / name) == Path("d") / expected


# A Ctrl-C or SIGTERM (to this process) at a chosen moment of a real run of the console
# script: while the manifest is written (before the commit), just before the outputs move
# into place, or after they have: while the run cleans up, once the library call has
# returned, once the summary is printed, and while the interpreter exits.
INTERRUPTED_RUN = textwrap.dedent("""
    import atexit, contextlib, os, signal, sys
    from tldp_cli.files import output
    from tldp_cli.run import manifest, pipeline
    import tldp_cli.cli.perturb as command
    from tldp_cli.entry import main

    moment, signum = sys.argv[1], getattr(signal, sys.argv[2])
    def signal_before(original):
        def call(*args, **kwargs):
            os.kill(os.getpid(), signum)
            return original(*args, **kwargs)
        return call

    def signal_after(original):
        def call(*args, **kwargs):
            result = original(*args, **kwargs)
            os.kill(os.getpid(), signum)
            return result
        return call

    if moment == "manifest":
        manifest.write = signal_before(manifest.write)
    elif moment == "commit":
        output.Staging.commit = signal_before(output.Staging.commit)
    elif moment == "after":
        output.Staging.close = signal_before(output.Staging.close)
    elif moment == "returned":
        pipeline.perturb = signal_after(pipeline.perturb)  # the command imports it when it runs
    elif moment == "reported":
        @contextlib.contextmanager
        def then_signal(original=command.uninterruptible):
            with original():
                yield
            os.kill(os.getpid(), signum)
        command.uninterruptible = then_signal
    else:
        atexit.register(os.kill, os.getpid(), signum)
    sys.argv = ["tldp", "perturb", sys.argv[3], "--eps", "1", "--out", sys.argv[4]]
    main()
""")


@pytest.mark.slow
@pytest.mark.parametrize("signame", ["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("moment,committed", [("manifest", False), ("commit", True), ("after", True),
                                              ("returned", True), ("reported", True), ("exiting", True)])
def test_a_signal_reports_what_is_on_disk(tmp_path, moment, committed, signame):
    """Before the commit Ctrl-C or SIGTERM stops the run with nothing written (exit 130);
    once the outputs start moving into place the run finishes, says so and exits 0,
    whatever it is doing when the signal comes (the signal is ignored to the end)."""
    np.save(tmp_path / "x.npy", np.arange(24, dtype=np.uint8).reshape(6, 4))
    out = tmp_path / "out.npy"
    run = subprocess.run([sys.executable, "-c", INTERRUPTED_RUN, moment, signame, tmp_path / "x.npy", out],
                         capture_output=True, text=True, timeout=120)
    if committed:
        assert run.returncode == 0, run.stderr
        lines = run.stderr.strip().splitlines()
        assert lines[0].startswith("tldp: wrote") and len(lines) == 2, run.stderr  # and the guarantee
        assert out.exists() and Path(str(out) + ".manifest.json").exists()
    else:
        assert run.returncode == 130, run.stderr
        assert run.stderr.strip().splitlines()[-1].startswith("tldp: error: interrupted")
        assert siblings(tmp_path) == {"x.npy"}


def test_the_folder_outputs_are_moved_into_is_flushed_after_the_move(cli, tmp_path, monkeypatch):
    """After a power loss the renames into place must still be there: the destination
    folder is flushed (fsync) once the output and its manifest are in it."""
    src = tmp_path / "in" / "x.npy"
    src.parent.mkdir()
    np.save(src, np.arange(64, dtype=np.uint8).reshape(4, 16))
    dest = tmp_path / "dest"
    dest.mkdir()
    flushed = []
    real_fsync = os.fsync

    def fsync(fd):
        path = os.readlink(f"/proc/self/fd/{fd}")
        flushed.append((path, sorted(os.listdir(path)) if os.path.isdir(path) else None))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    result = cli("perturb", src, "--eps", "1", "--out", dest / "x.npy", "--allow-raw-release")
    assert result.exit_code == 0, result.stderr
    assert any(path == str(dest) and {"x.npy", "x.npy.manifest.json"} <= set(listing)
               for path, listing in flushed)


def _remove_work_folders(dest: Path) -> None:
    for folder in dest.glob(f".*{output.WORK_MARK}*"):
        shutil.rmtree(folder)


@pytest.mark.parametrize("make", [make_npy, make_hdf5], ids=["npy", "hdf5"])
@pytest.mark.parametrize("removed", ["work folder", "destination"])
@pytest.mark.parametrize("moment", ["blocks", "written", "commit"])
def test_an_output_removed_during_the_run_fails_it(cli, tmp_path, monkeypatch, make, removed, moment):
    """A cleanup script removes the folder the output is written in (the run's work folder,
    or the destination folder itself) while blocks are written, once they all are, or just
    before the commit: one line naming the output, exit 1, nothing at the destination."""
    from tldp_cli.run import pipeline
    from tldp_cli.sampling import engine

    src, _ = make(tmp_path)
    dest = tmp_path / "o"
    dest.mkdir()
    out = dest / f"out{src.suffix}"

    def remove():
        _remove_work_folders(dest) if removed == "work folder" else shutil.rmtree(dest)

    def removing_first(original):
        def call(*args, **kwargs):
            if not getattr(call, "done", False):
                call.done = True
                remove()
            return original(*args, **kwargs)
        return call

    def removing_after(original):
        def call(*args, **kwargs):
            result = original(*args, **kwargs)
            remove()
            return result
        return call

    if moment == "blocks":
        monkeypatch.setattr(engine, "perturb_records", removing_first(engine.perturb_records))
    elif moment == "written":
        monkeypatch.setattr(pipeline, "_write_blocks", removing_after(pipeline._write_blocks))
    else:
        monkeypatch.setattr(output.Staging, "commit", removing_first(output.Staging.commit))
    result = cli("perturb", src, "--eps", "1", "--out", out, "--workers", "1", "--block-elements", "640")
    assert_one_line_error(result, 1, "removed while tldp wrote the output")
    assert str(dest) in result.stderr and output.WORK_MARK not in result.stderr
    assert not dest.exists() or siblings(dest) == set()


@pytest.mark.parametrize("make", [make_npy, make_hdf5], ids=["npy", "hdf5"])
def test_an_output_removed_as_it_is_moved_into_place_is_not_reported_written(cli, tmp_path, monkeypatch,
                                                                              make):
    """Removed by another program the moment it lands: the run does not say "wrote" a file
    that is not there (exit 1, one line) and leaves no manifest without its output."""
    src, _ = make(tmp_path)
    dest = tmp_path / "o"
    dest.mkdir()
    out = dest / f"out{src.suffix}"
    commit = output.Staging.commit

    def commit_then_remove(self, overwrite):
        commit(self, overwrite)
        out.unlink()

    monkeypatch.setattr(output.Staging, "commit", commit_then_remove)
    result = cli("perturb", src, "--eps", "1", "--out", out)
    assert_one_line_error(result, 1, f"{out}: removed by another program")
    assert siblings(dest) == set()


def test_signals_stay_ignored_only_after_a_commit_of_the_tldp_command():
    """uninterruptible(): the command's handler (output.interrupt) is left ignored once the
    outputs are in place (keep()), and comes back after a failed commit; a library caller's
    handler always comes back."""
    import signal

    saved = {number: signal.getsignal(number) for number in (signal.SIGINT, signal.SIGTERM)}
    mine = lambda signum, frame: None  # noqa: E731
    try:
        for handler, committed, expected in ((output.interrupt, True, signal.SIG_IGN),
                                             (output.interrupt, False, output.interrupt),
                                             (mine, True, mine)):
            for number in saved:
                signal.signal(number, handler)
            with pytest.raises(OutputError) if not committed else contextlib.nullcontext():
                with output.uninterruptible() as keep:
                    assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
                    if not committed:
                        raise OutputError("the commit failed")
                    keep()
            assert {signal.getsignal(number) for number in saved} == {expected}
    finally:
        for number, handler in saved.items():
            signal.signal(number, handler)
