"""The write cache's part in a full disk: a lowered flush trigger makes
flushes small, and garbage collection may drop deleted ledgers from a
flushing buffer that is held for room, so that the flush fits."""

from __future__ import annotations

from bookie.write_cache import WriteCache


def test_the_flush_trigger_defaults_to_half_the_cache_and_can_be_lowered():
    cache = WriteCache(1000)
    cache.put(1, 0, b"x" * 300)
    assert not cache.wants_flush()
    cache.flush_bytes = 200  # a nearly full disk: flush early, in small pieces
    assert cache.wants_flush()
    cache.begin_flush()
    cache.put(1, 1, b"y" * 250)
    # The other half is still flushing (or held): adds wait past the trigger.
    assert cache.is_full()
    cache.flush_bytes = cache.half_bytes
    assert not cache.is_full()


def test_a_flush_counts_its_entries_and_bytes_until_it_ends():
    cache = WriteCache(1000)
    cache.put(1, 0, b"a" * 10)
    cache.put(2, 0, b"b" * 20)
    cache.put(2, 0, b"c" * 30)  # a rewrite counts once
    cache.begin_flush()
    assert (cache.flushing, cache.flushing_entries, cache.flushing_bytes) == (True, 2, 40)
    assert (cache.active_entries, cache.active_bytes) == (0, 0)
    cache.end_flush()
    assert (cache.flushing, cache.flushing_entries, cache.flushing_bytes) == (False, 0, 0)


def test_deleted_ledgers_leave_both_buffers():
    cache = WriteCache(1000)
    cache.put(1, 0, b"a" * 10)
    cache.put(2, 0, b"b" * 20)
    cache.put(2, 1, b"b" * 20)
    cache.begin_flush()  # then held: no room on the disk
    cache.put(2, 2, b"b" * 5)
    cache.put(3, 0, b"c" * 7)
    cache.discard_ledgers({2})
    assert (cache.flushing_entries, cache.flushing_bytes) == (1, 10)
    assert (cache.active_entries, cache.active_bytes) == (1, 7)
    assert cache.get(2, 0) is None and cache.get(2, 2) is None
    assert cache.get(1, 0) == b"a" * 10 and cache.get(3, 0) == b"c" * 7
    assert cache.entry_ids(2, 0, 10) == []
