"""The Spark export against real processes and a real Spark (local[2]): what
it writes is exactly what a consumer receives from the same ledgers, large
ledgers split without losing or repeating a row, incremental runs add only
new ledgers, a dead bookie per ensemble is read around, and a producer
writing meanwhile is never fenced."""

from __future__ import annotations

import datetime
import fcntl
import os
import time
import uuid

import pytest
import trio

from broker.client import Client, Codec
from broker.spark_source import read_topic_ledgers, spark_session
from coordination.zk_store import KazooMetadataStore
from ledger_client import BookKeeper
from ledger_client.sync import BookKeeper as SyncBookKeeper
from quire.cli import build_parser
from quire.export_commands import PENDING_PREFIX, RUN_PREFIX, ExportFailed, export, root_cause, run_export
from tests.integration.test_cli_errors import error_line, quire
from tests.support import free_port
from tests.integration.bookie_processes import bookies  # noqa: F401 (a fixture)
from tests.integration.broker_processes import brokers, shared_cluster  # noqa: F401 (fixtures)

pytestmark = pytest.mark.integration

SMALL_LEDGERS = {"rollover_entries": 4, "rollover_min_time_ms": 0}


@pytest.fixture(scope="module")
def spark():
    session = spark_session("local[2]", "quire-tests", {"spark.sql.shuffle.partitions": "2"})
    try:
        yield session
    finally:
        session.stop()


def source(spark, cluster, topic: str, **options):
    reader = spark.read.format("quire").option("zk", cluster.zk_hosts).option("root", cluster.root).option("topic", topic)
    for name, value in options.items():
        reader = reader.option(name, str(value))
    return reader.load()


def export_arguments(cluster, topic: str, out, *extra: str):
    return build_parser().parse_args(["export", topic, "--zk", cluster.zk_hosts, "--root", cluster.root,
                                      "--out", str(out), *extra])


def closed_ledger_ids(cluster, topic: str) -> set[int]:
    return {info.ledger_id for chain in read_topic_ledgers(cluster.zk_hosts, cluster.root, topic)
            for info in chain.ledgers if info.is_closed}


def as_row(message) -> tuple:
    """A consumer's message in the export's terms, keyed by its id."""
    message_id = message.message_id
    # As PySpark gives a timestamp back: naive, in the local time zone.
    publish_ms = message.publish_time_ms
    publish_time = datetime.datetime.fromtimestamp(publish_ms // 1000).replace(microsecond=publish_ms % 1000 * 1000)
    return ((message_id.partition, message_id.ledger_id, message_id.entry_id, message_id.batch_index),
            (message.topic, message.offset, publish_time, message.producer_id, message.sequence_id, message.key,
             message.properties, message.data))


def exported_rows(frame) -> dict:
    rows = {}
    for row in frame.collect():
        key = (row.partition, row.ledger_id, row.entry_id, row.batch_index)
        assert key not in rows, f"row {key} exported twice"
        rows[key] = (row.topic, row.offset, row.publish_time, row.producer_id, row.sequence_id, row.key,
                     dict(row.properties or {}), bytes(row.payload))
    return rows


async def produce_mixed(client, topic: str, count: int, tag: str) -> list:
    """`count` messages from one producer per codec (some batched), with
    keys (some missing) and properties (some empty)."""
    results = []
    for index, codec in enumerate(Codec):
        producer = await client.create_producer(topic, f"{tag}-{codec.value}", batching=index % 2 == 1, codec=codec)
        futures = []
        for number in range(count // len(Codec)):
            payload = f"{tag}:{codec.value}:{number}:".encode() + os.urandom(number % 300)
            key = None if number % 5 == 0 else f"key-{number % 7}"
            properties = {"n": str(number), "codec": codec.value} if number % 3 else None
            futures.append(await producer.send_async(payload, key=key, properties=properties))
            if number % 10 == 9:
                await producer.flush()  # several entries, so several ledgers
        results.extend([await future.wait() for future in futures])
        await producer.close()
    return results


async def read_all(client, topic: str, count: int) -> list:
    reader = await client.create_reader(topic, start="earliest")
    messages = []
    with trio.fail_after(30):
        while len(messages) < count:
            messages.append(await reader.receive())
    await reader.close()
    return messages


async def test_every_exported_row_is_what_a_consumer_received_from_the_same_ledgers(shared_cluster, spark):
    # 2 partitions, four codecs, ledgers of 4 entries: the export holds
    # every message of the closed ledgers, field for field as a reader
    # received it, and nothing of the open ledger.
    topic = "export-mixed"
    async with Client.connect(shared_cluster.zk_hosts, shared_cluster.root) as client:
        await client.create_topic(topic, partitions=2, **SMALL_LEDGERS)
        sent = await produce_mixed(client, topic, 400, "a")
        consumed = await read_all(client, topic, len(sent))
    closed = closed_ledger_ids(shared_cluster, topic)
    rows = exported_rows(source(spark, shared_cluster, topic))
    expected = dict(as_row(message) for message in consumed if message.message_id.ledger_id in closed)
    assert len(closed) >= 6 and len(expected) >= 300
    assert rows == expected
    open_ledgers = {message.message_id.ledger_id for message in consumed} - closed
    assert not {key[1] for key in rows} & open_ledgers


async def test_a_topic_written_by_pulsar_clients_exports_one_row_per_message(shared_cluster, spark):
    # The official Pulsar client writes batches (LZ4, keys, properties) and
    # single messages; the export reads them as a quire reader does.
    import pulsar

    topic = "export-from-pulsar"

    def produce() -> None:
        client = pulsar.Client(shared_cluster.brokers[0].pulsar_url, logger=pulsar.ConsoleLogger(pulsar.LoggerLevel.Error))
        try:
            batched = client.create_producer(f"persistent://public/default/{topic}", producer_name="pulsar-batched",
                                             batching_enabled=True, batching_max_messages=5, batching_max_publish_delay_ms=1,
                                             compression_type=pulsar.CompressionType.LZ4)
            single = client.create_producer(f"persistent://public/default/{topic}", producer_name="pulsar-single",
                                            batching_enabled=False)
            for number in range(60):
                properties = {"n": str(number)} if number % 3 else {}
                batched.send(b"batched-%d" % number, partition_key=f"key-{number % 4}", properties=properties)
                single.send(b"single-%d" % number, properties=properties)
        finally:
            client.close()

    async with Client.connect(shared_cluster.zk_hosts, shared_cluster.root) as client:
        await client.create_topic(topic, **SMALL_LEDGERS)
        await trio.to_thread.run_sync(produce)
        consumed = await read_all(client, topic, 120)
    closed_before = closed_ledger_ids(shared_cluster, topic)
    rows = exported_rows(source(spark, shared_cluster, topic))
    # Housekeeping may close the last ledger while the export runs: what
    # the export holds lies between what was closed before and after it.
    closed_after = closed_ledger_ids(shared_cluster, topic)
    received = dict(as_row(message) for message in consumed)
    assert len(closed_before) >= 6
    assert {key: received[key] for key in received if key[1] in closed_before}.items() <= rows.items()
    assert all(received.get(key) == value and key[1] in closed_after for key, value in rows.items())
    assert {row[3] for row in rows.values()} == {"pulsar-batched", "pulsar-single"}


@pytest.mark.parametrize("messages_per_entry", [1, 7])
async def test_a_large_ledger_is_read_as_several_input_partitions_without_gaps_or_repeats(shared_cluster, spark,
                                                                                        messages_per_entry):
    # 700 messages of ~1 KiB in one closed ledger, one per entry or batched
    # seven per entry: split boundaries fall between entries, and every
    # message of a batch lands in exactly one input partition.
    topic = f"export-large-{messages_per_entry}"
    async with Client.connect(shared_cluster.zk_hosts, shared_cluster.root) as client:
        await client.create_topic(topic, rollover_min_time_ms=0)
        producer = await client.create_producer(topic, "large", batching=messages_per_entry > 1,
                                                batch_messages_max=messages_per_entry, batch_delay_ms=60_000)
        futures = [await producer.send_async(b"%05d" % number + bytes(1000)) for number in range(700)]
        await producer.flush()
        for future in futures:
            await future.wait()
        await client.unload(topic)  # closes the ledger: all 700 messages in one closed ledger
    [chain] = read_topic_ledgers(shared_cluster.zk_hosts, shared_cluster.root, topic)
    [ledger] = [info for info in chain.ledgers if info.is_closed]
    assert ledger.entries == 700 // messages_per_entry and ledger.messages == 700
    frame = source(spark, shared_cluster, topic, split_bytes=64 * 1024)
    assert frame.rdd.getNumPartitions() >= 10  # 700 KiB in ranges of ~64 KiB
    rows = frame.select("offset", "entry_id", "batch_index", "payload").collect()
    assert sorted(row.offset for row in rows) == list(range(700))
    assert all((row.entry_id, row.batch_index) == divmod(row.offset, messages_per_entry)
               and row.payload[:5] == b"%05d" % row.offset for row in rows)


async def test_incremental_exports_add_only_new_ledgers_and_together_equal_a_full_export(shared_cluster, spark, tmp_path):
    topic = "export-incremental"
    out = tmp_path / "incremental"
    async with Client.connect(shared_cluster.zk_hosts, shared_cluster.root) as client:
        await client.create_topic(topic, partitions=2, **SMALL_LEDGERS)
        # Each export follows an unload, which closes the partitions' last
        # ledgers: otherwise housekeeping could close one between two runs.
        await produce_mixed(client, topic, 200, "first")
        await client.unload(topic)
        first = run_export(spark, export_arguments(shared_cluster, topic, out, "--incremental"))
        # A run whose Spark job committed and whose manifest was written,
        # but which died before the rename: the next run commits it (its
        # ledgers are not written again).
        (out / f"{RUN_PREFIX}1").rename(out / f"{PENDING_PREFIX}1")
        # A run that crashed before its commit leaves a pending folder: the
        # next run deletes it (its ledgers were never recorded).
        (out / f"{PENDING_PREFIX}7").mkdir()
        (out / f"{PENDING_PREFIX}7" / "part-0.parquet").write_bytes(b"not parquet")
        await produce_mixed(client, topic, 200, "second")
        await client.unload(topic)
        second = run_export(spark, export_arguments(shared_cluster, topic, out, "--incremental"))
        third = run_export(spark, export_arguments(shared_cluster, topic, out, "--incremental"))
    assert first["run"] == 1 and second["run"] == 2 and third["run"] is None  # nothing new the third time
    assert first["ledgers"] and second["ledgers"] and not set(first["ledgers"]) & set(second["ledgers"])
    assert sorted(path.name for path in out.iterdir()) == ["_lock", f"{RUN_PREFIX}1", f"{RUN_PREFIX}2"]
    both = spark.read.parquet(str(out))
    assert sorted(row.run for row in both.select("run").distinct().collect()) == [1, 2]
    full = tmp_path / "full"
    run_export(spark, export_arguments(shared_cluster, topic, full, "--format", "parquet"))
    assert exported_rows(both.drop("run")) == exported_rows(spark.read.parquet(str(full)))
    assert set(first["ledgers"]) | set(second["ledgers"]) == closed_ledger_ids(shared_cluster, topic) - {
        info.ledger_id for chain in read_topic_ledgers(shared_cluster.zk_hosts, shared_cluster.root, topic)
        for info in chain.ledgers if not info.entries}


async def test_the_export_reads_around_a_dead_bookie_of_every_ensemble(bookies, brokers, zk_hosts, zk_root, spark):  # noqa: F811
    # Three bookies, so every ensemble holds each; one is killed before the
    # export. With write quorum 3 a batch read falls back to another
    # replica; with write quorum 2 some entries are left on one bookie only.
    for _ in range(3):
        await bookies.started()
    await brokers.started()
    consumed = {}
    async with Client.connect(zk_hosts, zk_root) as client:
        for topic, write_quorum in (("replicas-3", 3), ("replicas-2", 2)):
            await client.create_topic(topic, **SMALL_LEDGERS, ensemble_size=3, write_quorum=write_quorum, ack_quorum=2)
            sent = await produce_mixed(client, topic, 120, topic)
            consumed[topic] = await read_all(client, topic, len(sent))
    bookies.created[0].kill()

    class Cluster:
        pass

    cluster = Cluster()
    cluster.zk_hosts, cluster.root = zk_hosts, zk_root
    for topic, messages in consumed.items():
        closed = closed_ledger_ids(cluster, topic)
        expected = dict(as_row(message) for message in messages if message.message_id.ledger_id in closed)
        assert len(expected) >= 80
        assert exported_rows(source(spark, cluster, topic)) == expected


async def test_a_producer_writing_during_the_export_is_never_fenced(shared_cluster, spark, tmp_path):
    topic = "export-live"
    async with Client.connect(shared_cluster.zk_hosts, shared_cluster.root) as client:
        await client.create_topic(topic, rollover_entries=50, rollover_min_time_ms=0)
        producer = await client.create_producer(topic, "live")
        sent = []
        for number in range(100):
            sent.append(await (await producer.send_async(b"before-%d" % number)).wait())
        exports_done = trio.Event()
        results = []

        async def keep_producing() -> None:
            number = 0
            while not exports_done.is_set() or number < 50:
                results.append(await (await producer.send_async(b"during-%d" % number)).wait())
                number += 1

        async def export_twice() -> None:
            for run in range(2):
                await trio.to_thread.run_sync(run_export, spark, export_arguments(shared_cluster, topic, tmp_path / "out",
                                                                                  "--incremental"))
            exports_done.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(keep_producing)
            nursery.start_soon(export_twice)
        sent.extend(results)
    offsets = [result.offset for result in sent]
    assert offsets == list(range(len(sent))), "every send was stored once, in order"
    assert len({result.message_id.ledger_id for result in sent}) >= 3
    rows = exported_rows(spark.read.parquet(str(tmp_path / "out")).drop("run"))
    assert len(rows) >= 50, "the export wrote the closed ledgers' rows"
    by_offset = {result.offset: result for result in sent}
    for key, row in rows.items():
        result = by_offset[row[1]]
        assert (result.message_id.ledger_id, result.message_id.entry_id) == key[1:3]
    # Fenced, the partition would have failed a write, been unloaded and
    # opened again (the client resending quietly): it was opened once.
    assert opened_count(shared_cluster, topic) == 1
    assert not [line for line in topic_log(shared_cluster, topic) if " WARNING " in line or " ERROR " in line]

    # The control: a reader that does fence the open ledger (recovery)
    # makes the next write fail and the partition open again.
    [chain] = read_topic_ledgers(shared_cluster.zk_hosts, shared_cluster.root, topic)
    assert not chain.ledgers[-1].is_closed
    async with BookKeeper.connect(shared_cluster.zk_hosts, shared_cluster.root) as bk:
        await bk.open_ledger(chain.ledgers[-1].ledger_id, b"", recovery=True)
    async with Client.connect(shared_cluster.zk_hosts, shared_cluster.root) as client:
        producer = await client.create_producer(topic, "live")
        with trio.fail_after(30):
            await (await producer.send_async(b"after")).wait()
    assert opened_count(shared_cluster, topic) == 2


def topic_log(cluster, topic: str) -> list[str]:
    return [line for broker in cluster.brokers for line in broker.log_path.read_text(errors="replace").splitlines()
            if topic in line]


def opened_count(cluster, topic: str) -> int:
    return len([line for line in topic_log(cluster, topic) if f"partition {topic} open" in line])


# --- an operator's mistakes and failed jobs: one line ------------------------------------------


async def closed_topic(cluster, topic: str, messages: int = 40) -> None:
    """A topic whose messages are all in closed ledgers (unloaded)."""
    async with Client.connect(cluster.zk_hosts, cluster.root) as client:
        await client.create_topic(topic, **SMALL_LEDGERS)
        producer = await client.create_producer(topic, "closed")
        for number in range(messages):
            await (await producer.send_async(b"m-%d" % number)).wait()
        await client.unload(topic)


async def test_mistakes_are_one_line_before_spark_starts(shared_cluster, tmp_path):
    # Each would need a Spark session to go further; each is found before
    # one starts (the whole test takes seconds, not Spark's start-ups).
    topic = "export-mistakes"
    await closed_topic(shared_cluster, topic)
    cluster = ["--zk", shared_cluster.zk_hosts, "--root", shared_cluster.root]

    def export(*arguments: str):
        return quire("export", *arguments, timeout_s=30)

    began = time.monotonic()
    error_line(export(topic, "--zk", f"127.0.0.1:{free_port()}", "--out", tmp_path / "a"), "could not reach ZooKeeper")
    assert time.monotonic() - began < 15
    typo = f"/typo-{uuid.uuid4().hex}"
    error_line(export(topic, "--zk", shared_cluster.zk_hosts, "--root", typo, "--out", tmp_path / "a"),
               f"no quire cluster under {typo} at {shared_cluster.zk_hosts}")
    store = KazooMetadataStore.connect(shared_cluster.zk_hosts, "/")
    try:
        assert store.exists(typo) is None, "the export only reads ZooKeeper"
    finally:
        store.close()
    error_line(export("no-such-topic", *cluster, "--out", tmp_path / "a"), "no topic 'no-such-topic'")
    error_line(export(topic, *cluster, "--out", tmp_path / "a", "--password", "wrong"), "password", "--ledger-password")
    error_line(export(topic, *cluster, "--out", tmp_path / "a", "--split-bytes", "0"), "--split-bytes")
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "part-0.parquet").write_bytes(b"a plain export")
    error_line(export(topic, *cluster, "--out", plain, "--incremental"), str(plain), "run=")
    locked = tmp_path / "locked"
    locked.mkdir()
    with open(locked / "_lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # as a concurrent incremental run holds it
        error_line(export(topic, *cluster, "--out", locked, "--incremental"), f"another export is writing to {locked}")
    committed = tmp_path / "committed"
    (committed / f"{RUN_PREFIX}1").mkdir(parents=True)
    (committed / f"{RUN_PREFIX}1" / "_quire_manifest.json").write_text("{not json")
    error_line(export(topic, *cluster, "--out", committed, "--incremental"), f"{RUN_PREFIX}1", "manifest")
    assert time.monotonic() - began < 60


async def test_an_empty_directory_is_written_and_nothing_exported_shows_nothing(shared_cluster, spark, tmp_path, capsys):
    topic = "export-empty-directory"
    await closed_topic(shared_cluster, topic)
    out = tmp_path / "empty"
    out.mkdir()
    result = run_export(spark, export_arguments(shared_cluster, topic, out))
    assert result["messages"] == 40 and spark.read.parquet(str(out)).count() == 40
    async with Client.connect(shared_cluster.zk_hosts, shared_cluster.root) as client:
        await client.create_topic("export-nothing")
    arguments = export_arguments(shared_cluster, "export-nothing", tmp_path / "nothing", "--show", "5")
    assert export(arguments) == 0  # without starting Spark: nothing to read
    assert "nothing exported" in capsys.readouterr().out


async def test_a_time_range_counts_the_rows_written(shared_cluster, spark, tmp_path):
    topic = "export-time-range"
    await closed_topic(shared_cluster, topic)
    frame = source(spark, shared_cluster, topic).orderBy("offset").collect()
    middle_ms = int(frame[20].publish_time.replace(tzinfo=datetime.timezone.utc).timestamp() * 1000)
    result = run_export(spark, export_arguments(shared_cluster, topic, tmp_path / "out", "--start-time", str(middle_ms)))
    written = spark.read.parquet(str(tmp_path / "out")).count()
    assert 0 < written < 40 and result["messages"] == written


async def test_a_ledger_deleted_by_retention_during_the_export_is_one_line_and_the_run_is_discarded(
        shared_cluster, spark, tmp_path):
    topic = "export-retention"
    await closed_topic(shared_cluster, topic)
    [chain] = read_topic_ledgers(shared_cluster.zk_hosts, shared_cluster.root, topic)
    victim = chain.ledgers[0].ledger_id

    def session_after_retention():
        # Planned, then the ledger is deleted before Spark reads it.
        with SyncBookKeeper.connect(shared_cluster.zk_hosts, shared_cluster.root) as bk:
            bk.delete_ledger(victim)
        return spark

    out = tmp_path / "out"
    with pytest.raises(ExportFailed) as failure:
        await trio.to_thread.run_sync(run_export, session_after_retention,
                                      export_arguments(shared_cluster, topic, out, "--incremental"))
    assert str(failure.value) == f"ledger {victim} was deleted by retention during the export; run it again"
    assert sorted(path.name for path in out.iterdir()) == ["_lock"], "the pending run was discarded"


def test_a_failed_job_is_one_line_with_its_root_cause():
    # As str() of the PythonException of a failed task reads.
    error = Exception("An exception was thrown from the Python worker:\nTraceback (most recent call last):\n"
                            '  File "x.py", line 6, in read\n    raise NotEnoughBookiesError(...)\n'
                            "ledger_client.errors.EntryReadError: entry 5 of ledger 12: no bookie answered\n")
    assert root_cause(error) == "EntryReadError: entry 5 of ledger 12: no bookie answered"


async def test_the_compacted_view_exports_the_latest_message_of_each_key(shared_cluster, spark, tmp_path):
    from tests.integration.test_compaction import compaction_ended

    topic = "export-compacted"
    async with Client.connect(shared_cluster.zk_hosts, shared_cluster.root) as client:
        await client.create_topic(topic, partitions=2)
        producer = await client.create_producer(topic, batching=True)
        sent = {}
        for round_ in range(5):
            for index in range(8):
                sent[f"key-{index}"] = (await producer.send_async(f"{round_}-{index}".encode(), key=f"key-{index}"),
                                        f"{round_}-{index}".encode())
        latest = {}
        for key, (future, payload) in sent.items():
            result = await future.wait()
            latest[key] = (result.message_id.partition, result.offset, payload)
        await producer.send(b"", key="key-0")  # a tombstone
        del latest["key-0"]
        await producer.send(b"keyless")
        arguments = export_arguments(shared_cluster, topic, tmp_path / "none", "--compacted")
        assert run_export(spark, arguments)["messages"] == 0  # never compacted: nothing
        await client.compact(topic)
        statuses = await compaction_ended(client, topic)
        assert all(status["status"] == "SUCCESS" for status in statuses.values()), statuses
    out = tmp_path / "view"
    result = run_export(spark, export_arguments(shared_cluster, topic, out, "--compacted"))
    rows = spark.read.parquet(str(out)).collect()
    assert result["messages"] == len(rows) == 7
    assert {row.key: (row.partition, row.offset, bytes(row.payload)) for row in rows} == latest
    from_source = source(spark, shared_cluster, topic, compacted="true").collect()
    assert sorted((row.key, row.ledger_id, row.entry_id, row.batch_index) for row in from_source) == \
        sorted((row.key, row.ledger_id, row.entry_id, row.batch_index) for row in rows)


async def test_chunked_messages_are_exported_whole_across_splits_and_ledgers(shared_cluster, spark):
    """A Pulsar producer's chunked messages in ledgers of 4 entries, read in
    splits of about one entry: each message is one row, put together from
    chunks in other splits and other ledgers."""
    import random

    import pulsar

    from tests.integration.test_pulsar_clients import pulsar_client

    topic = "export-chunked"
    async with Client.connect(shared_cluster.zk_hosts, shared_cluster.root) as client:
        await client.create_topic(topic, **SMALL_LEDGERS)

    def produce() -> list[bytes]:
        pulsar_side = pulsar_client(shared_cluster.brokers[0].pulsar_url)
        try:
            producer = pulsar_side.create_producer(f"persistent://public/default/{topic}", chunking_enabled=True,
                                                   batching_enabled=False, compression_type=pulsar.CompressionType.ZSTD)
            rng = random.Random(11)
            payloads = [b"first", rng.randbytes(11 * 1024 * 1024), b"between", rng.randbytes(6 * 1024 * 1024), b"last"]
            for payload in payloads:
                producer.send(payload, partition_key="k")
            return payloads
        finally:
            pulsar_side.close()

    payloads = await trio.to_thread.run_sync(produce)
    async with Client.connect(shared_cluster.zk_hosts, shared_cluster.root) as client:
        await client.unload(topic)  # every ledger closed
    rows = source(spark, shared_cluster, topic, split_bytes=1024).orderBy("offset").collect()
    assert [bytes(row.payload) for row in rows] == payloads
    assert all(row.key == "k" for row in rows)
    assert len({row.ledger_id for row in rows}) > 1
