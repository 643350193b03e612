"""The kazoo metadata store against a real ZooKeeper: the shared contract,
connection failures, chroot creation, and the trio adapter's events."""

from __future__ import annotations

import socket
import threading
import time
import uuid

import pytest
import trio
from kazoo.client import KazooClient

from broker.topic_records import TopicPolicies, TopicRecord
from broker.topic_store import TopicStore
from coordination.async_store import AsyncMetadataStore
from coordination.store import ConnectionLossError, EventType, NodeExistsError, NoNodeError, SessionState, WatchEvent
from coordination.zk_launcher import ZooKeeperServer
from coordination.zk_store import KazooMetadataStore
from tests.metadata_store_contract import MetadataStoreContract, Recorder, wait_for_events
from tests.support import free_port, wait_until, wait_until_async

SESSION_TIMEOUT_MS = 4_000


def connect(hosts: str, root: str, **options) -> KazooMetadataStore:
    options.setdefault("session_timeout_ms", SESSION_TIMEOUT_MS)
    options.setdefault("connect_timeout_ms", 10_000)
    return KazooMetadataStore.connect(hosts, root, **options)


@pytest.fixture
def store(zk_hosts, zk_root):
    store = connect(zk_hosts, zk_root)
    yield store
    store.close()


@pytest.fixture
def other_store(zk_hosts, zk_root):
    store = connect(zk_hosts, zk_root)
    yield store
    store.close()


def expire_kazoo_session(hosts: str, store: KazooMetadataStore) -> None:
    """Expire `store`'s session the known way: attach a second client to the
    same session, then close that session from it. ZooKeeper ends the session
    (its ephemeral nodes go) and the store sees LOST when it reconnects."""
    lost = threading.Event()
    store.add_session_listener(lambda state: lost.set() if state is SessionState.LOST else None)
    session_id, password = store.kazoo_client.client_id
    # If the store reconnects before the intruder closes, it takes the session
    # back and the close does not happen: try again (bounded).
    for _ in range(5):
        intruder = KazooClient(hosts=hosts, client_id=(session_id, password), timeout=SESSION_TIMEOUT_MS / 1000)
        intruder.start(timeout=10)
        intruder.stop()
        intruder.close()
        if lost.wait(timeout=3):
            return
    raise AssertionError(f"session {session_id:#x} did not expire")


@pytest.fixture
def expire(zk_hosts):
    return lambda store: expire_kazoo_session(zk_hosts, store)


class TestKazooStoreContract(MetadataStoreContract):
    pass


# -- connecting ---------------------------------------------------------------


def test_unreachable_zookeeper_fails_fast_with_one_clear_line():
    port = free_port()  # nothing listens there
    threads_before = set(threading.enumerate())
    started = time.monotonic()
    with pytest.raises(ConnectionLossError) as caught:
        KazooMetadataStore.connect(f"127.0.0.1:{port}", "/quire", connect_timeout_ms=1_500)
    elapsed_s = time.monotonic() - started
    assert str(caught.value) == f"could not reach ZooKeeper at 127.0.0.1:{port} within 1.5s"
    assert caught.value.__cause__ is None and caught.value.__suppress_context__
    assert 1.4 <= elapsed_s < 5.0
    wait_until(
        lambda: set(threading.enumerate()) <= threads_before,
        deadline_s=5,
        what="kazoo's threads to stop",
    )


def test_connect_creates_a_missing_chroot(zk_hosts, zk_root):
    nested_root = f"{zk_root}/nested/app"
    with connect(zk_hosts, "/") as whole_tree:
        assert whole_tree.exists(nested_root) is None
        with connect(zk_hosts, nested_root) as chrooted:
            chrooted.create("/node", b"inside")
            assert chrooted.children("/") == ["node"]
        assert whole_tree.get(f"{nested_root}/node")[0] == b"inside"


def test_hosts_with_a_chroot_are_refused():
    with pytest.raises(ValueError):
        KazooMetadataStore.connect("127.0.0.1:2181/quire")


def test_session_id_matches_ephemeral_owner_seen_by_zookeeper(store, other_store):
    store.create("/member", ephemeral=True)
    assert store.session_id == store.kazoo_client.client_id[0]
    assert other_store.exists("/member").ephemeral_owner == store.session_id


def test_a_restarted_zookeeper_suspends_and_resumes_the_same_session(tmp_path):
    # With its own ZooKeeper, so the shared one stays up. ZooKeeper keeps
    # sessions across a restart; kazoo drops the watches on disconnect, which
    # the store reports as SESSION events.
    server = ZooKeeperServer(free_port(), tmp_path / "zookeeper", die_with_parent=True)
    server.start()
    try:
        with connect(server.address, "/app", session_timeout_ms=10_000) as store:
            store.create("/node")
            states, events = Recorder(), Recorder()
            store.add_session_listener(states)
            store.get("/node", watch=events)
            session_id = store.session_id
            server.stop()
            wait_until(lambda: SessionState.SUSPENDED in states.items, deadline_s=10, what="SUSPENDED")
            assert wait_for_events(events, 1, "the dropped watch") == [WatchEvent(EventType.SESSION, "/node")]
            # A call made during the outage waits for the connection to return.
            created: list[str] = []
            caller = threading.Thread(target=lambda: created.append(store.create("/during-outage", ephemeral=True)))
            caller.start()
            server.start()
            wait_until(lambda: SessionState.CONNECTED in states.items, deadline_s=15, what="CONNECTED again")
            caller.join(timeout=15)
            assert created == ["/during-outage"]
            assert store.session_id == session_id
            assert SessionState.LOST not in states.items
            assert store.exists("/during-outage").ephemeral_owner == session_id
    finally:
        server.stop()


# -- the trio adapter ---------------------------------------------------------


async def test_async_watches_set_their_events(store, other_store):
    async_store = AsyncMetadataStore(store)
    other = AsyncMetadataStore(other_store)
    await async_store.create("/node", b"v0")
    await async_store.create("/parent")

    data, stat, changed = await async_store.get_watch("/node")
    assert (data, stat.version) == (b"v0", 0)
    missing_stat, created = await async_store.exists_watch("/later")
    assert missing_stat is None
    names, child_added = await async_store.children_watch("/parent")
    assert names == []

    assert not (changed.is_set() or created.is_set() or child_added.is_set())
    await other.set("/node", b"v1")
    await other.create("/later")
    await other.create("/parent/child")
    with trio.fail_after(10):
        await changed.wait()
        await created.wait()
        await child_added.wait()
    assert (await async_store.get("/node"))[0] == b"v1"
    assert await async_store.children("/parent") == ["child"]


async def test_a_watched_topic_record_is_read_again_only_once_it_changed(store, other_store):
    topics, writer = TopicStore(AsyncMetadataStore(store)), TopicStore(AsyncMetadataStore(other_store))
    await writer.store.ensure_path("/topics")
    assert await topics.read_topic_watched("watched") is None
    await writer.create_topic("watched", TopicRecord(0, TopicPolicies(), 0))
    first = await topics.read_topic_watched("watched")
    reads = []
    get = store.get
    store.get = lambda path, watch=None: reads.append(path) or get(path, watch)  # counted from here
    assert await topics.read_topic_watched("watched") == first and reads == []  # unchanged: not read
    _, version = await writer.read_topic("watched")
    await writer.write_topic("watched", TopicRecord(0, TopicPolicies(message_ttl_s=60), 0), version)

    async def changed_record():
        record = await topics.read_topic_watched("watched")
        return record if record != first else None

    changed = await wait_until_async(changed_record, deadline_s=10, what="the watch to say the record changed")
    assert changed.policies.message_ttl_s == 60 and len(reads) == 1


async def test_async_wait_session_change_sees_an_expiry(store, zk_hosts):
    async_store = AsyncMetadataStore(store)
    generation = async_store.session_generation
    old_session_id = async_store.session_id
    await trio.to_thread.run_sync(expire_kazoo_session, zk_hosts, store)
    with trio.fail_after(15):
        new_generation = await async_store.wait_session_change(generation)
    assert new_generation == generation + 1
    assert async_store.session_id not in (0, old_session_id)
    # Returns at once when the generation given is already old.
    with trio.fail_after(1):
        assert await async_store.wait_session_change(generation) == new_generation
    await async_store.create("/works", ephemeral=True)


async def test_async_close_closes_the_store(store):
    async with AsyncMetadataStore(store) as async_store:
        await async_store.ensure_path("/a/b")
    assert store.kazoo_client.client_id is None


# -- answers lost on the way back -----------------------------------------------


class CuttingProxy:
    """A TCP proxy in front of ZooKeeper. Once armed with `cut_after(marker)`,
    it forwards the next client packet containing `marker` and then cuts the
    connection without passing on ZooKeeper's answer: the request is applied
    but the client sees a connection loss, as when a network fails."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.cuts = 0
        self._marker: bytes | None = None
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def cut_after(self, marker: bytes) -> None:
        with self._lock:
            self._marker = marker

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return  # closed
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            cutting = threading.Event()
            with self._lock:
                self._sockets += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, cutting, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, cutting, False), daemon=True).start()

    def _pump(self, source: socket.socket, destination: socket.socket, cutting: threading.Event, inspect: bool) -> None:
        try:
            while chunk := source.recv(65536):
                if cutting.is_set():
                    break
                with self._lock:
                    cut = inspect and self._marker is not None and self._marker in chunk
                    if cut:
                        self._marker = None
                        self.cuts += 1
                        cutting.set()  # before forwarding, so the answer is never passed on
                destination.sendall(chunk)
                if cut:
                    break
        except OSError:
            pass
        finally:
            for end in (source, destination):
                try:
                    end.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.listener.close()
        with self._lock:
            for end in self._sockets:
                end.close()


@pytest.fixture
def cutting_proxy(zookeeper):
    proxy = CuttingProxy(zookeeper.port)
    yield proxy
    proxy.close()


@pytest.fixture
def proxied_store(cutting_proxy, zk_root):
    store = connect(f"127.0.0.1:{cutting_proxy.port}", zk_root)
    yield store
    store.close()


def test_retried_ephemeral_create_recognises_its_own_node(proxied_store, cutting_proxy, other_store):
    path = f"/ambiguous-{uuid.uuid4().hex}"
    cutting_proxy.cut_after(path.encode())
    assert proxied_store.create(path, b"mine", ephemeral=True) == path
    assert cutting_proxy.cuts == 1
    assert other_store.exists(path).ephemeral_owner == proxied_store.session_id


def test_retried_persistent_create_cannot_tell_and_reports_node_exists(proxied_store, cutting_proxy, other_store):
    # The documented ambiguity: the first try did create the node.
    path = f"/ambiguous-{uuid.uuid4().hex}"
    cutting_proxy.cut_after(path.encode())
    with pytest.raises(NodeExistsError):
        proxied_store.create(path, b"mine")
    assert other_store.get(path)[0] == b"mine"


def test_retried_conditional_set_recognises_its_own_write(proxied_store, cutting_proxy, other_store):
    path = f"/ambiguous-{uuid.uuid4().hex}"
    proxied_store.create(path, b"v0")
    cutting_proxy.cut_after(path.encode())
    assert proxied_store.set(path, b"v1", expected_version=0).version == 1
    assert cutting_proxy.cuts == 1
    assert other_store.get(path)[0] == b"v1"


def test_retried_delete_counts_a_vanished_node_as_done(proxied_store, cutting_proxy, other_store):
    unconditional = f"/ambiguous-{uuid.uuid4().hex}"
    conditional = f"/ambiguous-{uuid.uuid4().hex}"
    proxied_store.create(unconditional)
    proxied_store.create(conditional)
    cutting_proxy.cut_after(unconditional.encode())
    proxied_store.delete(unconditional)
    cutting_proxy.cut_after(conditional.encode())
    with pytest.raises(NoNodeError):
        proxied_store.delete(conditional, expected_version=0)
    assert other_store.exists(unconditional) is None and other_store.exists(conditional) is None
