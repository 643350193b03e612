"""A full disk is a state, not a crash (BookKeeper's semantics): a bookie
whose ledger directory (and, in one layout, its journal too) is a small
tmpfs is filled by writes through the ledger client until it turns
read-only. It never exits, never lets a flush take the disk's last bytes,
serves every read of what it acknowledged, says why it is read-only (GET_INFO,
`quire bookie info`, the metrics, the log), holds a checkpoint that no longer
fits instead of failing it, starts read-only (not refusing) when restarted
full, and turns writable again by itself once files are removed, with
every acknowledged entry still there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from bookie.protocol import Status
from bookie.protocol.entry_format import master_key
from ledger_client.bookie_client import BookieClient
from ledger_client.bookkeeper import BookKeeper
from ledger_client.errors import BKError
from tests.integration.bookie_processes import bookies  # noqa: F401  (fixture)
from tests.integration.test_bookie_operations import wait_for_registration
from tests.integration.test_metrics import scrape_async, value
from tests.support import cannot_run_here, free_port, wait_until_async

MIB = 1024 * 1024
DISK_BYTES = 64 * MIB
PASSWORD = b"full disk"
ENTRY_BYTES = 16 * 1024
PIPELINE = 32


@pytest.fixture
def small_disk(tmp_path):
    """A 64 MiB tmpfs, always unmounted (lazily if a process still holds it)."""
    mount_point = tmp_path / "disk"
    mount_point.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK_BYTES}", "tmpfs", str(mount_point)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        cannot_run_here(f"cannot mount a tmpfs here: {mounted.stderr.strip() or mounted.returncode}")
    try:
        yield mount_point
    finally:
        if subprocess.run(["umount", str(mount_point)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mount_point)], capture_output=True)


def free_bytes(path: Path) -> int:
    stats = os.statvfs(path)
    return stats.f_bavail * stats.f_frsize


def fill(path: Path, leave_bytes: int) -> None:
    """A filler file that leaves about `leave_bytes` free on the disk."""
    size = free_bytes(path.parent) - leave_bytes
    assert size > 0, f"only {free_bytes(path.parent)} bytes free, wanted to leave {leave_bytes}"
    chunk = b"\1" * MIB
    with open(path, "ab") as filler:
        while size > 0:
            filler.write(chunk[: min(size, len(chunk))])
            size -= len(chunk)


def payload(ledger_id: int, index: int) -> bytes:
    head = b"%d/%d/" % (ledger_id, index)
    return (head * (ENTRY_BYTES // len(head) + 1))[:ENTRY_BYTES]


async def write_until_refused(zk_hosts: str, zk_root: str, acknowledged: dict[tuple[int, int], bytes]) -> int:
    """Write one ledger (a single bookie) until the bookie refuses adds;
    record what it acknowledged. Returns the ledger id."""
    async with BookKeeper.connect(zk_hosts, zk_root) as bk:
        ledger = await bk.create_ledger(1, 1, 1, password=PASSWORD)
        index = 0
        with trio.fail_after(180):
            while True:
                pending = []
                for _ in range(PIPELINE):
                    data = payload(ledger.ledger_id, index)
                    index += 1
                    pending.append((await ledger.submit_add(data), data))
                refused = False
                for add, data in pending:
                    try:
                        entry_id = await add.wait()
                    except BKError:
                        refused = True
                        continue
                    acknowledged[(ledger.ledger_id, entry_id)] = data
                if refused:
                    return ledger.ledger_id


async def write_one_ledger(bookie, entries: int) -> dict[tuple[int, int], bytes]:
    """A closed ledger of `entries` entries on the one bookie; what was acknowledged."""
    acknowledged: dict[tuple[int, int], bytes] = {}
    async with BookKeeper.connect(bookie.zk_hosts, bookie.root) as bk:
        ledger = await bk.create_ledger(1, 1, 1, password=PASSWORD)
        for index in range(entries):
            data = payload(ledger.ledger_id, index)
            acknowledged[(ledger.ledger_id, await ledger.add(data))] = data
        await ledger.close()
    return acknowledged


async def read_everything(address: str, acknowledged: dict[tuple[int, int], bytes]) -> None:
    """Every acknowledged entry reads back from the bookie, byte for byte."""
    by_ledger: dict[int, list[int]] = {}
    for ledger_id, entry_id in acknowledged:
        by_ledger.setdefault(ledger_id, []).append(entry_id)
    async with BookieClient.connect(address) as client:
        for ledger_id, entry_ids in by_ledger.items():
            found: dict[int, bytes] = {}
            next_id, last = min(entry_ids), max(entry_ids)
            while next_id <= last:
                response = await client.batch_read(ledger_id, next_id, entries_max=200)
                assert response.status is Status.OK, (ledger_id, next_id, response.status)
                assert response.entries, (ledger_id, next_id)
                for offset, data in enumerate(response.entries):
                    found[next_id + offset] = data
                next_id += len(response.entries)
            for entry_id in entry_ids:
                assert found[entry_id].endswith(acknowledged[(ledger_id, entry_id)]), (ledger_id, entry_id)


async def get_info(address: str) -> dict:
    async with BookieClient.connect(address) as client:
        return (await client.get_info()).info


def cli_info(address: str) -> dict:
    done = subprocess.run([sys.executable, "-m", "quire", "bookie", "info", address], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


async def wait_for_info(bookie, condition, what: str, deadline_s: float = 30) -> dict:
    async def matching():
        assert bookie.running, f"the bookie exited:\n{bookie.log_tail()}"
        info = await get_info(bookie.address)
        return info if condition(info) else None

    return await wait_until_async(matching, deadline_s=deadline_s, what=what, poll_s=0.1)


async def reads_for(bookie, acknowledged, seconds: float) -> int:
    """Read everything acknowledged again and again for `seconds`; the
    bookie must stay up and answer every read."""
    passes = 0
    with trio.move_on_after(seconds):
        while True:
            assert bookie.running, f"the bookie exited:\n{bookie.log_tail()}"
            await read_everything(bookie.address, acknowledged)
            passes += 1
            await trio.sleep(0.2)
    assert bookie.running
    return passes


async def watch_free_space(directory: Path, low: list[int]) -> None:
    while True:
        low[0] = min(low[0], free_bytes(directory))
        await trio.sleep(0.02)


async def disk_full_scenario(bookies, small_disk: Path, *, shared_journal: bool, read_s: float) -> None:
    metrics_port = free_port()
    options = [
        "--ledger-dir", str(small_disk / "ledgers"),
        "--disk-check-interval-ms", "100", "--write-cache-bytes", "4MiB", "--entry-log-bytes-max", "2MiB",
        "--checkpoint-interval-ms", "500", "--gc-interval-s", "1", "--metrics-port", str(metrics_port),
    ]
    if shared_journal:
        # One file system for both: the journal's reserve (two 4 MiB
        # preallocation chunks and a batch) is kept free by every flush.
        options += ["--journal-dir", str(small_disk / "journal"), "--journal-file-bytes-max", "4MiB"]
    else:
        options += ["--journal-file-bytes-max", "1MiB"]
    # Most of the disk goes to a filler, so that writes fill the rest quickly
    # (a shared journal keeps 9 MiB of it, and has 4 MiB files of its own).
    fill(small_disk / "filler-1", leave_bytes=(36 if shared_journal else 24) * MIB)
    bookie = bookies.new(*options)
    await bookie.started()
    await wait_for_registration(bookie.zk_hosts, bookie.root, bookie.address, "writable")

    # Written until the bookie turns read-only; the disk never fills (every
    # flush leaves a 2 MiB margin, and with a shared journal its reserve,
    # which only the journal may use), and nothing ever meets ENOSPC.
    acknowledged: dict[tuple[int, int], bytes] = {}
    lowest = [DISK_BYTES]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch_free_space, small_disk, lowest)
        await write_until_refused(bookie.zk_hosts, bookie.root, acknowledged)
        info = await wait_for_info(bookie, lambda info: info["read_only"], "the bookie to turn read-only")
        await trio.sleep(2)  # flushes and garbage collection go on
        nursery.cancel_scope.cancel()
    assert len(acknowledged) > 400, len(acknowledged)
    assert lowest[0] >= 1 * MIB, lowest[0]
    info = await get_info(bookie.address)
    assert info["read_only"] and info["read_only_reason"], info
    assert "disk" in info["read_only_reason"] or "checkpoint held" in info["read_only_reason"]
    await wait_for_registration(bookie.zk_hosts, bookie.root, bookie.address, "read-only")
    assert cli_info(bookie.address)["read_only_reason"] == (await get_info(bookie.address))["read_only_reason"]
    samples = await scrape_async(metrics_port)
    assert value(samples, "quire_bookie_read_only") == 1
    assert sum(value(samples, "quire_bookie_read_only_reason", reason=reason) for reason in ("disk_full", "checkpoint_held")) >= 1
    assert value(samples, "quire_bookie_read_only_reason", reason="journal_failed") == 0

    # Fuller still (an outside writer): a fence, which a read-only bookie
    # still journals, dirties a ledger's state, and the checkpoint that would
    # write it is held for room, not failed.
    fill(small_disk / "filler-2", leave_bytes=(6 if shared_journal else 1) * MIB)
    ledger_id = next(iter(acknowledged))[0]
    async with BookieClient.connect(bookie.address) as client:
        fenced = await client.read(ledger_id, fence=True, master_key=master_key(PASSWORD))
        assert fenced.status is Status.OK, fenced.status
    info = await wait_for_info(bookie, lambda info: "checkpoint held" in info["read_only_reason"], "the checkpoint to be held")
    assert info["checkpoint_held_bytes"] > 0
    samples = await scrape_async(metrics_port)
    assert value(samples, "quire_bookie_read_only_reason", reason="checkpoint_held") == 1
    assert value(samples, "quire_bookie_checkpoint_held_bytes") > 0

    # Reads go on, for as long as it stays full.
    assert await reads_for(bookie, acknowledged, read_s) >= 1

    # Restarted full (kill -9: what the journal holds past the mark is
    # replayed and cannot be flushed): it starts read-only, not refusing.
    bookie.kill()
    await bookie.started()
    info = await get_info(bookie.address)
    assert info["read_only"] and "checkpoint held" in info["read_only_reason"], info
    await wait_for_registration(bookie.zk_hosts, bookie.root, bookie.address, "read-only")
    await reads_for(bookie, acknowledged, min(read_s, 5))

    # Space comes back: writable again by itself, the held checkpoint written.
    (small_disk / "filler-1").unlink()
    (small_disk / "filler-2").unlink()
    info = await wait_for_info(bookie, lambda info: not info["read_only"], "the bookie to turn writable again")
    assert info["read_only_reason"] == "" and info["checkpoint_held_bytes"] == 0
    await wait_for_registration(bookie.zk_hosts, bookie.root, bookie.address, "writable")
    await read_everything(bookie.address, acknowledged)
    acknowledged.update(await write_one_ledger(bookie, entries=20))
    # A clean restart finds nothing left to replay that it cannot flush.
    assert bookie.terminate() == 0
    await bookie.started()
    info = await get_info(bookie.address)
    assert not info["read_only"], info
    await read_everything(bookie.address, acknowledged)
    log = bookie.log_path.read_text(errors="replace")
    assert "No space left on device" not in log
    assert "Traceback" not in log and "CRITICAL" not in log
    # The log says so once per change, not once per check.
    assert log.count("bookie turns read-only") <= 3, log.count("bookie turns read-only")


# `small_disk` comes first: set up before the bookies, it is unmounted after they are stopped.
async def test_a_full_ledger_disk_leaves_the_bookie_read_only_and_serving(small_disk, bookies):
    await disk_full_scenario(bookies, small_disk, shared_journal=False, read_s=30)


async def test_a_journal_on_the_full_disk_keeps_its_reserve(small_disk, bookies):
    await disk_full_scenario(bookies, small_disk, shared_journal=True, read_s=10)


@pytest.mark.slow(seconds=230)
@pytest.mark.parametrize("shared_journal", [False, True])
async def test_a_full_disk_for_minutes(small_disk, bookies, shared_journal):
    await disk_full_scenario(bookies, small_disk, shared_journal=shared_journal, read_s=180)


async def test_a_bookie_started_on_a_full_journal_disk_turns_writable_once_there_is_room(small_disk, bookies):
    # Its journal cannot start a new file (a file is preallocated 4 MiB at a
    # time, and 1 MiB is free): it starts read-only, serving, and used to
    # stay so until restarted. Each disk check now tries again.
    fill(small_disk / "filler", leave_bytes=1 * MIB)
    bookie = bookies.new("--journal-dir", str(small_disk / "journal"), "--disk-check-interval-ms", "100")
    await bookie.started()
    info = await get_info(bookie.address)
    assert info["read_only"] and "journal has no file: cannot start a new journal file" in info["read_only_reason"], info
    await wait_for_registration(bookie.zk_hosts, bookie.root, bookie.address, "read-only")

    (small_disk / "filler").unlink()
    info = await wait_for_info(bookie, lambda info: not info["read_only"], "the bookie to turn writable by itself")
    assert info["read_only_reason"] == "" and not info["journal_failed"], info
    await wait_for_registration(bookie.zk_hosts, bookie.root, bookie.address, "writable")
    acknowledged = await write_one_ledger(bookie, entries=20)
    await read_everything(bookie.address, acknowledged)
    log = bookie.log_path.read_text(errors="replace")
    assert "journal_no_file cleared" in log
    assert "Traceback" not in log and "CRITICAL" not in log
