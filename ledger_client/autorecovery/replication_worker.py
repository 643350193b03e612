"""The replication worker's trio driver: takes marked ledgers one lock at a
time, copies the lost bookies' entries from surviving replicas to a
replacement with recovery adds, checks the replacement lists them, and puts
the replacement in the ensemble by compare-and-set; an open ledger is fenced
and closed first once its grace period is over. The decisions are
`replication_core`'s."""

from __future__ import annotations

import functools
import logging
import random
from typing import TYPE_CHECKING

import trio

from bookie.protocol.entry_format import DigestManager, DigestMismatchError, EntryFormatError, master_key
from bookie.protocol.wire import (
    AddFlag,
    AddRequest,
    BatchReadRequest,
    ListEntriesRequest,
    ReadFlag,
    ReadRequest,
    Status,
    encode_add_tail,
)
from coordination.cluster_layout import ClusterLayout
from coordination.store import MetadataError
from ledger_client.autorecovery import underreplication
from ledger_client.autorecovery.config import AutoRecoveryConfig
from ledger_client.autorecovery.replication_core import (
    BLOCKED_RECHECK_MS_MIN,
    Fragment,
    GraceClock,
    Replacement,
    RetryBackoff,
    Step,
    apply_replacements,
    choose_replacements,
    next_list_start,
    password_for,
    plan_replication,
)
from ledger_client.autorecovery.waits import run_while_enabled, wait_any, wall_ms
from ledger_client.bookie_client import BookieConnectionError
from ledger_client.errors import BKError, NoSuchLedgerError
from ledger_client.metadata import LedgerState

if TYPE_CHECKING:
    from ledger_client.bookkeeper import BookKeeper

log = logging.getLogger(__name__)

REQUEST_TIMEOUT_S = 10.0  # a bookie that takes a request and never answers
BATCH_BYTES_MAX = 4 * 1024 * 1024  # a batch read's answer
RECOVERY_TIMEOUT_S = 120.0  # fencing and closing an open ledger
ROUNDS_MAX = 8  # plan-copy-update rounds for one ledger in one attempt
LOCKED_RECHECK_MS = 5_000.0  # another worker holds the lock: look again after this
MARKERS_RELIST_MS = 30_000.0  # list the markers this often even without a watch event
UNLOCK_RETRY_MS = 1_000.0  # a lock whose release failed (store unreachable) is released again this often
UNLOCK_TIMEOUT_S = 5.0


class ReplicationError(BKError):
    """A fragment could not be copied (no intact copy, the replacement
    refused it) or the ledger cannot be handled (no password opens it)."""


class ReplicationWorker:
    def __init__(
        self,
        bookkeeper: "BookKeeper",
        config: AutoRecoveryConfig,
        name: str,
        *,
        layout: ClusterLayout | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self._bookkeeper = bookkeeper
        self._config = config
        self.name = name
        self._layout = layout or ClusterLayout()
        self._rng = rng or random.Random()
        self._backoff = RetryBackoff(
            delay_ms_initial=config.retry_delay_ms_initial, delay_ms_max=config.retry_delay_ms_max
        )
        self._in_progress: set[int] = set()
        self._finished = trio.Event()
        self._grace = GraceClock()
        self._unlocks_pending: set[int] = set()  # locks of ours whose release failed
        self._blocked_warned: set[int] = set()  # blocked ledgers already warned about
        # Counters for status and tests.
        self.ledgers_replicated = 0
        self.fragments_replicated = 0
        self.entries_copied = 0
        self.ledgers_recovered = 0
        self.ledgers_blocked = 0  # times a ledger was found blocked (see Step.BLOCKED)
        self.failures = 0

    # --- the loop -----------------------------------------------------------------------

    async def run(self) -> None:
        """Work until cancelled, pausing while auto-recovery is switched off."""
        await trio.to_thread.run_sync(
            underreplication.ensure_paths, self._bookkeeper.store.store, self._layout, abandon_on_cancel=True
        )
        await run_while_enabled("replication worker", self._bookkeeper.store, self._layout, self._work)

    async def _work(self) -> None:
        store, layout = self._bookkeeper.store, self._layout
        slots = trio.Semaphore(self._config.ledgers_in_flight_max)
        changed: trio.Event | None = None
        async with trio.open_nursery() as nursery:
            while True:
                # A new event before looking: an attempt that ends from now
                # on wakes the wait below; one that ended before is seen by
                # this pass (its retry time, its free slot).
                finished = self._finished = trio.Event()
                await self._release_pending_locks()
                if changed is None or changed.is_set():
                    names, changed = await store.children_watch(layout.underreplicated_ledgers)
                else:
                    # The watch set before has not fired: a new one each
                    # round would pile up callbacks in the ZooKeeper client.
                    names = await store.children(layout.underreplicated_ledgers)
                marked = [int(name) for name in names if name.isascii() and name.isdigit()]
                self._grace.forget_except(marked)
                self._blocked_warned.intersection_update(marked)
                ready = [ledger_id for ledger_id in self._backoff.ready(marked, wall_ms()) if ledger_id not in self._in_progress]
                # Workers in every bookie look at the same list: start at
                # different places so that they rarely meet on one lock.
                self._rng.shuffle(ready)
                for ledger_id in ready:
                    try:
                        slots.acquire_nowait()
                    except trio.WouldBlock:
                        break
                    self._in_progress.add(ledger_id)
                    self._backoff.started(ledger_id)
                    nursery.start_soon(self._attempt, ledger_id, slots)
                deadline_ms = wall_ms() + MARKERS_RELIST_MS
                # Retry times matter only when a slot is free to use them;
                # otherwise the end of an attempt wakes the loop.
                next_ready_ms = self._backoff.next_ready_ms() if slots.value > 0 else None
                if next_ready_ms is not None:
                    deadline_ms = min(deadline_ms, next_ready_ms)
                if self._unlocks_pending - self._in_progress:
                    deadline_ms = min(deadline_ms, wall_ms() + UNLOCK_RETRY_MS)
                await wait_any(changed.wait, finished.wait, deadline_ms=deadline_ms)

    async def _attempt(self, ledger_id: int, slots: trio.Semaphore) -> None:
        store, layout = self._bookkeeper.store, self._layout
        try:
            if not await trio.to_thread.run_sync(underreplication.try_lock, store.store, layout, ledger_id, self.name):
                self._backoff.wait_until(ledger_id, wall_ms() + LOCKED_RECHECK_MS)
                return
            try:
                wait_until_ms = await self._replicate(ledger_id)
            finally:
                await self._unlock(ledger_id)
            if wait_until_ms is None:
                self._backoff.succeeded(ledger_id)
                self.ledgers_replicated += 1
            else:
                self._backoff.wait_until(ledger_id, wait_until_ms)
        except (BKError, MetadataError, BookieConnectionError, trio.TooSlowError) as error:
            self.failures += 1
            again_ms = self._backoff.failed(ledger_id, wall_ms(), self._rng)
            log.warning("ledger %d: re-replication failed (%s); again in %.1fs", ledger_id, error, (again_ms - wall_ms()) / 1000)
        finally:
            self._in_progress.discard(ledger_id)
            slots.release()
            self._finished.set()

    async def _unlock(self, ledger_id: int) -> bool:
        """Release our lock on the ledger, even in a cancelled scope; when
        the store cannot be reached the lock is kept for a later try (left
        alone, it would stay with our session, and no other worker could
        take the ledger while it lasts). Returns whether it was released."""
        with trio.move_on_after(UNLOCK_TIMEOUT_S) as scope:
            scope.shield = True
            try:
                await trio.to_thread.run_sync(
                    underreplication.unlock, self._bookkeeper.store.store, self._layout, ledger_id, abandon_on_cancel=True
                )
                self._unlocks_pending.discard(ledger_id)
                return True
            except MetadataError as error:
                log.info("ledger %d: lock not released yet (%s); trying again", ledger_id, error)
        self._unlocks_pending.add(ledger_id)
        return False

    async def _release_pending_locks(self) -> None:
        for ledger_id in sorted(self._unlocks_pending - self._in_progress):
            if not await self._unlock(ledger_id):
                return  # the store is still away: the next pass tries again

    # --- one ledger ---------------------------------------------------------------------

    async def _replicate(self, ledger_id: int) -> float | None:
        """Bring the ledger back to full replication. Returns None once its
        marker is gone, or the time to look again (an open ledger within its
        grace period)."""
        bookkeeper, layout = self._bookkeeper, self._layout
        sync_store = bookkeeper.store.store
        for _ in range(ROUNDS_MAX):
            found = await trio.to_thread.run_sync(underreplication.read_marker, sync_store, layout, ledger_id)
            if found is None:
                return None
            marker, marker_version = found
            try:
                metadata, _ = await bookkeeper.ledger_store.read(ledger_id)
            except NoSuchLedgerError:
                await trio.to_thread.run_sync(underreplication.unmark, sync_store, layout, ledger_id, marker_version)
                continue
            registered = set(bookkeeper.registry.writable_bookies) | set(bookkeeper.registry.readonly_bookies)
            suspects = marker.lost_bookies or metadata.all_bookies()
            lost = frozenset(suspects - registered)
            now_ms = wall_ms()
            plan = plan_replication(
                metadata, lost, lost_since_ms=self._grace.lost_since_ms(ledger_id, lost, now_ms),
                now_ms=now_ms, grace_ms=self._config.open_ledger_grace_ms,
            )
            if plan.step is Step.DONE:
                if await trio.to_thread.run_sync(underreplication.unmark, sync_store, layout, ledger_id, marker_version):
                    log.info("ledger %d is fully replicated again", ledger_id)
                    self._blocked_warned.discard(ledger_id)
                    return None
                continue  # the auditor added a bookie meanwhile: look again
            if plan.step is Step.WAIT:
                return plan.wait_until_ms
            if plan.step is Step.BLOCKED:
                self._warn_blocked(metadata, plan.blocked_by)
                return plan.wait_until_ms
            password = password_for(metadata, self._config.passwords)
            if password is None:
                raise ReplicationError(f"ledger {ledger_id}: none of the configured recovery passwords opens it")
            if plan.step is Step.RECOVER:
                log.info("ledger %d: %s past its grace period; fencing and closing it", ledger_id, metadata.state.value)
                with trio.fail_after(RECOVERY_TIMEOUT_S):
                    await bookkeeper.open_ledger(ledger_id, password, recovery=True)
                self.ledgers_recovered += 1
                continue
            await self._replicate_fragments(metadata, plan.fragments, lost, password)
        raise ReplicationError(f"ledger {ledger_id}: still under-replicated after {ROUNDS_MAX} rounds")

    def _warn_blocked(self, metadata, blocked_by: frozenset[str]) -> None:
        self.ledgers_blocked += 1
        if metadata.ledger_id in self._blocked_warned:
            return
        self._blocked_warned.add(metadata.ledger_id)
        bookies = ", ".join(sorted(blocked_by))
        resolved_by = f"bookie {bookies} back" if metadata.state is not LedgerState.OPEN else (
            f"bookie {bookies} back or the writer's next add to replace it"
        )
        log.warning(
            "ledger %d (%s, E=%d WQ=%d AQ=%d): without %s its last ensemble keeps fewer than E - AQ + 1 live "
            "bookies, too few for recovery to fence it and decide its last entries, so it is not fenced; it needs "
            "%s (looking again every %.0fs)",
            metadata.ledger_id, metadata.state.value, metadata.ensemble_size, metadata.write_quorum,
            metadata.ack_quorum, bookies, resolved_by,
            max(self._config.open_ledger_grace_ms, BLOCKED_RECHECK_MS_MIN) / 1000,
        )

    async def _replicate_fragments(self, metadata, fragments: tuple[Fragment, ...], lost: frozenset[str], password: bytes) -> None:
        bookkeeper = self._bookkeeper
        await bookkeeper.registry.refresh()
        new_bookies = choose_replacements(metadata, fragments, bookkeeper.registry.writable_racks(), lost, rng=self._rng)
        digest = DigestManager(metadata.ledger_id, metadata.digest_type, password)
        key = master_key(password)
        for fragment, new_bookie in zip(fragments, new_bookies):
            await self._copy_fragment(metadata, fragment, new_bookie, lost, digest, key)
        replacements = [
            Replacement(fragment.first_entry_id, fragment.index, fragment.bookie_id, new_bookie)
            for fragment, new_bookie in zip(fragments, new_bookies)
        ]
        await bookkeeper.ledger_store.update(metadata.ledger_id, functools.partial(apply_replacements, replacements=replacements))
        self.fragments_replicated += len(fragments)
        log.info(
            "ledger %d: %s", metadata.ledger_id,
            ", ".join(f"{r.old} -> {r.new} from entry {r.first_entry_id}" for r in replacements),
        )

    async def _copy_fragment(
        self, metadata, fragment: Fragment, new_bookie: str, lost: frozenset[str], digest: DigestManager, key: bytes
    ) -> None:
        entry_ids = fragment.entry_ids(metadata.write_quorum)
        if not entry_ids:
            return  # an ensemble that never held an entry: only the metadata changes
        remaining = entry_ids
        if metadata.write_quorum == metadata.ensemble_size:
            # Every surviving member holds every entry of the fragment: read
            # runs of entries with batch reads instead of one read each.
            remaining = await self._copy_by_batches(metadata, fragment, entry_ids, new_bookie, lost, digest, key)
        slots = trio.Semaphore(self._config.entries_in_flight_max)
        errors: list[Exception] = []
        async with trio.open_nursery() as nursery:
            for entry_id in remaining:
                await slots.acquire()
                if errors:
                    break
                nursery.start_soon(
                    self._copy_entry, metadata, fragment, entry_id, new_bookie, lost, digest, key, slots, errors
                )
        if errors:
            raise errors[0]
        # Check that the replacement holds every entry before the metadata
        # names it: an add it acknowledged is durable there (journal fsync).
        held = set()
        next_first: int | None = entry_ids[0]
        while next_first is not None:
            response = await self._call(new_bookie, functools.partial(
                _list_entries, metadata.ledger_id, next_first, entry_ids[-1]
            ))
            ranges = response.ranges if response.status is Status.OK else []
            for first, last in ranges:
                held.update(range(max(first, next_first), min(last, entry_ids[-1]) + 1))
            next_first = next_list_start(next_first, entry_ids[-1], ranges)
        missing = [entry_id for entry_id in entry_ids if entry_id not in held]
        if missing:
            raise ReplicationError(
                f"ledger {metadata.ledger_id}: {new_bookie} lacks {len(missing)} copied entries (first {missing[0]})"
            )

    async def _copy_by_batches(
        self, metadata, fragment: Fragment, entry_ids: list[int], new_bookie: str, lost: frozenset[str],
        digest: DigestManager, key: bytes,
    ) -> list[int]:
        """Copy consecutive `entry_ids` a batch read at a time (at most
        `entries_in_flight_max` entries a batch, their adds pipelined);
        returns the entries left for one-by-one copying when no source
        answers a batch with an intact run."""
        sources = fragment.sources(entry_ids[0], metadata.write_quorum, lost)
        next_entry_id, last_entry_id = entry_ids[0], entry_ids[-1]
        batch = 0
        while next_entry_id <= last_entry_id and sources:
            wanted = min(self._config.entries_in_flight_max, last_entry_id - next_entry_id + 1)
            entries = []
            for attempt in range(len(sources)):
                source = sources[(batch + attempt) % len(sources)]
                entries = await self._read_batch(source, metadata.ledger_id, next_entry_id, wanted, digest)
                if entries:
                    break
            if not entries:
                break
            await self._add_all(metadata.ledger_id, next_entry_id, entries, new_bookie, key)
            next_entry_id += len(entries)
            batch += 1
        return [entry_id for entry_id in entry_ids if entry_id >= next_entry_id]

    async def _read_batch(self, bookie_id: str, ledger_id: int, first_entry_id: int, wanted: int, digest: DigestManager) -> list[bytes]:
        """The intact run of entries from `first_entry_id` (at most `wanted`)
        that `bookie_id` returns to a batch read; empty when it fails."""
        try:
            response = await self._call(bookie_id, functools.partial(
                _batch_read, ledger_id, first_entry_id, wanted, BATCH_BYTES_MAX
            ))
        except (BookieConnectionError, trio.TooSlowError):
            return []
        if response.status is not Status.OK:
            return []
        entries = response.entries[:wanted]
        intact = len(digest.decode_range(entries, first_entry_id))
        return entries[:intact]

    async def _add_all(self, ledger_id: int, first_entry_id: int, entries: list[bytes], new_bookie: str, key: bytes) -> None:
        """Recovery-add `entries` (consecutive from `first_entry_id`) to
        `new_bookie`, pipelined, and wait for every answer."""
        answered = trio.Event()
        statuses: dict[int, object] = {}

        def on_answer(entry_id: int, response) -> None:
            statuses[entry_id] = response if isinstance(response, BookieConnectionError) else response.status
            if len(statuses) == len(entries):
                answered.set()

        for offset, entry in enumerate(entries):
            self._bookkeeper.pool.send_add_tail(
                new_bookie, encode_add_tail(AddFlag.RECOVERY_ADD, key, entry),
                functools.partial(on_answer, first_entry_id + offset), ledger_id, first_entry_id + offset,
            )
        with trio.fail_after(REQUEST_TIMEOUT_S):
            await answered.wait()
        failed = sorted(entry_id for entry_id, status in statuses.items() if status is not Status.OK)
        if failed:
            raise ReplicationError(
                f"ledger {ledger_id}: {new_bookie} did not take {len(failed)} entries "
                f"(entry {failed[0]}: {statuses[failed[0]]})"
            )
        self.entries_copied += len(entries)

    async def _copy_entry(
        self, metadata, fragment: Fragment, entry_id: int, new_bookie: str, lost: frozenset[str],
        digest: DigestManager, key: bytes, slots: trio.Semaphore, errors: list[Exception],
    ) -> None:
        """Copy one entry; a failure is added to `errors` (the fragment
        stops starting copies and reports the first)."""
        try:
            sources = fragment.sources(entry_id, metadata.write_quorum, lost)
            # Spread the reads over the surviving replicas.
            turn = entry_id % len(sources) if sources else 0
            entry = None
            for source in sources[turn:] + sources[:turn]:
                entry = await self._read_intact(source, metadata.ledger_id, entry_id, digest)
                if entry is not None:
                    break
            if entry is None:
                raise ReplicationError(
                    f"ledger {metadata.ledger_id} entry {entry_id}: no intact copy on {sources or 'any surviving bookie'}"
                )
            response = await self._call(new_bookie, functools.partial(_recovery_add, key, entry))
            if response.status is not Status.OK:
                raise ReplicationError(
                    f"ledger {metadata.ledger_id} entry {entry_id}: {new_bookie} answered {response.status.name}"
                )
            self.entries_copied += 1
        except (ReplicationError, BookieConnectionError, trio.TooSlowError) as error:
            errors.append(error)
        finally:
            slots.release()

    async def _read_intact(self, bookie_id: str, ledger_id: int, entry_id: int, digest: DigestManager) -> bytes | None:
        """The entry's bytes as stored on `bookie_id`, if it answers with an
        intact copy (digest checked: a corrupt copy is never spread)."""
        try:
            response = await self._call(bookie_id, functools.partial(_read, ledger_id, entry_id))
        except (BookieConnectionError, trio.TooSlowError):
            return None
        if response.status is not Status.OK or response.entry is None:
            return None
        try:
            digest.decode(response.entry, expected_entry_id=entry_id)
        except (DigestMismatchError, EntryFormatError) as error:
            log.warning("ledger %d entry %d on %s is corrupt: %s", ledger_id, entry_id, bookie_id, error)
            return None
        return response.entry

    async def _call(self, bookie_id: str, request_factory):
        with trio.fail_after(REQUEST_TIMEOUT_S):
            return await self._bookkeeper.pool.call(bookie_id, request_factory)


def _read(ledger_id: int, entry_id: int, request_id: int) -> ReadRequest:
    return ReadRequest(request_id, ReadFlag.NONE, ledger_id, entry_id, None, None, None)


def _batch_read(ledger_id: int, first_entry_id: int, entries_max: int, bytes_max: int, request_id: int) -> BatchReadRequest:
    return BatchReadRequest(request_id, ledger_id, first_entry_id, entries_max, bytes_max)


def _recovery_add(key: bytes, entry: bytes, request_id: int) -> AddRequest:
    return AddRequest(request_id, AddFlag.RECOVERY_ADD, key, entry)


def _list_entries(ledger_id: int, first_entry_id: int, last_entry_id: int, request_id: int) -> ListEntriesRequest:
    return ListEntriesRequest(request_id, ledger_id, first_entry_id, last_entry_id)


__all__ = ["ReplicationError", "ReplicationWorker"]
