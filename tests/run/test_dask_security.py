"""The local Dask cluster (--scheduler dask without --dask-address) is private to the run:
it speaks TLS with the run's temporary credentials only, so another local user cannot join
it, run code in its workers or read its tasks (they carry the secret noise key).

One local cluster of worker processes, started the way tldp starts it, serves the module
(about 1 s); every refused connection must fail within a few seconds."""

import ssl
import sys
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

from tests.builders import assert_one_line_error, make_npy
from tldp_cli.errors import MissingExtra
from tldp_cli.run import dask_runner

distributed = pytest.importorskip("distributed")
pytest.importorskip("cryptography")

from distributed.comm import connect as comm_connect  # noqa: E402
from distributed.security import Security  # noqa: E402

pytestmark = pytest.mark.dask

TIMEOUT_SECONDS = 3
# A refused client fails within its own timeout, not after a hang (with room for a loaded machine).
QUICK_SECONDS = TIMEOUT_SECONDS + 20


@pytest.fixture(scope="module")
def client():
    with dask_runner.quiet_logs(), dask_runner.connect(None, 1) as run_client:
        yield run_client


def listening_addresses(client) -> list[str]:
    """The scheduler's, every worker's and every nanny's comm address."""
    info = client.scheduler_info()
    return [client.scheduler.address, *info["workers"],
            *(worker["nanny"] for worker in info["workers"].values())]


def fails_quickly(attempt) -> BaseException:
    started = time.monotonic()
    with dask_runner.quiet_logs(), pytest.raises(Exception) as failure:
        attempt()
    assert time.monotonic() - started < QUICK_SECONDS
    return failure.value


def test_the_run_can_use_its_own_cluster(client):
    assert client.submit(sum, [1, 2, 3], pure=False).result(timeout=30) == 6


def test_every_listener_speaks_tls_on_loopback(client):
    addresses = listening_addresses(client)
    assert len(addresses) == 3
    assert all(address.startswith("tls://127.0.0.1:") for address in addresses), addresses


def test_a_plain_client_cannot_connect(client):
    address = client.scheduler.address
    fails_quickly(lambda: distributed.Client(address, timeout=f"{TIMEOUT_SECONDS}s",
                                             set_as_default=False).close())


def test_a_client_with_other_temporary_credentials_cannot_connect(client):
    address = client.scheduler.address
    error = fails_quickly(lambda: distributed.Client(address, timeout=f"{TIMEOUT_SECONDS}s",
                                                     security=Security.temporary(),
                                                     set_as_default=False).close())
    assert isinstance(error, OSError)


def own_certificate_context(verify_server: bool = False) -> ssl.SSLContext:
    """TLS as another user could set it up: its own self-signed certificate, trusting any server."""
    stranger = Security.temporary().get_connection_args("client")["ssl_context"]
    if not verify_server:
        stranger.check_hostname = False
        stranger.verify_mode = ssl.CERT_NONE
    return stranger


@pytest.mark.parametrize("certificate", [True, False], ids=["own-certificate", "no-certificate"])
def test_the_servers_refuse_a_client_they_did_not_certify(client, certificate):
    """The client side accepts anything here: the refusal must come from tldp's cluster."""
    if certificate:
        context = own_certificate_context()
    else:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE

    async def identity(address):
        comm = await comm_connect(address, timeout=TIMEOUT_SECONDS, ssl_context=context)
        try:
            await comm.write({"op": "identity", "reply": True})
            return await comm.read()
        finally:
            await comm.close()

    for address in listening_addresses(client):
        error = fails_quickly(lambda: client.sync(identity, address))
        assert isinstance(error, OSError), (address, error)


def test_plain_tcp_to_the_cluster_is_refused(client):
    for address in listening_addresses(client):
        tcp_address = "tcp://" + address.split("://", 1)[1]
        error = fails_quickly(lambda: distributed.Client(tcp_address, timeout=f"{TIMEOUT_SECONDS}s",
                                                         set_as_default=False).close())
        assert isinstance(error, OSError), (tcp_address, error)


def test_the_scheduler_http_server_shows_nothing_but_health(client):
    port = client.scheduler_info()["services"]["dashboard"]
    base = f"http://127.0.0.1:{port}"
    with urllib.request.urlopen(f"{base}/health", timeout=TIMEOUT_SECONDS) as health:
        assert health.read() == b"ok"
    for page in ("/info/main/workers.html", "/json/identity.json", "/metrics", "/status"):
        with pytest.raises(urllib.error.HTTPError) as missing:
            urllib.request.urlopen(base + page, timeout=TIMEOUT_SECONDS)
        missing.value.close()
        assert missing.value.code == 404, page


def test_without_cryptography_there_is_no_unauthenticated_fallback(monkeypatch):
    monkeypatch.setitem(sys.modules, "cryptography", None)  # makes `import cryptography` fail
    started = []
    monkeypatch.setattr(distributed, "LocalCluster", lambda *a, **k: started.append(k))
    with pytest.raises(MissingExtra) as failure, dask_runner.connect(None, 1):
        pass
    assert started == []
    assert str(failure.value) == ("--scheduler dask without --dask-address (its local cluster's TLS "
                                  "credentials) needs the cryptography package, an optional extra: "
                                  "pip install 'tldp-tensors[dask]'")


def test_without_cryptography_the_cli_says_what_to_install(cli, tmp_path, monkeypatch):
    src, _ = make_npy(tmp_path)
    monkeypatch.setitem(sys.modules, "cryptography", None)
    result = cli("perturb", src, "--eps", "1", "--scheduler", "dask", "--workers", "1")
    assert_one_line_error(result, 1, "cryptography", "pip install 'tldp-tensors[dask]'")  # the wording: above
    assert sorted(p.name for p in tmp_path.iterdir()) == [src.name]


def test_the_noise_is_the_same_on_the_private_cluster(cli, tmp_path):
    """End to end through the CLI: TLS changes the transport, never the output."""
    src, read = make_npy(tmp_path)
    for name, more in (("threads", ()), ("dask", ("--scheduler", "dask", "--workers", "1"))):
        result = cli("perturb", src, "--eps", "1", "--seed", "4", "--allow-weak-seed",
                     "--out", tmp_path / f"{name}.npy", "--block-elements", "640", *more)
        assert result.exit_code == 0, result.stderr
    np.testing.assert_array_equal(read(tmp_path / "threads.npy"), read(tmp_path / "dask.npy"))
