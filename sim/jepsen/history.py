"""The history of a Jepsen-style run: one JSON operation record per line
(invoke, then ok/fail/info), written as the run goes and read back for the
checker and the plot; also pairs invokes with completions and faults into windows."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

TYPES = ("invoke", "ok", "fail", "info")
COMPLETION_TYPES = ("ok", "fail", "info")
NEMESIS_PROCESS = "nemesis"
FAULT_START = "fault-start"
FAULT_END = "fault-end"

# The record's keys in the order they are written, so a line reads the same
# way in every history and `grep` on a prefix works.
_RECORD_KEYS = ("index", "time_ms", "process", "type", "f", "value")


class HistoryFormatError(ValueError):
    """A history file or operation list that breaks the format (what the
    recorder wrote is wrong, not what the cluster did)."""


@dataclass(frozen=True, slots=True)
class Operation:
    index: int
    time_ms: float
    process: str
    type: str  # "invoke" | "ok" | "fail" | "info"
    f: str  # "add", "create", "close", "read", "recover", "fault-start", "fault-end"
    value: dict[str, Any]

    def to_record(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "time_ms": self.time_ms,
            "process": self.process,
            "type": self.type,
            "f": self.f,
            "value": self.value,
        }

    @classmethod
    def from_record(cls, record: Any) -> "Operation":
        """Builds an operation from a decoded JSON object; raises ValueError
        naming the first field that is missing or of the wrong kind."""
        if not isinstance(record, dict):
            raise ValueError(f"expected a JSON object, got {type(record).__name__}")
        missing = [key for key in _RECORD_KEYS if key not in record]
        if missing:
            raise ValueError(f"missing field(s) {', '.join(missing)}")
        index, time_ms = record["index"], record["time_ms"]
        # bool is an int subclass in Python; true/false is never a valid index.
        if not isinstance(index, int) or isinstance(index, bool) or index < 0:
            raise ValueError(f"index must be a non-negative integer, got {index!r}")
        if not isinstance(time_ms, (int, float)) or isinstance(time_ms, bool):
            raise ValueError(f"time_ms must be a number, got {time_ms!r}")
        if not isinstance(record["process"], str) or not record["process"]:
            raise ValueError(f"process must be a non-empty string, got {record['process']!r}")
        if record["type"] not in TYPES:
            raise ValueError(f"type must be one of {', '.join(TYPES)}, got {record['type']!r}")
        if not isinstance(record["f"], str) or not record["f"]:
            raise ValueError(f"f must be a non-empty string, got {record['f']!r}")
        if not isinstance(record["value"], dict):
            raise ValueError(f"value must be a JSON object, got {record['value']!r}")
        return cls(index, float(time_ms), record["process"], record["type"], record["f"], record["value"])


class HistoryWriter:
    """Appends operation records to a JSON-lines file. Each line is flushed as
    it is written, so a run killed with SIGKILL keeps everything it recorded
    except perhaps a torn last line (which `read_history` ignores).

    `clock` returns seconds (like `time.monotonic`, the default); time_ms is
    measured from the writer's creation. One lock orders the index, the clock
    reading and the write, so indexes and times grow in file order even when
    several tasks or threads record at once."""

    def __init__(self, path: str | Path, clock: Callable[[], float] = time.monotonic, *, origin_s: float | None = None) -> None:
        self.path = Path(path)
        self._clock = clock
        # Several processes writing their own files share an origin on the
        # system-wide monotonic clock, so that their histories merge in time.
        self._start_s = clock() if origin_s is None else origin_s
        self._lock = threading.Lock()
        self._next_index = 0
        self._file = open(self.path, "w", encoding="utf-8")

    def append(self, process: str, type: str, f: str, value: dict[str, Any] | None = None) -> Operation:
        if type not in TYPES:
            raise ValueError(f"type must be one of {', '.join(TYPES)}, got {type!r}")
        if not isinstance(process, str) or not process:
            raise ValueError(f"process must be a non-empty string, got {process!r}")
        if not isinstance(f, str) or not f:
            raise ValueError(f"f must be a non-empty string, got {f!r}")
        value = {} if value is None else dict(value)
        with self._lock:
            if self._file.closed:
                raise ValueError(f"history {self.path} is closed")
            time_ms = round((self._clock() - self._start_s) * 1000.0, 3)
            operation = Operation(self._next_index, time_ms, process, type, f, value)
            # The index advances only once the line is written, so a value
            # that is not JSON (json.dumps raises) leaves no gap.
            line = json.dumps(operation.to_record(), separators=(",", ":")) + "\n"
            self._file.write(line)
            self._file.flush()
            self._next_index += 1
        return operation

    def close(self) -> None:
        with self._lock:
            self._file.close()

    def __enter__(self) -> "HistoryWriter":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def merge_histories(paths: Iterable[str | Path], merged_path: str | Path) -> list[Operation]:
    """Merges the histories of several processes (written with one origin)
    into one, in time order, renumbered, and writes it to `merged_path`."""
    operations = [operation for path in paths for operation in read_history(path)]
    operations.sort(key=lambda operation: operation.time_ms)  # stable: a file's own order is kept
    merged = [
        Operation(index, operation.time_ms, operation.process, operation.type, operation.f, operation.value)
        for index, operation in enumerate(operations)
    ]
    with open(merged_path, "w", encoding="utf-8") as file:
        for operation in merged:
            file.write(json.dumps(operation.to_record(), separators=(",", ":")) + "\n")
    return merged


def read_history(path: str | Path) -> list[Operation]:
    """Reads a history file. A last line without its newline that is not valid
    JSON is the torn tail of a killed writer and is dropped; any other bad
    line raises HistoryFormatError naming its line number."""
    text = Path(path).read_text(encoding="utf-8")
    lines = text.split("\n")
    # After a final newline, split leaves one empty string; without one, the
    # last element is a line whose writer may have been killed mid-write.
    tail_is_unterminated = lines[-1] != ""
    if not tail_is_unterminated:
        lines.pop()
    operations: list[Operation] = []
    for line_number, line in enumerate(lines, start=1):
        is_last = line_number == len(lines)
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            if is_last and tail_is_unterminated:
                break
            raise HistoryFormatError(f"{path}: line {line_number}: not valid JSON ({error.msg})") from None
        try:
            operation = Operation.from_record(record)
        except ValueError as error:
            raise HistoryFormatError(f"{path}: line {line_number}: {error}") from None
        if operation.index != len(operations):
            raise HistoryFormatError(
                f"{path}: line {line_number}: index {operation.index}, expected {len(operations)} "
                "(indexes count the records from 0)"
            )
        operations.append(operation)
    return operations


@dataclass(frozen=True, slots=True)
class OperationPair:
    """A client operation: its invoke and its completion (None when the
    history ended first, which counts as indeterminate)."""

    invoke: Operation
    completion: Operation | None

    @property
    def outcome(self) -> str:
        """"ok", "fail" or "info"; an operation never completed is "info"."""
        return "info" if self.completion is None else self.completion.type

    @property
    def latency_ms(self) -> float | None:
        if self.completion is None:
            return None
        return self.completion.time_ms - self.invoke.time_ms


def _pairing_key(operation: Operation, op_ids_required: bool) -> tuple[str, Any]:
    # An operation with an op_id is named by it: a writer pipelines its adds,
    # and a broker run's client has several operations of a kind in flight.
    # One without is alone in flight in its process, which names it.
    op_id = operation.value.get("op_id")
    if op_id is None and (op_ids_required or operation.f == "add"):
        raise HistoryFormatError(f"operation {operation.index}: {operation.type} {operation.f} without an op_id")
    return (operation.process, op_id)


def pair_operations(operations: Iterable[Operation], *, op_ids_required: bool = False) -> list[OperationPair]:
    """Matches every client invoke with its completion, in invoke order; an
    invoke never completed pairs with None. Adds always carry an op_id; with
    `op_ids_required` (the broker run) every client operation must. Nemesis
    records are not client operations and are skipped."""
    pairs: list[OperationPair | None] = []
    outstanding: dict[tuple[str, Any], tuple[int, Operation]] = {}
    for operation in operations:
        if operation.process == NEMESIS_PROCESS:
            continue
        key = _pairing_key(operation, op_ids_required)
        if operation.type == "invoke":
            if key in outstanding:
                earlier = outstanding[key][1]
                same_op_id = "" if key[1] is None else f" with op_id {key[1]!r}"
                raise HistoryFormatError(
                    f"operation {operation.index}: {operation.process} invokes {operation.f}{same_op_id} while "
                    f"operation {earlier.index} ({earlier.f}) is still outstanding"
                )
            outstanding[key] = (len(pairs), operation)
            pairs.append(None)
            continue
        if key not in outstanding:
            raise HistoryFormatError(
                f"operation {operation.index}: {operation.type} {operation.f} of {operation.process} "
                "completes nothing that was invoked"
            )
        position, invoke = outstanding.pop(key)
        if invoke.f != operation.f:
            raise HistoryFormatError(
                f"operation {operation.index}: completes {operation.f} but operation {invoke.index} invoked {invoke.f}"
            )
        pairs[position] = OperationPair(invoke, operation)
    for position, invoke in outstanding.values():
        pairs[position] = OperationPair(invoke, None)
    assert all(pair is not None for pair in pairs)
    return pairs  # type: ignore[return-value]


def integer_value(operation: Operation, key: str) -> int:
    """The integer at `key` of an operation's value, for a checker; anything
    else there is the recorder's mistake (HistoryFormatError)."""
    value = operation.value.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise HistoryFormatError(f"operation {operation.index}: {operation.type} {operation.f} needs an integer {key}, got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class FaultWindow:
    fault: str  # "kill" | "pause" | "partition" | "expire-session"
    targets: tuple[str, ...]
    fault_id: Any
    start_ms: float
    end_ms: float | None  # None: the fault lasted to the end of the history

    def end_ms_or(self, history_end_ms: float) -> float:
        return history_end_ms if self.end_ms is None else self.end_ms


def fault_windows(operations: Iterable[Operation]) -> list[FaultWindow]:
    """Pairs the nemesis's fault-start and fault-end records by fault_id,
    in order of start."""
    started: dict[Any, tuple[int, Operation]] = {}
    windows: list[FaultWindow | None] = []
    for operation in operations:
        if operation.process != NEMESIS_PROCESS or operation.f not in (FAULT_START, FAULT_END):
            continue
        if "fault_id" not in operation.value:
            raise HistoryFormatError(f"operation {operation.index}: {operation.f} without a fault_id")
        fault_id = operation.value["fault_id"]
        if operation.f == FAULT_START:
            if fault_id in started:
                raise HistoryFormatError(f"operation {operation.index}: fault_id {fault_id!r} started twice")
            started[fault_id] = (len(windows), operation)
            windows.append(None)
            continue
        if fault_id not in started or windows[started[fault_id][0]] is not None:
            raise HistoryFormatError(
                f"operation {operation.index}: fault-end of fault_id {fault_id!r}, which is not running"
            )
        position, start = started[fault_id]
        windows[position] = _window(start, operation.time_ms)
    for position, start in started.values():
        if windows[position] is None:
            windows[position] = _window(start, None)
    return windows  # type: ignore[return-value]


def _window(start: Operation, end_ms: float | None) -> FaultWindow:
    return FaultWindow(
        fault=str(start.value.get("fault", "unknown")),
        targets=tuple(start.value.get("targets", ())),
        fault_id=start.value["fault_id"],
        start_ms=start.time_ms,
        end_ms=end_ms,
    )
