"""The Jepsen run plot: the per-second throughput and latency it draws, and
the PNG it writes (with fault windows, and for an empty history)."""

from __future__ import annotations

import random

import numpy
from matplotlib.colors import to_rgb
from matplotlib.image import imread

from sim.jepsen.history import Operation
from sim.jepsen.plot import FAULT_ALPHA, FAULT_COLOURS, add_latency, add_throughput, plot_history

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def add_records(index: int, writer: str, op_id: int, invoke_ms: float, complete_ms: float, outcome: str, entry: int = 0) -> list[Operation]:
    value = {"op_id": op_id, "ledger": 1, "payload": f"{writer}:{op_id}"}
    completion = {**value, "entry": entry} if outcome == "ok" else {**value, "error": "fenced"}
    return [
        Operation(index, invoke_ms, writer, "invoke", "add", value),
        Operation(index + 1, complete_ms, writer, outcome, "add", completion),
    ]


def test_throughput_counts_completions_per_second_with_quiet_seconds_as_zero():
    # Two adds acknowledged in second 0, none in second 1 (a stall), one
    # acknowledged and one failed in second 2.
    operations = [
        *add_records(0, "writer-0", 0, 100, 200, "ok"),
        *add_records(2, "writer-0", 1, 300, 900, "ok"),
        *add_records(4, "writer-0", 2, 950, 2100, "ok"),
        *add_records(6, "writer-0", 3, 960, 2500, "info"),
    ]
    throughput = add_throughput(operations)
    assert throughput.seconds == [0, 1, 2]
    assert throughput.ok_per_second == [2, 0, 1]
    assert throughput.failed_per_second == [0, 0, 1]


def test_latency_percentiles_are_per_second_of_invoke_for_acknowledged_adds():
    # In second 0, a hundred adds take 1..100 ms; the failed add's latency
    # is left out. In second 3, one add takes 40 ms.
    operations: list[Operation] = []
    for op_id in range(100):
        operations += add_records(len(operations), "writer-0", op_id, 5.0 * op_id, 5.0 * op_id + op_id + 1, "ok")
    operations += add_records(len(operations), "writer-0", 100, 600, 5600, "fail")
    operations += add_records(len(operations), "writer-0", 101, 3000, 3040, "ok")
    latency = add_latency(operations)
    assert latency.seconds == [0, 3]
    assert latency.latency_ms_p50 == [50, 40]
    assert latency.latency_ms_p99 == [99, 40]


def test_the_broker_run_s_writes_are_its_produces():
    # A producer's two sends, pipelined (one acknowledged, one never
    # answered), and a consumer's receive that is no write at all.
    operations = [
        Operation(0, 100, "producer-0", "invoke", "produce", {"op_id": "1.0", "seq": 0}),
        Operation(1, 150, "producer-0", "invoke", "produce", {"op_id": "1.1", "seq": 1}),
        Operation(2, 300, "consumer-0", "invoke", "receive", {"op_id": "1.0", "session": "s"}),
        Operation(3, 400, "producer-0", "ok", "produce", {"op_id": "1.0", "offset": 0}),
        Operation(4, 1200, "consumer-0", "ok", "receive", {"op_id": "1.0", "session": "s", "offset": 0}),
    ]
    throughput = add_throughput(operations, "produce")
    assert (throughput.seconds, throughput.ok_per_second, throughput.failed_per_second) == ([0, 1], [1, 0], [0, 0])
    assert add_latency(operations, "produce").latency_ms_p50 == [300]
    # Counted as adds, there are none.
    assert add_throughput(operations).ok_per_second == [0, 0] and add_latency(operations).seconds == []


def simulated_run(seed: int) -> list[Operation]:
    """Twenty seconds of two pipelining writers with a kill, a partition,
    a session expiry and a pause that never heals."""
    rng = random.Random(seed)
    events: list[tuple[float, str, str, str, dict]] = []
    for writer_number in range(2):
        writer = f"writer-{writer_number}"
        for op_id in range(1500):
            invoke_ms = op_id * 13.0 + writer_number
            slow = 5000 <= invoke_ms < 8000
            latency_ms = rng.uniform(1, 5) * (60 if slow else 1)
            outcome = "info" if slow and rng.random() < 0.2 else "ok"
            value = {"op_id": op_id, "ledger": writer_number, "payload": f"{writer}:{op_id}"}
            events.append((invoke_ms, writer, "invoke", "add", value))
            completion = {**value, "entry": op_id} if outcome == "ok" else {**value, "error": "timed out"}
            events.append((invoke_ms + latency_ms, writer, outcome, "add", completion))
    faults = [("kill", 5000, 8000, 1), ("partition", 9000, 11000, 2), ("expire-session", 12000, 12000, 3), ("pause", 15000, None, 4)]
    for kind, start_ms, end_ms, fault_id in faults:
        value = {"fault": kind, "targets": ["bookie-1"], "fault_id": fault_id}
        events.append((start_ms, "nemesis", "info", "fault-start", value))
        if end_ms is not None:
            events.append((end_ms + 0.001, "nemesis", "info", "fault-end", value))
    events.sort(key=lambda event: event[0])
    return [Operation(index, time_ms, process, type, f, value) for index, (time_ms, process, type, f, value) in enumerate(events)]


def pixels_of_shade(image, fault: str) -> int:
    """How many pixels have the colour of `fault`'s shading over white."""
    shade = 1.0 - FAULT_ALPHA * (1.0 - numpy.array(to_rgb(FAULT_COLOURS[fault])))
    return int((numpy.abs(image[:, :, :3] - shade).max(axis=2) < 0.02).sum())


def test_plot_writes_a_png_of_a_run_with_its_faults_shaded(tmp_path):
    run_path, empty_path = tmp_path / "run.png", tmp_path / "empty.png"
    plot_history(simulated_run(seed=1), run_path, title="quire jepsen: kill, partition, expiry, pause")
    plot_history([], empty_path, title="quire jepsen: kill, partition, expiry, pause")
    content = run_path.read_bytes()
    assert content.startswith(PNG_SIGNATURE)
    # Lines and shading make the picture much richer than bare axes.
    assert len(content) > 1.5 * len(empty_path.read_bytes())
    image = imread(run_path)
    # The kill (3 s), partition (2 s) and unhealed pause (about 4.5 s) cover
    # broad bands of both panels; the empty plot has none of their colours.
    for fault in ("kill", "partition", "pause"):
        assert pixels_of_shade(image, fault) > 10_000, fault
        assert pixels_of_shade(imread(empty_path), fault) == 0, fault


def test_plot_of_an_empty_history_is_still_a_png(tmp_path):
    # A run that died before recording anything still gets its picture.
    path = tmp_path / "empty.png"
    plot_history([], path, title="nothing happened")
    assert path.read_bytes().startswith(PNG_SIGNATURE)
