"""The behaviour every MetadataStore shares, as a test class to inherit.

A subclass named `Test...` provides the fixtures `store` and `other_store` (two
sessions on the same tree and root) and `expire` (a function that expires a
store's session and returns once that store has seen LOST). Watches may fire
on another thread (kazoo), so the tests wait for them with a deadline.
"""

from __future__ import annotations

import threading
import uuid

import pytest

from coordination.store import (
    ANY_VERSION,
    BadVersionError,
    EventType,
    MetadataStore,
    NoChildrenForEphemeralsError,
    NodeExistsError,
    NoNodeError,
    NotEmptyError,
    SessionState,
    StoreClosedError,
    WatchEvent,
)
from tests.support import wait_until

DEADLINE_S = 15.0


class Recorder:
    """A watcher or session listener that remembers what it was told."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: list = []

    def __call__(self, item: object) -> None:
        with self._lock:
            self._items.append(item)

    @property
    def items(self) -> list:
        with self._lock:
            return list(self._items)


def flush_watches(store: MetadataStore) -> None:
    """Return once every watch event caused by earlier changes has been
    delivered to `store`'s watchers. ZooKeeper sends a session its events in
    transaction order and kazoo runs them on one thread in that order, so once
    the watch on a fresh marker node fired, all earlier ones have run."""
    marker = f"/flush/{uuid.uuid4().hex}"
    seen = Recorder()
    store.exists(marker, watch=seen)
    store.create(marker, make_parents=True)
    wait_until(lambda: seen.items, deadline_s=DEADLINE_S, what=f"the watch on marker {marker}")
    store.delete(marker)


def wait_for_events(recorder: Recorder, count: int, what: str) -> list:
    return wait_until(
        lambda: recorder.items if len(recorder.items) >= count else None, deadline_s=DEADLINE_S, what=what
    )


def is_subsequence(wanted: list, items: list) -> bool:
    iterator = iter(items)
    return all(any(item == w for item in iterator) for w in wanted)


class MetadataStoreContract:
    # -- create / get ------------------------------------------------------

    def test_create_then_get_returns_data_and_fresh_stat(self, store):
        assert store.create("/node", b"hello") == "/node"
        data, stat = store.get("/node")
        assert data == b"hello"
        assert stat.version == 0
        assert stat.children_version == 0
        assert stat.children_count == 0
        assert stat.ephemeral_owner == 0
        assert stat.created_txid == stat.modified_txid

    def test_create_of_an_existing_node_raises(self, store):
        store.create("/node", b"one")
        with pytest.raises(NodeExistsError):
            store.create("/node", b"two")
        assert store.get("/node")[0] == b"one"

    def test_root_exists_and_cannot_be_created_or_deleted(self, store):
        assert store.exists("/") is not None
        with pytest.raises(NodeExistsError):
            store.create("/")
        with pytest.raises(ValueError):
            store.delete("/")

    def test_create_without_parent_raises_unless_make_parents(self, store):
        with pytest.raises(NoNodeError):
            store.create("/a/b/c", b"x")
        assert store.create("/a/b/c", b"x", make_parents=True) == "/a/b/c"
        for parent in ("/a", "/a/b"):
            data, stat = store.get(parent)
            assert data == b""
            assert stat.ephemeral_owner == 0
        assert store.get("/a/b/c")[0] == b"x"

    def test_missing_node_errors(self, store):
        with pytest.raises(NoNodeError):
            store.get("/missing")
        assert store.exists("/missing") is None
        with pytest.raises(NoNodeError):
            store.children("/missing")
        with pytest.raises(NoNodeError):
            store.set("/missing", b"x")
        with pytest.raises(NoNodeError):
            store.delete("/missing")
        with pytest.raises(NoNodeError):
            store.delete("/missing", recursive=True)

    def test_caller_mistakes_raise_value_or_type_errors(self, store):
        for bad_path in ("relative", "/trailing/", "/double//slash", "/dot/./x", ""):
            with pytest.raises(ValueError):
                store.create(bad_path)
        with pytest.raises(TypeError):
            store.create("/text", "not bytes")
        store.create("/node")
        with pytest.raises(TypeError):
            store.set("/node", "not bytes")

    def test_created_txid_orders_creations_across_the_store(self, store, other_store):
        store.create("/first")
        other_store.create("/second")
        store.create("/first/child")
        txids = [store.exists(path).created_txid for path in ("/first", "/second", "/first/child")]
        assert txids == sorted(txids)
        assert len(set(txids)) == 3

    def test_ensure_path_creates_missing_nodes_and_is_idempotent(self, store):
        store.ensure_path("/x/y/z")
        store.ensure_path("/x/y/z")
        assert store.exists("/x/y/z") is not None

    # -- set / versions ----------------------------------------------------

    def test_set_bumps_version_and_modified_txid(self, store):
        store.create("/node", b"v0")
        created = store.exists("/node")
        stat = store.set("/node", b"v1")
        assert stat.version == 1
        assert stat.modified_txid > created.modified_txid
        assert stat.created_txid == created.created_txid
        assert store.get("/node") == (b"v1", stat)

    def test_conditional_set_succeeds_only_at_the_named_version(self, store, other_store):
        store.create("/node", b"v0")
        assert store.set("/node", b"v1", expected_version=0).version == 1
        with pytest.raises(BadVersionError):
            other_store.set("/node", b"stale", expected_version=0)
        assert store.get("/node")[0] == b"v1"
        assert other_store.set("/node", b"v2", expected_version=1).version == 2
        assert store.set("/node", b"v3", expected_version=ANY_VERSION).version == 3

    def test_conditional_delete_succeeds_only_at_the_named_version(self, store):
        store.create("/node")
        store.set("/node", b"v1")
        with pytest.raises(BadVersionError):
            store.delete("/node", expected_version=0)
        assert store.exists("/node") is not None
        store.delete("/node", expected_version=1)
        assert store.exists("/node") is None

    # -- children ----------------------------------------------------------

    def test_children_are_sorted_names_and_bump_children_version(self, store):
        store.create("/parent")
        for name in ("b", "c", "a"):
            store.create(f"/parent/{name}")
        assert store.children("/parent") == ["a", "b", "c"]
        stat = store.exists("/parent")
        assert (stat.children_version, stat.children_count, stat.version) == (3, 3, 0)
        store.delete("/parent/b")
        stat = store.exists("/parent")
        assert (stat.children_version, stat.children_count) == (4, 2)
        assert store.children("/parent") == ["a", "c"]

    def test_delete_of_a_node_with_children_needs_recursive(self, store):
        store.create("/tree/a/deep", make_parents=True)
        store.create("/tree/b", make_parents=True)
        with pytest.raises(NotEmptyError):
            store.delete("/tree")
        store.delete("/tree", recursive=True)
        assert store.exists("/tree") is None
        assert store.exists("/tree/a/deep") is None

    def test_recursive_delete_checks_the_version_before_deleting_anything(self, store):
        store.create("/tree/child", make_parents=True)
        store.set("/tree", b"v1")
        with pytest.raises(BadVersionError):
            store.delete("/tree", expected_version=0, recursive=True)
        assert store.exists("/tree/child") is not None
        store.delete("/tree", expected_version=1, recursive=True)
        assert store.exists("/tree") is None

    # -- sequential nodes --------------------------------------------------

    def test_sequential_names_have_ten_digits_and_follow_creation_order(self, store, other_store):
        store.create("/queue")
        created = [
            store.create("/queue/job-", b"1", sequential=True),
            other_store.create("/queue/job-", b"2", sequential=True),
            store.create("/queue/job-", b"3", sequential=True),
        ]
        assert created == ["/queue/job-0000000000", "/queue/job-0000000001", "/queue/job-0000000002"]
        assert store.children("/queue") == [path.rsplit("/", 1)[1] for path in created]
        assert store.get("/queue/job-0000000001")[0] == b"2"

    def test_sequence_numbers_count_child_creations_and_are_never_reused(self, store):
        store.create("/queue")
        store.create("/queue/plain")  # a plain child takes a number too
        first = store.create("/queue/job-", sequential=True)
        assert first == "/queue/job-0000000001"
        store.delete(first)
        store.delete("/queue/plain")
        # Deletions do not advance the counter, and numbers are not reused.
        assert store.create("/queue/job-", sequential=True) == "/queue/job-0000000002"

    def test_sequential_create_under_a_trailing_slash_names_by_number_only(self, store):
        assert store.create("/numbers/", sequential=True, make_parents=True) == "/numbers/0000000000"
        assert store.create("/numbers/", sequential=True) == "/numbers/0000000001"

    # -- ephemeral nodes ---------------------------------------------------

    def test_ephemeral_node_belongs_to_the_session_and_goes_with_close(self, store, other_store):
        store.create("/member", b"me", ephemeral=True)
        stat = other_store.exists("/member")
        assert stat is not None
        assert stat.ephemeral_owner == store.session_id != 0
        assert store.session_id != other_store.session_id
        store.close()
        wait_until(lambda: other_store.exists("/member") is None, deadline_s=DEADLINE_S, what="ephemeral node to go")

    def test_ephemeral_node_cannot_have_children(self, store):
        store.create("/member", ephemeral=True)
        with pytest.raises(NoChildrenForEphemeralsError):
            store.create("/member/child")

    def test_ephemeral_sequential_nodes(self, store, other_store):
        store.create("/election")
        path = store.create("/election/candidate-", b"a", ephemeral=True, sequential=True)
        assert path == "/election/candidate-0000000000"
        assert other_store.exists(path).ephemeral_owner == store.session_id

    def test_closed_store_refuses_calls(self, store):
        store.close()
        store.close()  # closing twice is fine
        with pytest.raises(StoreClosedError):
            store.create("/node")
        with pytest.raises(StoreClosedError):
            store.get("/node")

    # -- sessions ----------------------------------------------------------

    def test_expiry_removes_ephemeral_nodes_and_a_new_session_starts(self, store, other_store, expire):
        states = Recorder()
        store.add_session_listener(states)
        store.create("/member", ephemeral=True)
        store.create("/durable", b"kept")
        old_session_id = store.session_id

        expire(store)

        wait_until(
            lambda: other_store.exists("/member") is None, deadline_s=DEADLINE_S, what="ephemeral node to go on expiry"
        )
        wait_until(
            lambda: store.session_id not in (0, old_session_id), deadline_s=DEADLINE_S, what="a new session"
        )
        wait_until(
            lambda: is_subsequence([SessionState.LOST, SessionState.CONNECTED], states.items),
            deadline_s=DEADLINE_S,
            what="LOST then CONNECTED",
        )
        assert store.get("/durable")[0] == b"kept"
        store.create("/member", ephemeral=True)
        assert other_store.exists("/member").ephemeral_owner == store.session_id

    def test_watches_of_an_expired_session_fire_once_with_session(self, store, other_store, expire):
        store.create("/watched")
        events = Recorder()
        store.get("/watched", watch=events)
        old_session_id = store.session_id

        expire(store)

        assert wait_for_events(events, 1, "the dropped watch") == [WatchEvent(EventType.SESSION, "/watched")]
        wait_until(lambda: store.session_id not in (0, old_session_id), deadline_s=DEADLINE_S, what="a new session")
        other_store.set("/watched", b"changed")
        flush_watches(store)
        assert len(events.items) == 1

    # -- watches -----------------------------------------------------------

    def test_get_watch_fires_changed_exactly_once(self, store, other_store):
        store.create("/node", b"v0")
        events = Recorder()
        store.get("/node", watch=events)
        other_store.set("/node", b"v1")
        other_store.set("/node", b"v2")
        assert wait_for_events(events, 1, "CHANGED") == [WatchEvent(EventType.CHANGED, "/node")]
        flush_watches(store)
        assert len(events.items) == 1

    def test_get_watch_fires_deleted(self, store, other_store):
        store.create("/node")
        events = Recorder()
        other_store.get("/node", watch=events)
        store.delete("/node")
        assert wait_for_events(events, 1, "DELETED") == [WatchEvent(EventType.DELETED, "/node")]

    def test_exists_watch_on_a_missing_node_fires_created(self, store, other_store):
        events = Recorder()
        assert store.exists("/later", watch=events) is None
        other_store.create("/later")
        other_store.delete("/later")
        assert wait_for_events(events, 1, "CREATED") == [WatchEvent(EventType.CREATED, "/later")]
        flush_watches(store)
        assert len(events.items) == 1

    def test_exists_watch_on_an_existing_node_fires_changed(self, store, other_store):
        store.create("/node")
        events = Recorder()
        assert store.exists("/node", watch=events) is not None
        other_store.set("/node", b"x")
        assert wait_for_events(events, 1, "CHANGED") == [WatchEvent(EventType.CHANGED, "/node")]

    def test_failed_get_leaves_no_watch(self, store, other_store):
        events = Recorder()
        with pytest.raises(NoNodeError):
            store.get("/missing", watch=events)
        other_store.create("/missing")
        flush_watches(store)
        assert events.items == []

    def test_a_watcher_set_twice_on_a_node_fires_once(self, store, other_store):
        store.create("/node")
        events = Recorder()
        store.get("/node", watch=events)
        store.exists("/node", watch=events)
        other_store.set("/node", b"x")
        wait_for_events(events, 1, "CHANGED")
        flush_watches(store)
        assert events.items == [WatchEvent(EventType.CHANGED, "/node")]

    def test_children_watch_fires_child_once_on_create_and_delete(self, store, other_store):
        store.create("/parent")
        created = Recorder()
        assert store.children("/parent", watch=created) == []
        other_store.create("/parent/a")
        other_store.create("/parent/b")
        assert wait_for_events(created, 1, "CHILD on create") == [WatchEvent(EventType.CHILD, "/parent")]
        deleted = Recorder()
        assert store.children("/parent", watch=deleted) == ["a", "b"]
        other_store.delete("/parent/a")
        assert wait_for_events(deleted, 1, "CHILD on delete") == [WatchEvent(EventType.CHILD, "/parent")]
        flush_watches(store)
        assert len(created.items) == 1 and len(deleted.items) == 1

    def test_children_watch_ignores_data_changes_and_fires_deleted_with_the_node(self, store, other_store):
        store.create("/parent")
        events = Recorder()
        store.children("/parent", watch=events)
        other_store.set("/parent", b"data")
        flush_watches(store)
        assert events.items == []
        other_store.delete("/parent")
        assert wait_for_events(events, 1, "DELETED") == [WatchEvent(EventType.DELETED, "/parent")]

    def test_recursive_delete_fires_the_watches_of_every_node(self, store, other_store):
        store.create("/tree/leaf", make_parents=True)
        leaf_events, tree_events = Recorder(), Recorder()
        other_store.exists("/tree/leaf", watch=leaf_events)
        other_store.get("/tree", watch=tree_events)
        store.delete("/tree", recursive=True)
        assert wait_for_events(leaf_events, 1, "leaf DELETED") == [WatchEvent(EventType.DELETED, "/tree/leaf")]
        assert wait_for_events(tree_events, 1, "tree DELETED") == [WatchEvent(EventType.DELETED, "/tree")]
