"""Producer deduplication: which batches are new, duplicates or still in
flight, the bounded producer map, and its rebuild after a takeover from a
snapshot plus the entries written after it. Scenario tests first, then
random interleavings of sends, completions and failures (hypothesis)."""

from __future__ import annotations

import json
from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.dedup import Dedup, DedupSnapshot, Verdict

# --- scenarios ----------------------------------------------------------------------


def send(dedup: Dedup, producer_id: str, last_sequence_id: int) -> Verdict:
    """What the broker does with a batch: ask, and hand a new one to storage."""
    verdict = dedup.check(producer_id, last_sequence_id)
    if verdict is Verdict.NEW:
        dedup.pushed(producer_id, last_sequence_id)
    return verdict


def write(dedup: Dedup, *batches: tuple[str, int]) -> None:
    """Batches sent and persisted, one after the other."""
    for producer_id, last_sequence_id in batches:
        assert send(dedup, producer_id, last_sequence_id) is Verdict.NEW
        dedup.persisted(producer_id, last_sequence_id)


def test_a_resent_batch_is_a_duplicate_once_persisted():
    # The producer resends sequence id 0 (it missed the receipt): while the
    # first copy is being written it must ask again, afterwards it is told
    # that the batch was persisted.
    dedup = Dedup()
    assert send(dedup, "p", 0) is Verdict.NEW
    assert dedup.check("p", 0) is Verdict.IN_FLIGHT
    dedup.persisted("p", 0)
    assert dedup.check("p", 0) is Verdict.DUPLICATE
    assert dedup.last_persisted("p") == 0
    assert dedup.check("p", 1) is Verdict.NEW


def test_ids_between_persisted_and_pushed_are_in_flight():
    # 3 is persisted, 7 is being written: 4..7 are "unknown, retry", 8 is new.
    dedup = Dedup()
    write(dedup, ("p", 3))
    send(dedup, "p", 7)
    assert [dedup.check("p", sequence_id) for sequence_id in (3, 4, 7, 8)] == [
        Verdict.DUPLICATE, Verdict.IN_FLIGHT, Verdict.IN_FLIGHT, Verdict.NEW,
    ]


def test_a_batch_is_judged_by_its_highest_sequence_id():
    # A batch 5..9 after 0..6 was persisted is new (as in Pulsar), though it
    # repeats 5 and 6.
    dedup = Dedup()
    write(dedup, ("p", 6))
    assert dedup.check("p", 9) is Verdict.NEW


def test_a_failed_write_lets_the_producer_send_the_batch_again():
    dedup = Dedup()
    write(dedup, ("p", 0))
    send(dedup, "p", 1)
    send(dedup, "p", 2)
    dedup.failed("p")
    assert dedup.check("p", 2) is Verdict.IN_FLIGHT  # batch 2 is still out
    dedup.failed("p")
    assert dedup.check("p", 1) is Verdict.NEW and dedup.check("p", 2) is Verdict.NEW
    assert dedup.check("p", 0) is Verdict.DUPLICATE


def test_producers_are_independent():
    dedup = Dedup()
    write(dedup, ("a", 5))
    assert dedup.check("b", 5) is Verdict.NEW and dedup.last_persisted("b") == -1


def test_settling_a_batch_never_pushed_is_a_bug():
    with pytest.raises(AssertionError):
        Dedup().persisted("p", 0)
    dedup = Dedup()
    send(dedup, "p", 4)
    with pytest.raises(AssertionError):
        dedup.pushed("p", 4)  # sequence ids of one producer increase


def test_the_least_recently_used_idle_producer_is_forgotten():
    # Three producers fit in a map of two: the one idle longest goes, even
    # if an older one is still writing; a forgotten producer's resend is
    # taken as new (as Pulsar forgets inactive producers).
    dedup = Dedup(producers_max=2)
    write(dedup, ("a", 0), ("b", 0))
    send(dedup, "a", 1)  # a is busy now
    write(dedup, ("c", 0))  # b is the one idle longest
    assert dedup.producer_count == 2
    assert dedup.last_persisted("b") == -1 and dedup.check("b", 0) is Verdict.NEW
    assert dedup.last_persisted("a") == 0 and dedup.check("a", 1) is Verdict.IN_FLIGHT


def test_a_busy_map_grows_past_its_bound_rather_than_forget_a_writing_producer():
    dedup = Dedup(producers_max=1)
    write(dedup, ("a", 0))
    send(dedup, "a", 1)
    write(dedup, ("b", 0))  # a is writing: b, idle, goes instead
    assert dedup.last_persisted("a") == 0 and dedup.last_persisted("b") == -1
    dedup.persisted("a", 1)
    assert dedup.producer_count == 1


def test_a_new_owner_rebuilds_the_map_from_the_snapshot_and_the_entries_after_it():
    # The snapshot was taken at entry 7; entries 8 and 9 were written after
    # it. The new owner replays them (an older entry replayed again, a's 0,
    # changes nothing) and judges resends as the old owner would.
    live = Dedup()
    write(live, ("a", 0), ("b", 0), ("a", 1))
    snapshot = live.snapshot(3, 7)
    write(live, ("b", 4), ("c", 0))
    record = json.loads(json.dumps(snapshot.to_record()))
    rebuilt = Dedup.from_snapshot(DedupSnapshot.from_record(record))
    for producer_id, sequence_id in (("a", 0), ("b", 4), ("c", 0)):
        rebuilt.replayed(producer_id, sequence_id)
    assert rebuilt.snapshot(3, 9) == live.snapshot(3, 9)
    assert rebuilt.check("b", 3) is Verdict.DUPLICATE and rebuilt.check("c", 1) is Verdict.NEW
    assert Dedup.from_snapshot(None).producer_count == 0


@pytest.mark.parametrize(
    "record",
    [
        {"ledger_id": "3", "entry_id": 7, "sequences": {}},
        {"ledger_id": 3, "entry_id": None, "sequences": {}},
        {"ledger_id": 3, "entry_id": 7, "sequences": []},
        {"ledger_id": 3, "entry_id": 7, "sequences": {"a": "1"}},
        {"ledger_id": 3, "entry_id": 7, "sequences": {"a": 1.5}},
    ],
)
def test_a_malformed_snapshot_record_is_refused(record):
    with pytest.raises(ValueError):
        DedupSnapshot.from_record(record)


def test_producers_max_must_be_positive():
    with pytest.raises(ValueError):
        Dedup(producers_max=0)


# --- properties ---------------------------------------------------------------------

PRODUCERS = ("a", "b", "c", "d")
dedup_operations = st.lists(
    st.one_of(
        # A producer sends a batch: a step forward (new), or back (a resend).
        st.tuples(st.just("send"), st.sampled_from(PRODUCERS), st.integers(-3, 3)),
        st.tuples(st.just("persist"), st.none(), st.none()),
        st.tuples(st.just("fail"), st.none(), st.none()),
        st.tuples(st.just("snapshot"), st.none(), st.none()),
    ),
    max_size=60,
)


class Partition:
    """The broker around a Dedup, as a model: batches complete in entry order
    (persisted or failed), and a plain record of what was persisted."""

    def __init__(self, dedup: Dedup) -> None:
        self.dedup = dedup
        self.pending: deque[tuple[str, int]] = deque()  # (producer, last sequence id) being written
        self.persisted: dict[str, int] = {}  # the model: highest persisted id per producer
        self.highest_sent = {producer_id: -1 for producer_id in PRODUCERS}
        self.log: list[tuple[str, int]] = []  # entries persisted, in order
        self.snapshot: tuple[DedupSnapshot, int] | None = None  # and how many entries it covers

    def expected(self, producer_id: str, sequence_id: int) -> Verdict:
        if sequence_id <= self.persisted.get(producer_id, -1):
            return Verdict.DUPLICATE
        if any(producer == producer_id and sequence_id <= pending for producer, pending in self.pending):
            return Verdict.IN_FLIGHT
        return Verdict.NEW

    def step(self, operation) -> None:
        name, producer_id, delta = operation
        if name == "send":
            sequence_id = max(0, self.highest_sent[producer_id] + delta)
            verdict = send(self.dedup, producer_id, sequence_id)
            self.check_verdict(producer_id, sequence_id, verdict)
            if verdict is Verdict.NEW:
                self.pending.append((producer_id, sequence_id))
                self.highest_sent[producer_id] = max(self.highest_sent[producer_id], sequence_id)
        elif name == "persist" and self.pending:
            producer_id, sequence_id = self.pending.popleft()
            self.dedup.persisted(producer_id, sequence_id)
            self.persisted[producer_id] = max(self.persisted.get(producer_id, -1), sequence_id)
            self.log.append((producer_id, sequence_id))
        elif name == "fail" and self.pending:
            producer_id, _ = self.pending.popleft()
            self.dedup.failed(producer_id)
        elif name == "snapshot" and self.log:
            # As the broker does: right after an entry is persisted, the map
            # as of that entry.
            self.snapshot = (self.dedup.snapshot(1, len(self.log) - 1), len(self.log))

    def check_verdict(self, producer_id: str, sequence_id: int, verdict: Verdict) -> None:
        assert verdict is self.expected(producer_id, sequence_id), (producer_id, sequence_id)

    def rebuilt(self) -> Dedup:
        snapshot, covered = self.snapshot or (None, 0)
        if snapshot is not None:
            snapshot = DedupSnapshot.from_record(json.loads(json.dumps(snapshot.to_record())))
        dedup = Dedup.from_snapshot(snapshot, producers_max=self.dedup.producers_max)
        for producer_id, sequence_id in self.log[covered:]:
            dedup.replayed(producer_id, sequence_id)
        return dedup


@settings(max_examples=300, deadline=None)
@given(dedup_operations)
def test_random_interleavings_match_the_model(operations):
    # Never NEW for an id at or below one persisted, IN_FLIGHT exactly while a
    # batch with that id or a higher one is unsettled.
    partition = Partition(Dedup())
    for operation in operations:
        partition.step(operation)
    for producer_id in PRODUCERS:
        assert partition.dedup.last_persisted(producer_id) == partition.persisted.get(producer_id, -1)
        for sequence_id in range(-1, partition.highest_sent[producer_id] + 2):
            assert partition.dedup.check(producer_id, sequence_id) is partition.expected(producer_id, sequence_id)


@settings(max_examples=300, deadline=None)
@given(dedup_operations)
def test_a_rebuilt_map_equals_the_live_one(operations):
    partition = Partition(Dedup())
    for operation in operations:
        partition.step(operation)
    rebuilt = partition.rebuilt()
    # The same producers, ids and least-recently-used order.
    assert list(rebuilt.snapshot(0, 0).sequences.items()) == list(partition.dedup.snapshot(0, 0).sequences.items())


class BoundedPartition(Partition):
    """With a small bound, the map forgets producers (a forgotten producer's
    resend is taken as new), but only idle ones, and it stays bounded."""

    def step(self, operation) -> None:
        busy = {producer for producer, _ in self.pending}
        for producer_id in list(self.persisted):
            if self.dedup.last_persisted(producer_id) == -1:
                assert producer_id not in busy, f"{producer_id} forgotten while writing"
                del self.persisted[producer_id]  # the model forgets it too
        super().step(operation)
        if operation[0] == "persist":
            busy = {producer for producer, _ in self.pending}
            assert self.dedup.producer_count <= max(self.dedup.producers_max, len(busy))


@settings(max_examples=300, deadline=None)
@given(dedup_operations, st.integers(1, 3))
def test_a_bounded_map_forgets_only_idle_producers(operations, producers_max):
    partition = BoundedPartition(Dedup(producers_max=producers_max))
    for operation in operations:
        partition.step(operation)
