"""--scheduler dask failures keep the CLI contract: one line on stderr, the right exit code,
no log output of distributed's, nothing left behind, and no hang on a cluster without
workers. The subprocess tests start a real local cluster of worker processes (a few s)."""

import logging
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from tests.builders import siblings
from tldp_cli.errors import InputError
from tldp_cli.run import dask_runner
from tldp_cli.run.pipeline import PerturbOptions, perturb

pytestmark = pytest.mark.dask

distributed = pytest.importorskip("distributed")
psutil = pytest.importorskip("psutil")  # a dependency of distributed


# Records of 4 floats in 0:1 keep raw values with probability above dp_delta, which needs consent
# (tests/privacy/test_raw_release.py); these tests are about Dask's failures, so every run gives it.
CONSENT = "--allow-raw-release"


def nan_input(tmp_path):
    src = tmp_path / "f.npy"
    values = np.zeros((100, 4), np.float32)
    values[77, 2] = np.nan
    np.save(src, values)
    return src


def tldp(*args):
    return subprocess.run([sys.executable, "-m", "tldp_cli", *map(str, args)], capture_output=True,
                          text=True, timeout=120, check=False)


def test_a_cluster_without_workers_fails_naming_it(tmp_path):
    """A scheduler with no worker would queue the blocks forever: one line, exit 1."""
    src = nan_input(tmp_path)
    with distributed.LocalCluster(n_workers=0, processes=False, protocol="tcp", host="127.0.0.1",
                                  dashboard_address="127.0.0.1:0") as empty:
        address = empty.scheduler_address
        script = textwrap.dedent(f"""
            import sys
            from tldp_cli import cli
            from tldp_cli.run import dask_runner
            dask_runner.WORKER_WAIT_SECONDS = 0.5
            sys.argv = ["tldp", "perturb", {str(src)!r}, "--eps", "1", "--range", "0:1", {CONSENT!r},
                        "--scheduler", "dask", "--dask-address", {address!r}]
            cli.main()
        """)
        result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                                check=False)
    assert result.returncode == 1 and len(result.stderr.splitlines()) == 1, result.stderr
    assert address in result.stderr and "no workers" in result.stderr
    assert siblings(tmp_path) == {"f.npy"}


def test_worker_errors_print_one_line_and_no_worker_log(tmp_path):
    """A NaN raised in a worker process: tldp's line only, not distributed's "Compute Failed"."""
    src = nan_input(tmp_path)
    result = tldp("perturb", src, "--eps", "1", "--range", "0:1", CONSENT, "--scheduler", "dask",
                  "--workers", "1")
    assert result.returncode == 1 and len(result.stderr.splitlines()) == 1, result.stderr  # tldp's line only
    assert result.stderr.startswith(f"tldp: error: {src}: NaN or Inf at record 77"), result.stderr
    assert siblings(tmp_path) == {"f.npy"}


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_interrupt_while_the_local_cluster_starts(tmp_path, signum):
    """Ctrl-C or SIGTERM while LocalCluster starts its workers: one line, exit 130, the
    workers stopped, and no traceback from distributed's exit hook."""
    src = tmp_path / "d.npy"
    np.save(src, np.zeros((64, 4), np.float32))
    run = subprocess.Popen([sys.executable, "-m", "tldp_cli", "perturb", str(src), "--eps", "1",
                            "--range", "0:1", CONSENT, "--scheduler", "dask", "--workers", "1"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    process = psutil.Process(run.pid)
    while not process.children() and run.poll() is None:  # the cluster is being built
        psutil.wait_procs([process], timeout=0.01)
    children = process.children(recursive=True) if run.poll() is None else []
    if not children:
        _, stderr = run.communicate(timeout=120)
        if run.returncode == 0:
            pytest.skip("the run finished before its cluster could be interrupted")
        pytest.fail(f"the run failed before it started a cluster (exit {run.returncode}): {stderr}")
    run.send_signal(signum)
    _, stderr = run.communicate(timeout=120)
    assert run.returncode == 130
    assert stderr == "tldp: error: interrupted; nothing was written\n"
    assert siblings(tmp_path) == {"d.npy"}
    _, alive = psutil.wait_procs(children, timeout=10)
    assert all(p.status() == psutil.STATUS_ZOMBIE for p in alive)


@pytest.mark.parametrize("settings, expected", [
    ({}, "tls:// needs Dask's TLS settings"),
    ({"DASK_DISTRIBUTED__COMM__TLS__CA_FILE": "missing-ca.pem",
      "DASK_DISTRIBUTED__COMM__TLS__CLIENT__CERT": "missing-cert.pem"}, "TLS settings"),
], ids=["no-tls-settings", "unloadable-tls-settings"])
def test_a_tls_address_without_usable_tls_settings_is_a_usage_error(tmp_path, settings, expected):
    """distributed finds out only while connecting (a traceback after 40 s, the Zarr partial
    left behind): refused at once from the options and Dask's settings, nothing written."""
    import os
    import time

    from tests.builders import make_zarr

    src, _ = make_zarr(tmp_path)
    config = tmp_path / "dask-config"  # no user or site Dask settings
    config.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("DASK_")}
    env.update(settings, DASK_CONFIG=str(config))
    started = time.monotonic()
    run = subprocess.run([sys.executable, "-m", "tldp_cli", "perturb", str(src), "--eps", "1",
                          "--scheduler", "dask", "--dask-address", "tls://127.0.0.1:9"],
                         capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert run.returncode == 2, run.stderr
    assert len(run.stderr.splitlines()) == 1 and expected in run.stderr, run.stderr
    assert run.stderr.startswith("tldp: error: --dask-address tls://127.0.0.1:9: ")
    assert time.monotonic() - started < 20
    assert siblings(tmp_path) == {"d.zarr", "dask-config"}


def test_an_unknown_scheme_is_a_usage_error(cli, tmp_path):
    np.save(tmp_path / "x.npy", np.zeros((4, 4), np.uint8))
    result = cli("perturb", tmp_path / "x.npy", "--eps", "1", "--scheduler", "dask",
                 "--dask-address", "tlss://127.0.0.1:9")
    assert result.exit_code == 2 and "Dask knows no scheme tlss://" in result.stderr, result.stderr
    assert siblings(tmp_path) == {"x.npy"}


@pytest.fixture(scope="module")
def cluster():
    with distributed.LocalCluster(processes=False, n_workers=1, threads_per_worker=1,
                                  dashboard_address="127.0.0.1:0") as local:
        yield local


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        self.records.append(record)


@pytest.mark.parametrize("show", [False, True], ids=["silenced", "dask-logs"])
def test_distributed_logs_only_with_dask_logs(tmp_path, cluster, show):
    """The in-process worker logs "Compute Failed" through this process's loggers: nothing
    reaches a handler unless dask_logs (--debug); the levels are restored after."""
    src = nan_input(tmp_path)
    seen = Records()
    logger = logging.getLogger("distributed")
    levels = {name: logging.getLogger(name).level for name in ("distributed", "distributed.client")}
    logger.addHandler(seen)
    try:
        with pytest.raises(InputError, match="NaN or Inf at record 77"):
            perturb(PerturbOptions(input=src, eps=1.0, value_range=(0, 1), out=tmp_path / "o.npy",
                                   scheduler="dask", dask_address=cluster.scheduler_address,
                                   dask_logs=show, allow_raw_release=True))
    finally:
        logger.removeHandler(seen)
    failed = [r for r in seen.records if "Compute Failed" in r.getMessage()]
    assert bool(failed) == show
    assert {name: logging.getLogger(name).level for name in levels} == levels


@pytest.mark.parametrize("command", [("perturb", "--eps", "1"), ("evaluate",)], ids=["perturb", "evaluate"])
def test_error_messages_are_one_line_even_with_a_newline_inside(cli, tmp_path, command):
    """An embedded message with newlines (a file name here; distributed's errors too)."""
    missing = tmp_path / "two\nlines.npy"
    np.save(tmp_path / "x.npy", np.zeros((2, 2)))
    args = (command[0], *((tmp_path / "x.npy",) if command[0] == "evaluate" else ()), missing, *command[1:])
    result = cli(*args)
    assert result.exit_code in (1, 2)
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "two lines.npy" in result.stderr


def test_the_worker_wait_is_documented(cli):
    result = cli("perturb", "--help")
    assert f"within {dask_runner.WORKER_WAIT_SECONDS} s" in " ".join(result.output.split())
