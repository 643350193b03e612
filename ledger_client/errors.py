"""The errors a ledger client raises, in one small hierarchy. Each maps to the
bookie status (or metadata condition) behind it, so that callers can tell
"try another bookie" from "this ledger is gone for you"."""

from __future__ import annotations

from bookie.protocol.wire import Status


class BKError(Exception):
    """Base of every ledger client error."""

    status: Status | None = None


class NotEnoughBookiesError(BKError):
    """Fewer writable bookies are registered than the ensemble (or a
    replacement) needs."""


class NoSuchLedgerError(BKError):
    """The ledger's metadata does not exist (never created, or deleted)."""

    status = Status.NO_LEDGER


class NoSuchEntryError(BKError):
    """The entry is not in the ledger (beyond its last entry, or no bookie of
    its write set has it)."""

    status = Status.NO_ENTRY


class UnauthorizedError(BKError):
    """Wrong password: the metadata's password hash or a bookie's master key
    does not match."""

    status = Status.UNAUTHORIZED


class LedgerFencedError(BKError):
    """Another client opened the ledger for recovery (or closed it): this
    writer can never add to it again."""

    status = Status.FENCED


class LedgerClosedError(BKError):
    """The ledger is closed; nothing more can be added."""


class MetadataVersionError(BKError):
    """A compare-and-set of ledger metadata lost to a concurrent change and
    the change could not be re-applied."""


class TooManyEnsembleChangesError(BKError):
    """The writer replaced failed bookies more often than it is allowed to."""


class EntryReadError(BKError):
    """No replica of an entry could be read intact (every bookie of its write
    set failed, answered an error, or returned a digest mismatch)."""

    status = Status.IO_ERROR


class BookieUnavailableError(BKError):
    """A bookie could not be reached or answered with a transient error."""


class MalformedLedgerMetadataError(BKError):
    """The ledger's node holds data that is not valid ledger metadata (or is
    the metadata of another ledger)."""


class LedgerIdAllocationError(BKError):
    """No ledger id could be allocated: the generator kept rolling over
    under contention, or every id is used."""


class LedgerStateError(BKError):
    """An operation that the ledger's state does not allow (for example a
    transition missing from the state table)."""


__all__ = [
    "BKError",
    "BookieUnavailableError",
    "EntryReadError",
    "LedgerClosedError",
    "LedgerFencedError",
    "LedgerIdAllocationError",
    "LedgerStateError",
    "MalformedLedgerMetadataError",
    "MetadataVersionError",
    "NoSuchEntryError",
    "NoSuchLedgerError",
    "NotEnoughBookiesError",
    "TooManyEnsembleChangesError",
    "UnauthorizedError",
]
