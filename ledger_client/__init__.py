"""The ledger client: ledger metadata in ZooKeeper, placement, quorum writes
with ensemble changes, reads, and fencing recovery (the rules each keeps:
docs/architecture.md, "Where each protocol rule lives").
`BookKeeper` is the trio API; `ledger_client.sync.BookKeeper` the same for
code that is not async.

The trio drivers (`BookKeeper`, the handles, `BookieClient`) are imported on
first use, so that importing a pure core (`ledger_client.write_core`) does
not load trio."""

from __future__ import annotations

from bookie.protocol.entry_format import DigestType, Entry
from coordination.lazy_exports import lazy_exports
from ledger_client.errors import (
    BKError,
    BookieUnavailableError,
    EntryReadError,
    LedgerClosedError,
    LedgerFencedError,
    LedgerIdAllocationError,
    LedgerStateError,
    MalformedLedgerMetadataError,
    MetadataVersionError,
    NoSuchEntryError,
    NoSuchLedgerError,
    NotEnoughBookiesError,
    TooManyEnsembleChangesError,
    UnauthorizedError,
)
from ledger_client.metadata import LedgerMetadata, LedgerState

_LAZY = {
    "BookieClient": "ledger_client.bookie_client",
    "BookieConnectionError": "ledger_client.bookie_client",
    "BookKeeper": "ledger_client.bookkeeper",
    "LedgerHandle": "ledger_client.ledger_handle",
    "LedgerWriter": "ledger_client.ledger_handle",
    "PendingAdd": "ledger_client.ledger_handle",
    "ReadHandle": "ledger_client.read_handle",
}

__getattr__ = lazy_exports(globals(), _LAZY)

__all__ = [
    "BKError",
    "BookKeeper",
    "BookieClient",
    "BookieConnectionError",
    "BookieUnavailableError",
    "DigestType",
    "Entry",
    "EntryReadError",
    "LedgerClosedError",
    "LedgerFencedError",
    "LedgerHandle",
    "LedgerIdAllocationError",
    "LedgerWriter",
    "LedgerMetadata",
    "LedgerState",
    "LedgerStateError",
    "MalformedLedgerMetadataError",
    "MetadataVersionError",
    "NoSuchEntryError",
    "NoSuchLedgerError",
    "NotEnoughBookiesError",
    "PendingAdd",
    "ReadHandle",
    "TooManyEnsembleChangesError",
    "UnauthorizedError",
]
