"""The ledger client against a real ZooKeeper and real bookie processes:
quorum writes across a bookie killed -9 (ensemble change), fencing of a
writer by a recoverer, recovery past a corrupted replica, two recoverers at
once, and a reader tailing an open ledger."""

from __future__ import annotations

import contextlib

import pytest
import trio

from bookie.protocol.wire import Status
from ledger_client.bookie_client import BookieClient
from ledger_client.bookkeeper import BookKeeper
from ledger_client.errors import BKError, LedgerFencedError
from ledger_client.ledger_handle import ENTRY_BYTES_MAX
from ledger_client.metadata import LedgerState
from tests.integration.bookie_processes import bookies  # noqa: F401  (fixture)
from tests.support import wait_until_async

PASSWORD = b"secret"


async def start_bookies(bookies, count: int) -> list:
    started = []
    async with trio.open_nursery() as nursery:
        for _ in range(count):
            bookie = bookies.new()
            bookie.start()
            started.append(bookie)
        for bookie in started:
            nursery.start_soon(bookie.wait_serving)
    return started


async def ledger_with_entries(bk, count: int, prefix: bytes, quorums=(3, 3, 2)):
    """A ledger holding entries prefix + index for index < count (still open)."""
    lh = await bk.create_ledger(*quorums, password=PASSWORD)
    for index in range(count):
        await lh.add(prefix + b"%d" % index)
    return lh


async def read_from_every_replica(metadata, expected: dict[int, bytes], *, may_lack: str | None = None) -> None:
    """Every entry reads back, byte for byte, from every bookie of its write
    set in the closed metadata (bookie ids are their addresses here), and
    from at least AQ of them. Only `may_lack`, a bookie killed -9 while adds
    were in flight to it, may miss entries it never acknowledged: an add
    completes at AQ, and re-replicating the rest is auto-recovery's job."""
    bookie_ids = sorted(metadata.all_bookies())
    async with contextlib.AsyncExitStack() as stack:
        clients = {bookie_id: await stack.enter_async_context(BookieClient.connect(bookie_id)) for bookie_id in bookie_ids}
        for entry_id, payload in expected.items():
            holders = 0
            for bookie_id in metadata.write_set(entry_id):
                response = await clients[bookie_id].read(metadata.ledger_id, entry_id)
                if response.status is Status.NO_ENTRY and bookie_id == may_lack:
                    continue
                assert response.status is Status.OK, (entry_id, bookie_id, response.status, metadata.ensembles)
                assert response.entry.endswith(payload), (entry_id, bookie_id)
                holders += 1
            assert holders >= metadata.ack_quorum, (entry_id, holders)


async def test_write_close_and_read_back(bookies, zk_hosts, zk_root):
    # The plain path: pipelined adds, close, reopen, read everything back.
    await start_bookies(bookies, 3)
    async with BookKeeper.connect(zk_hosts, zk_root) as bk:
        lh = await bk.create_ledger(3, 3, 2, password=PASSWORD)
        # An entry too large for a bookie's frame is refused before the
        # ledger takes it, and does not block the entries after it.
        with pytest.raises(ValueError, match="at most"):
            await lh.submit_add(bytes(ENTRY_BYTES_MAX + 1))
        pending = [await lh.submit_add(b"entry-%d" % index) for index in range(200)]
        assert [await add.wait() for add in pending] == list(range(200))
        assert lh.last_add_confirmed == 199
        await lh.close()
        assert lh.metadata.state is LedgerState.CLOSED and lh.metadata.last_entry_id == 199
        rh = await bk.open_ledger(lh.ledger_id, PASSWORD)
        assert rh.last_add_confirmed == 199
        entries = [entry async for entry in rh.read(0, 199)]
        assert [entry.data for entry in entries] == [b"entry-%d" % index for index in range(200)]
        assert rh.length == sum(len(b"entry-%d" % index) for index in range(200))
        assert lh.ledger_id in await bk.list_ledgers()


async def _kill_during_adds(bookies, zk_hosts, zk_root, *, bookie_count, ensemble_size, write_quorum, ack_quorum):
    processes = await start_bookies(bookies, bookie_count)
    by_address = {bookie.address: bookie for bookie in processes}
    acknowledged: dict[int, bytes] = {}
    async with BookKeeper.connect(zk_hosts, zk_root, add_timeout_ms=3_000) as bk:
        lh = await bk.create_ledger(ensemble_size, write_quorum, ack_quorum, password=PASSWORD)
        first_ensemble = lh.metadata.last_ensemble[1]
        victim = by_address[first_ensemble[1]]

        async def write(count: int) -> None:
            pending = []
            for index in range(count):
                payload = b"payload-%06d" % (len(acknowledged) + len(pending))
                pending.append((payload, await lh.submit_add(payload)))
            for payload, add in pending:
                acknowledged[await add.wait()] = payload

        await write(300)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(write, 600)
            await trio.sleep(0)  # the adds are in flight
            victim.kill()
        await write(300)  # and writing goes on after the change
        await lh.close()
        metadata = lh.metadata
    assert len(metadata.ensembles) >= 2, metadata.ensembles
    assert victim.address not in metadata.last_ensemble[1]
    assert metadata.last_entry_id == max(acknowledged) == 1199
    # The killed bookie holds the entries of the first ensemble: bring it
    # back to check every replica.
    await victim.started()
    await read_from_every_replica(metadata, acknowledged, may_lack=victim.address)


async def test_kill_one_bookie_of_three_during_adds(bookies, zk_hosts, zk_root):
    await _kill_during_adds(bookies, zk_hosts, zk_root, bookie_count=4, ensemble_size=3, write_quorum=3, ack_quorum=2)


async def test_kill_one_bookie_of_five_during_adds(bookies, zk_hosts, zk_root):
    await _kill_during_adds(bookies, zk_hosts, zk_root, bookie_count=6, ensemble_size=5, write_quorum=3, ack_quorum=2)


async def test_a_recoverer_fences_a_writer_that_keeps_writing(bookies, zk_hosts, zk_root):
    # The first writer goes on adding while a second client recovers the
    # ledger: after the close it never gets another acknowledgement, and the
    # closed ledger holds every entry it saw acknowledged.
    await start_bookies(bookies, 3)
    acknowledged: dict[int, bytes] = {}
    errors: list[BKError] = []
    async with BookKeeper.connect(zk_hosts, zk_root) as writer_bk, BookKeeper.connect(zk_hosts, zk_root) as recoverer_bk:
        lh = await writer_bk.create_ledger(3, 3, 2, password=PASSWORD)
        recovered = trio.Event()

        async def keep_writing() -> None:
            index = 0
            while True:
                payload = b"w-%d" % index
                index += 1
                try:
                    entry_id = await lh.add(payload)
                except BKError as error:
                    errors.append(error)
                    return
                assert not recovered.is_set() or entry_id <= closed_at, "acknowledged after the close"
                acknowledged[entry_id] = payload

        closed_at = None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(keep_writing)
            await wait_until_async(lambda: len(acknowledged) >= 100, deadline_s=30, what="100 adds acknowledged")
            rh = await recoverer_bk.open_ledger(lh.ledger_id, PASSWORD, recovery=True)
            closed_at = rh.metadata.last_entry_id
            recovered.set()
        assert errors and isinstance(errors[0], LedgerFencedError), errors
        assert rh.metadata.state is LedgerState.CLOSED
        assert closed_at >= max(acknowledged)
        read_back = {entry.entry_id: entry.data async for entry in rh.read(0, closed_at)}
        for entry_id, payload in acknowledged.items():
            assert read_back[entry_id] == payload


async def test_two_recoverers_end_with_the_same_close(bookies, zk_hosts, zk_root):
    await start_bookies(bookies, 3)
    async with BookKeeper.connect(zk_hosts, zk_root) as writer_bk:
        lh = await ledger_with_entries(writer_bk, 50, b"x")
        results = []
        async with BookKeeper.connect(zk_hosts, zk_root) as first, BookKeeper.connect(zk_hosts, zk_root) as second:
            async def recover(bk) -> None:
                rh = await bk.open_ledger(lh.ledger_id, PASSWORD)
                results.append(rh.metadata)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(recover, first)
                nursery.start_soon(recover, second)
        assert len(results) == 2 and results[0] == results[1]
        assert results[0].last_entry_id == 49


async def test_a_reader_tails_an_open_ledger(bookies, zk_hosts, zk_root):
    await start_bookies(bookies, 3)
    async with BookKeeper.connect(zk_hosts, zk_root) as writer_bk, BookKeeper.connect(zk_hosts, zk_root) as reader_bk:
        lh = await writer_bk.create_ledger(3, 3, 2, password=PASSWORD)
        seen: list[int] = []

        async def tail() -> None:
            rh = await reader_bk.open_ledger(lh.ledger_id, PASSWORD, recovery=False)
            async for entry in rh.tail(0):
                assert entry.data == b"t-%d" % entry.entry_id
                seen.append(entry.entry_id)
                if entry.entry_id == 298:  # the LAC once entry 299 is added
                    return

        async with trio.open_nursery() as nursery:
            nursery.start_soon(tail)
            for index in range(300):
                await lh.add(b"t-%d" % index)
                if index % 50 == 0:
                    await trio.sleep(0.05)  # pacing: the reader also tails while the writer pauses
        assert seen == list(range(299))


async def test_recovery_reads_past_a_corrupted_copy_of_the_last_entry(bookies, zk_hosts, zk_root):
    # The writer dies with its ledger open; one bookie's copy of the last
    # entry is damaged on disk. Recovery takes the entry from the other
    # replicas and does not truncate the ledger.
    processes = await start_bookies(bookies, 3)
    by_address = {bookie.address: bookie for bookie in processes}
    payloads = [b"c-%d" % index for index in range(40)]
    async with BookKeeper.connect(zk_hosts, zk_root) as writer_bk:
        lh = await writer_bk.create_ledger(3, 3, 2, password=PASSWORD)
        for payload in payloads:
            await lh.add(payload)
        ledger_id, ensemble = lh.ledger_id, lh.metadata.last_ensemble[1]
        # The writer's client goes away without closing the ledger.
    damaged = by_address[ensemble[0]]
    assert damaged.terminate() == 0  # a clean stop checkpoints the entries into the entry log
    damaged.flip_stored_byte(ledger_id, 39, from_end=2)
    await damaged.started()
    async with BookieClient.connect(damaged.address) as client:
        assert (await client.read(ledger_id, 39)).status is Status.IO_ERROR
    async with BookKeeper.connect(zk_hosts, zk_root) as bk:
        rh = await bk.open_ledger(ledger_id, PASSWORD)
        assert rh.metadata.last_entry_id == 39
        assert [entry.data async for entry in rh.read(0, 39)] == payloads


async def test_the_sync_facade_for_code_that_is_not_async(bookies, zk_hosts, zk_root):
    from ledger_client.sync import BookKeeper as SyncBookKeeper

    await start_bookies(bookies, 3)

    def plain_code() -> tuple[int, list[bytes]]:
        with SyncBookKeeper.connect(zk_hosts, zk_root) as bk:
            lh = bk.create_ledger(ensemble_size=3, write_quorum=3, ack_quorum=2, password=PASSWORD)
            for index in range(20):
                assert lh.add(b"s-%d" % index) == index
            lh.close()
            rh = bk.open_ledger(lh.ledger_id, password=PASSWORD)
            data = [entry.data for entry in rh.read(0, rh.last_add_confirmed)]
            bk.delete_ledger(lh.ledger_id)
            assert lh.ledger_id not in bk.list_ledgers()
            return rh.last_add_confirmed, data

    last, data = await trio.to_thread.run_sync(plain_code)
    assert last == 19 and data == [b"s-%d" % index for index in range(20)]


async def test_every_way_to_add_writes_the_same_ledger(bookies, zk_hosts, zk_root):
    # add from many tasks, add_many, and a writer with a window: one ledger,
    # every entry once, in the order each caller handed them over.
    await start_bookies(bookies, 3)
    async with BookKeeper.connect(zk_hosts, zk_root, pending_adds_max=64) as bk:
        lh = await bk.create_ledger(3, 3, 2, password=PASSWORD)
        with pytest.raises(ValueError, match="at most"):
            await lh.add_many([b"fine", bytes(ENTRY_BYTES_MAX + 1)])  # checked first: neither is added
        assert await lh.add_many([]) == []
        # More entries than the pending-adds bound: add_many waits for room.
        assert await lh.add_many([b"many-%d" % index for index in range(150)]) == list(range(150))
        async with lh.writer(window=16) as writer:
            for index in range(200):
                pending = await writer.add(b"writer-%d" % index)
                assert writer.in_flight <= 16
        assert writer.last_entry_id == 349 and pending.done and pending.entry_id == 349
        with pytest.raises(ValueError, match="window"):
            lh.writer(window=0)
        ids: dict[int, bytes] = {}

        async def one(index: int) -> None:
            ids[await lh.add(b"task-%d" % index)] = b"task-%d" % index

        async with trio.open_nursery() as nursery:
            for index in range(100):
                nursery.start_soon(one, index)
        assert sorted(ids) == list(range(350, 450))
        await lh.close()
        rh = await bk.open_ledger(lh.ledger_id, PASSWORD)
        data = [entry.data async for entry in rh.read(0, 449)]
    assert data[:350] == [b"many-%d" % index for index in range(150)] + [b"writer-%d" % index for index in range(200)]
    assert {entry_id: data[entry_id] for entry_id in ids} == ids


async def test_a_writer_raises_the_failure_of_its_adds(bookies, zk_hosts, zk_root):
    # A recoverer closes the ledger under a writer: the writer's next add
    # (or the end of its block) raises the fencing, never an acknowledgement.
    await start_bookies(bookies, 3)
    async with BookKeeper.connect(zk_hosts, zk_root) as bk, BookKeeper.connect(zk_hosts, zk_root) as recoverer:
        lh = await bk.create_ledger(3, 3, 2, password=PASSWORD)
        with pytest.raises(BKError):
            async with lh.writer(window=8) as writer:
                for index in range(20):
                    await writer.add(b"w-%d" % index)
                await writer.flush()
                await recoverer.open_ledger(lh.ledger_id, PASSWORD)  # fences the ledger at entry 19
                for index in range(20, 1000):
                    await writer.add(b"w-%d" % index)
        assert writer.last_entry_id == 19


async def test_the_sync_writer_keeps_a_window_in_flight(bookies, zk_hosts, zk_root):
    from ledger_client.sync import BookKeeper as SyncBookKeeper

    await start_bookies(bookies, 3)

    def plain_code() -> tuple[int, list[bytes], list[int]]:
        with SyncBookKeeper.connect(zk_hosts, zk_root, pending_adds_max=32) as bk:
            lh = bk.create_ledger(ensemble_size=3, write_quorum=3, ack_quorum=2, password=PASSWORD)
            with lh.writer(window=64) as writer:  # wider than the ledger's bound: it waits for room
                for index in range(500):
                    writer.add(b"sync-%d" % index)
                with pytest.raises(TypeError):
                    writer.add("text")  # refused in the caller's thread, nothing added
            many = lh.add_many([b"after-%d" % index for index in range(3)])
            lh.close()
            rh = bk.open_ledger(lh.ledger_id, password=PASSWORD)
            return writer.last_entry_id, [entry.data for entry in rh.read(0, rh.last_add_confirmed)], many

    last, data, many = await trio.to_thread.run_sync(plain_code)
    assert last == 499 and many == [500, 501, 502]
    assert data == [b"sync-%d" % index for index in range(500)] + [b"after-%d" % index for index in range(3)]


async def test_reads_move_on_from_a_bookie_that_stopped_answering(bookies, zk_hosts, zk_root):
    # A bookie frozen with SIGSTOP keeps its connections open but answers
    # nothing: reads give up on it after the read timeout and use the others.
    import signal

    processes = await start_bookies(bookies, 3)
    async with BookKeeper.connect(zk_hosts, zk_root) as bk:
        lh = await ledger_with_entries(bk, 30, b"f-")
        await lh.close()
        rh = await bk.open_ledger(lh.ledger_id, PASSWORD)
        assert (await rh.read_entry(0)).data == b"f-0"  # connections are open now
        frozen = next(bookie for bookie in processes if bookie.address == rh.metadata.write_set(1)[0])
        frozen.process.send_signal(signal.SIGSTOP)
        try:
            with trio.fail_after(30):
                assert (await rh.read_entry(1)).data == b"f-1"
                assert [entry.data async for entry in rh.read(0, 29)] == [b"f-%d" % index for index in range(30)]
        finally:
            frozen.process.send_signal(signal.SIGCONT)


async def test_striped_ledger_reads_and_a_missing_entry_error(bookies, zk_hosts, zk_root):
    # E=4 > WQ=2: no bookie holds a whole range, so ranges are read entry by
    # entry; past the end of an open ledger's LAC the error is a plain one.
    from ledger_client.errors import NoSuchEntryError

    await start_bookies(bookies, 4)
    async with BookKeeper.connect(zk_hosts, zk_root) as bk:
        lh = await ledger_with_entries(bk, 50, b"s-", quorums=(4, 2, 2))
        await lh.close()
        rh = await bk.open_ledger(lh.ledger_id, PASSWORD)
        assert [entry.data async for entry in rh.read(0, 49)] == [b"s-%d" % index for index in range(50)]
        with pytest.raises(NoSuchEntryError):
            await rh.read_entry(50)
