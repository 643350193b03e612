"""Putting a chunked message's chunks together, as Pulsar's consumers do
(pure: time comes in as `now_ms`). A producer with chunking on cuts a
message larger than the broker's largest into chunks of one sequence id,
stored as messages of their own; a consumer holds each message's chunks
until its last one comes, then gives the whole message, whose
acknowledgement acknowledges every chunk.

Bounds, Pulsar's defaults: at most 10 chunked messages being put together
per partition consumer (past it, the oldest one's chunks are asked for again
later), each for at most 60 s without a new chunk (then its chunks are
acknowledged and dropped: its producer never sent the rest).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

from broker.message_format import Chunk

CHUNKED_MESSAGES_PENDING_MAX = 10  # Pulsar's maxPendingChunkedMessage
INCOMPLETE_EXPIRY_MS = 60_000  # Pulsar's expireTimeOfIncompleteChunkedMessage
CHUNKED_MESSAGE_BYTES_MAX = 1024 * 1024 * 1024  # one chunked message's payload, as sent


@dataclass
class _Pending:
    offsets: list[int] = field(default_factory=list)
    payloads: list[bytes] = field(default_factory=list)
    size: int = 0
    last_chunk_ms: int = 0


@dataclass(frozen=True)
class Assembled:
    """What one chunk led to: a whole message (its chunks' payloads and
    offsets, the last chunk's last), offsets to acknowledge (chunks that
    can never make a message), offsets to ask for again later."""

    payloads: list[bytes] | None = None
    offsets: tuple[int, ...] = ()
    acknowledge: tuple[int, ...] = ()
    redeliver: tuple[int, ...] = ()


NOTHING = Assembled()


class ChunkAssembler:
    def __init__(self, pending_max: int = CHUNKED_MESSAGES_PENDING_MAX, expiry_ms: int = INCOMPLETE_EXPIRY_MS,
                 bytes_max: int = CHUNKED_MESSAGE_BYTES_MAX) -> None:
        self.pending_max = pending_max
        self.expiry_ms = expiry_ms
        self.bytes_max = bytes_max
        self._pending: collections.OrderedDict[str, _Pending] = collections.OrderedDict()

    @property
    def pending_count(self) -> int:
        return len(self._pending)

    def add(self, chunk: Chunk, offset: int, publish_time_ms: int, now_ms: int) -> Assembled:
        pending = self._pending.get(chunk.uuid)
        if pending is not None and offset in pending.offsets:
            return NOTHING  # the very chunk held, delivered again (a failover's replay): not a copy
        if chunk.chunk_id == 0:
            acknowledge: tuple[int, ...] = ()
            if pending is not None:
                # The message again from its start (its producer sent it
                # again): what was held of it is a copy.
                acknowledge = tuple(self._pending.pop(chunk.uuid).offsets)
            redeliver: tuple[int, ...] = ()
            if len(self._pending) >= self.pending_max:
                _, oldest = self._pending.popitem(last=False)
                redeliver = tuple(oldest.offsets)
            pending = self._pending[chunk.uuid] = _Pending()
            done = self._append(chunk, pending, offset, now_ms)
            return Assembled(done.payloads, done.offsets, acknowledge + done.acknowledge, redeliver)
        if pending is not None and chunk.chunk_id < len(pending.offsets):
            return Assembled(acknowledge=(offset,))  # another copy of a chunk held (its producer sent it again)
        if pending is None or chunk.chunk_id != len(pending.offsets):
            # Its earlier chunks are not here (acknowledged, or asked for
            # again): Pulsar's rule, dropped once it is older than the
            # expiry, asked for again until then.
            if now_ms - publish_time_ms > self.expiry_ms:
                return Assembled(acknowledge=(offset,))
            return Assembled(redeliver=(offset,))
        return self._append(chunk, pending, offset, now_ms)

    def _append(self, chunk: Chunk, pending: _Pending, offset: int, now_ms: int) -> Assembled:
        pending.offsets.append(offset)
        pending.payloads.append(chunk.payload)
        pending.size += len(chunk.payload)
        pending.last_chunk_ms = now_ms
        self._pending.move_to_end(chunk.uuid)
        if pending.size > min(self.bytes_max, chunk.total_bytes):
            del self._pending[chunk.uuid]
            return Assembled(acknowledge=tuple(pending.offsets))  # more than it said, or than a consumer holds
        if chunk.chunk_id < chunk.chunks - 1:
            return NOTHING
        del self._pending[chunk.uuid]
        return Assembled(pending.payloads, tuple(pending.offsets))

    def expire(self, now_ms: int) -> tuple[int, ...]:
        """The chunks of messages that had no new chunk for the expiry:
        dropped, to be acknowledged."""
        expired = [uuid for uuid, pending in self._pending.items() if now_ms - pending.last_chunk_ms > self.expiry_ms]
        return tuple(offset for uuid in expired for offset in self._pending.pop(uuid).offsets)

    def clear(self) -> None:
        """A new connection: the broker delivers every unacknowledged chunk again."""
        self._pending.clear()


__all__ = ["Assembled", "CHUNKED_MESSAGES_PENDING_MAX", "ChunkAssembler", "INCOMPLETE_EXPIRY_MS"]
