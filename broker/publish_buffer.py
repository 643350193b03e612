"""The broker's publish buffer (Pulsar's `maxMessagePublishBufferSizeInMB`):
the bytes of producers' batches taken from connections and not yet answered
(persisted, refused or failed), all partitions together, and whether the
broker should stop reading from producers' connections.

Pure: sizes in, a paused flag and a resume callback out; the server's read
loops wait while it is paused. Each batch holds a `PublishPermit`, released
once whatever path ends the batch; releasing it again does nothing.
"""

from __future__ import annotations

from typing import Callable

PUBLISH_BUFFER_BYTES_DEFAULT = 256 * 1024 * 1024


# What checking a batch may build per message beside its bytes: the key
# object of a keyed message and its slot in the batch's tuple of keys.
MESSAGE_OBJECT_BYTES = 96


def batch_cost_bytes(body: bytes, message_count: int) -> int:
    """What a producer's batch holds in memory until it is answered, in
    bytes: its body, and what checking it builds (a key object per
    message, at most). Counting the body alone, a batch of 100,000
    5-character keys counted 0.9 MB and held some 8 MB."""
    return len(body) + MESSAGE_OBJECT_BYTES * message_count


class PublishBuffer:
    """Past `bytes_max` the buffer is paused (producers' connections are
    not read); it resumes once it has drained to `resume_bytes`, half the
    bound, as Pulsar does, so that reading does not flap on and off with
    every batch. The bound is passed, not enforced: batches already read
    from the connections (at most one read's worth each) are still taken."""

    def __init__(self, bytes_max: int = PUBLISH_BUFFER_BYTES_DEFAULT, on_resume: Callable[[], None] = lambda: None) -> None:
        if bytes_max < 1:
            raise ValueError(f"the publish buffer must hold at least 1 byte, got {bytes_max}")
        self.bytes_max = bytes_max
        self.resume_bytes = bytes_max // 2
        self.bytes = 0  # batches taken and not yet answered (`batch_cost_bytes`)
        self.batches = 0
        self.paused = False
        self.pauses = 0  # times the bound was passed
        self._on_resume = on_resume

    def take(self, size: int) -> "PublishPermit":
        """A batch of `size` bytes was read from a producer's connection."""
        if size < 0:
            raise ValueError(f"a batch has a size of at least 0 bytes, got {size}")
        self.bytes += size
        self.batches += 1
        if not self.paused and self.bytes > self.bytes_max:
            self.paused = True
            self.pauses += 1
        return PublishPermit(self, size)

    def _release(self, size: int) -> None:
        assert 0 <= size <= self.bytes and self.batches > 0, (size, self.bytes, self.batches)
        self.bytes -= size
        self.batches -= 1
        if self.paused and self.bytes <= self.resume_bytes:
            self.paused = False
            self._on_resume()


class PublishPermit:
    """One batch's share of the publish buffer."""

    __slots__ = ("_buffer", "size")

    def __init__(self, buffer: PublishBuffer | None, size: int) -> None:
        self._buffer = buffer
        self.size = size

    @classmethod
    def unbounded(cls, size: int = 0) -> "PublishPermit":
        """A permit of no buffer (a partition driven without a server)."""
        return cls(None, size)

    @property
    def released(self) -> bool:
        return self._buffer is None

    def release(self) -> None:
        """Give the bytes back; only the first call counts."""
        buffer, self._buffer = self._buffer, None
        if buffer is not None:
            buffer._release(self.size)


__all__ = ["PUBLISH_BUFFER_BYTES_DEFAULT", "PublishBuffer", "PublishPermit", "batch_cost_bytes"]
