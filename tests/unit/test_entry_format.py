"""Entry encoding and digest verification for every digest type."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bookie.protocol.entry_format import (
    HEADER_BYTES,
    DigestManager,
    DigestMismatchError,
    DigestType,
    EntryFormatError,
    master_key,
    parse_header,
)


@given(
    st.sampled_from(list(DigestType)),
    st.integers(0, 2**64 - 1),
    st.integers(0, 2**64 - 1),
    st.integers(-1, 2**63 - 1),
    st.integers(0, 2**64 - 1),
    st.binary(max_size=500),
    st.binary(max_size=20),
)
def test_encode_then_decode_gives_the_same_entry(digest_type, ledger_id, entry_id, lac, length, payload, password):
    manager = DigestManager(ledger_id, digest_type, password)
    raw = manager.encode(entry_id, lac, length, payload)
    header = parse_header(raw)
    assert (header.ledger_id, header.entry_id, header.last_add_confirmed, header.total_length) == (
        ledger_id, entry_id, lac, length,
    )
    entry = manager.decode(raw, expected_entry_id=entry_id)
    assert entry.data == payload and entry.last_add_confirmed == lac


@pytest.mark.parametrize("digest_type", [DigestType.CRC32C, DigestType.HMAC_SHA256])
@pytest.mark.parametrize("position", [0, 9, HEADER_BYTES, HEADER_BYTES + 40, -1])
def test_any_flipped_byte_is_caught(digest_type, position):
    manager = DigestManager(3, digest_type, b"pw")
    raw = bytearray(manager.encode(5, 4, 100, b"p" * 64))
    raw[position] ^= 0x01
    with pytest.raises(DigestMismatchError):
        manager.decode(bytes(raw), expected_entry_id=5)


def test_hmac_depends_on_the_password():
    raw = DigestManager(3, DigestType.HMAC_SHA256, b"right").encode(0, -1, 1, b"x")
    with pytest.raises(DigestMismatchError):
        DigestManager(3, DigestType.HMAC_SHA256, b"wrong").decode(raw)


def test_wrong_ledger_or_entry_is_a_mismatch():
    raw = DigestManager(3, DigestType.CRC32C).encode(0, -1, 1, b"x")
    with pytest.raises(DigestMismatchError, match="ledger"):
        DigestManager(4, DigestType.CRC32C).decode(raw)
    with pytest.raises(DigestMismatchError, match="asked for entry 1"):
        DigestManager(3, DigestType.CRC32C).decode(raw, expected_entry_id=1)


def test_short_bytes_are_not_an_entry():
    with pytest.raises(EntryFormatError):
        parse_header(b"tiny")
    with pytest.raises(DigestMismatchError):
        DigestManager(0, DigestType.HMAC_SHA256).decode(bytes(HEADER_BYTES + 3))


def test_master_key_is_a_stable_hash_not_the_password():
    assert master_key(b"pw") == master_key(b"pw") != master_key(b"pw2")
    assert b"pw" not in master_key(b"pw") and len(master_key(b"pw")) == 32


def test_digest_type_must_be_the_enum():
    with pytest.raises(TypeError):
        DigestManager(1, 1)
