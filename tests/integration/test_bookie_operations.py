"""A running bookie under bad input and bad conditions: malformed frames,
wiped or swapped directories, a full disk, too many requests; plus its
registration, long polls and handshake."""

from __future__ import annotations

import shutil
import struct
import subprocess
import sys

import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ledger_client.bookie_client import BookieClient, BookieConnectionError
from bookie.protocol import (
    PROTOCOL_VERSION,
    AddFlag,
    AddRequest,
    Hello,
    Status,
    encode_hello,
    encode_request,
)
from framing.codec import encode_frame
from coordination.cluster_layout import ClusterLayout, list_bookies
from coordination.zk_store import KazooMetadataStore
from tests.integration.bookie_processes import bookies  # noqa: F401  (fixture)
from tests.integration.test_bookie_durability import KEY, PipelinedWriter, check_nothing_lost, read_all
from tests.support import raw_exchange, wait_until_async


def registrations(zk_hosts: str, root: str) -> dict[str, str]:
    with KazooMetadataStore.connect(zk_hosts, root) as store:
        return {
            info.address: ("read-only" if read_only else "writable")
            for read_only in (False, True)
            for info in list_bookies(store, ClusterLayout(), read_only=read_only).values()
        }


async def wait_for_registration(zk_hosts: str, root: str, address: str, state: str | None, deadline_s: float = 20) -> None:
    async def registered_as_wanted() -> bool:
        return await trio.to_thread.run_sync(lambda: registrations(zk_hosts, root).get(address)) == state

    await wait_until_async(registered_as_wanted, deadline_s=deadline_s, what=f"{address} registered as {state}", poll_s=0.1)


frames = st.one_of(
    st.binary(max_size=300),
    st.builds(lambda body: struct.pack(">I", len(body)) + body, st.binary(max_size=200)),
    st.builds(
        lambda fields: encode_frame(fields),
        st.lists(st.one_of(st.integers(-5, 10), st.binary(max_size=40), st.none(), st.text(max_size=5)), min_size=1, max_size=9),
    ),
    st.just(struct.pack(">I", 2**31)),  # far past the frame bound
    st.just(encode_request(AddRequest(1, AddFlag.NONE, KEY, b"too short for a header"))),
)


async def test_malformed_frames_close_only_their_connection(bookies):
    bookie = await bookies.started()
    writer = PipelinedWriter(ledger_id=21)
    await writer.run(bookie.address, count=200)
    async with BookieClient.connect(bookie.address) as healthy:

        @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
        @given(data=frames, handshake=st.booleans())
        def fuzz(data: bytes, handshake: bool) -> None:
            raw_exchange(bookie.address, data, prefix=encode_hello(Hello(PROTOCOL_VERSION, "fuzz")) if handshake else b"")

        await trio.to_thread.run_sync(fuzz)
        # The healthy connection opened before the fuzzing still works.
        assert (await healthy.read(21, 5)).entry == writer.acknowledged[5]
        assert bookie.running
    more = PipelinedWriter(ledger_id=21, first_entry_id=200)
    more.sent, more.acknowledged = writer.sent, writer.acknowledged
    await more.run(bookie.address, count=100)
    stored = await read_all(bookie.address, 21, more.sent)
    check_nothing_lost(stored, more)
    assert len(stored) == 300


async def test_a_client_of_another_protocol_version_is_refused(bookies):
    bookie = await bookies.started()
    with trio.fail_after(10):
        stream = await trio.open_tcp_stream("127.0.0.1", bookie.port)
        await stream.send_all(encode_hello(Hello(PROTOCOL_VERSION + 1, "future client")))
        reply = await stream.receive_some(1000)
        assert reply and Status.BAD_VERSION in reply[5:8]
        assert await stream.receive_some(1000) == b""  # then closed
        await stream.aclose()


async def test_a_wiped_ledger_directory_refuses_to_start(bookies):
    bookie = await bookies.started()
    await PipelinedWriter(ledger_id=22).run(bookie.address, count=10)
    assert bookie.terminate() == 0
    shutil.rmtree(bookie.ledger_dir)
    bookie.ledger_dir.mkdir()
    code, output = bookie.run_until_exit()
    assert code == 2
    assert "wiped or replaced" in output and "fence" in output and "Traceback" not in output
    # The operator's way out: format, then it starts as a new bookie.
    format_command = [
        sys.executable, "-m", "quire", "bookie", "format", "--zk", bookie.zk_hosts, "--root", bookie.root,
        "--bookie-id", bookie.address, "--journal-dir", str(bookie.journal_dir), "--ledger-dir", str(bookie.ledger_dir),
    ]
    refused = subprocess.run(format_command, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "--force" in refused.stderr
    formatted = subprocess.run(format_command + ["--force"], capture_output=True, text=True, timeout=60)
    assert formatted.returncode == 0, formatted.stderr
    info = await (await bookie.started()).wait_serving()
    assert info["ledgers"] == 0


async def test_swapped_directories_refuse_to_start(bookies):
    first = await bookies.started()
    second = await bookies.started()
    first.terminate()
    second.terminate()
    first.journal_dir.rename(first.directory / "journal-of-first")
    second.journal_dir.rename(first.journal_dir)
    code, output = first.run_until_exit()
    assert code == 2 and "belongs to another bookie" in output and "Traceback" not in output


async def test_past_the_disk_quota_the_bookie_turns_read_only_and_reads_still_work(bookies):
    bookie = await bookies.started(
        "--disk-quota-bytes", "24MiB", "--disk-check-interval-ms", "100", "--write-cache-bytes", "2MiB",
        "--checkpoint-interval-ms", "200",
    )
    await wait_for_registration(bookie.zk_hosts, bookie.root, bookie.address, "writable")
    writer = PipelinedWriter(ledger_id=23)
    with trio.fail_after(120):
        while Status.READ_ONLY not in writer.refused.values():
            await writer.run(bookie.address, count=2000)
    await wait_for_registration(bookie.zk_hosts, bookie.root, bookie.address, "read-only")
    async with BookieClient.connect(bookie.address) as client:
        info = (await client.get_info()).info
        assert info["read_only"] and "quota" in info["read_only_reason"]
        assert (await client.add(writer.entry(10**6), KEY)).status is Status.READ_ONLY
    stored = await read_all(bookie.address, 23, writer.sent)
    check_nothing_lost(stored, writer)
    # Restarted with its disk still over the quota, it starts read-only.
    bookie.terminate()
    info = await bookie.started()
    info = await bookie.wait_serving()
    assert info["read_only"]
    await wait_for_registration(bookie.zk_hosts, bookie.root, bookie.address, "read-only")


async def test_past_the_in_flight_bound_adds_get_too_many_requests(bookies):
    bookie = await bookies.started("--adds-in-flight-max", "4")
    writer = PipelinedWriter(ledger_id=24)
    await writer.run(bookie.address, count=2000, window=1000)
    assert Status.TOO_MANY_REQUESTS in writer.refused.values()
    assert len(writer.acknowledged) > 0
    stored = await read_all(bookie.address, 24, writer.sent)
    check_nothing_lost(stored, writer)


async def test_registration_follows_the_bookie(bookies):
    bookie = await bookies.started()
    await wait_for_registration(bookie.zk_hosts, bookie.root, bookie.address, "writable")
    assert bookie.terminate() == 0
    await wait_for_registration(bookie.zk_hosts, bookie.root, bookie.address, None, deadline_s=5)
    # After kill -9 the registration goes when the ZooKeeper session expires,
    # and a restarted bookie registers again once the stale one is gone.
    await bookie.started()
    await wait_for_registration(bookie.zk_hosts, bookie.root, bookie.address, "writable")
    bookie.kill()
    await wait_for_registration(bookie.zk_hosts, bookie.root, bookie.address, None, deadline_s=20)
    await bookie.started()
    await wait_for_registration(bookie.zk_hosts, bookie.root, bookie.address, "writable")


async def test_a_long_poll_returns_when_the_lac_moves(bookies):
    bookie = await bookies.started()
    writer = PipelinedWriter(ledger_id=25)
    await writer.run(bookie.address, count=3)  # LAC 1 on the bookie
    async with BookieClient.connect(bookie.address) as reader:
        async with trio.open_nursery() as nursery:
            answers = []

            async def poll() -> None:
                answers.append(await reader.read(25, 2, previous_lac=1, timeout_ms=20_000))

            nursery.start_soon(poll)
            # The bookie holds the poll (it says so) until the LAC moves.
            async def holding() -> bool:
                return (await reader.get_info()).info["long_poll_waiters"] == 1

            await wait_until_async(holding, deadline_s=10, what="the bookie to hold the long poll")
            assert answers == []
            await writer.run(bookie.address, count=1)  # entry 3 carries LAC 2
        (answer,) = answers
        assert (answer.status, answer.last_add_confirmed, answer.entry) == (Status.OK, 2, writer.acknowledged[2])


async def test_a_bookie_that_cannot_be_reached_fails_clearly():
    try:
        async with BookieClient.connect("127.0.0.1:1"):
            raise AssertionError("connected to nothing")
    except BookieConnectionError as error:
        assert "127.0.0.1:1" in str(error)


async def test_an_add_with_an_entry_id_past_the_signed_range_is_a_bad_request_for_that_client_only(bookies):
    # Ids are signed 64-bit, as in BookKeeper; the header has room for more.
    from bookie.protocol import DigestManager, DigestType

    bookie = await bookies.started()
    huge = DigestManager(26, DigestType.CRC32C, b"pw").encode(2**63, 0, 0, b"x")
    async with BookieClient.connect(bookie.address) as client:
        assert (await client.add(huge, KEY)).status is Status.BAD_REQUEST
    writer = PipelinedWriter(ledger_id=27)
    await writer.run(bookie.address, count=100)
    assert len(writer.acknowledged) == 100 and not writer.refused
    info = await bookie.wait_serving()
    assert not info["read_only"] and not info["journal_failed"]


async def test_a_wiped_index_refuses_to_start(bookies):
    bookie = await bookies.started()
    writer = PipelinedWriter(ledger_id=28)
    await writer.run(bookie.address, count=20)
    async with BookieClient.connect(bookie.address) as client:
        assert (await client.read(28, -1, fence=True, master_key=KEY)).status is Status.OK
    assert bookie.terminate() == 0
    shutil.rmtree(bookie.ledger_dir / "index")
    code, output = bookie.run_until_exit()
    assert code == 2 and "index" in output and "wiped" in output and "Traceback" not in output


async def test_a_bookie_starts_read_only_when_its_disk_is_past_the_threshold(bookies):
    # Any file system is fuller than 1%: the bookie must start read-only,
    # register so, refuse adds and still serve reads.
    bookie = await bookies.started("--disk-usage-threshold", "0.01", "--disk-usage-lwm", "0.01")
    info = await bookie.wait_serving()
    assert info["read_only"] and "threshold" in info["read_only_reason"]
    await wait_for_registration(bookie.zk_hosts, bookie.root, bookie.address, "read-only")
    writer = PipelinedWriter(ledger_id=29)
    await writer.run(bookie.address, count=5)
    assert set(writer.refused.values()) == {Status.READ_ONLY}
