"""The bookie's garbage collector (BookKeeper's GarbageCollectorThread with
DbLedgerStorage's entry-log compaction), driven by trio.

Every `gc_interval_s` one round: find the ledgers whose metadata is gone and
drop them, record the usage of entry logs that have none, delete the logs
that hold no live ledger, and compact those below `gc_compaction_threshold`.
Decisions come from `bookie.gc_policy`; blocking work runs on worker
threads; every storage step holds the server's checkpoint lock, because
checkpoints write the same entry logs and index. On a full disk, dropping
deleted ledgers comes first (it lets a checkpoint held for room fit), and
compaction copies a stretch only when the ledger disk has room for it above
the reserve (bookie.flush_room).
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field
from typing import AbstractSet, Protocol

import trio

from bookie.compaction import CompactionAborted, EntryLogCompaction
from bookie.config import BookieConfig
from bookie.gc_policy import DeletedLedgerDetector, plan_entry_logs
from bookie.ledger_storage import LedgerStorage
from bookie.request_core import BookieCore
from bookie.storage_interfaces import CorruptEntryError, IndexWriteError, JournalPosition
from coordination.cluster_layout import iter_ledger_ids, ledger_path
from coordination.store import MetadataError, MetadataStore, NoNodeError

log = logging.getLogger(__name__)


class StorageOwner(Protocol):
    """What garbage collection needs of the server that owns the storage
    (`bookie.server.BookieServer` is one): the lock that checkpoints hold,
    the journal's state, a checkpoint on demand and the ledger disk's room.
    Named here, where it is used, so that the collector never reaches into
    the server and the server is the only one of the two that imports the
    other."""

    @property
    def journal_failed(self) -> str | None:
        """Why the journal takes no records (None: it takes them)."""

    @property
    def storage_lock(self) -> trio.Lock:
        """Held by every checkpoint and by each step of garbage collection."""

    @property
    def synced_position(self) -> JournalPosition:
        """Every journal record before it is durable."""

    async def checkpoint_locked(self) -> JournalPosition:
        """With `storage_lock` held: checkpoint what is synced; the durable mark."""

    async def has_room_for(self, entries: int, data_bytes: int) -> bool:
        """Whether the ledger disk has room for compaction's copies."""


def find_absent_ledgers(store: MetadataStore, known: AbstractSet[int]) -> set[int]:
    """Of the ledgers in `known` (a snapshot taken before this call), those
    whose metadata the store confirms gone: missing from a listing, then
    missing on a direct read (NoNodeError). A store error propagates, and
    the caller then deletes nothing (blocking: call from a worker thread)."""
    if not known:
        return set()
    last = max(known)
    listed: set[int] = set()
    for ledger_id in iter_ledger_ids(store, min(known)):
        if ledger_id > last:
            break
        listed.add(ledger_id)
    absent = set()
    for ledger_id in sorted(set(known) - listed):
        try:
            store.get(ledger_path(ledger_id))
        except NoNodeError:
            absent.add(ledger_id)
    return absent


@dataclass
class GcWork:
    """What garbage collection did, in a round or in all."""

    ledgers_dropped: int = 0
    entry_logs_deleted: int = 0
    entry_logs_compacted: int = 0
    entries_moved: int = 0
    bytes_reclaimed: int = 0  # bytes of removed log files, less the bytes compaction copied

    def add(self, other: "GcWork") -> None:
        for name, value in asdict(other).items():
            setattr(self, name, getattr(self, name) + value)

    def __bool__(self) -> bool:
        return any(asdict(self).values())


@dataclass
class GcStats:
    done: GcWork = field(default_factory=GcWork)
    rounds: int = 0
    rounds_failed: int = 0
    compactions_aborted: int = 0
    last_run_ms: float = 0.0
    last_error: str = ""

    def as_info(self) -> dict[str, object]:
        """For GET_INFO (`quire bookie info`), each name prefixed with gc_."""
        flat = {name: value for name, value in asdict(self).items() if name != "done"}
        flat.update(asdict(self.done))
        return {f"gc_{name}": value for name, value in flat.items()}


class GarbageCollector:
    """One per bookie server; `run()` is its task. It works on the server's
    request `core` and `storage`, and asks the `owner` (the server) for the
    rest. `ledger_metadata` is the synchronous store to look for ledger
    metadata in (None: no ledger is ever deleted, entry logs are still
    cleaned up)."""

    def __init__(
        self,
        config: BookieConfig,
        *,
        core: BookieCore,
        storage: LedgerStorage,
        owner: StorageOwner,
        ledger_metadata: MetadataStore | None,
    ) -> None:
        self.core = core
        self.storage = storage
        self.owner = owner
        self.ledger_metadata = ledger_metadata
        self.interval_s = config.gc_interval_s
        self.compaction_threshold = config.gc_compaction_threshold
        self.compaction_bytes_max = config.gc_compaction_bytes_max
        self.stretch_bytes = config.gc_compaction_stretch_bytes
        self.detector = DeletedLedgerDetector()
        self.stats = GcStats()
        # Ledgers the core forgot whose index entries are not yet removed:
        # live for entry-log decisions until then.
        self._dropping: set[int] = set()
        # Logs found damaged: kept as they are for the life of the process.
        self._damaged_logs: set[int] = set()
        self._publish()

    def _publish(self) -> None:
        """Counters for GET_INFO (`quire bookie info`), from the start on."""
        self.core.info.update(self.stats.as_info(), entry_logs=len(self.storage.log_usage))

    async def run(self) -> None:
        while True:
            await trio.sleep(self.interval_s)
            await self.run_round()

    async def run_round(self) -> None:
        started = time.perf_counter()
        work = GcWork()
        try:
            await self._drop_deleted_ledgers(work)
            await self._collect_entry_logs(work)
        except (OSError, CorruptEntryError, IndexWriteError) as error:
            # The disk refused (full, failing): nothing half-done is visible,
            # the next round tries again. (After a failed index write the next
            # checkpoint fails too, and the bookie turns read-only.)
            self.stats.rounds_failed += 1
            self.stats.last_error = f"{type(error).__name__}: {error}"
            log.error("garbage collection round failed: %s", error)
        finally:
            elapsed_ms = (time.perf_counter() - started) * 1000
            self.stats.rounds += 1
            self.stats.last_run_ms = round(elapsed_ms, 1)
            self.stats.done.add(work)
            self._publish()
        if work:
            log.info(
                "garbage collection: dropped %d ledgers, deleted %d entry logs, compacted %d (%d entries moved), "
                "reclaimed %d bytes in %.0f ms",
                work.ledgers_dropped, work.entry_logs_deleted, work.entry_logs_compacted, work.entries_moved,
                work.bytes_reclaimed, elapsed_ms,
            )

    # --- deleted ledgers -------------------------------------------------------------

    async def _drop_deleted_ledgers(self, work: GcWork) -> None:
        owner, core, storage = self.owner, self.core, self.storage
        if owner.journal_failed is not None:
            # Records of a failed journal batch may be on disk past the synced
            # position, where a restart would replay them: drop nothing.
            return
        if self.ledger_metadata is not None:
            known = set(core.ledgers)  # before the listing begins
            try:
                absent = await trio.to_thread.run_sync(find_absent_ledgers, self.ledger_metadata, known)
            except MetadataError as error:
                self.stats.last_error = f"metadata store: {error}"
                log.warning("garbage collection: the metadata store failed (%s); no ledger is deleted this round", error)
            else:
                deleted = self.detector.round(known, absent)
                if deleted:
                    self._dropping.update(core.drop_ledgers(deleted))
        if not self._dropping:
            return
        async with owner.storage_lock:
            # A writer that did not hear of the delete may have started one
            # of them afresh meanwhile: that ledger is live again.
            ledgers = sorted(ledger_id for ledger_id in self._dropping if ledger_id not in core.ledgers)
            # Their cached entries need no flush: forgetting them first makes
            # the checkpoint smaller, so that one held for room may now fit.
            storage.discard_cached(ledgers)
            # Every journal record of a dropped ledger is synced (the core
            # drops none with a request in flight). A checkpoint past them
            # comes first, so that no restart replays them once the index
            # forgets the ledger.
            synced = owner.synced_position
            mark = await owner.checkpoint_locked()
            if mark < synced:
                log.info("garbage collection: a checkpoint is held, ledgers %s are dropped once it is written", _ids(ledgers))
                return
            ledgers = [ledger_id for ledger_id in ledgers if ledger_id not in core.ledgers]
            await trio.to_thread.run_sync(storage.drop_from_index, ledgers)
        self._dropping.clear()
        work.ledgers_dropped += len(ledgers)
        log.info("garbage collection: dropped ledgers %s, whose metadata is gone", _ids(ledgers))

    # --- entry logs ---------------------------------------------------------------------

    def _live_ledgers(self) -> set[int]:
        return set(self.core.ledgers) | self._dropping

    async def _collect_entry_logs(self, work: GcWork) -> None:
        storage, lock = self.storage, self.owner.storage_lock
        async with lock:
            unmeasured = storage.entry_logs_without_usage()
        if unmeasured:
            # Without the lock: checkpoints never write to these logs.
            usage = await trio.to_thread.run_sync(storage.measure_entry_logs, unmeasured)
            async with lock:
                await trio.to_thread.run_sync(storage.record_log_usage, usage)
            log.info("garbage collection: measured entry logs %s, which had no recorded usage", _ids(unmeasured))
        async with lock:
            live = self._live_ledgers()
            writing = storage.entry_log.writing_log_id()
            plan = await trio.to_thread.run_sync(
                lambda: plan_entry_logs(
                    storage.log_usage,
                    live,
                    writing_log_id=writing,
                    compaction_threshold=self.compaction_threshold,
                    compaction_bytes_max=self.compaction_bytes_max,
                    uncompactable=self._damaged_logs,
                )
            )
        for log_id in plan.delete:
            # One log per hold of the lock: a checkpoint waits for one at most.
            async with lock:
                work.bytes_reclaimed += await trio.to_thread.run_sync(storage.delete_entry_log, log_id)
            work.entry_logs_deleted += 1
        for log_id in plan.compact:
            await self._compact(log_id, work)

    async def _compact(self, log_id: int, work: GcWork) -> None:
        storage, lock = self.storage, self.owner.storage_lock
        async with lock:
            compaction = EntryLogCompaction(storage, log_id, self.stretch_bytes)
        try:
            done = False
            while not done:
                # Checkpoints get the lock between stretches.
                async with lock:
                    live = await trio.to_thread.run_sync(compaction.scan_next)
                    entries = sum(map(len, live.values()))
                    data_bytes = sum(len(data) for entries_of_ledger in live.values() for data in entries_of_ledger.values())
                    if entries and not await self.owner.has_room_for(entries, data_bytes):
                        # Copies need room until the old log goes: leave the
                        # rest for a round when the disk has it.
                        log.info("garbage collection: no room on the ledger disk to compact entry log %d this round", log_id)
                        return
                    await trio.to_thread.run_sync(compaction.move, live)
                    done = compaction.scanned_to_end
            async with lock:
                live = self._live_ledgers()
                freed = await trio.to_thread.run_sync(compaction.finish, live)
        except CompactionAborted as error:
            self._damaged_logs.add(log_id)
            self.stats.compactions_aborted += 1
            self.stats.last_error = str(error)
            log.error("garbage collection: %s", error)
            return
        finally:
            work.entries_moved += compaction.entries_moved
            work.bytes_reclaimed -= compaction.bytes_moved
        work.bytes_reclaimed += freed
        work.entry_logs_compacted += 1


def _ids(ids: list[int], shown_max: int = 20) -> str:
    shown = ", ".join(map(str, ids[:shown_max]))
    return shown + (f" and {len(ids) - shown_max} more" if len(ids) > shown_max else "")
