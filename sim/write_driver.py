"""One ledger's `WriteCore` carried out over a simulated node's links to
bookies and ZooKeeper, the way `LedgerHandle` does with trio: adds go out
as one ADD_BATCH per bookie, ensemble changes are written by
compare-and-set, the core's timer ticks it. The ledger checker hears of
every entry written and acknowledged. Used by the simulated writers and by
the simulated brokers' managed ledgers."""

from __future__ import annotations

from typing import Any, Callable

from bookie.protocol.wire import AddFlag
from ledger_client.write_core import AddsCompleted, AddsFailed, Closed, CloseFailed, SendAdd, WriteCore, WriteMetadata
from sim.client_node import BookieCalls, answer_metadata_write

Listener = Callable[..., None]


def _ignore(*_: Any) -> None:
    pass


class WriteDriver:
    def __init__(self, client: BookieCalls, core: WriteCore, master_key: bytes, *, on_completed: Listener = _ignore,
                 on_failed: Listener = _ignore, on_ended: Listener = _ignore, on_progress: Listener = _ignore,
                 on_close_failed: Listener = _ignore) -> None:
        """`on_completed(entry_ids)` in entry order; `on_failed(entry_ids,
        error)`; `on_ended()` once the core is closed or failed;
        `on_close_failed(error)` when a close could not be written (as
        `LedgerHandle.close` raises it); `on_progress()` after every event
        (the writer adds more)."""
        self.client = client
        self.core = core
        self.master_key = master_key
        self.on_completed = on_completed
        self.on_failed = on_failed
        self.on_ended = on_ended
        self.on_progress = on_progress
        self.on_close_failed = on_close_failed
        self.payloads: dict[int, bytes] = {}
        self.stopped = False  # its owner let it go (crashed, or done with it): answers change nothing

    @property
    def ledger_id(self) -> int:
        return self.core.metadata.ledger_id

    def add(self, payload: bytes) -> int:
        """Add an entry (raises BKError when the core takes no more adds)."""
        entry_id, actions = self.core.add(payload, self.client.world.now_ms)
        self.payloads[entry_id] = payload
        self.execute(actions)
        return entry_id

    def close(self) -> None:
        self.execute(self.core.close(self.client.world.now_ms))

    def execute(self, actions: list) -> None:
        client, core = self.client, self.core
        checker = client.ledger_checker
        ledger_id = core.metadata.ledger_id
        sends: list[SendAdd] = []
        for action in actions:
            kind = type(action)
            if kind is SendAdd:
                if (ledger_id, action.entry_id) not in checker.written:
                    checker.entry_written(ledger_id, action.entry_id, action.entry, self.payloads[action.entry_id])
                sends.append(action)
            elif kind is WriteMetadata:
                client.write_metadata(action, self._on_metadata)
            elif kind is AddsCompleted:
                for entry_id in action.entry_ids:
                    checker.entry_acked(ledger_id, entry_id, client.name, core.metadata.write_set(entry_id))
                self.on_completed(action.entry_ids)
            elif kind is AddsFailed:
                client.world.log(f"{client.name} adds failed on ledger {ledger_id}: {type(action.error).__name__}")
                self.on_failed(action.entry_ids, action.error)
            elif kind is Closed or kind is CloseFailed:
                client.world.log(f"{client.name} {kind.__name__} ledger {ledger_id}")
                if kind is CloseFailed:
                    self.on_close_failed(action.error)
            else:
                raise AssertionError(f"unknown action {action!r}")
        if sends:
            client.send_add_batches(sends, AddFlag.NONE, self.master_key, self._on_add_status)
        if core.closed or core.error is not None:
            return self.on_ended()
        client.arm_core_timer(core.next_deadline_ms(), self._tick)

    def _on_add_status(self, bookie_id: str, entry_id: int, status: Any) -> None:
        if self.stopped:
            return
        core, client = self.core, self.client
        core.bookies_changed(client.writable_bookies())
        if status is None:
            actions = core.bookie_failed(bookie_id, client.world.now_ms)
        else:
            actions = core.bookie_responded(bookie_id, entry_id, status, client.world.now_ms)
        self.execute(actions)
        self.on_progress()

    def _on_metadata(self, outcome: str, value: Any) -> None:
        if self.stopped:
            return
        self.execute(answer_metadata_write(self.core, outcome, value, self.client.world.now_ms))
        self.on_progress()

    def _tick(self) -> None:
        if self.stopped:
            return
        self.core.bookies_changed(self.client.writable_bookies())
        self.execute(self.core.tick(self.client.world.now_ms))
        self.on_progress()


__all__ = ["WriteDriver"]
