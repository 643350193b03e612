"""Pulsar's framing, pure (bytes in, commands out, and back):

    [total size, u32][command size, u32][BaseCommand][payload]

The payload follows only SEND (the producer's message, see
`broker/pulsar_message.py`) and MESSAGE (the message delivered). The
decoder shares `framing.FrameDecoder`'s buffer and bounds (the total size
comes first, as in quire's own frames), so that the server's reader
(`framing.peer_limits.FrameReader`) serves both protocols. Anything that is
not a frame of a command this broker knows (a command size past the frame,
protobuf that does not decode, a type without its command) is a
ProtocolError: that one connection is closed, with an ERROR first where
one can be sent.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Iterator

from google.protobuf.message import DecodeError

from broker.pulsar.pulsar_api_pb2 import BaseCommand
from framing.codec import FRAME_BYTES_MAX_DEFAULT, LENGTH_PREFIX, FrameDecoder, ProtocolError

_TWO_SIZES = struct.Struct(">II")
Type = BaseCommand.Type

# Each command type and the field of BaseCommand that holds it.
FIELD_OF_TYPE: dict[int, str] = {}
for _field in BaseCommand.DESCRIPTOR.fields:
    if _field.name == "type":
        continue
    _type_name = _field.message_type.name  # CommandXxx
    FIELD_OF_TYPE[_field.number] = _field.name
# The command fields are numbered as their types (Pulsar's convention); check it.
assert all(number in Type.values() for number in FIELD_OF_TYPE), "a command field without its type"

PAYLOAD_TYPES = frozenset({Type.SEND, Type.MESSAGE})


@dataclass(frozen=True, slots=True)
class Frame:
    command: BaseCommand
    payload: bytes | None  # what followed the command (SEND, MESSAGE), else None

    @property
    def type(self) -> int:
        return self.command.type

    @property
    def body(self):
        """The command itself (CommandSend, CommandSubscribe, ...)."""
        return getattr(self.command, FIELD_OF_TYPE[self.command.type])


class PulsarFrameDecoder(FrameDecoder):
    """Splits a byte stream into Pulsar frames (see the module docstring)."""

    def __init__(self, frame_bytes_max: int = FRAME_BYTES_MAX_DEFAULT) -> None:
        super().__init__(frame_bytes_max)

    def frames(self) -> Iterator[Frame]:  # type: ignore[override]
        buffer = self._buffer
        view = memoryview(buffer)
        try:
            while True:
                start = self._position
                if len(buffer) - start < 4:
                    break
                (length,) = LENGTH_PREFIX.unpack_from(buffer, start)
                if length > self.frame_bytes_max:
                    raise ProtocolError(f"frame of {length} bytes exceeds the bound of {self.frame_bytes_max}")
                if length < 4:
                    raise ProtocolError(f"a frame of {length} bytes cannot hold a command")
                end = start + 4 + length
                if len(buffer) < end:
                    break
                self._position = end
                (command_size,) = LENGTH_PREFIX.unpack_from(buffer, start + 4)
                if command_size == 0 or command_size > length - 4:
                    raise ProtocolError(f"a command of {command_size} bytes in a frame of {length}")
                command_end = start + 8 + command_size
                self.frames_decoded += 1
                # Copies (a command is small): no view of the buffer may
                # outlive this step, or a failed parse would keep the buffer
                # from being resized ever after.
                command_bytes = bytes(view[start + 8:command_end])
                payload = bytes(view[command_end:end]) if command_end < end else None
                yield Frame(parse_command(command_bytes), payload)
        finally:
            view.release()
            if self._position and self._position == len(buffer):
                buffer.clear()
                self._position = 0


def parse_command(data) -> BaseCommand:
    command = BaseCommand()
    try:
        command.ParseFromString(data)
    except DecodeError as error:
        raise ProtocolError(f"a command that does not decode: {error}"[:300]) from None
    # A type number this broker does not know is kept aside by protobuf
    # (the field then reads as its default): it is missing, not CONNECT.
    if not command.HasField("type"):
        raise ProtocolError("a command of a type this broker does not know")
    field = FIELD_OF_TYPE.get(command.type)
    if field is None:
        raise ProtocolError(f"unknown command type {command.type}")
    if not command.HasField(field):
        raise ProtocolError(f"a {Type.Name(command.type)} command without its {field}")
    return command


def encode(command: BaseCommand, payload: bytes | memoryview | None = None) -> bytes:
    """A frame of `command` (and `payload`, for SEND and MESSAGE)."""
    packed = command.SerializeToString()
    payload_size = 0 if payload is None else len(payload)
    head = _TWO_SIZES.pack(4 + len(packed) + payload_size, len(packed)) + packed
    return head if payload is None else head + bytes(payload)


def encode_parts(command: BaseCommand, payload: bytes | memoryview) -> tuple[list, int]:
    """A frame as parts for a writer that gathers them (no copy of a
    delivered message's payload), and its size."""
    packed = command.SerializeToString()
    head = _TWO_SIZES.pack(4 + len(packed) + len(payload), len(packed)) + packed
    return [head, payload], len(head) + len(payload)


def command(type_: int, **fields) -> BaseCommand:
    """A BaseCommand of `type_` whose command has `fields`."""
    base = BaseCommand(type=type_)
    getattr(base, FIELD_OF_TYPE[type_]).SetInParent()
    for name, value in fields.items():
        target = getattr(base, FIELD_OF_TYPE[type_])
        if isinstance(value, (list, tuple)):
            getattr(target, name).extend(value)
        elif hasattr(value, "DESCRIPTOR"):
            getattr(target, name).CopyFrom(value)
        else:
            setattr(target, name, value)
    return base


__all__ = ["FIELD_OF_TYPE", "Frame", "PAYLOAD_TYPES", "PulsarFrameDecoder", "Type", "command", "encode", "encode_parts",
           "parse_command"]
