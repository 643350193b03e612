"""Jepsen-style testing of a real quire cluster: the history of operations a
run records (history.py), the checker that judges it (checker.py) and the plot
of its throughput and latency under faults (plot.py)."""

from sim.jepsen.checker import Anomaly, CheckResult, check
from sim.jepsen.history import (
    FaultWindow,
    HistoryFormatError,
    HistoryWriter,
    Operation,
    OperationPair,
    fault_windows,
    pair_operations,
    read_history,
)
from sim.jepsen.plot import plot_history

__all__ = [
    "Anomaly",
    "CheckResult",
    "FaultWindow",
    "HistoryFormatError",
    "HistoryWriter",
    "Operation",
    "OperationPair",
    "check",
    "fault_windows",
    "pair_operations",
    "plot_history",
    "read_history",
]
