"""The pieces of metrics and logging that need no process: the bookie's
lock-free histogram as Prometheus reads it, the under-replicated count's
bounded refresh, the broker's result series, and the log line format."""

from __future__ import annotations

import io
import json
import logging
import threading
import time
from types import SimpleNamespace

import pytest
import trio
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from bookie.metrics import INF, BookieMetrics, LoopHistogram, UnderReplicatedCount
from broker.metrics import broker_registry
from bookie.protocol.wire import Status
from quire import logging_setup


def exposed(family) -> dict:
    """The samples Prometheus would scrape for one family."""

    class One:
        def collect(self):
            return [family]

    registry = CollectorRegistry()
    registry.register(One())
    text = generate_latest(registry).decode()
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for parsed in text_string_to_metric_families(text) for sample in parsed.samples}


def test_histogram_buckets_are_cumulative_and_inclusive():
    histogram = LoopHistogram((0.001, 0.01, INF))
    for value in (0.0005, 0.001, 0.002, 5.0):  # 0.001 belongs to le="0.001"
        histogram.observe(value)
    samples = exposed(histogram.family("quire_test_seconds", "a test"))
    assert samples[("quire_test_seconds_bucket", (("le", "0.001"),))] == 2
    assert samples[("quire_test_seconds_bucket", (("le", "0.01"),))] == 3
    assert samples[("quire_test_seconds_bucket", (("le", "+Inf"),))] == 4
    assert samples[("quire_test_seconds_count", ())] == 4
    assert samples[("quire_test_seconds_sum", ())] == pytest.approx(5.0035)


def test_answers_count_by_result_and_only_successes_have_latency():
    metrics = BookieMetrics()
    metrics.answered(True, Status.OK, 0.0004)
    metrics.answered(True, Status.TOO_MANY_REQUESTS, 0.00001)
    metrics.answered(False, Status.OK, None)  # a long poll: counted, not timed
    assert metrics.adds_ok == 1 and metrics.add_results == {Status.TOO_MANY_REQUESTS: 1}
    assert metrics.read_results == {Status.OK: 1}
    assert sum(metrics.add_latency_s.counts) == 1 and sum(metrics.read_latency_s.counts) == 0


class _Store:
    """`exists` answers `stat`, or blocks until released (ZooKeeper not answering)."""

    def __init__(self, stat=None, blocked: bool = False) -> None:
        self.stat = stat
        self.release = threading.Event()
        if not blocked:
            self.release.set()

    def exists(self, path: str):
        self.release.wait(10)
        return self.stat


def test_under_replicated_count_is_refreshed_within_its_bound():
    counted = UnderReplicatedCount(_Store(SimpleNamespace(children_count=2)))
    trio.run(counted.refresh)
    assert counted.value == 2
    silent = _Store(SimpleNamespace(children_count=2), blocked=True)
    counted.store = silent
    started = time.monotonic()
    try:
        trio.run(UnderReplicatedCount.refresh, counted)
        # The read is given up after its bound, and the count is unknown
        # rather than stale (the scrape leaves the series out).
        assert time.monotonic() - started < counted.read_timeout_s + 0.5
        assert counted.value is None
    finally:
        silent.release.set()


def test_broker_result_series_exist_at_zero_from_the_start():
    registry, _ = broker_registry()
    samples = {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
               for family in text_string_to_metric_families(generate_latest(registry).decode()) for sample in family.samples}
    for result in ("ok", "duplicate", "partition_overflow", "topic_fenced"):
        assert samples[("quire_broker_publish_requests_total", (("result", result),))] == 0


@pytest.fixture
def captured_log():
    stream = io.StringIO()
    root, kazoo, kazoo_parent = logging.getLogger(), logging.getLogger("kazoo.client"), logging.getLogger("kazoo")
    saved = (list(root.handlers), root.level, list(kazoo.filters), kazoo.level, kazoo_parent.level)
    yield stream
    root.handlers[:] = saved[0]
    root.setLevel(saved[1])
    kazoo.filters[:] = saved[2]
    kazoo.setLevel(saved[3])
    kazoo_parent.setLevel(saved[4])


def configure(stream: io.StringIO, log_format: str) -> None:
    logging_setup.configure_logging("info", "bookie", "127.0.0.1:3181", log_format)
    logging.getLogger().handlers[0].setStream(stream)


def test_text_lines_name_role_and_id(captured_log):
    configure(captured_log, "text")
    logging.getLogger("bookie.journal").info("synced %d records", 3)
    line = captured_log.getvalue().rstrip("\n")
    timestamp, rest = line.split(" ", 1)
    assert rest == "INFO bookie 127.0.0.1:3181 bookie.journal: synced 3 records"
    assert timestamp.endswith("Z") and "T" in timestamp


def test_json_lines_name_role_and_id(captured_log):
    configure(captured_log, "json")
    logging.getLogger("broker.server").warning("a \"quoted\" word")
    record = json.loads(captured_log.getvalue())
    assert {key: record[key] for key in ("level", "role", "id", "logger", "message")} == {
        "level": "WARNING", "role": "bookie", "id": "127.0.0.1:3181", "logger": "broker.server",
        "message": 'a "quoted" word',
    }


def test_kazoo_retries_stay_quiet_until_the_first_session(captured_log):
    configure(captured_log, "text")
    kazoo = logging.getLogger("kazoo.client")
    kazoo.warning("Connection dropped: socket connection error: Connection refused")
    assert captured_log.getvalue() == ""  # the startup error line says it
    kazoo.info("Zookeeper connection established, state: CONNECTED")
    kazoo.warning("Connection dropped: socket connection error: Connection reset")
    assert captured_log.getvalue().count("\n") == 1 and "Connection reset" in captured_log.getvalue()
