"""The trio driver of ledger recovery: carries out a `RecoveryCore`'s fencing
reads, recovery reads, recovery adds and metadata writes against real
bookies and the metadata store, and starts over (a bounded number of times)
when a concurrent recoverer changed the ledger under it."""

from __future__ import annotations

import functools
import logging

import trio

from bookie.protocol.entry_format import DigestManager
from bookie.protocol.wire import LAST_ADD_CONFIRMED, AddFlag, ReadFlag, ReadRequest, encode_add_tail
from ledger_client.bookie_client import BookieConnectionError
from ledger_client.client_services import ClientServices
from ledger_client.errors import BKError, MetadataVersionError
from ledger_client.driver_support import CoreTicker, carry_out_metadata_write, now_ms
from ledger_client.metadata import LedgerMetadata
from ledger_client.read_handle import READ_TIMEOUT_S
from ledger_client.recovery_core import (
    FenceRead,
    RecoveryCore,
    RecoveryDone,
    RecoveryFailed,
    RecoveryRead,
)
from ledger_client.write_core import SendAdd, WriteMetadata

log = logging.getLogger(__name__)
RECOVERY_ATTEMPTS_MAX = 5


async def recover_ledger(services: ClientServices, ledger_id: int, digest: DigestManager, master_key: bytes) -> tuple[LedgerMetadata, int]:
    """Fence and close the ledger (or adopt a close someone else made);
    returns the closed metadata and its version."""
    for attempt in range(1, RECOVERY_ATTEMPTS_MAX + 1):
        metadata, version = await services.ledger_store.read(ledger_id)
        if metadata.is_closed:
            return metadata, version
        core = RecoveryCore(metadata, version, digest, bookies=services.bookies.writable_racks(), rng=services.rng)
        try:
            return await _RecoveryDriver(services, core, master_key).run()
        except MetadataVersionError as error:
            if attempt == RECOVERY_ATTEMPTS_MAX:
                raise
            log.info("recovery of ledger %d starts over (attempt %d): %s", ledger_id, attempt + 1, error)
    raise AssertionError("unreachable")


class _RecoveryDriver:
    def __init__(self, services: ClientServices, core: RecoveryCore, master_key: bytes) -> None:
        self._services = services
        self._core = core
        self._master_key = master_key
        self._ledger_id = core.metadata.ledger_id
        self._result: RecoveryDone | RecoveryFailed | None = None
        self._done = trio.Event()
        self._ticker = CoreTicker(core, services.bookies, self._execute)
        self._nursery: trio.Nursery | None = None
        self._finished = False

    async def run(self) -> tuple[LedgerMetadata, int]:
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self._tick_loop)
                self._execute(self._core.start(now_ms()))
                await self._done.wait()
                nursery.cancel_scope.cancel()
        finally:
            # Answers that arrive after this (a caller gave up, or recovery
            # ended) must not drive the core into new work.
            self._finished = True
        result = self._result
        if isinstance(result, RecoveryFailed):
            raise result.error
        assert isinstance(result, RecoveryDone)
        return result.metadata, result.version

    def _execute(self, actions: list) -> None:
        if self._finished:
            return
        connections = self._services.connections
        for action in actions:
            kind = type(action)
            if kind is FenceRead:
                self._nursery.start_soon(
                    self._ask, action.bookie_id, ReadFlag.FENCE, LAST_ADD_CONFIRMED,
                    functools.partial(self._on_fence, action.bookie_id),
                )
            elif kind is RecoveryRead:
                flags = ReadFlag.FENCE if action.fence else ReadFlag.NONE
                self._nursery.start_soon(
                    self._ask, action.bookie_id, flags, action.entry_id,
                    functools.partial(self._on_read, action.bookie_id, action.entry_id),
                )
            elif kind is SendAdd:
                connections.send_add_tail(
                    action.bookie_id, encode_add_tail(AddFlag.RECOVERY_ADD, self._master_key, action.entry),
                    functools.partial(self._on_add, action.bookie_id, action.entry_id), self._ledger_id, action.entry_id,
                )
            elif kind is WriteMetadata:
                assert self._nursery is not None
                self._nursery.start_soon(self._write_metadata, action)
            elif kind is RecoveryDone or kind is RecoveryFailed:
                self._result = action
                self._done.set()
            else:
                raise AssertionError(f"unknown recovery action {action!r}")
        self._ticker.wake_if_due_sooner()

    async def _ask(self, bookie_id: str, flags: ReadFlag, entry_id: int, on_answer) -> None:
        """One read; no answer within READ_TIMEOUT_S (or a broken
        connection) is reported as None, which the core asks again later."""
        try:
            with trio.fail_after(READ_TIMEOUT_S):
                response = await self._services.connections.call(bookie_id, functools.partial(self._read_request, flags, entry_id))
        except (BookieConnectionError, trio.TooSlowError):
            response = None
        on_answer(response)

    def _read_request(self, flags: ReadFlag, entry_id: int, request_id: int) -> ReadRequest:
        return ReadRequest(request_id, flags, self._ledger_id, entry_id, self._master_key, None, None)

    def _on_fence(self, bookie_id: str, response) -> None:
        if response is None:
            self._execute(self._core.fence_response(bookie_id, None, -1, None, now_ms()))
            return
        self._execute(self._core.fence_response(bookie_id, response.status, response.last_add_confirmed, response.entry, now_ms()))

    def _on_read(self, bookie_id: str, entry_id: int, response) -> None:
        if response is None:
            self._execute(self._core.read_response(bookie_id, entry_id, None, None, now_ms()))
            return
        self._execute(self._core.read_response(bookie_id, entry_id, response.status, response.entry, now_ms()))

    def _on_add(self, bookie_id: str, entry_id: int, response) -> None:
        status = None if isinstance(response, BookieConnectionError) else response.status
        self._core.bookies_changed(self._services.bookies.writable_racks())
        self._execute(self._core.add_response(bookie_id, entry_id, status, now_ms()))

    async def _write_metadata(self, action: WriteMetadata) -> None:
        self._execute(await carry_out_metadata_write(self._services.ledger_store, self._core, action))

    async def _tick_loop(self) -> None:
        await self._ticker.run()


__all__ = ["recover_ledger", "BKError"]
