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
ids), `exclude_ledgers`, `split_bytes` (default 128 MiB), `compacted`
("true": the topic's compacted view, the latest message of each key as of
its last compaction, instead of its ledgers).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import sys
import tempfile
import threading
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Sequence

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
    compacted_chain,
    parse_ledger_ids,
    parse_time_ms,
    plan_splits,
)
from broker.compaction_core import CompactedEntry, CompactionError, CompactionRecord
from broker.entry_types import BodyColumns
from broker.message_format import MalformedEntryError, body_columns, chunk_of, chunked_message, decode_entry
from broker.topic_records import (
    ManagedLedgerRecord,
    TopicRecord,
    check_name,
    compaction_path,
    managed_ledger_path,
    topic_path,
)

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
# Entries may expand 16x and more when decompressed: a record batch is also
# cut at this many payload bytes, far below pa.binary()'s 2 GiB per array.
BATCH_PAYLOAD_BYTES_MAX = 64 * 1024 * 1024
CHUNKS_AHEAD_MAX = 2  # chunks of BATCH_BYTES read ahead of the Arrow building, per split
CHUNKED_MESSAGES_HELD_MAX = 1_000  # chunked messages a split gathers at once (the oldest is dropped past it)
CHUNK_LOOKBACK_ENTRIES = 100_000  # entries read before a split to find a chunked message's earlier chunks
LOOKBACK_READ_ENTRIES = 100  # ... per read
METADATA_TIMEOUT_MS = 5_000  # to connect to ZooKeeper, as every command
JVM_STOP_TIMEOUT_S = 30  # for the driver's JVM to exit once told to


@dataclass(frozen=True)
class SourceOptions:
    zk: str
    root: str
    topic: str
    password: bytes
    selection: Selection
    split_bytes: int
    # What the ledger clients show bookies that authenticate them or serve
    # TLS: a token, and the CA certificates as PEM text (executors need no file).
    auth_token: str | None = None
    tls_trust_certs: str | None = None
    zk_auth: str | None = None  # USER:PASSWORD of ZooKeeper's digest ACLs (option zk_auth_password)
    compacted: bool = False  # the compacted view instead of the ledgers

    def use_zk_auth(self) -> None:
        """This process's ZooKeeper connections authenticate as the option says."""
        if self.zk_auth is not None:
            from coordination.zk_store import set_digest_auth

            set_digest_auth(self.zk_auth)

    def credentials(self):
        from security.credentials import ClientCredentials
        from security.tls import client_context_from_pem

        context = None if self.tls_trust_certs is None else client_context_from_pem(self.tls_trust_certs)
        return ClientCredentials(self.auth_token, context)

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
        compacted = get("compacted", "false").lower()
        if compacted not in ("true", "false"):
            raise ValueError(f"compacted must be true or false, got {compacted[:20]!r}")
        if compacted == "true" and (selection.from_ledger is not None or selection.start_time_ms is not None
                                    or selection.end_time_ms is not None or selection.exclude_ledger_ids):
            raise ValueError("the compacted view is read whole: compacted cannot be combined with from_ledger, "
                             "start_time, end_time or exclude_ledgers")
        return cls(get("zk", "127.0.0.1:2181"), get("root", "/quire"), topic, (get("password", "") or "").encode(),
                   selection, split_bytes, get("auth_token"), get("tls_trust_certs"), get("zk_auth_password"),
                   compacted == "true")


# --- planning (on the driver) -----------------------------------------------------------


class WrongPasswordError(ValueError):
    """The password given does not open the topic's ledgers."""


class LedgerDeletedError(ValueError):
    """A ledger of the plan is gone (retention deleted it since the topic's
    record was read)."""

    def __init__(self, ledger_id: int, partition: str) -> None:
        super().__init__(f"ledger {ledger_id} of {partition} was deleted by retention during the export; run it again")
        self.ledger_id = ledger_id


class ClusterMetadata:
    """Read-only access to a cluster's records in ZooKeeper for planning.
    It connects to the whole tree, not through the chroot (which kazoo would
    create), so that a mistyped --root is reported and never created."""

    def __init__(self, zk: str, root: str) -> None:
        from coordination.zk_store import KazooMetadataStore

        self.zk, self.root = zk, root
        self.store = KazooMetadataStore.connect(zk, "/", connect_timeout_ms=METADATA_TIMEOUT_MS)
        try:
            if self.store.exists(root) is None:
                raise ValueError(f"no quire cluster under {root} at {zk}")
        except BaseException:
            self.store.close()
            raise

    def __enter__(self) -> "ClusterMetadata":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.store.close()

    def _path(self, path: str) -> str:
        return path if self.root == "/" else self.root + path

    def _get(self, path: str) -> bytes:
        return self.store.get(self._path(path))[0]

    def topic_ledgers(self, topic: str) -> list[PartitionLedgers]:
        """Every partition's chain of ledgers, from the brokers' records (no
        broker is asked)."""
        from coordination.store import NoNodeError

        check_name(topic)
        try:
            record = TopicRecord.from_bytes(self._get(topic_path(topic)))
        except NoNodeError:
            raise ValueError(f"no topic {topic!r} in the cluster at {self.zk}{self.root}") from None
        chains = []
        for index, partition in enumerate(record.partition_names(topic)):
            try:
                ledgers = ManagedLedgerRecord.from_bytes(self._get(managed_ledger_path(partition))).ledgers
            except NoNodeError:  # never loaded by a broker: no ledger yet
                ledgers = ()
            chains.append(PartitionLedgers(topic, partition, index if record.partitions else -1, ledgers))
        return chains

    def compacted_ledgers(self, topic: str) -> list[PartitionLedgers]:
        """Every partition's compacted view, as a chain of its one ledger
        (none for a partition never compacted)."""
        from coordination.store import NoNodeError

        chains = []
        for chain in self.topic_ledgers(topic):
            try:
                record = CompactionRecord.from_dict(json.loads(self._get(compaction_path(chain.partition))))
            except NoNodeError:
                record = None
            chains.append(compacted_chain(topic, chain.partition, chain.partition_index, record))
        return chains

    def chains(self, topic: str, compacted: bool) -> list[PartitionLedgers]:
        return self.compacted_ledgers(topic) if compacted else self.topic_ledgers(topic)

    def check_ledgers(self, splits: Sequence[LedgerSplit], password: bytes) -> None:
        """Check on the driver what each worker would find out alone, one
        failed task at a time: every planned ledger still exists, opens with
        `password`, and is closed with the entry count of its partition's
        record."""
        from coordination.cluster_layout import ledger_path
        from coordination.store import NoNodeError
        from ledger_client.metadata import LedgerMetadata

        checked = set()
        for split in splits:
            if split.ledger_id in checked:
                continue
            checked.add(split.ledger_id)
            try:
                metadata = LedgerMetadata.from_bytes(self._get(ledger_path(split.ledger_id)))
            except NoNodeError:
                raise LedgerDeletedError(split.ledger_id, split.partition) from None
            if not metadata.check_password(password):
                raise WrongPasswordError(f"the password does not open ledger {split.ledger_id} of {split.partition}: "
                                         f"give the brokers' --ledger-password")
            if not metadata.is_closed or metadata.last_entry_id != split.ledger_entries - 1:
                raise ValueError(f"ledger {split.ledger_id} of {split.partition} is not closed with "
                                 f"{split.ledger_entries} entries as its partition's record says")

    def missing_ledgers(self, ledger_ids: Iterable[int]) -> list[int]:
        """Which of `ledger_ids` have no metadata any more."""
        from coordination.cluster_layout import ledger_path

        return [ledger_id for ledger_id in sorted(set(ledger_ids))
                if self.store.exists(self._path(ledger_path(ledger_id))) is None]


def read_topic_ledgers(zk: str, root: str, topic: str) -> list[PartitionLedgers]:
    """Every partition's chain of ledgers, from the brokers' records in
    ZooKeeper (no broker is asked)."""
    with ClusterMetadata(zk, root) as cluster:
        return cluster.topic_ledgers(topic)


def plan(options: SourceOptions) -> list[LedgerSplit]:
    options.use_zk_auth()
    with ClusterMetadata(options.zk, options.root) as cluster:
        chains = cluster.chains(options.topic, options.compacted)
        splits = plan_splits(chains, options.selection, options.split_bytes)
        wanted = options.selection.ledger_ids
        if wanted is not None:
            missing = wanted - {split.ledger_id for split in splits}
            if missing:
                raise ValueError(f"ledgers {sorted(missing)} are not closed ledgers of topic {options.topic!r} "
                                 f"(deleted by retention since, or not closed yet)")
        cluster.check_ledgers(splits, options.password)
    return splits


# --- reading (on the workers) ---------------------------------------------------------------


class _Clients:
    """One ledger client per cluster per Python worker process, reused by
    every split the worker reads (Spark reuses its Python workers): a
    ZooKeeper session and bookie connections are made once, not per split."""

    _lock = threading.Lock()
    _loops: dict[tuple, "LoopThread"] = {}

    @classmethod
    def get(cls, options: "SourceOptions") -> "LoopThread":
        from ledger_client.bookkeeper import BookKeeper
        from ledger_client.sync import LoopThread

        zk, root = options.zk, options.root
        key = (zk, root, options.auth_token, options.tls_trust_certs, os.getpid())  # a forked worker needs its own
        with cls._lock:
            loop = cls._loops.get(key)
            if loop is None or not loop._thread.is_alive():
                credentials = options.credentials()
                loop = LoopThread(lambda: BookKeeper.connect(zk, root, credentials=credentials))
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


def _unwrapped(split: LedgerSplit, data: bytes) -> tuple[int | None, tuple[int, ...] | None, int | None, bytes]:
    """(original ledger id, kept batch indexes, original entry id, entry)
    of an entry of the split's ledger: a compacted view's entry is an
    original entry and the messages of it the view keeps."""
    if not split.compacted:
        return None, None, None, data
    compacted = CompactedEntry.from_bytes(data)
    return compacted.ledger_id, compacted.retained, compacted.entry_id, compacted.data


class ChunkGather:
    """A split's chunked messages, put together as a consumer does: a
    message is the split's whose last chunk it holds; chunks before the
    split are looked for by `lookback` (uuid, chunk ids -> payloads)."""

    def __init__(self, split: LedgerSplit, lookback: Callable[[str, set[int]], dict[int, bytes]] | None = None) -> None:
        self.split = split
        self.lookback = lookback
        self._held: dict[str, dict[int, bytes]] = {}

    def add(self, header: Any, body: Any) -> BodyColumns | None:
        """The message a chunk completes (one row), or None."""
        chunk = chunk_of(header, body)
        assert chunk is not None
        held = self._held.setdefault(chunk.uuid, {})
        held[chunk.chunk_id] = chunk.payload
        while len(self._held) > CHUNKED_MESSAGES_HELD_MAX:
            del self._held[next(iter(self._held))]
        if chunk.chunk_id != chunk.chunks - 1:
            return None
        del self._held[chunk.uuid]
        missing = set(range(chunk.chunks)) - held.keys()
        if missing and self.lookback is not None:
            held.update(self.lookback(chunk.uuid, missing))
        if len(held) != chunk.chunks or set(held) != set(range(chunk.chunks)):
            log.error("chunked message %s of %s is missing chunks %s: skipped (as consumers skip it)", chunk.uuid,
                      self.split.partition, sorted(set(range(chunk.chunks)) - held.keys())[:10])
            return None
        sequence_id, publish_ms, properties, payload, _ = chunked_message(header, body, [held[index] for index in range(chunk.chunks)])
        return BodyColumns((sequence_id,), (publish_ms,), (properties or None,), (payload,))


def entries_to_batches(split: LedgerSplit, entries: Sequence, selection: Selection = Selection(),
                       payload_bytes_max: int = BATCH_PAYLOAD_BYTES_MAX,
                       chunks: ChunkGather | None = None) -> Iterator[pa.RecordBatch]:
    """The rows of `entries` (one ledger's, in order) as record batches:
    every message of each entry, decompressed, as a consumer receives it
    (a chunked message once, in the row of its last chunk; `chunks` holds
    what came of it across calls). A batch is cut once its payloads hold
    `payload_bytes_max` decompressed bytes (an entry is never cut), so that
    a chunk of well-compressed entries cannot make one huge batch. A
    malformed entry is skipped, as a consumer's client skips it."""
    columns = _Columns()
    chunks = chunks or ChunkGather(split)
    timed = selection.start_time_ms is not None or selection.end_time_ms is not None
    for entry in entries:
        entry_id, data = entry.entry_id, entry.data
        try:
            original_ledger_id, kept, original_entry_id, data = _unwrapped(split, data)
            if original_entry_id is not None:
                entry_id = original_entry_id
            header, body = decode_entry(data)
            if header.chunked:
                body_data = chunks.add(header, body)
                if body_data is None:
                    continue
            if timed and not selection.keeps_entry(header.publish_time_ms):
                continue
            if not header.chunked:
                body_data = body_columns(header, body)
        except (MalformedEntryError, CompactionError) as error:
            log.error("ledger %d entry %d of %s is malformed and skipped (as consumers skip it): %s",
                      split.ledger_id, entry.entry_id, split.partition, error)
            continue
        if entry.entry_id == 0 and not split.compacted and header.first_offset != split.ledger_first_offset:
            raise RuntimeError(f"ledger {split.ledger_id} of {split.partition} starts at offset {header.first_offset}, "
                               f"its partition's record says {split.ledger_first_offset}")
        if split.compacted:
            columns.add_kept(entry_id, original_ledger_id, header, body_data, (0,) if header.chunked else kept)
        else:
            columns.add(entry_id, header, body_data)
        if columns.payload_bytes >= payload_bytes_max:
            yield columns.to_batch(split)
            columns = _Columns()
    if columns.entry_ids:
        yield columns.to_batch(split)


class _Columns:
    """The columns of one record batch being gathered, per entry (C-level
    extends); per-row numbers are made by numpy at the end: no Python
    object per row besides what msgpack makes."""

    def __init__(self) -> None:
        self.entry_ids: list[int] = []  # one per entry kept, with its message count
        self.counts: list[int] = []
        self.first_offsets: list[int] = []
        self.producer_ids: list[str] = []
        self.publish_ms: list[int] = []
        self.sequence_ids: list[int] = []
        self.keys: list[str | None] = []
        self.properties: list[dict[str, str] | None] = []
        self.payloads: list[bytes] = []
        self.payload_bytes = 0
        # A compacted view's rows: each one's batch index and original
        # ledger (None: every message of each entry, of the split's ledger).
        self.batch_indexes: list[int] | None = None
        self.ledger_ids: list[int] | None = None

    def add(self, entry_id: int, header: Any, body: Any) -> None:
        count = header.message_count
        self.entry_ids.append(entry_id)
        self.counts.append(count)
        self.first_offsets.append(header.first_offset)
        self.producer_ids.append(header.producer_id)
        self.sequence_ids.extend(body.sequence_ids)
        self.publish_ms.extend(body.publish_times_ms)
        self.properties.extend(body.properties)
        self.payloads.extend(body.payloads)
        self.payload_bytes += sum(map(len, body.payloads))
        self.keys.extend(header.keys if header.keys is not None else (None,) * count)

    def add_kept(self, entry_id: int, ledger_id: int, header: Any, body: Any, kept: Sequence[int]) -> None:
        """The messages `kept` (batch indexes) of an entry of `ledger_id`."""
        if self.batch_indexes is None:
            self.batch_indexes, self.ledger_ids = [], []
        assert self.ledger_ids is not None
        count = len(kept)
        self.entry_ids.append(entry_id)
        self.counts.append(count)
        self.first_offsets.append(header.first_offset)
        self.producer_ids.append(header.producer_id)
        self.batch_indexes.extend(kept)
        self.ledger_ids.extend([ledger_id] * count)
        for index in kept:
            self.sequence_ids.append(body.sequence_ids[index])
            self.publish_ms.append(body.publish_times_ms[index])
            self.properties.append(body.properties[index])
            self.payloads.append(body.payloads[index])
            self.payload_bytes += len(body.payloads[index])
            self.keys.append(header.keys[index] if header.keys is not None else None)

    def to_batch(self, split: LedgerSplit) -> pa.RecordBatch:
        rows = len(self.payloads)
        counts_array = np.array(self.counts, dtype=np.int64)
        entry_starts = np.cumsum(counts_array) - counts_array  # row of each entry's first message
        if self.batch_indexes is not None:
            batch_indexes = np.array(self.batch_indexes, dtype=np.int64)
        else:
            batch_indexes = np.arange(rows, dtype=np.int64) - np.repeat(entry_starts, counts_array)
        offsets = np.repeat(np.array(self.first_offsets, dtype=np.int64), counts_array) + batch_indexes
        entry_index = np.repeat(np.arange(len(self.counts), dtype=np.int32), counts_array)
        property_counts = np.fromiter(map(_map_size, self.properties), dtype=np.int32, count=rows)
        property_offsets = np.concatenate(([0], np.cumsum(property_counts, dtype=np.int32)))
        present = [item for item in self.properties if item]
        columns = [
            pa.repeat(pa.scalar(split.topic, pa.string()), rows),
            pa.repeat(pa.scalar(split.partition_index, pa.int32()), rows),
            pa.array(offsets, pa.int64()),
            (pa.repeat(pa.scalar(split.ledger_id, pa.int64()), rows) if self.ledger_ids is None
             else pa.array(self.ledger_ids, pa.int64())),
            pa.array(np.repeat(np.array(self.entry_ids, dtype=np.int64), counts_array), pa.int64()),
            pa.array(batch_indexes.astype(np.int32), pa.int32()),
            pa.array(self.publish_ms, pa.timestamp("ms", tz="UTC")).cast(pa.timestamp("us", tz="UTC")),
            pa.DictionaryArray.from_arrays(pa.array(entry_index), pa.array(self.producer_ids, pa.string())).cast(pa.string()),
            pa.array(self.sequence_ids, pa.int64()),
            pa.array(self.keys, pa.string()),
            pa.MapArray.from_arrays(pa.array(property_offsets, pa.int32()),
                                    pa.array(list(itertools.chain.from_iterable(present)), pa.string()),
                                    pa.array(list(itertools.chain.from_iterable(map(dict.values, present))), pa.string())),
            pa.array(self.payloads, pa.binary()),
        ]
        return pa.RecordBatch.from_arrays(columns, schema=ARROW_SCHEMA)


def _map_size(item: dict | None) -> int:
    return len(item) if item else 0


def read_split(split: LedgerSplit, options: SourceOptions) -> Iterator[pa.RecordBatch]:
    options.use_zk_auth()
    loop = _Clients.get(options)
    chunks = ChunkGather(split, lambda uuid, missing: look_back(loop, split, options.password, uuid, missing))
    for entries in LedgerRangeReader(loop, split, options.password).chunks():
        yield from entries_to_batches(split, entries, options.selection, chunks=chunks)


def look_back(loop: "LoopThread", split: LedgerSplit, password: bytes, uuid: str, missing: set[int]) -> dict[int, bytes]:
    """Chunks `missing` of chunked message `uuid`, looked for before the
    split (its ledger, then the ledgers before it, nearest first), within
    CHUNK_LOOKBACK_ENTRIES entries."""
    found: dict[int, bytes] = {}
    places = [(split.ledger_id, split.first_entry_id)] + [(ledger_id, entries) for ledger_id, entries in reversed(split.previous_ledgers)]
    budget = CHUNK_LOOKBACK_ENTRIES
    for ledger_id, end in places:
        while end > 0 and budget > 0 and missing - found.keys():
            first = max(0, end - LOOKBACK_READ_ENTRIES)
            entries = loop.call(_read_range, loop.value, ledger_id, password, first, end - 1)
            budget -= len(entries)
            end = first
            for entry in reversed(entries):
                try:
                    _, _, _, data = _unwrapped(split, entry.data)
                    header, body = decode_entry(data)
                    chunk = chunk_of(header, body)
                except (MalformedEntryError, CompactionError):
                    continue
                if chunk is not None and chunk.uuid == uuid and chunk.chunk_id in missing:
                    found.setdefault(chunk.chunk_id, chunk.payload)
        if not missing - found.keys() or budget <= 0:
            break
    return found


async def _read_range(bk, ledger_id: int, password: bytes, first: int, last: int) -> list:
    handle = await bk.open_ledger(ledger_id, password, recovery=False)
    return [entry async for entry in handle.read(first, last)]


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


# Spark's own log, for a command line: nothing (a failed job is reported in
# one line by the caller). The root level stays WARN, as the one PySpark's
# start-up assumes, so that it does not announce the level it sets.
QUIET_LOG4J2 = """\
rootLogger.level = warn
rootLogger.appenderRef.stderr.ref = console
appender.console.type = Console
appender.console.name = console
appender.console.target = SYSTEM_ERR
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = %d{yy/MM/dd HH:mm:ss} %p %c{1}: %m%n%ex
appender.console.filter.threshold.type = ThresholdFilter
appender.console.filter.threshold.level = off
"""
# What the JVM itself prints at start, before any log configuration.
JVM_NOISE = ("WARNING: Using incubator modules",)


def spark_session(master: str = "local[2]", app_name: str = "quire", config: dict[str, str] | None = None,
                  *, quiet: bool = False, python: str | None = None,
                  launch_directory: "os.PathLike[str] | None" = None) -> "SparkSession":
    """A Spark session with the data source registered. With a local
    master, its Python workers run this interpreter (so that they import
    quire's packages) and everything binds to loopback; a real cluster's
    executors need quire (quire.spark_shipping ships it). `python` is the
    Python workers run (PySpark reads it from PYSPARK_PYTHON as the session
    starts); the driver's JVM starts in `launch_directory`, relative to
    which a relative `python` runs on the driver's side. `quiet` silences
    Spark's log and the JVM's start-up lines (the command line's choice)."""
    from pyspark.sql import SparkSession

    # PySpark warns about pandas 3 on every session; the data source uses Arrow only.
    warnings.filterwarnings("ignore", message="PySpark does not yet fully support pandas")
    config = dict(config or {})
    local = master.startswith("local")
    if local:
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    builder = (SparkSession.builder.master(master).appName(app_name)
               .config("spark.ui.enabled", "false")
               .config("spark.sql.session.timeZone", "UTC")
               .config("spark.ui.showConsoleProgress", "false"))
    if local:
        builder = builder.config("spark.driver.host", "127.0.0.1").config("spark.driver.bindAddress", "127.0.0.1")
    with contextlib.ExitStack() as stack:
        if quiet:
            log_config = stack.enter_context(tempfile.NamedTemporaryFile("w", prefix="quire-log4j2-", suffix=".properties"))
            log_config.write(QUIET_LOG4J2)
            log_config.flush()
            option = f"-Dlog4j2.configurationFile=file:{log_config.name}"
            java_options = config.get("spark.driver.extraJavaOptions")
            config["spark.driver.extraJavaOptions"] = f"{java_options} {option}" if java_options else option
            stack.enter_context(_children_stderr_filtered(JVM_NOISE))
        for name, value in config.items():
            builder = builder.config(name, value)
        if python is not None:
            stack.enter_context(_environment_variable("PYSPARK_PYTHON", python))
        if launch_directory is not None:
            stop_jvm()  # PySpark keeps its JVM for the next session: one started elsewhere would not do
            stack.enter_context(contextlib.chdir(launch_directory))
        spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    register(spark)
    return spark


def stop_jvm() -> None:
    """End the JVM PySpark keeps in this process between sessions (when no
    session runs), so that the next session starts a new one: in its own
    working directory."""
    from pyspark import SparkContext

    gateway = SparkContext._gateway
    if gateway is None or SparkContext._active_spark_context is not None:
        return
    gateway.shutdown()
    process = getattr(gateway, "proc", None)
    if process is not None:
        process.stdin.close()  # the JVM exits when its standard input ends
        process.wait(timeout=JVM_STOP_TIMEOUT_S)
    SparkContext._gateway = None
    SparkContext._jvm = None


@contextlib.contextmanager
def _environment_variable(name: str, value: str) -> Iterator[None]:
    """`name` set to `value` meanwhile, then as it was."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


@contextlib.contextmanager
def _children_stderr_filtered(noise: Sequence[str]) -> Iterator[None]:
    """Processes started meanwhile (the JVM, and through it Python workers)
    write their standard error through a pipe that drops lines starting
    with `noise`; this process's own standard error is restored after."""
    read_fd, write_fd = os.pipe()
    original_fd = os.dup(2)  # where the thread forwards to, for as long as the children live
    restore_fd = os.dup(2)

    def forward() -> None:
        with os.fdopen(read_fd, "rb") as lines, os.fdopen(original_fd, "wb", buffering=0) as target:
            for line in lines:
                if not line.decode(errors="replace").startswith(tuple(noise)):
                    target.write(line)

    threading.Thread(target=forward, name="jvm-stderr", daemon=True).start()
    sys.stderr.flush()
    os.dup2(write_fd, 2)
    os.close(write_fd)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(restore_fd, 2)
        os.close(restore_fd)


__all__ = [
    "ARROW_SCHEMA",
    "NAME",
    "SCHEMA",
    "QuireDataSource",
    "SourceOptions",
    "entries_to_batches",
    "plan",
    "read_split",
    "read_topic_ledgers",
    "register",
    "spark_session",
]
