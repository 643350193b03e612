"""Ledger metadata in the metadata store: one versioned node per ledger,
ledger ids from ZooKeeper sequential nodes, compare-and-set updates, and
listing in id order. `LedgerStore` is synchronous; `AsyncLedgerStore` runs
the same calls in worker threads for trio code.

Layout, inside the cluster's chroot:

- `/ledgers/DDD/DDDD/DDDD/DDDD/LDDDD`: ledger metadata (JSON, see
  `ledger_client.metadata`). The path layout and the listing of ledger ids
  are defined once, in `coordination.cluster_layout`, because bookies read
  them too (their garbage collection looks for deleted ledgers).
- `/idgen/ledgers/GGGGGGGGGG`: one id generator node per generation. An id
  is taken by creating a sequential child `id-NNNNNNNNNN` and deleting it at
  once; the id is `generation * 2**31 + N`. ZooKeeper's sequence counter is
  a signed 32-bit number per parent, so when it passes `sequence_max`
  (2**31 - 1) the next generation node is created and used, like
  BookKeeper's LongZkLedgerIdGenerator. A generation node is never created
  twice (that would restart its counter and hand out its ids again), so ids
  are never reused, even after deletes; never delete `/idgen`.
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
from typing import Any, Callable, Iterator, TypeVar

import trio

from coordination.async_store import AsyncMetadataStore
from coordination.cluster_layout import LEDGER_ID_MAX, LEDGERS_PATH, is_digits, iter_ledger_ids, ledger_path
from coordination.store import ANY_VERSION, BadVersionError, MetadataError, MetadataStore, NodeExistsError
from coordination.store import NoNodeError, NotEmptyError, parent_of
from ledger_client.errors import (
    LedgerIdAllocationError,
    MalformedLedgerMetadataError,
    MetadataVersionError,
    NoSuchLedgerError,
)
from ledger_client.metadata import LedgerMetadata

_log = logging.getLogger(__name__)
T = TypeVar("T")

ID_GENERATOR_PATH = "/idgen/ledgers"
SEQUENCE_PREFIX = "id-"
GENERATION_WIDTH = 10
SEQUENCE_BITS = 31
SEQUENCE_MAX = 2**SEQUENCE_BITS - 1  # ZooKeeper's counter is a signed 32-bit int
GENERATION_MAX = 2**32 - 1  # keeps every id below 2**63, a signed 64-bit long

# Bounds on the retry loops, each for a different reason (see where used).
CAS_ATTEMPTS_MAX = 10
CREATE_ATTEMPTS_MAX = 5
ID_ATTEMPTS_MAX = 8


def generation_path(generation: int) -> str:
    return f"{ID_GENERATOR_PATH}/{generation:0{GENERATION_WIDTH}d}"


def ledger_id_of(generation: int, sequence: int) -> int:
    """The ledger id of sequence number `sequence` in id generation `generation`."""
    if not 0 <= generation <= GENERATION_MAX or not 0 <= sequence <= SEQUENCE_MAX:
        raise ValueError(f"no ledger id for generation {generation}, sequence {sequence}")
    return (generation << SEQUENCE_BITS) | sequence


def sequence_of(sequential_path: str) -> int:
    """The number ZooKeeper appended to a sequential node; negative once its
    32-bit counter overflowed."""
    name = sequential_path.rsplit("/", 1)[1]
    assert name.startswith(SEQUENCE_PREFIX), f"unexpected id generator node {sequential_path}"
    return int(name[len(SEQUENCE_PREFIX) :])


class LedgerStore:
    """Ledger metadata over a synchronous `MetadataStore`. Thread-safe: the
    only state of its own is the id generation in use.

    `sequence_max` (tests lower it to force a rollover) is the last sequence
    number used in a generation. `cas_attempts_max` bounds `update`'s
    read-change-write rounds.
    """

    def __init__(
        self,
        store: MetadataStore,
        *,
        sequence_max: int = SEQUENCE_MAX,
        cas_attempts_max: int = CAS_ATTEMPTS_MAX,
    ) -> None:
        if not 0 <= sequence_max <= SEQUENCE_MAX:
            raise ValueError(f"sequence_max must be within [0, {SEQUENCE_MAX}], got {sequence_max!r}")
        _check_attempts(cas_attempts_max)
        self.store = store
        self.sequence_max = sequence_max
        self.cas_attempts_max = cas_attempts_max
        self._generation: int | None = None
        self._generation_lock = threading.Lock()

    # -- ids -------------------------------------------------------------------

    def allocate_ledger_id(self) -> int:
        """A ledger id no other call, in any process, ever gets."""
        generation = self._generation if self._generation is not None else self._newest_generation()
        for _ in range(ID_ATTEMPTS_MAX):
            try:
                created = self.store.create(f"{generation_path(generation)}/{SEQUENCE_PREFIX}", sequential=True)
            except NoNodeError:
                # The generation node was deleted by hand. Recreating it would
                # restart its counter at 0 and hand out its ids again.
                generation = self._next_generation(generation)
                continue
            self._remove_id_node(created)
            sequence = sequence_of(created)
            if 0 <= sequence <= self.sequence_max:
                return ledger_id_of(generation, sequence)
            # The counter only grows, so every later number in this
            # generation is past the bound too: move on for good.
            generation = self._next_generation(generation)
        # Each try without an id moves to a newer generation, so getting here
        # takes generations exhausted faster than one create each.
        raise LedgerIdAllocationError(f"no ledger id after {ID_ATTEMPTS_MAX} tries under {ID_GENERATOR_PATH}")

    def _generations(self) -> list[int]:
        try:
            names = self.store.children(ID_GENERATOR_PATH)
        except NoNodeError:
            return []
        return sorted(int(name) for name in names if is_digits(name, GENERATION_WIDTH))

    def _newest_generation(self) -> int:
        generations = self._generations()
        if generations:
            return self._use_generation(generations[-1])
        return self._create_generation(0)

    def _next_generation(self, exhausted: int) -> int:
        """The generation after `exhausted`: one that another client already
        created, or a new one."""
        newest = max(self._generations(), default=exhausted)
        if newest > exhausted:
            return self._use_generation(newest)
        if exhausted >= GENERATION_MAX:
            raise LedgerIdAllocationError(f"every ledger id up to {LEDGER_ID_MAX} is used")
        return self._create_generation(exhausted + 1)

    def _create_generation(self, generation: int) -> int:
        try:
            self.store.create(generation_path(generation), make_parents=True)
        except NodeExistsError:
            pass  # another client rolled over at the same time: share its node
        return self._use_generation(generation)

    def _use_generation(self, generation: int) -> int:
        with self._generation_lock:
            # Threads may finish out of order; never go back to an older one.
            self._generation = max(generation, self._generation or 0)
            return self._generation

    def _remove_id_node(self, path: str) -> None:
        # The id is ours once the node was created; the node itself only
        # costs space, so a failed delete must not fail the allocation.
        try:
            self.store.delete(path)
        except MetadataError as error:
            _log.warning("could not delete ledger id node %s: %s", path, error)

    # -- one ledger ------------------------------------------------------------

    def create(self, build: Callable[[int], LedgerMetadata]) -> tuple[LedgerMetadata, int]:
        """Allocate an id, build the metadata for it, and store it; return the
        metadata and its version."""
        ledger_id = self.allocate_ledger_id()
        metadata = build(ledger_id)
        if not isinstance(metadata, LedgerMetadata) or metadata.ledger_id != ledger_id:
            raise ValueError(f"build({ledger_id}) must return LedgerMetadata for ledger {ledger_id}, got {metadata!r}")
        data = _serialize(metadata)
        path = ledger_path(ledger_id)
        # `delete` removes empty directories; one may vanish between the
        # store making the parents and creating the leaf (kazoo retries that
        # itself, the store contract does not promise it), so try again.
        for _ in range(CREATE_ATTEMPTS_MAX - 1):
            try:
                return metadata, self._create_node(path, data)
            except NoNodeError:
                continue
        return metadata, self._create_node(path, data)

    def _create_node(self, path: str, data: bytes) -> int:
        try:
            self.store.create(path, data, make_parents=True)
            return 0  # a new node's version
        except NodeExistsError:
            # Only our own earlier try can have made it (the id is ours): the
            # store retried a create whose first answer was lost.
            stored, stat = self.store.get(path)
            if stored != data:
                raise AssertionError(f"a ledger id was handed out twice: {path} holds other metadata") from None
            return stat.version

    def read(self, ledger_id: int) -> tuple[LedgerMetadata, int]:
        """The ledger's metadata and version. Raises NoSuchLedgerError, or
        MalformedLedgerMetadataError for data that is not its metadata."""
        path = ledger_path(ledger_id)
        try:
            data, stat = self.store.get(path)
        except NoNodeError:
            raise NoSuchLedgerError(f"ledger {ledger_id} does not exist") from None
        try:
            metadata = LedgerMetadata.from_bytes(data)
        except (ValueError, AttributeError) as error:
            # AttributeError: from_bytes lets some wrong JSON types through.
            raise MalformedLedgerMetadataError(f"{path}: {error}") from None
        if metadata.ledger_id != ledger_id:
            raise MalformedLedgerMetadataError(f"{path} holds the metadata of ledger {metadata.ledger_id}")
        return metadata, stat.version

    def write(self, metadata: LedgerMetadata, expected_version: int) -> int:
        """Compare-and-set: store `metadata` if the node is still at
        `expected_version`; return the new version. Raises the store's
        BadVersionError when another writer got there first, and
        NoSuchLedgerError when the ledger was deleted."""
        if not isinstance(expected_version, int) or expected_version < 0:
            raise ValueError(f"expected_version must be a version (>= 0), got {expected_version!r}")
        data = _serialize(metadata)
        try:
            return self.store.set(ledger_path(metadata.ledger_id), data, expected_version).version
        except NoNodeError:
            raise NoSuchLedgerError(f"ledger {metadata.ledger_id} does not exist") from None

    def update(
        self,
        ledger_id: int,
        change: Callable[[LedgerMetadata], LedgerMetadata | None],
        *,
        attempts_max: int | None = None,
    ) -> tuple[LedgerMetadata, int]:
        """Read, apply `change`, compare-and-set; on a conflict read the newer
        value and apply `change` to it again. `change` returns the new
        metadata, or None for "nothing to do" (the current value is returned);
        it may raise (LedgerStateError, say) to stop, and must be pure: it
        runs once per attempt. Raises MetadataVersionError after
        `attempts_max` (default `cas_attempts_max`) lost races."""
        attempts_max = self.cas_attempts_max if attempts_max is None else attempts_max
        _check_attempts(attempts_max)
        # No backoff between attempts: each conflict means another writer
        # succeeded, so the system as a whole made progress.
        for _ in range(attempts_max):
            current, version = self.read(ledger_id)
            changed = change(current)
            if changed is None:
                return current, version
            if not isinstance(changed, LedgerMetadata) or changed.ledger_id != ledger_id:
                raise ValueError(f"change must return LedgerMetadata of ledger {ledger_id} or None, got {changed!r}")
            try:
                return changed, self.write(changed, version)
            except BadVersionError:
                continue
        raise MetadataVersionError(f"ledger {ledger_id}: lost {attempts_max} compare-and-set races in a row")

    def delete(self, ledger_id: int, expected_version: int = ANY_VERSION) -> None:
        """Remove the ledger's metadata (if still at `expected_version`, when
        given), then the directories it leaves empty. Raises
        NoSuchLedgerError, or the store's BadVersionError."""
        path = ledger_path(ledger_id)
        try:
            self.store.delete(path, expected_version)
        except NoNodeError:
            raise NoSuchLedgerError(f"ledger {ledger_id} does not exist") from None
        directory = parent_of(path)
        while directory != LEDGERS_PATH:
            try:
                self.store.delete(directory)
            except (NotEmptyError, NoNodeError):
                return  # still in use, or another deleter got here first
            except MetadataError as error:
                # The ledger is gone, which is what the caller asked for; an
                # empty directory left behind costs one node.
                _log.warning("could not remove empty ledger directory %s: %s", directory, error)
                return
            directory = parent_of(directory)

    # -- all ledgers -----------------------------------------------------------

    def iter_ledger_ids(self, start: int = 0) -> Iterator[int]:
        """Ledger ids >= `start`, in increasing order, read one directory at a
        time as the iteration goes. Ledgers created or deleted meanwhile may
        or may not appear."""
        return iter_ledger_ids(self.store, start)

    def list_ledger_ids(self, start: int = 0, limit: int | None = None) -> list[int]:
        """At most `limit` (None: all) ledger ids >= `start`, in increasing order."""
        if limit is not None and (not isinstance(limit, int) or limit < 0):
            raise ValueError(f"limit must be None or a non-negative int, got {limit!r}")
        return list(itertools.islice(self.iter_ledger_ids(start), limit))


class AsyncLedgerStore:
    """`LedgerStore`'s calls for trio code, over the sync store inside an
    `AsyncMetadataStore`: each call runs in a worker thread (at most
    `threads_max` at once), so the logic exists once. A cancelled call is
    abandoned and may still take effect, as with `AsyncMetadataStore`; a
    `create` abandoned that way leaves a ledger nobody was told about."""

    def __init__(self, metadata: AsyncMetadataStore, *, threads_max: int = 4, **options: Any) -> None:
        if not isinstance(threads_max, int) or threads_max < 1:
            raise ValueError(f"threads_max must be a positive int, got {threads_max!r}")
        self.ledgers = LedgerStore(metadata.store, **options)
        self._limiter = trio.CapacityLimiter(threads_max)

    async def _run(self, call: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        return await trio.to_thread.run_sync(
            functools.partial(call, *args, **kwargs), limiter=self._limiter, abandon_on_cancel=True
        )

    async def create(self, build: Callable[[int], LedgerMetadata]) -> tuple[LedgerMetadata, int]:
        return await self._run(self.ledgers.create, build)

    async def read(self, ledger_id: int) -> tuple[LedgerMetadata, int]:
        return await self._run(self.ledgers.read, ledger_id)

    async def write(self, metadata: LedgerMetadata, expected_version: int) -> int:
        return await self._run(self.ledgers.write, metadata, expected_version)

    async def update(
        self, ledger_id: int, change: Callable[[LedgerMetadata], LedgerMetadata | None], *, attempts_max: int | None = None
    ) -> tuple[LedgerMetadata, int]:
        """As `LedgerStore.update`; `change` runs in the worker thread."""
        return await self._run(self.ledgers.update, ledger_id, change, attempts_max=attempts_max)

    async def delete(self, ledger_id: int, expected_version: int = ANY_VERSION) -> None:
        await self._run(self.ledgers.delete, ledger_id, expected_version)

    async def list_ledger_ids(self, start: int = 0, limit: int | None = None) -> list[int]:
        """As `LedgerStore.list_ledger_ids`, in one worker thread: page with
        `start` and `limit` through a large cluster."""
        return await self._run(self.ledgers.list_ledger_ids, start, limit)


def _serialize(metadata: LedgerMetadata) -> bytes:
    data = metadata.to_bytes()
    # Check before writing that readers will get back exactly this value.
    assert LedgerMetadata.from_bytes(data) == metadata, f"ledger {metadata.ledger_id} metadata does not round-trip"
    return data


def _check_attempts(attempts_max: object) -> None:
    if not isinstance(attempts_max, int) or isinstance(attempts_max, bool) or attempts_max < 1:
        raise ValueError(f"attempts bounds must be positive ints, got {attempts_max!r}")


__all__ = [
    "AsyncLedgerStore", "CAS_ATTEMPTS_MAX", "ID_GENERATOR_PATH", "LEDGERS_PATH", "LedgerIdAllocationError",
    "LedgerStore", "MalformedLedgerMetadataError", "SEQUENCE_MAX", "generation_path", "ledger_id_of",
    "ledger_path", "sequence_of",
]
