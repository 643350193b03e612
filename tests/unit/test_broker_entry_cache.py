"""The broker's entry cache counts what its entries really cost: their
objects, not only their bytes. Measured with tracemalloc: a cache filled
with many tiny entries (the case that used to hold ten times its bound)
stays under its bound, and its count is not far above what they take."""

from __future__ import annotations

import gc
import tracemalloc

import pytest

from broker.entry_cache import ENTRY_OVERHEAD_BYTES, EntryCache, Position, StoredEntry, entry_cost_bytes
from broker.message_format import decode_entry, entry_of
from broker.pulsar_message import OutMessage

LEDGER_ID = 1_234_567
PUBLISH_TIME_MS = 1_790_000_000_000


def entry_bytes(first_offset: int, publish_ms: int, body: bytes, keys: tuple[str | None, ...] | None = None) -> bytes:
    """An entry of len(keys) messages (one without keys) sharing `body` in equal parts."""
    count = 1 if keys is None else len(keys)
    size = len(body) // count
    return entry_of("producer-1", first_offset, publish_ms,
                    [OutMessage(first_offset + index, body[index * size:(index + 1) * size], None if keys is None else keys[index])
                     for index in range(count)])


def make_entry(entry_id: int, body: bytes, keys: tuple[str | None, ...] | None = None) -> StoredEntry:
    """An entry as the managed ledger caches it: built, then its header
    decoded from its bytes (every field a fresh object, as after a read)."""
    data = entry_bytes(10_000_000 + entry_id, PUBLISH_TIME_MS + entry_id, body, keys)
    header, _ = decode_entry(data)
    # entry_id + 1 - 1: a fresh integer, as the ledger handle makes one per entry.
    return StoredEntry(Position(LEDGER_ID, entry_id + 1 - 1), header, data)


def traced_bytes_of_filled_cache(bytes_max: int, count: int, body: bytes, keys=None) -> tuple[EntryCache, int]:
    """Fill a cache with `count` entries; what it holds afterwards, as
    tracemalloc counts it."""
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        cache = EntryCache(bytes_max)
        for entry_id in range(count):
            cache.put(make_entry(entry_id, body, keys))
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    return cache, held


@pytest.mark.parametrize(
    "body, keys",
    [
        (b"12345678", None),  # one 8-byte message: some 50 bytes stored, ten times that in objects
        (b"x" * 1000, None),
        (b"12345678" * 20, tuple(f"key-{index}" for index in range(20))),  # a key-shared batch
        (b"12345678" * 4, ("ключ-1", None, "ключ-3", "k")),  # keys that are not ASCII, and none
    ],
)
def test_tiny_entries_stay_under_the_bound_measured_with_tracemalloc(body, keys):
    bytes_max = 512 * 1024
    count = 3 * bytes_max // len(entry_bytes(0, 0, body, keys))
    cache, held = traced_bytes_of_filled_cache(bytes_max, count, body, keys)
    assert len(cache) < count, "the cache must have dropped entries to stay under its bound"
    assert cache.bytes <= bytes_max
    assert held <= bytes_max, f"the cache holds {held} bytes for a bound of {bytes_max}"
    # Counted close to what it holds: not so high that the cache keeps
    # much less than its bound.
    assert held >= 0.75 * cache.bytes, f"{cache.bytes} bytes counted, {held} held"


def test_the_old_count_of_payload_bytes_would_let_tiny_entries_take_ten_times_the_bound():
    entry = make_entry(0, b"12345678")
    assert len(entry.data) * 8 < entry_cost_bytes(entry)
    assert entry_cost_bytes(entry) >= ENTRY_OVERHEAD_BYTES + len(entry.data)


def test_keys_count_with_their_entry():
    keyless = entry_cost_bytes(make_entry(0, b"12345678" * 100))
    keyed = entry_cost_bytes(make_entry(0, b"12345678" * 100, tuple(f"key-{index}" for index in range(100))))
    assert keyed - keyless >= 100 * 50  # a str object is some 50 bytes before its characters


def test_accounting_returns_to_zero():
    cache = EntryCache(1024 * 1024)
    for entry_id in range(100):
        cache.put(make_entry(entry_id, b"12345678"))
    cache.put(make_entry(5, b"12345678"))  # cached already: counted once
    assert len(cache) == 100 and cache.bytes == 100 * entry_cost_bytes(make_entry(0, b"12345678"))
    other = StoredEntry(Position(LEDGER_ID + 1, 0), make_entry(0, b"1").header, make_entry(0, b"1").data)
    cache.put(other)
    cache.drop_ledger(LEDGER_ID)
    assert len(cache) == 1 and cache.get(LEDGER_ID + 1, 0) is other and cache.bytes == entry_cost_bytes(other)
    cache.drop_ledger(LEDGER_ID + 1)
    assert len(cache) == 0 and cache.bytes == 0


def test_oldest_entries_go_first_and_an_entry_larger_than_the_bound_is_not_kept():
    cost = entry_cost_bytes(make_entry(0, b"12345678"))
    cache = EntryCache(3 * cost)
    for entry_id in range(5):
        cache.put(make_entry(entry_id, b"12345678"))
    assert [entry_id for entry_id in range(5) if cache.get(LEDGER_ID, entry_id)] == [2, 3, 4]
    cache.put(make_entry(9, b"x" * (3 * cost)))
    assert cache.get(LEDGER_ID, 9) is None and len(cache) == 3 and cache.bytes == 3 * cost


def test_a_negative_bound_is_refused():
    with pytest.raises(ValueError):
        EntryCache(-1)
