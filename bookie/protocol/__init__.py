"""What crosses the wire between clients and bookies: the messages (`wire`,
their types in `messages`) inside the frames of `framing`, and the entries
inside them (`entry_format`). Both the bookie and the ledger client import it."""

from bookie.protocol.entry_format import (
    DIGEST_BYTES,
    HEADER_BYTES,
    DigestManager,
    DigestMismatchError,
    DigestType,
    Entry,
    EntryFormatError,
    EntryHeader,
    master_key,
    parse_header,
)
from bookie.protocol.wire import *  # noqa: F401,F403  (the wire's public names)
from bookie.protocol.wire import __all__ as _wire_names

__all__ = [
    "DIGEST_BYTES",
    "HEADER_BYTES",
    "DigestManager",
    "DigestMismatchError",
    "DigestType",
    "Entry",
    "EntryFormatError",
    "EntryHeader",
    "master_key",
    "parse_header",
    *_wire_names,
]
