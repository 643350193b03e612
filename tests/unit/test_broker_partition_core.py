"""The partition core, driven directly with a real `PublishCore` and a real
`ManagedLedgerCore` (opened, appended to, rolled over and trimmed through
its own commands and events): the order of a load (open, snapshot, replay
after the position the snapshot covers, the snapshot this owner starts
from, the cursors in order, serve), the deduplication snapshots while
serving (one write at a time, the newest due one next), the order of an
unload (graceful: close, finish with writes, final snapshot after the one
in flight; fenced: finish without writes, nothing more written), a timed
out unload, late answers after an unload during a load, and failures."""

from __future__ import annotations

import collections

import pytest

from broker import managed_ledger_core as mlc
from broker.dedup import DedupSnapshot
from broker.entry_cache import Position
from broker.errors import BrokerStatus
from broker.managed_ledger_core import ManagedLedgerCore
from broker.partition_core import (
    REPLAY_ENTRIES_PER_READ,
    CloseLedger,
    Command,
    Fence,
    FinishSubscriptions,
    LoadFailed,
    OpenLedger,
    PartitionCore,
    Phase,
    ReadCursors,
    ReadEntries,
    ReadSnapshot,
    Serve,
    Stopped,
    WriteCursor,
    WriteSnapshot,
)
from broker.publish_core import ProducerAnswer, PublishCore
from broker.topic_records import ManagedLedgerRecord, TopicPolicies

# Any ledger holding an entry may be rolled over at will, and a trim drops
# every closed ledger but the last (retention 0, nothing held).
POLICIES = TopicPolicies(rollover_entries=1, rollover_min_time_ms=0, retention_time_ms=0)
NOW = 1_000


# --- a chain of ledgers, as owners before this one left it ---------------------------------


class History:
    """What earlier owners left: the managed ledger of the last of them (a
    real core, driven through its commands and events) and the entries
    they persisted, as (position, producer id, last sequence id)."""

    def __init__(self, first_ledger_id: int = 10) -> None:
        core = ManagedLedgerCore("p", POLICIES)
        assert core.open() == [mlc.ReadRecord()]
        assert core.record_read(None) == [mlc.CreateRecord()]
        assert core.record_read((ManagedLedgerRecord(), 0)) == [mlc.CreateLedger(POLICIES)]
        core.ledger_created(first_ledger_id, NOW)
        assert core.record_written(1, NOW) == [mlc.Writable(first_ledger_id)]
        self.core = core
        self.next_ledger_id = first_ledger_id + 1
        self.entries: list[tuple[Position, str, int]] = []

    def append(self, producer_id: str, last_sequence_id: int) -> Position:
        core = self.core
        slot = core.next_append(NOW)
        assert slot is not None
        core.appended(slot, 1)
        entry_id = core.open_state.entries
        core.add_persisted(slot.ledger_id, slot.first_offset, 1, 100, NOW)
        position = Position(slot.ledger_id, entry_id)
        self.entries.append((position, producer_id, last_sequence_id))
        return position

    def roll_over(self) -> None:
        core = self.core
        assert core.rollover(NOW) == [mlc.CloseLedger(core.current_ledger_id)]
        assert core.ledger_closed(NOW) == [mlc.CreateLedger(POLICIES)]
        core.ledger_created(self.next_ledger_id, NOW)
        assert core.record_written(core.version + 1, NOW) == [mlc.Writable(self.next_ledger_id)]
        self.next_ledger_id += 1

    def trim(self) -> tuple[int, ...]:
        """Retention drops every closed ledger but the last (and their entries)."""
        core = self.core
        (write,) = core.trim(held_from_offset=None, now_ms=NOW)
        assert isinstance(write, mlc.WriteRecord)
        writable, delete = core.record_written(core.version + 1, NOW)
        assert writable == mlc.Writable(core.current_ledger_id, new_ledger=False)
        self.entries = [entry for entry in self.entries if entry[0].ledger_id not in delete.ledger_ids]
        return delete.ledger_ids

    def take_over(self, core: ManagedLedgerCore) -> int:
        """`core` (a new owner's) opens the chain: the previous owner's open
        ledger is recovered (fenced and closed), a new one is recorded.
        Returns the new ledger's id."""
        previous = self.core
        last = previous.current_ledger_id
        state = previous.open_state
        assert core.open() == [mlc.ReadRecord()]
        assert core.record_read((previous.record, previous.version)) == [mlc.RecoverLedger(last)]
        last_offset = previous.confirmed_offset if state.entries else None
        assert core.ledger_recovered(last, state.entries, state.bytes, last_offset, NOW if state.entries else None,
                                     NOW) == [mlc.CreateLedger(POLICIES)]
        ledger_id = self.next_ledger_id
        self.next_ledger_id += 1
        core.ledger_created(ledger_id, NOW)
        assert core.record_written(previous.version + 1, NOW) == [mlc.Writable(ledger_id)]
        self.core = core
        return ledger_id

    def new_owner(self) -> None:
        """Another owner takes the chain over and writes to a ledger of its own."""
        self.take_over(ManagedLedgerCore("p", POLICIES))

    def read(self, position: Position, count: int) -> list[tuple[Position, str, int]]:
        """A ledger read: up to `count` entries of `position`'s ledger, from it on."""
        index = [entry[0] for entry in self.entries].index(position)
        return [entry for entry in self.entries[index:index + count] if entry[0].ledger_id == position.ledger_id]


def open_fresh(core: ManagedLedgerCore, ledger_id: int = 50) -> int:
    """A partition nobody ever wrote: no record yet."""
    assert core.open() == [mlc.ReadRecord()]
    assert core.record_read(None) == [mlc.CreateRecord()]
    assert core.record_read((ManagedLedgerRecord(), 0)) == [mlc.CreateLedger(POLICIES)]
    core.ledger_created(ledger_id, NOW)
    assert core.record_written(1, NOW) == [mlc.Writable(ledger_id)]
    return ledger_id


def new_partition(*, snapshot_entries: int = 1_000, per_read: int = REPLAY_ENTRIES_PER_READ,
                  deduplication: bool = True) -> PartitionCore:
    publishing: PublishCore[str] = PublishCore("p", deduplication=deduplication, snapshot_entries=snapshot_entries)
    return PartitionCore("p", publishing, ManagedLedgerCore("p", POLICIES), replay_entries_per_read=per_read)


def stored(snapshot: DedupSnapshot, version: int) -> tuple[dict, int]:
    return snapshot.to_record(), version


class Loader:
    """Carries out a load's commands as a driver would, answering each."""

    def __init__(self, history: History | None, *, snapshot: tuple[dict, int] | None = None,
                 cursors: tuple[str, ...] = ()) -> None:
        self.history = history
        self.snapshot = snapshot
        self.cursors = cursors
        self.version = -1 if snapshot is None else snapshot[1]
        self.ledger_id: int | None = None  # the new owner's ledger

    def answer(self, partition: PartitionCore, command: Command) -> list[Command]:
        if isinstance(command, OpenLedger):
            if self.history is None:
                self.ledger_id = open_fresh(partition.ledger)
            else:
                self.ledger_id = self.history.take_over(partition.ledger)
            return partition.ledger_opened()
        if isinstance(command, ReadSnapshot):
            return partition.snapshot_read(self.snapshot)
        if isinstance(command, ReadEntries):
            assert self.history is not None
            return partition.entries_read(self.history.read(command.position, command.count))
        if isinstance(command, WriteSnapshot):
            assert partition.publishing.snapshot_version == (None if self.version < 0 else self.version)  # compare-and-set
            self.version += 1
            return partition.snapshot_written(command.snapshot, self.version)
        if isinstance(command, ReadCursors):
            return partition.cursors_read(list(self.cursors))
        if isinstance(command, WriteCursor):
            return partition.cursor_written(command.name)
        assert isinstance(command, (Serve, LoadFailed)), command
        return []

    def run(self, partition: PartitionCore) -> list[Command]:
        """The whole load; every command, in order."""
        done: list[Command] = []
        pending = collections.deque(partition.load())
        while pending:
            command = pending.popleft()
            done.append(command)
            pending.extend(self.answer(partition, command))
        return done

    def until(self, partition: PartitionCore, phase: Phase) -> Command:
        """Load until `phase`; the command whose answer is awaited then."""
        pending = collections.deque(partition.load())
        while partition.phase is not phase:
            pending.extend(self.answer(partition, pending.popleft()))
        (command,) = pending
        return command


def serving(history: History | None = None, **kwargs) -> tuple[PartitionCore, Loader]:
    partition_kwargs = {name: kwargs.pop(name) for name in ("snapshot_entries", "per_read", "deduplication") if name in kwargs}
    partition = new_partition(**partition_kwargs)
    loader = Loader(history, **kwargs)
    loader.run(partition)
    assert partition.serving
    return partition, loader


def publish(partition: PartitionCore, producer_id: str, sequence_id: int) -> tuple[Position, list[Command]]:
    """A batch taken, appended and persisted while serving; what the
    partition core says when the publish core finds a snapshot due."""
    publishing, ledger = partition.publishing, partition.ledger
    judgement = publishing.judge(producer_id, sequence_id, sequence_id, stored_bytes=0, backlog_quota_bytes=None)
    assert judgement.status is BrokerStatus.OK and judgement.deduplicated
    slot = ledger.next_append(NOW)
    assert slot is not None
    publishing.pushed(producer_id, sequence_id, sequence_id, judgement)
    ledger.appended(slot, 1)
    entry_id = ledger.open_state.entries
    ledger.add_persisted(slot.ledger_id, slot.first_offset, 1, 100, NOW)
    position = Position(slot.ledger_id, entry_id)
    due = publishing.persisted(producer_id, sequence_id, sequence_id, (position.ledger_id, position.entry_id), judgement)
    return position, (partition.persisted() if due else [])


def kinds(commands: list[Command]) -> list[type]:
    return [type(command) for command in commands]


def reads(commands: list[Command]) -> list[Position]:
    return [command.position for command in commands if isinstance(command, ReadEntries)]


# --- loading ---------------------------------------------------------------------------------


def test_an_empty_partition_loads_without_a_replay_or_a_snapshot():
    partition = new_partition()
    commands = Loader(None).run(partition)
    # PublishCore.loaded(None) gives no snapshot: straight to the cursors.
    assert commands == [OpenLedger(), ReadSnapshot(), ReadCursors(), Serve()]
    assert partition.phase is Phase.SERVING and partition.serving and not partition.loading and not partition.unloading
    assert partition.publishing.last_position is None and partition.publishing.snapshot_version is None
    assert partition.publishing.replayed_entries == 0
    assert partition.ledger.state is mlc.State.WRITABLE


def test_a_chain_without_entries_replays_nothing_even_after_an_earlier_owner():
    history = History()
    history.new_owner()  # ledger 10 recovered empty; ledger 11 open, empty too
    partition = new_partition()
    commands = Loader(history).run(partition)
    assert commands == [OpenLedger(), ReadSnapshot(), ReadCursors(), Serve()]
    assert [info.entries for info in partition.ledger.record.ledgers] == [0, 0, None]


def test_the_load_goes_step_by_step_in_its_order():
    history = History()
    history.append("a", 1)
    history.append("a", 2)
    partition = new_partition()
    assert partition.phase is Phase.NEW and not partition.loading
    assert partition.load() == [OpenLedger()]
    assert partition.phase is Phase.OPENING and partition.loading
    # The driver opens the managed ledger (recovering ledger 10) before answering.
    assert history.take_over(partition.ledger) == 11
    assert partition.ledger_opened() == [ReadSnapshot()]
    assert partition.phase is Phase.READING_SNAPSHOT
    assert partition.snapshot_read(None) == [ReadEntries(Position(10, 0), REPLAY_ENTRIES_PER_READ)]
    assert partition.phase is Phase.REPLAYING
    (write,) = partition.entries_read(history.read(Position(10, 0), REPLAY_ENTRIES_PER_READ))
    assert write == WriteSnapshot(DedupSnapshot(10, 1, {"a": 2}))
    assert partition.phase is Phase.WRITING_SNAPSHOT and partition.loading
    assert partition.persisted() == []  # not serving yet: no other snapshot is written
    assert partition.snapshot_written(write.snapshot, 0) == [ReadCursors()]
    assert partition.publishing.snapshot_version == 0
    assert partition.phase is Phase.READING_CURSORS
    assert partition.cursors_read(["sub-b", "sub-a"]) == [WriteCursor("sub-a")]
    assert partition.phase is Phase.WRITING_CURSORS and partition.loading
    assert partition.cursor_written("sub-a") == [WriteCursor("sub-b")]
    assert partition.cursor_written("sub-b") == [Serve()]
    assert partition.phase is Phase.SERVING and not partition.loading
    assert partition.publishing.last_position == (10, 1)


def test_replay_starts_after_the_covered_entry_and_crosses_a_closed_ledger_into_the_next():
    history = History()
    history.append("a", 1)
    covered = history.append("a", 2)  # (10, 1), the last entry of ledger 10
    history.roll_over()
    history.append("b", 7)
    history.append("a", 3)
    history.roll_over()
    history.append("c", 4)  # ledger 12, left open: the load recovers it
    partition = new_partition()
    loader = Loader(history, snapshot=stored(DedupSnapshot(covered.ledger_id, covered.entry_id, {"a": 2}), 5))
    commands = loader.run(partition)
    assert kinds(commands) == [OpenLedger, ReadSnapshot, ReadEntries, ReadEntries, WriteSnapshot, ReadCursors, Serve]
    assert reads(commands) == [Position(11, 0), Position(12, 0)]
    assert partition.publishing.replayed_entries == 3  # none of ledger 10 again
    (write,) = [command for command in commands if isinstance(command, WriteSnapshot)]
    assert write.snapshot == DedupSnapshot(12, 0, {"a": 3, "b": 7, "c": 4})
    assert partition.publishing.snapshot_version == 6
    assert partition.publishing.last_position == (12, 0)


def test_replay_starts_right_after_a_covered_entry_in_the_middle_of_a_ledger():
    history = History()
    history.append("a", 1)
    history.append("a", 2)
    history.append("a", 3)
    partition = new_partition()
    commands = Loader(history, snapshot=stored(DedupSnapshot(10, 0, {"a": 1}), 0)).run(partition)
    assert reads(commands) == [Position(10, 1)]
    assert partition.publishing.replayed_entries == 2


def test_replay_skips_an_empty_closed_ledger():
    history = History()
    history.append("a", 1)
    history.new_owner()  # ledger 10 recovered with its entry; ledger 11 open
    history.new_owner()  # ledger 11 recovered empty; ledger 12 open
    history.append("a", 2)
    partition = new_partition()
    commands = Loader(history, snapshot=stored(DedupSnapshot(10, 0, {"a": 1}), 3)).run(partition)
    assert reads(commands) == [Position(12, 0)]
    assert partition.publishing.last_persisted("a") == 2


def test_a_snapshot_covering_the_last_entry_replays_nothing_and_is_written_again():
    history = History()
    history.append("a", 1)
    history.roll_over()
    last = history.append("b", 9)
    partition = new_partition()
    snapshot = DedupSnapshot(last.ledger_id, last.entry_id, {"a": 1, "b": 9})
    commands = Loader(history, snapshot=stored(snapshot, 4)).run(partition)
    assert kinds(commands) == [OpenLedger, ReadSnapshot, WriteSnapshot, ReadCursors, Serve]
    # The same map, written again: the version moves on past the previous owner's.
    (write,) = [command for command in commands if isinstance(command, WriteSnapshot)]
    assert write.snapshot == snapshot
    assert partition.publishing.snapshot_version == 5
    assert partition.publishing.replayed_entries == 0


@pytest.mark.parametrize("covered", [(10, 1), (11, 0), (99, 0), (12, 5)],
                         ids=["trimmed-ledger", "trimmed-last-entry", "unknown-ledger", "past-the-end"])
def test_a_snapshot_of_a_position_no_longer_in_the_chain_replays_from_the_first_entry(covered):
    history = History()
    history.append("a", 1)
    history.append("a", 2)
    history.roll_over()
    history.append("a", 3)
    history.roll_over()
    history.append("a", 4)
    history.append("b", 1)
    assert history.trim() == (10, 11)
    partition = new_partition()
    snapshot = DedupSnapshot(*covered, {"a": 3, "z": 8})
    commands = Loader(history, snapshot=stored(snapshot, 2)).run(partition)
    assert reads(commands) == [Position(12, 0)]  # the first entry stored
    assert partition.publishing.replayed_entries == 2
    publishing = partition.publishing
    # The snapshot's map and the replay, together.
    assert (publishing.last_persisted("a"), publishing.last_persisted("b"), publishing.last_persisted("z")) == (4, 1, 8)
    (write,) = [command for command in commands if isinstance(command, WriteSnapshot)]
    assert (write.snapshot.ledger_id, write.snapshot.entry_id) == (12, 1)


def test_a_snapshot_of_a_trimmed_position_with_no_entry_left_loads_without_a_replay():
    history = History()
    history.append("a", 1)
    history.roll_over()
    history.trim()  # ledger 10 gone; ledger 11 open and empty
    partition = new_partition()
    commands = Loader(history, snapshot=stored(DedupSnapshot(10, 0, {"a": 1}), 2)).run(partition)
    assert commands == [OpenLedger(), ReadSnapshot(), ReadCursors(), Serve()]
    assert partition.publishing.last_persisted("a") == 1  # from the snapshot
    assert partition.publishing.snapshot_version == 2  # nothing written


@pytest.mark.parametrize("record", [
    {"ledger_id": "10", "entry_id": 0, "sequences": {}},
    {"ledger_id": 10, "entry_id": 0, "sequences": {"a": "1"}},
    {"ledger_id": 10, "entry_id": 0},
    {},
], ids=["bad-ledger-id", "bad-sequence", "no-sequences", "empty"])
def test_an_unreadable_snapshot_counts_as_none(record):
    history = History()
    history.append("a", 1)
    history.append("b", 2)
    partition = new_partition()
    commands = Loader(history, snapshot=(record, 7)).run(partition)
    assert partition.publishing.snapshot_problem  # the driver says so
    assert reads(commands) == [Position(10, 0)]  # every entry replayed
    (write,) = [command for command in commands if isinstance(command, WriteSnapshot)]
    assert write.snapshot == DedupSnapshot(10, 1, {"a": 1, "b": 2})
    assert partition.publishing.snapshot_version == 8  # written over the unreadable one's version
    assert partition.serving


def test_replay_in_several_reads():
    history = History()
    for sequence_id in range(5):
        history.append("a", sequence_id)
    history.roll_over()
    history.append("b", 0)
    partition = new_partition(per_read=2)
    commands = Loader(history).run(partition)
    assert [(command.position, command.count) for command in commands if isinstance(command, ReadEntries)] == [
        (Position(10, 0), 2), (Position(10, 2), 2), (Position(10, 4), 2), (Position(11, 0), 2)]
    assert partition.publishing.replayed_entries == 6
    assert partition.publishing.last_persisted("a") == 4 and partition.publishing.last_persisted("b") == 0


def test_a_short_read_goes_on_from_the_last_entry_read():
    history = History()
    for sequence_id in range(3):
        history.append("a", sequence_id)
    partition = new_partition()
    loader = Loader(history)
    command = loader.until(partition, Phase.REPLAYING)
    assert command == ReadEntries(Position(10, 0), REPLAY_ENTRIES_PER_READ)
    assert partition.entries_read(history.read(Position(10, 0), 1)) == [ReadEntries(Position(10, 1), REPLAY_ENTRIES_PER_READ)]
    assert partition.publishing.replayed_entries == 1
    (write,) = partition.entries_read(history.read(Position(10, 1), 5))
    assert write.snapshot == DedupSnapshot(10, 2, {"a": 2})


def test_a_replay_read_of_nothing_fails_the_load():
    history = History()
    history.append("a", 1)
    partition = new_partition()
    command = Loader(history).until(partition, Phase.REPLAYING)
    (failed,) = partition.entries_read([])
    assert isinstance(failed, LoadFailed) and "no entry" in failed.reason
    assert partition.phase is Phase.FAILED and not partition.loading
    assert partition.entries_read(history.read(command.position, command.count)) == []  # late: ignored
    assert partition.unload(graceful=True) == []
    assert partition.publishing.stopped == "unloading"


def test_the_dedup_map_after_load_knows_each_producers_last_sequence_id():
    history = History()
    history.append("a", 10)
    history.append("b", 3)
    covered = history.append("a", 12)
    history.roll_over()
    history.append("b", 5)
    history.append("c", 0)
    history.append("a", 11)  # lower than the one before (a resent batch): the highest stays
    partition = new_partition()
    snapshot = DedupSnapshot(covered.ledger_id, covered.entry_id, {"a": 12, "b": 3, "d": 40})
    Loader(history, snapshot=stored(snapshot, 0)).run(partition)
    publishing = partition.publishing
    assert {producer: publishing.last_persisted(producer) for producer in "abcde"} == {
        "a": 12, "b": 5, "c": 0, "d": 40, "e": -1}
    # A producer reconnecting continues after it; a resent batch is a duplicate.
    assert publishing.add_producer("b", "link") == (ProducerAnswer.OK, 5)
    judge = lambda producer, sequence_id: publishing.judge(producer, sequence_id, sequence_id, stored_bytes=0,
                                                            backlog_quota_bytes=None).status
    assert judge("b", 5) is BrokerStatus.DUPLICATE and judge("b", 6) is BrokerStatus.OK
    assert judge("d", 40) is BrokerStatus.DUPLICATE and judge("e", 0) is BrokerStatus.OK


def test_cursors_are_written_one_at_a_time_in_sorted_order_then_serve():
    partition = new_partition()
    commands = Loader(None, cursors=("zeta", "alpha", "mid")).run(partition)
    assert commands == [OpenLedger(), ReadSnapshot(), ReadCursors(), WriteCursor("alpha"), WriteCursor("mid"),
                        WriteCursor("zeta"), Serve()]


def test_a_cursor_written_out_of_turn_is_a_driver_bug():
    partition = new_partition()
    Loader(None).until(partition, Phase.READING_CURSORS)
    assert partition.cursors_read(["b", "a"]) == [WriteCursor("a")]
    with pytest.raises(AssertionError, match="out of turn"):
        partition.cursor_written("b")
    assert partition.cursor_written("a") == [WriteCursor("b")]
    assert partition.cursor_written("b") == [Serve()]


# --- a load that fails or is stopped ---------------------------------------------------------


def a_partition_with_entries_and_cursors() -> tuple[PartitionCore, Loader]:
    history = History()
    history.append("a", 1)
    history.append("a", 2)
    return new_partition(), Loader(history, cursors=("s",))


LOAD_PHASES = [Phase.OPENING, Phase.READING_SNAPSHOT, Phase.REPLAYING, Phase.WRITING_SNAPSHOT, Phase.READING_CURSORS,
               Phase.WRITING_CURSORS]


@pytest.mark.parametrize("phase", LOAD_PHASES, ids=lambda phase: phase.name)
def test_a_step_of_the_load_failing_fails_it_and_its_late_answer_is_ignored(phase):
    partition, loader = a_partition_with_entries_and_cursors()
    command = loader.until(partition, phase)
    assert partition.failed("broken") == [LoadFailed("broken")]
    assert partition.phase is Phase.FAILED and not partition.loading and not partition.serving
    assert loader.answer(partition, command) == []
    assert partition.phase is Phase.FAILED
    assert partition.failed("again") == []
    assert partition.unload(graceful=False) == []


def test_a_failure_before_the_load_starts_fails_it():
    partition = new_partition()
    assert partition.failed("no") == [LoadFailed("no")]
    assert partition.phase is Phase.FAILED


@pytest.mark.parametrize("graceful", [True, False])
@pytest.mark.parametrize("phase", LOAD_PHASES, ids=lambda phase: phase.name)
def test_an_unload_during_the_load_writes_nothing_and_late_answers_are_ignored(phase, graceful):
    partition, loader = a_partition_with_entries_and_cursors()
    command = loader.until(partition, phase)
    # Not serving yet: even a graceful unload writes nothing.
    assert partition.unload(graceful=graceful) == [FinishSubscriptions(write=False)]
    assert partition.phase is Phase.FINISHING and partition.unloading and not partition.loading
    assert partition.graceful is False
    assert partition.publishing.stopped == ("unloading" if graceful else "fenced")
    assert loader.answer(partition, command) == []  # the step that was under way ends: nothing follows
    assert partition.phase is Phase.FINISHING
    assert partition.failed("late") == []
    assert partition.unload(graceful=True) == []
    assert partition.subscriptions_finished() == [Stopped(False)]
    assert partition.phase is Phase.STOPPED
    # Any further late answer changes nothing either.
    assert partition.ledger_opened() == [] and partition.snapshot_read(None) == [] and partition.entries_read([]) == []
    assert partition.cursors_read(["s"]) == [] and partition.cursor_written("s") == [] and partition.ledger_closed() == []
    assert partition.subscriptions_finished() == [] and partition.timed_out() == []
    assert partition.phase is Phase.STOPPED


def test_a_snapshot_write_finishing_after_the_stop_of_a_stopped_load_changes_nothing():
    partition, loader = a_partition_with_entries_and_cursors()
    write = loader.until(partition, Phase.WRITING_SNAPSHOT)
    assert partition.unload(graceful=False) == [FinishSubscriptions(write=False)]
    assert partition.subscriptions_finished() == [Stopped(False)]
    assert partition.snapshot_written(write.snapshot, 9) == []
    assert partition.phase is Phase.STOPPED


def test_a_snapshot_write_failing_at_load_fails_the_load():
    partition, loader = a_partition_with_entries_and_cursors()
    write = loader.until(partition, Phase.WRITING_SNAPSHOT)
    (failed,) = partition.snapshot_failed(write.snapshot, "bad version")
    assert isinstance(failed, LoadFailed) and failed.reason == "deduplication snapshot write failed: bad version"
    assert partition.phase is Phase.FAILED
    with pytest.raises(AssertionError):
        partition.snapshot_written(write.snapshot, 3)  # no longer in flight


EVENTS = {
    "ledger_opened": lambda partition: partition.ledger_opened(),
    "snapshot_read": lambda partition: partition.snapshot_read(None),
    "entries_read": lambda partition: partition.entries_read([(Position(10, 0), "a", 1)]),
    "cursors_read": lambda partition: partition.cursors_read([]),
    "cursor_written": lambda partition: partition.cursor_written("s"),
    "ledger_closed": lambda partition: partition.ledger_closed(),
    "subscriptions_finished": lambda partition: partition.subscriptions_finished(),
}
AWAITED = {Phase.OPENING: "ledger_opened", Phase.READING_CURSORS: "cursors_read"}


@pytest.mark.parametrize("phase, event", [
    (phase, event) for phase in (Phase.NEW, Phase.OPENING, Phase.READING_CURSORS, Phase.SERVING)
    for event in EVENTS if AWAITED.get(phase) != event
], ids=lambda value: value.name if isinstance(value, Phase) else value)
def test_events_out_of_order_are_driver_bugs(phase, event):
    partition = new_partition()
    loader = Loader(None, cursors=("s",))
    if phase is Phase.SERVING:
        loader.run(partition)
    elif phase is not Phase.NEW:
        loader.until(partition, phase)
    with pytest.raises(AssertionError, match=f"partition p: {event} while {phase.value}"):
        EVENTS[event](partition)
    assert partition.phase is phase


def test_loading_twice_is_a_driver_bug():
    partition = new_partition()
    partition.load()
    with pytest.raises(AssertionError, match="load while"):
        partition.load()
    partition = new_partition()
    Loader(None).run(partition)
    with pytest.raises(AssertionError, match="load while serving"):
        partition.load()


def test_a_load_after_the_partition_stopped_does_not_start_again():
    partition = new_partition()
    assert partition.unload(graceful=False) == [FinishSubscriptions(write=False)]
    assert partition.subscriptions_finished() == [Stopped(False)]
    try:
        commands = partition.load()
    except AssertionError:
        commands = []  # refusing it as a driver bug would do too
    assert commands == [] and partition.phase is Phase.STOPPED


def test_a_snapshot_answer_for_a_snapshot_not_in_flight_is_a_driver_bug():
    partition, _ = serving()
    stray = DedupSnapshot(50, 0, {})
    with pytest.raises(AssertionError, match="not being written"):
        partition.snapshot_written(stray, 1)
    with pytest.raises(AssertionError, match="not being written"):
        partition.snapshot_failed(stray, "x")


# --- snapshots while serving -----------------------------------------------------------------


def test_snapshots_while_serving_are_written_one_at_a_time_the_newest_due_next():
    partition, loader = serving(snapshot_entries=2)
    ledger_id = loader.ledger_id
    assert publish(partition, "a", 1)[1] == []  # not due yet
    position, commands = publish(partition, "a", 2)
    (first,) = commands
    assert first == WriteSnapshot(DedupSnapshot(ledger_id, 1, {"a": 2}))
    assert position == Position(ledger_id, 1)
    publish(partition, "b", 1)
    assert publish(partition, "a", 3)[1] == []  # due, but the first is in flight
    publish(partition, "b", 2)
    assert publish(partition, "a", 4)[1] == []  # due again: the newest one is written next
    (following,) = partition.snapshot_written(first.snapshot, 0)
    assert following == WriteSnapshot(DedupSnapshot(ledger_id, 5, {"a": 4, "b": 2}))
    assert partition.publishing.snapshot_version == 0
    assert partition.persisted() == []  # one in flight
    assert partition.snapshot_written(following.snapshot, 1) == []
    assert partition.publishing.snapshot_version == 1
    assert partition.persisted() == []  # nothing new is due
    (third,) = publish(partition, "c", 1)[1] + publish(partition, "c", 2)[1]
    assert third.snapshot == DedupSnapshot(ledger_id, 7, {"a": 4, "b": 2, "c": 2})
    assert partition.phase is Phase.SERVING


def test_a_snapshot_write_failing_while_serving_fences():
    partition, _ = serving(snapshot_entries=1)
    (write,) = publish(partition, "a", 1)[1]
    assert partition.snapshot_failed(write.snapshot, "bad version") == [
        Fence("deduplication snapshot write failed: bad version")]
    assert partition.phase is Phase.SERVING  # the driver unloads it


def test_a_failure_while_serving_fences():
    partition, _ = serving()
    assert partition.failed("a write failed") == [Fence("a write failed")]
    assert partition.serving


# --- unloading -------------------------------------------------------------------------------


def test_a_graceful_unload_closes_finishes_then_writes_the_final_snapshot():
    history = History()
    history.append("a", 1)
    partition, loader = serving(history, snapshot_entries=100)
    publish(partition, "a", 2)
    publish(partition, "b", 1)
    assert partition.unload(graceful=True) == [CloseLedger()]
    assert partition.phase is Phase.CLOSING_LEDGER and partition.unloading and partition.graceful
    assert partition.publishing.stopped == "unloading"
    assert partition.publishing.judge("a", 3, 3, stored_bytes=0, backlog_quota_bytes=None).status is BrokerStatus.TOPIC_FENCED
    assert partition.persisted() == []  # no more snapshots but the final one
    assert partition.ledger_closed() == [FinishSubscriptions(write=True)]
    assert partition.phase is Phase.FINISHING
    (final,) = partition.subscriptions_finished()
    assert final == WriteSnapshot(DedupSnapshot(loader.ledger_id, 1, {"a": 2, "b": 1}))
    assert partition.phase is Phase.FINAL_SNAPSHOT
    assert partition.snapshot_written(final.snapshot, 4) == [Stopped(True)]
    assert partition.phase is Phase.STOPPED and not partition.unloading
    assert partition.publishing.snapshot_version == 4
    assert partition.unload(graceful=True) == [] and partition.timed_out() == []


def test_a_graceful_unload_with_nothing_new_since_the_last_snapshot_writes_none():
    history = History()
    history.append("a", 1)
    partition, _ = serving(history)  # the load wrote the snapshot of (10, 0)
    assert partition.unload(graceful=True) == [CloseLedger()]
    assert partition.ledger_closed() == [FinishSubscriptions(write=True)]
    assert partition.subscriptions_finished() == [Stopped(True)]


def test_a_graceful_unload_without_deduplication_writes_no_snapshot():
    partition, _ = serving(deduplication=False)
    judgement = partition.publishing.judge("a", 0, 0, stored_bytes=0, backlog_quota_bytes=None)
    assert not judgement.deduplicated
    assert partition.publishing.persisted("a", 0, 0, (50, 0), judgement) is False
    partition.unload(graceful=True)
    partition.ledger_closed()
    assert partition.subscriptions_finished() == [Stopped(True)]


def test_a_graceful_unload_waits_for_the_snapshot_in_flight_then_writes_the_final_one():
    partition, loader = serving(snapshot_entries=2)
    ledger_id = loader.ledger_id
    publish(partition, "a", 1)
    (first,) = publish(partition, "a", 2)[1]
    publish(partition, "a", 3)  # not due: only the final snapshot covers it
    assert partition.unload(graceful=True) == [CloseLedger()]
    assert partition.ledger_closed() == [FinishSubscriptions(write=True)]
    assert partition.subscriptions_finished() == []  # after the one in flight
    assert partition.phase is Phase.FINAL_SNAPSHOT
    (final,) = partition.snapshot_written(first.snapshot, 0)
    assert final == WriteSnapshot(DedupSnapshot(ledger_id, 2, {"a": 3}))
    assert partition.snapshot_written(final.snapshot, 1) == [Stopped(True)]
    assert partition.publishing.snapshot_version == 1


def test_a_graceful_unload_writes_the_newer_due_snapshot_then_the_final_one():
    partition, loader = serving(snapshot_entries=2)
    ledger_id = loader.ledger_id
    publish(partition, "a", 1)
    (first,) = publish(partition, "a", 2)[1]
    publish(partition, "a", 3)
    assert publish(partition, "a", 4)[1] == []  # due while the first is in flight
    publish(partition, "a", 5)
    assert partition.unload(graceful=True) == [CloseLedger()]
    # The one in flight is done while the ledger closes: the newer due one goes at once.
    (second,) = partition.snapshot_written(first.snapshot, 0)
    assert second == WriteSnapshot(DedupSnapshot(ledger_id, 3, {"a": 4}))
    assert partition.ledger_closed() == [FinishSubscriptions(write=True)]
    assert partition.subscriptions_finished() == []  # the second is in flight
    (final,) = partition.snapshot_written(second.snapshot, 1)
    assert final == WriteSnapshot(DedupSnapshot(ledger_id, 4, {"a": 5}))
    assert partition.snapshot_written(final.snapshot, 2) == [Stopped(True)]


def test_a_graceful_unload_whose_in_flight_snapshot_covers_everything_writes_no_other():
    partition, _ = serving(snapshot_entries=2)
    publish(partition, "a", 1)
    (first,) = publish(partition, "a", 2)[1]
    partition.unload(graceful=True)
    partition.ledger_closed()
    assert partition.subscriptions_finished() == []
    assert partition.snapshot_written(first.snapshot, 0) == [Stopped(True)]


def test_the_final_snapshot_failing_still_stops_the_unload():
    partition, _ = serving()
    publish(partition, "a", 1)
    partition.unload(graceful=True)
    partition.ledger_closed()
    (final,) = partition.subscriptions_finished()
    assert isinstance(final, WriteSnapshot)
    # Only a longer replay for the next owner: the ledger is closed and the acknowledgements written.
    assert partition.snapshot_failed(final.snapshot, "connection lost") == [Stopped(True)]
    assert partition.phase is Phase.STOPPED


def test_the_in_flight_snapshot_failing_during_the_final_wait_stops_the_unload():
    partition, _ = serving(snapshot_entries=1)
    (first,) = publish(partition, "a", 1)[1]
    partition.unload(graceful=True)
    partition.ledger_closed()
    assert partition.subscriptions_finished() == []
    assert partition.snapshot_failed(first.snapshot, "bad version") == [Stopped(True)]


def test_a_snapshot_failing_while_the_ledger_closes_does_not_fence_the_unload():
    partition, _ = serving(snapshot_entries=1)
    (first,) = publish(partition, "a", 1)[1]
    partition.unload(graceful=True)
    assert partition.snapshot_failed(first.snapshot, "bad version") == []  # no Fence while unloading
    assert partition.ledger_closed() == [FinishSubscriptions(write=True)]
    (final,) = partition.subscriptions_finished()  # tried again: the compare-and-set decides
    assert final.snapshot.sequences == {"a": 1}
    assert partition.snapshot_written(final.snapshot, 3) == [Stopped(True)]


def test_a_fenced_unload_finishes_without_writing_and_stops():
    history = History()
    history.append("a", 1)
    partition, _ = serving(history)
    publish(partition, "a", 2)  # not covered by any snapshot
    assert partition.unload(graceful=False) == [FinishSubscriptions(write=False)]
    assert partition.phase is Phase.FINISHING and partition.graceful is False
    assert partition.publishing.stopped == "fenced"
    assert partition.persisted() == []
    assert partition.subscriptions_finished() == [Stopped(False)]
    assert partition.phase is Phase.STOPPED


@pytest.mark.parametrize("stop_first", [False, True], ids=["written-then-finished", "finished-then-written"])
def test_a_fenced_unload_writes_nothing_more_even_when_a_newer_snapshot_became_due(stop_first):
    partition, _ = serving(snapshot_entries=1)
    (first,) = publish(partition, "a", 1)[1]
    assert publish(partition, "a", 2)[1] == []  # due, waits for the first
    assert partition.unload(graceful=False) == [FinishSubscriptions(write=False)]
    if stop_first:
        assert partition.subscriptions_finished() == [Stopped(False)]
        assert partition.snapshot_written(first.snapshot, 0) == []
    else:
        assert partition.snapshot_written(first.snapshot, 0) == []
        assert partition.subscriptions_finished() == [Stopped(False)]
    assert partition.phase is Phase.STOPPED
    assert partition.publishing.snapshot_version == 0  # the first one's write did land
    assert partition.publishing.next_snapshot() is not None  # the newer one was never taken as written


def test_an_unload_that_takes_too_long_stops_waiting():
    partition, _ = serving()
    publish(partition, "a", 1)
    assert partition.unload(graceful=True) == [CloseLedger()]
    assert partition.timed_out() == [FinishSubscriptions(write=False), Stopped(False)]
    assert partition.phase is Phase.STOPPED and partition.graceful is False
    assert partition.ledger_closed() == []  # late
    assert partition.subscriptions_finished() == []
    assert partition.timed_out() == []


def test_a_timed_out_unload_writes_no_newer_snapshot_when_the_one_in_flight_lands():
    partition, _ = serving(snapshot_entries=1)
    (first,) = publish(partition, "a", 1)[1]
    publish(partition, "a", 2)  # due, waits for the first
    partition.unload(graceful=True)
    partition.ledger_closed()
    assert partition.subscriptions_finished() == []
    assert partition.timed_out() == [FinishSubscriptions(write=False), Stopped(False)]
    assert partition.snapshot_written(first.snapshot, 0) == []
    assert partition.phase is Phase.STOPPED


def test_a_timed_out_final_snapshot_answered_late_changes_nothing():
    partition, _ = serving()
    publish(partition, "a", 1)
    partition.unload(graceful=True)
    partition.ledger_closed()
    (final,) = partition.subscriptions_finished()
    assert partition.timed_out() == [FinishSubscriptions(write=False), Stopped(False)]
    assert partition.snapshot_written(final.snapshot, 0) == []
    assert partition.phase is Phase.STOPPED
