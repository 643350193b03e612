"""Start-up under ZooKeeper trouble: `Startup` retries a step after a lost
connection or session, within one deadline, and then names the step in one
line; any other ZooKeeper error (no permission) names the step in one line at
once; the start-up steps of bookies and brokers (cookies, registration) are
safe to run again after ZooKeeper failed them half-way."""

from __future__ import annotations

import random
import threading
from pathlib import Path

import pytest
import trio

from bookie.registration import CookieCheck, Registration
from broker.ownership import BrokerInfo, Ownership
from broker.topic_records import broker_path
from coordination.async_store import AsyncMetadataStore
from coordination.cluster_layout import BookieRegistrationInfo, ClusterLayout, ensure_cluster_layout
from coordination.memory_store import InMemoryMetadataServer
from coordination.retry import RetryPolicy
from coordination.startup import Startup, StartupFailedError, StartupTimeoutError, _connect_abandonably
from coordination.store import ConnectionLossError, MetadataError, NoNodeError, SessionExpiredError, StoreClosedError
from ledger_client.registry import BookieRegistry
from tests.support import wait_until_async

FAST = RetryPolicy(tries_max=1_000, delay_initial_ms=10, delay_max_ms=50)
LAYOUT = ClusterLayout()
NOT_ALLOWED = "/bookies/writable/b1: not allowed: the node's ACL refuses this client (NoAuthError)"


class Flaky:
    """An async call that fails with the given errors, one per call, then returns "done"."""

    def __init__(self, *errors: Exception) -> None:
        self.errors = list(errors)
        self.calls = 0

    async def __call__(self) -> str:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return "done"


# --- Startup ---------------------------------------------------------------------------------


async def test_a_step_is_tried_again_after_connection_and_session_loss(autojump_clock):
    startup = Startup("bookie", 60_000, policy=FAST, rng=random.Random(1))
    call = Flaky(ConnectionLossError("no answer"), SessionExpiredError("expired"), ConnectionLossError("no answer"))
    with startup.deadline():
        assert await startup.step("register", call) == "done"
    assert call.calls == 4


async def test_the_delays_between_tries_grow_and_stay_bounded(autojump_clock):
    policy = RetryPolicy(tries_max=1_000, delay_initial_ms=100, delay_max_ms=400, jitter_ratio=0)
    startup = Startup("broker", 60_000, policy=policy)
    started = trio.current_time()
    with startup.deadline():
        await startup.step("register", Flaky(*[ConnectionLossError("x")] * 5))
    # 100 + 200 + 400 + 400 + 400 ms: backoff, capped at delay_max_ms.
    assert trio.current_time() - started == pytest.approx(1.5)


@pytest.mark.parametrize("error", [
    MetadataError("/cookies/b1: not allowed: the node's ACL refuses this client (NoAuthError)"),
    NoNodeError("/cookies: no such node"),
    StoreClosedError("the metadata store is closed"),
], ids=["no permission", "no node", "store closed"])
async def test_other_zookeeper_errors_end_start_up_at_once_with_one_line(error, autojump_clock):
    # They used to escape as they were, and ended the process in a traceback.
    startup = Startup("bookie", 60_000, policy=FAST)
    call = Flaky(error)
    started = trio.current_time()
    with pytest.raises(StartupFailedError) as raised:
        with startup.deadline():
            await startup.step("check the cookies", call)
    assert call.calls == 1 and trio.current_time() == started
    assert not isinstance(raised.value, StartupTimeoutError)
    assert str(raised.value) == f"bookie did not start: could not check the cookies: {error}"


async def test_errors_that_are_not_zookeepers_propagate_as_they_are(autojump_clock):
    # A refused cookie, a bad address: the caller words those itself.
    startup = Startup("bookie", 60_000, policy=FAST)
    with pytest.raises(ValueError, match="bad address"):
        with startup.deadline():
            await startup.step("reach ZooKeeper", Flaky(ValueError("bad address")))


async def test_a_refusal_after_a_wait_lets_the_caller_clean_up_then_names_the_step(autojump_clock):
    startup = Startup("bookie", 2_000, policy=FAST)
    cleaned_up = False
    with pytest.raises(StartupFailedError) as raised:
        with startup.deadline():
            # The wait ends early: the registration was refused.
            refused = trio.Event()
            refused.set()
            assert await startup.wait_for("register bookie b1", refused.wait)
            startup.refuse(MetadataError(NOT_ALLOWED))
            await trio.sleep(10)  # a clean stop takes its time: no deadline cancels it
            cleaned_up = True
    assert cleaned_up
    assert str(raised.value) == f"bookie did not start: could not register bookie b1: {NOT_ALLOWED}"


async def test_past_the_deadline_one_line_names_the_step_and_the_last_error(autojump_clock):
    startup = Startup("broker", 5_000, policy=FAST)
    started = trio.current_time()

    async def never_answers() -> None:
        raise ConnectionLossError("/brokers/b1: no answer from ZooKeeper after retries")

    with pytest.raises(StartupTimeoutError) as raised:
        with startup.deadline():
            await startup.step("register broker b1 under /brokers", never_answers)
    assert trio.current_time() - started == pytest.approx(5, abs=0.1)
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith("broker did not start within 5s (--startup-timeout): could not register broker b1 under /brokers")
    assert "no answer from ZooKeeper" in message


async def test_a_step_still_waiting_at_the_deadline_is_cancelled_and_explained(autojump_clock):
    startup = Startup("broker", 2_000, policy=FAST)
    with pytest.raises(StartupTimeoutError, match="could not register: held by session 0x7"):
        with startup.deadline():
            await startup.step("register", trio.sleep_forever, detail=lambda: "held by session 0x7")


async def test_local_work_does_not_count_against_the_deadline(autojump_clock):
    # A journal replay longer than the whole deadline, then a quick ZooKeeper step.
    startup = Startup("bookie", 1_000, policy=FAST)
    with startup.deadline():
        with startup.paused():
            await trio.sleep(30)
        await trio.sleep(0.5)
        assert await startup.step("register", Flaky()) == "done"
        startup.finish()
        await trio.sleep(3_600)  # serving: no deadline any more


async def test_wait_for_lets_the_caller_clean_up_before_the_failure_is_raised(autojump_clock):
    startup = Startup("bookie", 2_000, policy=FAST)
    cleaned_up = False
    with pytest.raises(StartupTimeoutError, match="could not register bookie b1: still held"):
        with startup.deadline():
            done = await startup.wait_for("register bookie b1", trio.sleep_forever, detail=lambda: "still held")
            assert not done
            await trio.sleep(10)  # a clean stop takes its time: no deadline cancels it
            cleaned_up = True
    assert cleaned_up


def test_a_start_up_timeout_must_be_positive():
    async def make() -> None:
        Startup("bookie", 0)

    with pytest.raises(ValueError, match="positive"):
        trio.run(make)


# --- the broker's registration ----------------------------------------------------------------


async def wait_for(condition, what: str, deadline_s: float = 5) -> None:
    await wait_until_async(condition, deadline_s=deadline_s, what=what)


class Counted:
    """An async call, counted: `calls` says how often it was tried."""

    def __init__(self, call) -> None:
        self.call = call
        self.calls = 0

    async def __call__(self):
        self.calls += 1
        return await self.call()


class RefusesCreates:
    """A metadata store that refuses the next `refusals` creates under
    `prefix` as ZooKeeper refuses a client without permission."""

    def __init__(self, store, prefix: str, refusals: int) -> None:
        self._store = store
        self._prefix = prefix
        self.refusals = refusals

    def __getattr__(self, name: str):
        return getattr(self._store, name)

    def create(self, path: str, *args, **kwargs) -> str:
        if path.startswith(self._prefix) and self.refusals:
            self.refusals -= 1
            raise MetadataError(f"{path}: not allowed: the node's ACL refuses this client (NoAuthError)")
        return self._store.create(path, *args, **kwargs)


async def test_a_restarted_broker_waits_for_its_previous_session_then_registers():
    server = InMemoryMetadataServer()
    info = BrokerInfo("b1", "127.0.0.1:6700")
    # The previous process of broker b1 was killed; its session still holds the node.
    previous = server.connect(session_timeout_ms=10_000)
    previous.create(broker_path("b1"), info.to_bytes(), ephemeral=True, make_parents=True)
    store = AsyncMetadataStore(server.connect(session_timeout_ms=10_000))
    ownership = Ownership(store, info, stale_wait_s=0.1)
    startup = Startup("broker", 30_000, policy=FAST)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(startup.step, "register broker b1", ownership.register)
        await wait_for(lambda: ownership.stale_owner == previous.session_id, "waiting for the stale node")
        assert "is another broker running with id b1" in ownership.problem()
        # The old session expires: its node goes and the new one is made at once.
        server.expire_session(previous.session_id)
        await wait_for(lambda: ownership.stale_owner is None and store.store.exists(broker_path("b1")) is not None, "registered")
    _, stat = store.store.get(broker_path("b1"))
    assert stat.ephemeral_owner == store.session_id


async def test_a_broker_registers_once_zookeeper_answers_again_with_a_new_session():
    server = InMemoryMetadataServer()
    store = AsyncMetadataStore(server.connect(session_timeout_ms=10_000))
    ownership = Ownership(store, BrokerInfo("b1", "127.0.0.1:6700"))
    startup = Startup("broker", 30_000, policy=FAST)
    # ZooKeeper stops answering before the broker registers, and the session
    # expires meanwhile (a SIGSTOPped ZooKeeper that comes back).
    old_session = store.session_id
    store.store.suspend()
    server.expire_session(old_session)
    register = Counted(ownership.register)
    with startup.deadline():
        async with trio.open_nursery() as nursery:
            nursery.start_soon(startup.step, "register broker b1", register)
            await wait_for(lambda: register.calls >= 3, "several tries")
            assert isinstance(startup.last_error, ConnectionLossError)
            store.store.resume(now_ms=1)
    assert store.session_id not in (0, old_session)
    _, stat = store.store.get(broker_path("b1"))
    assert stat.ephemeral_owner == store.session_id


async def test_after_a_session_loss_the_broker_keeps_trying_to_register_again():
    server = InMemoryMetadataServer()
    observer = server.connect(session_timeout_ms=10_000)
    store = AsyncMetadataStore(server.connect(session_timeout_ms=10_000))
    ownership = Ownership(store, BrokerInfo("b1", "127.0.0.1:6700"), retry=FAST)
    ownership.register = Counted(ownership.register)
    store.store.suspend()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(ownership.register_with_retries)
        await wait_for(lambda: ownership.register.calls >= 3, "several tries failing with ConnectionLossError")
        assert observer.exists(broker_path("b1")) is None
        store.store.resume(now_ms=1)
    _, stat = store.store.get(broker_path("b1"))
    assert stat.ephemeral_owner == store.session_id


async def test_a_serving_broker_refused_its_registration_keeps_trying():
    # No permission for a while (an ACL changed, then put right): the broker
    # serves on, and registers once ZooKeeper lets it; it used to end the
    # broker in a traceback.
    server = InMemoryMetadataServer()
    refusing = RefusesCreates(server.connect(session_timeout_ms=10_000), broker_path("b1"), refusals=3)
    store = AsyncMetadataStore(refusing)
    ownership = Ownership(store, BrokerInfo("b1", "127.0.0.1:6700"), retry=FAST)
    with trio.fail_after(10):
        await ownership.register_with_retries()
    assert refusing.refusals == 0
    _, stat = store.store.get(broker_path("b1"))
    assert stat.ephemeral_owner == store.session_id


# --- the bookie's cookies and registration ------------------------------------------------------


class LosesAnswer:
    """A metadata store whose create of `path` takes effect but whose answer
    is lost once (ConnectionLossError), as when ZooKeeper stops right after
    applying a request."""

    def __init__(self, store, path: str) -> None:
        self._store = store
        self._path = path
        self.lost = 0

    def __getattr__(self, name: str):
        return getattr(self._store, name)

    def create(self, path: str, *args, **kwargs) -> str:
        created = self._store.create(path, *args, **kwargs)
        if path == self._path and not self.lost:
            self.lost += 1
            raise ConnectionLossError(f"{path}: no answer from ZooKeeper after retries; the outcome is unknown")
        return created


def bookie_directories(tmp_path: Path) -> tuple[Path, Path]:
    journal, ledgers = tmp_path / "journal", tmp_path / "ledgers"
    journal.mkdir()
    ledgers.mkdir()
    return journal, ledgers


async def test_a_new_bookie_whose_cookie_answer_was_lost_is_still_new_on_the_next_try(tmp_path):
    server = InMemoryMetadataServer()
    journal, ledgers = bookie_directories(tmp_path)
    flaky = LosesAnswer(server.connect(session_timeout_ms=10_000), LAYOUT.cookie("b1"))
    store = AsyncMetadataStore(flaky)
    check = CookieCheck(store, LAYOUT, "b1", journal, ledgers)
    startup = Startup("bookie", 30_000, policy=FAST)
    with startup.deadline():
        cookie, new = await startup.step("check the cookies", check.run)
    # The first try wrote every cookie, then lost the answer; the second
    # finds this process's own cookies and still knows the bookie is new
    # (its index must get the identity, or the next start would refuse).
    assert flaky.lost == 1
    assert new
    data, _ = store.store.get(LAYOUT.cookie("b1"))
    assert data == cookie.to_bytes()
    # A later process finding the same cookies knows the bookie.
    again = CookieCheck(AsyncMetadataStore(server.connect(session_timeout_ms=10_000)), LAYOUT, "b1", journal, ledgers)
    assert await again.run() == (cookie, False)


async def test_a_known_bookie_is_never_taken_for_new_by_a_retry(tmp_path):
    server = InMemoryMetadataServer()
    journal, ledgers = bookie_directories(tmp_path)
    first = CookieCheck(AsyncMetadataStore(server.connect(session_timeout_ms=10_000)), LAYOUT, "b1", journal, ledgers)
    cookie, new = await first.run()
    assert new
    (ledgers / "index").mkdir()  # it ran: its storage exists
    check = CookieCheck(AsyncMetadataStore(server.connect(session_timeout_ms=10_000)), LAYOUT, "b1", journal, ledgers)
    startup = Startup("bookie", 30_000, policy=FAST)
    calls = Flaky(SessionExpiredError("expired"))

    async def flaky_run():
        await calls()
        return await check.run()

    with startup.deadline():
        assert await startup.step("check the cookies", flaky_run) == (cookie, False)


async def test_a_bookie_registration_is_tried_again_until_zookeeper_answers():
    server = InMemoryMetadataServer()
    observer = server.connect(session_timeout_ms=10_000)
    ensure_cluster_layout(observer, LAYOUT)
    metadata = AsyncMetadataStore(server.connect(session_timeout_ms=10_000))
    info = BookieRegistrationInfo("b1:3181", "127.0.0.1:3181", None, False)
    registration = Registration(metadata, LAYOUT, info, stale_wait_s=1, retry=FAST)
    metadata.store.suspend()
    async with trio.open_nursery() as nursery:
        await nursery.start(registration.run)
        await wait_for(lambda: isinstance(registration.last_error, ConnectionLossError), "a failed try")
        assert registration.problem() is not None
        metadata.store.resume(now_ms=1)
        await wait_for(registration.registered.is_set, "registered")
        assert registration.last_error is None
        nursery.cancel_scope.cancel()
    _, stat = observer.get(LAYOUT.bookie_registration("b1:3181", read_only=False))
    assert stat.ephemeral_owner == metadata.session_id


async def test_a_connect_the_deadline_gave_up_on_is_closed_when_it_completes():
    # ZooKeeper answers only after the deadline: the session the late
    # connect opens must not be left behind.
    server = InMemoryMetadataServer()
    release = threading.Event()
    made = []

    def slow_connect():
        release.wait(10)
        store = server.connect(session_timeout_ms=10_000)
        made.append(store)
        return store

    with trio.move_on_after(0.1) as scope:
        await _connect_abandonably(slow_connect)
    assert scope.cancelled_caught
    release.set()
    await wait_for(lambda: made and server.session_ids() == [], "the late session closed")


async def test_the_bookie_registry_starts_empty_before_any_bookie_ever_ran():
    # A broker (or any client) started before the first bookie of a new
    # cluster: the registry lists do not exist yet. It starts with none, and
    # sees the first bookie when it registers.
    server = InMemoryMetadataServer()
    registry = BookieRegistry(AsyncMetadataStore(server.connect(session_timeout_ms=10_000)), LAYOUT)
    async with trio.open_nursery() as nursery:
        with trio.fail_after(5):
            await nursery.start(registry.run)
        assert registry.writable_racks() == {}
        bookie = server.connect(session_timeout_ms=10_000)
        ensure_cluster_layout(bookie, LAYOUT)
        info = BookieRegistrationInfo("b1:3181", "127.0.0.1:3181", "rack-a", False)
        bookie.create(LAYOUT.bookie_registration("b1:3181", read_only=False), info.to_bytes(), ephemeral=True)
        await wait_for(lambda: registry.writable_racks() == {"b1:3181": "rack-a"}, "the first bookie")
        nursery.cancel_scope.cancel()
