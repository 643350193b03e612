"""The journal's own thread: group commit off the event loop.

The event loop hands records over under a lock; the thread takes everything
waiting, appends it, fsyncs once, and reports the batch back to trio. A
dedicated thread (as BookKeeper's journal has) costs a futex wake per batch,
where `trio.to_thread` costs about 0.15 ms per hop here: at a window of
one add, that hop would be a third of the latency budget.

Group commit: a batch is flushed once the oldest waiting record is
`group_wait_ms` old or `group_bytes` wait; with `group_wait_ms` 0 it is
flushed as soon as the previous fsync ends (records that arrive during an
fsync form the next batch).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

import trio

from bookie.journal import JournalError
from bookie.storage_interfaces import Journal, JournalPosition, JournalRecord

log = logging.getLogger(__name__)
# Framing a journal adds to each record, at most (see bookie.journal).
RECORD_OVERHEAD_BOUND = 64


@dataclass(slots=True)
class SyncedBatch:
    tokens: list[int]
    position: JournalPosition | None  # None when the batch failed
    error: OSError | JournalError | None  # the disk refused: the journal is done
    records: int
    bytes: int
    bug: BaseException | None = None  # anything else: our own bug, re-raised on the loop
    write_s: float = 0.0  # append and fsync


class JournalThread:
    def __init__(
        self,
        journal: Journal,
        *,
        group_wait_ms: float,
        group_bytes: int,
        on_synced: Callable[[], None],
    ) -> None:
        """`on_synced` runs on the trio thread (via the trio token) whenever
        batches are ready in `take_synced()`."""
        self.journal = journal
        self.group_wait_s = group_wait_ms / 1000.0
        self.group_bytes = group_bytes
        self._on_synced = on_synced
        self._trio_token = trio.lowlevel.current_trio_token()
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._records: list[JournalRecord] = []
        self._tokens: list[int] = []
        self._bytes = 0
        self._oldest_s = 0.0
        self._synced: deque[SyncedBatch] = deque()
        self._stopping = False
        self._prepare_requested = False
        self.busy = False
        self._thread = threading.Thread(target=self._run, name="journal", daemon=True)
        self._thread.start()

    # --- the event loop's side -------------------------------------------------

    def submit(self, records: list[JournalRecord], tokens: list[int], data_bytes: int) -> None:
        with self._lock:
            if not self._records:
                self._oldest_s = time.monotonic()
            self._records.extend(records)
            self._tokens.extend(tokens)
            self._bytes += data_bytes
            self._work.notify()

    def take_synced(self) -> list[SyncedBatch]:
        with self._lock:
            batches = list(self._synced)
            self._synced.clear()
            return batches

    @property
    def idle(self) -> bool:
        with self._lock:
            return not self._records and not self.busy and not self._synced

    def write_inline(self, records: list[JournalRecord], tokens: list[int], data_bytes: int) -> SyncedBatch | None:
        """Append and fsync on the caller's thread if the journal thread is
        idle with nothing queued or unreported (so journal order holds);
        otherwise do nothing and return None."""
        with self._lock:
            if self._records or self.busy or self._synced or self._stopping:
                return None
            if self.journal.room_bytes() < data_bytes + RECORD_OVERHEAD_BOUND * len(records):
                return None  # it would allocate or roll: slow, leave it to the thread
            self.busy = True
        try:
            return self._write(records, tokens, data_bytes)
        finally:
            with self._lock:
                self.busy = False
                if self.journal.needs_prepare():
                    # Let the thread preallocate ahead, off the event loop.
                    self._prepare_requested = True
                    self._work.notify()

    def stop(self) -> None:
        """Finish what is queued, then end the thread (blocking: call from a worker thread)."""
        with self._lock:
            self._stopping = True
            self._work.notify()
        self._thread.join()

    # --- the journal thread --------------------------------------------------------

    def _write(self, records: list[JournalRecord], tokens: list[int], data_bytes: int) -> SyncedBatch:
        started = time.perf_counter()
        try:
            position = self.journal.append(records)
            self.journal.sync()
            return SyncedBatch(tokens, position, None, len(records), data_bytes, write_s=time.perf_counter() - started)
        except (JournalError, OSError) as error:
            return SyncedBatch(tokens, None, error, len(records), data_bytes)
        except Exception as error:  # a bug: the loop re-raises it, the bookie stops
            return SyncedBatch(tokens, None, None, len(records), data_bytes, bug=error)

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._records and not self._stopping and not self._prepare_requested:
                    self._work.wait()
                if not self._records:
                    if self._stopping:
                        return
                    self._prepare_requested = False
                    batch = None
                else:
                    if self.group_wait_s > 0:
                        deadline = self._oldest_s + self.group_wait_s
                        while self._bytes < self.group_bytes and not self._stopping:
                            remaining = deadline - time.monotonic()
                            if remaining <= 0:
                                break
                            self._work.wait(remaining)
                    batch = self._records, self._tokens, self._bytes
                    self._records, self._tokens, self._bytes = [], [], 0
                    self.busy = True
            if batch is None:
                self._prepare_if_idle()
                continue
            synced = self._write(*batch)
            with self._lock:
                self._synced.append(synced)
                self.busy = False
            try:
                self._trio_token.run_sync_soon(self._on_synced)
            except trio.RunFinishedError:
                return
            self._prepare_if_idle()

    def _prepare_if_idle(self) -> None:
        with self._lock:
            if self._records or self.busy:
                return
            self.busy = True
        try:
            self.journal.prepare()
        finally:
            with self._lock:
                self.busy = False
