"""One broker simulation from one seed: ZooKeeper, 3-5 bookies, 2-3 brokers
taking turns at owning one partition (its chain of ledgers on the bookies,
through the real managed ledger, write and recovery cores), producers and
consumers of one durable subscription; a safety phase (faults on,
invariants of the broker and of the ledgers checked as events happen),
then healing and a liveness phase: every message is published once,
delivered, acknowledged, and the backlog reaches 0 within a bound."""

from __future__ import annotations

import json
from typing import Any

from broker.topic_records import cursor_path
from coordination.store import NoNodeError
from sim.broker_checker import BrokerChecker
from sim.broker_consumer import SimConsumer, consumer_priorities
from sim.broker_links import Links
from sim.broker_messages import PARTITION, SUBSCRIPTION
from sim.broker_mistakes import BROKER_MISTAKES
from sim.broker_nemesis import BrokerNemesis
from sim.broker_node import OWNER_PATH, SimBroker
from sim.broker_parameters import BrokerSimParameters, choose_broker_parameters
from sim.broker_producer import SimProducer
from sim.bookie_node import SimBookie
from sim.checker import SimChecker
from sim.metadata_node import ROOT, ZkNode
from sim.network import Network
from sim.runner import LIVENESS_STEP_MS, SimResult, run_phases
from sim.world import World

OBSERVER_SESSION_TIMEOUT_MS = 2**62  # the simulator's own look at ZooKeeper never expires
DURABILITY_CHECK_MS = 500.0


def run_broker_seed(seed: int, *, mistake: str | None = None, trace: bool = False, **overrides: Any) -> SimResult:
    """Run one broker seed (with a planted mistake from `sim.broker_mistakes`, for tests)."""
    if mistake is not None and mistake not in BROKER_MISTAKES:
        raise ValueError(f"unknown broker mistake {mistake!r}; known: {', '.join(sorted(BROKER_MISTAKES))}")
    parameters = choose_broker_parameters(seed, **overrides)
    return run_phases(BrokerSimRun(parameters, BROKER_MISTAKES.get(mistake, {}) if mistake else {}, trace=trace), mistake)


class BrokerSimRun:
    def __init__(self, parameters: BrokerSimParameters, classes: dict, *, trace: bool) -> None:
        self.parameters = parameters
        classes = dict(classes)
        self.producer_class = classes.pop("producer_class", SimProducer)
        self.classes = classes  # the brokers'
        self.world = World(parameters.seed, trace=trace)
        self.checker = BrokerChecker(lambda: self.world.now_ms)
        self.ledger_checker = SimChecker(lambda: self.world.now_ms)
        self.ledger_checker.share_violations(self.checker)  # one verdict for the run
        self.bookies: list[SimBookie] = []
        self.notes: list[str] = []
        self.brokers: list[SimBroker] = []
        self.producers: list[SimProducer] = []
        self.consumers: list[SimConsumer] = []
        self.links: Links | None = None
        self.nemesis: BrokerNemesis | None = None
        self.liveness_ms_taken: float | None = None

    def build(self) -> None:
        world, parameters, checker = self.world, self.parameters, self.checker
        network = Network(world, latency_ms_min=parameters.latency_ms_min, latency_ms_max=parameters.latency_ms_max,
                          slow_message_probability=parameters.slow_message_probability)
        zk = ZkNode(world, network)
        self._observer = zk.server.connect(OBSERVER_SESSION_TIMEOUT_MS, ROOT)
        links = self.links = Links(world, network)
        self.bookies = [
            SimBookie(f"bookie-{index}", world, network, zk, self.ledger_checker, fsync_ms_max=parameters.fsync_ms_max,
                      write_cache_bytes=parameters.write_cache_bytes, session_timeout_ms=parameters.session_timeout_ms)
            for index in range(parameters.bookies)
        ]
        names = [f"broker-{index}" for index in range(parameters.brokers)]
        self.brokers = [
            SimBroker(name, world, network, links, zk, checker, self.ledger_checker, parameters,
                      owner_session=self._owner_session, **self.classes)
            for name in names
        ]
        self.producers = [self.producer_class(f"producer-{index}", world, network, links, names, checker, parameters)
                          for index in range(parameters.producers)]
        priorities = consumer_priorities(parameters.kind, parameters.consumers, world.rng)
        self.consumers = [SimConsumer(f"consumer-{index}", world, network, links, names, checker, parameters, priority=priority)
                          for index, priority in enumerate(priorities)]
        self.nemesis = BrokerNemesis(world, network, links, zk, parameters, bookies=self.bookies, brokers=self.brokers,
                                     clients=self.producers + self.consumers)

    def _owner_session(self) -> int | None:
        stat = self._observer.exists(OWNER_PATH)
        return None if stat is None else stat.ephemeral_owner

    def durable_cursor(self) -> dict | None:
        try:
            data, _ = self._observer.get(cursor_path(PARTITION, SUBSCRIPTION))
        except NoNodeError:
            return None
        return json.loads(data)

    # --- the phases ------------------------------------------------------------------------------

    def safety(self) -> None:
        world = self.world

        def durability_check() -> None:
            self.ledger_checker.check_durability(self.bookies, "a periodic check")
            world.after(DURABILITY_CHECK_MS, durability_check)

        self.nemesis.start()
        world.after(DURABILITY_CHECK_MS, durability_check)
        world.run_until(self.parameters.safety_ms, stop=lambda: not self.checker.ok)

    def liveness(self) -> None:
        world, checker = self.world, self.checker
        self.nemesis.heal()
        healed_ms = world.now_ms
        deadline_ms = healed_ms + self.parameters.liveness_ms
        while world.now_ms < deadline_ms and checker.ok and self.unfinished():
            world.run_until(world.now_ms + LIVENESS_STEP_MS, stop=lambda: not checker.ok)
        if not checker.ok:
            return
        unfinished = self.unfinished()
        if not unfinished:
            self.liveness_ms_taken = world.now_ms - healed_ms
        for invariant, detail in unfinished:
            checker.violate(invariant, f"{detail} {self.parameters.liveness_ms} ms after healing")

    def unfinished(self) -> list[tuple[str, str]]:
        """What the liveness phase still waits for (empty once done)."""
        checker = self.checker
        waiting = []
        unpublished = {producer.producer_id: producer.pending_messages + len(producer.plan) - producer._next
                       for producer in self.producers if not producer.done}
        if unpublished:
            waiting.append(("liveness: every message is published", f"producers still have messages to send: {unpublished}"))
        missing = checker.missing_from_log({producer.producer_id: producer.planned for producer in self.producers})
        if missing and not unpublished:
            waiting.append(("liveness: every message is published",
                            f"sequence ids missing from the log: {({producer: ids[:10] for producer, ids in missing.items()})}"))
        undelivered = [offset for offset in range(checker.log_offsets) if offset not in checker.received]
        if undelivered:
            waiting.append(("liveness: every message is delivered", f"{len(undelivered)} offsets never delivered, first {undelivered[:10]}"))
        record = self.durable_cursor()
        backlog = checker.log_offsets if record is None else _backlog(record, checker.log_offsets)
        if backlog:
            waiting.append(("liveness: the backlog reaches 0", f"the durable cursor leaves {backlog} messages unacknowledged"))
        acks = {consumer.name: consumer.acks_in_flight for consumer in self.consumers if consumer.acks_in_flight}
        if acks:
            waiting.append(("liveness: every acknowledgement sent is answered", f"acknowledgements still unanswered: {acks}"))
        return waiting

    def stats(self) -> dict[str, object]:
        checker, nemesis = self.checker, self.nemesis
        return {
            "virtual_ms": round(self.world.now_ms),
            "events": self.world.events_run,
            "messages": 0 if self.links is None else self.links.sent,
            "connection_breaks": 0 if self.links is None else self.links.breaks,
            "entries": len(checker.entries),
            "log_messages": checker.log_offsets,
            "ledgers": len(self.ledger_checker.metadata),
            "loads": sum(broker.loads for broker in self.brokers),
            "sessions_lost": sum(broker.sessions_lost for broker in self.brokers),
            "producer_acks": checker.producer_acks,
            "producer_retries": sum(producer.retries for producer in self.producers),
            "deliveries": checker.deliveries,
            "redeliveries": checker.redeliveries,
            "stale_deliveries": checker.stale_deliveries,
            "nacks": sum(consumer.nacks for consumer in self.consumers),
            "acks_answered": sum(consumer.acks_answered for consumer in self.consumers),
            "acks_beyond_cursor_record": len(checker.answered_beyond_record),
            "redelivered_beyond_cursor_record": checker.redelivered_beyond_record,
            "liveness_ms": None if self.liveness_ms_taken is None else round(self.liveness_ms_taken),
            "faults": {} if nemesis is None else dict(sorted(nemesis.injected.items())),
            "faults_skipped": {} if nemesis is None else dict(sorted(nemesis.skipped.items())),
            "broker_restarts": sum(broker.restarts for broker in self.brokers),
            "client_restarts": sum(client.restarts for client in self.producers + self.consumers),
        }


def _backlog(record: dict, log_messages: int) -> int:
    """Messages of the log a persisted cursor record leaves unacknowledged."""
    acked = set()
    for first, last in record.get("acked", []):
        acked.update(range(first, last + 1))
    return sum(1 for offset in range(record["mark_delete"] + 1, log_messages) if offset not in acked)

