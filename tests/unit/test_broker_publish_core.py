"""The publishing core, driven directly: what a (re)connecting producer is
told while batches of its earlier connection are unanswered, what a batch
gets (taken, duplicate, retry, over quota, unloading), and the snapshots of
the deduplication map (due every N entries, one write at a time, at load and
at a graceful unload)."""

from __future__ import annotations

from broker.errors import BrokerStatus
from broker.publish_core import TAKE, TAKE_DEDUPLICATED, AccessMode, ProducerAnswer, PublishCore


def test_a_reconnecting_producer_waits_for_its_earlier_batches():
    core = PublishCore("p")
    assert core.add_producer("a", "link-1") == (ProducerAnswer.OK, -1)
    assert core.add_producer("a", "link-2") == (ProducerAnswer.BUSY, -1)
    core.taken("a")
    assert core.judge("a", 0, 4, stored_bytes=0, backlog_quota_bytes=None).status is BrokerStatus.OK
    core.pushed("a", 0, 4, TAKE_DEDUPLICATED)
    core.remove_producer("a", "link-1")  # its connection broke, the batch is still being written
    assert core.add_producer("a", "link-2") == (ProducerAnswer.WAIT, -1)
    core.persisted("a", 0, 4, (7, 0), TAKE_DEDUPLICATED)
    assert core.finished("a") is True
    assert core.add_producer("a", "link-2") == (ProducerAnswer.OK, 4)


def test_what_a_batch_gets():
    core = PublishCore("p")
    judge = lambda first, last, **kw: core.judge("a", first, last, stored_bytes=kw.get("stored", 0),
                                                   backlog_quota_bytes=kw.get("quota"))
    assert judge(0, 2).status is BrokerStatus.OK
    core.pushed("a", 0, 2, TAKE_DEDUPLICATED)
    assert judge(0, 2).status is BrokerStatus.RETRY  # still being written
    core.persisted("a", 0, 2, (1, 0), TAKE_DEDUPLICATED)
    assert judge(1, 2).status is BrokerStatus.DUPLICATE  # judged by its last sequence id
    assert judge(3, 3, stored=100, quota=100).status is BrokerStatus.PARTITION_OVERFLOW
    core.deduplication = False
    assert judge(0, 2).status is BrokerStatus.OK
    core.stop("unloading")
    assert judge(5, 5).status is BrokerStatus.TOPIC_FENCED
    assert core.add_producer("b", "link")[0] is ProducerAnswer.FENCED


def test_snapshots_are_due_every_n_entries_and_written_one_at_a_time():
    core = PublishCore("p", snapshot_entries=2)
    assert core.restore(None) is None
    for sequence_id in range(4):
        core.pushed("a", sequence_id, sequence_id, TAKE_DEDUPLICATED)
        due = core.persisted("a", sequence_id, sequence_id, (1, sequence_id), TAKE_DEDUPLICATED)
        assert due is (sequence_id % 2 == 1)
        if sequence_id == 1:
            first = core.next_snapshot()
            assert first.entry_id == 1 and first.sequences == {"a": 1}
    assert core.next_snapshot() is None  # the first is still being written
    newer = core.snapshot_written(first, 0)
    assert newer.entry_id == 3 and core.snapshot_version == 0
    assert core.snapshot_written(newer, 1) is None
    assert core.final_snapshot() is None  # nothing new since


def test_a_new_owner_restores_replays_and_writes_what_it_starts_from():
    core = PublishCore("p")
    covered = core.restore(({"ledger_id": 3, "entry_id": 9, "sequences": {"a": 5}}, 4))
    assert covered == (3, 9) and core.last_persisted("a") == 5
    core.replayed("a", 8)
    core.replayed("b", 1)
    snapshot = core.loaded((4, 1))
    assert (snapshot.ledger_id, snapshot.entry_id) == (4, 1) and snapshot.sequences == {"a": 8, "b": 1}
    assert core.snapshot_version == 4  # the write is a compare-and-set against the stored version
    unreadable = PublishCore("q")
    assert unreadable.restore(({"ledger_id": "x"}, 0)) is None  # every entry is replayed instead


def test_a_batch_keeps_the_deduplication_policy_it_was_judged_under():
    # The policy changes while batches are being written: each batch is
    # finished as it was judged, so the map never hears of a batch it did
    # not see pushed, and never keeps one in flight.
    core = PublishCore("p", deduplication=False)
    plain = core.judge("a", 0, 0, stored_bytes=0, backlog_quota_bytes=None)
    assert plain == TAKE
    core.pushed("a", 0, 0, plain)
    core.deduplication = True
    deduplicated = core.judge("a", 1, 1, stored_bytes=0, backlog_quota_bytes=None)
    assert deduplicated == TAKE_DEDUPLICATED
    core.pushed("a", 1, 1, deduplicated)
    core.persisted("a", 0, 0, (1, 0), plain)  # no assertion: the map never saw it pushed
    core.deduplication = False
    core.persisted("a", 1, 1, (1, 1), deduplicated)
    assert core.last_persisted("a") == 1
    core.deduplication = True
    assert core.judge("a", 2, 2, stored_bytes=0, backlog_quota_bytes=None) == TAKE_DEDUPLICATED  # nothing left in flight


def test_producer_access_modes():
    core: PublishCore[str] = PublishCore("p")
    assert core.add_producer("shared-1", "link-shared-1") == (ProducerAnswer.OK, -1)
    # Exclusive access is refused while another producer is there; waiting
    # for it is told to wait.
    assert core.add_producer("exclusive-1", "link-x", AccessMode.EXCLUSIVE)[0] is ProducerAnswer.EXCLUDED
    assert core.add_producer("waiter-1", "link-w", AccessMode.WAIT_FOR_EXCLUSIVE)[0] is ProducerAnswer.WAIT_EXCLUSIVE
    assert core.remove_producer("shared-1", "link-shared-1")
    assert core.add_producer("waiter-1", "link-w", AccessMode.WAIT_FOR_EXCLUSIVE)[0] is ProducerAnswer.OK
    assert core.exclusive == "waiter-1" and core.topic_epoch == 1
    # Nobody else while it has the partition to itself, shared or exclusive.
    assert core.add_producer("shared-2", "link-shared-2")[0] is ProducerAnswer.EXCLUDED
    assert core.add_producer("exclusive-2", "link-x2", AccessMode.EXCLUSIVE)[0] is ProducerAnswer.EXCLUDED
    # Except one that fences it out: the driver closes the fenced one, and
    # shared producers stay out while the fencer is there.
    assert core.add_producer("fencer-1", "link-f", AccessMode.EXCLUSIVE_WITH_FENCING)[0] is ProducerAnswer.OK
    assert core.take_fenced() == ["link-w"] and core.take_fenced() == []
    assert set(core.producers) == {"fencer-1"} and core.topic_epoch == 2
    assert not core.remove_producer("waiter-1", "link-w")  # closed by the driver: no longer registered
    assert core.add_producer("shared-2", "link-shared-2")[0] is ProducerAnswer.EXCLUDED
    assert core.remove_producer("fencer-1", "link-f")
    assert core.add_producer("shared-2", "link-shared-2")[0] is ProducerAnswer.OK
