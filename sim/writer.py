"""A simulated writer: creates ledgers and adds entries through the real
`WriteCore`, carrying out its actions over the simulated network and
ZooKeeper the way `LedgerHandle` does with trio; then closes the ledger (or
abandons it open, as a crashed application would) and starts another."""

from __future__ import annotations

import functools
from typing import Any

from bookie.protocol.entry_format import DigestManager, DigestType, master_key
from bookie.protocol.wire import AddFlag
from ledger_client.errors import BKError, NotEnoughBookiesError
from ledger_client.ledger_store import LedgerStore
from ledger_client.metadata import LedgerMetadata, password_hash
from ledger_client.placement import choose_ensemble
from ledger_client.write_core import (
    AddsCompleted,
    AddsFailed,
    Closed,
    CloseFailed,
    SendAdd,
    WriteCore,
    WriteMetadata,
)
from sim.client_node import SimClient, answer_metadata_write
from sim.parameters import SimParameters

PASSWORD = b"quire-sim"
MASTER_KEY = master_key(PASSWORD)
RETRY_MS = 200.0
ABANDON_PROBABILITY = 0.2  # a ledger left open for a recoverer to close


class SimWriter(SimClient):
    def __init__(self, *args: Any, parameters: SimParameters, write_core_class: type[WriteCore] = WriteCore, **kwargs: Any) -> None:
        super().__init__(*args, request_timeout_ms=parameters.read_timeout_ms, **kwargs)
        self.parameters = parameters
        self.write_core_class = write_core_class
        self.active = True
        self.sequence = 0
        self.ledgers_created = 0
        self.entries_acked = 0
        self.core: WriteCore | None = None
        self._payloads: dict[int, bytes] = {}
        self.start()

    def start(self) -> None:
        super().start()
        self.core = None
        self.after(self.world.uniform(0, 10), self._next_ledger)

    def crash(self) -> None:
        super().crash()
        self.core = None
        self.world.log(f"{self.name} crashed")

    # --- ledgers ----------------------------------------------------------------------

    def _next_ledger(self) -> None:
        if not self.active or self.core is not None:
            return
        parameters = self.parameters
        try:
            ensemble = choose_ensemble(self.writable_bookies(), parameters.ensemble_size, parameters.write_quorum, rng=self.world.rng)
        except NotEnoughBookiesError:
            self.after(RETRY_MS, self._next_ledger)
            return
        created_ms = int(self.world.now_ms)

        def build(ledger_id: int) -> LedgerMetadata:
            return LedgerMetadata(
                ledger_id=ledger_id, ensemble_size=parameters.ensemble_size, write_quorum=parameters.write_quorum,
                ack_quorum=parameters.ack_quorum, ensembles=((0, tuple(ensemble)),), digest_type=DigestType.CRC32C,
                password_hash=password_hash(PASSWORD), creation_time_ms=created_ms,
            )

        checker = self.checker

        def create(store) -> tuple[LedgerMetadata, int]:
            metadata, version = LedgerStore(store).create(build)
            checker.metadata_written(metadata)
            return metadata, version

        self.metadata.call(create, self._created, "create ledger")

    def _created(self, result: Any, error: Exception | None) -> None:
        if error is not None:
            # A lost reply may leave a created ledger behind, open and empty:
            # a recoverer closes it, as in BookKeeper.
            self.after(RETRY_MS, self._next_ledger)
            return
        metadata, version = result
        self.core = self.write_core_class(
            metadata, version, DigestManager(metadata.ledger_id, DigestType.CRC32C, PASSWORD),
            bookies=self.writable_bookies(), rng=self.world.rng, add_timeout_ms=self.parameters.add_timeout_ms,
        )
        self.ledgers_created += 1
        self._entries_left = self.world.rng.randint(1, self.parameters.entries_per_ledger_max)
        self._payloads = {}
        self._closing = False
        self.world.log(f"{self.name} writes ledger {metadata.ledger_id} on {list(metadata.last_ensemble[1])}")
        if self.parameters.add_gap_ms_mean > 0:
            self._add_timer(self.core)
        else:
            self._pump()

    def _pump(self) -> None:
        """Add while the window has room (adds back to back), then close once
        every entry is acknowledged. With gaps between adds, the add timer
        adds instead."""
        core = self.core
        if core is None or not self.active:
            return
        if self.parameters.add_gap_ms_mean == 0:
            while self._entries_left > 0 and core.pending_count < self.parameters.add_window and self.core is core:
                self._add_one(core)
        self._maybe_close(core)

    def _add_timer(self, core: WriteCore) -> None:
        if self.core is not core or not self.active:
            return
        if core.pending_count < self.parameters.add_window:
            self._add_one(core)
        if self._entries_left > 0:
            self.after(self.world.exponential(self.parameters.add_gap_ms_mean), self._add_timer, core)
        self._maybe_close(core)

    def _add_one(self, core: WriteCore) -> None:
        self.sequence += 1
        filler = self.world.rng.randbytes(self.world.rng.randrange(self.parameters.payload_bytes_max + 1))
        payload = f"{self.name}:{self.sequence}:".encode() + filler
        try:
            entry_id, actions = core.add(payload, self.world.now_ms)
        except BKError:
            self._done(core)
            return
        self._entries_left -= 1
        self._payloads[entry_id] = payload
        self._execute(core, actions)

    def _maybe_close(self, core: WriteCore) -> None:
        if self.core is not core or self._entries_left > 0 or core.pending_count or self._closing:
            return
        self._closing = True
        if self.world.chance(ABANDON_PROBABILITY):
            self.world.log(f"{self.name} abandons ledger {core.metadata.ledger_id} open")
            self._done(core)
            return
        self._execute(core, core.close(self.world.now_ms))

    def _done(self, core: WriteCore) -> None:
        if self.core is core:
            self.core = None
            self.after(self.world.uniform(0, 50), self._next_ledger)

    # --- carrying out the core's actions -----------------------------------------------

    def _execute(self, core: WriteCore, actions: list) -> None:
        ledger_id = core.metadata.ledger_id
        sends: list[SendAdd] = []
        for action in actions:
            kind = type(action)
            if kind is SendAdd:
                if (ledger_id, action.entry_id) not in self.checker.written:
                    self.checker.entry_written(ledger_id, action.entry_id, action.entry, self._payloads[action.entry_id])
                sends.append(action)
            elif kind is WriteMetadata:
                self.write_metadata(action, functools.partial(self._on_metadata, core))
            elif kind is AddsCompleted:
                for entry_id in action.entry_ids:
                    self.checker.entry_acked(ledger_id, entry_id, self.name, core.metadata.write_set(entry_id))
                self.entries_acked += len(action.entry_ids)
            elif kind is AddsFailed:
                self.world.log(f"{self.name} adds failed on ledger {ledger_id}: {type(action.error).__name__}")
            elif kind is Closed or kind is CloseFailed:
                self.world.log(f"{self.name} {kind.__name__} ledger {ledger_id}")
            else:
                raise AssertionError(f"unknown action {action!r}")
        if sends:
            self.send_add_batches(sends, AddFlag.NONE, MASTER_KEY, functools.partial(self._on_add_status, core))
        if core.closed or core.error is not None:
            return self._done(core)
        self.arm_core_timer(core.next_deadline_ms(), functools.partial(self._tick, core))

    def _on_add_status(self, core: WriteCore, bookie_id: str, entry_id: int, status: Any) -> None:
        if self.core is not core:
            return
        core.bookies_changed(self.writable_bookies())
        if status is None:
            actions = core.bookie_failed(bookie_id, self.world.now_ms)
        else:
            actions = core.bookie_responded(bookie_id, entry_id, status, self.world.now_ms)
        self._execute(core, actions)
        self._pump()

    def _on_metadata(self, core, outcome: str, value: Any) -> None:
        if self.core is not core:
            return
        self._execute(core, answer_metadata_write(core, outcome, value, self.world.now_ms))
        self._pump()

    def _tick(self, core: WriteCore) -> None:
        if self.core is not core:
            return
        core.bookies_changed(self.writable_bookies())
        self._execute(core, core.tick(self.world.now_ms))
        self._pump()
