"""Carrying out what the pure cores ask of their drivers, shared by the
write handle and the recoverer: the run's time in milliseconds, a timer
for a core's deadlines, and the compare-and-set of a core's metadata."""

from __future__ import annotations

import math
from typing import Callable

import trio

from coordination.store import BadVersionError, MetadataError
from ledger_client.client_services import LedgerMetadataAccess, WritableBookies
from ledger_client.errors import BKError
from ledger_client.write_core import WriteMetadata


def now_ms() -> float:
    return trio.current_time() * 1000.0


class CoreTicker:
    """Calls a core's `tick` at its next deadline (a RecoveryCore has
    `next_deadline_ms`, `tick` and `bookies_changed`). Call
    `wake_if_due_sooner()` after each step that may move the deadline.
    (Write handles share one timer instead: `ledger_client.add_timeouts`.)"""

    def __init__(self, core, bookies: WritableBookies, execute: Callable[[list], None]) -> None:
        self._core = core
        self._bookies = bookies
        self._execute = execute
        self._wakeup = trio.Event()
        self._sleeping_until_ms = math.inf

    def wake(self) -> None:
        self._wakeup.set()

    def wake_if_due_sooner(self) -> None:
        """Wake the timer only if the core's deadline moved before the one it
        sleeps until (a later deadline is found on waking)."""
        deadline_ms = self._core.next_deadline_ms()
        if deadline_ms is not None and deadline_ms < self._sleeping_until_ms:
            self._wakeup.set()

    async def run(self, keep_going: Callable[[], bool] = lambda: True) -> None:
        while keep_going():
            deadline_ms = self._core.next_deadline_ms()
            self._sleeping_until_ms = math.inf if deadline_ms is None else deadline_ms
            self._wakeup = trio.Event()
            with trio.move_on_at(self._sleeping_until_ms / 1000.0):
                await self._wakeup.wait()
                continue
            # A tick may replace bookies: let it pick from the registry as it is now.
            self._core.bookies_changed(self._bookies.writable_racks())
            self._execute(self._core.tick(now_ms()))


async def carry_out_metadata_write(store: LedgerMetadataAccess, core, action: WriteMetadata) -> list:
    """Compare-and-set `action.metadata` and tell the core how it went (a
    WriteCore and a RecoveryCore answer the same three events); returns
    the core's actions."""
    ledger_id = action.metadata.ledger_id
    try:
        version = await store.write(action.metadata, action.expected_version)
    except BadVersionError:
        try:
            current, current_version = await store.read(ledger_id)
        except (MetadataError, BKError) as error:
            return core.metadata_failed(_as_bk_error(error))
        return core.metadata_conflict(current, current_version, now_ms())
    except (MetadataError, BKError) as error:
        return core.metadata_failed(_as_bk_error(error))
    return core.metadata_written(version, now_ms())


def _as_bk_error(error: Exception) -> BKError:
    if isinstance(error, BKError):
        return error
    return BKError(f"metadata store failed: {error}")


__all__ = ["CoreTicker", "carry_out_metadata_write", "now_ms"]
