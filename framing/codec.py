"""Length-prefixed msgpack frames, shared by the bookie and the broker
protocols: a frame is a 4-byte big-endian length followed by a msgpack array.

Pure code: bytes in, arrays out (and back), as h11 does for HTTP; no trio, no
socket. A peer that sends a frame longer than `frame_bytes_max`, bytes that
are not msgpack, an array nested deeper or holding more items than the
decoder's bounds, a msgpack extension type (timestamps too: no message has
one), or anything but a non-empty array gets a `ProtocolError`, and the
driver closes that one connection. Error messages describe a peer's value by
its type and size (`describe`), never by formatting the value itself.
"""

from __future__ import annotations

import struct
from typing import Any, Iterator

import msgpack

FRAME_BYTES_MAX_DEFAULT = 16 * 1024 * 1024
# What one frame may decode to. Each array and map costs Python objects far
# larger than its bytes on the wire (an empty array is one byte and a 56-byte
# list), so a frame's items are bounded across all its containers, not only
# per container; depth is bounded so that nothing which walks a value
# recursively (formatting, comparison, JSON) can overflow the stack.
FRAME_ITEMS_MAX_DEFAULT = 2_000_000
FRAME_DEPTH_MAX = 16
LENGTH_PREFIX = struct.Struct(">I")


class ProtocolError(Exception):
    """The peer sent bytes that break the protocol; close its connection."""


_TEXT_CHARS_SHOWN = 40


def describe(value: Any) -> str:
    """A peer's value for an error message, bounded in size and cost
    whatever the value holds: scalars shown (strings cut short), containers
    and binaries by their type and length only."""
    kind = type(value)
    if value is None or kind is bool or kind is float:
        return repr(value)
    if kind is int:
        return str(value) if -(2**64) <= value < 2**64 else "an integer beyond 64 bits"
    if kind is str:
        shown = value[:_TEXT_CHARS_SHOWN]
        return repr(shown) + ("..." if len(value) > _TEXT_CHARS_SHOWN else "")
    if kind is bytes:
        return f"binary of {len(value)} bytes"
    if kind is list:
        return f"an array of {len(value)}"
    if kind is dict:
        return f"a map of {len(value)}"
    return kind.__name__


def check_depth(value: Any, depth_max: int = FRAME_DEPTH_MAX) -> None:
    """Raise ProtocolError if arrays and maps nest deeper than `depth_max`.
    Iterative, so that a deep value cannot overflow the stack here either."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > depth_max:
            raise ProtocolError(f"value nested deeper than {depth_max} levels")
        if type(item) is list:
            stack.extend((child, depth + 1) for child in item if type(child) is list or type(child) is dict)
        elif type(item) is dict:
            stack.extend((child, depth + 1) for child in item.values() if type(child) is list or type(child) is dict)


class _TooManyItems(Exception):
    """Raised inside msgpack's hooks to stop decoding a frame that holds too much."""


class _ExtensionType(Exception):
    """Raised by msgpack's ext hook: no message holds an extension type."""


def _refuse_extension(code: int, data: bytes) -> Any:
    raise _ExtensionType


class _ItemBudget:
    """msgpack hooks that count a frame's containers and their items while
    it is decoded, and stop it once the items pass the bound: a frame never
    costs more than its bound in Python objects, whatever its bytes say."""

    __slots__ = ("items_max", "items", "containers")

    def __init__(self, items_max: int) -> None:
        self.items_max = items_max
        self.items = 0
        self.containers = 0

    # A container counts as an item itself: a frame of empty arrays costs
    # 56 bytes of Python per byte on the wire.
    def list_hook(self, value: list) -> list:
        self.containers += 1
        self.items += len(value) + 1
        if self.items > self.items_max:
            raise _TooManyItems
        return value

    def map_hook(self, value: dict) -> dict:
        self.containers += 1
        self.items += 2 * len(value) + 1
        if self.items > self.items_max:
            raise _TooManyItems
        return value


_packer = msgpack.Packer(use_bin_type=True)
_unpackb = msgpack.unpackb


def encode_frame(fields: list[Any]) -> bytes:
    body = _packer.pack(fields)
    return LENGTH_PREFIX.pack(len(body)) + body


class FrameDecoder:
    """Splits a byte stream into msgpack arrays, enforcing the bounds on a
    frame's bytes (`frame_bytes_max`), on the items of all its arrays and
    maps together (`items_max`), and on their nesting (`FRAME_DEPTH_MAX`)."""

    def __init__(self, frame_bytes_max: int = FRAME_BYTES_MAX_DEFAULT, items_max: int = FRAME_ITEMS_MAX_DEFAULT) -> None:
        if frame_bytes_max < 1:
            raise ValueError("frame_bytes_max must be positive")
        if items_max < 1:
            raise ValueError("items_max must be positive")
        self.frame_bytes_max = frame_bytes_max
        self.items_max = items_max
        self.frames_decoded = 0
        self._buffer = bytearray()
        self._position = 0

    @property
    def has_whole_frame(self) -> bool:
        """Whether a whole frame is buffered and not yet taken by `frames()`."""
        available = len(self._buffer) - self._position
        return available >= 4 and available >= 4 + LENGTH_PREFIX.unpack_from(self._buffer, self._position)[0]

    @property
    def started_frame(self) -> bool:
        """Whether part of a frame is buffered (its first byte arrived, its last not yet)."""
        return len(self._buffer) > self._position

    @property
    def pending_frame_bytes(self) -> int:
        """The full length of the frame being received, once its length prefix
        is in (0 before): what finishing it will hold in memory."""
        if len(self._buffer) - self._position < 4:
            return len(self._buffer) - self._position
        return 4 + LENGTH_PREFIX.unpack_from(self._buffer, self._position)[0]

    @property
    def buffered_bytes(self) -> int:
        return len(self._buffer) - self._position

    def feed(self, data: bytes) -> None:
        if self._position and self._position == len(self._buffer):
            self._buffer.clear()
            self._position = 0
        self._buffer += data

    def frames(self) -> Iterator[list[Any]]:
        """Yield every complete frame buffered so far, decoded to a list."""
        buffer = self._buffer
        # msgpack reads straight from the buffer (binary fields come out as
        # new bytes objects); the view is released before the buffer changes.
        view = memoryview(buffer)
        try:
            while True:
                start = self._position
                if len(buffer) - start < 4:
                    break
                (length,) = LENGTH_PREFIX.unpack_from(buffer, start)
                if length > self.frame_bytes_max:
                    raise ProtocolError(f"frame of {length} bytes exceeds the bound of {self.frame_bytes_max}")
                if length == 0:
                    raise ProtocolError("empty frame")
                end = start + 4 + length
                if len(buffer) < end:
                    break
                self._position = end
                budget = _ItemBudget(self.items_max)
                try:
                    # msgpack's defaults are raw=False, strict_map_key=True,
                    # use_list=True. The hooks cost about 0.05 µs a frame;
                    # the length bounds refuse a declared count before any
                    # list or dict of that size is made. `max_ext_len` 0
                    # refuses every extension type that carries data,
                    # timestamps included (msgpack checks it before decoding
                    # a timestamp, which never reaches the ext hook); the
                    # hook refuses those that carry none.
                    fields = _unpackb(view[start + 4 : end], list_hook=budget.list_hook, object_hook=budget.map_hook,
                                      max_array_len=self.items_max, max_map_len=self.items_max // 2,
                                      max_ext_len=0, ext_hook=_refuse_extension)
                except _TooManyItems:
                    raise ProtocolError(f"frame holds more than {self.items_max} items") from None
                except _ExtensionType:
                    raise ProtocolError("frame holds a msgpack extension type") from None
                except Exception as error:  # msgpack raises several unrelated types
                    raise ProtocolError(f"frame is not valid msgpack ({type(error).__name__})") from None
                if type(fields) is not list or not fields:
                    raise ProtocolError(f"frame must hold a non-empty msgpack array, not {describe(fields)}")
                # Depth can pass the bound only with more containers than
                # levels: the usual frame (one or two arrays) is not walked.
                if budget.containers > FRAME_DEPTH_MAX:
                    check_depth(fields)
                self.frames_decoded += 1
                yield fields
        finally:
            view.release()
        # Drop consumed bytes once they dominate the buffer, so it never grows
        # past one frame plus one read.
        if self._position > 65536 and self._position * 2 > len(buffer):
            del buffer[: self._position]
            self._position = 0


__all__ = [
    "FRAME_BYTES_MAX_DEFAULT",
    "FRAME_DEPTH_MAX",
    "FRAME_ITEMS_MAX_DEFAULT",
    "LENGTH_PREFIX",
    "FrameDecoder",
    "ProtocolError",
    "check_depth",
    "describe",
    "encode_frame",
]
