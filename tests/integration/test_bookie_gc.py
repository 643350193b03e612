"""Garbage collection in real bookie processes against a real ZooKeeper:
ledgers written through the ledger client, some deleted with
`bk.delete_ledger`; the bookies drop them, remove and compact entry logs, and
every live ledger reads back byte for byte, also while a reader streams one
during compaction."""

from __future__ import annotations

import hashlib

import trio

from ledger_client.bookie_client import BookieClient
from ledger_client.bookkeeper import BookKeeper
from tests.integration.bookie_processes import BookieProcess, bookies  # noqa: F401  (fixture)
from tests.support import wait_until_async

PASSWORD = b"pw"
ENTRY_BYTES = 4000
ENTRIES = 150  # per ledger: about 600 KB
LEDGERS = 6
DEADLINE_S = 20
# Small entry logs (the least a bookie takes) and frequent checkpoints, so
# that a few megabytes fill several logs; a small read cache, so that reads
# go to the entry logs that compaction moves entries out of.
BOOKIE_OPTIONS = (
    "--gc-interval-s", "0.3", "--gc-compaction-threshold", "0.7", "--entry-log-bytes-max", "1048576",
    "--checkpoint-interval-ms", "200", "--read-cache-bytes", "65536",
)


def payload(ledger_index: int, entry_id: int) -> bytes:
    seed = hashlib.sha256(b"%d/%d" % (ledger_index, entry_id)).digest()
    return (seed * (ENTRY_BYTES // len(seed) + 1))[:ENTRY_BYTES]


def entry_log_bytes(bookie: BookieProcess) -> int:
    return sum(path.stat().st_size for path in (bookie.ledger_dir / "entrylogs").glob("*.log"))


async def bookie_info(bookie: BookieProcess) -> dict:
    async with BookieClient.connect(bookie.address) as client:
        return (await client.get_info()).info


async def start_three(bookies) -> list[BookieProcess]:
    started = [bookies.new(*BOOKIE_OPTIONS) for _ in range(3)]
    for bookie in started:
        bookie.start()
    async with trio.open_nursery() as nursery:
        for bookie in started:
            nursery.start_soon(bookie.wait_serving)
    return started


async def write_interleaved(bk) -> list:
    """LEDGERS closed ledgers on all three bookies, written side by side so
    that every checkpoint, and so every entry log, holds some of each."""
    handles = [await bk.create_ledger(3, 3, 2, password=PASSWORD) for _ in range(LEDGERS)]
    for first in range(0, ENTRIES, 10):
        pending = [
            await handle.submit_add(payload(index, entry_id))
            for entry_id in range(first, first + 10)
            for index, handle in enumerate(handles)
        ]
        for add in pending:
            await add.wait()
    for handle in handles:
        await handle.close()
    return handles


async def read_ledger(bk, ledger_id: int) -> list[bytes]:
    rh = await bk.open_ledger(ledger_id, PASSWORD, recovery=False)
    return [entry.data async for entry in rh.read(0, rh.last_add_confirmed)]


async def wait_for(condition, what: str) -> None:
    """Poll an async condition until it holds; fail after DEADLINE_S."""
    await wait_until_async(condition, deadline_s=DEADLINE_S, what=what, poll_s=0.1)


async def checkpointed(started: list[BookieProcess], total_bytes: int) -> None:
    async def all_in_entry_logs() -> bool:
        return all(entry_log_bytes(bookie) >= total_bytes for bookie in started)

    await wait_for(all_in_entry_logs, "every entry in the bookies' entry logs")


async def test_deleted_ledgers_give_their_disk_back_and_live_ones_read_back_whole(bookies, zk_hosts, zk_root):
    started = await start_three(bookies)
    async with BookKeeper.connect(zk_hosts, zk_root) as bk:
        handles = await write_interleaved(bk)
        await checkpointed(started, LEDGERS * ENTRIES * ENTRY_BYTES)
        before = {bookie.address: entry_log_bytes(bookie) for bookie in started}
        deleted = [handle.ledger_id for handle in handles[::2]]
        for ledger_id in deleted:
            await bk.delete_ledger(ledger_id)

        async def reclaimed() -> bool:
            for bookie in started:
                info = await bookie_info(bookie)
                if info["gc_ledgers_dropped"] < len(deleted) or entry_log_bytes(bookie) > 0.65 * before[bookie.address]:
                    return False
            return True

        await wait_for(reclaimed, "the bookies to drop the deleted ledgers and reclaim their space")
        for bookie in started:
            info = await bookie_info(bookie)
            assert info["ledgers"] == LEDGERS - len(deleted)
            assert info["gc_entry_logs_compacted"] + info["gc_entry_logs_deleted"] >= 1
            assert info["gc_bytes_reclaimed"] > 0
        for index, handle in enumerate(handles):
            if handle.ledger_id not in deleted:
                assert await read_ledger(bk, handle.ledger_id) == [payload(index, e) for e in range(ENTRIES)]


async def test_a_reader_streaming_a_live_ledger_through_compaction_sees_every_entry(bookies, zk_hosts, zk_root):
    started = await start_three(bookies)
    async with BookKeeper.connect(zk_hosts, zk_root) as bk:
        handles = await write_interleaved(bk)
        await checkpointed(started, LEDGERS * ENTRIES * ENTRY_BYTES)
        streamed = handles[1]
        expected = [payload(1, entry_id) for entry_id in range(ENTRIES)]
        passes = 0
        compacted = trio.Event()

        async def stream() -> None:
            # Whole passes over the live ledger, until every bookie has
            # compacted, and one more pass after that.
            nonlocal passes
            while True:
                last_pass = compacted.is_set()
                assert await read_ledger(bk, streamed.ledger_id) == expected, f"pass {passes} read something else"
                passes += 1
                if last_pass:
                    return

        async def compacted_everywhere() -> bool:
            # Compacted, and every deleted ledger noticed: ledgers deleted
            # while a collection runs are dropped by the next one.
            infos = [await bookie_info(bookie) for bookie in started]
            return all(info["gc_entry_logs_compacted"] >= 1 and info["ledgers"] == 1 for info in infos)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(stream)
            for handle in handles:
                if handle is not streamed:
                    await bk.delete_ledger(handle.ledger_id)
            await wait_for(compacted_everywhere, "every bookie to compact an entry log and drop the deleted ledgers")
            compacted.set()
        assert passes >= 2
        for bookie in started:
            info = await bookie_info(bookie)
            assert info["gc_compactions_aborted"] == 0 and info["ledgers"] == 1
