"""What the broker and its readers know of a stored entry, whichever format
wrote it (`broker/message_format.py` for Pulsar's layout, the format
quire wrote before in `broker/legacy_entry.py`)."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple

# A body never decompresses past this (a crafted or corrupt body must not
# exhaust memory): the largest entry a ledger takes, with room for headers.
BODY_BYTES_MAX = 16 * 1024 * 1024


class MalformedEntryError(Exception):
    """Bytes that are not an entry this broker wrote (or a body that does not
    decompress): a bug or corruption, never silently skipped."""


@dataclass(frozen=True, slots=True)
class BatchHeader:
    """What the broker knows of an entry without decompressing it."""

    producer_id: str
    first_sequence_id: int
    last_sequence_id: int
    first_offset: int  # partition offset of the first message
    message_count: int
    publish_time_ms: int  # when the broker took the entry
    codec: enum.Enum  # broker.codecs.Codec, or a legacy entry's own
    keys: tuple[str | None, ...] | None  # one per message, or None when no message has a key
    # Pulsar's layout: where the message ("headers and payload", as a
    # Pulsar consumer receives it) starts in the entry, and whether it is a
    # batch. -1: an entry of the legacy format.
    message_start: int = -1
    batched: bool = True
    deliver_at_ms: int = 0  # Pulsar's deliver_at_time (0: none)
    partial_chunk: bool = False  # a chunk of a chunked message other than its last
    chunked: bool = False  # a chunk of a chunked message (its payload a slice of the message's)

    @property
    def last_offset(self) -> int:
        return self.first_offset + self.message_count - 1

    @property
    def legacy(self) -> bool:
        return self.message_start < 0

    def key_of(self, batch_index: int) -> str | None:
        return None if self.keys is None else self.keys[batch_index]


@dataclass(frozen=True, slots=True)
class MessageRecord:
    """One message of a decoded body."""

    sequence_id: int
    publish_time_ms: int  # the producer's
    properties: dict[str, str]
    payload: bytes
    event_time_ms: int = 0  # 0: not set


class BodyColumns(NamedTuple):
    """The messages of a body column by column (the Spark export's path)."""

    sequence_ids: tuple[int, ...]
    publish_times_ms: tuple[int, ...]
    properties: tuple[dict[str, str] | None, ...]  # None: no properties
    payloads: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class EntryRef:
    """What the dispatcher needs of an entry (not its bytes)."""

    ledger_id: int
    entry_id: int
    first_offset: int
    message_count: int
    keys: tuple[str | None, ...] | None = None
    deliver_at_ms: int = 0  # Pulsar's deliver_at_time: held back from shared subscriptions until then (0: at once)
    # An entry of a compacted view: the offsets it keeps (the others were
    # superseded by later messages of their keys). None: every one.
    retained: frozenset[int] | None = None

    @property
    def last_offset(self) -> int:
        return self.first_offset + self.message_count - 1

    def key_of(self, offset: int) -> str | None:
        return None if self.keys is None else self.keys[offset - self.first_offset]


__all__ = ["BODY_BYTES_MAX", "BatchHeader", "BodyColumns", "EntryRef", "MalformedEntryError", "MessageRecord"]
