"""The broker's entry cache: entries recently written or read, shared by
every partition, bounded by what they cost in memory (the Python objects
around each entry's bytes included), oldest out first."""

from __future__ import annotations

import collections
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from broker.message_format import BatchHeader

ENTRY_CACHE_BYTES_DEFAULT = 64 * 1024 * 1024

# What one cached entry costs besides its bytes and its strings, measured
# with tracemalloc (tests/unit/test_broker_entry_cache.py checks it): the
# StoredEntry (64 bytes), its Position (48) and entry id (32), the
# BatchHeader (96) and its four large integers (128), the bytes object's
# header (33, rounded up), the key tuple (64) and the OrderedDict's slot and
# node (90 to 130, the most just after its table grew): some 600 bytes, and
# a margin. An entry of one 8-byte message is 56 bytes: counting only those,
# a 64 MiB cache held a million such entries, and the broker 700 MB.
ENTRY_OVERHEAD_BYTES = 640
# A string kept with an entry (its producer id, each message key) beyond
# what sys.getsizeof says: pymalloc's rounding and its slot in a tuple.
STRING_OVERHEAD_BYTES = 16


@dataclass(frozen=True, slots=True)
class Position:
    ledger_id: int
    entry_id: int


@dataclass(frozen=True, slots=True)
class StoredEntry:
    position: Position
    header: BatchHeader
    data: bytes  # the entry as stored: header + body (msgpack)


def keys_cost_bytes(keys: Sequence[str | None] | None) -> int:
    """The memory a batch's message keys hold, in bytes: the list or tuple
    and each key in it (none: 0)."""
    if keys is None:
        return 0
    # Each key is an object of its own (decoding makes one per message);
    # a key-shared batch of 100,000 messages holds megabytes of them.
    return sys.getsizeof(keys) + sum(map(sys.getsizeof, keys)) + STRING_OVERHEAD_BYTES * len(keys)


def entry_cost_bytes(entry: StoredEntry) -> int:
    """The memory a cached entry holds, in bytes."""
    header = entry.header
    return (ENTRY_OVERHEAD_BYTES + len(entry.data) + sys.getsizeof(header.producer_id) + STRING_OVERHEAD_BYTES
            + keys_cost_bytes(header.keys))


class EntryCache:
    """Recently written or read entries, bounded by `bytes_max` as
    `entry_cost_bytes` counts them (oldest out first)."""

    def __init__(self, bytes_max: int) -> None:
        if bytes_max < 0:
            raise ValueError(f"the entry cache's bound must not be negative, got {bytes_max}")
        self.bytes_max = bytes_max
        self.bytes = 0  # what the entries held cost
        self._entries: collections.OrderedDict[tuple[int, int], StoredEntry] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, ledger_id: int, entry_id: int) -> StoredEntry | None:
        # Ledger ids are unique in the cluster, so one cache serves every partition.
        return self._entries.get((ledger_id, entry_id))

    def put(self, entry: StoredEntry) -> None:
        key = (entry.position.ledger_id, entry.position.entry_id)
        if key in self._entries:
            return
        cost = entry_cost_bytes(entry)
        if cost > self.bytes_max:
            return
        self._entries[key] = entry
        self.bytes += cost
        while self.bytes > self.bytes_max:
            _, evicted = self._entries.popitem(last=False)
            self.bytes -= entry_cost_bytes(evicted)

    def drop_ledger(self, ledger_id: int) -> None:
        for key in [key for key in self._entries if key[0] == ledger_id]:
            self.bytes -= entry_cost_bytes(self._entries.pop(key))


__all__ = [
    "ENTRY_CACHE_BYTES_DEFAULT",
    "ENTRY_OVERHEAD_BYTES",
    "EntryCache",
    "Position",
    "StoredEntry",
    "entry_cost_bytes",
    "keys_cost_bytes",
]
