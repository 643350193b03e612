"""The compression codecs of stored messages: Pulsar's, framed as Pulsar
frames them, so that a batch written by any Pulsar client is stored and
delivered as it came. The uncompressed size travels beside the data (in the
message metadata), and a decompression must give exactly that many bytes:
a body never grows past what its producer declared, nor past the caller's
bound.

  NONE    the bytes as they are
  LZ4     one LZ4 block, no frame, no size prefix (lz4-java's and liblz4's block format)
  ZLIB    one zlib stream (RFC 1950, with its header and Adler-32)
  ZSTD    one Zstandard frame
  SNAPPY  one raw Snappy block (its length varint first)
"""

from __future__ import annotations

import enum
import zlib


class CodecError(Exception):
    """Bytes that do not decompress to the size they declare."""


class Codec(str, enum.Enum):
    NONE = "none"
    LZ4 = "lz4"
    ZLIB = "zlib"
    ZSTD = "zstd"
    SNAPPY = "snappy"

    @property
    def wire_number(self) -> int:
        """Pulsar's CompressionType number."""
        return _WIRE_NUMBERS[self]

    @classmethod
    def from_wire(cls, number: int) -> "Codec":
        try:
            return _BY_WIRE_NUMBER[number]
        except KeyError:
            raise CodecError(f"unknown compression type {number}") from None

    @classmethod
    def parse(cls, value: "Codec | str") -> "Codec":
        """A codec by name (any case), for flags and options."""
        if isinstance(value, Codec):
            return value
        try:
            return cls(str(value).lower())
        except ValueError:
            raise ValueError(f"unknown codec {value!r}; known: {', '.join(codec.value for codec in cls)}") from None


_WIRE_NUMBERS = {Codec.NONE: 0, Codec.LZ4: 1, Codec.ZLIB: 2, Codec.ZSTD: 3, Codec.SNAPPY: 4}
_BY_WIRE_NUMBER = {number: codec for codec, number in _WIRE_NUMBERS.items()}

ZSTD_LEVEL = 3  # Pulsar's clients' default
ZLIB_LEVEL = 6


def compress(codec: Codec, data: bytes) -> bytes:
    if codec is Codec.NONE:
        return data
    if codec is Codec.LZ4:
        import lz4.block

        return lz4.block.compress(data, store_size=False)
    if codec is Codec.ZLIB:
        return zlib.compress(data, ZLIB_LEVEL)
    if codec is Codec.ZSTD:
        import zstandard

        return zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_content_size=True).compress(data)
    if codec is Codec.SNAPPY:
        import snappy

        return snappy.compress(data)
    raise AssertionError(codec)


def decompress(codec: Codec, data: bytes | memoryview, size: int) -> bytes:
    """Exactly `size` bytes (the caller has checked `size` against its own
    bound), or CodecError."""
    if codec is Codec.NONE:
        if len(data) != size:
            raise CodecError(f"{len(data)} bytes where {size} were declared")
        return bytes(data)
    try:
        out = _DECOMPRESS[codec](data, size)
    except CodecError:
        raise
    except Exception as error:  # each codec library raises its own types
        raise CodecError(f"{codec.value} data does not decompress: {type(error).__name__}: {error}"[:300]) from None
    if len(out) != size:
        raise CodecError(f"{codec.value} data decompresses to {len(out)} bytes, {size} were declared")
    return out


def _lz4(data, size: int) -> bytes:
    import lz4.block

    # A block says nothing of its size: liblz4 writes at most `size` bytes
    # and fails if the block wants more.
    return lz4.block.decompress(bytes(data), uncompressed_size=size) if size else _empty(data, Codec.LZ4)


def _zlib(data, size: int) -> bytes:
    decompressor = zlib.decompressobj()
    out = decompressor.decompress(data, size + 1)
    if len(out) > size:
        raise CodecError(f"zlib data decompresses past the {size} bytes declared")
    if not decompressor.eof:
        raise CodecError("zlib data is a truncated stream")
    if decompressor.unused_data:
        raise CodecError(f"zlib data has {len(decompressor.unused_data)} bytes after its stream")
    return out


def _zstd(data, size: int) -> bytes:
    import zstandard

    declared = zstandard.get_frame_parameters(data).content_size
    if declared not in (zstandard.CONTENTSIZE_UNKNOWN, size):
        raise CodecError(f"zstd frame declares {declared} bytes, the metadata {size}")
    if declared == 0:
        # python-zstandard answers b"" for a frame that declares no content
        # without reading the frame: read it, so that a truncated frame or
        # bytes after it are refused as for any other size (zstd stops at
        # the first block that would go past the declared 0 bytes).
        decompressor = zstandard.ZstdDecompressor().decompressobj()
        if decompressor.decompress(data) or not decompressor.eof or decompressor.unused_data:
            raise CodecError("zstd frame of 0 bytes is truncated, holds more, or has bytes after it")
        return b""
    return zstandard.ZstdDecompressor().decompress(data, max_output_size=size, allow_extra_data=False)


def _snappy(data, size: int) -> bytes:
    import snappy

    declared = _varint(data)
    if declared != size:
        raise CodecError(f"snappy block declares {declared} bytes, the metadata {size}")
    return snappy.uncompress(bytes(data))


def _empty(data, codec: Codec) -> bytes:
    # Nothing declared: the block must say nothing either (a one-byte block
    # of a zero-length literal run is what LZ4 writes for nothing).
    if bytes(data) not in (b"", b"\x00"):
        raise CodecError(f"{codec.value} data of {len(data)} bytes where 0 bytes were declared")
    return b""


def _varint(data) -> int:
    value = shift = 0
    for index in range(min(len(data), 5)):
        byte = data[index]
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value
        shift += 7
    raise CodecError("snappy block has no length")


_DECOMPRESS = {Codec.LZ4: _lz4, Codec.ZLIB: _zlib, Codec.ZSTD: _zstd, Codec.SNAPPY: _snappy}

__all__ = ["Codec", "CodecError", "compress", "decompress"]
