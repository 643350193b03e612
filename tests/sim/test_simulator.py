"""The simulator as a whole: one seed reproduces a run exactly (even across
processes with other hash seeds), a batch of seeds keeps every invariant,
and each planted mistake is found within a bounded number of seeds."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import sim.runner
from ledger_client.recovery_core import RecoveryCore
from sim.bookie_node import SimBookie
from sim.mistakes import SAFETY_MISTAKES
from sim.nemesis import FIRST_FAULT_MS_MAX, SimNemesis
from sim.network import Network
from sim.node import SimNode
from sim.parameters import FAULT_KINDS, choose_parameters
from sim.runner import run_seed
from sim.world import EVENTS_AT_ONE_INSTANT_MAX, LivelockError, World
from tests.sim.sim_cli import REPOSITORY, assert_same_run_under_other_hash_seeds, forbid_trio, quire_sim
from tests.support import wait_until

# How many seeds the simulator may take to find a planted mistake. Measured
# over seeds 0-149: unfenced-recovery-reads first at seed 52 (2% of seeds),
# io-error-is-negative at 60 (2%), ack-before-ensemble-written at 3 (4%);
# the bound leaves room for changes that move the random stream.
MISTAKE_SEEDS_MAX = 300


def test_a_seed_reproduces_its_run_exactly():
    first, second = run_seed(11), run_seed(11)
    assert first.digest == second.digest
    assert first.stats == second.stats
    assert run_seed(12).digest != first.digest


# A seed whose parameters turn every fault kind on, and whose run injects
# each of the nemesis's kinds: the fault paths must not depend on the hash
# seed either.
EVERY_FAULT_SEED = 623


def test_a_seed_reproduces_across_processes_and_hash_seeds():
    assert_same_run_under_other_hash_seeds([], EVERY_FAULT_SEED, FAULT_KINDS)


def test_check_determinism_and_trace(tmp_path):
    trace = tmp_path / "trace.log"
    completed = quire_sim("--seed", "3", "--check-determinism", "--trace", str(trace))
    assert completed.returncode == 0, completed.stdout + completed.stderr
    assert "matches" in completed.stdout
    lines = trace.read_text().splitlines()
    assert lines[0].startswith("0.000 parameters seed=3")
    assert any("ReadRequest" in line for line in lines)


def test_a_simulated_run_uses_no_trio_scheduler(monkeypatch):
    forbid_trio(monkeypatch)
    assert run_seed(5).ok


def test_a_batch_of_seeds_keeps_every_invariant():
    # The CLI with a progress bar (quiet here) and two processes.
    completed = quire_sim("--seeds", "40", "--first-seed", "1000", "--jobs", "2", timeout_s=900)
    assert completed.returncode == 0, completed.stdout[-4000:] + completed.stderr[-2000:]
    assert re.search(r"40 seeds in [0-9.]+s \([0-9.]+ seeds/s\): 40 without violation, 0 failing", completed.stdout)
    # Every run prints its seed and all its parameters.
    assert len(re.findall(r"^seed (\d+): ok digest [0-9a-f]{16} parameters seed=\1 bookies=\d.* liveness_ms=\d+$",
                          completed.stdout, re.MULTILINE)) == 40


@pytest.mark.slow(seconds=110)
def test_a_long_batch_of_seeds_keeps_every_invariant():
    completed = quire_sim("--seeds", "600", "--first-seed", "20000", "--jobs", "2", timeout_s=3600)
    assert completed.returncode == 0, completed.stdout[-4000:] + completed.stderr[-2000:]


# What each planted mistake breaks: an acknowledged entry cut off by the
# close, or a fenced writer acknowledged past it (never a liveness failure).
SAFETY_INVARIANTS = {
    "closed ledger holds every acknowledged entry",
    "a fenced writer gets no acknowledgement",
    "acknowledged entries stay durable",
}


@pytest.mark.parametrize("mistake", sorted(SAFETY_MISTAKES))
def test_the_simulator_finds_each_planted_mistake(mistake):
    seed = first_failing_seed(mistake)
    violation = run_seed(seed, mistake=mistake).violations[0]
    assert violation.invariant in SAFETY_INVARIANTS, violation
    # The failing seed reproduces, and the correct cores pass it.
    assert run_seed(seed, mistake=mistake).digest == run_seed(seed, mistake=mistake).digest
    assert run_seed(seed).ok, run_seed(seed).summary()


def first_failing_seed(mistake: str) -> int:
    for seed in range(MISTAKE_SEEDS_MAX):
        if not run_seed(seed, mistake=mistake).ok:
            return seed
    pytest.fail(f"{mistake}: no violation in {MISTAKE_SEEDS_MAX} seeds")


def test_a_failing_seed_is_printed_with_how_to_reproduce_it():
    seed = first_failing_seed("ack-before-ensemble-written")
    completed = quire_sim("--seeds", "2", "--first-seed", str(seed), "--mistake", "ack-before-ensemble-written")
    assert completed.returncode == 1, completed.stdout + completed.stderr
    assert re.search(rf"\d+ failing: {seed}\b", completed.stdout), completed.stdout
    assert f"reproduce one with: quire sim --seed {seed} --mistake ack-before-ensemble-written" in completed.stdout


def test_a_crash_in_a_core_is_a_failing_seed_and_the_batch_goes_on():
    # A write core whose assert fails at entry 3: each seed is reported
    # failing with the crash and its traceback, and the batch (in two
    # processes) runs every seed and lists them all.
    completed = quire_sim("--seeds", "3", "--first-seed", "0", "--jobs", "2", "--mistake", "assert-in-write-core")
    assert completed.returncode == 1, completed.stdout + completed.stderr
    assert "Traceback" not in completed.stderr, completed.stderr
    for seed in range(3):
        assert f"crash: seed {seed}: AssertionError: planted: the write core's invariant broke at entry 3" in completed.stdout
    assert completed.stdout.count('in add\n        assert entry_id != 3') == 3, completed.stdout
    assert re.search(r"3 seeds in .*: 0 without violation, 3 failing: 0 1 2 \(crashed or livelocked: 0 1 2\)", completed.stdout)


# A process with a pool like the batch's, whose worker is busy on a long
# task. (A worker between seeds exits on its own once the pool's pipe
# closes; one in the middle of a long seed would not.)
POOL_WITH_A_BUSY_WORKER = """
import multiprocessing, os, time
from quire.sim_commands import _die_with_parent
from tests.sim.test_simulator import say_pid_and_sleep
if __name__ == "__main__":
    pool = multiprocessing.get_context("spawn").Pool(1, initializer=_die_with_parent, initargs=(os.getpid(),))
    pool.apply_async(say_pid_and_sleep, (300,))
    time.sleep(300)
"""


def say_pid_and_sleep(seconds: float) -> None:
    print(os.getpid(), flush=True)
    time.sleep(seconds)


def test_a_batchs_worker_processes_die_with_it():
    # A batch killed from outside (a test's timeout) takes its workers with
    # it, rather than leaving them to run seeds for nobody.
    parent = subprocess.Popen([sys.executable, "-c", POOL_WITH_A_BUSY_WORKER], cwd=REPOSITORY, stdout=subprocess.PIPE, text=True)
    try:
        worker = int(parent.stdout.readline())  # the worker is busy
    finally:
        parent.kill()
        parent.wait()
        parent.stdout.close()
    try:
        wait_until(lambda: not running(worker), deadline_s=30, what=f"worker {worker} to die with its batch", poll_s=0.1)
    except AssertionError:
        os.kill(worker, signal.SIGKILL)
        pytest.fail(f"worker {worker} outlived its batch")


def running(pid: int) -> bool:
    """Alive and not a zombie (this machine's init may be slow to reap)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_single_seed_prints_its_parameters_before_it_runs():
    completed = quire_sim("--seed", "2", "--mistake", "assert-in-write-core")
    assert completed.returncode == 1, completed.stdout + completed.stderr
    first_line = completed.stdout.splitlines()[0]
    assert first_line.startswith("seed 2: parameters seed=2 bookies="), first_line
    assert "crash: seed 2: AssertionError" in completed.stdout


def test_time_that_stops_is_a_livelock():
    world = World(1)
    spins = []

    def spin():
        spins.append(world.now_ms)
        world.after(0, spin)

    world.after(5, spin)
    with pytest.raises(LivelockError, match="at 5.000 ms"):
        world.run_until(10)
    assert len(spins) == EVENTS_AT_ONE_INSTANT_MAX and set(spins) == {5.0}


def test_a_livelock_in_a_run_is_a_failing_seed(monkeypatch):
    # A bookie's checkpoint timer planted to reschedule itself with no delay.
    def spinning_checkpoint_timer(bookie):
        bookie.after(0, bookie._checkpoint_timer)

    monkeypatch.setattr(SimBookie, "_checkpoint_timer", spinning_checkpoint_timer)
    result = run_seed(5)
    [violation] = result.violations
    assert violation.invariant == "livelock" and violation.detail.startswith("seed 5: "), violation
    assert "time does not move on" in violation.detail and "_timer" in violation.detail
    assert "livelock" in result.summary()


# --- the liveness phase excuses only what cannot be recovered ------------------------------


class NegativesUnknown(RecoveryCore):
    """A planted liveness bug: "no such entry" never counts, so recovery
    never finds the end of a ledger and never closes it."""

    @staticmethod
    def _is_negative(status):
        return False


def test_a_ledger_stuck_for_another_reason_is_not_excused_by_a_corrupt_entry(monkeypatch):
    # Seed 13 corrupts entries of ledgers 0, 6, 7 and 22, which stay open.
    # With recovery unable to close anything, each is reported: stuck on
    # the entry after its end, which is not the corrupt one.
    monkeypatch.setattr(sim.runner, "RecoveryCore", NegativesUnknown)
    result = run_seed(13, trace=True)
    corrupted = {int(ledger) for line in result.trace for ledger in re.findall(r"nemesis corrupt \S+ ledger (\d+) ", line)}
    stuck = {int(ledger) for violation in result.violations for ledger in re.findall(r"ledger (\d+) is not closed", violation.detail)}
    assert {0, 6, 7, 22} <= corrupted & stuck, (corrupted, stuck)
    assert not result.notes


def test_a_corrupt_entry_with_one_intact_copy_left_is_recovered():
    # Seed 2277: when the liveness phase begins, entry 0 of ledger 30 has
    # one intact copy, one corrupt and one bookie without it (E/WQ/AQ
    # 4/3/2). The intact copy makes it present: the ledger closes at 0 and
    # nothing is excused.
    result = run_seed(2277, trace=True)
    assert result.ok, result.summary()
    assert not result.notes, result.notes
    assert any("nemesis corrupt bookie-1 ledger 30 entry 0 " in line for line in result.trace)
    assert any(line.endswith("liveness-recoverer-30 recovered ledger 30: last entry 0") for line in result.trace)


def test_a_ledger_whose_fencing_a_corrupt_copy_blocks_is_excused_and_its_acknowledged_entries_read():
    # Seed 252 (E/WQ/AQ 3/2/1): fencing ledger 7 needs all three bookies,
    # and one answers every fence read IO_ERROR (its copy of the last entry
    # is corrupt). The acknowledged entries of the ledger left open are
    # read back all the same.
    result = run_seed(252)
    assert result.ok, result.summary()
    assert any("fencing needs 3 of 3 bookies" in note for note in result.notes), result.notes
    assert result.stats["unclosed_entries_read"] > 0


# --- faults -----------------------------------------------------------------------------------


def test_corruption_served_as_intact_reaches_the_clients_digest_checks():
    # The entry log serves the bad bytes as OK: a reader's or a recoverer's
    # digest check catches them, and the run keeps every invariant.
    result = run_seed(1, trace=True)
    assert result.ok, result.summary()
    assert any("(served as intact)" in line for line in result.trace)
    assert result.stats["digest_mismatches"] > 0


def test_no_seed_declares_corruption_with_one_copy_of_each_entry():
    # With WQ = 1 the nemesis could never corrupt a copy (never the last
    # intact one): the kind is not declared at all.
    chosen = [choose_parameters(seed) for seed in range(300)]
    single = [parameters for parameters in chosen if parameters.write_quorum == 1]
    assert single and not any("corrupt" in parameters.faults for parameters in single)
    assert any("corrupt" in parameters.faults for parameters in chosen)


def test_the_first_fault_comes_within_the_first_second(monkeypatch):
    # Even with a mean of a day between faults, a run gets its first one.
    world = World(1)
    injected_ms = []
    monkeypatch.setattr(SimNemesis, "_inject", lambda nemesis: injected_ms.append(world.now_ms))
    parameters = choose_parameters(0, faults=("crash",), fault_interval_ms_mean=86_400_000.0)
    nemesis = SimNemesis(world, Network(world, latency_ms_min=1, latency_ms_max=2), None, None, parameters, bookies=[], clients=[])
    nemesis.start()
    world.run_until(FIRST_FAULT_MS_MAX)
    assert len(injected_ms) == 1


def test_a_fault_with_nothing_to_act_on_is_counted_as_skipped():
    world = World(1)
    parameters = choose_parameters(0, faults=("crash", "client_crash"))
    nemesis = SimNemesis(world, Network(world, latency_ms_min=1, latency_ms_max=2), None, None, parameters, bookies=[], clients=[])
    nemesis._crash()
    nemesis._client_crash()
    assert nemesis.skipped == {"crash": 1, "client_crash": 1} and not nemesis.injected


# --- the parts ---------------------------------------------------------------------------


def test_events_run_in_time_order_and_in_order_scheduled_at_equal_times():
    world = World(1)
    seen = []
    world.at(5, seen.append, "late")
    world.at(1, seen.append, "first")
    world.at(1, seen.append, "second")
    world.run_until(10)
    assert seen == ["first", "second", "late"] and world.now_ms == 10


class Recorder(SimNode):
    def __init__(self, name, world, network):
        super().__init__(name, world, network)
        self.received = []
        self.lost = []
        self.start()

    def deliver(self, source, message):
        self.received.append((source, message))

    def connection_lost(self, peer):
        self.lost.append(peer)


def nodes(**network_options):
    world = World(3)
    network = Network(world, latency_ms_min=1, latency_ms_max=2, **network_options)
    return world, network, Recorder("a", world, network), Recorder("b", world, network)


def test_a_partition_loses_messages_and_healing_restores_the_link():
    world, network, a, b = nodes()
    network.block([("a", "b")])
    a.send("b", "lost")
    b.send("a", "kept")  # asymmetric: the other way still works
    world.run_until(10)
    assert b.received == [] and a.received == [("b", "kept")]
    network.heal()
    a.send("b", "after")
    world.run_until(20)
    assert b.received == [("a", "after")]


def test_a_paused_node_gets_its_messages_and_timers_when_resumed():
    world, network, a, b = nodes()
    b.pause()
    fired = []
    b.after(1, fired.append, "timer")
    a.send("b", "held")
    world.run_until(10)
    assert b.received == [] and fired == []
    b.resume()
    assert fired == ["timer"] and b.received == [("a", "held")]


def test_a_crash_drops_messages_in_flight_and_tells_peers():
    world, network, a, b = nodes()
    a.send("b", "hello")
    world.run_until(5)
    a.send("b", "in flight")
    b.crash()
    world.run_until(50)
    assert b.received == [("a", "hello")] and a.lost == ["b"]
    b.start()
    a.send("b", "again")
    world.run_until(60)
    assert b.received[-1] == ("a", "again")


def test_duplication_delivers_twice():
    world, network, a, b = nodes(duplicate_probability=1.0)
    a.send("b", "twice")
    world.run_until(10)
    assert b.received == [("a", "twice"), ("a", "twice")]
