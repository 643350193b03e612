"""The picture of a Jepsen-style run: the writes per second and their latency
(p50, p99) over time, with the nemesis's fault windows shaded, saved as a
PNG. The writes are the ledger run's adds, or the broker run's produces."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from sim.jepsen.history import Operation, fault_windows, pair_operations

BUCKET_MS = 1000.0
# Latency is drawn on a log scale, which cannot show zero; a sub-microsecond
# latency (only seen in hand-made histories) is drawn at this floor.
LATENCY_MS_FLOOR = 0.001
FAULT_COLOURS = {
    "kill": "tab:red",
    "pause": "tab:orange",
    "partition": "tab:purple",
    "expire-session": "tab:blue",
}
FAULT_COLOUR_OTHER = "tab:gray"
FAULT_ALPHA = 0.2  # light enough that the lines stay readable over the shading
# An instantaneous fault (a session expiry) is drawn at least this wide so
# that it shows.
FAULT_WIDTH_S_MIN = 0.1


@dataclass(frozen=True, slots=True)
class Throughput:
    """Writes completed per one-second bucket; bucket k covers [k, k+1) s."""

    seconds: list[int]
    ok_per_second: list[int]
    failed_per_second: list[int]  # fail and info completions together


@dataclass(frozen=True, slots=True)
class Latency:
    """Latency of acknowledged writes, by the bucket of their invoke; only
    buckets with at least one write appear."""

    seconds: list[int]
    latency_ms_p50: list[float]
    latency_ms_p99: list[float]


def _bucket(time_ms: float) -> int:
    return int(time_ms // BUCKET_MS)


def add_throughput(operations: Iterable[Operation], operation_name: str = "add") -> Throughput:
    """Counts the completions of the writes (operations named
    `operation_name`) by the second they completed in; writes the run cut
    short have no completion time and are not counted."""
    ok: dict[int, int] = {}
    failed: dict[int, int] = {}
    last_bucket = -1
    for operation in operations:
        last_bucket = max(last_bucket, _bucket(operation.time_ms))
        if operation.f != operation_name or operation.type == "invoke":
            continue
        counts = ok if operation.type == "ok" else failed
        bucket = _bucket(operation.time_ms)
        counts[bucket] = counts.get(bucket, 0) + 1
    # Every second up to the end of the history appears, so a stall during a
    # fault shows as zero rather than as a line drawn across the gap.
    seconds = list(range(last_bucket + 1))
    return Throughput(seconds, [ok.get(second, 0) for second in seconds], [failed.get(second, 0) for second in seconds])


def _percentile(sorted_values: list[float], fraction: float) -> float:
    # Nearest rank: the smallest value with at least `fraction` of the values
    # at or below it, so p99 is a latency some write actually had.
    rank = max(1, math.ceil(fraction * len(sorted_values)))
    return sorted_values[rank - 1]


def add_latency(operations: Iterable[Operation], operation_name: str = "add") -> Latency:
    by_bucket: dict[int, list[float]] = {}
    writes = [operation for operation in operations if operation.f == operation_name]
    for pair in pair_operations(writes):
        if pair.outcome == "ok":
            by_bucket.setdefault(_bucket(pair.invoke.time_ms), []).append(pair.latency_ms)
    seconds = sorted(by_bucket)
    p50, p99 = [], []
    for second in seconds:
        latencies_ms = sorted(by_bucket[second])
        p50.append(_percentile(latencies_ms, 0.50))
        p99.append(_percentile(latencies_ms, 0.99))
    return Latency(seconds, p50, p99)


def plot_history(operations: Iterable[Operation], path_png: str | Path, *, title: str, operation_name: str = "add",
                 noun: str = "adds") -> None:
    """Draws the run into a PNG at `path_png`: the writes are the operations
    named `operation_name`, called `noun` in the labels (the broker run's
    are "produce" operations, "messages")."""
    # matplotlib is imported here, and through Figure rather than pyplot, so
    # that importing sim.jepsen needs neither matplotlib's start-up time nor a
    # display, and no global backend is switched under the caller.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    operations = list(operations)
    throughput = add_throughput(operations, operation_name)
    latency = add_latency(operations, operation_name)
    windows = fault_windows(operations)
    end_ms = max((operation.time_ms for operation in operations), default=0.0)

    figure = Figure(figsize=(12, 7), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    throughput_axes, latency_axes = figure.subplots(2, 1, sharex=True)
    figure.suptitle(title)

    # A bucket's count is drawn across the second it covers.
    step_x = [*throughput.seconds, len(throughput.seconds)]
    throughput_axes.plot(step_x, [*throughput.ok_per_second, 0], drawstyle="steps-post", color="tab:green", label=f"acknowledged {noun}")
    throughput_axes.plot(step_x, [*throughput.failed_per_second, 0], drawstyle="steps-post", color="tab:red", linestyle="--", label=f"failed or indeterminate {noun}")
    throughput_axes.set_ylabel(f"{noun} per second")
    throughput_axes.set_ylim(bottom=0)

    middle_x = [second + 0.5 for second in latency.seconds]
    latency_axes.plot(middle_x, [max(value, LATENCY_MS_FLOOR) for value in latency.latency_ms_p50], marker=".", color="tab:blue", label="p50")
    latency_axes.plot(middle_x, [max(value, LATENCY_MS_FLOOR) for value in latency.latency_ms_p99], marker=".", color="tab:brown", label="p99")
    latency_axes.set_yscale("log")
    if not latency.seconds:
        # An empty log axis has no range of its own to autoscale to.
        latency_axes.set_ylim(1, 1000)
    latency_axes.set_ylabel(f"{operation_name} latency (ms)")
    latency_axes.set_xlabel("time since start (s)")
    latency_axes.set_xlim(0, max(end_ms / 1000.0, 1.0))

    kinds_shown: list[str] = []
    for window in windows:
        colour = FAULT_COLOURS.get(window.fault, FAULT_COLOUR_OTHER)
        start_s = window.start_ms / 1000.0
        end_s = max(window.end_ms_or(end_ms) / 1000.0, start_s + FAULT_WIDTH_S_MIN)
        for axes in (throughput_axes, latency_axes):
            axes.axvspan(start_s, end_s, color=colour, alpha=FAULT_ALPHA, linewidth=0)
        if window.fault not in kinds_shown:
            kinds_shown.append(window.fault)

    fault_handles = [
        Patch(color=FAULT_COLOURS.get(kind, FAULT_COLOUR_OTHER), alpha=FAULT_ALPHA, label=f"fault: {kind}") for kind in kinds_shown
    ]
    handles, _ = throughput_axes.get_legend_handles_labels()
    # Legends go outside the panels on the right, where they hide no data.
    throughput_axes.legend(handles=handles + fault_handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    latency_axes.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    for axes in (throughput_axes, latency_axes):
        axes.grid(True, alpha=0.3)
    figure.savefig(path_png, format="png")
