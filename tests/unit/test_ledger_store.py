"""Ledger metadata in the in-memory metadata store: the path layout, id
allocation (unique, increasing, never reused, rolling over to a new
generation), compare-and-set updates that re-apply a change, deletes that
prune empty directories, and listing in id order across the levels."""

from __future__ import annotations

import random
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordination.async_store import AsyncMetadataStore
from coordination.memory_store import InMemoryMetadataServer
from coordination.store import BadVersionError, NodeExistsError, NoNodeError
from ledger_client.errors import LedgerStateError, MetadataVersionError, NoSuchLedgerError
from ledger_client.ledger_store import (
    CREATE_ATTEMPTS_MAX,
    ID_GENERATOR_PATH,
    LEDGER_ID_MAX,
    LEDGERS_PATH,
    SEQUENCE_MAX,
    AsyncLedgerStore,
    LedgerStore,
    MalformedLedgerMetadataError,
    generation_path,
    ledger_id_of,
    ledger_path,
    sequence_of,
)
from ledger_client.metadata import LedgerMetadata, LedgerState
from tests.support import ledger_metadata_for

GENERATION_SPAN = 2**31  # ids per id generation


def connect(server: InMemoryMetadataServer):
    return server.connect(session_timeout_ms=10_000)


@pytest.fixture
def server():
    return InMemoryMetadataServer()


@pytest.fixture
def store(server):
    return connect(server)


@pytest.fixture
def ledgers(store):
    return LedgerStore(store)


def put_ledger(store, ledger_id: int) -> None:
    """A ledger node written directly, to place ids anywhere in the tree."""
    store.create(ledger_path(ledger_id), ledger_metadata_for(ledger_id).to_bytes(), make_parents=True)


# -- layout --------------------------------------------------------------------


def test_ledger_paths_cut_19_digits_into_levels():
    assert ledger_path(0) == "/ledgers/000/0000/0000/0000/L0000"
    assert ledger_path(123) == "/ledgers/000/0000/0000/0000/L0123"
    assert ledger_path(10_000) == "/ledgers/000/0000/0000/0001/L0000"
    assert ledger_path(LEDGER_ID_MAX) == "/ledgers/922/3372/0368/5477/L5807"
    with pytest.raises(ValueError):
        ledger_path(-1)
    with pytest.raises(ValueError):
        ledger_path(LEDGER_ID_MAX + 1)
    with pytest.raises(TypeError):
        ledger_path("123")


def test_ids_combine_generation_and_sequence():
    assert ledger_id_of(0, 5) == 5
    assert ledger_id_of(1, 0) == GENERATION_SPAN
    assert ledger_id_of(2**32 - 1, SEQUENCE_MAX) == LEDGER_ID_MAX
    with pytest.raises(ValueError):
        ledger_id_of(0, SEQUENCE_MAX + 1)
    # ZooKeeper formats an overflowed counter as a negative number.
    assert sequence_of(f"{generation_path(0)}/id--2147483648") == -(2**31)
    assert sequence_of(f"{generation_path(3)}/id-0000000042") == 42


# -- create and read -------------------------------------------------------------


def test_create_stores_the_metadata_at_its_path_and_reads_it_back(store, ledgers):
    metadata, version = ledgers.create(ledger_metadata_for)
    assert (metadata, version) == (ledger_metadata_for(metadata.ledger_id), 0)
    data, stat = store.get(ledger_path(metadata.ledger_id))
    assert LedgerMetadata.from_bytes(data) == metadata and stat.version == 0
    assert ledgers.read(metadata.ledger_id) == (metadata, 0)
    # The id node was removed at once: the generator never accumulates.
    assert store.children(generation_path(0)) == []


def test_many_creates_get_unique_increasing_ids_and_leave_no_id_nodes(store, ledgers):
    ids = [ledgers.create(ledger_metadata_for)[0].ledger_id for _ in range(300)]
    assert ids == sorted(set(ids))
    assert store.children(generation_path(0)) == []
    assert ledgers.list_ledger_ids() == ids


def test_ids_are_never_reused_after_deletes(server, ledgers):
    first = [ledgers.create(ledger_metadata_for)[0].ledger_id for _ in range(3)]
    for ledger_id in first:
        ledgers.delete(ledger_id)
    # A new client, with nothing cached, continues after them too.
    fresh = LedgerStore(connect(server))
    assert fresh.create(ledger_metadata_for)[0].ledger_id > max(first)


def test_creators_on_many_threads_and_connections_get_distinct_ids(server):
    stores = [LedgerStore(connect(server)) for _ in range(4)]
    found: list[list[int]] = [[] for _ in stores]
    start = threading.Barrier(len(stores))

    def create_many(index: int) -> None:
        start.wait()
        for _ in range(50):
            found[index].append(stores[index].create(ledger_metadata_for)[0].ledger_id)

    threads = [threading.Thread(target=create_many, args=(index,)) for index in range(len(stores))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    every_id = [ledger_id for ids in found for ledger_id in ids]
    assert len(set(every_id)) == 200
    # Each creator sees its own ids increase.
    assert all(ids == sorted(ids) for ids in found)


def test_build_must_return_metadata_for_the_allocated_id(ledgers):
    with pytest.raises(ValueError, match="must return LedgerMetadata"):
        ledgers.create(lambda ledger_id: ledger_metadata_for(ledger_id + 1))


def test_read_of_a_missing_ledger_raises_no_such_ledger(ledgers):
    with pytest.raises(NoSuchLedgerError, match="ledger 7"):
        ledgers.read(7)


@pytest.mark.parametrize(
    "data",
    [
        b"not json",
        b"[1, 2]",
        ledger_metadata_for(7).to_bytes().replace(b'"custom_metadata":{}', b'"custom_metadata":[]'),
        ledger_metadata_for(8).to_bytes(),  # another ledger's metadata
    ],
)
def test_read_of_malformed_metadata_says_where(store, ledgers, data):
    store.create(ledger_path(7), data, make_parents=True)
    with pytest.raises(MalformedLedgerMetadataError, match="/ledgers/000/0000/0000/0000/L0007"):
        ledgers.read(7)


# -- id generations --------------------------------------------------------------


def test_ids_roll_over_to_a_new_generation_past_sequence_max(store):
    ledgers = LedgerStore(store, sequence_max=3)
    ids = [ledgers.create(ledger_metadata_for)[0].ledger_id for _ in range(10)]
    assert ids == [0, 1, 2, 3] + [GENERATION_SPAN + n for n in range(4)] + [2 * GENERATION_SPAN + n for n in range(2)]
    assert store.children(ID_GENERATOR_PATH) == ["0000000000", "0000000001", "0000000002"]
    assert ledgers.list_ledger_ids() == ids


def test_a_client_behind_on_generations_moves_to_the_newest(server):
    first = LedgerStore(connect(server), sequence_max=3)
    second = LedgerStore(connect(server), sequence_max=3)
    ids = [first.create(ledger_metadata_for)[0].ledger_id for _ in range(4)]  # generation 0 is full
    # `second` finds generation 0 exhausted and opens generation 1; `first`,
    # which still uses generation 0, must join it rather than open another.
    ids.append(second.create(ledger_metadata_for)[0].ledger_id)
    ids.append(first.create(ledger_metadata_for)[0].ledger_id)
    assert ids == [0, 1, 2, 3, GENERATION_SPAN, GENERATION_SPAN + 1]
    assert server.connect(10_000).children(ID_GENERATOR_PATH) == ["0000000000", "0000000001"]


def test_a_deleted_generation_node_is_never_recreated(store, ledgers):
    assert ledgers.create(ledger_metadata_for)[0].ledger_id == 0
    store.delete(generation_path(0))
    # Recreating generation 0 would restart its counter and return id 0 again.
    assert ledgers.create(ledger_metadata_for)[0].ledger_id == GENERATION_SPAN


# -- write and update ------------------------------------------------------------


def test_write_is_a_compare_and_set(ledgers):
    metadata, version = ledgers.create(ledger_metadata_for)
    changed = metadata.with_ensemble(0, ("b4", "b2", "b3"))
    assert ledgers.write(changed, version) == 1
    with pytest.raises(BadVersionError):
        ledgers.write(metadata.with_recovery_started(), version)
    assert ledgers.read(metadata.ledger_id) == (changed, 1)
    with pytest.raises(ValueError, match="expected_version"):
        ledgers.write(changed, -1)
    ledgers.delete(metadata.ledger_id)
    with pytest.raises(NoSuchLedgerError):
        ledgers.write(changed, 1)


def test_update_reapplies_the_change_to_the_value_that_won_the_race(server, ledgers):
    metadata, _ = ledgers.create(ledger_metadata_for)
    other = LedgerStore(connect(server))
    seen: list[LedgerMetadata] = []

    def add_ensemble(current: LedgerMetadata) -> LedgerMetadata:
        seen.append(current)
        if len(seen) == 1:
            # Another client changes the ledger between our read and our write.
            other.update(metadata.ledger_id, lambda m: m.with_ensemble(5, ("b4", "b2", "b3")))
        return current.with_ensemble(10, ("b4", "b5", "b3"))

    updated, version = ledgers.update(metadata.ledger_id, add_ensemble)
    assert len(seen) == 2 and seen[1].ensemble_keys == [0, 5]
    assert updated.ensemble_keys == [0, 5, 10] and version == 2
    assert ledgers.read(metadata.ledger_id) == (updated, 2)


def test_update_gives_up_after_its_bound(server, ledgers):
    metadata, _ = ledgers.create(ledger_metadata_for)
    other = LedgerStore(connect(server))
    calls = 0

    def always_overtaken(current: LedgerMetadata) -> LedgerMetadata:
        nonlocal calls
        calls += 1
        other.update(metadata.ledger_id, lambda m: m.with_ensemble(calls, ("b4", "b2", "b3")))
        return current.with_recovery_started()

    with pytest.raises(MetadataVersionError, match="3 compare-and-set races"):
        ledgers.update(metadata.ledger_id, always_overtaken, attempts_max=3)
    assert calls == 3
    assert ledgers.read(metadata.ledger_id)[0].state is LedgerState.OPEN


def test_update_with_nothing_to_do_writes_nothing(ledgers):
    metadata, _ = ledgers.create(ledger_metadata_for)
    assert ledgers.update(metadata.ledger_id, lambda current: None) == (metadata, 0)
    assert ledgers.read(metadata.ledger_id)[1] == 0


def test_a_change_that_raises_stops_the_update(ledgers):
    metadata, _ = ledgers.create(ledger_metadata_for)
    closed, version = ledgers.update(metadata.ledger_id, lambda m: m.with_closed(-1, 0))
    with pytest.raises(LedgerStateError):
        ledgers.update(metadata.ledger_id, lambda m: m.with_recovery_started())
    assert ledgers.read(metadata.ledger_id) == (closed, version)
    with pytest.raises(ValueError, match="change must return"):
        ledgers.update(metadata.ledger_id, lambda m: ledger_metadata_for(m.ledger_id + 1))
    with pytest.raises(NoSuchLedgerError):
        ledgers.update(99, lambda m: m)


# -- delete ----------------------------------------------------------------------


def test_delete_removes_the_ledger_and_the_directories_it_empties(store, ledgers):
    kept, _ = ledgers.create(ledger_metadata_for)
    gone, _ = ledgers.create(ledger_metadata_for)
    put_ledger(store, 12_345_678)  # alone in its directories
    ledgers.delete(gone.ledger_id)
    with pytest.raises(NoSuchLedgerError):
        ledgers.read(gone.ledger_id)
    assert ledgers.read(kept.ledger_id)[0] == kept  # its directory stays
    ledgers.delete(12_345_678)
    assert store.children(LEDGERS_PATH) == ["000"]
    assert store.children("/ledgers/000/0000") == ["0000"]
    ledgers.delete(kept.ledger_id)
    assert store.children(LEDGERS_PATH) == []
    with pytest.raises(NoSuchLedgerError):
        ledgers.delete(kept.ledger_id)


def test_delete_with_a_stale_version_keeps_the_ledger(ledgers):
    metadata, _ = ledgers.create(ledger_metadata_for)
    ledgers.update(metadata.ledger_id, lambda m: m.with_recovery_started())
    with pytest.raises(BadVersionError):
        ledgers.delete(metadata.ledger_id, expected_version=0)
    ledgers.delete(metadata.ledger_id, expected_version=1)
    assert ledgers.list_ledger_ids() == []


class StoreWithLostAnswers:
    """The in-memory store, but some creates under /ledgers fail the way a
    ZooKeeper client can: `vanishing_parents` times with NoNodeError (a
    concurrent delete removed an empty directory the create had just made),
    or with NodeExistsError after creating the node (a retry of a create
    whose first answer was lost)."""

    def __init__(self, store, *, vanishing_parents: int = 0, answer_lost: bool = False) -> None:
        self._store = store
        self.vanishing_parents = vanishing_parents
        self.answer_lost = answer_lost

    def __getattr__(self, name):
        return getattr(self._store, name)

    def create(self, path, data=b"", **options):
        if path.startswith(LEDGERS_PATH) and self.vanishing_parents:
            self.vanishing_parents -= 1
            raise NoNodeError(f"parent of {path} does not exist")
        created = self._store.create(path, data, **options)
        if path.startswith(LEDGERS_PATH) and self.answer_lost:
            raise NodeExistsError(f"{path} already exists")
        return created


def test_create_tries_again_when_a_directory_vanishes_under_it(store):
    ledgers = LedgerStore(StoreWithLostAnswers(store, vanishing_parents=CREATE_ATTEMPTS_MAX - 1))
    metadata, version = ledgers.create(ledger_metadata_for)
    assert ledgers.read(metadata.ledger_id) == (metadata, version)
    ledgers = LedgerStore(StoreWithLostAnswers(store, vanishing_parents=CREATE_ATTEMPTS_MAX))
    with pytest.raises(NoNodeError):
        ledgers.create(ledger_metadata_for)


def test_create_accepts_its_own_node_after_a_lost_answer(store):
    ledgers = LedgerStore(StoreWithLostAnswers(store, answer_lost=True))
    metadata, version = ledgers.create(ledger_metadata_for)
    assert ledgers.read(metadata.ledger_id) == (metadata, version)


def test_create_over_another_ledgers_node_is_a_broken_invariant(store, ledgers):
    store.create(ledger_path(0), ledger_metadata_for(0).with_recovery_started().to_bytes(), make_parents=True)
    with pytest.raises(AssertionError, match="handed out twice"):
        ledgers.create(ledger_metadata_for)


# -- listing ---------------------------------------------------------------------

SPREAD_IDS = [0, 1, 9_999, 10_000, 123_456_789, GENERATION_SPAN, GENERATION_SPAN + 3, 10**15 + 7, LEDGER_ID_MAX]


def test_listing_walks_every_level_in_id_order(store, ledgers):
    for ledger_id in random.Random(7).sample(SPREAD_IDS, len(SPREAD_IDS)):
        put_ledger(store, ledger_id)
    # Nodes that are not ledgers or level directories are skipped.
    store.create("/ledgers/available", make_parents=True)
    store.create("/ledgers/000/0000/0000/0000/L12", make_parents=True)
    store.create("/ledgers/000/0000/0000/0000/X0002", make_parents=True)
    assert ledgers.list_ledger_ids() == SPREAD_IDS
    assert SPREAD_IDS == sorted(SPREAD_IDS)
    assert ledgers.list_ledger_ids(start=2) == SPREAD_IDS[2:]
    assert ledgers.list_ledger_ids(start=10_000, limit=2) == [10_000, 123_456_789]
    assert ledgers.list_ledger_ids(start=LEDGER_ID_MAX) == [LEDGER_ID_MAX]
    assert ledgers.list_ledger_ids(limit=0) == []
    iterator = ledgers.iter_ledger_ids(start=10_001)
    assert next(iterator) == 123_456_789


def test_listing_an_empty_cluster_finds_nothing(ledgers):
    assert ledgers.list_ledger_ids() == []
    with pytest.raises(ValueError, match="limit"):
        ledgers.list_ledger_ids(limit=-1)


ledger_ids = st.one_of(
    st.integers(0, 30_000),
    st.integers(0, 10**12),
    st.integers(0, LEDGER_ID_MAX),
)


@settings(max_examples=60, deadline=None)
@given(ids=st.sets(ledger_ids, max_size=25), start=ledger_ids, limit=st.none() | st.integers(0, 30))
def test_listing_matches_the_sorted_ids_from_any_start(ids, start, limit):
    store = connect(InMemoryMetadataServer())
    for ledger_id in ids:
        put_ledger(store, ledger_id)
    expected = sorted(ledger_id for ledger_id in ids if ledger_id >= start)
    assert LedgerStore(store).list_ledger_ids(start, limit) == expected[:limit]


# -- trio ------------------------------------------------------------------------


async def test_the_trio_face_runs_the_same_calls(store):
    ledgers = AsyncLedgerStore(AsyncMetadataStore(store), threads_max=2)
    metadata, version = await ledgers.create(ledger_metadata_for)
    assert await ledgers.read(metadata.ledger_id) == (metadata, version)
    changed = metadata.with_ensemble(0, ("b4", "b2", "b3"))
    assert await ledgers.write(changed, version) == 1
    recovering, version = await ledgers.update(metadata.ledger_id, lambda m: m.with_recovery_started())
    assert recovering.state is LedgerState.IN_RECOVERY and version == 2
    assert await ledgers.list_ledger_ids() == [metadata.ledger_id]
    await ledgers.delete(metadata.ledger_id, version)
    with pytest.raises(NoSuchLedgerError):
        await ledgers.read(metadata.ledger_id)
