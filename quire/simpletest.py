"""`quire bookie simpletest`: write entries to every writable bookie through
the bookie protocol, read them back (single reads, a batch read, the LAC, a
long poll), verify every digest, and print what happened."""

from __future__ import annotations

import dataclasses
import os
import time

import trio

from ledger_client.bookie_client import BookieClient
from bookie.protocol.entry_format import DigestManager, DigestType, master_key
from bookie.protocol import AddFlag, Status
from coordination.cluster_layout import ClusterLayout, list_bookies
from quire.metadata_access import open_metadata
from security.credentials import NO_CREDENTIALS, ClientCredentials


async def run_simpletest(zk_hosts: str, root: str, count: int, entry_bytes: int,
                         credentials: ClientCredentials = NO_CREDENTIALS) -> bool:
    async with open_metadata(zk_hosts, root) as metadata:
        bookies = await trio.to_thread.run_sync(lambda: list_bookies(metadata.store, ClusterLayout(), read_only=False))
    if not bookies:
        raise RuntimeError(f"no writable bookie is registered under {root} at {zk_hosts}")
    print(f"{len(bookies)} writable bookies registered: {', '.join(sorted(bookies))}")
    results = []
    for bookie_id, info in sorted(bookies.items()):
        # TLS where the bookie's registration says it serves TLS.
        shown = credentials if info.tls else dataclasses.replace(credentials, tls_context=None)
        results.append(await _exercise(bookie_id, info.address, count, entry_bytes, shown))
    return all(results)


async def _exercise(bookie_id: str, address: str, count: int, entry_bytes: int, credentials: ClientCredentials) -> bool:
    # Ledger ids normally come from ZooKeeper (the ledger client); this test
    # talks to bookies directly, so it picks a random one.
    ledger_id = int.from_bytes(os.urandom(7), "big")
    password = b"simpletest"
    key = master_key(password)
    digest = DigestManager(ledger_id, DigestType.CRC32C, password)
    payloads = [os.urandom(entry_bytes) for _ in range(count)]
    async with BookieClient.connect(address, credentials=credentials) as client:
        started = time.perf_counter()
        statuses: list[Status] = []
        done = trio.Event()
        total_length = 0
        for entry_id, payload in enumerate(payloads):
            total_length += len(payload)
            entry = digest.encode(entry_id, entry_id - 1, total_length, payload)

            def on_response(response, _count=count) -> None:
                statuses.append(getattr(response, "status", None))
                if len(statuses) == _count:
                    done.set()

            await client.submit_add(AddFlag.NONE, key, entry, on_response)
        await done.wait()
        write_s = time.perf_counter() - started
        failed_adds = sum(1 for status in statuses if status is not Status.OK)
        # The LAC a bookie knows is the one piggybacked on the last entry.
        lac = (await client.read_lac(ledger_id)).last_add_confirmed
        started = time.perf_counter()
        read_back = []
        next_entry = 0
        while next_entry < count:
            response = await client.batch_read(ledger_id, next_entry, entries_max=1000)
            if response.status is not Status.OK:
                break
            read_back.extend(response.entries)
            next_entry += len(response.entries)
        read_s = time.perf_counter() - started
        mismatches = 0
        for entry_id, raw in enumerate(read_back):
            if digest.decode(raw, expected_entry_id=entry_id).data != payloads[entry_id]:
                mismatches += 1
        single = await client.read(ledger_id, count - 1)
        # A long poll past the current LAC returns after its timeout with the LAC unchanged.
        poll_started = time.perf_counter()
        poll = await client.read(ledger_id, count, previous_lac=lac, timeout_ms=200)
        poll_ms = (time.perf_counter() - poll_started) * 1000
    megabytes = count * entry_bytes / 1e6
    # The bookie's LAC is the one piggybacked on the last entry; a long poll
    # past it must wait out its timeout and leave the LAC as it was.
    lac_ok = lac == count - 2
    poll_ok = poll.status is Status.NO_ENTRY and poll.last_add_confirmed == lac and poll_ms >= 190
    ok = (
        failed_adds == 0 and len(read_back) == count and mismatches == 0 and single.status is Status.OK
        and lac_ok and poll_ok
    )
    print(
        f"bookie {bookie_id} ({address}), ledger {ledger_id}:\n"
        f"  wrote {count} entries of {entry_bytes} bytes in {write_s * 1000:.0f} ms "
        f"({count / write_s:,.0f} entries/s, {megabytes / write_s:.1f} MB/s), {failed_adds} failed\n"
        f"  read back {len(read_back)} entries with batch reads in {read_s * 1000:.0f} ms, "
        f"{mismatches} digest or payload mismatches; last entry read alone: {single.status.name}\n"
        f"  LAC on the bookie: {lac} (the last entry carries LAC {count - 2}); "
        f"long poll past it: {poll.status.name} after {poll_ms:.0f} ms\n"
        f"  {'OK' if ok else 'FAILED'}"
    )
    return ok

