"""A partition's storage in the broker simulation: a durable log with an
owner epoch, standing for the managed ledger over BookKeeper.

Appending needs the current epoch; a new owner opens the log, which bumps
the epoch (as recovery fences the last ledger) and shows it every persisted
entry. Appends complete in order after a delay. Those still in flight when
the log is opened again (the writer crashed, paused or failed) are decided
then: a random prefix of them is persisted, the rest is lost, and a writer
still alive hears of each outcome as it would from its bookies (an entry
persisted by the recovery may still be acknowledged to it late). A storage
failure fails every append in flight without deciding them: the next
opening does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from sim.world import World


@dataclass(frozen=True, slots=True)
class LogEntry:
    ledger_id: int  # the epoch of the owner that wrote it: one ledger per owner
    entry_id: int  # within that ledger
    producer_id: str
    sequence_ids: tuple[int, ...]
    keys: tuple[str | None, ...]
    first_offset: int

    @property
    def message_count(self) -> int:
        return len(self.sequence_ids)

    @property
    def last_offset(self) -> int:
        return self.first_offset + len(self.sequence_ids) - 1

    @property
    def last_sequence_id(self) -> int:
        return self.sequence_ids[-1]


OnDone = Callable[[LogEntry | None], None]


@dataclass(eq=False, slots=True)
class _Append:
    entry: LogEntry
    on_done: OnDone
    complete_ms: float
    outcome: bool | None = None  # decided: persisted (True) or lost (False)
    told: bool = False  # the writer heard of it


class SimPartitionLog:
    def __init__(self, world: World, *, append_ms_max: float, on_persisted: Callable[[LogEntry], None]) -> None:
        self.world = world
        self.append_ms_max = append_ms_max
        self.on_persisted = on_persisted  # the checker's view of what became durable
        self.epoch = 0
        self.entries: list[LogEntry] = []
        self._in_flight: list[_Append] = []  # in append order
        self._broken_epoch = -1  # a storage failure: the writer of this epoch appends no more
        self._entries_in_ledger = 0
        self._last_complete_ms = 0.0

    @property
    def next_offset(self) -> int:
        return self.entries[-1].last_offset + 1 if self.entries else 0

    def open(self) -> tuple[int, list[LogEntry]]:
        """A new owner: fence the previous one, decide what it had in flight,
        and return the new epoch and every persisted entry."""
        undecided = [append for append in self._in_flight if append.outcome is None]
        persisted = self.world.rng.randint(0, len(undecided))
        for index, append in enumerate(undecided):
            append.outcome = index < persisted
            if append.outcome:
                self._persist(append.entry)
        self._in_flight = []  # all decided; the writer hears of each at its time
        self.epoch += 1
        self._entries_in_ledger = 0
        self.world.log(f"log opened at epoch {self.epoch}: {len(self.entries)} entries "
                       f"({persisted} of {len(undecided)} in flight persisted)")
        return self.epoch, list(self.entries)

    def append(self, epoch: int, producer_id: str, sequence_ids: tuple[int, ...], keys: tuple[str | None, ...],
               first_offset: int, on_done: OnDone) -> None:
        """Append an entry as the owner of `epoch`; `on_done(entry)` once it is
        persisted, `on_done(None)` once it failed (in append order)."""
        entry = LogEntry(epoch, self._entries_in_ledger, producer_id, sequence_ids, keys, first_offset)
        complete_ms = max(self.world.now_ms + self.world.uniform(0.1, self.append_ms_max), self._last_complete_ms)
        self._last_complete_ms = complete_ms
        append = _Append(entry, on_done, complete_ms)
        if epoch != self.epoch or epoch == self._broken_epoch:
            append.outcome = False  # fenced: nothing of it is written
        else:
            self._entries_in_ledger += 1
            self._in_flight.append(append)
        self.world.at(complete_ms, self._complete, append)

    def _complete(self, append: _Append) -> None:
        if append.told:
            return
        if append.outcome is None:
            append.outcome = True
            self._persist(append.entry)
        append.told = True
        if self._in_flight and self._in_flight[0] is append:
            self._in_flight.pop(0)  # appends complete in order
        append.on_done(append.entry if append.outcome else None)

    def _persist(self, entry: LogEntry) -> None:
        expected = self.next_offset
        assert entry.first_offset == expected, f"entry at offset {entry.first_offset}, the log's next is {expected}"
        self.entries.append(entry)
        self.on_persisted(entry)

    def fail_writes(self) -> int:
        """Storage failed (bookies gone): every append in flight fails now and
        is decided at the next opening; the writer appends no more. Returns
        how many failed."""
        failed = 0
        for append in self._in_flight:
            if not append.told:
                append.told = True
                failed += 1
                append.on_done(None)
        self._broken_epoch = self.epoch
        return failed
