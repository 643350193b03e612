"""A bookie's registration over the in-memory metadata store: it follows the
bookie's mode, comes back after its ZooKeeper session is lost, waits out a
stale registration of an earlier session, and leaves on unregister. A first
registration ZooKeeper refuses ends at once with the reason; once the bookie
serves, a refusal is logged and tried again."""

from __future__ import annotations

import trio

from bookie.registration import Registration
from coordination.async_store import AsyncMetadataStore
from coordination.cluster_layout import BookieRegistrationInfo, ClusterLayout, ensure_cluster_layout, list_bookies
from coordination.memory_store import InMemoryMetadataServer
from coordination.retry import RetryPolicy
from coordination.store import MetadataError
from tests.support import wait_until_async

LAYOUT = ClusterLayout()
FAST = RetryPolicy(tries_max=1_000, delay_initial_ms=10, delay_max_ms=50)
INFO = BookieRegistrationInfo("b1:3181", "127.0.0.1:3181", "rack-a", False)


def registered(store) -> dict[str, str]:
    return {
        bookie_id: ("read-only" if read_only else "writable")
        for read_only in (False, True)
        for bookie_id in list_bookies(store, LAYOUT, read_only=read_only)
    }


async def wait_for(condition, what: str, deadline_s: float = 5) -> None:
    await wait_until_async(condition, deadline_s=deadline_s, what=what)


async def test_registration_follows_mode_and_survives_session_loss():
    server = InMemoryMetadataServer()
    observer = server.connect(session_timeout_ms=10_000)
    bookie_store = server.connect(session_timeout_ms=10_000)
    ensure_cluster_layout(observer, LAYOUT)
    metadata = AsyncMetadataStore(bookie_store)
    registration = Registration(metadata, LAYOUT, INFO, stale_wait_s=1)
    async with trio.open_nursery() as nursery:
        await nursery.start(registration.run)
        await wait_for(lambda: registered(observer) == {"b1:3181": "writable"}, "writable registration")
        data, stat = observer.get(LAYOUT.bookie_registration("b1:3181", read_only=False))
        assert BookieRegistrationInfo.from_bytes(data) == INFO
        assert stat.ephemeral_owner == bookie_store.session_id

        # Disk full: the bookie moves to the read-only list, never in both.
        registration.set_read_only(True)
        await wait_for(lambda: registered(observer) == {"b1:3181": "read-only"}, "read-only registration")

        # The session expires: its ephemeral node goes, and the bookie,
        # with its new session, registers again in its current mode.
        old_session = bookie_store.session_id
        server.expire_session(old_session)
        await wait_for(lambda: registered(observer) == {"b1:3181": "read-only"} and bookie_store.session_id != old_session, "re-registration")
        _, stat = observer.get(LAYOUT.bookie_registration("b1:3181", read_only=True))
        assert stat.ephemeral_owner == bookie_store.session_id

        registration.set_read_only(False)
        await wait_for(lambda: registered(observer) == {"b1:3181": "writable"}, "writable again")
        await registration.unregister()
        nursery.cancel_scope.cancel()
    assert registered(observer) == {}


async def test_a_restarted_bookie_waits_for_its_stale_registration_to_expire():
    server = InMemoryMetadataServer()
    observer = server.connect(session_timeout_ms=10_000)
    ensure_cluster_layout(observer, LAYOUT)
    # The previous process of this bookie died; its session is still alive.
    previous = server.connect(session_timeout_ms=10_000)
    previous.create(LAYOUT.bookie_registration("b1:3181", read_only=False), b"{}", ephemeral=True)
    metadata = AsyncMetadataStore(server.connect(session_timeout_ms=10_000))
    registration = Registration(metadata, LAYOUT, INFO, stale_wait_s=0.2)
    async with trio.open_nursery() as nursery:
        await nursery.start(registration.run)
        # Past stale_wait_s it keeps waiting (and warns) rather than give up.
        await trio.sleep(0.5)
        assert not registration.registered.is_set()
        server.expire_session(previous.session_id)
        await wait_for(registration.registered.is_set, "registration after expiry")
        _, stat = observer.get(LAYOUT.bookie_registration("b1:3181", read_only=False))
        assert stat.ephemeral_owner == metadata.store.session_id
        nursery.cancel_scope.cancel()


async def test_a_mode_change_during_registration_is_not_lost():
    server = InMemoryMetadataServer()
    observer = server.connect(session_timeout_ms=10_000)
    ensure_cluster_layout(observer, LAYOUT)
    metadata = AsyncMetadataStore(server.connect(session_timeout_ms=10_000))
    registration = Registration(metadata, LAYOUT, INFO, stale_wait_s=1)
    # The disk fills up while the first registration is still being written.
    original = metadata.create

    async def slow_create(*args, **kwargs):
        registration.set_read_only(True)
        return await original(*args, **kwargs)

    metadata.create = slow_create
    async with trio.open_nursery() as nursery:
        await nursery.start(registration.run)
        await wait_for(lambda: registered(observer) == {"b1:3181": "read-only"}, "read-only after the race")
        nursery.cancel_scope.cancel()


class RefusesCreates:
    """A metadata store that refuses the next `refusals` creates under
    /bookies as ZooKeeper refuses a client without permission."""

    def __init__(self, store, refusals: int) -> None:
        self._store = store
        self.refusals = refusals

    def __getattr__(self, name: str):
        return getattr(self._store, name)

    def create(self, path: str, *args, **kwargs) -> str:
        if path.startswith("/bookies/") and self.refusals:
            self.refusals -= 1
            raise MetadataError(f"{path}: not allowed: the node's ACL refuses this client (NoAuthError)")
        return self._store.create(path, *args, **kwargs)


async def test_a_first_registration_zookeeper_refuses_ends_at_once_with_the_reason():
    # Waiting would not cure it: the bookie's start-up reports it in one line.
    server = InMemoryMetadataServer()
    ensure_cluster_layout(server.connect(session_timeout_ms=10_000), LAYOUT)
    metadata = AsyncMetadataStore(RefusesCreates(server.connect(session_timeout_ms=10_000), refusals=1))
    registration = Registration(metadata, LAYOUT, INFO, stale_wait_s=1, retry=FAST)
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            await nursery.start(registration.run)
            await registration.refused.wait()
    assert not registration.registered.is_set()
    assert isinstance(registration.refusal, MetadataError) and "NoAuthError" in str(registration.refusal)


async def test_a_serving_bookie_refused_its_registration_keeps_trying_and_serving(caplog):
    # Registered, then its session expires and ZooKeeper refuses the new
    # registration for a while: the bookie logs it and tries again (it used
    # to end the bookie in a traceback), and is found again once allowed.
    server = InMemoryMetadataServer()
    observer = server.connect(session_timeout_ms=10_000)
    ensure_cluster_layout(observer, LAYOUT)
    refusing = RefusesCreates(server.connect(session_timeout_ms=10_000), refusals=0)
    metadata = AsyncMetadataStore(refusing)
    registration = Registration(metadata, LAYOUT, INFO, stale_wait_s=1, retry=FAST)
    async with trio.open_nursery() as nursery:
        await nursery.start(registration.run)
        await wait_for(lambda: registered(observer) == {"b1:3181": "writable"}, "the first registration")
        refusing.refusals = 3
        server.expire_session(metadata.session_id)
        await wait_for(lambda: refusing.refusals == 0, "three refused tries")
        await wait_for(lambda: registered(observer) == {"b1:3181": "writable"}, "registered again")
        # The node shows before the loop has taken back the create's result
        # from its thread: wait for the loop too.
        await wait_for(lambda: registration.last_error is None, "the loop saw the registration")
        assert registration.refusal is None
        nursery.cancel_scope.cancel()
    assert sum("NoAuthError" in record.getMessage() for record in caplog.records) == 3


async def test_a_bookie_registers_even_where_the_lists_are_gone():
    # /bookies/writable deleted by hand: the registration makes it again,
    # as BookKeeper's does, instead of failing.
    server = InMemoryMetadataServer()
    observer = server.connect(session_timeout_ms=10_000)
    metadata = AsyncMetadataStore(server.connect(session_timeout_ms=10_000))
    registration = Registration(metadata, LAYOUT, INFO, stale_wait_s=1, retry=FAST)
    async with trio.open_nursery() as nursery:
        await nursery.start(registration.run)
        await wait_for(registration.registered.is_set, "registered")
        nursery.cancel_scope.cancel()
    _, stat = observer.get(LAYOUT.bookie_registration("b1:3181", read_only=False))
    assert stat.ephemeral_owner == metadata.session_id
