"""The Jepsen history checker, fed hand-written histories: each story below
is a short run in which the cluster did right, or did one thing wrong that
the checker must find (and nothing else)."""

from __future__ import annotations

import time

import pytest

from sim.jepsen.checker import ANOMALY_KINDS, check
from sim.jepsen.history import HistoryFormatError, Operation


class Story:
    """Builds a history; every record is 10 ms after the one before.
    A writer's add of sequence number n has op_id n and payload "writer:n"."""

    def __init__(self) -> None:
        self.operations: list[Operation] = []

    def record(self, process: str, type: str, f: str, value: dict) -> Operation:
        operation = Operation(len(self.operations), 10.0 * len(self.operations), process, type, f, value)
        self.operations.append(operation)
        return operation

    def create(self, writer: str, ledger: int) -> None:
        self.record(writer, "invoke", "create", {})
        self.record(writer, "ok", "create", {"ledger": ledger})

    def invoke_add(self, writer: str, sequence: int, ledger: int) -> None:
        self.record(writer, "invoke", "add", {"op_id": sequence, "ledger": ledger, "payload": f"{writer}:{sequence}"})

    def complete_add(self, writer: str, sequence: int, ledger: int, outcome: str = "ok", entry: int | None = None) -> None:
        value = {"op_id": sequence, "ledger": ledger, "payload": f"{writer}:{sequence}"}
        if outcome == "ok":
            value["entry"] = entry
        else:
            value["error"] = "fenced" if outcome == "info" else "ledger closed"
        self.record(writer, outcome, "add", value)

    def add(self, writer: str, sequence: int, ledger: int, outcome: str = "ok", entry: int | None = None) -> None:
        self.invoke_add(writer, sequence, ledger)
        self.complete_add(writer, sequence, ledger, outcome, entry)

    def close(self, writer: str, ledger: int, last_entry: int) -> None:
        self.record(writer, "invoke", "close", {"ledger": ledger})
        self.record(writer, "ok", "close", {"ledger": ledger, "last_entry": last_entry})

    def recover(self, ledger: int, last_entry: int) -> None:
        self.record("recoverer", "invoke", "recover", {"ledger": ledger})
        self.record("recoverer", "ok", "recover", {"ledger": ledger, "last_entry": last_entry})

    def read(self, reader: str, ledger: int, payloads: dict[int, str], *, closed: bool = True, final: bool = False, last_entry: int | None = None) -> None:
        """`payloads` maps entry id -> payload, in the order read."""
        value = {
            "ledger": ledger,
            "closed": closed,
            "last_entry": max(payloads, default=-1) if last_entry is None else last_entry,
            "entries": [[entry, payload] for entry, payload in payloads.items()],
        }
        if final:
            value["final"] = True
        self.record(reader, "invoke", "read", {"ledger": ledger})
        self.record(reader, "ok", "read", value)

    def fault(self, kind: str, targets: list[str], fault_id: int, *, ending: str) -> None:
        self.record("nemesis", "info", ending, {"fault": kind, "targets": targets, "fault_id": fault_id})


def kinds_found(result) -> set[str]:
    return {kind for kind in ANOMALY_KINDS if result.anomalies(kind)}


def sequential_ledger(writer: str, ledger: int, count: int, first_sequence: int = 0) -> dict[int, str]:
    return {entry: f"{writer}:{first_sequence + entry}" for entry in range(count)}


def test_a_run_where_everything_went_right_is_valid():
    # Two writers, a bookie killed and restarted, pipelined adds, a timed-out
    # add that recovery kept, a reader tailing an open ledger, and final reads
    # that find everything acknowledged.
    story = Story()
    story.create("writer-0", 1)
    story.create("writer-1", 2)
    for sequence in range(5):
        story.invoke_add("writer-0", sequence, 1)
    story.fault("kill", ["bookie-1"], 1, ending="fault-start")
    for sequence in range(5):
        story.complete_add("writer-0", sequence, 1, entry=sequence)
    story.read("reader-0", 1, sequential_ledger("writer-0", 1, 3), closed=False)
    story.fault("kill", ["bookie-1"], 1, ending="fault-end")
    story.close("writer-0", 1, 4)
    story.add("writer-1", 0, 2, entry=0)
    story.add("writer-1", 1, 2, entry=1)
    story.fault("pause", ["bookie-2"], 2, ending="fault-start")
    story.add("writer-1", 2, 2, outcome="info")
    story.add("writer-1", 3, 2, outcome="fail")
    story.recover(2, 2)
    story.read("reader-0", 1, sequential_ledger("writer-0", 1, 5), final=True)
    story.read("reader-1", 2, sequential_ledger("writer-1", 2, 3), final=True)

    result = check(story.operations)

    assert kinds_found(result) == set(), result.summary()
    assert result.valid and result.complete and result.verdict == "VALID"
    assert (result.adds_invoked, result.adds_ok, result.adds_fail, result.adds_info) == (9, 7, 1, 1)
    assert (result.reads_ok, result.reads_final, result.ledgers) == (3, 2, 2)
    assert (result.ledgers_acked, result.ledgers_acked_final_read, result.recoveries_ok) == (2, 2, 1)
    assert result.adds_info_read == 1
    assert result.faults_by_kind == {"kill": 1, "pause": 1}
    assert result.summary().startswith("VALID\n")


def test_indeterminate_adds_may_or_may_not_be_in_the_ledger():
    # Two adds time out. Recovery keeps the first (its bookies had it) and
    # drops the second; both outcomes are allowed for an info add. The
    # history is cut with a third add still in flight, which counts as info.
    story = Story()
    story.create("writer-0", 1)
    story.add("writer-0", 0, 1, entry=0)
    story.add("writer-0", 1, 1, outcome="info")
    story.add("writer-0", 2, 1, outcome="info")
    story.recover(1, 1)
    story.read("reader-0", 1, sequential_ledger("writer-0", 1, 2), final=True)
    story.invoke_add("writer-0", 3, 1)

    result = check(story.operations)

    assert result.valid and kinds_found(result) == set(), result.summary()
    assert (result.adds_info, result.adds_info_read) == (3, 1)


def test_an_acknowledged_add_with_no_final_read_of_its_ledger_is_unseen_and_incomplete():
    # The run was cut before the final reads: nothing shows the add lost, and
    # nothing shows it kept, so the run proves nothing about it.
    story = Story()
    story.create("writer-0", 1)
    story.add("writer-0", 0, 1, entry=0)

    result = check(story.operations)

    assert kinds_found(result) == {"unseen"}
    assert result.valid and not result.complete and result.verdict == "INCOMPLETE"
    assert result.summary().startswith("INCOMPLETE\n")
    [unseen] = result.unseen
    assert (unseen.ledger, unseen.entry, unseen.payload) == (1, 0, "writer-0:0")


def test_final_reads_that_all_failed_make_a_run_incomplete_not_valid():
    # After healing, the final reader recovered both ledgers but every read
    # failed: nothing acknowledged was checked.
    story = Story()
    for ledger in (1, 2):
        story.create("writer-0", ledger)
        story.add("writer-0", ledger, ledger, entry=0)
        story.recover(ledger, 0)
        story.record("final", "invoke", "read", {"ledger": ledger})
        story.record("final", "fail", "read", {"ledger": ledger, "error": "TooSlowError"})

    result = check(story.operations)

    assert result.verdict == "INCOMPLETE" and not result.complete, result.summary()
    assert (result.ledgers_acked, result.ledgers_acked_final_read, result.reads_final) == (2, 0, 0)
    assert "2 with acknowledged adds, 0 of them read whole after healing" in result.summary()


def test_a_ledger_with_acknowledged_adds_but_no_final_read_makes_a_run_incomplete():
    # Ledger 1 is read back whole; ledger 2 is not.
    story = Story()
    story.create("writer-0", 1)
    story.add("writer-0", 0, 1, entry=0)
    story.close("writer-0", 1, 0)
    story.create("writer-0", 2)
    story.add("writer-0", 1, 2, entry=0)
    story.read("final", 1, {0: "writer-0:0"}, final=True)

    result = check(story.operations)

    assert result.verdict == "INCOMPLETE", result.summary()
    assert (result.ledgers_acked, result.ledgers_acked_final_read) == (2, 1)


def test_only_reads_marked_final_check_acknowledged_adds():
    # A reader read the closed ledger during the faults, but the run was cut
    # before the final reads after healing: the add is still unseen.
    story = Story()
    story.create("writer-0", 1)
    story.add("writer-0", 0, 1, entry=0)
    story.close("writer-0", 1, 0)
    story.read("reader-0", 1, {0: "writer-0:0"})

    result = check(story.operations)

    assert kinds_found(result) == {"unseen"}
    assert (result.reads_ok, result.reads_final) == (1, 0)


def test_an_acknowledged_entry_past_the_end_of_the_final_read_is_lost():
    # Recovery closed the ledger one entry short of what the writer was told
    # was safe.
    story = Story()
    story.create("writer-0", 1)
    for sequence in range(4):
        story.add("writer-0", sequence, 1, entry=sequence)
    story.recover(1, 2)
    story.read("reader-0", 1, sequential_ledger("writer-0", 1, 3), final=True)

    result = check(story.operations)

    assert kinds_found(result) == {"lost"}
    assert not result.valid
    [lost] = result.lost
    assert (lost.ledger, lost.entry, lost.payload) == (1, 3, "writer-0:3")
    assert "ends at entry 2" in lost.detail


def test_a_recovery_below_an_acknowledged_entry_is_lost_even_without_a_final_read():
    story = Story()
    story.create("writer-0", 1)
    story.add("writer-0", 0, 1, entry=0)
    story.add("writer-0", 1, 1, entry=1)
    story.recover(1, 0)

    result = check(story.operations)

    # Entry 0 is within the recovered ledger, but with no final read nobody
    # read it back.
    assert kinds_found(result) == {"lost", "unseen"}
    assert [(lost.entry, lost.payload) for lost in result.lost] == [(1, "writer-0:1")]
    assert [(unseen.entry, unseen.payload) for unseen in result.unseen] == [(0, "writer-0:0")]


def test_an_acknowledged_entry_overwritten_by_another_payload_is_lost_and_inconsistent():
    # The final read has the timed-out add's payload where the acknowledged
    # one should be.
    story = Story()
    story.create("writer-0", 1)
    story.add("writer-0", 0, 1, entry=0)
    story.add("writer-0", 1, 1, outcome="info")
    story.add("writer-0", 2, 1, entry=1)
    story.read("reader-0", 1, {0: "writer-0:0", 1: "writer-0:1"}, final=True)

    result = check(story.operations)

    assert kinds_found(result) == {"lost", "inconsistent"}
    [lost] = result.lost
    assert (lost.ledger, lost.entry, lost.payload) == (1, 1, "writer-0:2")
    [inconsistent] = result.inconsistent
    assert (inconsistent.entry, inconsistent.payload) == (1, "writer-0:2")


def test_a_payload_read_at_two_positions_is_duplicated():
    # writer-0's timed-out add was kept by recovery of ledger 1 and also
    # shows up in writer-1's ledger 2, as if a bookie replayed it there.
    story = Story()
    story.create("writer-0", 1)
    story.create("writer-1", 2)
    story.add("writer-0", 0, 1, entry=0)
    story.add("writer-0", 1, 1, outcome="info")
    story.add("writer-1", 0, 2, entry=0)
    story.recover(1, 1)
    story.recover(2, 1)
    story.read("reader-0", 1, {0: "writer-0:0", 1: "writer-0:1"}, final=True)
    story.read("reader-0", 2, {0: "writer-1:0", 1: "writer-0:1"}, final=True)

    result = check(story.operations)

    assert kinds_found(result) == {"duplicated"}
    [duplicated] = result.duplicated
    assert (duplicated.ledger, duplicated.entry, duplicated.payload) == (2, 1, "writer-0:1")
    assert "ledger 1 entry 1" in duplicated.detail


def test_a_later_add_at_a_lower_entry_is_reordered():
    # writer-0 pipelined three adds and the client gave the third the entry
    # meant for the second; every read agrees with what was acknowledged.
    story = Story()
    story.create("writer-0", 1)
    for sequence in range(3):
        story.invoke_add("writer-0", sequence, 1)
    story.complete_add("writer-0", 0, 1, entry=0)
    story.complete_add("writer-0", 2, 1, entry=1)
    story.complete_add("writer-0", 1, 1, entry=2)
    story.close("writer-0", 1, 2)
    story.read("reader-0", 1, {0: "writer-0:0", 1: "writer-0:2", 2: "writer-0:1"}, final=True)

    result = check(story.operations)

    assert kinds_found(result) == {"reordered"}
    [reordered] = result.reordered
    assert (reordered.ledger, reordered.entry, reordered.payload) == (1, 2, "writer-0:1")


def test_two_writers_interleaved_in_one_ledger_are_not_reordered():
    # Order is per writer: writer-1's low sequence numbers after writer-0's
    # high ones are fine.
    story = Story()
    story.create("writer-0", 1)
    story.add("writer-0", 0, 1, entry=0)
    story.add("writer-0", 1, 1, entry=1)
    story.add("writer-1", 0, 1, outcome="info")
    story.recover(1, 2)
    story.read("reader-0", 1, {0: "writer-0:0", 1: "writer-0:1", 2: "writer-1:0"}, final=True)

    assert kinds_found(check(story.operations)) == set()


def inconsistent_reads() -> Story:
    # Two readers tailing the open ledger disagree on entry 1; no add was
    # acknowledged, so nothing else is wrong.
    story = Story()
    story.create("writer-0", 1)
    story.add("writer-0", 0, 1, outcome="info")
    story.add("writer-0", 1, 1, outcome="info")
    story.add("writer-0", 2, 1, outcome="info")
    story.read("reader-0", 1, {0: "writer-0:0", 1: "writer-0:1"}, closed=False)
    story.read("reader-1", 1, {0: "writer-0:0", 1: "writer-0:2"}, closed=False)
    return story


def inconsistent_with_an_acknowledgement() -> Story:
    # A tailing read shows a timed-out add where an acknowledged one is, and
    # the final read shows the acknowledged one.
    story = Story()
    story.create("writer-0", 1)
    story.add("writer-0", 0, 1, entry=0)
    story.add("writer-0", 1, 1, outcome="info")
    story.add("writer-0", 2, 1, entry=1)
    story.read("reader-0", 1, {0: "writer-0:0", 1: "writer-0:1"}, closed=False)
    story.close("writer-0", 1, 1)
    story.read("reader-0", 1, {0: "writer-0:0", 1: "writer-0:2"}, final=True)
    return story


def closed_read_with_a_gap() -> Story:
    # A read of the closed ledger skips entry 1 (a timed-out add, so nothing
    # acknowledged is missing).
    story = Story()
    story.create("writer-0", 1)
    story.add("writer-0", 0, 1, entry=0)
    story.add("writer-0", 1, 1, outcome="info")
    story.add("writer-0", 2, 1, outcome="info")
    story.recover(1, 2)
    story.read("reader-0", 1, {0: "writer-0:0", 2: "writer-0:2"}, last_entry=2, final=True)
    return story


def two_different_ends() -> Story:
    # Recovery closed the ledger at entry 2, but one reader saw it closed at 1.
    story = Story()
    story.create("writer-0", 1)
    story.add("writer-0", 0, 1, entry=0)
    story.add("writer-0", 1, 1, entry=1)
    story.add("writer-0", 2, 1, outcome="info")
    story.recover(1, 2)
    story.read("reader-1", 1, sequential_ledger("writer-0", 1, 2))
    story.read("reader-0", 1, sequential_ledger("writer-0", 1, 3), final=True)
    return story


def read_beyond_the_close() -> Story:
    # A tailing reader saw entry 3 while the ledger was open, and recovery
    # then closed it at entry 2: entry 3 was returned but is not in the ledger.
    story = Story()
    story.create("writer-0", 1)
    for sequence in range(3):
        story.add("writer-0", sequence, 1, entry=sequence)
    story.add("writer-0", 3, 1, outcome="info")
    story.read("reader-0", 1, sequential_ledger("writer-0", 1, 4), closed=False)
    story.recover(1, 2)
    story.read("reader-0", 1, sequential_ledger("writer-0", 1, 3), final=True)
    return story


@pytest.mark.parametrize(
    "story, ledger, entry, detail",
    [
        (inconsistent_reads, 1, 1, "reads disagree"),
        (inconsistent_with_an_acknowledgement, 1, 1, "reads disagree"),
        (closed_read_with_a_gap, 1, None, "not 0..2 in order"),
        (two_different_ends, 1, None, "different last entries"),
        (read_beyond_the_close, 1, 3, "beyond its closed last entry 2"),
    ],
)
def test_inconsistencies_are_found_and_nothing_else(story, ledger, entry, detail):
    result = check(story().operations)
    assert kinds_found(result) == {"inconsistent"}, result.summary()
    assert not result.valid
    assert any(
        anomaly.ledger == ledger and anomaly.entry == entry and detail in anomaly.detail for anomaly in result.inconsistent
    ), result.summary()


def test_an_acknowledgement_and_a_read_that_disagree_are_inconsistent():
    # The acknowledged payload and the read one differ, shown from the
    # acknowledgement's side (the reads agree among themselves).
    story = inconsistent_with_an_acknowledgement()
    details = [anomaly.detail for anomaly in check(story.operations).inconsistent]
    assert "acknowledged, but a read returned 'writer-0:1' there" in details


def test_a_read_of_an_open_ledger_with_a_gap_is_inconsistent():
    # A tailing reader's read up to the LAC (2) skipped entry 1.
    story = Story()
    story.create("writer-0", 1)
    for sequence in range(3):
        story.add("writer-0", sequence, 1, entry=sequence)
    story.read("reader-0", 1, {0: "writer-0:0", 2: "writer-0:2"}, closed=False, last_entry=2)
    story.close("writer-0", 1, 2)
    story.read("final", 1, sequential_ledger("writer-0", 1, 3), final=True)

    result = check(story.operations)

    assert kinds_found(result) == {"inconsistent"}, result.summary()
    [inconsistent] = result.inconsistent
    assert "read of the open ledger returned entries [0, 2], not 0..2 in order" in inconsistent.detail


def test_acknowledgements_out_of_entry_order_are_reordered():
    # The client told writer-0 that entry 1 was safe before entry 0: a
    # ledger handle completes adds in entry order. Reads agree with both.
    story = Story()
    story.create("writer-0", 1)
    story.invoke_add("writer-0", 0, 1)
    story.invoke_add("writer-0", 1, 1)
    story.complete_add("writer-0", 1, 1, entry=1)
    story.complete_add("writer-0", 0, 1, entry=0)
    story.close("writer-0", 1, 1)
    story.read("final", 1, sequential_ledger("writer-0", 1, 2), final=True)

    result = check(story.operations)

    assert kinds_found(result) == {"reordered"}, result.summary()
    [reordered] = result.reordered
    assert (reordered.entry, reordered.payload) == (0, "writer-0:0")
    assert "acknowledged after 'writer-0:1'" in reordered.detail


def test_two_acknowledgements_at_one_entry_are_inconsistent():
    story = Story()
    story.create("writer-0", 1)
    story.add("writer-0", 0, 1, entry=0)
    story.add("writer-0", 1, 1, entry=0)

    result = check(story.operations)

    assert "at the same entry" in " ".join(anomaly.detail for anomaly in result.inconsistent), result.summary()


def test_a_fenced_writer_acknowledged_past_a_recovered_close_is_lost():
    # A reader recovered the ledger at entry 1 while writer-0 was writing;
    # the writer was then told entry 2 was safe. The final read agrees
    # with the recovery, so only the acknowledgement is wrong.
    story = Story()
    story.create("writer-0", 1)
    story.add("writer-0", 0, 1, entry=0)
    story.add("writer-0", 1, 1, entry=1)
    story.invoke_add("writer-0", 2, 1)
    story.recover(1, 1)
    story.complete_add("writer-0", 2, 1, entry=2)
    story.read("final", 1, sequential_ledger("writer-0", 1, 2), final=True)

    result = check(story.operations)

    assert kinds_found(result) == {"lost"} and result.verdict == "INVALID", result.summary()
    [lost] = result.lost
    assert (lost.entry, lost.payload) == (2, "writer-0:2")
    assert "a fenced writer was acknowledged past the close" in lost.detail


def test_a_fenced_writer_whose_adds_failed_after_a_recovery_is_valid():
    # The same race done right: the writer's add beyond the close fails
    # (info), and the writer's close fails too.
    story = Story()
    story.create("writer-0", 1)
    story.add("writer-0", 0, 1, entry=0)
    story.invoke_add("writer-0", 1, 1)
    story.recover(1, 0)
    story.complete_add("writer-0", 1, 1, outcome="info")
    story.record("writer-0", "invoke", "close", {"ledger": 1})
    story.record("writer-0", "info", "close", {"ledger": 1, "error": "LedgerFencedError"})
    story.read("final", 1, {0: "writer-0:0"}, final=True)

    result = check(story.operations)

    assert result.verdict == "VALID", result.summary()


def test_a_payload_nobody_added_is_unexpected():
    # Phantom data: the final read returns a payload no writer ever invoked.
    story = Story()
    story.create("writer-0", 1)
    story.add("writer-0", 0, 1, entry=0)
    story.recover(1, 1)
    story.read("reader-0", 1, {0: "writer-0:0", 1: "writer-9:0"}, final=True)

    result = check(story.operations)

    assert kinds_found(result) == {"unexpected"}
    [unexpected] = result.unexpected
    assert (unexpected.ledger, unexpected.entry, unexpected.payload) == (1, 1, "writer-9:0")


def test_a_failed_add_read_back_is_counted_but_not_an_anomaly():
    # As in Jepsen's set checker, a failed add that recovery kept is
    # "recovered": the client's error may have come after the bookies stored it.
    story = Story()
    story.create("writer-0", 1)
    story.add("writer-0", 0, 1, outcome="fail")
    story.recover(1, 0)
    story.read("reader-0", 1, {0: "writer-0:0"}, final=True)

    result = check(story.operations)

    assert result.valid and kinds_found(result) == set()
    assert result.adds_fail_read == 1


def test_the_summary_says_invalid_and_shows_a_bounded_number_of_examples():
    story = Story()
    story.create("writer-0", 1)
    for sequence in range(10):
        story.add("writer-0", sequence, 1, entry=sequence)
    story.recover(1, 2)
    story.read("reader-0", 1, sequential_ledger("writer-0", 1, 3), final=True)

    summary = check(story.operations).summary(examples_max=2)

    lines = summary.splitlines()
    assert lines[0] == "INVALID"
    assert "10 invoked, 10 ok" in summary
    assert "lost 7" in summary
    assert sum(line.startswith("  lost: ledger 1") for line in lines) == 2
    assert "  lost: ... and 5 more" in lines
    assert "payload 'writer-0:3'" in summary


def test_a_read_entry_that_is_not_a_pair_is_a_format_error():
    story = Story()
    story.record("reader-0", "invoke", "read", {"ledger": 1})
    story.record("reader-0", "ok", "read", {"ledger": 1, "closed": True, "last_entry": 0, "entries": [[0]]})
    with pytest.raises(HistoryFormatError, match="operation 1: entry"):
        check(story.operations)


def test_a_payload_added_twice_is_a_format_error():
    # Duplicates are found by payload, so the recorder must never reuse one.
    story = Story()
    story.add("writer-0", 0, 1, entry=0)
    story.record("writer-0", "invoke", "add", {"op_id": 1, "ledger": 1, "payload": "writer-0:0"})
    with pytest.raises(HistoryFormatError, match="already added"):
        check(story.operations)


def test_a_long_history_checks_in_linear_time():
    # 100 ledgers of 500 pipelined adds each, a tailing read per ledger and a
    # final read: about 100k records. A quadratic pass over them would take
    # minutes; the bound is loose for a busy machine.
    story = Story()
    ledger_count, adds_per_ledger = 100, 500
    for ledger in range(ledger_count):
        writer = f"writer-{ledger % 5}"
        first_sequence = (ledger // 5) * adds_per_ledger
        story.create(writer, ledger)
        for offset in range(adds_per_ledger):
            story.invoke_add(writer, first_sequence + offset, ledger)
        for offset in range(adds_per_ledger):
            story.complete_add(writer, first_sequence + offset, ledger, entry=offset)
        payloads = {entry: f"{writer}:{first_sequence + entry}" for entry in range(adds_per_ledger)}
        story.read("reader-0", ledger, dict(list(payloads.items())[:100]), closed=False)
        story.close(writer, ledger, adds_per_ledger - 1)
        story.read("reader-1", ledger, payloads, final=True)

    started_s = time.monotonic()
    result = check(story.operations)
    elapsed_s = time.monotonic() - started_s

    assert len(story.operations) > 100_000
    assert result.valid and kinds_found(result) == set(), result.summary()
    assert result.adds_ok == ledger_count * adds_per_ledger
    assert elapsed_s < 10.0
