"""Ledger metadata: the value kept in one versioned znode per ledger, its
allowed state transitions, and its serialized form (JSON, so that operators
can read it with any ZooKeeper tool).

Every change is a new immutable `LedgerMetadata`, written by compare-and-set
against the version it was derived from (see `ledger_client.ledger_store`).
"""

from __future__ import annotations

import base64
import bisect
import enum
import hashlib
import hmac
import json
from dataclasses import dataclass, field, replace
from functools import cached_property
from types import MappingProxyType
from typing import Mapping

from bookie.protocol.entry_format import DigestType
from ledger_client.errors import LedgerStateError

FORMAT_VERSION = 1
PASSWORD_HASH_SALT = b"quire-ledger-password-check"


class LedgerState(enum.Enum):
    OPEN = "OPEN"
    IN_RECOVERY = "IN_RECOVERY"
    CLOSED = "CLOSED"


class MetadataChange(enum.Enum):
    ENSEMBLE_CHANGE = "ensemble_change"  # the writer (or a recoverer) replaced bookies
    START_RECOVERY = "start_recovery"  # a recoverer fences the ledger
    CLOSE = "close"  # the writer or a recoverer closes it
    # Auto-recovery copied a lost bookie's entries of one fragment to another
    # bookie and puts it in the lost one's place (BookKeeper's re-replication).
    REPLICATE = "replicate"


# Which change each state allows, and the state it leads to. Anything else
# is refused with LedgerStateError.
TRANSITIONS: Mapping[tuple[LedgerState, MetadataChange], LedgerState] = MappingProxyType(
    {
        (LedgerState.OPEN, MetadataChange.ENSEMBLE_CHANGE): LedgerState.OPEN,
        (LedgerState.OPEN, MetadataChange.START_RECOVERY): LedgerState.IN_RECOVERY,
        (LedgerState.OPEN, MetadataChange.CLOSE): LedgerState.CLOSED,
        # A recoverer that died leaves IN_RECOVERY behind; the next one starts
        # over. A recoverer replaces failed bookies while it rewrites entries,
        # but keeps the new ensembles to itself until its close writes them
        # (see RecoveryCore._from_writer); the change is computed with this.
        (LedgerState.IN_RECOVERY, MetadataChange.START_RECOVERY): LedgerState.IN_RECOVERY,
        (LedgerState.IN_RECOVERY, MetadataChange.ENSEMBLE_CHANGE): LedgerState.IN_RECOVERY,
        (LedgerState.IN_RECOVERY, MetadataChange.CLOSE): LedgerState.CLOSED,
        # Only fragments whose entries are final are re-replicated: any of a
        # closed ledger, those before the last of an open one (its writer
        # adopts the change on its next compare-and-set). A ledger in
        # recovery is left to its recoverer, whose close would start over.
        (LedgerState.OPEN, MetadataChange.REPLICATE): LedgerState.OPEN,
        (LedgerState.CLOSED, MetadataChange.REPLICATE): LedgerState.CLOSED,
    }
)


def password_hash(password: bytes) -> bytes:
    """What the metadata keeps of the password: enough to check a password
    given to `open_ledger`, not the bookies' master key itself."""
    return hashlib.sha256(PASSWORD_HASH_SALT + password).digest()


@dataclass(frozen=True)
class LedgerMetadata:
    ledger_id: int
    ensemble_size: int
    write_quorum: int
    ack_quorum: int
    # first entry id -> bookie ids, ordered by first entry id; the first key is 0
    ensembles: tuple[tuple[int, tuple[str, ...]], ...]
    digest_type: DigestType
    password_hash: bytes
    creation_time_ms: int
    state: LedgerState = LedgerState.OPEN
    last_entry_id: int = -1  # meaningful once CLOSED
    length: int = 0  # payload bytes of entries 0..last_entry_id, once CLOSED
    custom_metadata: Mapping[str, bytes] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not (self.ensemble_size >= self.write_quorum >= self.ack_quorum >= 1):
            raise ValueError(
                f"need ensemble_size >= write_quorum >= ack_quorum >= 1, got "
                f"{self.ensemble_size}/{self.write_quorum}/{self.ack_quorum}"
            )
        if self.ledger_id < 0:
            raise ValueError(f"ledger_id must not be negative, got {self.ledger_id}")
        if not self.ensembles or self.ensembles[0][0] != 0:
            raise ValueError("the first ensemble must start at entry 0")
        previous = -1
        for first_entry_id, bookies in self.ensembles:
            if first_entry_id <= previous:
                raise ValueError("ensembles must be keyed by increasing first entry ids")
            previous = first_entry_id
            if len(bookies) != self.ensemble_size or len(set(bookies)) != len(bookies):
                raise ValueError(f"an ensemble needs {self.ensemble_size} distinct bookies, got {list(bookies)}")
        if self.state is LedgerState.CLOSED and self.last_entry_id < -1:
            raise ValueError("last_entry_id of a closed ledger must be >= -1")

    # --- reading ---------------------------------------------------------------

    @property
    def is_closed(self) -> bool:
        return self.state is LedgerState.CLOSED

    @property
    def ensemble_keys(self) -> list[int]:
        return [first for first, _ in self.ensembles]

    @property
    def last_ensemble(self) -> tuple[int, tuple[str, ...]]:
        return self.ensembles[-1]

    def ensemble_at(self, entry_id: int) -> tuple[int, tuple[str, ...]]:
        """The ensemble that covers `entry_id`: (its first entry id, bookies)."""
        last = self.ensembles[-1]
        if entry_id >= last[0]:
            return last  # the writer's case, on every add
        if entry_id < 0:
            raise ValueError(f"entry_id must not be negative, got {entry_id}")
        index = bisect.bisect_right(self.ensemble_keys, entry_id) - 1
        return self.ensembles[index]

    def write_set(self, entry_id: int) -> list[str]:
        """The bookies that store `entry_id`: (e + i) mod E, i < WQ."""
        return list(self.write_set_tuple(entry_id))

    def write_set_tuple(self, entry_id: int) -> tuple[str, ...]:
        """`write_set` as a tuple, without a copy for the last ensemble (the
        writer's case, on every add)."""
        last_key, _ = self.ensembles[-1]
        if entry_id >= last_key:
            return self.last_write_sets[entry_id % self.ensemble_size]
        return self._earlier_write_set(entry_id)

    def _earlier_write_set(self, entry_id: int) -> tuple[str, ...]:
        # Apart from `write_set_tuple`, whose every call would otherwise make
        # cells for the generator's variables.
        _, bookies = self.ensemble_at(entry_id)
        return tuple(bookies[(entry_id + i) % self.ensemble_size] for i in range(self.write_quorum))

    @cached_property
    def last_write_sets(self) -> tuple[tuple[str, ...], ...]:
        """The last ensemble's write set for each entry id modulo E (the
        metadata never changes: a change makes a new value)."""
        _, bookies = self.ensembles[-1]
        size = self.ensemble_size
        return tuple(tuple(bookies[(first + i) % size] for i in range(self.write_quorum)) for first in range(size))

    def all_bookies(self) -> set[str]:
        return {bookie for _, bookies in self.ensembles for bookie in bookies}

    # --- changes (each returns a new value) --------------------------------------

    def _next_state(self, change: MetadataChange) -> LedgerState:
        try:
            return TRANSITIONS[(self.state, change)]
        except KeyError:
            raise LedgerStateError(f"ledger {self.ledger_id} is {self.state.value}: {change.value} is not allowed") from None

    def with_ensemble(self, first_entry_id: int, bookies: list[str] | tuple[str, ...]) -> "LedgerMetadata":
        """Replace bookies from `first_entry_id` on. An ensemble keyed at the
        same entry as the last one replaces it (nothing was written through
        it yet); a key before the last ensemble's is refused."""
        state = self._next_state(MetadataChange.ENSEMBLE_CHANGE)
        last_key, _ = self.ensembles[-1]
        if first_entry_id < last_key:
            raise ValueError(f"new ensemble at entry {first_entry_id} would precede the last one at {last_key}")
        kept = self.ensembles[:-1] if first_entry_id == last_key else self.ensembles
        return replace(self, state=state, ensembles=(*kept, (first_entry_id, tuple(bookies))))

    def with_bookie_replaced(self, first_entry_id: int, index: int, old: str, new: str) -> "LedgerMetadata":
        """Put `new` at position `index` of the ensemble keyed at
        `first_entry_id`, where `old` must be (auto-recovery copied `old`'s
        entries of that fragment to `new` first). The last ensemble of an
        open ledger is its writer's and is refused."""
        state = self._next_state(MetadataChange.REPLICATE)
        keys = self.ensemble_keys
        if first_entry_id not in keys:
            raise ValueError(f"ledger {self.ledger_id} has no ensemble at entry {first_entry_id}")
        position = keys.index(first_entry_id)
        if self.state is LedgerState.OPEN and position == len(keys) - 1:
            raise LedgerStateError(f"ledger {self.ledger_id} is OPEN: its last ensemble belongs to the writer")
        bookies = list(self.ensembles[position][1])
        if bookies[index] != old:
            raise ValueError(f"ledger {self.ledger_id} has {bookies[index]} at {first_entry_id}/{index}, not {old}")
        bookies[index] = new  # __post_init__ refuses a bookie already in the ensemble
        ensembles = (*self.ensembles[:position], (first_entry_id, tuple(bookies)), *self.ensembles[position + 1 :])
        return replace(self, state=state, ensembles=ensembles)

    def with_recovery_started(self) -> "LedgerMetadata":
        return replace(self, state=self._next_state(MetadataChange.START_RECOVERY))

    def with_closed(self, last_entry_id: int, length: int) -> "LedgerMetadata":
        state = self._next_state(MetadataChange.CLOSE)
        if last_entry_id < -1 or length < 0:
            raise ValueError(f"cannot close at entry {last_entry_id} with length {length}")
        # Ensembles keyed after the last entry never held anything: drop them
        # so that readers never look there (but keep the first at entry 0).
        ensembles = tuple(
            (first, bookies) for index, (first, bookies) in enumerate(self.ensembles)
            if index == 0 or first <= last_entry_id
        )
        return replace(self, state=state, last_entry_id=last_entry_id, length=length, ensembles=ensembles)

    def check_password(self, password: bytes) -> bool:
        return hmac.compare_digest(self.password_hash, password_hash(password))

    # --- serialized form -----------------------------------------------------------

    def to_bytes(self) -> bytes:
        document = {
            "format_version": FORMAT_VERSION,
            "ledger_id": self.ledger_id,
            "ensemble_size": self.ensemble_size,
            "write_quorum": self.write_quorum,
            "ack_quorum": self.ack_quorum,
            "state": self.state.value,
            "last_entry_id": self.last_entry_id,
            "length": self.length,
            "ensembles": [[first, list(bookies)] for first, bookies in self.ensembles],
            "digest_type": self.digest_type.name,
            "password_hash": base64.b64encode(self.password_hash).decode(),
            "creation_time_ms": self.creation_time_ms,
            "custom_metadata": {key: base64.b64encode(value).decode() for key, value in sorted(self.custom_metadata.items())},
        }
        return json.dumps(document, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> "LedgerMetadata":
        """Parse stored metadata; ValueError says what is wrong with it."""
        try:
            document = json.loads(data)
            version = document["format_version"]
            if version != FORMAT_VERSION:
                raise ValueError(f"unknown ledger metadata format version {version!r}")
            return cls(
                ledger_id=int(document["ledger_id"]),
                ensemble_size=int(document["ensemble_size"]),
                write_quorum=int(document["write_quorum"]),
                ack_quorum=int(document["ack_quorum"]),
                state=LedgerState(document["state"]),
                last_entry_id=int(document["last_entry_id"]),
                length=int(document["length"]),
                ensembles=tuple((int(first), tuple(str(b) for b in bookies)) for first, bookies in document["ensembles"]),
                digest_type=DigestType[document["digest_type"]],
                password_hash=base64.b64decode(document["password_hash"]),
                creation_time_ms=int(document["creation_time_ms"]),
                custom_metadata={str(k): base64.b64decode(v) for k, v in document.get("custom_metadata", {}).items()},
            )
        except (KeyError, TypeError, AttributeError, ValueError, UnicodeDecodeError) as error:
            raise ValueError(f"malformed ledger metadata: {error}") from None

    def describe(self) -> dict:
        """A JSON-friendly view for `quire ledger show`."""
        return {
            "ledger_id": self.ledger_id,
            "state": self.state.value,
            "ensemble_size": self.ensemble_size,
            "write_quorum": self.write_quorum,
            "ack_quorum": self.ack_quorum,
            "last_entry_id": self.last_entry_id if self.is_closed else None,
            "length": self.length if self.is_closed else None,
            "ensembles": {str(first): list(bookies) for first, bookies in self.ensembles},
            "digest_type": self.digest_type.name,
            "creation_time_ms": self.creation_time_ms,
            "custom_metadata": {key: value.decode(errors="replace") for key, value in self.custom_metadata.items()},
        }


__all__ = [
    "LedgerMetadata",
    "LedgerState",
    "MetadataChange",
    "TRANSITIONS",
    "password_hash",
]
