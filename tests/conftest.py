import os
import signal

import numpy as np
import pytest

from tests.builders import REPO, Cli, validate_manifest

# Ctrl-C is part of what the tests check. A shell starts a background job (`cmd &`) with
# SIGINT ignored, which Python and the tldp processes the tests start then keep: the
# tests take the handler an interactive run has.
signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_collection_modifyitems(config, items):
    """Run on several workers (pytest-xdist's -n, as .ci/run does), the tests marked slow or
    dask go first, in their order, and the quick ones after them: the workers share out the
    long tests while the queue is long and end on short ones together, instead of one worker
    running the last slow ones (the reproduction runs, top-level tests/ comes last) while
    the other waits. One run, every worker sorts the same collection the same way."""
    if hasattr(config, "workerinput"):  # an xdist worker
        items.sort(key=lambda item: item.get_closest_marker("slow") is None
                   and item.get_closest_marker("dask") is None)


@pytest.fixture
def cli():
    return Cli()


@pytest.fixture(autouse=True)
def _no_seed_from_the_environment(monkeypatch):
    """A TLDP_SEED exported in the shell that runs the tests would seed every run."""
    monkeypatch.delenv("TLDP_SEED", raising=False)


@pytest.fixture
def direct_opens(monkeypatch):
    """The files opened with O_DIRECT (the real calls still run)."""
    opened = []
    real_open = os.open

    def spy(path, flags, *args, **kwargs):
        if flags & getattr(os, "O_DIRECT", 0):
            opened.append(path)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", spy)
    return opened


@pytest.fixture(scope="session")
def digits() -> np.ndarray:
    return np.load(REPO / "sample_data" / "digits.npy")


@pytest.fixture(autouse=True)
def _manifests_follow_the_published_schema(request):
    """Every manifest a test leaves in its tmp_path validates against docs/manifest.schema.json
    (tests that write broken manifests on purpose are marked damaged_manifests)."""
    yield
    tmp_path = request.node.funcargs.get("tmp_path")
    if tmp_path is None or request.node.get_closest_marker("damaged_manifests"):
        return
    import json

    for path in tmp_path.rglob("*.json"):
        try:
            manifest = json.loads(path.read_text())
        except (ValueError, UnicodeDecodeError, OSError, RecursionError):  # deep JSON: a test input
            continue
        if isinstance(manifest, dict) and manifest.get("schema") == "tldp-manifest/1":
            validate_manifest(manifest)


@pytest.fixture
def alarm():
    """Fails a test whose open or read blocks (a FIFO opened to read waits for a writer)
    instead of hanging the test run."""
    def expired(*_):
        raise TimeoutError("blocked on a FIFO")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(20)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)
