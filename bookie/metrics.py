"""The bookie's Prometheus metrics (`quire_bookie_*`) and their HTTP endpoint.

Per-request numbers (results, latencies, journal batches) are plain counts
kept by the event loop, with no lock and no prometheus_client object on the
hot path; gauges (in-flight requests, ledgers, write cache, mode) are read
from the server when Prometheus scrapes, on the event loop, so they are
consistent. The request core knows nothing of this: it stays pure (no clock,
no I/O), and metrics are the driver's business.
"""

from __future__ import annotations

import bisect
import logging
from typing import Iterable, Iterator

import trio
from prometheus_client import CollectorRegistry, ProcessCollector, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from bookie.protocol.wire import Status
from bookie.read_only_mode import Cause
from coordination.cluster_layout import ClusterLayout
from coordination.store import MetadataError, MetadataStore

log = logging.getLogger(__name__)

INF = float("inf")
LATENCY_BUCKETS_S = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, INF,
)
BATCH_ENTRIES_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, INF)
BATCH_BYTES_BUCKETS = tuple(1024 * 4**power for power in range(9)) + (INF,)  # 1 KiB .. 64 MiB
UNDER_REPLICATED_REFRESH_S = 5.0
UNDER_REPLICATED_READ_TIMEOUT_S = 1.0
REJECTIONS = {Status.TOO_MANY_REQUESTS: "too_many_requests", Status.READ_ONLY: "read_only"}


class LoopHistogram:
    """Bucket counts and a sum kept by one thread; `family()` gives the
    Prometheus histogram (cumulative buckets) from a copy."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        assert bounds[-1] == INF and list(bounds) == sorted(bounds)
        self.bounds = bounds
        self.counts = [0] * len(bounds)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        # `le` is inclusive: the first bound not below the value.
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def family(self, name: str, documentation: str, labels: dict[str, str] | None = None,
               family: HistogramMetricFamily | None = None) -> HistogramMetricFamily:
        if family is None:
            family = HistogramMetricFamily(name, documentation, labels=list(labels or {}))
        cumulative, buckets = 0, []
        for bound, count in zip(self.bounds, self.counts):
            cumulative += count
            buckets.append(("+Inf" if bound == INF else repr(float(bound)), cumulative))
        family.add_metric(list((labels or {}).values()), buckets, self.sum)
        return family


class BookieMetrics:
    """What the server counts as it works (event loop only)."""

    def __init__(self) -> None:
        self.add_latency_s = LoopHistogram(LATENCY_BUCKETS_S)
        self.read_latency_s = LoopHistogram(LATENCY_BUCKETS_S)
        self.journal_fsync_s = LoopHistogram(LATENCY_BUCKETS_S)
        self.journal_batch_entries = LoopHistogram(BATCH_ENTRIES_BUCKETS)
        self.journal_batch_bytes = LoopHistogram(BATCH_BYTES_BUCKETS)
        self.adds_ok = 0  # the server counts these itself, on its hottest path
        self.add_results: dict[int, int] = {}  # any other status -> count
        self.read_results: dict[int, int] = {}  # every status -> count

    def answered(self, is_add: bool, status: int, latency_s: float | None) -> None:
        """An add or a read (fence and batch reads included; long polls
        have no latency) was answered other than by `DurableAdd`."""
        if is_add and status == Status.OK:
            self.adds_ok += 1
        else:
            results = self.add_results if is_add else self.read_results
            results[status] = results.get(status, 0) + 1
        if latency_s is not None and status == Status.OK:
            (self.add_latency_s if is_add else self.read_latency_s).observe(latency_s)

    def journal_batch(self, entries: int, data_bytes: int, fsync_s: float) -> None:
        self.journal_batch_entries.observe(entries)
        self.journal_batch_bytes.observe(data_bytes)
        self.journal_fsync_s.observe(fsync_s)


def _results_family(name: str, documentation: str, results: dict[int, int], ok: int = 0) -> CounterMetricFamily:
    family = CounterMetricFamily(name, documentation, labels=["result"])
    family.add_metric(["ok"], ok + results.get(Status.OK, 0))  # present from the start, so rates work at once
    for status, count in sorted(results.items()):
        if status != Status.OK:
            family.add_metric([Status(status).name.lower()], count)
    return family


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)


def server_families(server) -> list[Metric]:
    """Every family read from a `BookieServer` (call on its event loop)."""
    metrics: BookieMetrics = server.metrics
    core, stats, write_cache = server.core, server.stats, server.storage.write_cache
    rejected = CounterMetricFamily("quire_bookie_rejected_requests", "Requests refused before any work (back-pressure or read-only mode)",
                                   labels=["kind", "reason"])
    for kind, results in (("add", metrics.add_results), ("read", metrics.read_results)):
        for status, reason in REJECTIONS.items():
            rejected.add_metric([kind, reason], results.get(status, 0))
    inflight = GaugeMetricFamily("quire_bookie_inflight_requests", "Requests taken and not yet answered", labels=["kind"])
    inflight.add_metric(["add"], core.adds_in_flight)
    inflight.add_metric(["read"], core.reads_in_flight)
    inflight.add_metric(["long_poll"], core.waiter_count)
    causes = server.read_only_causes
    read_only_reasons = GaugeMetricFamily(
        "quire_bookie_read_only_reason", "1 for each cause that keeps the bookie read-only now (bookie.read_only_mode)",
        labels=["reason"],
    )
    for cause in Cause:
        read_only_reasons.add_metric([cause.value], 1 if cause in causes else 0)
    return [
        _results_family("quire_bookie_add_requests", "Adds answered, by result", metrics.add_results, metrics.adds_ok),
        metrics.add_latency_s.family("quire_bookie_add_latency_seconds", "From an add's arrival to its answer, successful adds"),
        _results_family("quire_bookie_read_requests", "Reads answered (fence and batch reads included), by result", metrics.read_results),
        metrics.read_latency_s.family("quire_bookie_read_latency_seconds", "From a read's arrival to its answer, successful reads but long polls"),
        rejected,
        inflight,
        metrics.journal_fsync_s.family("quire_bookie_journal_fsync_seconds", "Time of one journal append and fsync (one batch)"),
        metrics.journal_batch_entries.family("quire_bookie_journal_batch_entries", "Records per journal fsync (group commit)"),
        metrics.journal_batch_bytes.family("quire_bookie_journal_batch_bytes", "Payload bytes per journal fsync"),
        CounterMetricFamily("quire_bookie_journal_batches", "Journal batches synced", value=stats.journal_batches),
        CounterMetricFamily("quire_bookie_checkpoints", "Checkpoints of the write cache into entry logs", value=stats.checkpoints),
        CounterMetricFamily("quire_bookie_connections", "Client connections accepted", value=stats.connections_accepted),
        CounterMetricFamily("quire_bookie_protocol_errors", "Connections closed for breaking the protocol", value=stats.protocol_errors),
        CounterMetricFamily("quire_bookie_authentication_refusals",
                            "Ledger clients refused: credentials it does not take, or a role that is not a client role",
                            value=stats.authentication_refusals),
        CounterMetricFamily("quire_bookie_tls_handshakes_refused", "TLS connections whose handshake failed or did not finish in time",
                            value=stats.tls_handshakes_refused),
        CounterMetricFamily("quire_bookie_connections_refused", "Connections closed at once: too many open in all or from one address",
                            value=server.connection_limits.refused),
        _gauge("quire_bookie_frame_buffer_bytes", "Bytes reserved by large frames being received", server.frame_budget.reserved),
        _gauge("quire_bookie_open_connections", "Client connections open now", server.open_connections),
        _gauge("quire_bookie_write_cache_bytes", "Entries in the write cache, both buffers",
               write_cache.active_bytes + write_cache.flushing_bytes),
        _gauge("quire_bookie_write_cache_max_bytes", "The write cache's bound", write_cache.bytes_max),
        _gauge("quire_bookie_ledgers", "Ledgers this bookie stores", len(core.ledgers)),
        _gauge("quire_bookie_read_only", "1 while the bookie takes no adds (disk full, journal or checkpoint failure)",
               1 if core.read_only else 0),
        read_only_reasons,
        _gauge("quire_bookie_checkpoint_held_bytes", "What a checkpoint held for room (or failed) needs on the ledger disk; 0: none",
               server.checkpoint_held_bytes),
    ]


class UnderReplicatedCount:
    """The number of under-replicated ledgers the auto-recovery daemon has
    marked in ZooKeeper. A task on the event loop refreshes it every few
    seconds (scrapes of several bookies must not each cost a ZooKeeper round
    trip), each read bounded by `read_timeout_s`; a scrape only reads the
    cached value, so it answers at once even while ZooKeeper does not. When
    the last refresh failed the value is None and the series is left out:
    an old count would look current."""

    def __init__(self, store: MetadataStore, refresh_s: float = UNDER_REPLICATED_REFRESH_S,
                 read_timeout_s: float = UNDER_REPLICATED_READ_TIMEOUT_S) -> None:
        self.store = store
        # The auto-recovery auditor's markers: one child per under-replicated ledger.
        self.path = ClusterLayout().underreplicated_ledgers
        self.refresh_s = refresh_s
        self.read_timeout_s = read_timeout_s
        # One reader thread at most: a read abandoned at its time-out keeps
        # this slot until kazoo gives up, so reads never pile up.
        self._reader = trio.CapacityLimiter(1)
        self.value: int | None = None

    async def refresh(self) -> None:
        with trio.move_on_after(self.read_timeout_s) as scope:
            try:
                stat = await trio.to_thread.run_sync(
                    self.store.exists, self.path, limiter=self._reader, abandon_on_cancel=True
                )
            except MetadataError as error:
                log.debug("cannot count under-replicated ledgers: %s", error)
                self.value = None
                return
            self.value = 0 if stat is None else stat.children_count
        if scope.cancelled_caught:
            log.debug("cannot count under-replicated ledgers: ZooKeeper did not answer in %.1fs", self.read_timeout_s)
            self.value = None

    async def run(self) -> None:
        while True:
            await self.refresh()
            await trio.sleep(self.refresh_s)


class BookieCollector:
    """Collects on the server's event loop when Prometheus scrapes."""

    def __init__(self, server, trio_token: trio.lowlevel.TrioToken, under_replicated: UnderReplicatedCount | None) -> None:
        self.server = server
        self.trio_token = trio_token
        self.under_replicated = under_replicated

    def describe(self) -> Iterable[Metric]:
        return []  # names are known only by collecting, which needs the event loop

    def collect(self) -> Iterator[Metric]:
        try:
            families = trio.from_thread.run_sync(server_families, self.server, trio_token=self.trio_token)
        except trio.RunFinishedError:
            return
        yield from families
        if self.under_replicated is not None:
            count = self.under_replicated.value  # cached: never a ZooKeeper call here
            if count is not None:
                yield _gauge("quire_under_replicated_ledgers", "Ledgers marked under-replicated for auto-recovery", count)


class MetricsEndpoint:
    """`GET /metrics` on a thread of its own (prometheus_client's server)."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int) -> None:
        """Binds at once: raises OSError when the port is taken."""
        self._server, self._thread = start_http_server(port, addr=host, registry=registry)
        self.port = self._server.server_address[1]

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def open_bookie_metrics(host: str, port: int) -> tuple[MetricsEndpoint, CollectorRegistry]:
    """Bind HOST:PORT at once (OSError when it is taken), before the bookie
    writes anything; it serves the process's CPU and memory until
    `serve_bookie_metrics` adds the server's own families."""
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    return MetricsEndpoint(registry, host, port), registry


def serve_bookie_metrics(registry: CollectorRegistry, server, under_replicated: UnderReplicatedCount | None) -> None:
    """Add the server's families; call on its event loop. The caller runs
    `under_replicated.run()`."""
    registry.register(BookieCollector(server, trio.lowlevel.current_trio_token(), under_replicated))


__all__ = ["BookieMetrics", "LoopHistogram", "MetricsEndpoint", "UnderReplicatedCount", "open_bookie_metrics", "serve_bookie_metrics"]
