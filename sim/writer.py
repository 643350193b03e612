"""A simulated writer: creates ledgers and adds entries through the real
`WriteCore` (carried out by `sim.write_driver`, as `LedgerHandle` does with
trio); then closes the ledger (or abandons it open, as a crashed
application would) and starts another."""

from __future__ import annotations

from typing import Any

from bookie.protocol.entry_format import DigestManager, DigestType, master_key
from ledger_client.errors import BKError, NotEnoughBookiesError
from ledger_client.ledger_store import LedgerStore
from ledger_client.metadata import LedgerMetadata, password_hash
from ledger_client.placement import choose_ensemble
from ledger_client.write_core import WriteCore
from sim.client_node import SimClient
from sim.parameters import SimParameters
from sim.write_driver import WriteDriver

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
        self.driver: WriteDriver | None = None
        self.start()

    def start(self) -> None:
        super().start()
        self.driver = None
        self.after(self.world.uniform(0, 10), self._next_ledger)

    def crash(self) -> None:
        super().crash()
        if self.driver is not None:
            self.driver.stopped = True
        self.driver = None
        self.world.log(f"{self.name} crashed")

    # --- ledgers ----------------------------------------------------------------------

    def _next_ledger(self) -> None:
        if not self.active or self.driver is not None:
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
        core = self.write_core_class(
            metadata, version, DigestManager(metadata.ledger_id, DigestType.CRC32C, PASSWORD),
            bookies=self.writable_bookies(), rng=self.world.rng, add_timeout_ms=self.parameters.add_timeout_ms,
        )
        driver = self.driver = WriteDriver(self, core, MASTER_KEY, on_completed=self._completed,
                                           on_ended=lambda: self._done(driver), on_progress=self._pump)
        self.ledgers_created += 1
        self._entries_left = self.world.rng.randint(1, self.parameters.entries_per_ledger_max)
        self._closing = False
        self.world.log(f"{self.name} writes ledger {metadata.ledger_id} on {list(metadata.last_ensemble[1])}")
        if self.parameters.add_gap_ms_mean > 0:
            self._add_timer(driver)
        else:
            self._pump()

    def _completed(self, entry_ids: list[int]) -> None:
        self.entries_acked += len(entry_ids)

    def _pump(self) -> None:
        """Add while the window has room (adds back to back), then close once
        every entry is acknowledged. With gaps between adds, the add timer
        adds instead."""
        driver = self.driver
        if driver is None or not self.active:
            return
        if self.parameters.add_gap_ms_mean == 0:
            while self._entries_left > 0 and driver.core.pending_count < self.parameters.add_window and self.driver is driver:
                self._add_one(driver)
        self._maybe_close(driver)

    def _add_timer(self, driver: WriteDriver) -> None:
        if self.driver is not driver or not self.active:
            return
        if driver.core.pending_count < self.parameters.add_window:
            self._add_one(driver)
        if self._entries_left > 0:
            self.after(self.world.exponential(self.parameters.add_gap_ms_mean), self._add_timer, driver)
        self._maybe_close(driver)

    def _add_one(self, driver: WriteDriver) -> None:
        self.sequence += 1
        filler = self.world.rng.randbytes(self.world.rng.randrange(self.parameters.payload_bytes_max + 1))
        payload = f"{self.name}:{self.sequence}:".encode() + filler
        try:
            driver.add(payload)
        except BKError:
            self._done(driver)
            return
        self._entries_left -= 1

    def _maybe_close(self, driver: WriteDriver) -> None:
        if self.driver is not driver or self._entries_left > 0 or driver.core.pending_count or self._closing:
            return
        self._closing = True
        if self.world.chance(ABANDON_PROBABILITY):
            self.world.log(f"{self.name} abandons ledger {driver.ledger_id} open")
            self._done(driver)
            return
        driver.close()

    def _done(self, driver: WriteDriver) -> None:
        if self.driver is driver:
            driver.stopped = True
            self.driver = None
            self.after(self.world.uniform(0, 50), self._next_ledger)
