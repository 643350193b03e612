"""The codecs of stored messages (Pulsar's NONE, LZ4, ZLIB, ZSTD, SNAPPY):
round trips, data framed as Pulsar's clients frame it, and what happens to
data that does not give exactly its declared size (CodecError, never
another exception, never memory past the declared size)."""

from __future__ import annotations

import os
import zlib
from functools import cache

import cramjam
import lz4.block
import lz4.frame
import pytest
import snappy
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.codecs import Codec, CodecError, compress, decompress
from broker.pulsar.pulsar_api_pb2 import CompressionType
from tests.support import peak_bytes_of

COMPRESSED = [codec for codec in Codec if codec is not Codec.NONE]
MIB = 1024 * 1024


def test_every_codec_has_pulsars_compression_number():
    assert {codec: codec.wire_number for codec in Codec} == {
        codec: CompressionType.Value(codec.name) for codec in Codec
    }
    assert all(Codec.from_wire(codec.wire_number) is codec for codec in Codec)
    with pytest.raises(CodecError, match="unknown compression type 5"):
        Codec.from_wire(5)


def test_codec_names_parse_in_any_case_and_unknown_ones_are_refused():
    assert Codec.parse("ZSTD") is Codec.ZSTD and Codec.parse("Snappy") is Codec.SNAPPY
    assert Codec.parse(Codec.LZ4) is Codec.LZ4
    with pytest.raises(ValueError, match="known: none, lz4, zlib, zstd, snappy"):
        Codec.parse("gzip")


# --- round trips -------------------------------------------------------------------------


def payloads() -> list[bytes]:
    return [b"", b"x", b"hello world " * 100, os.urandom(1000), bytes(100_000)]


@pytest.mark.parametrize("codec", list(Codec))
def test_every_codec_round_trips_empty_small_repetitive_and_random_data(codec):
    for raw in payloads():
        data = compress(codec, raw)
        assert decompress(codec, data, len(raw)) == raw
        assert decompress(codec, memoryview(data), len(raw)) == raw  # as a stored entry hands it over


@pytest.mark.parametrize("codec", list(Codec))
def test_a_large_payload_round_trips_whole(codec):
    # Several megabytes, part incompressible: decompression must not stop
    # early at some internal buffer size.
    raw = os.urandom(2 * MIB) + bytes(6 * MIB) + os.urandom(100_000)
    assert decompress(codec, compress(codec, raw), len(raw)) == raw


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(list(Codec)), st.binary(max_size=3000) | st.binary(max_size=20).map(lambda part: part * 200))
def test_random_data_round_trips(codec, raw):
    assert decompress(codec, compress(codec, raw), len(raw)) == raw


# --- what Pulsar's clients send ----------------------------------------------------------


RAW = b"a message of a Pulsar batch, " * 50


@pytest.mark.parametrize(
    ("codec", "data"),
    [
        # lz4-java and liblz4 write one block, no frame and no size prefix.
        (Codec.LZ4, lz4.block.compress(RAW, store_size=False)),
        (Codec.LZ4, lz4.block.compress(RAW, mode="high_compression", compression=12, store_size=False)),
        (Codec.LZ4, lz4.block.compress(RAW, mode="fast", acceleration=16, store_size=False)),
        # java.util.zip.Deflater and zlib's compress: a zlib stream with its header and Adler-32.
        (Codec.ZLIB, zlib.compress(RAW, 1)),
        (Codec.ZLIB, zlib.compress(RAW, 9)),
        (Codec.ZLIB, zlib.compress(RAW, 0)),  # stored blocks
        # zstd-jni's and libzstd's one-shot compression: one frame declaring its size.
        (Codec.ZSTD, zstandard.ZstdCompressor(level=1).compress(RAW)),
        (Codec.ZSTD, zstandard.ZstdCompressor(level=19, write_checksum=True).compress(RAW)),
        # Snappy's raw block (its length varint first), as snappy-java's and libsnappy's compress.
        (Codec.SNAPPY, bytes(cramjam.snappy.compress_raw(RAW))),
        (Codec.SNAPPY, snappy.compress(RAW)),
    ],
)
def test_data_compressed_as_pulsars_clients_frame_it_decompresses(codec, data):
    assert decompress(codec, data, len(RAW)) == RAW


def test_a_zstd_frame_that_does_not_declare_its_size_decompresses():
    # A streaming compressor's frame: bounded by the metadata's size alone.
    compressor = zstandard.ZstdCompressor(level=3).compressobj()
    data = compressor.compress(RAW) + compressor.flush()
    assert zstandard.get_frame_parameters(data).content_size == zstandard.CONTENTSIZE_UNKNOWN
    assert decompress(Codec.ZSTD, data, len(RAW)) == RAW
    with pytest.raises(CodecError):
        decompress(Codec.ZSTD, data, len(RAW) - 1)


@pytest.mark.parametrize(
    ("codec", "data", "raw"),
    [
        # Written by hand from the formats' specifications.
        (Codec.LZ4, b"\x50hello", b"hello"),  # one sequence of 5 literals
        (Codec.LZ4, b"\x00", b""),  # what LZ4 writes for nothing
        (Codec.ZLIB, b"\x78\x9c\x03\x00\x00\x00\x00\x01", b""),
        (Codec.ZLIB, b"\x78\x01\x01\x05\x00\xfa\xffhello\x06\x2c\x02\x15", b"hello"),  # one stored block
        (Codec.SNAPPY, b"\x05\x10hello", b"hello"),  # length 5, one literal of 5
        (Codec.SNAPPY, b"\x00", b""),
    ],
)
def test_data_written_from_the_specifications_decompresses(codec, data, raw):
    assert decompress(codec, data, len(raw)) == raw


@pytest.mark.parametrize(
    ("codec", "data"),
    [
        (Codec.LZ4, lz4.frame.compress(RAW)),  # an LZ4 frame, not a block
        (Codec.LZ4, lz4.block.compress(RAW, store_size=True)),  # a block behind its size
        (Codec.ZLIB, zlib.compress(RAW, wbits=31)),  # a gzip member
        (Codec.ZLIB, zlib.compress(RAW, wbits=-15)),  # raw deflate, no zlib header
        (Codec.SNAPPY, bytes(cramjam.snappy.compress(RAW))),  # Snappy's framing format
        (Codec.ZSTD, lz4.block.compress(RAW, store_size=False)),
    ],
)
def test_data_in_another_framing_is_refused(codec, data):
    with pytest.raises(CodecError):
        decompress(codec, data, len(RAW))


# --- sizes and garbage -------------------------------------------------------------------


@pytest.mark.parametrize("codec", list(Codec))
def test_a_declared_size_that_is_wrong_either_way_is_refused(codec):
    for raw in [b"x", b"hello world " * 100, os.urandom(5000)]:
        data = compress(codec, raw)
        with pytest.raises(CodecError):
            decompress(codec, data, len(raw) + 1)
        with pytest.raises(CodecError):
            decompress(codec, data, len(raw) - 1)
        with pytest.raises(CodecError):
            decompress(codec, data, 0)
    with pytest.raises(CodecError):
        decompress(codec, compress(codec, b""), 1)


def test_the_messages_say_which_size_was_wrong():
    data = compress(Codec.ZSTD, b"x" * 100)
    with pytest.raises(CodecError, match="zstd frame declares 100 bytes, the metadata 101"):
        decompress(Codec.ZSTD, data, 101)
    with pytest.raises(CodecError, match="snappy block declares 100 bytes, the metadata 99"):
        decompress(Codec.SNAPPY, compress(Codec.SNAPPY, b"x" * 100), 99)
    with pytest.raises(CodecError, match="zlib data decompresses past the 99 bytes declared"):
        decompress(Codec.ZLIB, compress(Codec.ZLIB, b"x" * 100), 99)
    with pytest.raises(CodecError, match="lz4 data decompresses to 100 bytes, 101 were declared"):
        decompress(Codec.LZ4, compress(Codec.LZ4, b"x" * 100), 101)
    with pytest.raises(CodecError, match="3 bytes where 4 were declared"):
        decompress(Codec.NONE, b"abc", 4)


def garbage(codec: Codec) -> list[tuple[str, bytes]]:
    """(what, data) for a payload of 1000 bytes."""
    good = compress(codec, RAW[:1000])
    middle = len(good) // 2
    return [
        ("nothing", b""),
        ("random bytes", os.urandom(200)),
        ("truncated", good[:middle]),
        ("truncated at the end", good[:-1]),
        ("a trailing byte", good + b"\x00"),
        ("twice", good + good),
        ("a flipped byte", good[:middle] + bytes([good[middle] ^ 0xFF]) + good[middle + 1:]),
    ]


@pytest.mark.parametrize("codec", COMPRESSED)
def test_truncated_or_garbage_data_is_refused(codec):
    for what, data in garbage(codec):
        try:
            out = decompress(codec, data, 1000)
        except CodecError:
            continue
        # A flipped literal byte may still decompress: to exactly the size declared.
        assert what == "a flipped byte" and len(out) == 1000, what


@pytest.mark.parametrize("codec", COMPRESSED)
def test_an_empty_payload_is_refused_unless_its_data_says_nothing(codec):
    empty = compress(codec, b"")
    assert decompress(codec, empty, 0) == b""
    for data in (empty + b"\x00", empty + empty, os.urandom(16)):
        with pytest.raises(CodecError):
            decompress(codec, data, 0)


def test_a_zstd_frame_declaring_nothing_is_read_whole():
    # python-zstandard answers nothing for such a frame without reading it:
    # a truncated frame, bytes after it, or blocks in it are still refused.
    empty = compress(Codec.ZSTD, b"")
    assert zstandard.get_frame_parameters(empty).content_size == 0
    for data in (empty[:-1], empty[:6], empty + b"garbage", empty[:6] + os.urandom(64)):
        with pytest.raises(CodecError):
            decompress(Codec.ZSTD, data, 0)
    # A streaming frame (its window size, then its blocks) forged to declare
    # a content size of 0 (a 4-byte field) in front of 1 MiB of blocks.
    compressor = zstandard.ZstdCompressor(level=1).compressobj()
    stream = compressor.compress(bytes(MIB)) + compressor.flush()
    assert stream[4] == 0x00, "no content size, a window descriptor"
    forged = stream[:4] + b"\x80" + stream[5:6] + bytes(4) + stream[6:]
    assert zstandard.get_frame_parameters(forged).content_size == 0
    with pytest.raises(CodecError):
        decompress(Codec.ZSTD, forged, 0)


# --- bombs -------------------------------------------------------------------------------


def lz4_bomb(size: int) -> bytes:
    """An LZ4 block of `size` zeros, written by hand: a literal zero, one
    match of offset 1 as long as it takes, and the 5 literals a block ends
    with."""
    extra = size - 1 - 5 - 4 - 15  # the match's length past its token's 4 + 15
    return b"\x1f\x00\x01\x00" + b"\xff" * (extra // 255) + bytes([extra % 255]) + b"\x50" + bytes(5)


def snappy_bomb(declared: int, size: int) -> bytes:
    """A Snappy block declaring `declared` bytes whose elements write `size`
    zeros: a literal zero, then copies of 64 bytes at offset 1."""
    length = bytearray()
    value = declared
    while value >= 0x80:
        length.append(value & 0x7F | 0x80)
        value >>= 7
    length.append(value)
    copies, rest = divmod(size - 1, 64)
    tail = b"" if not rest else bytes([(rest - 1) << 2 | 2, 1, 0])
    return bytes(length) + b"\x00\x00" + bytes([63 << 2 | 2, 1, 0]) * copies + tail


@cache
def bomb(codec: Codec, size: int, *, declared: bool = False) -> bytes:
    """Small data that decompresses to `size` zeros (declaring it, where the
    format can), built without ever holding them."""
    chunk = bytes(MIB)
    if codec is Codec.LZ4:
        return lz4_bomb(size)
    if codec is Codec.SNAPPY:
        return snappy_bomb(size, size)
    if codec is Codec.ZSTD:
        compressor = zstandard.ZstdCompressor(level=3).compressobj(size=size if declared else -1)
        return b"".join(compressor.compress(chunk) for _ in range(size // MIB)) + compressor.flush()
    compressor = zlib.compressobj(9)
    return b"".join(compressor.compress(chunk) for _ in range(size // MIB)) + compressor.flush()


def test_the_bombs_are_what_they_say():
    assert lz4.block.decompress(lz4_bomb(MIB), uncompressed_size=MIB) == bytes(MIB)
    assert snappy.uncompress(snappy_bomb(MIB, MIB)) == bytes(MIB)
    assert zstandard.get_frame_parameters(bomb(Codec.ZSTD, 256 * MIB, declared=True)).content_size == 256 * MIB


def refused(codec: Codec, data: bytes, size: int) -> None:
    with pytest.raises(CodecError):
        decompress(codec, data, size)


@pytest.mark.parametrize("codec", COMPRESSED)
def test_a_bomb_is_refused_within_its_declared_size(codec):
    # 256 MiB of zeros in at most a few megabytes, declared as 1 MiB:
    # decompression stops at the declared size and raises; memory stays
    # near it, not near the bomb.
    data = bomb(codec, 256 * MIB)
    assert len(data) < 16 * MIB
    assert peak_bytes_of(lambda: refused(codec, data, MIB)) < 4 * MIB


@pytest.mark.parametrize("codec", [Codec.ZSTD, Codec.SNAPPY])
def test_data_declaring_more_than_the_metadata_is_refused_before_it_is_decompressed(codec):
    data = bomb(codec, 256 * MIB, declared=True) if codec is Codec.ZSTD else snappy_bomb(256 * MIB, MIB)
    assert peak_bytes_of(lambda: refused(codec, data, MIB)) < MIB
    with pytest.raises(CodecError, match=f"declares {256 * MIB} bytes, the metadata {MIB}"):
        decompress(codec, data, MIB)


def test_a_snappy_block_writing_past_what_it_declares_is_refused():
    assert peak_bytes_of(lambda: refused(Codec.SNAPPY, snappy_bomb(MIB, 2 * MIB), MIB)) < 4 * MIB


# --- any bytes ---------------------------------------------------------------------------


def mutated(data: bytes, draw) -> bytes:
    kind = draw(st.sampled_from(["flip", "cut", "append", "insert"]))
    at = draw(st.integers(0, max(0, len(data) - 1)))
    if kind == "flip" and data:
        return data[:at] + bytes([data[at] ^ draw(st.integers(1, 255))]) + data[at + 1:]
    if kind == "cut":
        return data[:at]
    if kind == "append":
        return data + draw(st.binary(min_size=1, max_size=8))
    return data[:at] + draw(st.binary(min_size=1, max_size=8)) + data[at:]


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(list(Codec)), st.binary(max_size=300), st.integers(0, 4096), st.data())
def test_any_bytes_decompress_to_their_declared_size_or_raise_codec_error(codec, raw, size, data):
    # Random bytes, or another payload's data with a byte changed, cut or
    # added, at a random declared size or at the right one.
    candidate = data.draw(st.sampled_from([raw, compress(codec, raw), mutated(compress(codec, raw), data.draw)]))
    size = data.draw(st.sampled_from([size, len(raw)]))
    try:
        out = decompress(codec, candidate, size)
    except CodecError:
        return
    assert type(out) is bytes and len(out) == size
