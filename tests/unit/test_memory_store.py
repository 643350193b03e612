"""The in-memory metadata store: the shared contract, then what only it offers
(a clock moved by hand, suspended connections, no auto-reconnect, chroots)."""

from __future__ import annotations

import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from coordination.async_store import AsyncMetadataStore
from coordination.memory_store import InMemoryMetadataServer
from coordination.store import (
    ConnectionLossError,
    EventType,
    NoNodeError,
    SessionExpiredError,
    SessionState,
    StoreClosedError,
    WatchEvent,
)
from tests.metadata_store_contract import MetadataStoreContract, Recorder

SESSION_TIMEOUT_MS = 4_000


@pytest.fixture
def server():
    return InMemoryMetadataServer(now_ms=1_000)


@pytest.fixture
def store(server):
    store = server.connect(SESSION_TIMEOUT_MS, root="/contract")
    yield store
    store.close()


@pytest.fixture
def other_store(server):
    store = server.connect(SESSION_TIMEOUT_MS, root="/contract")
    yield store
    store.close()


@pytest.fixture
def expire(server):
    def expire_session(store):
        server.expire_session(store.session_id)

    return expire_session


class TestMemoryStoreContract(MetadataStoreContract):
    pass


# -- the clock and heartbeats -------------------------------------------------


def test_session_expires_once_its_last_heartbeat_is_older_than_the_timeout(server):
    store = server.connect(1_000, auto_reconnect=False)
    observer = server.connect(10_000)
    store.create("/member", ephemeral=True)  # at 1_000 ms: counts as a heartbeat
    store.heartbeat(1_500)
    server.advance(2_500)  # 1_000 ms since the heartbeat: not older than the timeout
    observer.heartbeat(2_500)
    assert store.session_id in server.session_ids()
    server.advance(2_501)
    assert store.session_id == 0
    assert observer.exists("/member") is None
    assert server.session_ids() == [observer.session_id]


def test_heartbeats_keep_a_session_alive(server):
    store = server.connect(1_000)
    session_id = store.session_id
    for now_ms in range(1_500, 10_000, 500):
        store.heartbeat(now_ms)
        server.advance(now_ms)
    assert store.session_id == session_id


def test_the_clock_does_not_go_back(server):
    server.advance(5_000)
    with pytest.raises(ValueError):
        server.advance(4_999)


def test_timestamps_come_from_the_server_clock(server):
    store = server.connect(60_000)
    store.create("/node")
    server.advance(7_000)
    stat = store.set("/node", b"x")
    assert (stat.created_ms, stat.modified_ms) == (1_000, 7_000)


def test_expiring_an_unknown_session_is_a_caller_error(server):
    with pytest.raises(ValueError):
        server.expire_session(12345)


# -- auto-reconnect -------------------------------------------------------------


def test_expiry_with_auto_reconnect_starts_a_new_session_at_once(server):
    store = server.connect(1_000)
    states = Recorder()
    store.add_session_listener(states)
    old_session_id = store.session_id
    server.expire_session(old_session_id)
    assert states.items == [SessionState.LOST, SessionState.CONNECTED]
    assert store.session_id not in (0, old_session_id)
    assert server.session_ids() == [store.session_id]
    store.create("/works")


def test_without_auto_reconnect_calls_fail_until_reconnect(server):
    store = server.connect(1_000, auto_reconnect=False)
    states = Recorder()
    store.add_session_listener(states)
    server.expire_session(store.session_id)
    assert states.items == [SessionState.LOST]
    assert store.session_id == 0
    with pytest.raises(SessionExpiredError):
        store.get("/")
    store.heartbeat(1_000)  # ignored, not an error
    store.reconnect()
    assert states.items == [SessionState.LOST, SessionState.CONNECTED]
    assert store.session_id != 0
    store.create("/works")


def test_reconnect_of_a_live_session_is_a_caller_error(server):
    store = server.connect(1_000)
    with pytest.raises(ValueError):
        store.reconnect()


# -- suspended connections ------------------------------------------------------


def test_suspended_store_raises_connection_loss_and_resumes_the_same_session(server):
    store = server.connect(1_000)
    states = Recorder()
    store.add_session_listener(states)
    session_id = store.session_id
    store.suspend()
    with pytest.raises(ConnectionLossError):
        store.create("/node")
    store.resume(1_500)
    assert states.items == [SessionState.SUSPENDED, SessionState.CONNECTED]
    assert store.session_id == session_id
    store.create("/node")


def test_heartbeats_do_not_count_while_suspended(server):
    store = server.connect(1_000)
    session_id = store.session_id
    store.suspend()
    store.heartbeat(1_900)
    server.advance(2_001)
    assert session_id not in server.session_ids()


def test_watches_fire_session_when_the_connection_is_lost(server):
    store = server.connect(10_000)
    other = server.connect(10_000)
    store.create("/node")
    events = Recorder()
    store.get("/node", watch=events)
    store.suspend()
    assert events.items == [WatchEvent(EventType.SESSION, "/node")]
    store.resume(1_000)
    other.set("/node", b"x")
    assert len(events.items) == 1


def test_session_expiring_while_suspended_is_learnt_on_resume(server):
    store = server.connect(1_000)
    other = server.connect(60_000)
    states = Recorder()
    store.add_session_listener(states)
    store.create("/member", ephemeral=True)
    old_session_id = store.session_id
    store.suspend()
    server.advance(3_000)
    # The server expired it: its ephemeral node is gone for everyone else...
    assert other.exists("/member") is None
    # ...but the store cannot know until it reconnects.
    assert states.items == [SessionState.SUSPENDED]
    with pytest.raises(ConnectionLossError):
        store.get("/")
    store.resume(3_000)
    assert states.items == [SessionState.SUSPENDED, SessionState.LOST, SessionState.CONNECTED]
    assert store.session_id not in (0, old_session_id)


def test_closing_a_suspended_store_leaves_its_session_until_it_times_out(server):
    store = server.connect(1_000)
    other = server.connect(60_000)
    store.create("/member", ephemeral=True)
    store.suspend()
    store.close()
    assert other.exists("/member") is not None
    server.advance(2_001)
    assert other.exists("/member") is None


def test_no_callback_runs_after_close(server):
    store = server.connect(1_000)
    other = server.connect(60_000)
    other.create("/node")
    events, states = Recorder(), Recorder()
    store.get("/node", watch=events)
    store.add_session_listener(states)
    store.close()
    other.set("/node", b"x")
    assert events.items == [] and states.items == []
    with pytest.raises(StoreClosedError):
        store.heartbeat(1_000)


# -- watch delivery -------------------------------------------------------------


def test_watchers_run_after_the_mutation_is_complete(server):
    store = server.connect(60_000)
    store.create("/tree/a/leaf", make_parents=True)
    seen: list[tuple[str, object]] = []

    def on_leaf(event):
        # The whole recursive delete is done before any watcher runs.
        seen.append((event.path, store.exists("/tree")))

    store.exists("/tree/a/leaf", watch=on_leaf)
    store.delete("/tree", recursive=True)
    assert seen == [("/tree/a/leaf", None)]


def test_a_watcher_may_set_a_new_watch_from_its_callback(server):
    store = server.connect(60_000)
    store.create("/node")
    seen: list[WatchEvent] = []

    def rewatch(event):
        seen.append(event)
        store.get("/node", watch=rewatch)

    store.get("/node", watch=rewatch)
    store.set("/node", b"1")
    store.set("/node", b"2")
    assert [event.type for event in seen] == [EventType.CHANGED, EventType.CHANGED]


def test_a_failing_watcher_does_not_disturb_the_mutation_or_other_watchers(server, caplog):
    store = server.connect(60_000)
    store.create("/node")
    events = Recorder()

    def broken(event):
        raise RuntimeError("watcher bug")

    store.get("/node", watch=broken)
    store.get("/node", watch=events)
    stat = store.set("/node", b"x")
    assert stat.version == 1
    assert events.items == [WatchEvent(EventType.CHANGED, "/node")]
    assert "watcher bug" in caplog.text


# -- chroots --------------------------------------------------------------------


def test_chroots_are_isolated_and_created_on_connect(server):
    first = server.connect(60_000, root="/apps/first")
    second = server.connect(60_000, root="/apps/second")
    whole = server.connect(60_000)
    first.create("/node", b"1")
    second.create("/node", b"2")
    assert first.get("/node")[0] == b"1"
    assert second.get("/node")[0] == b"2"
    assert whole.children("/apps") == ["first", "second"]
    assert whole.get("/apps/first/node")[0] == b"1"
    with pytest.raises(NoNodeError):
        first.get("/apps")


def test_watch_paths_are_relative_to_the_chroot(server):
    chrooted = server.connect(60_000, root="/app")
    whole = server.connect(60_000)
    events = Recorder()
    chrooted.exists("/node", watch=events)
    whole.create("/app/node")
    assert events.items == [WatchEvent(EventType.CREATED, "/node")]
    root_events = Recorder()
    chrooted.children("/", watch=root_events)
    whole.create("/app/other")
    assert root_events.items == [WatchEvent(EventType.CHILD, "/")]


def test_sequential_create_at_the_chroot_root(server):
    store = server.connect(60_000, root="/app")
    assert store.create("/", sequential=True) == "/0000000000"
    assert store.create("/item-", sequential=True) == "/item-0000000001"


# -- a model of versions and sequence numbers -----------------------------------

operations = st.lists(
    st.tuples(st.sampled_from(["create", "sequential", "set", "delete"]), st.sampled_from(["a", "b", "c"])),
    max_size=40,
)


@settings(max_examples=200, deadline=None)
@given(operations)
def test_versions_and_sequence_numbers_follow_a_simple_model(steps):
    """Whatever the order of creates, sets and deletes, the store agrees with
    a dictionary model on data versions, children_version (creates + deletes)
    and sequence numbers (the count of child creations)."""
    store = InMemoryMetadataServer().connect(60_000)
    store.create("/parent")
    versions: dict[str, int] = {}
    creates = deletes = 0
    for operation, name in steps:
        path = f"/parent/{name}"
        if operation == "create" and name not in versions:
            store.create(path)
            versions[name] = 0
            creates += 1
        elif operation == "sequential":
            created = store.create("/parent/seq-", sequential=True)
            assert created == f"/parent/seq-{creates:010d}"
            versions[created.rsplit("/", 1)[1]] = 0
            creates += 1
        elif operation == "set" and name in versions:
            assert store.set(path, b"x", expected_version=versions[name]).version == versions[name] + 1
            versions[name] += 1
        elif operation == "delete" and name in versions:
            store.delete(path, expected_version=versions.pop(name))
            deletes += 1
    stat = store.exists("/parent")
    assert stat.children_version == creates + deletes
    assert store.children("/parent") == sorted(versions)


# -- the trio adapter over the in-memory store -----------------------------------
# The in-memory store calls watchers and listeners on whatever thread made the
# change: a worker thread for adapter calls, the trio thread itself when the
# test drives the server directly. Both must reach the trio loop.


async def test_async_watch_events_from_worker_threads_and_the_trio_thread(server):
    async_store = AsyncMetadataStore(server.connect(60_000))
    other = server.connect(60_000)
    await async_store.create("/node")
    await async_store.create("/parent")
    _, _, changed = await async_store.get_watch("/node")
    _, created = await async_store.exists_watch("/later")
    _, child_added = await async_store.children_watch("/parent")

    await async_store.set("/node", b"x")  # from a worker thread
    other.create("/later")  # on the trio thread: set at once
    assert created.is_set()
    other.create("/parent/child")
    with trio.fail_after(5):
        await changed.wait()
        await child_added.wait()


async def test_async_session_generation_counts_new_sessions_only(server):
    store = server.connect(1_000)
    async_store = AsyncMetadataStore(store)
    generation = async_store.session_generation

    store.suspend()
    store.resume(server.now_ms)  # the same session again
    await trio.testing.wait_all_tasks_blocked()
    assert async_store.session_generation == generation

    async def expire_later():
        await trio.testing.wait_all_tasks_blocked()
        server.expire_session(store.session_id)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(expire_later)
        with trio.fail_after(5):
            assert await async_store.wait_session_change(generation) == generation + 1


async def test_async_session_change_reported_from_a_worker_thread(server):
    store = server.connect(1_000)
    async_store = AsyncMetadataStore(store)
    generation = async_store.session_generation
    await trio.to_thread.run_sync(server.expire_session, store.session_id)
    with trio.fail_after(5):
        assert await async_store.wait_session_change(generation) == generation + 1


def test_async_store_must_be_made_inside_trio(server):
    with pytest.raises(RuntimeError, match="inside trio"):
        AsyncMetadataStore(server.connect(1_000))
