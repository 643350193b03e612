"""Token authentication and namespace grants on real brokers (3 bookies,
ZooKeeper), through the official Pulsar client and quire's own: clients
without a good token are refused, a role produces and consumes only where
it is granted, only admins delete, and a connection outlives its first
token by answering the broker's AUTH_CHALLENGE with a fresh one."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from dataclasses import dataclass

import pulsar
import pytest
import trio

from broker.client import Client
from broker.errors import AuthenticationError, AuthorizationError
from security.certificates import write_tls_files
from security.tokens import create_key_pair, create_secret_key, create_token, write_key_file
from tests.integration.bookie_processes import BookieFactory
from tests.integration.broker_processes import BrokerFactory
from tests.integration.processes import print_logs
from tests.support import free_ports, wait_until_async

pytestmark = pytest.mark.integration

ADMIN, ALICE, BOB = "admin", "alice", "bob"
NAMESPACE = "acme/payments"
KEEPALIVE_INTERVAL_S = 2  # the broker checks tokens' expiry a few times per interval


@dataclass
class SecureCluster:
    zk_hosts: str
    root: str
    secret_key: bytes
    broker: object
    tls_files: dict
    tls_port: int
    pulsar_tls_port: int
    metrics_port: int
    web_tls_port: int

    def metric(self, name: str) -> float:
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as response:
            for line in response.read().decode().splitlines():
                if line.startswith(name + " "):
                    return float(line.split()[1])
        raise AssertionError(f"no metric {name}")

    @property
    def pulsar_tls_url(self) -> str:
        return f"pulsar+ssl://127.0.0.1:{self.pulsar_tls_port}"

    def tls_context(self, role: str | None = None):
        from security.tls import client_context

        if role is None:
            return client_context(self.tls_files["ca.cert.pem"])
        return client_context(self.tls_files["ca.cert.pem"], cert_file=self.tls_files[f"{role}.cert.pem"],
                              key_file=self.tls_files[f"{role}.key.pem"])

    def token(self, role: str, expiry_s: float | None = None, *, key: bytes | None = None) -> str:
        return create_token(role, secret_key=key or self.secret_key, now=time.time(), expiry_s=expiry_s)

    @property
    def pulsar_url(self) -> str:
        return self.broker.pulsar_url


@pytest.fixture(scope="module")
def secure_cluster(zookeeper, tmp_path_factory):
    """Three bookies and a broker that authenticates by tokens signed with
    a secret key, and by client certificates its CA signed, on plaintext and
    TLS listeners of both protocols; `admin` is a superuser; tenant acme
    (admin role `acme-admin`) has the namespace acme/payments, where bob
    has no grant."""
    root = f"/m-{uuid.uuid4().hex}"
    base = tmp_path_factory.mktemp("secure")
    secret_key = create_secret_key()
    key_file = write_key_file(base / "secret.key", secret_key)
    tls_files = write_tls_files(base / "tls", hosts=["127.0.0.1", "localhost"], roles=["svc", "stranger"])
    bookie_factory = BookieFactory(zookeeper.address, root, base)
    broker_factory = BrokerFactory(zookeeper.address, root, base)
    cluster = SecureCluster(zookeeper.address, root, secret_key, None, tls_files, *free_ports(4))

    async def start() -> None:
        for _ in range(3):
            await bookie_factory.started()
        cluster.broker = await broker_factory.started(
            "--auth-token-secret-key", str(key_file), "--superuser-roles", ADMIN,
            "--keepalive-interval", f"{KEEPALIVE_INTERVAL_S}s",
            "--tls-cert-file", str(tls_files["server.cert.pem"]), "--tls-key-file", str(tls_files["server.key.pem"]),
            "--tls-trust-certs-file", str(tls_files["ca.cert.pem"]), "--tls-port", str(cluster.tls_port),
            "--pulsar-tls-port", str(cluster.pulsar_tls_port), "--tls-handshake-timeout", "2s",
            "--metrics-port", str(cluster.metrics_port), "--web-tls-port", str(cluster.web_tls_port))
        async with Client.connect(cluster.zk_hosts, root, auth_token=cluster.token(ADMIN)) as admin:
            await admin.create_tenant("acme", admin_roles=["acme-admin"])
            await admin.create_namespace(NAMESPACE)
            await admin.grant_permission(NAMESPACE, "svc", ["produce", "consume"])

    try:
        trio.run(start)
        yield cluster
    finally:
        broker_factory.stop_all()
        bookie_factory.stop_all()
        print_logs(broker_factory.created)


def pulsar_client(cluster: SecureCluster, token=None, *, operation_timeout_s: int = 10, tls: bool = False) -> pulsar.Client:
    authentication = None if token is None else pulsar.AuthenticationToken(token)
    over_tls = {"tls_trust_certs_file_path": str(cluster.tls_files["ca.cert.pem"])} if tls else {}
    return pulsar.Client(cluster.pulsar_tls_url if tls else cluster.pulsar_url, authentication=authentication,
                         operation_timeout_seconds=operation_timeout_s, io_threads=1, message_listener_threads=1,
                         logger=pulsar.ConsoleLogger(pulsar.LoggerLevel.Error), **over_tls)


def pulsar_refusal(cluster: SecureCluster, token, topic: str, *, operation_timeout_s: int = 10,
                   tls: bool = False) -> Exception | None:
    """What creating a producer raises (None if it works)."""
    client = pulsar_client(cluster, token, operation_timeout_s=operation_timeout_s, tls=tls)
    try:
        client.create_producer(topic, send_timeout_millis=5_000)
        return None
    except Exception as error:  # noqa: BLE001 (which error is what the test checks)
        return error
    finally:
        client.close()


@pytest.mark.parametrize("tls", [False, True], ids=["pulsar", "pulsar+ssl"])
async def test_pulsar_clients_without_a_good_token_are_refused(secure_cluster, tls):
    # The broker answers a refused CONNECT with an ERROR (AuthenticationError)
    # and closes the connection, as Pulsar's does; the C++ client reports
    # that as a failed connection and gives up at its operation timeout.
    # The broker logs why, with the peer's address, never the token.
    topic = f"persistent://{NAMESPACE}/refused"
    private_key, _ = create_key_pair()
    tokens = {
        "no token": (None, "needs credentials"),
        "garbage": ("not.a.token", "malformed"),
        "expired": (create_token(ADMIN, secret_key=secure_cluster.secret_key, now=time.time() - 3600, expiry_s=60), "expired"),
        "wrong key": (secure_cluster.token(ADMIN, key=create_secret_key()), "signature"),
        "another algorithm": (create_token(ADMIN, private_key=private_key, now=time.time()), "algorithm"),
    }
    for what, (token, reason) in tokens.items():
        before = secure_cluster.broker.log_path.read_text(errors="replace")
        error = await trio.to_thread.run_sync(lambda: pulsar_refusal(secure_cluster, token, topic, operation_timeout_s=3, tls=tls))
        assert error is not None, f"{what}: a producer was created"
        refusals = secure_cluster.broker.log_path.read_text(errors="replace")[len(before):]
        assert "refused Pulsar connection from 127.0.0.1:" in refusals and reason in refusals.lower(), f"{what}:\n{refusals}"
        if token:
            assert token not in refusals
    # The broker kept serving.
    assert await trio.to_thread.run_sync(lambda: pulsar_refusal(secure_cluster, secure_cluster.token(ADMIN), topic,
                                                                tls=tls)) is None


async def test_a_role_produces_and_consumes_only_where_it_is_granted(secure_cluster):
    topic = f"persistent://{NAMESPACE}/granted"
    async with Client.connect(secure_cluster.zk_hosts, secure_cluster.root, auth_token=secure_cluster.token("acme-admin")) as tenant_admin:
        await tenant_admin.grant_permission(NAMESPACE, "carol", ["produce", "consume"])
        assert (await tenant_admin.permissions(NAMESPACE))["carol"] == ["consume", "produce"]

    def run() -> None:
        refused = pulsar_refusal(secure_cluster, secure_cluster.token(BOB), topic)
        assert isinstance(refused, pulsar.AuthorizationError), repr(refused)
        client = pulsar_client(secure_cluster, secure_cluster.token("carol"))
        try:
            # The topic does not exist: a first subscribe makes it, with the grant only.
            consumer = client.subscribe(topic, "carol-sub", initial_position=pulsar.InitialPosition.Earliest)
            producer = client.create_producer(topic)
            for index in range(20):
                producer.send(b"m%d" % index)
            received = [consumer.receive(10_000).data() for _ in range(20)]
            assert received == [b"m%d" % index for index in range(20)]
        finally:
            client.close()

    await trio.to_thread.run_sync(run)


async def test_only_admins_delete_topics_and_a_refused_delete_changes_nothing(secure_cluster):
    topic = f"{NAMESPACE}/kept"
    async with Client.connect(secure_cluster.zk_hosts, secure_cluster.root, auth_token=secure_cluster.token(ADMIN)) as admin:
        await admin.create_topic(topic, partitions=2)
        await admin.grant_permission(NAMESPACE, "dave", ["produce"])
    async with Client.connect(secure_cluster.zk_hosts, secure_cluster.root, auth_token=secure_cluster.token("dave")) as dave:
        producer = await dave.create_producer(topic, "dave")
        await producer.send(b"stays")
        with pytest.raises(AuthorizationError):
            await dave.delete_topic(topic)
        with pytest.raises(AuthorizationError):
            await dave.create_namespace("acme/other")
    with pytest.raises(AuthenticationError):
        async with Client.connect(secure_cluster.zk_hosts, secure_cluster.root) as anonymous:
            await anonymous.delete_topic(topic)
    # The CLI says the same, in one line, exit 2.
    result = subprocess.run([sys.executable, "-m", "quire", "topic", "delete", topic, "--zk", secure_cluster.zk_hosts,
                             "--root", secure_cluster.root, "--auth-token", secure_cluster.token(BOB)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "AuthorizationError" in result.stderr, result.stderr
    async with Client.connect(secure_cluster.zk_hosts, secure_cluster.root, auth_token=secure_cluster.token(ADMIN)) as admin:
        assert {"topic": topic, "partitions": 2} in await admin.list_topics(NAMESPACE)
        stats = await admin.topic_stats(topic)
        assert sum(partition["next_offset"] for partition in stats["partitions"].values()) == 1
        await admin.delete_topic(topic)
        assert await admin.list_topics(NAMESPACE) == [] or all(t["topic"] != topic for t in await admin.list_topics(NAMESPACE))


async def test_a_connection_outlives_its_first_token_by_answering_the_challenge(secure_cluster):
    # Each token lasts 3 s; the client's supplier makes a fresh one each
    # time it is asked. Messages sent over 10 s all arrive, on connections
    # the broker challenged and kept.
    topic = f"persistent://{NAMESPACE}/refreshed"
    issued = []

    def supplier() -> str:
        issued.append(time.time())
        return secure_cluster.token(ADMIN, expiry_s=3)

    def run() -> None:
        client = pulsar_client(secure_cluster, supplier)
        try:
            consumer = client.subscribe(topic, "refresh", initial_position=pulsar.InitialPosition.Earliest)
            producer = client.create_producer(topic)
            deadline = time.monotonic() + 10
            sent = 0
            while time.monotonic() < deadline:
                producer.send(b"%d" % sent)
                sent += 1
                time.sleep(0.2)  # pacing: the sends span several tokens' lifetimes
            received = [consumer.receive(10_000).data() for _ in range(sent)]
            assert received == [b"%d" % index for index in range(sent)]
        finally:
            client.close()

    await trio.to_thread.run_sync(run)
    assert len(issued) >= 3, issued  # asked again after the first token expired


async def test_quire_clients_authenticate_with_tokens_and_are_refused_without(secure_cluster):
    topic = "quire-client-topic"  # public/default: only superusers and grants
    async with Client.connect(secure_cluster.zk_hosts, secure_cluster.root, auth_token=secure_cluster.token(ADMIN)) as admin:
        producer = await admin.create_producer(topic, "admin")
        await producer.send(b"hello")
    with pytest.raises(AuthenticationError, match="refused"):
        async with Client.connect(secure_cluster.zk_hosts, secure_cluster.root, auth_token="garbage") as client:
            await client.list_topics()
    async with Client.connect(secure_cluster.zk_hosts, secure_cluster.root, auth_token=secure_cluster.token(BOB)) as bob:
        with pytest.raises(AuthorizationError):
            await bob.create_producer(topic, "bob")
        assert await bob.list_topics() == []  # bob may see nothing


def pulsar_round_trip(url: str, topic: str, count: int, **client_options) -> list[bytes]:
    client = pulsar.Client(url, operation_timeout_seconds=10, io_threads=1, message_listener_threads=1,
                           logger=pulsar.ConsoleLogger(pulsar.LoggerLevel.Error), **client_options)
    try:
        consumer = client.subscribe(topic, "tls", initial_position=pulsar.InitialPosition.Earliest)
        producer = client.create_producer(topic)
        for index in range(count):
            producer.send(b"tls-%d" % index)
        return [consumer.receive(10_000).data() for _ in range(count)]
    finally:
        client.close()


async def test_pulsar_clients_produce_and_consume_over_tls_with_a_token_or_a_client_certificate(secure_cluster):
    expected = [b"tls-%d" % index for index in range(10)]
    trust = str(secure_cluster.tls_files["ca.cert.pem"])
    by_token = await trio.to_thread.run_sync(lambda: pulsar_round_trip(
        secure_cluster.pulsar_tls_url, f"persistent://{NAMESPACE}/over-tls", 10, tls_trust_certs_file_path=trust,
        tls_validate_hostname=True, authentication=pulsar.AuthenticationToken(secure_cluster.token(ADMIN))))
    assert by_token == expected
    # A client certificate the broker's CA signed authenticates as its CN
    # (svc, granted on the namespace); another CN has no grant.
    files = secure_cluster.tls_files

    def by_certificate(role: str):
        return pulsar_round_trip(secure_cluster.pulsar_tls_url, f"persistent://{NAMESPACE}/by-certificate", 5,
                                 tls_trust_certs_file_path=trust, authentication=pulsar.AuthenticationTLS(
                                     str(files[f"{role}.cert.pem"]), str(files[f"{role}.key.pem"])))

    assert await trio.to_thread.run_sync(by_certificate, "svc") == expected[:5]
    with pytest.raises(pulsar.AuthorizationError):
        await trio.to_thread.run_sync(by_certificate, "stranger")


async def test_quire_clients_connect_over_tls_and_bad_tls_peers_are_refused(secure_cluster):
    async with Client.connect(secure_cluster.zk_hosts, secure_cluster.root, auth_token=secure_cluster.token(ADMIN),
                              tls_context=secure_cluster.tls_context()) as client:
        producer = await client.create_producer(f"{NAMESPACE}/quire-tls", "p")
        await producer.send(b"over TLS")
        connection = next(iter(client._connections.values()))
        assert connection.address == f"127.0.0.1:{secure_cluster.tls_port}"
    # A client certificate alone authenticates quire's client too.
    async with Client.connect(secure_cluster.zk_hosts, secure_cluster.root, tls_context=secure_cluster.tls_context("svc")) as svc:
        reader = await svc.create_reader(f"{NAMESPACE}/quire-tls", start="earliest")
        assert (await reader.receive()).data == b"over TLS"
    # Plaintext to a TLS port, and a handshake that never comes: each is
    # closed, counted and logged with its address; the broker serves on.
    before = secure_cluster.broker.log_path.read_text(errors="replace")
    tls_refused_before = secure_cluster.metric("quire_broker_tls_handshakes_refused_total")
    for port in (secure_cluster.tls_port, secure_cluster.pulsar_tls_port):
        with trio.fail_after(10):  # closed at once (reset, or a plain close)
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            await stream.send_all(b"\x00\x00\x00\x10 plaintext here!")
            try:
                assert await stream.receive_some(1024) == b""
            except trio.BrokenResourceError:
                pass
            await stream.aclose()
        with trio.fail_after(10):  # the 2 s handshake timeout, then closed
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            try:
                assert await stream.receive_some(1024) == b""
            except trio.BrokenResourceError:
                pass
            await stream.aclose()
    await wait_until_async(
        lambda: "refusing TLS connection from 127.0.0.1:" in secure_cluster.broker.log_path.read_text(errors="replace")[len(before):],
        deadline_s=10, what="the TLS refusal logged")
    # Each of the four counted: two plaintext, two that never shook hands.
    await wait_until_async(
        lambda: secure_cluster.metric("quire_broker_tls_handshakes_refused_total") >= tls_refused_before + 4,
        deadline_s=10, what="four TLS refusals counted")
    # TLS to the plaintext port: the client fails cleanly, in one error.
    with pytest.raises(Exception) as refused:
        async with Client.connect(service_url=f"127.0.0.1:{secure_cluster.broker.port}",
                                  tls_context=secure_cluster.tls_context("svc")) as client:
            await client.list_topics()
    assert "cannot connect" in str(refused.value) or "no broker" in str(refused.value), refused.value
    async with Client.connect(secure_cluster.zk_hosts, secure_cluster.root, auth_token=secure_cluster.token(ADMIN),
                              tls_context=secure_cluster.tls_context()) as client:
        assert any(topic["topic"] == f"{NAMESPACE}/quire-tls" for topic in await client.list_topics(NAMESPACE))


async def test_hostile_credentials_are_refused_counted_and_logged_and_the_broker_serves_on(secure_cluster):
    import socket

    from broker.pulsar.wire import PulsarFrameDecoder, Type, command, encode

    def connect_refusal(**fields) -> str:
        """What the broker answers a raw CONNECT: the ERROR's message."""
        with socket.create_connection(("127.0.0.1", secure_cluster.broker.pulsar_port), timeout=20) as sock:
            sock.sendall(encode(command(Type.CONNECT, client_version="hostile", protocol_version=21, **fields)))
            decoder = PulsarFrameDecoder()
            while True:
                for frame in decoder.frames():
                    assert frame.type == Type.ERROR, Type.Name(frame.type)
                    return frame.body.message
                data = sock.recv(65536)
                assert data, "closed without an ERROR"
                decoder.feed(data)

    before = secure_cluster.metric("quire_broker_authentication_refusals_total")
    log_before = secure_cluster.broker.log_path.read_text(errors="replace")
    huge = secure_cluster.token(ADMIN) + "." + "A" * 100_000
    answers = await trio.to_thread.run_sync(lambda: [
        connect_refusal(auth_method_name="token", auth_data=huge.encode()),                  # oversized
        connect_refusal(auth_method_name=secure_cluster.token(ADMIN)),                       # a token as the method's name
        connect_refusal(original_principal=ADMIN, original_auth_data=secure_cluster.token(ADMIN)),  # a proxy's fields
        connect_refusal(auth_method_name="token", auth_data=b"\xff\xfe not ascii"),
    ])
    assert "longer than" in answers[0] and "method" in answers[1] and "proxied" in answers[2] and "ASCII" in answers[3], answers
    assert secure_cluster.metric("quire_broker_authentication_refusals_total") == before + 4
    logged = secure_cluster.broker.log_path.read_text(errors="replace")[len(log_before):]
    # Logged at most once a second (a client retrying in a loop must not flood the log), never with the token.
    assert "refused Pulsar connection from 127.0.0.1:" in logged and secure_cluster.token(ADMIN) not in logged
    # TLS spoken to a plaintext port: a protocol error, that connection only.
    errors_before = secure_cluster.metric("quire_broker_protocol_errors_total")
    context = secure_cluster.tls_context()
    with pytest.raises((trio.BrokenResourceError, trio.ClosedResourceError, OSError)), trio.fail_after(10):
        stream = await trio.open_tcp_stream("127.0.0.1", secure_cluster.broker.pulsar_port)
        tls_stream = trio.SSLStream(stream, context, server_hostname="127.0.0.1")
        await tls_stream.do_handshake()
    await wait_until_async(lambda: secure_cluster.metric("quire_broker_protocol_errors_total") > errors_before,
                           deadline_s=10, what="the protocol error counted")
    assert secure_cluster.metric("quire_broker_tls_handshakes_refused_total") >= 1  # from the TLS tests before, or now
    # A role refused a produce is counted too, and the broker still serves a good client.
    refusals_before = secure_cluster.metric("quire_broker_authorization_refusals_total")
    assert isinstance(await trio.to_thread.run_sync(pulsar_refusal, secure_cluster, secure_cluster.token(BOB),
                                                    f"persistent://{NAMESPACE}/hostile"), pulsar.AuthorizationError)
    assert secure_cluster.metric("quire_broker_authorization_refusals_total") > refusals_before
    assert await trio.to_thread.run_sync(pulsar_refusal, secure_cluster, secure_cluster.token(ADMIN),
                                         f"persistent://{NAMESPACE}/hostile") is None


async def test_a_quire_client_connects_again_with_a_fresh_token_when_its_token_expires(secure_cluster):
    # quire's protocol has no challenge: the broker closes a connection whose
    # token expired, and the client connects again with what its token
    # function gives then. Sends go on across it, none lost, none twice.
    issued = []

    def supplier() -> str:
        issued.append(time.time())
        return secure_cluster.token(ADMIN, expiry_s=3)

    topic = f"{NAMESPACE}/quire-refreshed"
    async with Client.connect(secure_cluster.zk_hosts, secure_cluster.root, auth_token=supplier) as client:
        producer = await client.create_producer(topic, "refreshing")
        deadline = trio.current_time() + 8
        sent = 0
        while trio.current_time() < deadline:
            await producer.send(b"%d" % sent)
            sent += 1
            await trio.sleep(0.1)  # pacing: the sends span several tokens' lifetimes
        reader = await client.create_reader(topic, start="earliest")
        received = [(await reader.receive()).data for _ in range(sent)]
    assert received == [b"%d" % index for index in range(sent)]
    assert len(issued) >= 3, issued


async def test_rest_calls_without_a_good_token_or_grant_are_refused_and_change_nothing(secure_cluster):
    import requests

    def call(method: str, path: str, token: str | None = None, *, body=None, tls: bool = False) -> requests.Response:
        base = f"https://127.0.0.1:{secure_cluster.web_tls_port}" if tls else secure_cluster.broker.web_url
        headers = {} if token is None else {"Authorization": f"Bearer {token}"}
        return requests.request(method, base + path, json=body, headers=headers, timeout=30,
                                verify=str(secure_cluster.tls_files["ca.cert.pem"]) if tls else True)

    def check() -> None:
        admin, bob = secure_cluster.token(ADMIN), secure_cluster.token(BOB)
        tenant = f"t-{uuid.uuid4().hex[:8]}"
        info = {"adminRoles": [], "allowedClusters": ["standalone"]}
        # No token, a token signed with another key, an expired one: 401.
        assert call("GET", "/admin/v2/tenants").status_code == 401
        other_key = create_secret_key()
        assert call("GET", "/admin/v2/tenants", secure_cluster.token(ADMIN, key=other_key)).status_code == 401
        expired = create_token(ADMIN, secret_key=secure_cluster.secret_key, now=time.time() - 3600, expiry_s=60)
        assert call("GET", "/admin/v2/tenants", expired).status_code == 401
        assert call("PUT", f"/admin/v2/tenants/{tenant}", "Basic abc", body=info).status_code == 401
        # A role without the right: 403, and nothing made or removed.
        assert call("PUT", f"/admin/v2/tenants/{tenant}", bob, body=info).status_code == 403
        assert call("DELETE", f"/admin/v2/namespaces/{NAMESPACE}", bob).status_code == 403
        assert call("POST", f"/admin/v2/namespaces/{NAMESPACE}/permissions/bob", bob, body=["produce"]).status_code == 403
        assert call("GET", f"/admin/v2/tenants/{tenant}", admin).status_code == 404
        assert "bob" not in call("GET", f"/admin/v2/namespaces/{NAMESPACE}/permissions", admin).json()
        assert call("GET", f"/admin/v2/namespaces/{NAMESPACE}", admin).status_code == 200  # not deleted
        # The superuser, over HTTP and HTTPS.
        assert call("PUT", f"/admin/v2/tenants/{tenant}", admin, body=info).status_code == 204
        assert call("GET", "/admin/v2/tenants", admin, tls=True).json().count(tenant) == 1
        assert call("DELETE", f"/admin/v2/tenants/{tenant}", admin, tls=True).status_code == 204

    await trio.to_thread.run_sync(check)
