"""What a Spark export of a topic reads, as pure functions: which ledgers
(closed ones only, never the open one; or the compacted views' ledgers), how
a large ledger is cut into entry ranges of about `split_bytes` each, and
what an incremental export already wrote. No ZooKeeper, no bookie: the records come in, the plan goes out."""

from __future__ import annotations

import datetime
import math
from dataclasses import dataclass
from typing import Iterable, Sequence

from broker.compaction_core import CompactionRecord
from broker.topic_records import LedgerInfo

# Spark's own default for file splits (spark.sql.files.maxPartitionBytes).
SPLIT_BYTES_DEFAULT = 128 * 1024 * 1024
# A chunked message whose last chunk is in a split is put together there,
# its earlier chunks looked for before the split: in its ledger and in at
# most this many ledgers before it.
CHUNK_LOOKBACK_LEDGERS = 2


@dataclass(frozen=True, slots=True)
class PartitionLedgers:
    """One partition's chain of ledgers, as its managed ledger record lists it."""

    topic: str
    partition: str  # its name: the topic itself, or `<topic>-partition-<i>`
    partition_index: int  # -1 for a topic that is not partitioned
    ledgers: tuple[LedgerInfo, ...]
    compacted: bool = False  # the ledger is the partition's compacted view (broker.compaction_core)


@dataclass(frozen=True, slots=True)
class LedgerSplit:
    """One input partition of the export: entries first..last (inclusive)
    of one closed ledger."""

    topic: str
    partition: str
    partition_index: int
    ledger_id: int
    first_entry_id: int
    last_entry_id: int
    ledger_first_offset: int  # partition offset of the ledger's first message
    ledger_entries: int
    bytes: int  # estimated from the ledger's size and entry count
    compacted: bool = False  # entries of a compacted view: each an original entry and the messages it keeps
    # (ledger id, entries) of the closed ledgers before this one in its
    # chain, the nearest last, where earlier chunks of a chunked message are looked for.
    previous_ledgers: tuple[tuple[int, int], ...] = ()

    @property
    def entries(self) -> int:
        return self.last_entry_id - self.first_entry_id + 1


@dataclass(frozen=True, slots=True)
class Selection:
    """Which closed ledgers to read. Times are the broker's append times in
    ms since the epoch (as a consumer's seek by publish time uses them);
    `end_time_ms` is exclusive."""

    from_ledger: int | None = None
    start_time_ms: int | None = None
    end_time_ms: int | None = None
    ledger_ids: frozenset[int] | None = None  # only these (None: any)
    exclude_ledger_ids: frozenset[int] = frozenset()  # already exported

    def __post_init__(self) -> None:
        if self.start_time_ms is not None and self.end_time_ms is not None and self.end_time_ms <= self.start_time_ms:
            raise ValueError(f"end_time ({self.end_time_ms}) must be after start_time ({self.start_time_ms})")

    def keeps(self, info: LedgerInfo) -> bool:
        """A closed ledger with entries that the selection wants. A ledger
        is judged by its creation and close times: it may hold entries of
        the time range only if it was created before the range ends and
        closed at or after it starts."""
        if not info.is_closed or not info.entries:
            return False
        if self.ledger_ids is not None and info.ledger_id not in self.ledger_ids:
            return False
        if info.ledger_id in self.exclude_ledger_ids:
            return False
        if self.from_ledger is not None and info.ledger_id < self.from_ledger:
            return False
        if self.start_time_ms is not None and info.closed_ms is not None and info.closed_ms < self.start_time_ms:
            return False
        if self.end_time_ms is not None and info.created_ms >= self.end_time_ms:
            return False
        return True

    def keeps_entry(self, append_time_ms: int) -> bool:
        if self.start_time_ms is not None and append_time_ms < self.start_time_ms:
            return False
        return self.end_time_ms is None or append_time_ms < self.end_time_ms


def closed_ledgers(ledgers: Sequence[LedgerInfo], selection: Selection = Selection()) -> list[LedgerInfo]:
    """The ledgers of a chain an export reads: closed (its record says how
    many entries it holds; the open ledger has no count and is never read),
    not empty, and wanted by `selection`."""
    return [info for info in ledgers if selection.keeps(info)]


def entry_ranges(entries: int, bytes_: int, split_bytes: int) -> list[tuple[int, int]]:
    """Entry ranges (first, last) covering 0..entries-1 in about
    `split_bytes` each, of near-equal entry counts (entries of one ledger
    are about the same size: one producer batch each)."""
    if split_bytes < 1:
        raise ValueError(f"split_bytes must be positive, got {split_bytes}")
    if entries <= 0:
        return []
    count = max(1, min(entries, math.ceil(bytes_ / split_bytes)))
    base, extra = divmod(entries, count)
    ranges = []
    first = 0
    for index in range(count):
        size = base + (1 if index < extra else 0)
        ranges.append((first, first + size - 1))
        first += size
    assert first == entries
    return ranges


def plan_splits(partitions: Iterable[PartitionLedgers], selection: Selection = Selection(),
                split_bytes: int = SPLIT_BYTES_DEFAULT) -> list[LedgerSplit]:
    """The export's input partitions: one per selected ledger, several for a
    ledger larger than `split_bytes`; partitions in order, ledgers in
    their chain's order."""
    splits = []
    for partition in partitions:
        closed = [(info.ledger_id, info.entries) for info in partition.ledgers if info.is_closed and info.entries]
        for info in closed_ledgers(partition.ledgers, selection):
            assert info.entries is not None and info.bytes is not None
            index = closed.index((info.ledger_id, info.entries))
            previous = tuple(closed[max(0, index - CHUNK_LOOKBACK_LEDGERS):index])
            for first, last in entry_ranges(info.entries, info.bytes, split_bytes):
                share = info.bytes * (last - first + 1) // info.entries
                splits.append(LedgerSplit(partition.topic, partition.partition, partition.partition_index, info.ledger_id,
                                          first, last, info.first_offset, info.entries, share, partition.compacted, previous))
    return splits


def compacted_chain(topic: str, partition: str, partition_index: int, record: CompactionRecord | None) -> PartitionLedgers:
    """A partition's compacted view as a chain of one closed ledger (none
    when the partition was never compacted)."""
    if record is None or record.ledger_id is None:
        return PartitionLedgers(topic, partition, partition_index, (), compacted=True)
    info = LedgerInfo(record.ledger_id, -1, record.compacted_ms, record.entries, record.messages, record.bytes, record.compacted_ms)
    return PartitionLedgers(topic, partition, partition_index, (info,), compacted=True)


def parse_time_ms(text: str | int | None, what: str) -> int | None:
    """A time given as ms since the epoch or as ISO 8601 (UTC unless it
    names a zone), or None."""
    if text is None or text == "":
        return None
    if isinstance(text, int):
        return text
    text = text.strip()
    if text.lstrip("-").isdigit():
        return int(text)
    try:
        moment = datetime.datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(f"{what} must be ms since the epoch or an ISO 8601 time, got {text!r}") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=datetime.timezone.utc)
    return int(moment.timestamp() * 1000)


def parse_ledger_ids(text: str | None) -> frozenset[int] | None:
    """'12,15,17' → {12, 15, 17}; None or '' → None."""
    if text is None or text.strip() == "":
        return None
    try:
        return frozenset(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ValueError(f"ledgers must be comma-separated ledger ids, got {text!r}") from None


__all__ = [
    "SPLIT_BYTES_DEFAULT",
    "LedgerSplit",
    "PartitionLedgers",
    "Selection",
    "closed_ledgers",
    "compacted_chain",
    "entry_ranges",
    "parse_ledger_ids",
    "parse_time_ms",
    "plan_splits",
]
