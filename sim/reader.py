"""A simulated reader, reading as `ReadHandle` does: a closed ledger up to its
last entry, an open one up to the LAC its last ensemble reports (the
largest of E - AQ + 1 answers), each entry from any bookie of its write set
with the next one tried on an error, a timeout or a digest mismatch. In the
liveness phase it reads every entry of every closed ledger, and every
acknowledged entry of a ledger left open, until it has them."""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterable

from bookie.protocol.entry_format import DigestManager, DigestMismatchError, EntryFormatError
from bookie.protocol.wire import ReadFlag, ReadLacRequest, ReadRequest, Status
from ledger_client.metadata import LedgerMetadata
from sim.client_node import SimClient
from sim.parameters import SimParameters
from sim.writer import PASSWORD

IDLE_MS_MEAN = 200.0
RANGE_ENTRIES_MAX = 40  # entries one random read asks for
FINAL_RETRY_MS = 200.0


class SimReader(SimClient):
    def __init__(self, *args: Any, parameters: SimParameters, **kwargs: Any) -> None:
        super().__init__(*args, request_timeout_ms=parameters.read_timeout_ms, **kwargs)
        self.parameters = parameters
        self.active = True
        self.busy = False
        self.unreadable = 0  # entries no replica returned (during faults: expected)
        self.digest_mismatches = 0  # copies served as OK that failed the digest (corrupt, served as intact)
        # Liveness: ledger -> entries still to read; filled by `read_all`.
        self.final_missing: dict[int, set[int]] | None = None
        self.start()

    def start(self) -> None:
        super().start()
        self.busy = False
        self.after(self.world.exponential(IDLE_MS_MEAN), self._next)

    # --- random reads (safety phase) ------------------------------------------------------

    def _next(self) -> None:
        if not self.active or self.busy or self.final_missing is not None:
            return
        ledger_ids = sorted(self.checker.metadata)
        if not ledger_ids:
            self.after(self.world.exponential(IDLE_MS_MEAN), self._next)
            return
        self.busy = True
        self.read_metadata(self.world.rng.choice(ledger_ids), self._read_some)

    def _idle(self) -> None:
        self.busy = False
        self.after(self.world.exponential(IDLE_MS_MEAN), self._next)

    def _read_some(self, found: tuple[LedgerMetadata, int] | None) -> None:
        if found is None:
            return self._idle()
        metadata = found[0]
        if metadata.is_closed:
            self._read_range(metadata, metadata.last_entry_id, closed=True)
        else:
            self._read_lac(metadata, functools.partial(self._read_range, metadata, closed=False))

    def _read_range(self, metadata: LedgerMetadata, last_entry_id: int, *, closed: bool) -> None:
        if last_entry_id < 0:
            return self._idle()
        first = self.world.rng.randint(max(0, last_entry_id - RANGE_ENTRIES_MAX), last_entry_id)
        remaining = [last_entry_id - first + 1]

        def one_done(_: bool) -> None:
            remaining[0] -= 1
            if remaining[0] == 0:
                self._idle()

        for entry_id in range(first, last_entry_id + 1):
            self._read_entry(metadata, entry_id, list(metadata.write_set(entry_id)), closed, one_done)

    def _read_lac(self, metadata: LedgerMetadata, on_lac: Callable[[int], None]) -> None:
        """Ask the last ensemble; the largest LAC of E - AQ + 1 answers (or of
        all that answered, once every bookie did or timed out)."""
        bookies = metadata.last_ensemble[1]
        needed = metadata.ensemble_size - metadata.ack_quorum + 1
        answers: list[int] = []
        done = [0, False]

        def answered(response: Any) -> None:
            done[0] += 1
            if response is not None and response.status in (Status.OK, Status.NO_LEDGER, Status.NO_ENTRY):
                answers.append(response.last_add_confirmed if response.status is Status.OK else -1)
            if not done[1] and (len(answers) >= needed or done[0] == len(bookies)):
                done[1] = True
                on_lac(max(answers, default=-1))

        for bookie_id in bookies:
            self.call(bookie_id, lambda request_id: ReadLacRequest(request_id, metadata.ledger_id), answered)

    def _read_entry(self, metadata: LedgerMetadata, entry_id: int, bookies: list[str], closed: bool,
                    on_done: Callable[[bool], None]) -> None:
        """Try the bookies of the write set in turn; the first intact copy wins."""
        if not bookies:
            self.unreadable += 1
            on_done(False)
            return
        bookie_id = bookies[0]
        digest = DigestManager(metadata.ledger_id, metadata.digest_type, PASSWORD)

        def answered(response: Any) -> None:
            if response is not None and response.status is Status.OK and response.entry is not None:
                try:
                    entry = digest.decode(response.entry, expected_entry_id=entry_id)
                except (DigestMismatchError, EntryFormatError):
                    self.digest_mismatches += 1
                else:
                    self.checker.entry_read(metadata.ledger_id, entry_id, bytes(entry.data), self.name, ledger_closed=closed)
                    on_done(True)
                    return
            self._read_entry(metadata, entry_id, bookies[1:], closed, on_done)

        self.call(
            bookie_id,
            lambda request_id: ReadRequest(request_id, ReadFlag.NONE, metadata.ledger_id, entry_id),
            answered,
        )

    # --- the liveness phase: read everything ---------------------------------------------------

    def read_all(self, ledgers: dict[int, tuple[LedgerMetadata, Iterable[int]]]) -> None:
        """Read these entries of these ledgers (ledger -> its metadata and
        the entry ids), retrying what fails."""
        self.final_missing = {ledger_id: set(entry_ids) for ledger_id, (_, entry_ids) in sorted(ledgers.items())}
        self._final_ledgers = {ledger_id: metadata for ledger_id, (metadata, _) in ledgers.items()}
        self._final_round()

    @property
    def final_done(self) -> bool:
        return self.final_missing is not None and not any(self.final_missing.values())

    def _final_round(self) -> None:
        assert self.final_missing is not None
        pending = [(ledger_id, entry_id) for ledger_id, missing in sorted(self.final_missing.items()) for entry_id in sorted(missing)]
        if not pending:
            return
        remaining = [len(pending)]

        def one_done(ledger_id: int, entry_id: int, read: bool) -> None:
            if read:
                self.final_missing[ledger_id].discard(entry_id)
            remaining[0] -= 1
            if remaining[0] == 0:
                self.after(FINAL_RETRY_MS, self._final_round)

        for ledger_id, entry_id in pending:
            metadata = self._final_ledgers[ledger_id]
            self._read_entry(
                metadata, entry_id, list(metadata.write_set(entry_id)), metadata.is_closed,
                functools.partial(one_done, ledger_id, entry_id),
            )
