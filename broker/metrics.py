"""The broker's Prometheus metrics (`quire_broker_*`) and their HTTP endpoint.

Publish results and latencies are observed once per producer batch; message
counts, topics, producers, consumers, backlogs and storage are read from the
server when Prometheus scrapes, on the event loop (so that no partition or
subscription changes under the reader), at no cost to the hot path.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field
from typing import Iterable, Iterator

import trio
from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from broker.errors import BrokerStatus

RATE_WINDOW_S = 10.0  # a partition's rates are over this many seconds
RATE_SAMPLES_MAX = 16  # samples kept (one a second): more than the window


class CounterRates:
    """Per-second rates of some counters, over the last RATE_WINDOW_S
    seconds, from samples taken by the broker's housekeeping clock."""

    __slots__ = ("names", "samples")

    def __init__(self, *names: str) -> None:
        self.names = names
        self.samples: collections.deque[tuple[float, tuple[int, ...]]] = collections.deque(maxlen=RATE_SAMPLES_MAX)

    def sample(self, now: float, counts: tuple[int, ...]) -> None:
        self.samples.append((now, counts))

    def rates(self, now: float, counts: tuple[int, ...]) -> dict[str, float]:
        """`counts` are the counters' values now."""
        past = next((sample for sample in self.samples if now - sample[0] <= RATE_WINDOW_S), None)
        if past is None or now - past[0] <= 0:
            return dict.fromkeys(self.names, 0.0)
        elapsed = now - past[0]
        return {name: round((count - earlier) / elapsed, 1) for name, count, earlier in zip(self.names, counts, past[1])}


@dataclass
class PartitionStats:
    """A partition's counts, and samples of them for its rates."""

    messages_in: int = 0
    bytes_in: int = 0
    messages_out: int = 0
    history: CounterRates = field(
        default_factory=lambda: CounterRates("messages_in_per_s", "bytes_in_per_s", "messages_out_per_s"))

    def counts(self) -> tuple[int, int, int]:
        return self.messages_in, self.bytes_in, self.messages_out

    def sample(self, now: float) -> None:
        self.history.sample(now, self.counts())

    def rates(self, now: float) -> dict[str, float]:
        """Per second over the last RATE_WINDOW_S seconds."""
        return self.history.rates(now, self.counts())


LATENCY_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, float("inf"))


class BrokerMetrics:
    """Per-batch counts; the rest is collected at scrape time."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.publish_requests = Counter(
            "quire_broker_publish_requests", "Producer batches answered, by result", ["result"], registry=registry,
        )
        for status in BrokerStatus:
            # Every result's series exists from the start (at 0), so that rates and alerts work at once.
            self.publish_requests.labels(_result_label(status))
        self._publish_ok = self.publish_requests.labels("ok")
        self.publish_latency = Histogram(
            "quire_broker_publish_latency_seconds", "From a batch's arrival to its receipt, persisted batches",
            buckets=LATENCY_BUCKETS_S, registry=registry,
        )

    def receipt(self, status: int, started_s: float | None) -> None:
        if status == BrokerStatus.OK:
            self._publish_ok.inc()
            if started_s is not None:
                self.publish_latency.observe(time.perf_counter() - started_s)
        else:
            self.publish_requests.labels(_result_label(status)).inc()


def _result_label(status: int) -> str:
    return BrokerStatus(status).name.lower()


def server_families(server) -> list[Metric]:
    """Families read from a `BrokerServer` (call on its event loop)."""
    services = list(server.partitions.values())
    retired = server.retired_stats
    totals = {
        name: getattr(retired, name) + sum(getattr(service.stats, name) for service in services)
        for name in ("messages_in", "bytes_in", "messages_out")
    }
    backlog = GaugeMetricFamily("quire_broker_subscription_backlog", "Messages a subscription has not acknowledged",
                                labels=["topic", "subscription"])
    storage = GaugeMetricFamily("quire_broker_topic_storage_bytes", "Bytes a partition stores in its ledgers", labels=["topic"])
    ledgers = GaugeMetricFamily("quire_broker_topic_ledgers", "Ledgers a partition's managed ledger holds", labels=["topic"])
    producers = consumers = 0
    for service in services:
        storage.add_metric([service.name], service.managed_ledger.stored_bytes)
        ledgers.add_metric([service.name], len(service.managed_ledger.record.ledgers))
        producers += len(service.producers)
        for name, subscription in service.subscriptions.items():
            backlog.add_metric([service.name, name], subscription.backlog())
            consumers += len(subscription.consumers)
    return [
        CounterMetricFamily("quire_broker_publish_messages", "Messages persisted", value=totals["messages_in"]),
        CounterMetricFamily("quire_broker_publish_bytes", "Message bytes persisted", value=totals["bytes_in"]),
        CounterMetricFamily("quire_broker_dispatched_messages", "Messages delivered to consumers", value=totals["messages_out"]),
        GaugeMetricFamily("quire_broker_topics", "Topic partitions this broker serves", value=len(services)),
        GaugeMetricFamily("quire_broker_producers", "Producers connected", value=producers),
        GaugeMetricFamily("quire_broker_consumers", "Consumers connected", value=consumers),
        GaugeMetricFamily("quire_broker_connections", "Client connections open, quire's protocol and Pulsar's",
                          value=server.open_connections),
        CounterMetricFamily("quire_broker_protocol_errors", "Client connections closed for breaking the protocol",
                            value=server.protocol_errors),
        CounterMetricFamily("quire_broker_connections_refused",
                            "Connections closed at once: too many open in all or from one address", value=server.connections_refused),
        CounterMetricFamily("quire_broker_connections_timed_out", "Connections closed after two keep-alive intervals of silence",
                            value=server.connections_timed_out),
        CounterMetricFamily("quire_broker_authentication_refusals",
                            "Connections refused for their credentials (missing, expired, malformed, wrongly signed), "
                            "or closed when a token expired unrefreshed", value=server.access.authentication_refusals),
        CounterMetricFamily("quire_broker_authorization_refusals", "Requests refused because the client's role may not make them",
                            value=server.access.authorization_refusals),
        CounterMetricFamily("quire_broker_tls_handshakes_refused", "TLS connections whose handshake failed or did not finish in time",
                            value=server.tls_handshakes_refused),
        GaugeMetricFamily("quire_broker_frame_buffer_bytes", "Bytes reserved by large frames being received",
                          value=server.frame_budget.reserved),
        GaugeMetricFamily("quire_broker_publish_inflight", "Producer batches taken and not yet answered",
                          value=server.publish_batches_measured),
        GaugeMetricFamily("quire_broker_publish_buffer_bytes",
                          "Bytes of producers' batches taken and not yet answered, all partitions (the publish buffer)",
                          value=server.publish_buffer.bytes),
        CounterMetricFamily("quire_broker_publish_buffer_pauses",
                            "Times the publish buffer passed its bound and producers' connections stopped being read",
                            value=server.publish_buffer.pauses),
        GaugeMetricFamily("quire_broker_entry_cache_bytes", "Memory the entries in the broker's cache hold, their objects included",
                          value=server.context.cache.bytes),
        GaugeMetricFamily("quire_broker_entry_cache_entries", "Entries in the broker's cache", value=len(server.context.cache)),
        backlog,
        storage,
        ledgers,
    ]


class BrokerCollector:
    """Collects on the server's event loop when Prometheus scrapes."""

    def __init__(self, server, trio_token: trio.lowlevel.TrioToken) -> None:
        self.server = server
        self.trio_token = trio_token

    def describe(self) -> Iterable[Metric]:
        return []  # names are known only by collecting, which needs the event loop

    def collect(self) -> Iterator[Metric]:
        try:
            yield from trio.from_thread.run_sync(server_families, self.server, trio_token=self.trio_token)
        except trio.RunFinishedError:
            return


class MetricsEndpoint:
    """`GET /metrics` on a thread of its own (prometheus_client's server)."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int) -> None:
        """Binds at once: raises OSError when the port is taken."""
        self._server, self._thread = start_http_server(port, addr=host, registry=registry)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def broker_registry() -> tuple[CollectorRegistry, BrokerMetrics]:
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    return registry, BrokerMetrics(registry)


def register_collector(registry: CollectorRegistry, server) -> None:
    """Add the server's families to what the registry serves; call on the server's event loop."""
    registry.register(BrokerCollector(server, trio.lowlevel.current_trio_token()))


__all__ = ["BrokerMetrics", "MetricsEndpoint", "PartitionStats", "broker_registry", "register_collector"]
