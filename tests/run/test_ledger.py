"""The release ledger: releases of the same subjects compose (a copy, a reshaped copy,
part of the rows, part of a row group's arrays, in any order of runs), a cap refuses,
races and kills leave it consistent, and it holds nothing of the raw data."""

import hashlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time

import h5py
import numpy as np
import pytest
import zarr

from tests.builders import siblings
from tldp_cli.run import ledger as ledger_mod

DATA = np.random.default_rng(7).integers(0, 256, (50, 8, 8), dtype=np.uint8)
PER_RECORD = 63.75  # discrete Laplace, eps 1 per element, 64 elements of 0..255


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "raw" / "x.npy"
    path.parent.mkdir()
    np.save(path, DATA)
    return path


def perturb(cli, src, out, *args):
    return cli("perturb", src, "--eps", "1", "--out", out, "--ledger", src.parent / "ledger.db", "-q", *args)


def listing(cli, ledger):
    result = cli("ledger", ledger, "--json")
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


def test_releases_of_a_copy_compose(cli, data, tmp_path):
    copy = tmp_path / "raw" / "copy.npy"
    copy.write_bytes(data.read_bytes())
    assert perturb(cli, data, tmp_path / "a.npy").exit_code == 0
    second = cli("perturb", copy, "--eps", "1", "--out", tmp_path / "b.npy",
                 "--ledger", tmp_path / "raw" / "ledger.db")
    assert second.exit_code == 0, second.stderr
    assert "2 releases: each record (eps=127.5" in second.stderr
    report = listing(cli, tmp_path / "raw" / "ledger.db")
    assert [r["status"] for r in report["releases"]] == ["complete", "complete"]
    assert [r["subjects"] for r in report["releases"]] == [50, 50]
    [group] = report["subjects"]
    assert group["subjects"] == 50 and group["releases"] == [1, 2]
    assert report["worst_subject"]["epsilon"] == pytest.approx(2 * PER_RECORD)


def test_other_records_are_other_subjects_and_reordered_records_the_same(cli, data, tmp_path):
    other = tmp_path / "raw" / "other.npy"
    np.save(other, np.random.default_rng(8).integers(0, 256, (30, 8, 8), dtype=np.uint8))
    reordered = tmp_path / "raw" / "reordered.npy"
    np.save(reordered, DATA[::-1])
    for i, src in enumerate((data, other, reordered)):
        assert perturb(cli, src, tmp_path / f"{i}.npy").exit_code == 0
    groups = listing(cli, tmp_path / "raw" / "ledger.db")["subjects"]
    assert [(g["subjects"], g["releases"]) for g in groups] == [(50, [1, 3]), (30, [2])]


def test_the_cap_refuses_writes_nothing_and_records_nothing(cli, data, tmp_path):
    assert perturb(cli, data, tmp_path / "a.npy", "--max-record-eps", "100").exit_code == 0
    before = siblings(tmp_path)
    refused = perturb(cli, data, tmp_path / "b.npy", "--max-record-eps", "100")
    assert refused.exit_code == 1
    line = refused.stderr.strip()
    assert len(line.splitlines()) == 1 and "refuses" in line and "eps left under the cap: 36.25" in line
    assert siblings(tmp_path) == before
    assert len(listing(cli, tmp_path / "raw" / "ledger.db")["releases"]) == 1


def test_a_cap_without_a_ledger_is_a_usage_error(cli, data, tmp_path):
    result = cli("perturb", data, "--eps", "1", "--max-record-eps", "5")
    assert result.exit_code == 2 and "--ledger" in result.stderr


def test_concurrent_releases_against_one_cap_let_exactly_one_through(data, tmp_path):
    ledger = tmp_path / "raw" / "ledger.db"
    runs = [subprocess.Popen([sys.executable, "-m", "tldp_cli", "perturb", data, "--eps", "1", "--out",
                              tmp_path / f"o{i}.npy", "--ledger", ledger, "--max-record-eps", "100", "-q"],
                             stderr=subprocess.PIPE, text=True) for i in range(4)]
    results = [(run.wait(timeout=120), run.stderr.read()) for run in runs]
    assert sorted(code for code, _ in results) == [0, 1, 1, 1], results
    assert sum((tmp_path / f"o{i}.npy").exists() for i in range(4)) == 1
    with sqlite3.connect(ledger) as db:
        assert db.execute("SELECT status FROM releases").fetchall() == [("complete",)]


def test_a_killed_run_stays_counted_and_the_ledger_consistent(data, tmp_path, cli):
    big = tmp_path / "raw" / "big.npy"
    np.save(big, np.random.default_rng(1).integers(0, 256, (20000, 28, 28), dtype=np.uint8))
    ledger = tmp_path / "raw" / "ledger.db"
    run = subprocess.Popen([sys.executable, "-m", "tldp_cli", "perturb", big, "--eps", "1", "--out",
                            tmp_path / "o.npy", "--ledger", ledger, "--workers", "1"],
                           stderr=subprocess.DEVNULL)
    # Until the release is recorded (pending) and the output is being written: a deadline, not
    # a count of polls, since a loaded machine can take many seconds to start the interpreter.
    deadline = time.monotonic() + 300
    while True:
        if any(".tldp-tmp-" in p.name for p in tmp_path.iterdir()) and ledger.exists():
            with sqlite3.connect(ledger) as db:
                if db.execute("SELECT count(*) FROM releases").fetchone()[0]:
                    break
        if run.poll() is not None:
            pytest.skip("the run finished before it could be killed")
        if time.monotonic() > deadline:
            run.kill()
            pytest.fail("the release was not recorded in 300 s")
        time.sleep(0.01)
    os.kill(run.pid, signal.SIGKILL)
    run.wait()
    with sqlite3.connect(ledger) as db:
        assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    report = listing(cli, ledger)
    assert [r["status"] for r in report["releases"]] == ["pending"]
    assert report["worst_subject"]["pending"] == 1  # counted: its output might be in place


def test_the_ledger_holds_no_raw_values_and_no_plain_hash(cli, data, tmp_path):
    perturb(cli, data, tmp_path / "a.npy")
    ledger = tmp_path / "raw" / "ledger.db"
    with sqlite3.connect(ledger) as db:
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    content = b"".join(p.read_bytes() for p in ledger.parent.iterdir() if p.name.startswith("ledger.db"))
    raw = DATA.tobytes()
    assert raw[:32] not in content and raw[1000:1032] not in content
    for digest in (hashlib.sha256(raw).hexdigest(), hashlib.sha256(data.read_bytes()).hexdigest()):
        assert digest.encode() not in content


def test_a_ledger_of_a_newer_schema_is_refused(cli, data, tmp_path):
    perturb(cli, data, tmp_path / "a.npy")
    ledger = tmp_path / "raw" / "ledger.db"
    with sqlite3.connect(ledger) as db:
        db.execute("UPDATE meta SET value = '99' WHERE key = 'schema_version'")
    result = perturb(cli, data, tmp_path / "b.npy")
    assert result.exit_code == 2 and "newer tldp" in result.stderr


def test_the_ledger_never_travels_with_the_output(cli, data, tmp_path):
    result = cli("perturb", data, "--eps", "1", "--out", tmp_path / "o.npy", "--ledger",
                 tmp_path / "o.npy.manifest.json")
    assert result.exit_code == 2 and not (tmp_path / "o.npy").exists()


def test_the_ledger_is_never_written_into_the_store_of_an_array_given_by_path(cli, tmp_path):
    src, a, _ = row_group_file(tmp_path, "zarr")
    before = sorted(p.name for p in src.iterdir())
    result = cli("perturb", src / a, "--eps", "1", "--out", tmp_path / "o.zarr", "--ledger", src / "ledger.db")
    assert result.exit_code == 2 and "the ledger cannot be inside the input" in result.stderr
    assert sorted(p.name for p in src.iterdir()) == before and not (tmp_path / "o.zarr").exists()


def test_a_run_refused_before_writing_records_nothing(cli, tmp_path):
    """The release is recorded as pending before the output's folders are set up; a run
    refused there (a live run holds the Zarr output) must take its record back."""
    import zarr

    from tldp_cli.run.resume import Partial

    store = tmp_path / "raw" / "s.zarr"
    store.parent.mkdir()
    zarr.create_array(store, shape=DATA.shape, dtype="uint8", chunks=(10, 8, 8), zarr_format=3)[:] = DATA
    out = tmp_path / "o.zarr"
    live = Partial(out, {}, resume=False)  # another run writing the same output
    try:
        result = cli("perturb", store, "--eps", "1", "--out", out, "--ledger", tmp_path / "raw" / "ledger.db")
        assert result.exit_code == 1 and "another tldp run is writing it" in result.stderr
    finally:
        live.remove()
    report = listing(cli, tmp_path / "raw" / "ledger.db")
    assert report["releases"] == [] and report["subjects"] == [] and report["worst_subject"] is None


def test_a_ledger_tldp_may_not_open_says_so(cli, data, tmp_path, monkeypatch):
    """SQLite says "unable to open database file" when permission is denied, which read as
    "not a tldp ledger" (simulated: tests may run as root, whom no mode stops)."""
    ledger = data.parent / "ledger.db"
    ledger.write_bytes(b"")
    real_access = os.access

    def access(path, mode, *args, **kwargs):
        return False if os.fspath(path) == str(ledger) else real_access(path, mode, *args, **kwargs)

    def refuse(*args, **kwargs):
        raise sqlite3.OperationalError("unable to open database file")

    monkeypatch.setattr(os, "access", access)
    monkeypatch.setattr(sqlite3, "connect", refuse)
    result = perturb(cli, data, tmp_path / "out.npy")
    assert result.exit_code == 1
    assert result.stderr.strip().splitlines() == [
        f"tldp: error: {ledger}: cannot open the ledger (permission denied on {ledger})"]
    assert not (tmp_path / "out.npy").exists()


@pytest.mark.parametrize("command", ["perturb", "ledger"])
def test_another_programs_database_is_not_made_a_ledger(cli, data, tmp_path, command):
    """A --ledger naming another program's SQLite file (a typo, a shared data folder) had
    tldp's tables added to it and its journal switched to WAL: it is refused, byte for byte
    untouched, and nothing is written."""
    other = data.parent / "app.db"
    with sqlite3.connect(other) as db:
        db.execute("CREATE TABLE users (name TEXT)")
        db.execute("INSERT INTO users VALUES ('ada')")
    db.close()
    before = other.read_bytes()
    if command == "perturb":
        result = cli("perturb", data, "--eps", "1", "--out", tmp_path / "out.npy", "--ledger", other, "-q")
    else:
        result = cli("ledger", other)
    assert result.exit_code == 1
    assert result.stderr.strip().splitlines() == [
        f"tldp: error: {other}: not a tldp ledger (an SQLite database of other tables: users); "
        "give a new file or one perturb --ledger wrote"]
    assert other.read_bytes() == before
    assert siblings(data.parent) == {"x.npy", "app.db"} and not (tmp_path / "out.npy").exists()


def test_releases_that_meet_the_cap_exactly_pass(cli, data, tmp_path):
    """0.1 + 0.1 + 0.1 rounds a hair above 0.3: the third release of 0.1 was refused with
    "eps left under the cap: 0.1"."""
    for i in range(3):
        result = cli("perturb", data, "--eps", "0.1", "--mechanism", "baseline", "--sampler", "float",
                     "--out", tmp_path / f"r{i}.npy", "--ledger", data.parent / "ledger.db",
                     "--max-record-eps", "0.3", "-q")
        assert result.exit_code == 0, result.stderr
    result = perturb(cli, data, tmp_path / "r3.npy", "--max-record-eps", "0.3")
    assert result.exit_code == 1 and "the ledger refuses this release" in result.stderr


@pytest.mark.parametrize("flag, value", [("--max-record-eps", "nan"), ("--max-record-eps", "-1"),
                                         ("--max-record-delta", "nan"), ("--max-record-delta", "1.5")])
def test_a_cap_that_is_not_a_cap_is_a_usage_error(cli, data, tmp_path, flag, value):
    """NaN turned the cap off (every comparison with it is false)."""
    result = perturb(cli, data, tmp_path / "out.npy", flag, value)
    assert result.exit_code == 2 and f"{flag} must be a number in" in result.stderr
    assert not (tmp_path / "out.npy").exists() and not (data.parent / "ledger.db").exists()


def test_a_larger_dp_delta_does_not_slip_under_an_eps_cap(cli, tmp_path):
    """Four Gaussian releases at delta 1e-5 and 1e-9: a fifth with --dp-delta 0.001 was
    composed with them at 0.001, a smaller eps than theirs at 1e-5, and passed the cap
    that the same release at 1e-5 failed."""
    src = tmp_path / "f.npy"
    np.save(src, DATA.astype(np.float32) / 256)
    ledger = tmp_path / "ledger.db"

    def release(delta, *cap):
        return cli("perturb", src, "--range", "0:1", "--eps", "2", "--mechanism", "baseline", "--noise",
                   "gaussian", "--budget", "record", "--dp-delta", delta, "--out",
                   tmp_path / f"out{len(list(tmp_path.glob('out*.npy')))}.npy", "--ledger", ledger, "-q", *cap)

    for delta in ("1e-5", "1e-5", "1e-9", "1e-9"):
        assert release(delta).exit_code == 0
    spent_before = listing(cli, ledger)["worst_subject"]["epsilon"]
    for delta in ("1e-5", "0.001"):
        refused = release(delta, "--max-record-eps", f"{spent_before:.6g}")
        assert refused.exit_code == 1 and "the ledger refuses this release" in refused.stderr
    assert listing(cli, ledger)["worst_subject"]["releases"] == 4


ROWS = np.random.default_rng(3)
A, B = ROWS.integers(0, 256, (10, 8, 8), dtype=np.uint8), ROWS.integers(0, 256, (10, 4), dtype=np.uint8)


def row_group_file(tmp_path, writer):
    """A file whose arrays /a (10, 8, 8) and /b (10, 4) share their rows: row i of both is subject i."""
    (tmp_path / "raw").mkdir(exist_ok=True)
    if writer == "h5py":
        path = tmp_path / "raw" / "rl.h5"
        with h5py.File(path, "w") as f:
            f["a"], f["b"] = A, B
        return path, "/a", "/b"
    path = tmp_path / "raw" / "rl.zarr"
    group = zarr.open_group(path, mode="w")
    group.create_array("a", data=A)
    group.create_array("b", data=B)
    return path, "a", "b"


def release(cli, src, out, cap, *args):
    """Each release spends 40 per record of what it perturbs (--budget record)."""
    return cli("perturb", src, "--eps", "40", "--budget", "record", "--out", out, "--ledger",
               src.parent / "ledger.db", "--max-record-eps", cap, "-q", *args)


def refused_at(result, spent):
    """Refused as a cap refuses (exit 1, one line), at the most-spent subject's `spent`."""
    lines = result.stderr.strip().splitlines()
    return (result.exit_code == 1 and len(lines) == 1
            and lines[0].startswith("tldp: error: the ledger refuses this release")
            and f"eps {spent:.4g} > --max-record-eps" in lines[0])


@pytest.mark.parametrize("writer", ["h5py", "zarr"])
def test_releases_of_parts_of_a_row_group_compose_per_subject(cli, tmp_path, writer):
    """Issue 27: the whole file, then /a, then /b passed a cap of 50, each "this data's 1
    release", while every subject had spent 119.45 per record."""
    src, a, b = row_group_file(tmp_path, writer)
    suffix = src.suffix
    assert release(cli, src, tmp_path / f"o1{suffix}", "100").exit_code == 0
    whole = json.loads((tmp_path / f"o1{suffix}.manifest.json").read_text())["accounting"]["per_record"]["epsilon"]
    assert whole == pytest.approx(39.448, abs=1e-3)  # records of 68 elements at 40 for 64
    second = release(cli, src, tmp_path / f"o2{suffix}", "100", "--dataset", a)
    assert second.exit_code == 0, second.stderr
    before = siblings(tmp_path)
    third = release(cli, src, tmp_path / f"o3{suffix}", "100", "--dataset", b)
    assert refused_at(third, whole + 80), third.stderr
    assert siblings(tmp_path) == before
    report = listing(cli, src.parent / "ledger.db")
    assert [(g["subjects"], g["releases"]) for g in report["subjects"]] == [(10, [1, 2])]
    assert report["worst_subject"]["epsilon"] == pytest.approx(whole + 40)


@pytest.mark.parametrize("order", [(0, 1), (1, 0)])
def test_arrays_of_a_row_group_released_in_separate_runs_compose(cli, tmp_path, order):
    src, *names = row_group_file(tmp_path, "h5py")
    first, second = (names[i] for i in order)
    assert release(cli, src, tmp_path / "o1.h5", "50", "--dataset", first).exit_code == 0
    assert refused_at(release(cli, src, tmp_path / "o2.h5", "50", "--dataset", second), 80)
    assert not (tmp_path / "o2.h5").exists()


@pytest.mark.parametrize("order", [(0, 1), (1, 0)])
def test_arrays_of_a_zarr_row_group_given_by_path_compose(cli, tmp_path, order):
    """`tldp perturb rl.zarr/a`, then `rl.zarr/b`: each array given by its path inside the
    store is part of the store's row group as --dataset makes it (both passed a cap of 50
    while each subject had spent 80)."""
    src, *names = row_group_file(tmp_path, "zarr")
    first, second = (src / names[i] for i in order)
    ledger = ("--ledger", src.parent / "ledger.db")
    assert release(cli, first, tmp_path / "o1.zarr", "50", *ledger).exit_code == 0
    assert refused_at(release(cli, second, tmp_path / "o2.zarr", "50", *ledger), 80)
    assert not (tmp_path / "o2.zarr").exists()
    assert refused_at(release(cli, src, tmp_path / "o3.zarr", "50", "--dataset", names[order[1]]), 80)
    assert [r["subjects"] for r in listing(cli, src.parent / "ledger.db")["releases"]] == [10]


@pytest.mark.parametrize("whole_first", [True, False])
def test_records_linked_by_one_file_compose_across_other_files(cli, tmp_path, whole_first):
    """Copies of /a's rows and of /b's rows in .npy files of their own are released apart;
    the HDF5 file, which links row i of both, makes each row one subject: whether it is
    released first (the copies reach its subjects) or last (it merges theirs)."""
    src, _, _ = row_group_file(tmp_path, "h5py")
    np.save(tmp_path / "raw" / "a.npy", A)
    np.save(tmp_path / "raw" / "b.npy", B)
    runs = [src, tmp_path / "raw" / "b.npy", tmp_path / "raw" / "a.npy"]
    runs = runs if whole_first else runs[1:] + runs[:1]
    for i, path in enumerate(runs[:2]):
        result = release(cli, path, tmp_path / f"o{i}{path.suffix}", "100")
        assert result.exit_code == 0, result.stderr
    whole = 39.448022057  # the HDF5 release's per-record figure (records of 68 elements at 40)
    last = release(cli, runs[2], tmp_path / f"o2{runs[2].suffix}", "100")
    assert refused_at(last, whole + 80), last.stderr


def test_a_reshaped_copy_is_the_same_records(cli, data, tmp_path):
    """(50, 8, 8) and (50, 64) hold the same records: the copy was new data to the ledger."""
    flat = tmp_path / "raw" / "flat.npy"
    np.save(flat, DATA.reshape(50, 64))
    assert perturb(cli, data, tmp_path / "a.npy", "--max-record-eps", "100").exit_code == 0
    assert refused_at(perturb(cli, flat, tmp_path / "b.npy", "--max-record-eps", "100"), 2 * PER_RECORD)


def test_a_release_of_part_of_the_rows_composes_with_the_whole(cli, data, tmp_path):
    half = tmp_path / "raw" / "half.npy"
    np.save(half, DATA[:25])
    assert perturb(cli, data, tmp_path / "a.npy", "--max-record-eps", "100").exit_code == 0
    assert refused_at(perturb(cli, half, tmp_path / "b.npy", "--max-record-eps", "100"), 2 * PER_RECORD)
    assert perturb(cli, half, tmp_path / "c.npy").exit_code == 0
    report = listing(cli, tmp_path / "raw" / "ledger.db")
    assert [(g["subjects"], g["releases"]) for g in report["subjects"]] == [(25, [1, 2]), (25, [1])]
    assert [g["per_record"]["epsilon"] for g in report["subjects"]] == [pytest.approx(2 * PER_RECORD),
                                                                      pytest.approx(PER_RECORD)]
    text = cli("ledger", tmp_path / "raw" / "ledger.db")
    assert "25 subjects: releases #1, #2: each record (eps=127.5, delta=0)" in text.stdout


def test_a_record_is_known_by_its_dtype_and_values_not_its_shape_or_byte_order(tmp_path):
    db = ledger_mod.open_ledger(tmp_path / "ledger.db")
    try:
        fingerprints = ledger_mod.Fingerprints(db)
        values = np.random.default_rng(4).normal(size=(6, 3, 4)).astype("<f4")
        same = fingerprints.of_rows(values)
        assert len(set(same.tolist())) == 6
        assert (fingerprints.of_rows(values.reshape(6, 12)) == same).all()
        assert (fingerprints.of_rows(values.astype(">f4")) == same).all()
        assert (fingerprints.of_array([values[:2], values[2:]]) == same).all()
        # a model's tensor read in parts (flat, in order, any byte order) is the record read whole
        assert fingerprints.of_parts(np.array_split(values[4].reshape(-1), [5, 7])) == same[4]
        assert fingerprints.of_parts([values[4].reshape(-1)[:5].astype(">f4"), values[4].reshape(-1)[5:]]) == same[4]
        changed = values.copy()
        changed[3, 2, 1] = np.nextafter(changed[3, 2, 1], np.float32(9))
        assert (fingerprints.of_rows(changed) != same).tolist() == [False, False, False, True, False, False]
        assert not set(fingerprints.of_rows(values.astype("<f8")).tolist()) & set(same.tolist())
        other_key = ledger_mod.open_ledger(tmp_path / "other.db")
        assert not set(ledger_mod.Fingerprints(other_key).of_rows(values).tolist()) & set(same.tolist())
        other_key.close()
    finally:
        db.close()


SCHEMA_1 = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE releases (id INTEGER PRIMARY KEY, fingerprint TEXT NOT NULL,
    status TEXT NOT NULL CHECK (status IN ('pending', 'complete')), created TEXT NOT NULL,
    input TEXT NOT NULL, output TEXT NOT NULL, options TEXT NOT NULL, figures TEXT NOT NULL);
CREATE INDEX releases_by_data ON releases (fingerprint);
INSERT INTO meta VALUES ('schema_version', '1');
INSERT INTO meta VALUES ('fingerprint_key', '5d1e0c0a6f1b4c2a9e3d7f8a1b2c3d4e5f60718293a4b5c6d7e8f90a1b2c3d4e');
"""


def test_a_schema_1_ledger_is_upgraded_charging_its_releases_to_every_subject(cli, data, tmp_path):
    """Schema 1 counted whole files; which records its releases touched is unknown."""
    ledger = data.parent / "ledger.db"
    old = {"per_element": {"epsilon": 0.3}, "per_record": {"epsilon": 20.0, "delta": 0.0, "rho": None}}
    with sqlite3.connect(ledger) as db:
        db.executescript(SCHEMA_1)
        db.execute("INSERT INTO releases VALUES (1, ?, 'pending', '2026-01-01T00:00:00+00:00', 'old.npy', "
                   "'old.tldp.npy', '{}', ?)", ("ab" * 32, json.dumps(old)))
    db.close()
    first = cli("perturb", data, "--eps", "1", "--out", tmp_path / "a.npy", "--ledger", ledger,
                "--max-record-eps", "100")
    assert first.exit_code == 0, first.stderr
    assert "2 releases, 1 of them pending (a run in progress, or one that was killed): each record (eps=83.75" in first.stderr
    report = listing(cli, ledger)
    assert [r["charged_to_every_subject"] for r in report["releases"]] == [True, False]
    assert "charged to every subject (recorded by a ledger of schema 1)" in cli("ledger", ledger).stdout
    assert [(g["subjects"], g["releases"]) for g in report["subjects"]] == [(50, [1, 2])]
    with sqlite3.connect(ledger) as db:
        assert db.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone() == ("2",)
    db.close()
    other = tmp_path / "raw" / "other.npy"
    np.save(other, np.random.default_rng(8).integers(0, 256, (30, 8, 8), dtype=np.uint8))
    assert refused_at(perturb(cli, other, tmp_path / "b.npy", "--max-record-eps", "80"), 83.75)


def test_links_merge_subjects_and_their_histories(tmp_path):
    """Subjects are connected sets of records: a release that links records of recorded
    subjects merges them (their histories too, and their records this release does not see),
    and a failed run's release id is never charged again."""
    path = tmp_path / "ledger.db"
    db = ledger_mod.open_ledger(path)
    figures = {"per_element": {}, "per_record": {"epsilon": 1.0, "delta": 0.0, "rho": None}, "per_file": None}

    def release(*rows, keep=True):  # rows: the fingerprints of each array of one row group
        rid, spent, subjects = ledger_mod.begin(db, [np.array(rows, np.int64)], figures, input="i", output="o",
                                                options={}, max_epsilon=None, max_delta=None, dp_delta=1e-5)
        (ledger_mod.complete if keep else ledger_mod.abandon)(db, rid)
        return spent.releases, subjects

    def groups():
        return [(g["subjects"], g["releases"]) for g in ledger_mod.listing(path)["subjects"]]

    try:
        assert release([10, 11]) == (1, 2)  # #1: subjects {10} and {11}
        assert release([20], [10]) == (2, 1)  # #2: 20 joins {10}
        assert release([30, 31], [11, 40]) == (2, 2)  # #3: 30 joins {11}; {31, 40} is new
        assert groups() == [(1, [1, 2]), (1, [1, 3]), (1, [3])]
        assert release([20], [30]) == (4, 1)  # #4 links {10, 20} and {11, 30}: one subject of #1 to #4
        assert groups() == [(1, [1, 2, 3, 4]), (1, [3])]
        assert release([11]) == (5, 1)  # 11, unseen by #4, reaches the merged subject
        assert release([40], keep=False) == (2, 1)  # #6 fails: removed
        assert release([31]) == (2, 1)  # #7: {31, 40} is charged #3 and #7, never #6
        assert groups() == [(1, [1, 2, 3, 4, 5]), (1, [3, 7])]
        release([60, 61])  # #8: two new subjects of one history
        assert release([60], [61]) == (2, 1)  # #9 makes them one
        assert groups() == [(1, [1, 2, 3, 4, 5]), (1, [3, 7]), (1, [8, 9])]
        counts = {table: db.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0]
                  for table in ("records", "subjects", "histories")}
        assert counts == {"records": 8, "subjects": 3, "histories": 3}
    finally:
        db.close()


def test_a_folder_given_as_the_ledger_is_named_as_a_folder(cli, tmp_path):
    """Regression: `tldp ledger some_folder/` said "no such ledger" of a folder that exists."""
    result = cli("ledger", tmp_path)
    assert result.exit_code == 1
    assert f"{tmp_path}: a folder, not a ledger" in result.stderr


def test_listing_an_empty_file_refuses_it_and_leaves_it_empty(cli, tmp_path):
    """`tldp ledger EMPTY` (a read command) made the empty file a ledger: SQLite takes an
    empty file as a new database, and opening it wrote tldp's tables into it."""
    empty = tmp_path / "empty.db"
    empty.touch()
    result = cli("ledger", empty)
    assert result.exit_code == 1 and f"{empty}: an empty file, not a ledger" in result.stderr
    assert empty.stat().st_size == 0 and sorted(p.name for p in tmp_path.iterdir()) == ["empty.db"]


@pytest.mark.parametrize("kind", ["npz", "safetensors"])
def test_a_model_file_is_one_subject_charged_its_whole_file(cli, tmp_path, kind):
    """A model file's tensors are one party's: the ledger charges the whole file (as the
    manifest's per_file, the scope perturb's warnings take for a model file), to one
    subject, not each tensor's per-record figure to a subject of its own."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(3)
    tensors = {f"layer{i}.weight": rng.normal(0, 0.05, (16, 16)).astype(np.float32) for i in range(5)}
    model = tmp_path / "raw" / f"model.{kind}"
    model.parent.mkdir()
    if kind == "npz":
        np.savez(model, **tensors)
    else:
        save_file(tensors, str(model))
    ledger = tmp_path / "raw" / "ledger.db"

    def release(out, *cap):
        return cli("perturb", model, "--eps", "0.02", "--clip", "0.1", "--ledger", ledger,
                   "--out", tmp_path / f"{out}.{kind}", *cap)

    first = release("r1")
    assert first.exit_code == 0, first.stderr
    figures = json.loads((tmp_path / f"r1.{kind}.manifest.json").read_text())["accounting"]
    per_file, per_record = figures["per_file"]["epsilon"], figures["per_record"]["epsilon"]
    assert per_file > 4 * per_record  # five tensors of about the same figure
    assert f"the most-spent of the 1 subject this release touches: 1 release: whole file (eps={per_file:.4g}" \
        in first.stderr
    report = listing(cli, ledger)
    [entry] = report["releases"]
    assert entry["subjects"] == 1 and entry["charged"] == "per_file"
    assert report["worst_subject"]["epsilon"] == pytest.approx(per_file)

    # Two releases of the model spend twice its whole file: a cap between refuses the second.
    refused = release("r2", "--max-record-eps", str(1.5 * per_file))
    assert refused.exit_code == 1
    assert "per model file" in refused.stderr and "nothing was written" in refused.stderr
    assert not (tmp_path / f"r2.{kind}").exists()
    assert len(listing(cli, ledger)["releases"]) == 1
    text = cli("ledger", ledger)
    assert f"whole file (eps={per_file:.4g}" in text.stdout


def test_a_subject_at_the_cap_has_nothing_left(cli, data, tmp_path):
    """Five releases at --budget record --eps 10 certify 10 - 6e-13 each: the sixth was refused
    with "eps left under the cap: 2.835e-12" (docs/plan-and-ledger.md showed it), a
    remainder that is rounding, under the cap's own tolerance."""
    for i in range(2):
        result = cli("perturb", data, "--eps", "10", "--budget", "record", "--out", tmp_path / f"r{i}.npy",
                     "--ledger", data.parent / "ledger.db", "--max-record-eps", "20", "-q")
        assert result.exit_code == 0, result.stderr
    spent = listing(cli, data.parent / "ledger.db")["worst_subject"]["epsilon"]
    assert spent != 20 and spent == pytest.approx(20, rel=1e-12)  # the case: a hair off the cap
    refused = perturb(cli, data, tmp_path / "r2.npy", "--max-record-eps", "20")
    assert refused.exit_code == 1
    assert "eps left under the cap: 0)" in refused.stderr, refused.stderr


def test_a_tensor_fingerprinted_in_parts_is_the_subject_fingerprinted_whole(cli, tmp_path):
    """A tensor larger than a block is fingerprinted part by part (flat memory), a smaller one
    whole: two releases of one model, one in parts (--block-elements 2^18) and one whole, touch
    one subject, charged twice."""
    from safetensors.numpy import save_file

    model = tmp_path / "raw" / "model.safetensors"
    model.parent.mkdir()
    rng = np.random.default_rng(5)
    save_file({"embed.weight": rng.normal(0, 0.05, (700, 1000)).astype(np.float32),
               "norm.weight": np.ones(64, np.float32)}, str(model))
    ledger = tmp_path / "raw" / "ledger.db"
    for out, block in (("parts", 1 << 18), ("whole", 1 << 24)):
        done = cli("perturb", model, "--eps", "1", "--clip", "0.1", "--ledger", ledger, "--block-elements", block,
                   "--out", tmp_path / f"{out}.safetensors")
        assert done.exit_code == 0, done.stderr
    report = listing(cli, ledger)
    assert [entry["subjects"] for entry in report["releases"]] == [1, 1]
    per_file = json.loads((tmp_path / "whole.safetensors.manifest.json").read_text())["accounting"]["per_file"]
    assert report["worst_subject"]["epsilon"] == pytest.approx(2 * per_file["epsilon"])
