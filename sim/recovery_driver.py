"""One ledger's recovery through the real `RecoveryCore`, carried out over a
simulated node's links to bookies and ZooKeeper as `ledger_client.recovery`
does with trio: fencing reads, recovery reads (fenced), recovery adds and
metadata writes. Used by the simulated recoverers and by the simulated
brokers opening a partition."""

from __future__ import annotations

from typing import Any, Callable

from bookie.protocol.entry_format import DigestManager, DigestMismatchError, EntryFormatError
from bookie.protocol.wire import LAST_ADD_CONFIRMED, AddFlag, ReadFlag, ReadRequest, Status
from ledger_client.recovery_core import FenceRead, Phase, RecoveryCore, RecoveryDone, RecoveryFailed, RecoveryRead
from ledger_client.write_core import SendAdd, WriteMetadata
from sim.client_node import BookieCalls, answer_metadata_write


class RecoveryDriver:
    def __init__(self, client: BookieCalls, core: RecoveryCore, master_key: bytes, *,
                 on_result: Callable[[RecoveryDone | RecoveryFailed], None], on_finished: Callable[[], None]) -> None:
        """`on_result(action)` when the core decides (RecoveryDone or
        RecoveryFailed), then `on_finished()` once that step's requests are out."""
        self.client = client
        self.core = core
        self.master_key = master_key
        self.on_result = on_result
        self.on_finished = on_finished
        self.stopped = False  # its owner let it go: answers change nothing
        self.fence_errors: dict[str, int] = {}  # bookie -> entry its fence read could not read (IO_ERROR)
        self.digest_mismatches = 0  # recovery reads answered OK with bytes that fail the digest

    def start(self) -> None:
        self.execute(self.core.start(self.client.world.now_ms))

    def execute(self, actions: list) -> None:
        client, core = self.client, self.core
        ledger_id = core.metadata.ledger_id
        master_key = self.master_key
        sends: list[SendAdd] = []
        for action in actions:
            kind = type(action)
            if kind is FenceRead:
                client.call(
                    action.bookie_id,
                    lambda request_id: ReadRequest(request_id, ReadFlag.FENCE, ledger_id, LAST_ADD_CONFIRMED, master_key),
                    lambda response, bookie_id=action.bookie_id: self._on_fence(bookie_id, response),
                )
            elif kind is RecoveryRead:
                flags = ReadFlag.FENCE if action.fence else ReadFlag.NONE
                entry_id = action.entry_id
                client.call(
                    action.bookie_id,
                    lambda request_id, flags=flags, entry_id=entry_id: ReadRequest(request_id, flags, ledger_id, entry_id, master_key),
                    lambda response, bookie_id=action.bookie_id, entry_id=entry_id: self._on_read(bookie_id, entry_id, response),
                )
            elif kind is SendAdd:
                sends.append(action)
            elif kind is WriteMetadata:
                client.write_metadata(action, self._on_metadata)
            elif kind is RecoveryDone or kind is RecoveryFailed:
                self.on_result(action)
            else:
                raise AssertionError(f"unknown recovery action {action!r}")
        if sends:  # (the rewriter's add timeout acts, its tick)
            client.send_add_batches(sends, AddFlag.RECOVERY_ADD, master_key, self._on_add)
        if core.phase not in (Phase.NEW, Phase.MARKING, Phase.FENCING):
            client.ledger_checker.fence_complete(ledger_id)
        if core.result is not None:
            return self.on_finished()
        client.arm_core_timer(core.next_deadline_ms(), self._tick)

    def _on_fence(self, bookie_id: str, response: Any) -> None:
        if self.stopped:
            return
        core, now_ms = self.core, self.client.world.now_ms
        if response is None:
            actions = core.fence_response(bookie_id, None, -1, None, now_ms)
        else:
            if response.status is Status.IO_ERROR:
                self.fence_errors[bookie_id] = response.entry_id
            else:
                self.fence_errors.pop(bookie_id, None)
            actions = core.fence_response(bookie_id, response.status, response.last_add_confirmed, response.entry, now_ms)
        self.execute(actions)

    def _on_read(self, bookie_id: str, entry_id: int, response: Any) -> None:
        if self.stopped:
            return
        core = self.core
        status, entry = (None, None) if response is None else (response.status, response.entry)
        if status is Status.OK and entry is not None and not intact(core.digest, entry, entry_id):
            self.digest_mismatches += 1  # a corrupt copy served as OK: the core counts it neither present nor absent
        self.execute(core.read_response(bookie_id, entry_id, status, entry, self.client.world.now_ms))

    def _on_add(self, bookie_id: str, entry_id: int, status: Any) -> None:
        if self.stopped:
            return
        self.core.bookies_changed(self.client.writable_bookies())
        self.execute(self.core.add_response(bookie_id, entry_id, status, self.client.world.now_ms))

    def _on_metadata(self, outcome: str, value: Any) -> None:
        if self.stopped:
            return
        self.execute(answer_metadata_write(self.core, outcome, value, self.client.world.now_ms))

    def _tick(self) -> None:
        if self.stopped:
            return
        self.core.bookies_changed(self.client.writable_bookies())
        self.execute(self.core.tick(self.client.world.now_ms))


def intact(digest: DigestManager, entry: bytes, entry_id: int) -> bool:
    try:
        digest.decode(entry, expected_entry_id=entry_id)
    except (DigestMismatchError, EntryFormatError):
        return False
    return True


__all__ = ["RecoveryDriver", "intact"]
