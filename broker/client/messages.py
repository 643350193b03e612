"""What a consumer receives: messages and their ids."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple


class MessageId(NamedTuple):
    """Where a message is stored: (ledger id, entry id, batch index,
    partition index; -1 for a topic that is not partitioned). A message
    a producer resent after it was persisted (a duplicate) has ledger and
    entry id -1: the broker dropped the copy. (A named tuple: a consumer
    makes one per message, and a tuple is made several times faster than a
    frozen dataclass.)"""

    ledger_id: int
    entry_id: int
    batch_index: int
    partition: int

    @property
    def is_duplicate(self) -> bool:
        return self.ledger_id < 0

    def __str__(self) -> str:
        return f"{self.ledger_id}:{self.entry_id}:{self.batch_index}:{self.partition}"

    @classmethod
    def parse(cls, text: str) -> "MessageId":
        try:
            ledger_id, entry_id, batch_index, partition = (int(part) for part in text.split(":"))
        except ValueError:
            raise ValueError(f"a message id is LEDGER:ENTRY:BATCH_INDEX:PARTITION, got {text!r}") from None
        return cls(ledger_id, entry_id, batch_index, partition)


@dataclass(frozen=True, slots=True)
class SendResult:
    """What a producer learns of a message it sent."""

    message_id: MessageId
    offset: int  # partition offset; -1 for a duplicate
    sequence_id: int


@dataclass(slots=True)
class Message:
    """A message as a consumer receives it (made once per message, so a
    plain slotted class: its fields are not meant to be changed)."""

    topic: str
    partition: str  # the partition's name
    message_id: MessageId
    offset: int  # contiguous and increasing within the partition
    data: bytes
    key: str | None
    properties: dict[str, str] = field(default_factory=dict)
    publish_time_ms: int = 0  # when the producer sent it
    producer_id: str = ""
    sequence_id: int = -1
    codec: str = "none"
    redelivery_count: int = 0
    event_time_ms: int = 0  # when the event happened, as its producer said (0: not said)
    # A chunked message: the offsets of its chunks before the last (its own
    # id and offset are the last chunk's); acknowledging it acknowledges them.
    chunk_offsets: tuple[int, ...] = ()

    @property
    def payload(self) -> bytes:
        return self.data


__all__ = ["Message", "MessageId", "SendResult"]
