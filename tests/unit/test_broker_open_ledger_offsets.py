"""Finding a message of the open ledger keeps no per-entry list: the managed
ledger's index holds a bounded number of first offsets and bisects the
entries between two of them by reading them back (from the entry cache, or
the ledger when the cache dropped them). Driven without bookies: a stand-in
ledger handle serves the reads and counts them."""

from __future__ import annotations

import random

import trio

from bookie.protocol.entry_format import Entry
from broker.entry_cache import EntryCache, Position
from broker.managed_ledger import ManagedLedger
from broker.managed_ledger_core import ManagedLedgerCore
from broker.message_format import entry_of
from broker.pulsar_message import OutMessage
from broker.topic_records import ManagedLedgerRecord, TopicPolicies

LEDGER_ID = 77


class StandInHandle:
    """The open ledger's handle, as far as reading goes."""

    def __init__(self) -> None:
        self.ledger_id = LEDGER_ID
        self.entries: list[bytes] = []
        self.reads = 0

    async def read(self, first_entry_id: int, last_entry_id: int):
        for entry_id in range(first_entry_id, last_entry_id + 1):
            self.reads += 1
            yield Entry(LEDGER_ID, entry_id, entry_id, 0, self.entries[entry_id])


def open_ledger_of(message_counts: list[int], *, points_max: int, cache_bytes: int) -> tuple[ManagedLedger, StandInHandle]:
    """A managed ledger whose open ledger holds entries of these message
    counts, persisted as the ledger handle would report them."""
    managed_ledger = ManagedLedger(None, None, "partition", TopicPolicies(), password=b"", cache=EntryCache(cache_bytes))
    # Its core opened on an empty chain, with a small index (so that it thins out).
    core = managed_ledger.core = ManagedLedgerCore("partition", TopicPolicies(), open_index_points_max=points_max)
    core.open()
    core.record_read((ManagedLedgerRecord(), 0))
    core.ledger_created(LEDGER_ID, 0)
    core.record_written(1, 0)
    handle = StandInHandle()
    managed_ledger.handle = handle
    first_offset = 0
    for entry_id, count in enumerate(message_counts):
        data = entry_of("p", first_offset, 1, [OutMessage(first_offset + index, b"x") for index in range(count)], batched=True)
        handle.entries.append(data)
        managed_ledger._persisted(handle, entry_id, first_offset, count, data)
        first_offset += count
    return managed_ledger, handle


def test_every_offset_of_a_long_open_ledger_is_found_with_a_bounded_index():
    rng = random.Random(21)
    counts = [rng.randint(1, 4) for _ in range(3_000)]
    managed_ledger, handle = open_ledger_of(counts, points_max=16, cache_bytes=0)  # every lookup reads back
    index = managed_ledger.core.open_index
    assert len(index) <= 16 and index.stride == 256
    firsts = [sum(counts[:entry_id]) for entry_id in range(len(counts))]

    async def check() -> None:
        for offset in rng.sample(range(sum(counts)), 200):
            handle.reads = 0
            position = await managed_ledger.position_of_offset(offset)
            entry_id = position.entry_id
            assert position.ledger_id == LEDGER_ID
            assert firsts[entry_id] <= offset < firsts[entry_id] + counts[entry_id], f"offset {offset} is not in entry {entry_id}"
            assert handle.reads <= 8 + 1, "a bisection of 256 entries reads about eight of them"
        assert await managed_ledger.position_of_offset(sum(counts)) is None  # not written yet

    trio.run(check)


def test_with_the_entries_cached_nothing_is_read_back():
    managed_ledger, handle = open_ledger_of([1, 2, 3] * 100, points_max=4, cache_bytes=1 << 30)

    async def check() -> None:
        assert await managed_ledger.position_of_offset(6 * 50 + 3) == Position(LEDGER_ID, 152)  # entries 150, 151, 152 hold 300, 301-302, 303-305
        assert await managed_ledger.position_of_offset(0) == Position(LEDGER_ID, 0)
        assert await managed_ledger.position_of_offset(599) == Position(LEDGER_ID, 299)

    trio.run(check)
    assert handle.reads == 0
