"""Ledger metadata in a real ZooKeeper: the life of a ledger, creators on two
connections getting distinct ids (through generation rollovers too), and
concurrent updates from two connections that both land by re-applying."""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest

from coordination.async_store import AsyncMetadataStore
from coordination.store import BadVersionError
from coordination.zk_store import KazooMetadataStore
from ledger_client.errors import NoSuchLedgerError
from ledger_client.ledger_store import (
    ID_GENERATOR_PATH,
    LEDGERS_PATH,
    AsyncLedgerStore,
    LedgerStore,
    generation_path,
    ledger_path,
)
from ledger_client.metadata import LedgerMetadata, LedgerState
from tests.support import ledger_metadata_for

WAIT_S = 10  # bound on waiting for the other thread; never reached when all is well


@pytest.fixture
def stores(zk_hosts, zk_root):
    opened = [KazooMetadataStore.connect(zk_hosts, zk_root, session_timeout_ms=4_000) for _ in range(2)]
    yield opened
    for store in opened:
        store.close()


def run_together(*calls) -> list:
    """Run each call on its own thread, started together; their results."""
    start = threading.Barrier(len(calls))
    results: list = [None] * len(calls)
    errors: list[BaseException] = []

    def run(index: int) -> None:
        start.wait()
        try:
            results[index] = calls[index]()
        except BaseException as error:  # reported to the test below
            errors.append(error)

    threads = [threading.Thread(target=run, args=(index,)) for index in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=WAIT_S * 3)
    assert not any(thread.is_alive() for thread in threads), "a thread did not finish"
    if errors:
        raise errors[0]
    return results


def test_a_ledger_is_created_read_updated_listed_and_deleted(stores):
    store, _ = stores
    ledgers = LedgerStore(store)
    metadata, version = ledgers.create(ledger_metadata_for)
    assert store.get(ledger_path(metadata.ledger_id))[1].version == version == 0
    assert ledgers.read(metadata.ledger_id) == (metadata, 0)
    assert store.children(generation_path(0)) == []

    closed, version = ledgers.update(metadata.ledger_id, lambda m: m.with_closed(-1, 0))
    assert closed.state is LedgerState.CLOSED and version == 1
    with pytest.raises(BadVersionError):
        ledgers.write(metadata.with_recovery_started(), 0)
    second, _ = ledgers.create(ledger_metadata_for)
    assert ledgers.list_ledger_ids() == [metadata.ledger_id, second.ledger_id]

    ledgers.delete(metadata.ledger_id, expected_version=1)
    ledgers.delete(second.ledger_id)
    with pytest.raises(NoSuchLedgerError):
        ledgers.read(metadata.ledger_id)
    assert ledgers.list_ledger_ids() == []
    assert store.children(LEDGERS_PATH) == []  # emptied directories are gone


def test_creators_on_two_connections_get_distinct_ids_across_rollovers(stores):
    # A tiny sequence_max makes both creators roll over to new generations
    # many times while racing each other.
    first, second = (LedgerStore(store, sequence_max=7) for store in stores)

    def create_many(ledgers: LedgerStore) -> list[int]:
        return [ledgers.create(ledger_metadata_for)[0].ledger_id for _ in range(40)]

    first_ids, second_ids = run_together(lambda: create_many(first), lambda: create_many(second))
    assert first_ids == sorted(first_ids) and second_ids == sorted(second_ids)
    every_id = first_ids + second_ids
    assert len(set(every_id)) == 80
    # Eight ids a generation: 80 ids took at least ten generations.
    assert max(every_id) >= 9 * 2**31
    assert first.list_ledger_ids() == sorted(every_id)
    for name in stores[0].children(ID_GENERATOR_PATH):
        assert stores[0].children(f"{ID_GENERATOR_PATH}/{name}") == []


def test_concurrent_updates_from_two_connections_both_land(stores):
    first, second = (LedgerStore(store) for store in stores)
    metadata, _ = first.create(ledger_metadata_for)
    ledger_id = metadata.ledger_id

    # First, a race made certain: `second` updates between `first`'s read and
    # its write, so `first` must re-read and re-apply its change.
    first_has_read, second_has_written = threading.Event(), threading.Event()
    seen_by_first: list[LedgerMetadata] = []

    def tag(key: str):
        def change(current: LedgerMetadata) -> LedgerMetadata:
            seen_by_first.append(current)
            if len(seen_by_first) == 1:
                first_has_read.set()
                assert second_has_written.wait(WAIT_S)
            return _with_tag(current, key)

        return change

    def second_writes() -> None:
        assert first_has_read.wait(WAIT_S)
        second.update(ledger_id, lambda current: _with_tag(current, "second"))
        second_has_written.set()

    run_together(lambda: first.update(ledger_id, tag("first")), second_writes)
    assert len(seen_by_first) == 2 and "second" in seen_by_first[1].custom_metadata
    current, version = first.read(ledger_id)
    assert set(current.custom_metadata) == {"first", "second"} and version == 2

    # Then many updates at once, each of which must land exactly once.
    updates_per_writer = 15

    def tag_many(ledgers: LedgerStore, writer: str) -> None:
        for number in range(updates_per_writer):
            # Each conflict means the other writer landed one, so this bound
            # cannot be reached.
            ledgers.update(ledger_id, lambda m, key=f"{writer}-{number}": _with_tag(m, key),
                           attempts_max=updates_per_writer + 1)

    run_together(lambda: tag_many(first, "a"), lambda: tag_many(second, "b"))
    current, version = second.read(ledger_id)
    assert len(current.custom_metadata) == 2 + 2 * updates_per_writer
    assert version == 2 + 2 * updates_per_writer


def _with_tag(metadata: LedgerMetadata, key: str) -> LedgerMetadata:
    return replace(metadata, custom_metadata={**metadata.custom_metadata, key: b"1"})


async def test_the_trio_face_over_zookeeper(stores):
    ledgers = AsyncLedgerStore(AsyncMetadataStore(stores[0]))
    metadata, version = await ledgers.create(ledger_metadata_for)
    recovering, version = await ledgers.update(metadata.ledger_id, lambda m: m.with_recovery_started())
    assert (recovering, version) == await ledgers.read(metadata.ledger_id)
    assert await ledgers.list_ledger_ids() == [metadata.ledger_id]
    await ledgers.delete(metadata.ledger_id)
    assert await ledgers.list_ledger_ids() == []
