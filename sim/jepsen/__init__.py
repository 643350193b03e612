"""Jepsen-style testing of a real quire cluster: the history of operations a
run records (history.py), the checker that judges it (checker.py) and the plot
of its throughput and latency under faults (plot.py), the per-link proxies
the nemesis partitions through (proxy.py) and the client processes (client.py);
for the broker run, its client processes (broker_client.py) and checker
(broker_checker.py). What the two runs' checkers share is in verdict.py,
what their client processes share in client_process.py."""

from sim.jepsen.broker_checker import BrokerAnomaly, BrokerCheckResult, check_broker
from sim.jepsen.checker import Anomaly, CheckResult, check
from sim.jepsen.history import (
    FaultWindow,
    HistoryFormatError,
    HistoryWriter,
    Operation,
    OperationPair,
    fault_windows,
    merge_histories,
    pair_operations,
    read_history,
)
from sim.jepsen.plot import plot_history
from sim.jepsen.proxy import LinkProxy, ProxyMesh, ProxyStats

__all__ = [
    "Anomaly",
    "BrokerAnomaly",
    "BrokerCheckResult",
    "CheckResult",
    "FaultWindow",
    "HistoryFormatError",
    "HistoryWriter",
    "LinkProxy",
    "Operation",
    "OperationPair",
    "ProxyMesh",
    "ProxyStats",
    "check",
    "check_broker",
    "fault_windows",
    "merge_histories",
    "pair_operations",
    "plot_history",
    "read_history",
]
