"""Operating brokers: bad client frames, the command line, the sync client,
graceful shutdown handing partitions over (real processes)."""

from __future__ import annotations

import json
import struct
import subprocess
import sys

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from broker.client import Client
from broker.protocol import PROTOCOL_VERSION, Connect, Send, encode
from framing.codec import encode_frame
from tests.integration.broker_processes import brokers, shared_cluster  # noqa: F401 (fixtures)
from tests.integration.bookie_processes import bookies  # noqa: F401
from tests.support import raw_exchange

pytestmark = pytest.mark.integration

frames = st.one_of(
    st.binary(max_size=300),
    st.builds(lambda body: struct.pack(">I", len(body)) + body, st.binary(max_size=200)),
    st.builds(
        encode_frame,
        st.lists(st.one_of(st.integers(-5, 20), st.binary(max_size=40), st.none(), st.text(max_size=5),
                           st.booleans(), st.dictionaries(st.text(max_size=3), st.integers(-(2**63), 2**64 - 1), max_size=2)),
                 min_size=1, max_size=12),
    ),
    st.just(struct.pack(">I", 2**31)),  # far past the frame bound
    st.just(encode(Send(1, 0, 0, 1, b"a send for no producer"))),
    st.just(encode(Send(1, 0, 0, 1, b""))),
)


async def test_bad_client_frames_close_only_that_connection(shared_cluster):
    # Random and malformed frames, with and without a handshake: only the
    # connection that sent them closes; a client connected all along keeps
    # producing and consuming, and nothing stored is lost.
    broker = shared_cluster.brokers[0]
    async with Client.connect(shared_cluster.zk_hosts, shared_cluster.root) as client:
        producer = await client.create_producer("fuzzed", "steady")
        consumer = await client.subscribe("fuzzed", "check", initial_position="earliest")
        for number in range(20):
            await producer.send(f"before-{number}".encode())

        @settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
        @given(data=frames, handshake=st.booleans())
        def fuzz(data: bytes, handshake: bool) -> None:
            raw_exchange(broker.address, data, prefix=encode(Connect(PROTOCOL_VERSION, "fuzz", "", b"")) if handshake else b"")

        await trio.to_thread.run_sync(fuzz)
        assert broker.running
        for number in range(20):
            await producer.send(f"after-{number}".encode())
        with trio.fail_after(20):
            received = []
            while len(received) < 40:
                message = await consumer.receive()
                received.append(message.data.decode())
                await consumer.acknowledge(message)
        assert received == [f"before-{n}" for n in range(20)] + [f"after-{n}" for n in range(20)]


def quire(cluster, *arguments: str, stdin: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    completed = subprocess.run(
        [sys.executable, "-m", "quire", *arguments, "--zk", cluster.zk_hosts, "--root", cluster.root],
        input=stdin, capture_output=True, text=True, timeout=120,
    )
    if check:
        assert completed.returncode == 0, completed.stderr
    return completed


def test_topics_from_the_command_line(shared_cluster):
    created = json.loads(quire(shared_cluster, "topic", "create", "cli-orders", "--partitions", "2",
                               "--retention-time", "7d", "--backlog-quota", "1GiB").stdout)
    assert created["partitions"] == 2 and created["policies"]["retention_time_ms"] == 7 * 86_400_000
    assert "cli-orders (2 partitions)" in quire(shared_cluster, "topic", "ls").stdout
    produced = json.loads(quire(shared_cluster, "produce", "cli-orders", "--producer-id", "cli", "--key", "user",
                                "--keys", "4", "--property", "source=cli", "--codec", "zstd", "--batching",
                                "--count", "100").stdout)
    assert produced["sent"] == 100
    lines = quire(shared_cluster, "produce", "cli-orders", "--key", "user-1", stdin="hello\nworld\n").stdout
    assert json.loads(lines)["sent"] == 2
    consumed = quire(shared_cluster, "consume", "cli-orders", "-s", "cli-reader", "--count", "102", "--format", "json")
    messages = [json.loads(line) for line in consumed.stdout.splitlines()]
    assert len(messages) == 102
    assert {m["properties"].get("source") for m in messages[:-2] if m["producer_id"] == "cli"} <= {"cli"}
    assert {"hello", "world"} <= {m["data"] for m in messages}
    stats = json.loads(quire(shared_cluster, "topic", "stats", "cli-orders").stdout)
    partitions = stats["partitions"]
    assert set(partitions) == {"cli-orders-partition-0", "cli-orders-partition-1"}
    assert sum(p["next_offset"] for p in partitions.values()) == 102
    for partition in partitions.values():
        assert partition["subscriptions"]["cli-reader"]["backlog_messages"] == 0
        assert partition["ledgers"] and partition["ledgers"][0]["state"] == "open"
    changed = json.loads(quire(shared_cluster, "topic", "set-policies", "cli-orders", "--retention-size", "10MiB").stdout)
    assert changed["policies"]["retention_bytes"] == 10 * 1024**2
    # Deleting refuses nothing here (no client is connected), and the topic is gone.
    quire(shared_cluster, "topic", "delete", "cli-orders")
    assert "cli-orders" not in quire(shared_cluster, "topic", "ls").stdout
    missing = quire(shared_cluster, "topic", "stats", "cli-orders", check=False)
    assert missing.returncode == 2 and "TopicNotFoundError" in missing.stderr and "Traceback" not in missing.stderr


def test_bad_arguments_print_one_line_and_exit_2(shared_cluster):
    for arguments in (["topic", "create", "bad/name"], ["produce", "t", "--codec", "gzip"],
                      ["consume", "t"], ["topic", "create", "t", "--retention-time", "soon"],
                      ["broker", "run", "--port", "99999"]):
        completed = quire(shared_cluster, *arguments, check=False)
        assert completed.returncode == 2, (arguments, completed.stderr)
        assert "Traceback" not in completed.stderr
        assert len(completed.stderr.strip().splitlines()) == 1, completed.stderr


def test_the_sync_client_offers_the_same_calls(shared_cluster):
    from broker.client.sync import Client as SyncClient

    with SyncClient.connect(shared_cluster.zk_hosts, shared_cluster.root) as client:
        producer = client.create_producer("sync-topic", "sync-producer")
        first = producer.send(b"one", key="k", properties={"a": "b"})
        results = producer.send_many([b"two", b"three"])
        consumer = client.subscribe("sync-topic", "sync-sub", initial_position="earliest")
        messages = [consumer.receive(timeout_s=10) for _ in range(3)]
        assert [m.data for m in messages] == [b"one", b"two", b"three"]
        assert messages[0].message_id == first and messages[0].properties == {"a": "b"}
        assert [r.offset for r in results] == [1, 2]
        for message in messages:
            consumer.acknowledge(message)
        assert consumer.receive(timeout_s=0.5) is None
        assert client.topic_stats("sync-topic")["partitions"]["sync-topic"]["subscriptions"]["sync-sub"]["backlog_messages"] == 0
        producer.close()
        consumer.close()


async def test_a_broker_stopped_with_sigterm_hands_its_partitions_over_cleanly(zk_hosts, zk_root, bookies, brokers):
    # A graceful stop closes each partition's ledger and records it, so the
    # broker taking over has nothing to recover, and clients move at once.
    for _ in range(3):
        await bookies.started()
    first = await brokers.started()
    second = await brokers.started()
    async with Client.connect(zk_hosts, zk_root) as client:
        await client.create_topic("handed-over", partitions=4)
        producer = await client.create_producer("handed-over", "steady")
        for number in range(40):
            await producer.send(f"{number}".encode(), key=str(number))
        owners = {await client.lookup(f"handed-over-partition-{index}") for index in range(4)}
        leaving = first if first.address in owners else second
        assert leaving.terminate() == 0
        for number in range(40, 80):
            with trio.fail_after(20):
                await producer.send(f"{number}".encode(), key=str(number))
        staying = second if leaving is first else first
        assert {await client.lookup(f"handed-over-partition-{index}") for index in range(4)} == {staying.address}
        assert "recovered ledger" not in staying.log_path.read_text()
        reader_messages = []
        consumer = await client.subscribe("handed-over", "all", initial_position="earliest")
        with trio.fail_after(20):
            while len(reader_messages) < 80:
                reader_messages.append(int((await consumer.receive()).data))
        assert sorted(reader_messages) == list(range(80))
