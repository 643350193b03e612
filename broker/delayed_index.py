"""Delayed delivery's index: the messages a shared subscription holds back
until their time, earliest first, in bounded memory.

The newest delayed messages are kept in memory, in a heap of at most
`memory_max`. When it fills, it is sealed: sorted by time due and written
out as a run of segments (`SEGMENT_RECORDS` messages each) to a spill file,
keeping in memory only the segment of each run to be released next. The
next message due is the earliest of the heap and of the runs' next
segments, and a run's next segment is read when the one before it is
released. This is the shape of Pulsar's bucket-based delayed delivery
tracker (a mutable bucket in memory, sealed buckets in storage, one loaded
segment each); past `RUNS_MAX` runs the smaller half are merged into one,
so memory stays bounded by about `memory_max + RUNS_MAX * SEGMENT_RECORDS`
messages however many are held.

A spill file that fails loses nothing: a seal or merge that cannot write
leaves the messages where they were (memory grows past its bound until a
later seal succeeds; `spill_failures` counts these), and a segment that
cannot be read back raises SpillError with nothing taken.

A run records what delivering a message needs: the entry's position,
offsets, keys and time, and its bytes when they are given and at most
`CARRIED_BYTES_MAX` (so a message coming due is sent without reading its
entry back from the bookies, one random read per message; larger entries
are read back). Memory holds at most `memory_bytes_max` of entries' bytes,
and a loaded segment at most `SEGMENT_BYTES`. The index is a cache of what
the ledgers hold: a broker that loads
the partition builds it again by reading the backlog, so a spill file never
outlives its process (an unnamed temporary file, reclaimed by the operating
system even after a kill).

Pure apart from the spill file, which is given: `MemorySpillFile` in tests
and the simulator, `DiskSpillFile` in the broker.
"""

from __future__ import annotations

import heapq
import itertools
import os
import tempfile
from typing import Callable, Iterable, Iterator, Protocol

import msgpack

from broker.entry_types import EntryRef

SEGMENT_RECORDS = 1_024  # messages in a run's segment: a run keeps one in memory
SEGMENT_BYTES = 256 * 1024  # entries' bytes in a segment (past it the segment ends, but holds one entry at least)
RUNS_MAX = 64  # runs kept apart; past it the smaller half are merged into one
MEMORY_BYTES_MAX_DEFAULT = 32 * 1024 * 1024  # entries' bytes held in memory before a seal
CARRIED_BYTES_MAX = 64 * 1024  # an entry larger than this is read back from the ledger when due, not carried

Record = tuple[int, int, EntryRef, bytes | None]  # (time due in ms, offset, entry, its bytes if carried)


class SpillFile(Protocol):
    def append(self, data: bytes) -> tuple[int, int]:
        """Write `data` after what is there: (position, length)."""

    def read(self, position: int, length: int) -> bytes: ...

    def close(self) -> None: ...


class MemorySpillFile:
    """A spill file in memory (tests and the simulator: deterministic, no files)."""

    def __init__(self) -> None:
        self._data = bytearray()

    def append(self, data: bytes) -> tuple[int, int]:
        position = len(self._data)
        self._data += data
        return position, len(data)

    def read(self, position: int, length: int) -> bytes:
        return bytes(self._data[position:position + length])

    def close(self) -> None:
        self._data = bytearray()


class DiskSpillFile:
    """An unnamed temporary file (in `directory`, else the system's temporary
    directory): gone once closed, or once the process ends however it ends.
    Neither written through nor synced: the page cache holds it, as the
    index is rebuilt from the ledgers after a restart."""

    def __init__(self, directory: str | None = None) -> None:
        self._file = tempfile.TemporaryFile(dir=directory, prefix="quire-delayed-")
        self._fd = self._file.fileno()
        self._size = 0

    def append(self, data: bytes) -> tuple[int, int]:
        position, view = self._size, memoryview(data)
        while view:
            written = os.pwrite(self._fd, view, position + len(data) - len(view))
            view = view[written:]
        self._size += len(data)
        return position, len(data)

    def read(self, position: int, length: int) -> bytes:
        data = os.pread(self._fd, length, position)
        if len(data) != length:
            raise OSError(f"delayed index spill file: read {len(data)} of {length} bytes at {position}")
        return data

    def close(self) -> None:
        self._file.close()


SpillFactory = Callable[[], SpillFile]


def _encode(records: list[Record]) -> bytes:
    """A segment: its entries once each (with their bytes, if carried), then
    (due, offset, entry index) per message."""
    entries: dict[int, int] = {}
    table: list[list] = []
    flat: list[int] = []
    for due_ms, offset, entry, data in records:
        index = entries.get(id(entry))
        if index is None:
            index = entries[id(entry)] = len(table)
            table.append([entry.ledger_id, entry.entry_id, entry.first_offset, entry.message_count,
                          None if entry.keys is None else list(entry.keys), entry.deliver_at_ms, data])
        flat += (due_ms, offset, index)
    return msgpack.packb([table, flat])


def _decode(data: bytes) -> list[Record]:
    table, flat = msgpack.unpackb(data)
    entries = [(EntryRef(ledger_id, entry_id, first_offset, message_count, None if keys is None else tuple(keys), deliver_at_ms),
                carried)
               for ledger_id, entry_id, first_offset, message_count, keys, deliver_at_ms, carried in table]
    return [(flat[at], flat[at + 1], *entries[flat[at + 2]]) for at in range(0, len(flat), 3)]


class SpillError(Exception):
    """A run's next segment could not be read back (the spill file failed):
    nothing was taken out of the index; try again later."""


class _Run:
    """A sealed run: segments in a spill file, the next one loaded."""

    __slots__ = ("file", "segments", "next_segment", "records", "at", "remaining", "last_offset")

    def __init__(self, file: SpillFile, segments: list[tuple[int, int]], first: list[Record], count: int,
                 last_offset: int) -> None:
        self.file = file
        self.last_offset = last_offset  # the highest offset in the run
        self.segments = segments  # (position, length) of each segment
        self.next_segment = 1  # the first is given loaded
        self.records = first
        self.at = 0
        self.remaining = count

    def head(self) -> Record:
        return self.records[self.at]

    @property
    def loaded(self) -> bool:
        """Whether its next record is in memory (False: spent, or its next
        segment is still to be read)."""
        return self.at < len(self.records)

    @property
    def spent(self) -> bool:
        return self.at >= len(self.records) and self.next_segment >= len(self.segments)

    def load_next(self) -> None:
        """Read the next segment (OSError leaves the run as it was)."""
        records = _decode(self.file.read(*self.segments[self.next_segment]))
        self.records, self.at = records, 0
        self.next_segment += 1

    def rest(self) -> Iterator[Record]:
        """What the run still holds, in order (reading its segments; the run
        itself is left as it is)."""
        yield from self.records[self.at:]
        for position, length in self.segments[self.next_segment:]:
            yield from _decode(self.file.read(position, length))


class DelayedIndex:
    def __init__(self, memory_max: int, spill: SpillFactory = MemorySpillFile, *, runs_max: int = RUNS_MAX,
                 memory_bytes_max: int = MEMORY_BYTES_MAX_DEFAULT) -> None:
        if memory_max < 1 or runs_max < 2 or memory_bytes_max < 1:
            raise ValueError("memory_max and memory_bytes_max must be at least 1, runs_max at least 2")
        self.memory_max = memory_max
        self.memory_bytes_max = memory_bytes_max
        self.runs_max = runs_max
        self._spill = spill
        # heap: (due, offset, number, entry, bytes or None), earliest first
        self._memory: list[tuple[int, int, int, EntryRef, bytes | None]] = []
        self._memory_bytes = 0  # entries' bytes carried in memory (an estimate: reset by every seal)
        self._heads: list[tuple[int, int, int, _Run]] = []  # heap: (due, offset, run number, run) of each run's next message
        self._numbers = itertools.count()
        self._spilled = 0  # messages in the runs
        self._closed = False
        # A seal or a merge that failed (the spill file could not be
        # written): what it would have written stays where it was, in memory
        # or in its runs, and the next try waits until memory has doubled.
        self.spill_failures = 0
        self.spill_error = ""
        self._seal_at_least = 0

    def __len__(self) -> int:
        return len(self._memory) + self._spilled

    @property
    def runs(self) -> int:
        return len(self._heads)

    @property
    def loaded(self) -> int:
        """Messages in memory: the newest, and the runs' loaded segments."""
        return len(self._memory) + sum(len(run.records) - run.at for _, _, _, run in self._heads)

    def add(self, due_ms: int, offsets: Iterable[int], entry: EntryRef, data: bytes | None = None) -> None:
        """Hold messages `offsets` of `entry` until `due_ms`; `data`, the
        entry's bytes, is carried along when given and small enough."""
        if data is not None and len(data) > CARRIED_BYTES_MAX:
            data = None
        added = 0
        for offset in offsets:
            heapq.heappush(self._memory, (due_ms, offset, next(self._numbers), entry, data))
            added += 1
        if added and data is not None:
            self._memory_bytes += len(data)
        memory = self._memory
        if (len(memory) >= self.memory_max or self._memory_bytes >= self.memory_bytes_max) and len(memory) >= self._seal_at_least:
            memory.sort()  # (numbers are unique: entries never compared; a sorted list is still a heap)
            if self._seal([(due_ms, offset, entry, data) for due_ms, offset, _, entry, data in memory]):
                self._memory, self._memory_bytes, self._seal_at_least = [], 0, 0
                if len(self._heads) > self.runs_max:
                    self._merge()
            else:
                self._seal_at_least = 2 * len(memory)

    def next_due_ms(self) -> int | None:
        memory, heads = self._memory, self._heads
        if memory and (not heads or (memory[0][0], memory[0][1]) <= heads[0][:2]):
            return memory[0][0]
        return heads[0][0] if heads else None

    def take(self, now_ms: int) -> tuple[int, EntryRef, bytes | None] | None:
        """The earliest message due at or before `now_ms`, out of the index
        (offset, entry, the entry's bytes if carried); None when none is due
        yet. SpillError when the run holding it cannot be read now (nothing
        is taken: the next call tries again)."""
        memory, heads = self._memory, self._heads
        if memory and (not heads or (memory[0][0], memory[0][1]) <= heads[0][:2]):
            if memory[0][0] > now_ms:
                return None
            _, offset, _, entry, data = heapq.heappop(memory)
            if data is not None and offset == entry.last_offset:
                self._memory_bytes -= len(data)  # (counted once per entry, given back with its last message)
            return offset, entry, data
        if not heads or heads[0][0] > now_ms:
            return None
        _, _, number, run = heads[0]
        if not run.loaded:
            # Its next segment could not be read when its last message was
            # taken (its place in the heap is that message's): try again.
            try:
                run.load_next()
            except OSError as error:
                raise SpillError(f"delayed index: a spilled run could not be read back: {error}") from error
            due_ms, next_offset, _, _ = run.head()
            heapq.heapreplace(heads, (due_ms, next_offset, number, run))
            return self.take(now_ms)
        _, offset, entry, data = run.head()
        run.at += 1
        run.remaining -= 1
        self._spilled -= 1
        if not run.loaded and not run.spent:
            try:
                run.load_next()
            except OSError:
                pass  # its place stays this message's: the next take tries again (and says why)
        if run.loaded:
            due_ms, next_offset, _, _ = run.head()
            heapq.heapreplace(heads, (due_ms, next_offset, number, run))
        elif run.spent:
            heapq.heappop(heads)
            run.file.close()
        return offset, entry, data

    def drop_through(self, offset: int) -> None:
        """Messages up to `offset` were acknowledged (a skip, an expiry, a
        cumulative acknowledgement): those in memory go, and so do runs
        holding nothing after it. (Others in runs are dropped by the caller
        when they come due.)"""
        memory = [item for item in self._memory if item[1] > offset]
        if len(memory) < len(self._memory):
            heapq.heapify(memory)
            self._memory = memory
            self._memory_bytes = _carried_bytes(memory)
        if any(run.last_offset <= offset for _, _, _, run in self._heads):
            kept = []
            for item in self._heads:
                run = item[3]
                if run.last_offset <= offset:
                    self._spilled -= run.remaining
                    run.file.close()
                else:
                    kept.append(item)
            heapq.heapify(kept)
            self._heads = kept

    def clear(self) -> None:
        """Forget everything (a seek): spill files closed."""
        for _, _, _, run in self._heads:
            run.file.close()
        self._memory, self._heads, self._spilled, self._memory_bytes, self._seal_at_least = [], [], 0, 0, 0

    def close(self) -> None:
        """The subscription is done with the index: spill files closed, and
        no more written."""
        self.clear()
        self._closed = True

    def _seal(self, records: Iterator[Record] | list[Record]) -> bool:
        """Write sorted records out as a run, keeping its first segment
        loaded. False when the spill file failed (nothing changed)."""
        if self._closed:
            return False
        run = self._write_run(records)
        if run is None:
            return False
        if run.remaining:
            self._push(run)
        return True

    def _write_run(self, records: Iterator[Record] | list[Record]) -> _Run | None:
        """A run of `records` in a new spill file; None if it failed."""
        segments: list[tuple[int, int]] = []
        first: list[Record] = []
        count = 0
        last_offset = -1
        try:
            file = self._spill()
        except OSError as error:
            self._failed(error)
            return None
        try:
            for segment in _segments(records):
                if not segments:
                    first = segment
                segments.append(file.append(_encode(segment)))
                count += len(segment)
                last_offset = max(last_offset, max(record[1] for record in segment))
        except OSError as error:
            file.close()
            self._failed(error)
            return None
        except BaseException:
            file.close()
            raise
        if not count:
            file.close()
        return _Run(file, segments, first, count, last_offset)

    def _push(self, run: _Run) -> None:
        self._spilled += run.remaining
        due_ms, offset, _, _ = run.head()
        heapq.heappush(self._heads, (due_ms, offset, next(self._numbers), run))

    def _merge(self) -> None:
        """Merge the smaller half of the runs into one (size-tiered: what is
        written again over time grows as n log n, not n squared), bounding
        the segments kept loaded. If it fails, the runs stay as they were."""
        by_size = sorted(self._heads, key=lambda item: item[3].remaining)
        chosen = by_size[:max(2, self.runs_max // 2)]
        try:
            merged = self._write_run(heapq.merge(*(item[3].rest() for item in chosen), key=_order))
        except OSError as error:  # reading the runs back
            self._failed(error)
            return
        if merged is None:
            return
        chosen_ids = {id(item[3]) for item in chosen}
        self._heads = [item for item in self._heads if id(item[3]) not in chosen_ids]
        heapq.heapify(self._heads)
        for item in chosen:
            self._spilled -= item[3].remaining
            item[3].file.close()
        if merged.remaining:
            self._push(merged)

    def _failed(self, error: OSError) -> None:
        self.spill_failures += 1
        self.spill_error = str(error)


def _order(record: Record) -> tuple[int, int]:
    return record[0], record[1]


def _carried_bytes(items: list[tuple]) -> int:
    """Entries' bytes carried by `items` (each entry once)."""
    seen: dict[int, int] = {}
    for item in items:
        if item[4] is not None:
            seen[id(item[3])] = len(item[4])
    return sum(seen.values())


def _segments(records) -> Iterator[list[Record]]:
    """Records in segments of about SEGMENT_RECORDS messages and
    SEGMENT_BYTES of entries' bytes (each entry counted once). A segment
    ends between entries, never inside one, so that a batch's messages
    come back as one entry and go out together."""
    segment: list[Record] = []
    segment_bytes = 0
    for record in records:
        entry = record[2]
        if segment and segment[-1][2] is not entry and (len(segment) >= SEGMENT_RECORDS or segment_bytes >= SEGMENT_BYTES):
            yield segment
            segment, segment_bytes = [], 0
        if record[3] is not None and (not segment or segment[-1][2] is not entry):
            segment_bytes += len(record[3])
        segment.append(record)
    if segment:
        yield segment


__all__ = ["CARRIED_BYTES_MAX", "DelayedIndex", "DiskSpillFile", "MemorySpillFile", "RUNS_MAX", "SEGMENT_BYTES",
           "SEGMENT_RECORDS", "SpillError", "SpillFactory", "SpillFile"]
