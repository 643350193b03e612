"""A LedgerHandle over a stand-in pool (no bookies, no network): what the
handle does with its bookies' answers once its core completes adds, and
the client's one timer for add timeouts."""

import logging
import random

import trio

from ledger_client.add_timeouts import AddTimeoutMonitor
from ledger_client.client_services import ClientServices
from ledger_client.ledger_handle import LedgerHandle
from tests.unit.test_write_core import make_core


class StandInPool:
    """Keeps each send: (bookie id, callback, ledger id, entry id)."""

    def __init__(self) -> None:
        self.sends: list[tuple[str, object, int, int]] = []

    def send_add_tail(self, bookie_id: str, tail: bytes, callback, ledger_id: int, entry_id: int) -> None:
        self.sends.append((bookie_id, callback, ledger_id, entry_id))


class StandInRegistry:
    def writable_racks(self) -> dict[str, str | None]:
        return {f"b{index}": None for index in range(6)}


class StandInLedgerStore:
    """Takes every metadata write (compare-and-set) and keeps it."""

    def __init__(self) -> None:
        self.written: list = []

    async def write(self, metadata, expected_version: int) -> int:
        self.written.append(metadata)
        return expected_version + 1


class StandInClient:
    """What a LedgerHandle is given by its BookKeeper (`services`), over the
    stand-ins above."""

    def __init__(self, nursery: trio.Nursery, add_timeout_ms: float = 10_000) -> None:
        self.pool = StandInPool()
        self.ledger_store = StandInLedgerStore()
        self.add_timeouts = AddTimeoutMonitor(add_timeout_ms)
        self.services = ClientServices(
            connections=self.pool,
            bookies=StandInRegistry(),
            ledger_store=self.ledger_store,
            spawn=nursery.start_soon,
            add_timeouts=self.add_timeouts,
            rng=random.Random(1),
        )


def answer_ok(client: StandInClient, bookie_id: str) -> None:
    """The bookie answers OK to every add sent to it, as one run."""
    sent = [(callback, ledger_id, entry_id) for to, callback, ledger_id, entry_id in client.pool.sends if to == bookie_id]
    callback, ledger_id, _ = sent[0]
    callback.adds_acknowledged(bookie_id, ledger_id, [entry_id for _, _, entry_id in sent])


async def test_a_raising_on_done_callback_leaves_the_adds_after_it_to_complete(caplog):
    # The first add's on_done raises. The error is logged, and the two adds
    # completed with it still complete and give their room back.
    async with trio.open_nursery() as nursery:
        client = StandInClient(nursery)
        handle = LedgerHandle(client.services, make_core(), b"key", pending_adds_max=3)
        seen: list[int] = []

        def on_done(pending) -> None:
            seen.append(pending.entry_id)
            if pending.entry_id == 0:
                raise RuntimeError("the caller's own bug")

        pendings = [handle.submit_add_nowait(b"entry", on_done) for _ in range(3)]
        with caplog.at_level(logging.ERROR, logger="ledger_client.ledger_handle"):
            answer_ok(client, "b0")
            answer_ok(client, "b1")  # the second answer of each: AQ 2 reached for all three
        assert seen == [0, 1, 2]
        assert all(pending.done and pending.error is None for pending in pendings)
        assert "on_done callback of entry 0 failed" in caplog.text
        # Their room is free again: three more adds go in without waiting.
        for _ in range(3):
            handle.submit_add_nowait(b"entry")
        nursery.cancel_scope.cancel()


async def test_one_timer_replaces_the_bookies_that_leave_an_add_unanswered(autojump_clock):
    # Two ledgers share the client's timer. On the first, b1 and b2 never
    # answer entry 0: once the add timeout has passed (seen within one
    # interval of it), both are replaced in one ensemble change. The other
    # ledger's add was answered at once, and the timer let go of it.
    async with trio.open_nursery() as nursery:
        client = StandInClient(nursery, add_timeout_ms=1_000)
        nursery.start_soon(client.add_timeouts.run)
        slow = LedgerHandle(client.services, make_core(add_timeout_ms=1_000), b"key")
        pending = slow.submit_add_nowait(b"entry")
        answer_ok(client, "b0")
        sent_before = len(client.pool.sends)
        quick = LedgerHandle(client.services, make_core(add_timeout_ms=1_000), b"key")
        quick.submit_add_nowait(b"entry")
        for bookie_id in ("b0", "b1"):
            callback, ledger_id, entry_id = next(
                (callback, ledger_id, entry_id) for to, callback, ledger_id, entry_id in client.pool.sends[sent_before:] if to == bookie_id
            )
            callback.adds_acknowledged(bookie_id, ledger_id, [entry_id])
        assert client.add_timeouts.watched == 2
        await trio.sleep(0.95)
        assert client.ledger_store.written == []  # not yet due
        assert client.add_timeouts.watched == 1  # the quick ledger has nothing pending
        await trio.sleep(0.2)
        [changed] = client.ledger_store.written
        _, ensemble = changed.last_ensemble
        assert ensemble[0] == "b0" and {"b1", "b2"}.isdisjoint(ensemble)
        assert not pending.done
        # The replacements get entry 0; their answers complete it, and the
        # timer lets go of the ledger at its next look.
        for bookie_id in ensemble[1:]:
            callback, ledger_id, entry_id = next(
                (callback, ledger_id, entry_id) for to, callback, ledger_id, entry_id in client.pool.sends if to == bookie_id
            )
            callback.adds_acknowledged(bookie_id, ledger_id, [entry_id])
        assert pending.done and pending.error is None
        await trio.sleep(0.2)
        assert client.add_timeouts.watched == 0
        nursery.cancel_scope.cancel()


async def test_every_task_waiting_on_an_add_wakes_and_a_cancelled_one_leaves(autojump_clock):
    # Three tasks wait on one add, and a fourth wait is cancelled while they
    # do (it leaves the add's waiters): the three wake with its entry id
    # once it completes; waiting on a done add returns at once.
    import trio.testing

    async with trio.open_nursery() as nursery:
        client = StandInClient(nursery)
        handle = LedgerHandle(client.services, make_core(), b"key")
        pending = handle.submit_add_nowait(b"entry")
        woken: list[int] = []

        async def waiter() -> None:
            woken.append(await pending.wait())

        async with trio.open_nursery() as waiters:
            waiters.start_soon(waiter)
            waiters.start_soon(waiter)
            with trio.move_on_after(1):
                await pending.wait_done()  # cancelled after 1 s: it leaves the waiters
            waiters.start_soon(waiter)
            await trio.testing.wait_all_tasks_blocked()
            answer_ok(client, "b0")
            answer_ok(client, "b1")
        assert woken == [0, 0, 0]
        assert await pending.wait() == 0
        nursery.cancel_scope.cancel()
