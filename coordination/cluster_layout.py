"""Where a quire cluster keeps its metadata inside its ZooKeeper chroot.

One place for the paths, so that bookies, clients and tools agree:
/instance_id, /cookies/<bookie>, /bookies/writable/<bookie> and
/bookies/readonly/<bookie> (ephemeral registrations, JSON data), and the
ledger metadata nodes under /ledgers (read and listed here; written by
`ledger_client.ledger_store`). Paths are relative to the store's chroot
(`--root`, default /quire).

Ledger metadata lives at `/ledgers/DDD/DDDD/DDDD/DDDD/LDDDD`: the id is
zero-padded to 19 digits and cut 3/4/4/4 into directories and a leaf `L` +
the last 4 digits (BookKeeper's "long hierarchical" layout): ledger 123 is
`/ledgers/000/0000/0000/0000/L0123`. No node has more than 10,000 children,
however many ledgers there are, and sorted children list ids in order.

Auto-recovery keeps its state under /underreplication: `ledgers/<ledger id>`
(a ledger with a fragment on a lost bookie, marked by the auditor),
`locks/<ledger id>` (ephemeral: a replication worker is at it), `auditor/`
(the election: ephemeral sequential nodes, the lowest is the auditor) and
`disabled` (exists while auto-recovery is switched off).
"""

from __future__ import annotations

import itertools
import json
import uuid
from dataclasses import asdict, dataclass
from typing import Iterator

from coordination.store import MetadataStore, NoNodeError, NodeExistsError


@dataclass(frozen=True)
class ClusterLayout:
    root: str = "/"  # inside the store's chroot

    def _path(self, *parts: str) -> str:
        return "/".join([self.root.rstrip("/"), *parts]) if self.root != "/" else "/" + "/".join(parts)

    @property
    def instance_id(self) -> str:
        return self._path("instance_id")

    @property
    def cookies(self) -> str:
        return self._path("cookies")

    def cookie(self, bookie_id: str) -> str:
        return self._path("cookies", bookie_id)

    @property
    def writable_bookies(self) -> str:
        return self._path("bookies", "writable")

    @property
    def readonly_bookies(self) -> str:
        return self._path("bookies", "readonly")

    def bookie_registration(self, bookie_id: str, *, read_only: bool) -> str:
        return self._path("bookies", "readonly" if read_only else "writable", bookie_id)

    # -- auto-recovery (ledger_client.autorecovery) --

    @property
    def underreplicated_ledgers(self) -> str:
        return self._path("underreplication", "ledgers")

    def underreplicated_ledger(self, ledger_id: int) -> str:
        return self._path("underreplication", "ledgers", str(ledger_id))

    @property
    def replication_locks(self) -> str:
        return self._path("underreplication", "locks")

    def replication_lock(self, ledger_id: int) -> str:
        return self._path("underreplication", "locks", str(ledger_id))

    @property
    def auditor_election(self) -> str:
        return self._path("underreplication", "auditor")

    @property
    def autorecovery_disabled(self) -> str:
        return self._path("underreplication", "disabled")


@dataclass(frozen=True)
class BookieRegistrationInfo:
    """The data of a bookie's registration node."""

    bookie_id: str
    address: str  # host:port clients connect to
    rack: str | None = None
    read_only: bool = False
    tls: bool = False  # its port serves TLS only: clients connect with TLS

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> "BookieRegistrationInfo":
        return cls(**json.loads(data))


def ensure_cluster_layout(store: MetadataStore, layout: ClusterLayout) -> str:
    """Create the cluster's base nodes if missing; return the instance id
    (created once per cluster, race-free between concurrent callers)."""
    for path in (layout.cookies, layout.writable_bookies, layout.readonly_bookies):
        store.ensure_path(path)
    try:
        return store.get(layout.instance_id)[0].decode()
    except NoNodeError:
        pass
    try:
        store.create(layout.instance_id, uuid.uuid4().hex.encode())
    except NodeExistsError:
        pass
    return store.get(layout.instance_id)[0].decode()


def list_bookies(store: MetadataStore, layout: ClusterLayout, *, read_only: bool) -> dict[str, BookieRegistrationInfo]:
    """Registered bookies of one kind, by id (a node that vanishes while we
    read is skipped: its bookie just went away)."""
    directory = layout.readonly_bookies if read_only else layout.writable_bookies
    try:
        names = store.children(directory)
    except NoNodeError:
        return {}
    bookies = {}
    for name in names:
        try:
            data, _ = store.get(f"{directory}/{name}")
        except NoNodeError:
            continue
        bookies[name] = BookieRegistrationInfo.from_bytes(data)
    return bookies


# --- ledger metadata nodes ------------------------------------------------------

LEDGERS_PATH = "/ledgers"
LEDGER_ID_DIGITS = 19
DIRECTORY_WIDTHS = (3, 4, 4, 4)  # digits per directory level under /ledgers
LEAF_PREFIX = "L"
LEAF_WIDTH = 4
LEDGER_ID_MAX = 2**63 - 1  # ids are signed 64-bit, as BookKeeper's longs


def ledger_path(ledger_id: int) -> str:
    """The metadata node of ledger `ledger_id` (see the module docstring)."""
    check_ledger_id(ledger_id)
    digits = f"{ledger_id:0{LEDGER_ID_DIGITS}d}"
    bounds = list(itertools.accumulate(DIRECTORY_WIDTHS, initial=0))
    directories = [digits[start:end] for start, end in itertools.pairwise(bounds)]
    return "/".join([LEDGERS_PATH, *directories, LEAF_PREFIX + digits[bounds[-1] :]])


def iter_ledger_ids(store: MetadataStore, start: int = 0) -> Iterator[int]:
    """Ids of the ledgers with metadata, >= `start`, in increasing order,
    read one directory at a time as the iteration goes. Ledgers created or
    deleted meanwhile may or may not appear. Store errors other than a
    missing directory propagate."""
    check_ledger_id(start)
    return _walk(store, LEDGERS_PATH, 0, "", f"{start:0{LEDGER_ID_DIGITS}d}")


def _walk(store: MetadataStore, directory: str, level: int, prefix: str, start_digits: str) -> Iterator[int]:
    try:
        names = store.children(directory)
    except NoNodeError:
        return  # no ledger yet, or the directory was emptied and removed
    is_leaf_level = level == len(DIRECTORY_WIDTHS)
    name_prefix, width = (LEAF_PREFIX, LEAF_WIDTH) if is_leaf_level else ("", DIRECTORY_WIDTHS[level])
    for name in names:  # sorted by the store; equal widths sort as numbers
        digits = name[len(name_prefix) :]
        if not name.startswith(name_prefix) or not is_digits(digits, width):
            continue  # neither a ledger node nor a level directory
        candidate = prefix + digits
        # Digit strings of one length compare as their numbers: skip
        # whole subtrees below `start`.
        if candidate < start_digits[: len(candidate)]:
            continue
        if is_leaf_level:
            yield int(candidate)
        else:
            yield from _walk(store, f"{directory}/{name}", level + 1, candidate, start_digits)


def is_digits(text: str, width: int) -> bool:
    """Whether `text` is exactly `width` ASCII digits (a zero-padded number)."""
    return len(text) == width and text.isascii() and text.isdigit()


def check_ledger_id(ledger_id: object) -> None:
    if not isinstance(ledger_id, int) or isinstance(ledger_id, bool):
        raise TypeError(f"a ledger id must be an int, got {ledger_id!r}")
    if not 0 <= ledger_id <= LEDGER_ID_MAX:
        raise ValueError(f"a ledger id must be within [0, {LEDGER_ID_MAX}], got {ledger_id}")
