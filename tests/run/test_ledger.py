"""The release ledger: releases of the same content compose, a cap refuses, races and
kills leave it consistent, and it holds nothing of the raw data."""

import hashlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.builders import siblings

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
    [dataset] = report["datasets"]
    assert [r["status"] for r in dataset["releases"]] == ["complete", "complete"]
    assert dataset["cumulative_per_record"]["epsilon"] == pytest.approx(2 * PER_RECORD)


def test_other_data_is_another_dataset(cli, data, tmp_path):
    other = tmp_path / "raw" / "other.npy"
    np.save(other, DATA[::-1])
    perturb(cli, data, tmp_path / "a.npy")
    perturb(cli, other, tmp_path / "b.npy")
    assert len(listing(cli, tmp_path / "raw" / "ledger.db")["datasets"]) == 2


def test_the_cap_refuses_writes_nothing_and_records_nothing(cli, data, tmp_path):
    assert perturb(cli, data, tmp_path / "a.npy", "--max-record-eps", "100").exit_code == 0
    before = siblings(tmp_path)
    refused = perturb(cli, data, tmp_path / "b.npy", "--max-record-eps", "100")
    assert refused.exit_code == 1
    line = refused.stderr.strip()
    assert len(line.splitlines()) == 1 and "refuses" in line and "eps left under the cap: 36.25" in line
    assert siblings(tmp_path) == before
    assert len(listing(cli, tmp_path / "raw" / "ledger.db")["datasets"][0]["releases"]) == 1


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
    for _ in range(2000):  # until the release is recorded (pending) and the output is being written
        if any(".tldp-tmp-" in p.name for p in tmp_path.iterdir()) and ledger.exists():
            with sqlite3.connect(ledger) as db:
                if db.execute("SELECT count(*) FROM releases").fetchone()[0]:
                    break
        if run.poll() is not None:
            pytest.skip("the run finished before it could be killed")
        time.sleep(0.01)
    os.kill(run.pid, signal.SIGKILL)
    run.wait()
    with sqlite3.connect(ledger) as db:
        assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    [dataset] = listing(cli, ledger)["datasets"]
    assert dataset["cumulative_per_record"]["pending"] == 1  # counted: its output might be in place


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
    assert listing(cli, tmp_path / "raw" / "ledger.db")["datasets"] == []


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
    spent_before = listing(cli, ledger)["datasets"][0]["cumulative_per_record"]["epsilon"]
    for delta in ("1e-5", "0.001"):
        refused = release(delta, "--max-record-eps", f"{spent_before:.6g}")
        assert refused.exit_code == 1 and "the ledger refuses this release" in refused.stderr
    assert listing(cli, ledger)["datasets"][0]["cumulative_per_record"]["releases"] == 4
