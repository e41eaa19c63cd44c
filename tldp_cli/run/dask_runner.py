"""Runs the per-block function on Dask (perturb --scheduler dask).

The function and its arguments are pickled to the workers: the array jobs' readers
open their files inside each call, and so do the writers' block writers (see
formats/__init__.py). Blocks whose format has no block writer come back and are
written in this process. At most two blocks per worker thread are in flight, so
memory stays flat on both sides.

The per-block function carries the run's random-stream root key (derived from the
seed when there is one): it travels in the cluster's comms, never in a task key,
log line or repr. The local cluster (no --dask-address) talks TLS with credentials made
for the run and held in memory only, so no other client can join it: another local
user could otherwise run code in its workers or read the key from the tasks. Use TLS
(tls:// addresses, Dask's own TLS settings) for a cluster on other machines.

distributed's own log output (worker errors, lost connections) is silenced for the
run, in this process and in a local cluster's workers: tldp's errors say what went
wrong in one line. `show_logs` (the CLI's --debug) keeps it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import signal
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from tldp_cli.errors import MissingExtra, TldpError, UsageError, reason_of

# How long a failed run waits for the blocks a cluster is still running, so none writes
# into an output that is being removed.
DRAIN_SECONDS = 60
# How long a run on an existing cluster waits for its first worker before failing (a
# scheduler with no workers would otherwise queue the blocks forever).
WORKER_WAIT_SECONDS = 30
# Loggers that print on stderr during a run (distributed installs its own handlers).
_LOGGERS = ("distributed", "tornado", "bokeh")
_LOOPBACK = ("127.", "localhost", "[::1]", "::1")
TLS_SETTINGS = "distributed.comm.tls.ca-file, .client.cert and .client.key"


class ClusterError(TldpError):
    """The Dask cluster could not be reached or lost the run's work."""


def require() -> None:
    try:
        import distributed  # noqa: F401
    except ImportError:
        raise MissingExtra("--scheduler dask", "Dask", "dask") from None


def parse_address(text: str) -> str:
    """HOST:PORT (TCP) or a Dask URI (tcp://, tls://, inproc://...) -> a Dask address."""
    if "://" in text:
        return text
    if not re.fullmatch(r"(\[[0-9A-Fa-f:.]+\]|[^\s:/\[\]]+):\d{1,5}", text):
        raise UsageError(f"--dask-address must be HOST:PORT (or tls://HOST:PORT), not {text!r}")
    return "tcp://" + text


def check_address(address: str) -> None:
    """Refuses, before any connection, what distributed would find out only while connecting
    (after a timeout, with a traceback): a scheme it does not know, and tls:// (or wss://)
    without Dask's TLS settings or with settings it cannot load."""
    from distributed.comm.registry import get_backend
    from distributed.security import Security

    scheme = address.partition("://")[0]
    try:
        get_backend(scheme)
    except ValueError:
        raise UsageError(f"--dask-address {address}: Dask knows no scheme {scheme}://; give HOST:PORT "
                         "or tls://HOST:PORT") from None
    if scheme not in ("tls", "wss"):
        return
    try:
        context = Security().get_connection_args("client").get("ssl_context")
    except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
        raise UsageError(f"--dask-address {address}: Dask's TLS settings ({TLS_SETTINGS}) cannot be "
                         f"loaded ({reason_of(exc)})") from None
    if context is None:
        raise UsageError(f"--dask-address {address}: {scheme}:// needs Dask's TLS settings, the CA file and "
                         f"this client's certificate and key ({TLS_SETTINGS}, in Dask's configuration or "
                         "its DASK_DISTRIBUTED__COMM__TLS__... variables); they are not all set")


def plain_remote(address: str) -> bool:
    """A TCP address on another machine: its comms are unencrypted."""
    scheme, _, host = address.partition("://")
    return scheme == "tcp" and not host.startswith(_LOOPBACK)


@contextlib.contextmanager
def quiet_logs(show: bool = False) -> Iterator[None]:
    """Silence distributed's loggers (and tornado's, bokeh's) in this process while the
    block runs, unless `show`; their levels are restored after."""
    if show:
        yield
        return
    names = [name for name in list(logging.root.manager.loggerDict)
             if name.split(".")[0] in _LOGGERS] + list(_LOGGERS)
    loggers = {name: logging.getLogger(name) for name in names}
    levels = {name: logger.level for name, logger in loggers.items()}
    for logger in loggers.values():
        logger.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        for name, logger in loggers.items():
            logger.setLevel(levels[name])


@contextlib.contextmanager
def _signals_deferred() -> Iterator[Callable[[], bool]]:
    """Ctrl-C and SIGTERM wait for the block to end; the callable says whether one came.

    An interruption inside LocalCluster's constructor leaves a half-built cluster that
    distributed's exit hook then fails to close, with a traceback."""
    received: list[int] = []
    previous: dict[signal.Signals, Any] = {}
    try:
        for signum in (signal.SIGINT, signal.SIGTERM):
            previous[signum] = signal.signal(signum, lambda number, frame: received.append(number))
    except ValueError:  # not the main thread: signals are not ours to handle
        pass
    try:
        yield lambda: bool(received)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)


def _close(client, cluster) -> None:
    if client is not None:
        client.close()
    if cluster is not None:
        cluster.close()


def _run_credentials():
    """Temporary TLS credentials (a self-signed key and certificate, in memory) that the
    local cluster's scheduler, workers and tldp's client share, and nobody else has."""
    from distributed.security import Security

    try:
        return Security.temporary()
    except ImportError:
        raise MissingExtra("--scheduler dask without --dask-address (its local cluster's TLS credentials)",
                           "the cryptography package", "dask") from None


@contextlib.contextmanager
def connect(address: str | None, workers: int, show_logs: bool = False) -> Iterator[Any]:
    """A client of the cluster at `address`, or of a local cluster of `workers` processes
    that only holders of the run's TLS credentials can join.

    An existing cluster must have a worker within WORKER_WAIT_SECONDS."""
    import dask
    from distributed import Client, LocalCluster

    cluster = client = None
    where = f"the Dask scheduler at {address}" if address else "a local Dask cluster"
    security = _run_credentials() if address is None else None
    try:
        if address is None:
            # The scheduler's HTTP server is plain HTTP that anyone on the machine can read:
            # no dashboard and no status pages (workers, logs, call stacks), only /health.
            private_http = {"distributed.scheduler.http.routes": ["distributed.http.health"]}
            with _signals_deferred() as interrupted, dask.config.set(private_http):
                cluster = LocalCluster(n_workers=workers, threads_per_worker=1, processes=True,
                                       host="127.0.0.1", protocol="tls://", security=security,
                                       dashboard_address="127.0.0.1:0",
                                       scheduler_kwargs={"dashboard": False},
                                       silence_logs=False if show_logs else logging.CRITICAL + 1)
                client = Client(cluster, security=security, set_as_default=False)
            if interrupted():
                raise KeyboardInterrupt
        else:
            client = Client(address, timeout="20s", set_as_default=False)
            try:
                client.wait_for_workers(1, timeout=WORKER_WAIT_SECONDS)
            except TimeoutError:
                raise ClusterError(f"{where} has no workers: none joined within "
                                   f"{WORKER_WAIT_SECONDS:g} s") from None
    except (OSError, TimeoutError) as exc:
        _close(client, cluster)
        raise ClusterError(f"cannot reach {where} ({reason_of(exc)})") from None
    except BaseException:
        _close(client, cluster)
        raise
    try:
        yield client
    finally:
        _close(client, cluster)


def _missing(paths: list[str]) -> list[str]:
    return [p for p in paths if not os.path.exists(p)]


def check_visible(client, paths: Iterable[str]) -> tuple[str, str] | None:
    """The first (path, worker) where a worker cannot see a path the run needs, or None."""
    paths = list(paths)
    for worker, missing in sorted(client.run(_missing, paths).items()):
        if missing:
            return missing[0], worker
    return None


def run(client, fn: Callable, tasks: list[tuple], count_only: Callable[[], bool],
        local: bool) -> Iterator[tuple[tuple, Any]]:
    """Run fn(*task, count_only()) for every task on the cluster, yielding (task, result)
    as each finishes (in any order; the output does not depend on it)."""
    from distributed import KilledWorker, as_completed, wait
    from distributed.client import FutureCancelledError
    from distributed.comm import CommClosedError

    # Random keys: dask would otherwise name a task by a hash of its arguments, and
    # those hold the stream key (a hash of the seed would confirm guesses).
    run_id = secrets.token_hex(8)
    limit = max(2, 2 * sum(client.nthreads().values()))
    queue = iter(enumerate(tasks))
    meta: dict[Any, tuple] = {}
    finished = as_completed(loop=client.loop)

    def submit() -> None:
        for index, task in queue:
            future = client.submit(fn, *task, count_only(), key=f"tldp-block-{run_id}-{index}",
                                   pure=False)
            meta[future] = task
            finished.add(future)
            return

    ok = False
    try:
        for _ in range(limit):
            submit()
        for future in finished:
            task = meta.pop(future)
            result = future.result()
            submit()
            yield task, result
        ok = True
    except (KilledWorker, CommClosedError, FutureCancelledError) as exc:
        raise ClusterError(f"the Dask cluster lost the run's work ({type(exc).__name__}: {exc})") from None
    finally:
        if not ok and meta:
            pending = list(meta)
            if not local:
                # Blocks already running cannot be stopped; let them end before the
                # output they write into is removed.
                with contextlib.suppress(Exception):
                    wait(pending, timeout=DRAIN_SECONDS)
            client.cancel(pending)
