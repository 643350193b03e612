"""Auto-recovery against a real ZooKeeper and real bookie processes: with
the daemon embedded in every bookie, a bookie killed -9 for good has every
ledger it held re-replicated (closed ones, open 3/3/2 and 3/2/2 ones fenced
and closed after their grace period, and an open 3/2/1 one that recovery
could not close without the lost bookie once its writer replaced it) to
full write quorum on the others, byte for byte; with
bookies run `--no-autorecovery` and a standalone `quire autorecovery run`,
switched off, auto-recovery leaves the ledgers alone until switched on."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys

import pytest
import trio

from bookie.protocol.wire import Status
from ledger_client.bookie_client import BookieClient
from ledger_client.bookkeeper import BookKeeper
from ledger_client.errors import LedgerFencedError
from ledger_client.metadata import LedgerState
from tests.integration.bookie_processes import bookies  # noqa: F401  (fixture)
from tests.integration.processes import QuireProcess, print_logs
from tests.support import wait_until_async

PASSWORD = b"autorecovery"
AUTORECOVERY_OPTIONS = (
    "--lost-bookie-delay", "1s", "--open-ledger-grace", "3s", "--audit-interval", "60s",
    "--recovery-password", PASSWORD.decode(),
)
REPAIR_DEADLINE_S = 60.0


class AutoRecoveryProcess(QuireProcess):
    role = "autorecovery"

    def arguments(self) -> list[str]:
        return ["autorecovery", "run", "--zk", self.zk_hosts, "--root", self.root, "--name", "standalone"]


@pytest.fixture
def standalone_autorecovery(zk_hosts, zk_root, tmp_path):
    process = AutoRecoveryProcess(zk_hosts, zk_root, tmp_path / "autorecovery", 0, list(AUTORECOVERY_OPTIONS))
    try:
        yield process
    finally:
        process.kill()
        print_logs([process])


async def start_bookies(bookies, count: int, *options: str) -> list:
    started = [bookies.new(*(options or AUTORECOVERY_OPTIONS)) for _ in range(count)]
    for bookie in started:
        bookie.start()
    async with trio.open_nursery() as nursery:
        for bookie in started:
            nursery.start_soon(bookie.wait_serving)
    return started


async def write_ledger(bk, count: int, quorums: tuple[int, int, int], *, close: bool = True):
    lh = await bk.create_ledger(*quorums, password=PASSWORD)
    pending = [await lh.submit_add(b"ledger-%d-entry-%d" % (lh.ledger_id, index) + bytes(index % 200)) for index in range(count)]
    for add in pending:
        await add.wait()
    if close:
        await lh.close()
    return lh


def expected_payloads(ledger_id: int, count: int) -> dict[int, bytes]:
    return {index: b"ledger-%d-entry-%d" % (ledger_id, index) + bytes(index % 200) for index in range(count)}


def autorecovery_cli(zk_hosts: str, zk_root: str, *action: str) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "quire", "autorecovery", *action, "--zk", zk_hosts, "--root", zk_root],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


async def status(zk_hosts: str, zk_root: str) -> dict:
    return json.loads(await trio.to_thread.run_sync(autorecovery_cli, zk_hosts, zk_root, "status", "--json"))


async def wait_until_repaired(bk, ledger_ids, lost: str, zk_hosts: str, zk_root: str) -> dict:
    """Wait until no ledger's ensembles name `lost` and none is marked
    under-replicated; return the ledgers' metadata."""
    async def repaired() -> dict | None:
        metadata = {ledger_id: await bk.ledger_metadata(ledger_id) for ledger_id in ledger_ids}
        if all(lost not in m.all_bookies() for m in metadata.values()):
            if not (await status(zk_hosts, zk_root))["under_replicated"]:
                return metadata
        return None

    return await wait_until_async(repaired, deadline_s=REPAIR_DEADLINE_S, what=f"every ledger repaired away from {lost}",
                                  poll_s=0.25)


async def wait_for_log(processes, text: str) -> None:
    await wait_until_async(lambda: any(text in process.log_path.read_text(errors="replace") for process in processes),
                           deadline_s=REPAIR_DEADLINE_S, what=f"{text!r} in a log", poll_s=0.25)


async def check_every_replica(metadata, payloads: dict[int, bytes]) -> None:
    """Every entry reads back from every bookie of its write set, all the
    copies byte-identical and carrying the payload written."""
    async with contextlib.AsyncExitStack() as stack:
        clients = {
            bookie_id: await stack.enter_async_context(BookieClient.connect(bookie_id))
            for bookie_id in sorted(metadata.all_bookies())
        }
        for entry_id, payload in payloads.items():
            copies = set()
            for bookie_id in metadata.write_set(entry_id):
                response = await clients[bookie_id].read(metadata.ledger_id, entry_id)
                assert response.status is Status.OK, (metadata.ledger_id, entry_id, bookie_id, response.status)
                assert response.entry.endswith(payload), (metadata.ledger_id, entry_id, bookie_id)
                copies.add(response.entry)
            assert len(copies) == 1, (metadata.ledger_id, entry_id, "replicas differ")


async def test_a_bookie_lost_for_good_has_every_ledger_re_replicated(bookies, zk_hosts, zk_root):
    processes = await start_bookies(bookies, 4)
    async with BookKeeper.connect(zk_hosts, zk_root) as bk:
        written = {}  # ledger id -> entries
        for count, quorums in ((300, (3, 3, 2)), (200, (3, 2, 2)), (150, (3, 2, 1)), (0, (3, 3, 2)), (120, (2, 2, 2))):
            lh = await write_ledger(bk, count, quorums)
            written[lh.ledger_id] = count
        # Writers that stop adding but never close: their last fragment is
        # left to them for the grace period, then fenced, closed and copied.
        # With WQ = AQ too (3/2/2): an entry of a write set with the lost
        # bookie keeps one copy, which is enough for recovery.
        open_handle = await write_ledger(bk, 100, (3, 3, 2), close=False)
        written[open_handle.ledger_id] = 100
        equal_quorums_handle = await write_ledger(bk, 50, (3, 2, 2), close=False)
        written[equal_quorums_handle.ledger_id] = 50
        # Another with AQ = 1: fencing needs all three bookies, and the lost
        # one may hold the only copy of an acknowledged entry. It is left to
        # its writer.
        blocked_handle = await write_ledger(bk, 40, (3, 2, 1), close=False)
        # The victim: in all three open ledgers' ensembles (one of four
        # bookies at least is), the one holding the most ledgers.
        bookies_of = {
            ledger_id: (await bk.ledger_metadata(ledger_id)).all_bookies()
            for ledger_id in [*written, blocked_handle.ledger_id]
        }
        shared = bookies_of[open_handle.ledger_id] & bookies_of[equal_quorums_handle.ledger_id] & bookies_of[blocked_handle.ledger_id]
        victim_id = max(sorted(shared), key=lambda bookie_id: sum(bookie_id in bookies for bookies in bookies_of.values()))
        victim = next(process for process in processes if process.address == victim_id)
        held = [ledger_id for ledger_id in written if victim_id in bookies_of[ledger_id]]
        assert {open_handle.ledger_id, equal_quorums_handle.ledger_id} <= set(held) and len(held) >= 3

        victim.kill()
        # Past its grace period the blocked ledger is reported, not fenced.
        await wait_for_log(processes, f"ledger {blocked_handle.ledger_id} (OPEN, E=3 WQ=2 AQ=1)")
        blocked = await bk.ledger_metadata(blocked_handle.ledger_id)
        assert blocked.state is LedgerState.OPEN and victim_id in blocked.ensembles[-1][1]
        # Its writer was not fenced: its next adds replace the lost bookie
        # (two adds touch every position of a 3/2 ensemble), after which
        # its fragments are final and copied like the others'.
        for index in range(40, 42):
            await (await blocked_handle.submit_add(b"ledger-%d-entry-%d" % (blocked_handle.ledger_id, index) + bytes(index % 200))).wait()
        await blocked_handle.close()
        written[blocked_handle.ledger_id] = 42
        metadata = await wait_until_repaired(bk, list(written), victim_id, zk_hosts, zk_root)
        # The 3/2/2 ledger's writer was fenced: it can add nothing more.
        with pytest.raises(LedgerFencedError):
            await equal_quorums_handle.add(b"after the fence")

        for ledger_id, count in written.items():
            assert metadata[ledger_id].state is LedgerState.CLOSED
            assert metadata[ledger_id].last_entry_id == count - 1  # nothing acknowledged was lost
            await check_every_replica(metadata[ledger_id], expected_payloads(ledger_id, count))
        # The ledger client reads them too (any replica).
        rh = await bk.open_ledger(open_handle.ledger_id, PASSWORD)
        assert [entry.data async for entry in rh.read(0, 99)] == list(expected_payloads(open_handle.ledger_id, 100).values())
        report = await status(zk_hosts, zk_root)
        assert report["enabled"] and report["auditor"] is not None and report["under_replicated"] == []


async def test_switched_off_nothing_moves_until_switched_on(bookies, standalone_autorecovery, zk_hosts, zk_root):
    processes = await start_bookies(bookies, 4, "--no-autorecovery")
    standalone_autorecovery.start()
    async with BookKeeper.connect(zk_hosts, zk_root) as bk:
        written = {}
        for quorums in ((3, 3, 2), (3, 2, 2), (3, 3, 2)):
            lh = await write_ledger(bk, 100, quorums)
            written[lh.ledger_id] = lh.metadata
        async def standalone_audits() -> bool:  # the standalone daemon is the only candidate
            return (await status(zk_hosts, zk_root))["auditor"] == "standalone"

        await wait_until_async(standalone_audits, deadline_s=30, what="the standalone auditor", poll_s=0.2)
        assert (await status(zk_hosts, zk_root))["candidates"] == ["standalone"]  # none in the bookies
        await trio.to_thread.run_sync(autorecovery_cli, zk_hosts, zk_root, "disable")
        assert (await status(zk_hosts, zk_root))["enabled"] is False

        victim_id = next(iter(written.values())).ensembles[0][1][0]
        next(process for process in processes if process.address == victim_id).kill()
        # Five lost-bookie delays later, still nothing is marked or moved.
        with trio.move_on_after(5):
            while True:
                report = await status(zk_hosts, zk_root)
                assert report["under_replicated"] == [] and report["enabled"] is False
                for ledger_id, before in written.items():
                    assert (await bk.ledger_metadata(ledger_id)).ensembles == before.ensembles
                await trio.sleep(0.5)

        await trio.to_thread.run_sync(autorecovery_cli, zk_hosts, zk_root, "enable")
        metadata = await wait_until_repaired(bk, list(written), victim_id, zk_hosts, zk_root)
        for ledger_id in written:
            await check_every_replica(metadata[ledger_id], expected_payloads(ledger_id, 100))
    assert standalone_autorecovery.terminate(deadline_s=15) == 0  # SIGTERM stops it cleanly
