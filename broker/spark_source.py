"""The Spark data source `quire`: a topic's closed ledgers read straight from
the bookies, without a broker, each opened without recovery (nothing is
ever fenced), one input partition per ledger or per entry range of a large
one, rows built as Arrow record batches.

    from broker.spark_source import register
    register(spark)
    df = spark.read.format("quire").option("zk", "127.0.0.1:2181").option("topic", "orders").load()

Options: `zk`, `root` (default /quire), `topic`; `password` (the brokers'
--ledger-password), `from_ledger`, `start_time`/`end_time` (ms or ISO 8601;
the brokers' append times, as a seek by publish time), `ledgers` (only these
ids), `exclude_ledgers`, `split_bytes` (default 128 MiB).
"""

from __future__ import annotations

import itertools
import logging
import os
import sys
import threading
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import numpy as np
import pyarrow as pa
from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition
from pyspark.sql.pandas.types import to_arrow_schema
from pyspark.sql.types import (
    BinaryType,
    IntegerType,
    LongType,
    MapType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from broker.export_plan import (
    SPLIT_BYTES_DEFAULT,
    LedgerSplit,
    PartitionLedgers,
    Selection,
    parse_ledger_ids,
    parse_time_ms,
    plan_splits,
)
from broker.message_format import MalformedEntryError, body_columns, decode_entry
from broker.topic_store import ManagedLedgerRecord, TopicRecord, check_name, managed_ledger_path, topic_path

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from ledger_client.sync import LoopThread

log = logging.getLogger(__name__)

NAME = "quire"
SCHEMA = StructType([
    StructField("topic", StringType()),
    StructField("partition", IntegerType()),  # partition index; -1 for a topic that is not partitioned
    StructField("offset", LongType()),  # partition offset
    StructField("ledger_id", LongType()),
    StructField("entry_id", LongType()),
    StructField("batch_index", IntegerType()),
    StructField("publish_time", TimestampType()),  # the producer's
    StructField("producer_id", StringType()),
    StructField("sequence_id", LongType()),
    StructField("key", StringType()),
    StructField("properties", MapType(StringType(), StringType())),
    StructField("payload", BinaryType()),  # decompressed
])
ARROW_SCHEMA = to_arrow_schema(SCHEMA, timezone="UTC")
# A record batch is cut once its entries hold this much: big enough that
# the per-batch costs vanish, small enough for a worker's memory.
BATCH_BYTES = 8 * 1024 * 1024
CHUNKS_AHEAD_MAX = 2  # chunks of BATCH_BYTES read ahead of the Arrow building, per split
METADATA_TIMEOUT_MS = 10_000


@dataclass(frozen=True)
class SourceOptions:
    zk: str
    root: str
    topic: str
    password: bytes
    selection: Selection
    split_bytes: int

    @classmethod
    def parse(cls, options: dict[str, str]) -> "SourceOptions":
        def get(name: str, default: str | None = None) -> str | None:
            value = options.get(name)
            return default if value is None or value == "" else value

        topic = get("topic")
        if topic is None:
            raise ValueError("the quire data source needs the option topic")
        check_name(topic)
        from_ledger = get("from_ledger")
        split_bytes = int(get("split_bytes", str(SPLIT_BYTES_DEFAULT)))
        if split_bytes < 1:
            raise ValueError(f"split_bytes must be positive, got {split_bytes}")
        selection = Selection(
            from_ledger=None if from_ledger is None else int(from_ledger),
            start_time_ms=parse_time_ms(get("start_time"), "start_time"),
            end_time_ms=parse_time_ms(get("end_time"), "end_time"),
            ledger_ids=parse_ledger_ids(get("ledgers")),
            exclude_ledger_ids=parse_ledger_ids(get("exclude_ledgers")) or frozenset(),
        )
        return cls(get("zk", "127.0.0.1:2181"), get("root", "/quire"), topic, (get("password", "") or "").encode(),
                   selection, split_bytes)


# --- planning (on the driver) -----------------------------------------------------------


def read_topic_ledgers(zk: str, root: str, topic: str) -> list[PartitionLedgers]:
    """Every partition's chain of ledgers, from the brokers' records in
    ZooKeeper (no broker is asked)."""
    from coordination.store import NoNodeError
    from coordination.zk_store import KazooMetadataStore

    store = KazooMetadataStore.connect(zk, root, connect_timeout_ms=METADATA_TIMEOUT_MS)
    try:
        try:
            data, _ = store.get(topic_path(topic))
        except NoNodeError:
            raise ValueError(f"no topic {topic!r} in the cluster at {zk}{root}") from None
        record = TopicRecord.from_bytes(data)
        chains = []
        for index, partition in enumerate(record.partition_names(topic)):
            try:
                data, _ = store.get(managed_ledger_path(partition))
                ledgers = ManagedLedgerRecord.from_bytes(data).ledgers
            except NoNodeError:  # never loaded by a broker: no ledger yet
                ledgers = ()
            chains.append(PartitionLedgers(topic, partition, index if record.partitions else -1, ledgers))
        return chains
    finally:
        store.close()


def plan(options: SourceOptions) -> list[LedgerSplit]:
    chains = read_topic_ledgers(options.zk, options.root, options.topic)
    splits = plan_splits(chains, options.selection, options.split_bytes)
    wanted = options.selection.ledger_ids
    if wanted is not None:
        missing = wanted - {split.ledger_id for split in splits}
        if missing:
            raise ValueError(f"ledgers {sorted(missing)} are not closed ledgers of topic {options.topic!r} "
                             f"(deleted by retention since, or not closed yet)")
    return splits


# --- reading (on the workers) ---------------------------------------------------------------


class _Clients:
    """One ledger client per cluster per Python worker process, reused by
    every split the worker reads (Spark reuses its Python workers): a
    ZooKeeper session and bookie connections are made once, not per split."""

    _lock = threading.Lock()
    _loops: dict[tuple[str, str, int], "LoopThread"] = {}

    @classmethod
    def get(cls, zk: str, root: str) -> "LoopThread":
        from ledger_client.bookkeeper import BookKeeper
        from ledger_client.sync import LoopThread

        key = (zk, root, os.getpid())  # a forked worker needs its own
        with cls._lock:
            loop = cls._loops.get(key)
            if loop is None or not loop._thread.is_alive():
                loop = LoopThread(lambda: BookKeeper.connect(zk, root))
                cls._loops[key] = loop
            return loop


class LedgerRangeReader:
    """Entries of one split, read in the worker's ledger client loop by a
    task that keeps up to CHUNKS_AHEAD_MAX chunks ready while the caller
    builds Arrow batches from the previous one."""

    def __init__(self, loop: "LoopThread", split: LedgerSplit, password: bytes, chunk_bytes: int = BATCH_BYTES) -> None:
        self.loop = loop
        self.split = split
        self.password = password
        self.chunk_bytes = chunk_bytes

    def chunks(self) -> Iterator[list]:
        receive, cancel_scope = self.loop.call(self._start)
        try:
            while True:
                item = self.loop.call(receive.receive)
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self.loop.call_sync(cancel_scope.cancel)

    async def _start(self):
        import trio

        bk = self.loop.value
        send, receive = trio.open_memory_channel(CHUNKS_AHEAD_MAX)
        cancel_scope = trio.CancelScope()
        bk.nursery.start_soon(self._read, bk, send, cancel_scope)
        return receive, cancel_scope

    async def _read(self, bk, send, cancel_scope) -> None:
        import trio

        split = self.split
        with cancel_scope:
            async with send:
                try:
                    handle = await bk.open_ledger(split.ledger_id, self.password, recovery=False)
                    if not handle.is_closed:
                        raise RuntimeError(f"ledger {split.ledger_id} of {split.partition} is not closed in its metadata; "
                                           f"an export reads closed ledgers only")
                    if handle.last_add_confirmed != split.ledger_entries - 1:
                        raise RuntimeError(f"ledger {split.ledger_id} of {split.partition} holds entries up to "
                                           f"{handle.last_add_confirmed}, its partition's record says {split.ledger_entries}")
                    chunk, chunk_bytes = [], 0
                    async for entry in handle.read(split.first_entry_id, split.last_entry_id):
                        chunk.append(entry)
                        chunk_bytes += len(entry.data)
                        if chunk_bytes >= self.chunk_bytes:
                            await send.send(chunk)
                            chunk, chunk_bytes = [], 0
                    if chunk:
                        await send.send(chunk)
                    await send.send(None)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass
                except Exception as error:  # handed to the worker's thread, raised there
                    try:
                        await send.send(error)
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        pass


def entries_to_batch(split: LedgerSplit, entries: Sequence, selection: Selection = Selection()) -> pa.RecordBatch | None:
    """The rows of `entries` (one ledger's, in order) as one record batch:
    every message of each entry, decompressed, as a consumer receives it.
    A malformed entry is skipped, as a consumer's client skips it. Columns
    are gathered per entry (C-level extends) and per-row numbers made by
    numpy: no Python object per row besides what msgpack makes."""
    entry_ids: list[int] = []  # one per entry kept, with its message count
    counts: list[int] = []
    first_offsets: list[int] = []
    producer_ids: list[str] = []
    publish_ms: list[int] = []
    sequence_ids: list[int] = []
    keys: list[str | None] = []
    properties: list[dict[str, str] | None] = []
    payloads: list[bytes] = []
    timed = selection.start_time_ms is not None or selection.end_time_ms is not None
    for entry in entries:
        try:
            header, body = decode_entry(entry.data)
            if timed and not selection.keeps_entry(header.publish_time_ms):
                continue
            columns = body_columns(header, body)
        except MalformedEntryError as error:
            log.error("ledger %d entry %d of %s is malformed and skipped (as consumers skip it): %s",
                      split.ledger_id, entry.entry_id, split.partition, error)
            continue
        if entry.entry_id == 0 and header.first_offset != split.ledger_first_offset:
            raise RuntimeError(f"ledger {split.ledger_id} of {split.partition} starts at offset {header.first_offset}, "
                               f"its partition's record says {split.ledger_first_offset}")
        count = header.message_count
        entry_ids.append(entry.entry_id)
        counts.append(count)
        first_offsets.append(header.first_offset)
        producer_ids.append(header.producer_id)
        sequence_ids.extend(columns.sequence_ids)
        publish_ms.extend(columns.publish_times_ms)
        properties.extend(columns.properties)
        payloads.extend(columns.payloads)
        keys.extend(header.keys if header.keys is not None else (None,) * count)
    rows = len(payloads)
    if rows == 0:
        return None
    counts_array = np.array(counts, dtype=np.int64)
    entry_starts = np.cumsum(counts_array) - counts_array  # row of each entry's first message
    batch_indexes = np.arange(rows, dtype=np.int64) - np.repeat(entry_starts, counts_array)
    offsets = np.repeat(np.array(first_offsets, dtype=np.int64), counts_array) + batch_indexes
    entry_index = np.repeat(np.arange(len(counts), dtype=np.int32), counts_array)
    property_counts = np.fromiter(map(_map_size, properties), dtype=np.int32, count=rows)
    property_offsets = np.concatenate(([0], np.cumsum(property_counts, dtype=np.int32)))
    present = [item for item in properties if item]
    columns = [
        pa.repeat(pa.scalar(split.topic, pa.string()), rows),
        pa.repeat(pa.scalar(split.partition_index, pa.int32()), rows),
        pa.array(offsets, pa.int64()),
        pa.repeat(pa.scalar(split.ledger_id, pa.int64()), rows),
        pa.array(np.repeat(np.array(entry_ids, dtype=np.int64), counts_array), pa.int64()),
        pa.array(batch_indexes.astype(np.int32), pa.int32()),
        pa.array(publish_ms, pa.timestamp("ms", tz="UTC")).cast(pa.timestamp("us", tz="UTC")),
        pa.DictionaryArray.from_arrays(pa.array(entry_index), pa.array(producer_ids, pa.string())).cast(pa.string()),
        pa.array(sequence_ids, pa.int64()),
        pa.array(keys, pa.string()),
        pa.MapArray.from_arrays(pa.array(property_offsets, pa.int32()),
                                pa.array(list(itertools.chain.from_iterable(present)), pa.string()),
                                pa.array(list(itertools.chain.from_iterable(map(dict.values, present))), pa.string())),
        pa.array(payloads, pa.binary()),
    ]
    return pa.RecordBatch.from_arrays(columns, schema=ARROW_SCHEMA)


def _map_size(item: dict | None) -> int:
    return len(item) if item else 0


def read_split(split: LedgerSplit, options: SourceOptions) -> Iterator[pa.RecordBatch]:
    loop = _Clients.get(options.zk, options.root)
    for chunk in LedgerRangeReader(loop, split, options.password).chunks():
        batch = entries_to_batch(split, chunk, options.selection)
        if batch is not None:
            yield batch


# --- the Spark data source -----------------------------------------------------------------


class SplitPartition(InputPartition):
    def __init__(self, split: LedgerSplit) -> None:
        super().__init__(split)
        self.split = split


class QuireReader(DataSourceReader):
    def __init__(self, options: SourceOptions) -> None:
        self.options = options

    def partitions(self) -> list[InputPartition]:
        return [SplitPartition(split) for split in plan(self.options)]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        if not isinstance(partition, SplitPartition):
            # Spark reads one empty partition when the plan has none.
            assert partition.value is None, partition
            return
        yield from read_split(partition.split, self.options)


class QuireDataSource(DataSource):
    """`spark.read.format("quire")`: see the module's docstring."""

    @classmethod
    def name(cls) -> str:
        return NAME

    def schema(self) -> StructType:
        return SCHEMA

    def reader(self, schema: StructType) -> DataSourceReader:
        return QuireReader(SourceOptions.parse(dict(self.options)))


def register(spark: "SparkSession") -> None:
    """Make `spark.read.format("quire")` available in this session."""
    spark.dataSource.register(QuireDataSource)


def spark_session(master: str = "local[2]", app_name: str = "quire", config: dict[str, str] | None = None) -> "SparkSession":
    """A Spark session whose Python workers run this interpreter (so that
    they import quire's packages), with the data source registered."""
    from pyspark.sql import SparkSession

    # PySpark warns about pandas 3 on every session; the data source uses Arrow only.
    warnings.filterwarnings("ignore", message="PySpark does not yet fully support pandas")
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    builder = (SparkSession.builder.master(master).appName(app_name)
               .config("spark.ui.enabled", "false")
               .config("spark.sql.session.timeZone", "UTC")
               .config("spark.ui.showConsoleProgress", "false"))
    if master.startswith("local"):
        builder = builder.config("spark.driver.host", "127.0.0.1").config("spark.driver.bindAddress", "127.0.0.1")
    for name, value in (config or {}).items():
        builder = builder.config(name, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    register(spark)
    return spark


__all__ = [
    "ARROW_SCHEMA",
    "NAME",
    "SCHEMA",
    "QuireDataSource",
    "SourceOptions",
    "entries_to_batch",
    "plan",
    "read_split",
    "read_topic_ledgers",
    "register",
    "spark_session",
]
