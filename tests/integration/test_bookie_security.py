"""Bookies that trust only the cluster: three real bookies serving TLS only
and authenticating their ledger clients (a token whose role is one of their
client roles, or a client certificate their CA signed, by its CN). A client
without credentials, with another role, or speaking plaintext is refused
before any add, read or fence; a broker reaches them over TLS with its own
certificate; ledger commands take a token and the CA."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import time
import uuid

import pytest
import trio

from broker.client import Client
from ledger_client.bookie_client import BookieClient, BookieConnectionError
from ledger_client.bookkeeper import BookKeeper
from security.certificates import SERVER_COMMON_NAME, write_tls_files
from security.credentials import ClientCredentials
from security.tls import client_context
from security.tokens import create_secret_key, create_token, write_key_file
from tests.integration.bookie_processes import BookieFactory
from tests.integration.broker_processes import BrokerFactory
from tests.integration.processes import print_logs
from tests.support import free_port, wait_until_async

pytestmark = pytest.mark.integration

OPS = "ops"


@pytest.fixture
def secure_bookies(zookeeper, tmp_path):
    root = f"/b-{uuid.uuid4().hex}"
    secret_key = create_secret_key()
    key_file = write_key_file(tmp_path / "secret.key", secret_key)
    tls = write_tls_files(tmp_path / "tls", hosts=["127.0.0.1", "localhost"], roles=[OPS, "eve"])
    factory = BookieFactory(zookeeper.address, root, tmp_path)
    broker_factory = BrokerFactory(zookeeper.address, root, tmp_path)

    def token(role: str) -> str:
        return create_token(role, secret_key=secret_key, now=time.time())

    ca = str(tls["ca.cert.pem"])
    ops_credentials = ClientCredentials(token(OPS), client_context(ca))

    async def start() -> None:
        for _ in range(3):
            bookie = factory.new(
                "--auth-token-secret-key", str(key_file), "--client-roles", f"{OPS},{SERVER_COMMON_NAME}",
                "--tls-cert-file", str(tls["server.cert.pem"]), "--tls-key-file", str(tls["server.key.pem"]),
                "--tls-trust-certs-file", ca, "--tls-handshake-timeout", "2s")
            bookie.credentials = ops_credentials
            await bookie.started()

    try:
        trio.run(start)
        yield {"root": root, "zk": zookeeper.address, "token": token, "tls": tls, "ca": ca, "bookies": factory.created,
               "brokers": broker_factory, "ops": ops_credentials}
    finally:
        broker_factory.stop_all()
        factory.stop_all()
        print_logs(factory.created + broker_factory.created)


async def test_bookies_refuse_ledger_clients_outside_their_client_roles(secure_bookies):
    address = secure_bookies["bookies"][0].address
    context = client_context(secure_bookies["ca"])
    refused = {
        "no credentials": ClientCredentials(tls_context=context),
        "another role": ClientCredentials(secure_bookies["token"]("eve"), context),
        "a garbage token": ClientCredentials("not-a-token", context),
        "another role's certificate": ClientCredentials(tls_context=client_context(
            secure_bookies["ca"], cert_file=secure_bookies["tls"]["eve.cert.pem"], key_file=secure_bookies["tls"]["eve.key.pem"])),
    }
    for what, credentials in refused.items():
        with pytest.raises(BookieConnectionError, match="refused this client"), trio.fail_after(10):
            async with BookieClient.connect(address, credentials=credentials):
                pass
        assert what  # (named for the failure message)
    # Plaintext to a bookie that serves TLS only: the handshake fails, the bookie serves on.
    with pytest.raises(BookieConnectionError), trio.fail_after(10):
        async with BookieClient.connect(address, credentials=ClientCredentials(secure_bookies["token"](OPS))) as client:
            await client.get_info()
    bookie = secure_bookies["bookies"][0]
    await wait_until_async(lambda: "refusing TLS connection from 127.0.0.1:" in bookie.log_path.read_text(errors="replace"),
                           deadline_s=10, what="the bookie logging the TLS refusal")  # logged as it closes the connection
    # The first refusal is logged with its reason (the next ones within a
    # second are counted, not logged: a client retrying must not flood the log).
    log = bookie.log_path.read_text(errors="replace")
    assert "refusing ledger client 127.0.0.1:" in log and "needs credentials" in log
    # A ledger client with a granted token, or a certificate whose CN is a client role, writes and reads.
    for credentials in (secure_bookies["ops"], ClientCredentials(tls_context=client_context(
            secure_bookies["ca"], cert_file=secure_bookies["tls"]["ops.cert.pem"], key_file=secure_bookies["tls"]["ops.key.pem"]))):
        async with BookKeeper.connect(secure_bookies["zk"], secure_bookies["root"], credentials=credentials) as bk:
            lh = await bk.create_ledger(3, 3, 2, password=b"pw")
            for index in range(5):
                await lh.add(b"entry-%d" % index)
            await lh.close()
            reader = await bk.open_ledger(lh.ledger_id, password=b"pw")
            assert [entry.data async for entry in reader.read(0, 4)] == [b"entry-%d" % index for index in range(5)]


async def test_a_broker_reaches_tls_bookies_with_its_certificate_and_commands_take_a_token(secure_bookies, tmp_path):
    tls = secure_bookies["tls"]
    tls_port = free_port()
    broker = await secure_bookies["brokers"].started(
        "--tls-cert-file", str(tls["server.cert.pem"]), "--tls-key-file", str(tls["server.key.pem"]),
        "--tls-trust-certs-file", secure_bookies["ca"], "--tls-port", str(tls_port), "--superuser-roles", OPS)
    ops_context = client_context(secure_bookies["ca"], cert_file=tls["ops.cert.pem"], key_file=tls["ops.key.pem"])
    async with Client.connect(secure_bookies["zk"], secure_bookies["root"], tls_context=ops_context) as client:
        producer = await client.create_producer("through-tls-bookies", "p")
        for index in range(10):
            await producer.send(b"m%d" % index)
        reader = await client.create_reader("through-tls-bookies", start="earliest")
        assert [(await reader.receive()).data for _ in range(10)] == [b"m%d" % index for index in range(10)]
        await client.unload("through-tls-bookies")  # its ledger closed, for the export
    assert broker.running
    # The Spark export's executors show the token and trust the CA.
    out = tmp_path / "export"
    exported = await trio.to_thread.run_sync(lambda: subprocess.run(
        [sys.executable, "-m", "quire", "export", "through-tls-bookies", "--zk", secure_bookies["zk"], "--root",
         secure_bookies["root"], "--out", str(out), "--format", "json", "--auth-token", secure_bookies["token"](OPS),
         "--tls-trust-certs-file", secure_bookies["ca"]], capture_output=True, text=True, timeout=300))
    assert exported.returncode == 0, exported.stderr[-3000:]
    rows = [json.loads(line) for path in out.glob("*.json") for line in path.read_text().splitlines()]
    assert sorted(base64.b64decode(row["payload"]) for row in rows) == sorted(b"m%d" % index for index in range(10))

    def ledger_create(*credentials: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "quire", "ledger", "create", "--entries", "3", "--zk", secure_bookies["zk"],
                               "--root", secure_bookies["root"], *credentials], capture_output=True, text=True, timeout=120)

    refused = await trio.to_thread.run_sync(ledger_create, "--tls-trust-certs-file", secure_bookies["ca"])
    assert refused.returncode != 0 and "refused this client" in refused.stderr, refused.stderr
    created = await trio.to_thread.run_sync(ledger_create, "--tls-trust-certs-file", secure_bookies["ca"],
                                            "--auth-token", secure_bookies["token"](OPS))
    assert created.returncode == 0, created.stderr
