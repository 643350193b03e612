"""A LedgerHandle over a stand-in pool (no bookies, no network): what the
handle does with its bookies' answers once its core completes adds."""

import logging

import trio

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


class StandInClient:
    """What a LedgerHandle uses of its BookKeeper."""

    def __init__(self, nursery: trio.Nursery) -> None:
        self.pool = StandInPool()
        self.registry = StandInRegistry()
        self.nursery = nursery


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
        handle = LedgerHandle(client, make_core(), b"key", pending_adds_max=3)
        handle.start(nursery)
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
