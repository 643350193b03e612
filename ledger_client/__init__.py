"""The ledger client: ledger metadata in ZooKeeper, placement, quorum writes
with ensemble changes, reads, and fencing recovery (the rules each keeps:
docs/architecture.md, "Where each protocol rule lives").
`BookKeeper` is the trio API; `ledger_client.sync.BookKeeper` the same for
code that is not async."""

from bookie.protocol.entry_format import DigestType, Entry
from ledger_client.bookie_client import BookieClient, BookieConnectionError
from ledger_client.bookkeeper import BookKeeper
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
from ledger_client.ledger_handle import LedgerHandle, PendingAdd, ReadHandle
from ledger_client.metadata import LedgerMetadata, LedgerState

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
