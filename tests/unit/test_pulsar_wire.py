"""Pulsar's framing as the broker reads and writes it: commands round-trip
through frames (with and without a payload), any bytes give frames or a
ProtocolError and nothing else, and the generated protobuf module is the
one `scripts/gen-pulsar-proto` makes from our .proto."""

from __future__ import annotations

import pathlib
import struct
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.pulsar.pulsar_api_pb2 import MessageIdData
from broker.pulsar.wire import FIELD_OF_TYPE, PulsarFrameDecoder, Type, command, encode, encode_parts
from framing.codec import ProtocolError

PULSAR_DIR = pathlib.Path(__file__).resolve().parents[2] / "broker" / "pulsar"


def frames_of(data: bytes, frame_bytes_max: int = 1 << 20) -> list:
    decoder = PulsarFrameDecoder(frame_bytes_max)
    decoder.feed(data)
    return list(decoder.frames())


def test_commands_round_trip_with_and_without_payloads():
    receipt = command(Type.SEND_RECEIPT, producer_id=3, sequence_id=9, message_id=MessageIdData(ledgerId=1, entryId=2))
    send = command(Type.SEND, producer_id=3, sequence_id=10, num_messages=2)
    parts, size = encode_parts(command(Type.MESSAGE, consumer_id=1, message_id=MessageIdData(ledgerId=5, entryId=6)), b"body")
    data = encode(receipt) + encode(command(Type.PING)) + encode(send, b"payload") + b"".join(parts)
    assert size == len(b"".join(parts))
    frames = frames_of(data)
    assert [Type.Name(frame.type) for frame in frames] == ["SEND_RECEIPT", "PING", "SEND", "MESSAGE"]
    assert frames[0].body.message_id.entryId == 2 and frames[0].payload is None
    assert frames[2].body.num_messages == 2 and frames[2].payload == b"payload"
    assert frames[3].payload == b"body"


def test_frames_split_across_reads_come_out_whole():
    data = encode(command(Type.FLOW, consumer_id=1, messagePermits=1000)) * 3
    decoder = PulsarFrameDecoder()
    got = []
    for index in range(len(data)):
        decoder.feed(data[index:index + 1])
        got += list(decoder.frames())
    assert [frame.body.messagePermits for frame in got] == [1000, 1000, 1000]


@pytest.mark.parametrize("data, says", [
    (struct.pack(">I", 1 << 30), "exceeds the bound"),
    (struct.pack(">II", 3, 1) + b"\x00", "cannot hold a command"),
    (struct.pack(">II", 20, 100) + bytes(16), "a command of 100 bytes in a frame of 20"),
    (struct.pack(">II", 4, 0), "a command of 0 bytes"),
    (struct.pack(">II", 6, 2) + b"\x08\x06", "a SEND command without its send"),
    (struct.pack(">II", 6, 2) + b"\x08\x63", "a type this broker does not know"),
    (struct.pack(">II", 7, 3) + b"\xff\xff\xff", "does not decode"),
])
def test_malformed_frames_raise_protocol_error(data, says):
    with pytest.raises(ProtocolError, match=says):
        frames_of(data)


def test_after_a_bad_frame_the_decoder_can_still_take_bytes():
    # A failed parse must leave no view of the buffer behind (a broker once
    # died of the BufferError that followed).
    decoder = PulsarFrameDecoder()
    decoder.feed(struct.pack(">II", 7, 3) + b"\xff\xff\xff")
    with pytest.raises(ProtocolError):
        list(decoder.frames())
    decoder.feed(b"more")
    decoder.feed(encode(command(Type.PING)))


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=200))
def test_any_bytes_give_frames_or_a_protocol_error(data):
    try:
        for frame in frames_of(data):
            assert frame.type in FIELD_OF_TYPE
    except ProtocolError:
        pass


@settings(max_examples=300, deadline=None)
@given(st.binary(min_size=1, max_size=100), st.binary(max_size=50))
def test_any_command_bytes_in_a_well_sized_frame_give_a_command_or_a_protocol_error(command_bytes, payload):
    data = struct.pack(">II", 4 + len(command_bytes) + len(payload), len(command_bytes)) + command_bytes + payload
    try:
        frames_of(data)
    except ProtocolError:
        pass


def test_the_generated_module_matches_the_proto(tmp_path):
    import grpc_tools  # noqa: F401 (the test extra installs it: scripts/gen-pulsar-proto needs it)
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{PULSAR_DIR}", f"--python_out={tmp_path}",
                    str(PULSAR_DIR / "pulsar_api.proto")], check=True)
    assert (tmp_path / "pulsar_api_pb2.py").read_text() == (PULSAR_DIR / "pulsar_api_pb2.py").read_text(), \
        "broker/pulsar/pulsar_api_pb2.py is stale: run scripts/gen-pulsar-proto"
