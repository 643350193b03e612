"""Prometheus /metrics of real bookie and broker processes, scraped over HTTP
before and after load, and the structured log lines of those processes;
`quire cluster up` and docker-compose.yml give every process a metrics port."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import trio
import yaml
from prometheus_client.parser import text_string_to_metric_families

from bookie.protocol import Status
from broker.client import Client
from broker.protocol import PROTOCOL_VERSION, Connect, Send, encode
from coordination.zk_launcher import ZooKeeperServer, stop_children
from coordination.zk_store import KazooMetadataStore
from ledger_client import BookKeeper, DigestType
from ledger_client.bookie_client import BookieClient
from quire.local_cluster import ClusterState
from tests.integration.bookie_processes import BookieFactory, BookieProcess, bookies  # noqa: F401 (fixture)
from tests.integration.broker_processes import brokers  # noqa: F401 (fixture)
from tests.integration.processes import print_logs
from tests.integration.test_bookie_durability import KEY, PipelinedWriter
from tests.support import free_port, free_port_run, free_ports, raw_exchange, wait_until, wait_until_async

REPOSITORY = Path(__file__).resolve().parents[2]
ENTRIES = 200
MESSAGES = 100
ACKNOWLEDGED = 40
# 2026-11-22T19:00:00.123Z INFO bookie 127.0.0.1:3181 bookie.server: ...
LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z (DEBUG|INFO|WARNING|ERROR|CRITICAL) (\S+) (\S+) [\w.]+: ")


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """Every sample of http://127.0.0.1:PORT/metrics: (name, sorted labels) -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        assert response.status == 200
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


async def scrape_async(port: int) -> dict[tuple[str, tuple], float]:
    return await trio.to_thread.run_sync(scrape, port)


def value(samples: dict, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def moved(before: dict, after: dict, name: str, **labels: str) -> float:
    return value(after, name, **labels) - before.get((name, tuple(sorted(labels.items()))), 0.0)


async def put_ledger_load(zk_hosts: str, zk_root: str) -> None:
    async with BookKeeper.connect(zk_hosts, root=zk_root) as bk:
        handle = await bk.create_ledger(ensemble_size=3, write_quorum=3, ack_quorum=2,
                                        digest_type=DigestType.CRC32C, password=b"pw")
        pending = [await handle.submit_add(b"x" * 1024) for _ in range(ENTRIES)]
        for add in pending:
            await add.wait()
        await handle.close()
        reader = await bk.open_ledger(handle.ledger_id, password=b"pw")
        read = [entry.entry_id async for entry in reader.read(0, reader.last_add_confirmed)]
        assert read == list(range(ENTRIES))


async def test_metrics_scraped_over_http_move_under_load(zk_hosts, zk_root, bookies, brokers):
    bookie_metrics_ports = free_ports(3)
    for port in bookie_metrics_ports:
        await bookies.started("--metrics-port", str(port))
    broker_metrics_port = free_port()
    broker = await brokers.started("--metrics-port", str(broker_metrics_port))
    bookies_before = [await scrape_async(port) for port in bookie_metrics_ports]
    broker_before = await scrape_async(broker_metrics_port)
    # Before any load every series is there, at zero where it counts.
    for samples in bookies_before:
        assert value(samples, "quire_bookie_add_requests_total", result="ok") == 0
        assert value(samples, "quire_bookie_read_only") == 0
        assert value(samples, "quire_under_replicated_ledgers") == 0  # no auto-recovery markers yet
    assert value(broker_before, "quire_broker_topics") == 0
    assert value(broker_before, "quire_broker_publish_requests_total", result="duplicate") == 0
    assert value(broker_before, "quire_broker_publish_inflight") == 0
    assert value(broker_before, "quire_broker_publish_buffer_bytes") == 0

    await put_ledger_load(zk_hosts, zk_root)
    async with Client.connect(zk_hosts, zk_root) as client:
        producer = await client.create_producer("metered", producer_id="meter-1")
        for number in range(MESSAGES):
            await producer.send(f"message {number}".encode())
        await producer.send(b"message 0 again", sequence_id=0)  # persisted before: answered DUPLICATE
        # A batch for a producer its connection does not have: answered TOPIC_FENCED, and counted.
        await trio.to_thread.run_sync(lambda: raw_exchange(
            broker.address, encode(Send(1, 0, 0, 1, b"no producer")),
            prefix=encode(Connect(PROTOCOL_VERSION, "meter", "", b"")),
        ))
        consumer = await client.subscribe("metered", subscription="audit", initial_position="earliest")
        for _ in range(ACKNOWLEDGED):
            with trio.fail_after(20):
                await consumer.acknowledge(await consumer.receive())
        bookies_after = [await scrape_async(port) for port in bookie_metrics_ports]
        broker_after = await scrape_async(broker_metrics_port)

        # Every bookie took every entry of the ledger (E = WQ = 3), and the broker's too.
        for before, after in zip(bookies_before, bookies_after):
            assert moved(before, after, "quire_bookie_add_requests_total", result="ok") >= ENTRIES
            assert moved(before, after, "quire_bookie_add_latency_seconds_count") >= ENTRIES
            # Seconds, not milliseconds: a loopback add takes well under a second and more than a microsecond.
            mean_add_s = (moved(before, after, "quire_bookie_add_latency_seconds_sum")
                          / moved(before, after, "quire_bookie_add_latency_seconds_count"))
            assert 1e-6 < mean_add_s < 1.0, mean_add_s
            assert moved(before, after, "quire_bookie_add_latency_seconds_bucket", le="+Inf") >= ENTRIES
            assert moved(before, after, "quire_bookie_journal_fsync_seconds_count") >= 1
            assert moved(before, after, "quire_bookie_journal_batch_entries_sum") >= ENTRIES
            assert moved(before, after, "quire_bookie_journal_batch_bytes_sum") >= ENTRIES * 1024
            assert value(after, "quire_bookie_ledgers") >= 2  # ours and the topic's
            assert 0 < value(after, "quire_bookie_write_cache_bytes") <= value(after, "quire_bookie_write_cache_max_bytes")
            for kind in ("add", "read"):  # everything was answered
                assert value(after, "quire_bookie_inflight_requests", kind=kind) == 0
            assert value(after, "quire_bookie_read_only") == 0
            assert value(after, "process_resident_memory_bytes") > 0
        # Reads go to one bookie of the ensemble at a time.
        assert sum(moved(before, after, "quire_bookie_read_requests_total", result="ok")
                   for before, after in zip(bookies_before, bookies_after)) >= 1
        assert sum(moved(before, after, "quire_bookie_read_latency_seconds_count")
                   for before, after in zip(bookies_before, bookies_after)) >= 1

        assert moved(broker_before, broker_after, "quire_broker_publish_messages_total") == MESSAGES
        assert moved(broker_before, broker_after, "quire_broker_publish_requests_total", result="ok") == MESSAGES
        assert moved(broker_before, broker_after, "quire_broker_publish_requests_total", result="duplicate") == 1
        assert moved(broker_before, broker_after, "quire_broker_publish_requests_total", result="topic_fenced") == 1
        assert value(broker_after, "quire_broker_publish_inflight") == 0  # every batch answered
        assert value(broker_after, "quire_broker_publish_buffer_bytes") == 0  # ... and its bytes given back
        assert value(broker_after, "quire_broker_publish_buffer_pauses_total") == 0
        assert value(broker_after, "quire_broker_topic_ledgers", topic="metered") == 1
        assert moved(broker_before, broker_after, "quire_broker_publish_latency_seconds_count") == MESSAGES
        assert moved(broker_before, broker_after, "quire_broker_publish_bytes_total") > 0
        assert moved(broker_before, broker_after, "quire_broker_dispatched_messages_total") >= ACKNOWLEDGED
        assert value(broker_after, "quire_broker_topics") == 1
        assert value(broker_after, "quire_broker_producers") == 1
        assert value(broker_after, "quire_broker_consumers") == 1
        assert value(broker_after, "quire_broker_subscription_backlog", topic="metered", subscription="audit") == MESSAGES - ACKNOWLEDGED
        assert value(broker_after, "quire_broker_topic_storage_bytes", topic="metered") > 0

    # The auto-recovery daemon's markers are counted (read at most every 5 s).
    # Auto-recovery is switched off first, so that no worker takes them.
    with KazooMetadataStore.connect(zk_hosts, zk_root) as store:
        store.create("/underreplication/disabled", b"", make_parents=True)
        for ledger_id in (7, 8):
            store.create(f"/underreplication/ledgers/{ledger_id}", b"", make_parents=True)

    async def counted() -> bool:
        return value(await scrape_async(bookie_metrics_ports[0]), "quire_under_replicated_ledgers") == 2

    await wait_until_async(counted, deadline_s=15, what="2 under-replicated ledgers counted", poll_s=0.2)

    # Every log line names the process's role and id.
    for process, role in [(bookies.created[0], "bookie"), (broker, "broker")]:
        lines = [line for line in process.log_path.read_text().splitlines() if line[:1].isdigit()]
        assert lines, process.log_tail()
        for line in lines:
            match = LOG_LINE.match(line)
            assert match is not None and match.group(2, 3) == (role, process.address), line


async def test_metrics_port_in_use_at_start_is_one_clear_line(zk_hosts, zk_root, bookies, brokers):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        busy = listener.getsockname()[1]
        for factory in (bookies, brokers):
            process = factory.new("--metrics-port", str(busy))
            process.start()
            returncode = await trio.to_thread.run_sync(lambda: process.process.wait(timeout=60))
            log = process.log_path.read_text()
            assert returncode == 2, log
            assert "Traceback" not in log
            errors = [line for line in log.splitlines() if ": error: " in line]
            assert len(errors) == 1 and f"cannot serve metrics on 127.0.0.1:{busy}" in errors[0], log
        # The bookie wrote no cookie before it failed: its directories start
        # on free ports, although its id (its address) is another now.
        refused = bookies.created[0]
        port, metrics_port = free_ports(2)
        again = BookieProcess(refused.zk_hosts, refused.root, refused.directory, port, ["--metrics-port", str(metrics_port)])
        bookies.created.append(again)
        await again.started()


async def test_a_read_only_bookie_counts_the_adds_it_rejects(bookies):
    metrics_port = free_port()
    # Any disk is fuller than this threshold: the bookie starts read-only.
    bookie = await bookies.started("--metrics-port", str(metrics_port), "--disk-usage-threshold", "0.0001",
                                   "--disk-usage-lwm", "0.0001")
    before = await scrape_async(metrics_port)
    assert value(before, "quire_bookie_read_only") == 1
    assert value(before, "quire_bookie_rejected_requests_total", kind="add", reason="read_only") == 0
    async with BookieClient.connect(bookie.address) as client:
        assert (await client.add(PipelinedWriter(ledger_id=31).entry(0), KEY)).status is Status.READ_ONLY
    after = await scrape_async(metrics_port)
    assert moved(before, after, "quire_bookie_rejected_requests_total", kind="add", reason="read_only") == 1
    assert moved(before, after, "quire_bookie_add_requests_total", result="ok") == 0


async def test_a_scrape_answers_at_once_while_zookeeper_is_paused(bookies_of_own_zookeeper):
    bookies, zookeeper = bookies_of_own_zookeeper
    metrics_port = free_port()
    await bookies.started("--metrics-port", str(metrics_port))

    async def first_count() -> bool:
        return ("quire_under_replicated_ledgers", ()) in await scrape_async(metrics_port)

    await wait_until_async(first_count, deadline_s=15, what="the first under-replicated count")  # soon after the start
    os.kill(zookeeper.pid, signal.SIGSTOP)
    try:
        # The count is refreshed every 5 s in the background, each read bounded
        # by 1 s; a scrape only reads what was cached, so it answers at once,
        # and leaves the count out once it could not be refreshed.
        async def count_left_out() -> bool:
            started = time.monotonic()
            samples = await scrape_async(metrics_port)
            assert time.monotonic() - started < 2.0
            assert value(samples, "quire_bookie_add_requests_total", result="ok") == 0
            return ("quire_under_replicated_ledgers", ()) not in samples

        await wait_until_async(count_left_out, deadline_s=20, what="the under-replicated count left out", poll_s=0.2)
    finally:
        os.kill(zookeeper.pid, signal.SIGCONT)


@pytest.fixture
def bookies_of_own_zookeeper(tmp_path):
    """Bookies of a ZooKeeper of their own, which the test may pause."""
    zookeeper = ZooKeeperServer(free_port(), tmp_path / "zookeeper", die_with_parent=True)
    zookeeper.start()
    factory = BookieFactory(zookeeper.address, "/quire", tmp_path)
    try:
        yield factory, zookeeper
    finally:
        factory.stop_all()
        print_logs(factory.created)
        zookeeper.stop()


def test_autorecovery_run_logs_its_role_and_name_as_json(zk_hosts, zk_root, tmp_path):
    log_path = tmp_path / "autorecovery.log"
    with open(log_path, "wb") as log:
        daemon = subprocess.Popen(
            [sys.executable, "-m", "quire", "autorecovery", "run", "--zk", zk_hosts, "--root", zk_root,
             "--name", "recoverer-1", "--log-format", "json"],
            cwd=REPOSITORY, stdout=subprocess.DEVNULL, stderr=log,
        )
    try:
        def first_line() -> bool:  # a first whole line (in an empty cluster, a registry warning)
            assert daemon.poll() is None, log_path.read_text()
            return "\n" in log_path.read_text()

        wait_until(first_line, deadline_s=30, what="a first log line", poll_s=0.05)
    finally:
        stop_children([daemon], deadline_s=30)
    records = [json.loads(line) for line in log_path.read_text().splitlines() if line.startswith("{")]
    assert records, log_path.read_text()
    assert {(record["role"], record["id"]) for record in records} == {("autorecovery", "recoverer-1")}


def quire(*arguments, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "quire", *map(str, arguments)], cwd=REPOSITORY,
                          capture_output=True, text=True, timeout=timeout)


def test_cluster_up_gives_every_process_a_metrics_port(tmp_path):
    data_dir = tmp_path / "cluster"
    # One run of free ports for all of them: ports picked one by one can
    # collide (a free port can be handed out twice, and each base is the
    # first of a run).
    zk_port = free_port_run(1 + 3 + 1 + 4)
    bookie_base, broker_base, metrics_base = zk_port + 1, zk_port + 4, zk_port + 5
    up = quire("cluster", "up", "--data-dir", data_dir, "--zk-port", zk_port, "--bookie-base-port", bookie_base,
               "--broker-base-port", broker_base, "--metrics-base-port", metrics_base)
    try:
        assert up.returncode == 0, up.stderr
        state = ClusterState.load(data_dir)
        expected = {f"bookie-{index + 1}": metrics_base + index for index in range(3)} | {"broker-1": metrics_base + 3}
        assert {record.name: int(record.metrics_address.rsplit(":", 1)[1])
                for record in state.processes if record.metrics_address} == expected
        status = quire("cluster", "status", "--data-dir", data_dir)
        assert status.returncode == 0, status.stdout + status.stderr
        for name, port in expected.items():
            assert f"http://127.0.0.1:{port}/metrics" in status.stdout
            samples = scrape(port)
            role = name.split("-")[0]
            assert any(sample_name.startswith(f"quire_{role}_") for sample_name, _ in samples)
        for record in state.processes:  # the processes of cluster up log with their role and id too
            if record.role not in ("bookie", "broker"):
                continue  # ZooKeeper's own (Java) lines share its log
            lines = [line for line in Path(record.log).read_text().splitlines() if line[:1].isdigit()]
            assert lines, record.log
            for line in lines:
                match = LOG_LINE.match(line)
                assert match is not None and match.group(2) == record.role, (record.log, line)
    finally:
        assert quire("cluster", "down", "--data-dir", data_dir).returncode == 0


def test_docker_compose_metrics_ports_are_those_of_cluster_up():
    result = subprocess.run(["docker-compose", "config"], cwd=REPOSITORY, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    services = yaml.safe_load(result.stdout)["services"]
    metrics_ports = {}
    for name, service in services.items():
        command = service["command"]
        options = dict(zip(command, command[1:]))
        if command[:2] in (["bookie", "run"], ["broker", "run"]):
            port = int(options["--metrics-port"])
            metrics_ports[name] = port
            published = {(int(mapping["published"]), int(mapping["target"])) for mapping in service["ports"]}
            assert (port, port) in published, f"{name} does not publish its metrics port"
    # `quire cluster up --brokers 2` with its default --metrics-base-port 8000.
    assert metrics_ports == {"bookie-1": 8000, "bookie-2": 8001, "bookie-3": 8002, "broker-1": 8003, "broker-2": 8004}
