"""The Jepsen history file: writing with a clock, reading back, torn tails,
malformed lines, pairing invokes with completions, and fault windows."""

from __future__ import annotations

import json
import threading

import pytest

from sim.jepsen.history import (
    FaultWindow,
    HistoryFormatError,
    HistoryWriter,
    Operation,
    fault_windows,
    merge_histories,
    pair_operations,
    read_history,
)


class FakeClock:
    """Seconds, as time.monotonic gives them; tests move it by hand."""

    def __init__(self, now_s: float = 100.0) -> None:
        self.now_s = now_s

    def __call__(self) -> float:
        return self.now_s


def record_line(index: int, time_ms: float = 0.0, process: str = "writer-0", type: str = "invoke", f: str = "create", value=None) -> str:
    return json.dumps({"index": index, "time_ms": time_ms, "process": process, "type": type, "f": f, "value": value or {}})


def test_writer_assigns_indexes_and_times_from_its_clock_and_reads_back(tmp_path):
    # Times are measured from the writer's creation, in milliseconds.
    clock = FakeClock(100.0)
    path = tmp_path / "history.jsonl"
    with HistoryWriter(path, clock=clock) as history:
        first = history.append("writer-0", "invoke", "create", {})
        clock.now_s = 100.25
        second = history.append("writer-0", "ok", "create", {"ledger": 12})
    assert first == Operation(0, 0.0, "writer-0", "invoke", "create", {})
    assert second == Operation(1, 250.0, "writer-0", "ok", "create", {"ledger": 12})
    assert read_history(path) == [first, second]


def test_each_line_is_on_disk_before_append_returns(tmp_path):
    # A run killed with SIGKILL never closes its writer; what it appended must
    # already be in the file.
    path = tmp_path / "history.jsonl"
    history = HistoryWriter(path, clock=FakeClock())
    history.append("nemesis", "info", "fault-start", {"fault": "kill", "targets": ["bookie-1"], "fault_id": 1})
    assert [operation.f for operation in read_history(path)] == ["fault-start"]
    history.close()


def test_append_rejects_an_unknown_type_without_using_an_index(tmp_path):
    path = tmp_path / "history.jsonl"
    with HistoryWriter(path, clock=FakeClock()) as history:
        with pytest.raises(ValueError, match="type must be one of"):
            history.append("writer-0", "done", "add", {"op_id": 0})
        with pytest.raises(TypeError):
            history.append("writer-0", "invoke", "add", {"op_id": 0, "payload": object()})
        operation = history.append("writer-0", "invoke", "create", {})
    assert operation.index == 0
    assert len(read_history(path)) == 1


def test_threads_appending_at_once_keep_whole_lines_and_ordered_indexes(tmp_path):
    # Client tasks and the nemesis record from different threads; the lock
    # keeps each line whole and indexes in file order.
    path = tmp_path / "history.jsonl"
    appends_per_thread = 300
    with HistoryWriter(path) as history:

        def record(process: str) -> None:
            for sequence in range(appends_per_thread):
                history.append(process, "invoke", "add", {"op_id": sequence, "payload": f"{process}:{sequence}" * 20})

        threads = [threading.Thread(target=record, args=(f"writer-{number}",)) for number in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    operations = read_history(path)
    assert [operation.index for operation in operations] == list(range(4 * appends_per_thread))
    times_ms = [operation.time_ms for operation in operations]
    assert times_ms == sorted(times_ms)
    for number in range(4):
        own = [operation.value["op_id"] for operation in operations if operation.process == f"writer-{number}"]
        assert own == list(range(appends_per_thread))


def test_a_torn_last_line_is_ignored(tmp_path):
    # The writer was killed in the middle of its third line.
    path = tmp_path / "history.jsonl"
    path.write_text(record_line(0) + "\n" + record_line(1, type="ok", value={"ledger": 3}) + "\n" + record_line(2)[:25])
    operations = read_history(path)
    assert [operation.index for operation in operations] == [0, 1]


def test_a_whole_last_line_without_its_newline_is_kept(tmp_path):
    path = tmp_path / "history.jsonl"
    path.write_text(record_line(0) + "\n" + record_line(1, type="ok", value={"ledger": 3}))
    assert [operation.type for operation in read_history(path)] == ["invoke", "ok"]


def test_a_malformed_middle_line_raises_with_its_line_number(tmp_path):
    path = tmp_path / "history.jsonl"
    path.write_text(record_line(0) + "\n" + record_line(1) + "\n" + '{"index": 2, "time_ms": ' + "\n" + record_line(3) + "\n")
    with pytest.raises(HistoryFormatError, match=r"line 3: not valid JSON"):
        read_history(path)


def test_a_torn_line_that_ends_with_a_newline_is_not_a_tail(tmp_path):
    # Only an unterminated last line can be a torn write; a bad line followed
    # by a newline was written whole and is an error.
    path = tmp_path / "history.jsonl"
    path.write_text(record_line(0) + "\n" + record_line(1)[:25] + "\n")
    with pytest.raises(HistoryFormatError, match="line 2"):
        read_history(path)


@pytest.mark.parametrize(
    "line, message",
    [
        (record_line(1, type="done"), "type must be one of"),
        (record_line(1, value=None).replace('"value": {}', '"value": [1]'), "value must be a JSON object"),
        ('{"index": 1, "time_ms": 0, "process": "writer-0", "type": "ok"}', "missing field"),
        (record_line(5), "index 5, expected 1"),
        ("[1, 2]", "expected a JSON object"),
    ],
)
def test_a_record_with_a_bad_field_raises_with_its_line_number(tmp_path, line, message):
    path = tmp_path / "history.jsonl"
    path.write_text(record_line(0) + "\n" + line + "\n")
    with pytest.raises(HistoryFormatError, match=f"line 2: .*{message}"):
        read_history(path)


def operation(index: int, time_ms: float, process: str, type: str, f: str, value: dict) -> Operation:
    return Operation(index, time_ms, process, type, f, value)


def test_pipelined_adds_pair_by_op_id_and_an_unfinished_invoke_counts_as_info():
    # writer-0 has three adds in flight; the second completes first, the
    # third never completes because the run was cut.
    operations = [
        operation(0, 0, "writer-0", "invoke", "add", {"op_id": 0, "ledger": 1, "payload": "writer-0:0"}),
        operation(1, 1, "writer-0", "invoke", "add", {"op_id": 1, "ledger": 1, "payload": "writer-0:1"}),
        operation(2, 2, "writer-0", "invoke", "add", {"op_id": 2, "ledger": 1, "payload": "writer-0:2"}),
        operation(3, 5, "writer-0", "ok", "add", {"op_id": 1, "ledger": 1, "entry": 1, "payload": "writer-0:1"}),
        operation(4, 9, "writer-0", "fail", "add", {"op_id": 0, "ledger": 1, "payload": "writer-0:0", "error": "x"}),
        operation(5, 9, "nemesis", "info", "fault-start", {"fault": "kill", "targets": ["bookie-1"], "fault_id": 1}),
    ]
    pairs = pair_operations(operations)
    assert [pair.invoke.index for pair in pairs] == [0, 1, 2]
    assert [pair.outcome for pair in pairs] == ["fail", "ok", "info"]
    assert [pair.latency_ms for pair in pairs] == [9, 4, None]


def test_a_completion_without_an_invoke_raises():
    operations = [operation(0, 0, "reader-0", "ok", "read", {"ledger": 1, "closed": True, "last_entry": -1, "entries": []})]
    with pytest.raises(HistoryFormatError, match="operation 0: .*completes nothing"):
        pair_operations(operations)


def test_a_second_invoke_while_one_is_outstanding_raises():
    # Only adds pipeline; a reader has one read in flight at a time.
    operations = [
        operation(0, 0, "reader-0", "invoke", "read", {"ledger": 1}),
        operation(1, 1, "reader-0", "invoke", "read", {"ledger": 2}),
    ]
    with pytest.raises(HistoryFormatError, match="operation 1: .*still outstanding"):
        pair_operations(operations)


def test_any_operation_with_an_op_id_pairs_by_it_and_the_broker_run_requires_one():
    # A broker run's consumer has two receives of one session in flight;
    # they complete in the other order.
    operations = [
        operation(0, 0, "consumer-0", "invoke", "receive", {"op_id": "1.0", "session": "s"}),
        operation(1, 1, "consumer-0", "invoke", "receive", {"op_id": "1.1", "session": "s"}),
        operation(2, 5, "consumer-0", "ok", "receive", {"op_id": "1.1", "offset": 0}),
        operation(3, 9, "consumer-0", "fail", "receive", {"op_id": "1.0", "error": "idle"}),
    ]
    pairs = pair_operations(operations, op_ids_required=True)
    assert [(pair.invoke.index, pair.completion.index) for pair in pairs] == [(0, 3), (1, 2)]
    without = [operation(0, 0, "consumer-0", "invoke", "subscribe", {"session": "s"})]
    assert pair_operations(without)[0].outcome == "info"
    with pytest.raises(HistoryFormatError, match="operation 0: invoke subscribe without an op_id"):
        pair_operations(without, op_ids_required=True)


def nemesis(index: int, time_ms: float, f: str, fault: str, targets: list[str], fault_id: int) -> Operation:
    return operation(index, time_ms, "nemesis", "info", f, {"fault": fault, "targets": targets, "fault_id": fault_id})


def test_fault_windows_pair_by_fault_id_and_an_unended_fault_runs_to_the_end():
    # A kill and a partition overlap and end in the other order; a session
    # expiry is instantaneous; a pause is never healed before the run ends.
    operations = [
        nemesis(0, 1000, "fault-start", "kill", ["bookie-1"], 1),
        nemesis(1, 1500, "fault-start", "partition", ["bookie-2", "bookie-3"], 2),
        nemesis(2, 2000, "fault-end", "partition", ["bookie-2", "bookie-3"], 2),
        operation(3, 2100, "writer-0", "invoke", "create", {}),
        nemesis(4, 3000, "fault-end", "kill", ["bookie-1"], 1),
        nemesis(5, 3500, "fault-start", "expire-session", ["writer-0"], 3),
        nemesis(6, 3500, "fault-end", "expire-session", ["writer-0"], 3),
        nemesis(7, 4000, "fault-start", "pause", ["bookie-4"], 4),
    ]
    assert fault_windows(operations) == [
        FaultWindow("kill", ("bookie-1",), 1, 1000, 3000),
        FaultWindow("partition", ("bookie-2", "bookie-3"), 2, 1500, 2000),
        FaultWindow("expire-session", ("writer-0",), 3, 3500, 3500),
        FaultWindow("pause", ("bookie-4",), 4, 4000, None),
    ]
    assert fault_windows(operations)[-1].end_ms_or(9000) == 9000


def test_a_fault_end_that_matches_no_running_fault_raises():
    operations = [
        nemesis(0, 1000, "fault-start", "kill", ["bookie-1"], 1),
        nemesis(1, 2000, "fault-end", "kill", ["bookie-1"], 1),
        nemesis(2, 3000, "fault-end", "kill", ["bookie-1"], 1),
    ]
    with pytest.raises(HistoryFormatError, match="operation 2: fault-end of fault_id 1"):
        fault_windows(operations)


def test_histories_of_several_processes_merge_in_time_order(tmp_path):
    # Two processes record with one origin on a shared clock; the merge
    # interleaves them by time and numbers the records afresh.
    now = [100.0]
    first = HistoryWriter(tmp_path / "a.jsonl", clock=lambda: now[0], origin_s=99.0)
    second = HistoryWriter(tmp_path / "b.jsonl", clock=lambda: now[0], origin_s=99.0)
    first.append("writer-0", "invoke", "create", {})  # at 1000 ms
    now[0] = 100.5
    second.append("reader-0", "invoke", "read", {"ledger": 1})  # at 1500 ms
    now[0] = 100.2
    first.append("writer-0", "ok", "create", {"ledger": 1})  # at 1200 ms
    first.close()
    second.close()
    merged = merge_histories([tmp_path / "a.jsonl", tmp_path / "b.jsonl"], tmp_path / "merged.jsonl")
    assert [(operation.index, operation.time_ms, operation.process) for operation in merged] == [
        (0, 1000.0, "writer-0"), (1, 1200.0, "writer-0"), (2, 1500.0, "reader-0"),
    ]
    assert read_history(tmp_path / "merged.jsonl") == merged
