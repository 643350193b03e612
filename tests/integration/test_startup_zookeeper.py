"""Start-up survives ZooKeeper: a bookie or broker started while ZooKeeper
is paused (SIGSTOP, longer than the session timeout) comes up and serves
once it resumes; a broker or bookie restarted at once, while its previous
session still holds its registration, waits that session out, even through
a ZooKeeper pause; a ZooKeeper that never comes back ends start-up at the
deadline with one line and exit 2, never a traceback.

Each test has a ZooKeeper of its own, since it pauses it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
from dataclasses import dataclass

import pytest
import trio

from broker.client import Client
from broker.errors import BrokerError
from coordination.store import MetadataError
from coordination.zk_launcher import ZooKeeperServer
from ledger_client import BookKeeper
from ledger_client.errors import BKError
from tests.integration.bookie_processes import BookieFactory
from tests.integration.broker_processes import BrokerFactory
from tests.integration.processes import QuireProcess, print_logs
from tests.support import free_port, wait_until_async

pytestmark = pytest.mark.integration

ROOT = "/quire"
PAUSE_S = 15  # how long ZooKeeper is stopped: well past the processes' 4 s sessions
COME_UP_DEADLINE_S = 90  # after the pause: start-up's own deadline (60 s) and a margin
# Small brokers: their topics need one bookie.
ONE_BOOKIE_TOPICS = ["--ensemble-size", "1", "--write-quorum", "1", "--ack-quorum", "1"]
ERROR_LINE = re.compile(r"^quire(?: [a-z-]+)*: error: ")


@dataclass
class PausableZooKeeper:
    server: ZooKeeperServer

    @property
    def address(self) -> str:
        return self.server.address

    def pause(self) -> None:
        os.kill(self.server.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.server.pid, signal.SIGCONT)


@dataclass
class Cluster:
    zookeeper: PausableZooKeeper
    bookies: BookieFactory
    brokers: BrokerFactory


@pytest.fixture
def zookeeper_to_pause(tmp_path):
    server = ZooKeeperServer(free_port(), tmp_path / "zookeeper", die_with_parent=True)
    try:
        server.start()
        yield PausableZooKeeper(server)
    finally:
        if server.pid is not None:
            os.kill(server.pid, signal.SIGCONT)  # a stopped process cannot act on SIGTERM
        server.stop()


@pytest.fixture
def cluster(zookeeper_to_pause, tmp_path):
    """Bookies and brokers of this test's own ZooKeeper, all killed at the
    end whatever happened (before the ZooKeeper itself stops)."""
    bookies = BookieFactory(zookeeper_to_pause.address, ROOT, tmp_path)
    brokers = BrokerFactory(zookeeper_to_pause.address, ROOT, tmp_path)
    try:
        yield Cluster(zookeeper_to_pause, bookies, brokers)
    finally:
        brokers.stop_all()
        bookies.stop_all()
        print_logs(brokers.created + bookies.created)


async def hold_paused(cluster: Cluster, *processes: QuireProcess) -> None:
    """Keep ZooKeeper stopped for PAUSE_S (the fault itself, not a wait for
    something), then check every process is still there, and resume it."""
    cluster.zookeeper.pause()
    try:
        await trio.sleep(PAUSE_S)
        for process in processes:
            assert process.running, f"{process.role} exited during the pause:\n{process.log_tail()}"
    finally:
        cluster.zookeeper.resume()


async def add_one_entry(cluster: Cluster) -> None:
    """A ledger client finds a writable bookie through ZooKeeper and one add
    is acknowledged, within the deadline (the bookie may still be
    registering again after its session expired in the pause)."""
    async def added() -> bool:
        try:
            with trio.fail_after(10):
                async with BookKeeper.connect(cluster.zookeeper.address, ROOT, session_timeout_ms=4_000) as bk:
                    ledger = await bk.create_ledger(ensemble_size=1, write_quorum=1, ack_quorum=1, password=b"pw")
                    assert await ledger.add(b"after the pause") == 0
                    await ledger.close()
                    return True
        except (BKError, MetadataError, trio.TooSlowError):
            return False

    await wait_until_async(added, deadline_s=COME_UP_DEADLINE_S, what="an acknowledged add", poll_s=0.5)


async def produce_one(cluster: Cluster, topic: str) -> None:
    """A client finds the topic's broker through ZooKeeper and one message
    is persisted, within the deadline."""
    async def produced() -> bool:
        try:
            with trio.fail_after(15):
                async with Client.connect(cluster.zookeeper.address, ROOT, session_timeout_ms=4_000) as client:
                    producer = await client.create_producer(topic, producer_id="startup-test")
                    await producer.send(b"after the pause")
                    return True
        except (BrokerError, MetadataError, trio.TooSlowError):
            return False

    await wait_until_async(produced, deadline_s=COME_UP_DEADLINE_S, what="a persisted message", poll_s=0.5)


def log_since(process: QuireProcess, offset: int) -> str:
    return process.log_path.read_bytes()[offset:].decode(errors="replace")


def log_size(process: QuireProcess) -> int:
    return process.log_path.stat().st_size if process.log_path.exists() else 0


async def wait_for_log(process: QuireProcess, offset: int, text: str, deadline_s: float = 30) -> None:
    def logged() -> bool:
        assert process.running, f"{process.role} exited:\n{process.log_tail()}"
        return text in log_since(process, offset)

    await wait_until_async(logged, deadline_s=deadline_s, what=f"{text!r} in the {process.role}'s log", poll_s=0.05)


def exit_of(process: QuireProcess, offset: int, deadline_s: float) -> tuple[int, str]:
    """Wait for the process to end by itself; its exit status and the log of this run."""
    try:
        code = process.process.wait(timeout=deadline_s)
    except subprocess.TimeoutExpired:
        process.kill()
        raise AssertionError(f"{process.role} still running after {deadline_s}s:\n{process.log_tail()}") from None
    return code, log_since(process, offset)


def one_error_line(code: int, output: str, *key_words: str) -> str:
    assert "Traceback" not in output, output
    assert code == 2, (code, output)
    lines = [line for line in output.splitlines() if ERROR_LINE.match(line)]
    assert len(lines) == 1, output
    for word in key_words:
        assert word in lines[0], (word, lines[0])
    return lines[0]


# --- ZooKeeper paused while a process starts ---------------------------------------------------


async def test_a_bookie_started_while_zookeeper_is_paused_comes_up_and_takes_adds(cluster):
    # ZooKeeper stops right after the bookie is launched, for longer than a
    # session; once it resumes, the bookie connects (or, had it connected,
    # gets a fresh session), checks its cookies, registers and serves.
    bookie = cluster.bookies.new()
    bookie.start()
    await hold_paused(cluster, bookie)
    await bookie.wait_serving(COME_UP_DEADLINE_S)
    await add_one_entry(cluster)


async def test_a_broker_started_while_zookeeper_is_paused_comes_up_and_takes_produces(cluster):
    # The bookie runs first; ZooKeeper stops right after the broker is
    # launched. Every session expires in the pause (the bookie's too): once
    # ZooKeeper resumes, the broker starts with a fresh session, the bookie
    # registers again, and a produce goes through.
    await cluster.bookies.started("--no-autorecovery")
    broker = cluster.brokers.new(*ONE_BOOKIE_TOPICS)
    broker.start()
    await hold_paused(cluster, broker)
    await broker.wait_serving(COME_UP_DEADLINE_S)
    await produce_one(cluster, "after-pause")


# --- restarted at once: the previous session still holds the registration ----------------------


async def test_a_broker_restarted_at_once_waits_out_its_previous_session(cluster):
    # kill -9, then the same broker (same id) again at once: its old session
    # keeps /brokers/<id> for 8 s, which the new process waits out.
    await cluster.bookies.started("--no-autorecovery")
    broker = await cluster.brokers.started(*ONE_BOOKIE_TOPICS, "--session-timeout-ms", "8000")
    await produce_one(cluster, "before-restart")
    broker.kill()
    offset = log_size(broker)
    broker.start()
    await wait_for_log(broker, offset, "still registered by another ZooKeeper session")
    await broker.wait_serving(COME_UP_DEADLINE_S)
    await produce_one(cluster, "after-restart")


async def test_a_restarted_broker_survives_a_session_expiry_while_it_waits_for_the_old_one(cluster):
    # The reported failure: the restarted broker is waiting for its previous
    # session's node when ZooKeeper stops for longer than a session. When
    # it resumes, the broker's own session expires too (SessionExpiredError
    # in the registration); it registers with a fresh session and serves.
    await cluster.bookies.started("--no-autorecovery")
    broker = await cluster.brokers.started(*ONE_BOOKIE_TOPICS, "--session-timeout-ms", "8000")
    broker.kill()
    offset = log_size(broker)
    broker.start()
    await wait_for_log(broker, offset, "still registered by another ZooKeeper session")
    await hold_paused(cluster, broker)
    await broker.wait_serving(COME_UP_DEADLINE_S)
    await produce_one(cluster, "after-expiry")
    assert "Traceback" not in log_since(broker, offset)


async def test_a_restarted_bookie_survives_a_zookeeper_pause_while_its_old_registration_lingers(cluster):
    # The same for a bookie: restarted at once, it serves its port but waits
    # for its previous session's registration before it counts as started;
    # ZooKeeper stops meanwhile. It registers once ZooKeeper is back.
    bookie = await cluster.bookies.started("--session-timeout-ms", "8000")
    # It answers requests a moment before it is registered; kill it once it is.
    await wait_for_log(bookie, 0, "serving on")
    bookie.kill()
    offset = log_size(bookie)
    bookie.start()
    await wait_for_log(bookie, offset, "waiting for the stale registration")
    await hold_paused(cluster, bookie)
    await add_one_entry(cluster)
    assert "Traceback" not in log_since(bookie, offset)


# --- past the deadline: one line, exit 2 ---------------------------------------------------------


@pytest.mark.parametrize("role", ["bookie", "broker"])
async def test_a_zookeeper_that_never_comes_back_ends_start_up_with_one_line(cluster, role):
    # ZooKeeper is stopped before the process starts and stays stopped: it
    # accepts connections and never answers, the hardest case. The process
    # gives up at its deadline, naming the step.
    factory = cluster.bookies if role == "bookie" else cluster.brokers
    process = factory.new("--startup-timeout", "6s")
    cluster.zookeeper.pause()
    started = trio.current_time()
    process.start()
    code, output = await trio.to_thread.run_sync(exit_of, process, 0, 60)
    one_error_line(code, output, f"quire {role} run: error: ", "did not start within 6s", f"could not reach ZooKeeper at {cluster.zookeeper.address}")
    # The deadline, the interpreter's start and one connect try at most.
    assert trio.current_time() - started < 6 + 15


async def test_a_broker_id_held_by_a_live_broker_ends_start_up_with_one_line(cluster):
    # Another live process holds this broker id's registration: it is never
    # taken from it, and the newcomer says so at its deadline.
    first = await cluster.brokers.started()
    second = cluster.brokers.new("--broker-id", first.address, "--startup-timeout", "5s")
    second.start()
    code, output = await trio.to_thread.run_sync(exit_of, second, 0, 60)
    one_error_line(code, output, "quire broker run: error: ", f"register broker {first.address}", "is another broker running")
    assert first.running
