"""A bookie never loses an acknowledged entry: kill -9 during pipelined adds,
twice in a row, across journal rolls and checkpoints; fences survive restarts;
a corrupt stored entry answers IO_ERROR, never NO_ENTRY."""

from __future__ import annotations

import hashlib

import trio

from ledger_client.bookie_client import BookieClient, BookieConnectionError
from bookie.protocol.entry_format import DigestManager, DigestType, master_key
from bookie.protocol import LAST_ADD_CONFIRMED, AddFlag, Status
from tests.integration.bookie_processes import BookieProcess, bookies  # noqa: F401  (fixture)
from tests.support import wait_until_async

PASSWORD = b"pw"
KEY = master_key(PASSWORD)


def payload(ledger_id: int, entry_id: int, size: int = 1024) -> bytes:
    seed = hashlib.sha256(f"{ledger_id}/{entry_id}".encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]


class PipelinedWriter:
    """Pipelines adds of one ledger to one bookie and records exactly what
    the bookie acknowledged."""

    def __init__(self, ledger_id: int, first_entry_id: int = 0) -> None:
        self.ledger_id = ledger_id
        self.digest = DigestManager(ledger_id, DigestType.CRC32C, PASSWORD)
        self.next_entry_id = first_entry_id
        self.sent: dict[int, bytes] = {}
        self.acknowledged: dict[int, bytes] = {}
        self.refused: dict[int, Status] = {}
        self.lost_connection = False

    def entry(self, entry_id: int) -> bytes:
        return self.digest.encode(entry_id, entry_id - 1, 0, payload(self.ledger_id, entry_id))

    async def run(self, address: str, *, count: int, window: int = 256) -> None:
        """Send `count` adds (or until the connection breaks)."""
        self.lost_connection = False
        done = trio.Event()
        outstanding = 0

        def on_response(entry_id: int, response) -> None:
            nonlocal outstanding
            outstanding -= 1
            if isinstance(response, BookieConnectionError):
                self.lost_connection = True
            elif response.status is Status.OK:
                assert (response.ledger_id, response.entry_id) == (self.ledger_id, entry_id)
                self.acknowledged[entry_id] = self.sent[entry_id]
            else:
                self.refused[entry_id] = response.status
            if outstanding == 0 and (self.lost_connection or self.next_entry_id >= end):
                done.set()

        end = self.next_entry_id + count
        try:
            async with BookieClient.connect(address, requests_in_flight_max=window) as client:
                while self.next_entry_id < end and not self.lost_connection:
                    entry_id = self.next_entry_id
                    self.sent[entry_id] = self.entry(entry_id)
                    outstanding += 1
                    self.next_entry_id += 1
                    await client.submit_add(
                        AddFlag.NONE, KEY, self.sent[entry_id], lambda response, entry_id=entry_id: on_response(entry_id, response)
                    )
                await done.wait()
        except BookieConnectionError:
            self.lost_connection = True


async def read_all(address: str, ledger_id: int, entry_ids) -> dict[int, bytes]:
    """Read every stored entry of the ledger (batch reads, gaps skipped)."""
    found: dict[int, bytes] = {}
    async with BookieClient.connect(address) as client:
        listing = await client.list_entries(ledger_id)
        assert listing.status is Status.OK, listing.status
        for first, last in listing.ranges:
            next_id = first
            while next_id <= last:
                response = await client.batch_read(ledger_id, next_id, entries_max=500)
                assert response.status is Status.OK, (next_id, response.status)
                for offset, data in enumerate(response.entries):
                    found[next_id + offset] = data
                next_id += len(response.entries)
    return found


async def kill_during_writes(bookie: BookieProcess, writer: PipelinedWriter, *, acknowledged_at_least: int, count: int) -> None:
    """Pipeline adds and kill -9 the bookie once enough were acknowledged."""
    async with trio.open_nursery() as nursery:
        nursery.start_soon(lambda: writer.run(bookie.address, count=count))
        target = len(writer.acknowledged) + acknowledged_at_least
        await wait_until_async(lambda: len(writer.acknowledged) >= target, deadline_s=60, what=f"{target} adds acknowledged", poll_s=0.005)
        bookie.kill()
    assert writer.lost_connection, "the writer should have seen the bookie die mid-stream"


def check_nothing_lost(stored: dict[int, bytes], writer: PipelinedWriter) -> None:
    missing = sorted(set(writer.acknowledged) - set(stored))
    assert not missing, f"{len(missing)} acknowledged entries lost, first {missing[:10]}"
    for entry_id, data in writer.acknowledged.items():
        assert stored[entry_id] == data, f"entry {entry_id} changed"
    # Nothing appears that was never sent, and what is there is what was sent
    # (an add in flight at the kill may or may not have made it).
    assert set(stored) <= set(writer.sent)
    for entry_id, data in stored.items():
        assert data == writer.sent[entry_id]


async def test_kill_9_during_pipelined_adds_loses_no_acknowledged_entry(bookies):
    bookie = await bookies.started()
    writer = PipelinedWriter(ledger_id=11)
    await kill_during_writes(bookie, writer, acknowledged_at_least=3000, count=200_000)
    acknowledged_before_restart = dict(writer.acknowledged)
    await bookie.started()
    stored = await read_all(bookie.address, 11, writer.sent)
    check_nothing_lost(stored, writer)
    assert writer.acknowledged == acknowledged_before_restart
    # The bookie's LAC is back too: the highest piggybacked on a durable entry.
    async with BookieClient.connect(bookie.address) as client:
        lac = (await client.read_lac(11)).last_add_confirmed
    assert lac >= max(writer.acknowledged) - 1


async def test_two_quick_kills_across_journal_rolls_and_checkpoints(bookies):
    # Small journal files and frequent checkpoints: the journal rolls and old
    # files are deleted while writes go on, so the mark moves many times.
    bookie = await bookies.started(
        "--journal-file-bytes-max", "1MiB", "--checkpoint-interval-ms", "100", "--write-cache-bytes", "2MiB"
    )
    writer = PipelinedWriter(ledger_id=12)
    await kill_during_writes(bookie, writer, acknowledged_at_least=6000, count=200_000)
    await bookie.started()
    # Kill again quickly, before the restarted bookie did much: the mark
    # written on restart must not have moved behind the replayed records.
    await kill_during_writes(bookie, writer, acknowledged_at_least=500, count=200_000)
    await bookie.started()
    await kill_during_writes(bookie, writer, acknowledged_at_least=4000, count=200_000)
    await bookie.started()
    stored = await read_all(bookie.address, 12, writer.sent)
    check_nothing_lost(stored, writer)
    journal_ids = sorted(int(path.name.split(".")[0], 16) for path in (bookie.journal_dir / "journal").iterdir())
    # Ids only grow, and the early files were deleted once covered.
    assert journal_ids[0] > 3, f"journal files did not roll and get deleted: {journal_ids}"


async def test_a_fence_survives_kill_9_and_recovery_adds_still_pass(bookies):
    bookie = await bookies.started()
    writer = PipelinedWriter(ledger_id=13)
    await writer.run(bookie.address, count=10)
    async with BookieClient.connect(bookie.address) as client:
        fence = await client.read(13, LAST_ADD_CONFIRMED, fence=True, master_key=KEY)
        assert (fence.status, fence.entry_id, fence.last_add_confirmed) == (Status.OK, 8, 8)
        refused = await client.add(writer.entry(10), KEY)
        assert refused.status is Status.FENCED
    await bookie.restarted()
    async with BookieClient.connect(bookie.address) as client:
        assert (await client.add(writer.entry(10), KEY)).status is Status.FENCED
        assert (await client.add(writer.entry(10), KEY, recovery=True)).status is Status.OK
        assert (await client.read(13, 10)).entry == writer.entry(10)
        # A ledger this bookie never saw can be fenced too; it stays fenced.
        never_seen = await client.read(14, LAST_ADD_CONFIRMED, fence=True, master_key=KEY)
        assert never_seen.status is Status.NO_ENTRY
    await bookie.restarted()
    async with BookieClient.connect(bookie.address) as client:
        assert (await client.add(PipelinedWriter(14).entry(0), KEY)).status is Status.FENCED


async def test_a_flipped_byte_in_an_entry_log_reads_as_io_error_never_no_entry(bookies):
    bookie = await bookies.started()
    writer = PipelinedWriter(ledger_id=15)
    await writer.run(bookie.address, count=50)
    assert len(writer.acknowledged) == 50
    assert bookie.terminate() == 0  # a clean stop checkpoints into the entry log
    bookie.flip_stored_byte(15, 20)
    await bookie.started()
    async with BookieClient.connect(bookie.address) as client:
        corrupt = await client.read(15, 20)
        assert corrupt.status is Status.IO_ERROR
        # Its neighbours are intact; a batch read stops before the bad one.
        assert (await client.read(15, 19)).entry == writer.acknowledged[19]
        batch = await client.batch_read(15, 10, entries_max=100)
        assert batch.status is Status.OK and batch.entries == [writer.acknowledged[e] for e in range(10, 20)]
        assert (await client.batch_read(15, 20)).status is Status.IO_ERROR
        # Absent is still absent.
        assert (await client.read(15, 50)).status is Status.NO_ENTRY


async def test_sigterm_under_load_stops_cleanly_and_loses_nothing(bookies):
    # Frequent checkpoints make it likely that a stop meets one running; the
    # final checkpoint must wait for it, and the exit must be clean. Three
    # rounds, so that such a meeting happens at least once in most runs.
    bookie = await bookies.started("--checkpoint-interval-ms", "50", "--write-cache-bytes", "1MiB")
    writer = PipelinedWriter(ledger_id=16)
    for _ in range(3):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: writer.run(bookie.address, count=200_000))
            target = len(writer.acknowledged) + 3000
            await wait_until_async(lambda: len(writer.acknowledged) >= target, deadline_s=60, what=f"{target} adds acknowledged", poll_s=0.005)
            code = await trio.to_thread.run_sync(bookie.terminate)
        assert code == 0, bookie.log_tail()
        assert "Traceback" not in bookie.log_tail(200)
        await bookie.started()
    check_nothing_lost(await read_all(bookie.address, 16, writer.sent), writer)
