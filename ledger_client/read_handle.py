"""`ReadHandle`, the read path of a ledger (the trio driver of reads): any
replica of an entry's write set, the next one on error or digest mismatch;
batch reads of ranges; the LAC, and tailing by long-polling it. The write
path is `ledger_client.ledger_handle`, recovery `ledger_client.recovery`."""

from __future__ import annotations

import collections
from typing import AsyncIterator

import trio

from bookie.protocol.entry_format import DigestManager, DigestMismatchError, Entry, EntryFormatError
from bookie.protocol.wire import BatchReadRequest, ReadFlag, ReadLacRequest, ReadRequest, Status
from ledger_client.bookie_client import BookieConnectionError
from ledger_client.client_services import ClientServices
from ledger_client.errors import BKError, EntryReadError, NoSuchEntryError
from ledger_client.metadata import LedgerMetadata

READ_WINDOW_ENTRIES = 256  # single-entry reads in flight while reading a range
BATCH_READ_ENTRIES_MAX = 1000
BATCH_READ_BYTES_MAX = 4 * 1024 * 1024
BATCHES_AHEAD = 4  # batch reads in flight while a range is read
LONG_POLL_TIMEOUT_MS = 10_000
TAIL_IDLE_DELAY_S_MAX = 1.0  # back-off of a tailing reader that no bookie holds
READ_TIMEOUT_S = 5.0  # a bookie that accepts a read and never answers: try the next replica


class ReadHandle:
    """A ledger opened for reading. For a closed ledger every entry up to its
    last entry can be read; for an open one, entries up to the LAC (learned
    with `read_lac` / `wait_for_lac`)."""

    def __init__(self, services: ClientServices, metadata: LedgerMetadata, version: int, digest: DigestManager, master_key: bytes) -> None:
        self._services = services
        self._metadata = metadata
        self._version = version
        self._digest = digest
        self._master_key = master_key
        self._last_add_confirmed = metadata.last_entry_id if metadata.is_closed else -1
        self._ledger_id = metadata.ledger_id  # never changes; read for every add answer

    @property
    def ledger_id(self) -> int:
        return self._ledger_id

    @property
    def metadata(self) -> LedgerMetadata:
        return self._metadata

    @property
    def last_add_confirmed(self) -> int:
        return self._last_add_confirmed

    @property
    def is_closed(self) -> bool:
        return self.metadata.is_closed

    @property
    def length(self) -> int:
        return self.metadata.length

    # --- single entries ------------------------------------------------------------

    def _check_readable(self, entry_id: int) -> None:
        if entry_id < 0 or entry_id > self.last_add_confirmed:
            state = "last entry" if self.is_closed else "last add confirmed"
            raise NoSuchEntryError(f"ledger {self.ledger_id} has no entry {entry_id} (its {state} is {self.last_add_confirmed})")

    async def read_entry(self, entry_id: int) -> Entry:
        self._check_readable(entry_id)
        return await self._read_unchecked(entry_id)

    async def _read_unchecked(self, entry_id: int) -> Entry:
        """Try each bookie of the write set in turn; the first intact copy wins."""
        errors: list[str] = []
        missing = 0
        for bookie_id in self.metadata.write_set(entry_id):
            try:
                with trio.fail_after(READ_TIMEOUT_S):
                    response = await self._services.connections.call(
                        bookie_id, lambda request_id: ReadRequest(request_id, ReadFlag.NONE, self.ledger_id, entry_id, None, None, None)
                    )
            except BookieConnectionError as error:
                errors.append(f"{bookie_id}: {error}")
                continue
            except trio.TooSlowError:
                errors.append(f"{bookie_id}: no answer within {READ_TIMEOUT_S:.0f}s")
                continue
            if response.status is Status.OK and response.entry is not None:
                try:
                    return self._digest.decode(response.entry, expected_entry_id=entry_id)
                except (DigestMismatchError, EntryFormatError) as error:
                    errors.append(f"{bookie_id}: {error}")
                    continue
            if response.status in (Status.NO_ENTRY, Status.NO_LEDGER):
                missing += 1
            errors.append(f"{bookie_id}: {response.status.name}")
        if missing == self.metadata.write_quorum:
            raise NoSuchEntryError(f"no bookie of its write set has entry {entry_id} of ledger {self.ledger_id}")
        raise EntryReadError(f"cannot read entry {entry_id} of ledger {self.ledger_id}: " + "; ".join(errors))

    # --- ranges --------------------------------------------------------------------------

    async def read(self, first_entry_id: int, last_entry_id: int) -> AsyncIterator[Entry]:
        """Entries first..last (inclusive), in order."""
        if first_entry_id > last_entry_id:
            return
        self._check_readable(first_entry_id)
        self._check_readable(last_entry_id)
        if self.metadata.write_quorum == self.metadata.ensemble_size:
            # A batch read serves a range from one bookie only where that
            # bookie stores every entry of it: write quorum == ensemble.
            async for entry in self._prefetched_batches(first_entry_id, last_entry_id):
                yield entry
            return
        next_entry_id = first_entry_id
        while next_entry_id <= last_entry_id:
            entries = await self._window_read(next_entry_id, last_entry_id)
            for entry in entries:
                yield entry
            next_entry_id += len(entries)

    async def _prefetched_batches(self, first_entry_id: int, last_entry_id: int) -> AsyncIterator[Entry]:
        """Batch reads of consecutive ranges, BATCHES_AHEAD in flight (spread
        over the replicas by `_batch_read`), consumed in order. A batch that
        came back short is completed before the next range is used.

        The fetches run in the client's nursery (`spawn`), not in one opened here: a
        generator must not yield inside a nursery (a reader that stops early
        would leave it open). Fetches a stopped reader no longer wants end
        on their own and are dropped."""
        in_flight: collections.deque[tuple[int, trio.Event, list]] = collections.deque()
        next_start = first_entry_id
        # Ranges of about what one batch read brings back (a bookie stops at
        # BATCH_READ_BYTES_MAX): with large entries, ranges of BATCH_READ_ENTRIES_MAX
        # would leave one request in flight, its range completed one short
        # answer after another.
        entry_bytes = self._average_entry_bytes()
        range_entries = BATCH_READ_ENTRIES_MAX if entry_bytes is None else max(
            1, min(BATCH_READ_ENTRIES_MAX, BATCH_READ_BYTES_MAX // max(1, entry_bytes))
        )

        def launch() -> None:
            nonlocal next_start
            start, end = next_start, min(last_entry_id, next_start + range_entries - 1)
            next_start = end + 1
            done, result = trio.Event(), []

            async def fetch() -> None:
                try:
                    result.append(await self._batch_read(start, end))
                except BKError as error:
                    result.append(error)
                done.set()

            self._services.spawn(fetch)
            in_flight.append((end, done, result))

        while next_start <= last_entry_id and len(in_flight) < BATCHES_AHEAD:
            launch()
        expected = first_entry_id
        while in_flight:
            end, done, result = in_flight.popleft()
            if next_start <= last_entry_id:
                launch()
            await done.wait()
            if isinstance(result[0], BKError):
                raise result[0]
            entries = result[0]
            while True:
                for entry in entries:
                    yield entry
                expected += len(entries)
                if expected > end:
                    break
                entries = await self._batch_read(expected, end)

    def _average_entry_bytes(self) -> int | None:
        """The ledger's mean entry size, where its length is known."""
        length, entries = self.metadata.length, self.last_add_confirmed + 1
        if not length or entries <= 0:
            return None
        return length // entries

    async def _batch_read(self, first_entry_id: int, last_entry_id: int) -> list[Entry]:
        first_key, bookies = self.metadata.ensemble_at(first_entry_id)
        # Stay within this ensemble's range.
        keys = self.metadata.ensemble_keys
        position = keys.index(first_key)
        if position + 1 < len(keys):
            last_entry_id = min(last_entry_id, keys[position + 1] - 1)
        wanted = last_entry_id - first_entry_id + 1
        # Spread readers over the replicas; fall back to the next on failure.
        start = first_entry_id % len(bookies)
        for offset in range(len(bookies)):
            bookie_id = bookies[(start + offset) % len(bookies)]
            try:
                with trio.fail_after(READ_TIMEOUT_S):
                    response = await self._services.connections.call(
                        bookie_id,
                        lambda request_id: BatchReadRequest(
                            request_id, self.ledger_id, first_entry_id, min(wanted, BATCH_READ_ENTRIES_MAX), BATCH_READ_BYTES_MAX
                        ),
                    )
            except (BookieConnectionError, trio.TooSlowError):
                continue
            if response.status is not Status.OK or not response.entries:
                continue
            # What verified; a bad entry stops it and is read on its own next.
            entries = self._digest.decode_range(response.entries[:wanted], first_entry_id)
            if entries:
                return entries
        return [await self._read_unchecked(first_entry_id)]

    async def _window_read(self, first_entry_id: int, last_entry_id: int) -> list[Entry]:
        """Entries read one by one, READ_WINDOW_ENTRIES at once (where no
        single bookie holds a whole range). The first entry that cannot be
        read is raised as itself, not wrapped in the nursery's group."""
        count = min(last_entry_id - first_entry_id + 1, READ_WINDOW_ENTRIES)
        results: list[Entry | BKError | None] = [None] * count

        async def read_one(index: int) -> None:
            try:
                results[index] = await self._read_unchecked(first_entry_id + index)
            except BKError as error:
                results[index] = error

        async with trio.open_nursery() as nursery:
            for index in range(count):
                nursery.start_soon(read_one, index)
        entries: list[Entry] = []
        for result in results:
            if isinstance(result, BKError):
                if not entries:
                    raise result
                break  # what came before it is returned; it is read again next
            entries.append(result)
        return entries

    # --- the LAC ----------------------------------------------------------------------------

    async def read_lac(self) -> int:
        """Ask the last ensemble for the LAC they know; take the largest of
        the answers once enough bookies (E - AQ + 1) answered that no write
        quorum is left out."""
        if self.is_closed:
            return self.last_add_confirmed
        _, bookies = self.metadata.last_ensemble
        needed = self.metadata.ensemble_size - self.metadata.ack_quorum + 1
        answers: list[int] = []
        enough = trio.Event()
        done = 0

        async def ask(bookie_id: str) -> None:
            nonlocal done
            try:
                with trio.fail_after(READ_TIMEOUT_S):
                    response = await self._services.connections.call(bookie_id, lambda request_id: ReadLacRequest(request_id, self.ledger_id))
                if response.status in (Status.OK, Status.NO_ENTRY, Status.NO_LEDGER):
                    answers.append(response.last_add_confirmed if response.status is Status.OK else -1)
            except (BookieConnectionError, trio.TooSlowError):
                pass
            done += 1
            if len(answers) >= needed or done == len(bookies):
                enough.set()

        async with trio.open_nursery() as nursery:
            for bookie_id in bookies:
                nursery.start_soon(ask, bookie_id)
            await enough.wait()
            nursery.cancel_scope.cancel()
        if len(answers) < needed and not answers:
            raise EntryReadError(f"no bookie of ledger {self.ledger_id}'s last ensemble answered a LAC read")
        self._last_add_confirmed = max(self.last_add_confirmed, *answers)
        return self.last_add_confirmed

    async def wait_for_lac(self, previous_lac: int, timeout_ms: int = LONG_POLL_TIMEOUT_MS) -> int:
        """Long-poll: return once some bookie of the last ensemble knows a LAC
        beyond `previous_lac`, or after `timeout_ms` (then the LAC as known)."""
        if self.is_closed or self.last_add_confirmed > previous_lac:
            return self.last_add_confirmed
        _, bookies = self.metadata.last_ensemble
        async with trio.open_nursery() as nursery:
            async def poll(bookie_id: str) -> None:
                try:
                    response = await self._services.connections.call(
                        bookie_id,
                        lambda request_id: ReadRequest(
                            request_id, ReadFlag.NONE, self.ledger_id, -1, None, previous_lac, timeout_ms
                        ),
                    )
                except BookieConnectionError:
                    return
                if response.last_add_confirmed > previous_lac:
                    self._last_add_confirmed = max(self.last_add_confirmed, response.last_add_confirmed)
                    nursery.cancel_scope.cancel()

            for bookie_id in bookies:
                nursery.start_soon(poll, bookie_id)
        return self.last_add_confirmed

    async def tail(self, first_entry_id: int = 0) -> AsyncIterator[Entry]:
        """Every entry from `first_entry_id` on, in order, as the writer's
        LAC advances; ends after the last entry once the ledger is closed."""
        next_entry_id = first_entry_id
        idle_delay_s = 0.0
        while True:
            if next_entry_id <= self.last_add_confirmed:
                idle_delay_s = 0.0
                async for entry in self.read(next_entry_id, self.last_add_confirmed):
                    yield entry
                    next_entry_id = entry.entry_id + 1
                continue
            if self.is_closed:
                return
            polled_at = trio.current_time()
            await self.wait_for_lac(next_entry_id - 1)
            if self.last_add_confirmed < next_entry_id:
                await self._refresh_metadata()
                if trio.current_time() - polled_at < 0.05:
                    # Nobody held the long poll (bookies that do not know the
                    # ledger yet answer at once): back off instead of spinning.
                    idle_delay_s = min(max(2 * idle_delay_s, 0.01), TAIL_IDLE_DELAY_S_MAX)
                    await trio.sleep(idle_delay_s)

    async def _refresh_metadata(self) -> None:
        metadata, version = await self._services.ledger_store.read(self.ledger_id)
        self._metadata, self._version = metadata, version
        if metadata.is_closed:
            self._last_add_confirmed = metadata.last_entry_id


__all__ = ["READ_TIMEOUT_S", "ReadHandle"]
