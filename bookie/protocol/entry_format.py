"""Entries as they travel and rest: `header | digest | payload`.

The client encodes and verifies; a bookie only parses the header to index the
entry and keeps the bytes as given. The header is ledger id (u64), entry id
(u64), last-add-confirmed (i64) and the ledger's total length up to and
including this entry (u64); the digest covers header and payload.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import struct
from dataclasses import dataclass
from typing import NamedTuple

import crc32c

HEADER = struct.Struct(">QQqQ")
HEADER_BYTES = HEADER.size
_CRC = struct.Struct(">I")


class DigestType(enum.IntEnum):
    CRC32C = 1
    HMAC_SHA256 = 2
    DUMMY = 3  # no digest at all: tests only


DIGEST_BYTES = {DigestType.CRC32C: 4, DigestType.HMAC_SHA256: 32, DigestType.DUMMY: 0}


class EntryFormatError(ValueError):
    """The bytes are too short or inconsistent to be an entry."""


class DigestMismatchError(Exception):
    """The entry's digest does not match its contents: it is corrupt or was
    written with another password or digest type."""


@dataclass(frozen=True, slots=True)
class EntryHeader:
    ledger_id: int
    entry_id: int
    last_add_confirmed: int
    total_length: int


class Entry(NamedTuple):
    """A verified entry. A named tuple: readers build hundreds of thousands
    a second, and a frozen dataclass costs twice as much to make."""

    ledger_id: int
    entry_id: int
    last_add_confirmed: int
    total_length: int
    data: bytes


def parse_header(entry: bytes) -> EntryHeader:
    if len(entry) < HEADER_BYTES:
        raise EntryFormatError(f"an entry needs at least {HEADER_BYTES} header bytes, got {len(entry)}")
    return EntryHeader(*HEADER.unpack_from(entry))


def header_fields(entry: bytes) -> tuple[int, int, int, int]:
    """(ledger id, entry id, last-add-confirmed, total length) without
    building an object: the bookie's hot path."""
    if len(entry) < HEADER_BYTES:
        raise EntryFormatError(f"an entry needs at least {HEADER_BYTES} header bytes, got {len(entry)}")
    return HEADER.unpack_from(entry)


def master_key(password: bytes) -> bytes:
    """The key a client sends with every add and fencing read: a hash of the
    ledger password, so the bookie never learns the password itself."""
    return hashlib.sha256(b"quire-ledger-master-key\x00" + password).digest()


def _mac_key(password: bytes) -> bytes:
    return hashlib.sha256(b"quire-ledger-mac-key\x00" + password).digest()


class DigestManager:
    """Encodes and verifies the entries of one ledger."""

    def __init__(self, ledger_id: int, digest_type: DigestType, password: bytes = b"") -> None:
        if not isinstance(digest_type, DigestType):
            raise TypeError(f"digest_type must be a DigestType, got {digest_type!r}")
        self.ledger_id = ledger_id
        self.digest_type = digest_type
        self._digest_bytes = DIGEST_BYTES[digest_type]
        self._mac_key = _mac_key(password) if digest_type is DigestType.HMAC_SHA256 else b""

    def _digest(self, header: bytes, payload: bytes | memoryview) -> bytes:
        if self.digest_type is DigestType.CRC32C:
            return _CRC.pack(crc32c.crc32c(payload, crc32c.crc32c(header)))
        if self.digest_type is DigestType.HMAC_SHA256:
            mac = hmac.new(self._mac_key, header, hashlib.sha256)
            mac.update(payload)
            return mac.digest()
        return b""

    def encode(self, entry_id: int, last_add_confirmed: int, total_length: int, payload: bytes) -> bytes:
        header = HEADER.pack(self.ledger_id, entry_id, last_add_confirmed, total_length)
        return b"".join((header, self._digest(header, payload), payload))

    def decode_range(self, entries: list[bytes], first_entry_id: int) -> list[Entry]:
        """Verify consecutive entries first_entry_id, first_entry_id + 1, ...
        (a batch read's answer); stops before the first one that fails and
        returns the intact ones before it. The catch-up reader's hot path:
        for CRC32C, one loop without per-entry helper calls."""
        if self.digest_type is not DigestType.CRC32C:
            decoded = []
            for offset, entry in enumerate(entries):
                try:
                    decoded.append(self.decode(entry, expected_entry_id=first_entry_id + offset))
                except (DigestMismatchError, EntryFormatError):
                    break
            return decoded
        body_start = HEADER_BYTES + 4
        unpack_header, unpack_crc, crc = HEADER.unpack_from, _CRC.unpack_from, crc32c.crc32c
        ledger_id = self.ledger_id
        decoded = []
        expected = first_entry_id
        for entry in entries:
            if len(entry) < body_start:
                break
            entry_ledger_id, entry_id, last_add_confirmed, total_length = unpack_header(entry)
            if entry_ledger_id != ledger_id or entry_id != expected:
                break
            payload = entry[body_start:]
            if crc(payload, crc(entry[:HEADER_BYTES])) != unpack_crc(entry, HEADER_BYTES)[0]:
                break
            decoded.append(Entry(ledger_id, entry_id, last_add_confirmed, total_length, payload))
            expected += 1
        return decoded

    def decode(self, entry: bytes, *, expected_entry_id: int | None = None) -> Entry:
        """Verify an entry read back from a bookie and return its parts."""
        header = parse_header(entry)
        body_start = HEADER_BYTES + self._digest_bytes
        if len(entry) < body_start:
            raise DigestMismatchError(f"entry of {len(entry)} bytes is too short for its digest")
        payload = memoryview(entry)[body_start:]
        expected = self._digest(entry[:HEADER_BYTES], payload)
        if not hmac.compare_digest(expected, entry[HEADER_BYTES:body_start]):
            raise DigestMismatchError(f"digest mismatch in ledger {header.ledger_id} entry {header.entry_id}")
        if header.ledger_id != self.ledger_id:
            raise DigestMismatchError(f"entry belongs to ledger {header.ledger_id}, not {self.ledger_id}")
        if expected_entry_id is not None and header.entry_id != expected_entry_id:
            raise DigestMismatchError(f"asked for entry {expected_entry_id}, got entry {header.entry_id}")
        return Entry(header.ledger_id, header.entry_id, header.last_add_confirmed, header.total_length, bytes(payload))
