"""The broker simulation (`quire sim --broker`): the broker's real cores
(managed ledger, publishing, subscriptions, ownership) over the real
ledger write and recovery cores and simulated bookies, under faults on the
simulator's World. One seed reproduces a run exactly, a batch of seeds
keeps every invariant, and each planted mistake is found within a bounded
number of seeds."""

from __future__ import annotations

import re

import pytest

from broker.dispatcher import SubscriptionType
from sim.broker_checker import BrokerChecker
from sim.broker_links import Links
from sim.broker_mistakes import BROKER_LIVENESS_MISTAKES, BROKER_SAFETY_MISTAKES
from sim.broker_parameters import BROKER_FAULT_KINDS, choose_broker_parameters
from sim.broker_runner import run_broker_seed
from sim.network import Network
from sim.node import SimNode
from sim.world import World
from tests.sim.sim_cli import assert_same_run_under_other_hash_seeds, forbid_trio, quire_sim

# How many seeds the simulation may take to find a planted mistake (each is
# found within 50 today; the bound leaves room for changes that move the
# random stream).
MISTAKE_SEEDS_MAX = 200
# A mistake that needs a rare coincidence gets the faults that make it
# likely (the swarm finds it too, in more seeds): a
# snapshot after every entry while appends in flight are lost; a producer
# started again at once while a batch of its old process is still being
# written (and fails: every bookie is in the ensemble, so one that goes
# fails the ledger instead of being replaced); a broker cut off from
# ZooKeeper or paused while connections reset, so that some consumers move
# to the new owner and others stay.
FOCUS = {
    "dedup-snapshot-ahead": dict(faults=("storage_error", "crash", "drop"), dedup_snapshot_entries=1,
                                 pending_messages_max=64, fsync_ms_max=20.0, break_probability=0.01,
                                 fault_interval_ms_mean=300.0),
    "resume-after-last-persisted": dict(faults=("client_crash",), batch_messages_max=16, pending_messages_max=64,
                                        fsync_ms_max=20.0, fault_interval_ms_mean=300.0),
    "resume-after-last-taken": dict(faults=("client_crash", "storage_error"), producers=1, batch_messages_max=16,
                                    pending_messages_max=64, fsync_ms_max=20.0, send_gap_ms_mean=0.5,
                                    fault_interval_ms_mean=30.0, bookies=3, ensemble_size=3, write_quorum=3, ack_quorum=3),
    "dispatch-without-lease": dict(faults=("expire", "drop", "pause"), break_probability=0.03, fault_interval_ms_mean=700.0,
                                   subscription_type="shared", cumulative_ack_probability=0.0, consumers=3,
                                   session_timeout_ms=3000, safety_ms=15000),
}
# What each planted mistake breaks (safety ones never break liveness).
DELIVERED_AGAIN = {"an acknowledged message is never delivered again", "a durable acknowledgement stays in the cursor record"}
BROKEN_BY = {
    "dedup-judges-first-sequence-id": {"exactly-once publishing"},
    "dedup-snapshot-ahead": {"a message acknowledged to its producer is in the log"},
    "dedup-replay-skipped": {"exactly-once publishing"},
    "ack-before-durable": DELIVERED_AGAIN,
    "key-shared-overtakes-on-join": {"key_shared: a message never overtakes an earlier one of its key out at another consumer"},
    "dispatch-without-lease": DELIVERED_AGAIN,
    "resume-after-last-persisted": {"exactly-once publishing"},
    "acks-wait-on-unload": {"liveness: every acknowledgement sent is answered"},
    "resume-after-last-taken": {"liveness: every message is published"},
    "open-without-recovery": {"one message per offset", "exactly-once publishing"},
}
# A seed whose parameters turn every fault kind on, and whose run injects each
# of the nemesis's kinds.
EVERY_FAULT_SEED = 366


def test_a_broker_seed_reproduces_its_run_exactly():
    first, second = run_broker_seed(14), run_broker_seed(14)
    assert first.ok, first.summary()
    assert first.digest == second.digest and first.stats == second.stats
    assert run_broker_seed(15).digest != first.digest


def test_a_broker_seed_reproduces_across_processes_and_hash_seeds():
    assert_same_run_under_other_hash_seeds(["--broker"], EVERY_FAULT_SEED, BROKER_FAULT_KINDS)


def test_check_determinism_and_trace(tmp_path):
    trace = tmp_path / "trace.log"
    completed = quire_sim("--broker", "--seed", "3", "--check-determinism", "--trace", str(trace))
    assert completed.returncode == 0, completed.stdout + completed.stderr
    assert completed.stdout.startswith("seed 3: parameters seed=3 brokers=")
    assert "matches" in completed.stdout
    lines = trace.read_text().splitlines()
    assert lines[0].startswith("0.000 parameters seed=3 brokers=")
    assert any(" Deliver(" in line for line in lines) and any("of the partition" in line for line in lines)


def test_a_broker_run_uses_no_trio_scheduler(monkeypatch):
    forbid_trio(monkeypatch)
    assert run_broker_seed(5).ok


def test_a_batch_of_broker_seeds_keeps_every_invariant():
    completed = quire_sim("--broker", "--seeds", "30", "--first-seed", "5000", "--jobs", "1", timeout_s=900)
    assert completed.returncode == 0, completed.stdout[-4000:] + completed.stderr[-2000:]
    assert re.search(r"30 seeds in [0-9.]+s \([0-9.]+ seeds/s\): 30 without violation, 0 failing", completed.stdout)
    assert len(re.findall(r"^seed (\d+): ok digest [0-9a-f]{16} parameters seed=\1 brokers=\d.* liveness_ms=\d+$",
                          completed.stdout, re.MULTILINE)) == 30


@pytest.mark.slow(seconds=120)
def test_a_long_batch_of_broker_seeds_keeps_every_invariant():
    completed = quire_sim("--broker", "--seeds", "500", "--first-seed", "20000", "--jobs", "2", timeout_s=3600)
    assert completed.returncode == 0, completed.stdout[-4000:] + completed.stderr[-2000:]


# --- planted mistakes ---------------------------------------------------------------------------


def first_failing_seed(mistake: str) -> int:
    for seed in range(MISTAKE_SEEDS_MAX):
        if not run_broker_seed(seed, mistake=mistake, **FOCUS.get(mistake, {})).ok:
            return seed
    pytest.fail(f"{mistake}: no violation in {MISTAKE_SEEDS_MAX} seeds")


@pytest.mark.parametrize("mistake", sorted(BROKER_SAFETY_MISTAKES + BROKER_LIVENESS_MISTAKES))
def test_the_broker_simulation_finds_each_planted_mistake(mistake):
    seed = first_failing_seed(mistake)
    focus = FOCUS.get(mistake, {})
    found = run_broker_seed(seed, mistake=mistake, **focus)
    assert {violation.invariant for violation in found.violations} <= BROKEN_BY[mistake], found.summary()
    # The failing seed reproduces, and the correct code passes it.
    assert run_broker_seed(seed, mistake=mistake, **focus).digest == found.digest
    correct = run_broker_seed(seed, **focus)
    assert correct.ok, correct.summary()


def test_a_failing_broker_seed_is_printed_with_how_to_reproduce_it():
    seed = first_failing_seed("dedup-replay-skipped")
    completed = quire_sim("--broker", "--seeds", "2", "--first-seed", str(seed), "--mistake", "dedup-replay-skipped")
    assert completed.returncode == 1, completed.stdout + completed.stderr
    assert re.search(rf"\d+ failing: {seed}\b", completed.stdout), completed.stdout
    assert f"reproduce one with: quire sim --broker --seed {seed} --mistake dedup-replay-skipped" in completed.stdout


def test_a_ledger_mistake_is_refused_with_broker():
    completed = quire_sim("--broker", "--seed", "1", "--mistake", "unfenced-recovery-reads")
    assert completed.returncode != 0 and "unknown --mistake 'unfenced-recovery-reads'" in completed.stderr


# --- what the runs go through -------------------------------------------------------------------


def test_the_swarm_covers_every_subscription_type_and_fault_kind():
    chosen = [choose_broker_parameters(seed) for seed in range(200)]
    assert {parameters.subscription_type for parameters in chosen} == {"exclusive", "failover", "shared", "key_shared"}
    for kind in BROKER_FAULT_KINDS:
        assert any(kind in parameters.faults for parameters in chosen)
    # Cumulative acknowledgements only where Pulsar's clients allow them.
    assert all(parameters.cumulative_ack_probability == 0 for parameters in chosen
               if parameters.subscription_type in ("shared", "key_shared"))


def test_takeovers_rebuild_dedup_and_cursors_and_the_liveness_phase_finishes():
    # Brokers crash and are cut off from ZooKeeper: the partition moves from
    # one to another; every load recovers (fences) the last ledger and starts
    # a new one, rebuilds the deduplication map from its snapshot and the
    # entries after it, and everything is published, delivered and
    # acknowledged in the end.
    result = run_broker_seed(6, trace=True, faults=("crash", "expire"), brokers=3, dedup_snapshot_entries=5,
                             safety_ms=15_000, fault_interval_ms_mean=1_000.0)
    assert result.ok, result.summary()
    assert result.stats["loads"] >= 3 and result.stats["ledgers"] >= result.stats["loads"]  # each load starts a ledger
    assert result.stats["sessions_lost"] >= 2 and result.stats["broker_restarts"] >= 2
    assert sum(1 for line in result.trace if re.search(r"dedup: snapshot \(\d+, \d+\), [1-9]\d* entries replayed", line)) >= 2
    assert result.stats["liveness_ms"] is not None


class Endpoint(SimNode):
    def __init__(self, name, world, network, links):
        super().__init__(name, world, network)
        links.add(self)
        self.received = []
        self.closed = []
        self.start()

    def receive(self, connection, message):
        self.received.append(message)

    def connection_closed(self, connection):
        self.closed.append(connection.connection_id)


def linked(**options):
    world = World(7)
    network = Network(world, latency_ms_min=0.1, latency_ms_max=20.0, slow_message_probability=0.5)
    links = Links(world, network, **options)
    return world, links, Endpoint("client", world, network, links), Endpoint("broker", world, network, links)


def test_a_connection_delivers_in_order_and_a_break_loses_the_rest():
    world, links, client, broker = linked()
    connection = links.connect("client", "broker")
    for number in range(50):
        links.send(connection, "client", number)
    world.run_until(1_000)
    assert broker.received == list(range(50))  # never reordered, however late each one is
    links.send(connection, "client", "lost")
    links.break_connection(connection, "reset")
    links.send(connection, "client", "after")
    world.run_until(2_000)
    assert broker.received[-1] == 49 and client.closed == broker.closed == [connection.connection_id]


def test_a_paused_end_reads_in_order_once_resumed():
    world, links, client, broker = linked()
    connection = links.connect("client", "broker")
    broker.pause()
    links.send(connection, "client", "first")
    links.send(connection, "client", "second")
    world.run_until(1_000)
    assert broker.received == []
    broker.resume()
    links.resumed("broker")
    assert broker.received == ["first", "second"]


def test_an_acknowledgement_the_cursor_record_bound_drops_may_come_back_but_no_other():
    checker = BrokerChecker(lambda: 0.0)
    checker.serving_started("b/1", SubscriptionType.SHARED)
    checker.ack_answered((5,), False, {"mark_delete": 2, "acked": [[5, 5]]})
    checker.ack_answered((7,), False, {"mark_delete": 2, "acked": [[5, 5], [7, 7]]})
    # A record of at most two ranges keeps the lowest: 7 is left out.
    checker.cursor_written({"mark_delete": 2, "acked": [[4, 5], [6, 6]]}, ranges_max=2)
    checker.consumer_added("b/1", 1, "c", 0)
    checker.delivered("b/1", 1, (7,), (None,), stale=False)
    assert checker.ok and checker.redelivered_beyond_record == 1
    checker.delivered("b/1", 1, (5,), (None,), stale=False)
    assert [violation.invariant for violation in checker.violations] == ["an acknowledged message is never delivered again"]
