"""`quire jepsen`: a real ZooKeeper, five real bookies and writer and reader
client processes, every client-bookie, client-ZooKeeper and bookie-ZooKeeper
link through a proxy the nemesis controls. The nemesis kills (-9) and
restarts bookies, pauses them, partitions a client from some bookies, and
expires ZooKeeper sessions (by cutting a node from ZooKeeper past its
session timeout, confirmed from ZooKeeper's own list of sessions). Then
everything heals, a final reader recovers and reads every ledger, and the
merged history is checked and plotted.

The frame of a run (ClusterRun: ZooKeeper, the proxies, the bookies, the
stopping of everything), the nemesis loop, its faults and the report are
shared with the broker run (sim/jepsen/broker_runner.py), which chooses
other targets."""

from __future__ import annotations

import json
import random
import re
import sys
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import trio

from coordination.zk_launcher import FOUR_LETTER_WORDS, ZooKeeperServer, four_letter_word
from sim.jepsen.checker import CheckResult, check
from sim.jepsen.client import SESSION_MARKER
from sim.jepsen.history import HistoryWriter, Operation, merge_histories
from sim.jepsen.processes import ManagedProcess, free_server_ports
from sim.jepsen.proxy import ProxyMesh

ZK = "zk"
BOOKIE_SESSION_TIMEOUT_MS = 4_000
CLIENT_SESSION_TIMEOUT_MS = 6_000
FAULT_S_MIN = 2.0
FAULT_S_MAX = 6.0
CALM_S_MIN = 1.0
CALM_S_MAX = 3.0
FINAL_DEADLINE_S = 240.0
FAULTS = ("kill", "pause", "partition", "expire-session")  # as the history records them
# What `--nemesis` names each fault kind (a session expiry is "expiry").
NEMESIS_WORDS = {"kill": "kill", "pause": "pause", "partition": "partition", "expiry": "expire-session"}
ROOT = "/quire"
CLIENT_SESSION_MARKER = ROOT + SESSION_MARKER  # each client's ephemeral znode, as ZooKeeper names it
SESSION_LOOKUP_S = 10.0  # to find a node's session before cutting it off
SESSION_POLL_S = 0.25
FOUR_LETTER_WORD_S = 5.0


def parse_nemesis(text: str) -> tuple[str, ...]:
    """The fault kinds a nemesis selection names ("kill,pause,partition,expiry"
    or any of them), in FAULTS order; ValueError saying what is wrong."""
    words = [word.strip() for word in text.split(",")]
    known = ", ".join(NEMESIS_WORDS)
    if not any(words):
        raise ValueError(f"names no fault; give one or more of {known}, separated by commas")
    for word in words:
        if word not in NEMESIS_WORDS:
            shown = repr(word[:40]) if word else "an empty name"
            raise ValueError(f"{shown} is not a fault; the nemesis knows {known}")
    chosen = {NEMESIS_WORDS[word] for word in words}
    return tuple(fault for fault in FAULTS if fault in chosen)


def ephemeral_owners(dump: str) -> dict[str, str]:
    """Ephemeral znode -> the session that owns it, from the answer to
    ZooKeeper's `dump` command."""
    owners: dict[str, str] = {}
    section = dump.split("Sessions with Ephemerals", 1)[-1].split("Connections dump:", 1)[0]
    session = None
    for line in section.splitlines()[1:]:
        if re.fullmatch(r"0x[0-9a-f]+:", line.strip()):
            session = line.strip()[:-1]
        elif line.startswith("\t") and session is not None:
            owners[line.strip()] = session
    return owners


def live_sessions(dump: str) -> set[str]:
    """The sessions ZooKeeper's session tracker holds, from `dump`."""
    tracker = dump.split("ephemeral nodes dump:", 1)[0]
    return set(re.findall(r"^\t(0x[0-9a-f]+)$", tracker, re.MULTILINE))


@dataclass
class JepsenReport:
    work_dir: Path
    result: CheckResult  # or the broker run's BrokerCheckResult: both have verdict and summary()
    operations: int
    duration_s: float
    faults: dict[str, int]
    expiries_confirmed: int  # session expiries ZooKeeper was seen to carry out
    summary_path: Path
    plot_path: Path
    history_path: Path

    def summary(self) -> str:
        return self.summary_path.read_text()


class Nemesis:
    """The fault loop both runs share: a calm pause, then one fault at a time
    among the kinds selected, each recorded as a fault-start and a fault-end
    in the nemesis's history and counted by kind; and the faults themselves,
    on processes, proxies and ZooKeeper sessions. The run chooses the
    targets (`inject` is called with the kind, the fault's id and how long
    it should last)."""

    def __init__(self, history: HistoryWriter, rng: random.Random, zk_port: int, *, faults: Iterable[str] = FAULTS) -> None:
        self.history = history
        self.rng = rng
        self.zk_port = zk_port
        self.selected = tuple(faults)
        if not self.selected or any(fault not in FAULTS for fault in self.selected):
            raise ValueError(f"faults must be some of {', '.join(FAULTS)}, got {self.selected!r}")
        self.faults: dict[str, int] = {}  # injected, by kind
        self.expiries_confirmed = 0  # session expiries ZooKeeper was seen to carry out
        self._fault_id = 0

    @classmethod
    def recording_in(cls, work_dir: Path, origin_s: float, rng: random.Random, zk_port: int, *,
                     faults: Iterable[str] = FAULTS) -> Nemesis:
        """A nemesis recording to work_dir/history-nemesis.jsonl, its times
        taken from the run's start (`origin_s`) like the clients'; the run
        closes its history at the end."""
        history = HistoryWriter(work_dir / "history-nemesis.jsonl", origin_s=origin_s)
        return cls(history, rng, zk_port, faults=faults)

    def record(self, f: str, fault: str, targets: list[str], fault_id: int, **details) -> None:
        self.history.append("nemesis", "info", f, {"fault": fault, "targets": targets, "fault_id": fault_id, **details})

    async def run(self, duration_s: float, inject: Callable[[str, int, float], Awaitable[None]]) -> None:
        end = trio.current_time() + duration_s
        while trio.current_time() < end:
            await trio.sleep(self.rng.uniform(CALM_S_MIN, CALM_S_MAX))
            if trio.current_time() >= end:
                break
            fault = self.rng.choice(self.selected)
            self._fault_id += 1
            self.faults[fault] = self.faults.get(fault, 0) + 1
            fault_s = min(self.rng.uniform(FAULT_S_MIN, FAULT_S_MAX), max(0.5, end - trio.current_time()))
            await inject(fault, self._fault_id, fault_s)

    async def kill(self, process: ManagedProcess, fault_id: int, duration_s: float, *,
                   on_killed: Callable[[], None] | None = None, **details) -> None:
        """kill -9, and start it again after `duration_s` (waiting until a
        server accepts connections again); `on_killed` runs between."""
        self.record("fault-start", "kill", [process.name], fault_id, **details)
        process.kill()
        if on_killed is not None:
            on_killed()
        await trio.sleep(duration_s)
        process.start()
        if process.port is not None:
            await process.wait_serving()
        self.record("fault-end", "kill", [process.name], fault_id)

    async def pause(self, process: ManagedProcess, fault_id: int, duration_s: float) -> None:
        self.record("fault-start", "pause", [process.name], fault_id)
        process.pause()
        await trio.sleep(duration_s)
        process.resume()
        self.record("fault-end", "pause", [process.name], fault_id)

    async def partition(self, mesh: ProxyMesh, node: str, targets: list[str], direction: str, fault_id: int,
                        duration_s: float, *, reset: bool = False) -> None:
        """Cut `node`'s links to `targets` in `direction`; heal them after
        `duration_s`, first resetting their connections when `reset` (as a
        cut longer than the peers' keep-alive would end)."""
        self.record("fault-start", "partition", [node, *targets], fault_id, direction=direction, reset=reset)
        mesh.cut(node, targets, direction)
        await trio.sleep(duration_s)
        if reset:
            mesh.reset(node, targets)
        mesh.heal(node)
        self.record("fault-end", "partition", [node, *targets], fault_id)

    async def expire_session(self, mesh: ProxyMesh, node: str, session: str | None, timeout_ms: int, fault_id: int,
                             **details) -> None:
        """ZooKeeper expires a session it has not heard from for its timeout:
        cut the node from ZooKeeper for longer than that, and confirm from
        ZooKeeper's list of sessions that the node's session is gone."""
        self.record("fault-start", "expire-session", [node], fault_id, session=session, **details)
        mesh.cut(node, [ZK])
        await trio.sleep(timeout_ms / 1000 * 1.5)
        confirmed = False
        with trio.move_on_after(timeout_ms / 1000):
            while session is not None and not confirmed:
                dump = await self.zk_dump()
                confirmed = dump is not None and session not in live_sessions(dump)
                if not confirmed:
                    await trio.sleep(SESSION_POLL_S)
        mesh.heal(node)
        self.expiries_confirmed += confirmed
        self.record("fault-end", "expire-session", [node], fault_id, session=session, confirmed=confirmed)

    async def zk_dump(self) -> str | None:
        """ZooKeeper's answer to `dump` (asked directly, not through a
        proxy), or None when it gave none."""
        try:
            return await trio.to_thread.run_sync(four_letter_word, "127.0.0.1", self.zk_port, "dump", FOUR_LETTER_WORD_S)
        except OSError:
            return None

    async def session_of(self, matches: Callable[[str], bool]) -> str | None:
        """The session owning the first ephemeral znode whose path `matches`,
        as ZooKeeper lists them; None if none shows within SESSION_LOOKUP_S."""
        with trio.move_on_after(SESSION_LOOKUP_S):
            while True:
                for path, session in ephemeral_owners(await self.zk_dump() or "").items():
                    if matches(path):
                        return session
                await trio.sleep(SESSION_POLL_S)
        return None


def injector(run: object, mesh: ProxyMesh) -> Callable[[str, int, float], Awaitable[None]]:
    """The `inject` of Nemesis.run for a run whose method for each fault kind
    is named after it (`_kill`, `_pause`, `_partition`, `_expire_session`)
    and takes the mesh, the fault's id and its duration."""
    async def inject(fault: str, fault_id: int, duration_s: float) -> None:
        await getattr(run, "_" + fault.replace("-", "_"))(mesh, fault_id, duration_s)

    return inject


async def start_serving(processes: Iterable[ManagedProcess]) -> None:
    """Start every process, then wait until each accepts connections."""
    processes = list(processes)
    for process in processes:
        process.start()
    for process in processes:
        await process.wait_serving()


async def heal(mesh: ProxyMesh, processes: Iterable[ManagedProcess]) -> None:
    """Heal every link, resume every paused process, start every one that is
    down, and wait until the servers among them accept connections."""
    mesh.heal()
    processes = list(processes)
    for process in processes:
        process.resume()
        if not process.running:
            process.start()
    for process in processes:
        if process.port is not None:
            await process.wait_serving()


def write_report(work_dir: Path, check_history: Callable[[list[Operation]], CheckResult], nemesis: Nemesis, *,
                 describe: Callable[[list[Operation], float], str], plot_title: str, plot_operation_name: str = "add",
                 plot_noun: str = "adds") -> JepsenReport:
    """Merge the processes' histories into history.jsonl, check them, and
    write summary.txt (`describe`'s line, the faults, the checker's summary)
    and plot.png (of the operations named `plot_operation_name`, which its
    labels call `plot_noun`)."""
    from sim.jepsen.plot import plot_history

    paths = sorted(work_dir.glob("history-*.jsonl"))
    history_path = work_dir / "history.jsonl"
    operations = merge_histories(paths, history_path)
    result = check_history(operations)
    duration_s = operations[-1].time_ms / 1000 if operations else 0.0
    summary_path = work_dir / "summary.txt"
    faults = ", ".join(f"{kind} {count}" for kind, count in sorted(nemesis.faults.items())) or "none"
    summary_path.write_text(
        f"{describe(operations, duration_s)}\n"
        f"faults injected: {faults}; session expiries confirmed by ZooKeeper: "
        f"{nemesis.expiries_confirmed} of {nemesis.faults.get('expire-session', 0)}\n{result.summary()}\n"
    )
    plot_path = work_dir / "plot.png"
    plot_history(operations, plot_path, title=f"{plot_title}: {result.verdict}", operation_name=plot_operation_name,
                 noun=plot_noun)
    return JepsenReport(
        work_dir, result, len(operations), duration_s, dict(nemesis.faults), nemesis.expiries_confirmed,
        summary_path, plot_path, history_path,
    )


class ClusterRun:
    """The frame both runs share: ZooKeeper, a proxy for every link and the
    nemesis around the run's own work, everything it started stopped
    whatever happens, and then the report. A run names the servers that
    need a port (`server_names`) and says which links there are (`_links`),
    does its work (`_work`: servers, clients, the nemesis, the healing, the
    last reads), stops what is left running (`_stop_leftovers`, also after
    a failure) and writes its report (`_report`)."""

    def __init__(self, work_dir: Path, *, duration_s: float, bookies: int, seed: int, faults: Iterable[str],
                 progress) -> None:
        self.work_dir = work_dir
        self.duration_s = duration_s
        self.seed = seed
        self.rng = random.Random(seed)
        self.selected_faults = tuple(faults)
        self.progress = progress
        self.start_monotonic = time.monotonic()
        self.bookie_names = [f"bookie-{index}" for index in range(bookies)]
        self.server_names = list(self.bookie_names)
        self.ports: dict[str, int] = {}  # server -> the port it serves on
        self.bookies: dict[str, ManagedProcess] = {}
        self.clients: dict[str, ManagedProcess] = {}
        self.nemesis: Nemesis | None = None

    async def run(self) -> JepsenReport:
        self.work_dir.mkdir(parents=True, exist_ok=True)
        # `dump`: how the expire-session fault finds and confirms sessions.
        zk_port, *server_ports = free_server_ports(1 + len(self.server_names))
        zk = ZooKeeperServer(zk_port, self.work_dir / "zookeeper", die_with_parent=True,
                             four_letter_words=(*FOUR_LETTER_WORDS, "dump"))
        self.ports = dict(zip(self.server_names, server_ports))
        mesh = ProxyMesh(self._links(zk.port))
        self.nemesis = Nemesis.recording_in(self.work_dir, self.start_monotonic, self.rng, zk.port, faults=self.selected_faults)
        zk.start()
        self.progress(f"zookeeper serving on {zk.address}")
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(mesh.run)
                await self._work(mesh)
                nursery.cancel_scope.cancel()
        finally:
            self._stop_leftovers()
            self.nemesis.history.close()
            zk.stop()
        return self._report()

    async def _start_bookies(self, mesh: ProxyMesh) -> None:
        """Start a bookie of each name, its data and log under work_dir/name,
        dialling ZooKeeper through its proxy, and wait until each serves. Each
        is in `bookies` before it starts, so that it is stopped whatever fails
        after."""
        for name in self.bookie_names:
            directory = self.work_dir / name
            command = [
                sys.executable, "-m", "quire", "bookie", "run", "--zk", mesh.address(name, ZK), "--root", ROOT,
                "--port", str(self.ports[name]), "--journal-dir", str(directory / "journal"),
                "--ledger-dir", str(directory / "ledgers"), "--session-timeout-ms", str(BOOKIE_SESSION_TIMEOUT_MS),
            ]
            self.bookies[name] = ManagedProcess(name, command, directory / "bookie.log", port=self.ports[name])
        await start_serving(self.bookies.values())

    def _start_client_process(self, name: str, command: list[str]) -> ManagedProcess:
        """Start a client process, logging to work_dir/<name>.log."""
        process = self.clients[name] = ManagedProcess(name, command, self.work_dir / f"{name}.log")
        process.start()
        return process

    def _links(self, zk_port: int) -> dict[tuple[str, str], tuple[str, int]]:
        """(node, target) -> the target's address, for every link the proxies carry."""
        raise NotImplementedError

    async def _work(self, mesh: ProxyMesh) -> None:
        raise NotImplementedError

    def _stop_leftovers(self) -> None:
        raise NotImplementedError

    def _report(self) -> JepsenReport:
        raise NotImplementedError


class JepsenRun(ClusterRun):
    def __init__(self, work_dir: Path, *, duration_s: float, writers: int, readers: int, bookies: int, seed: int,
                 faults: Iterable[str] = FAULTS, progress=print) -> None:
        super().__init__(work_dir, duration_s=duration_s, bookies=bookies, seed=seed, faults=faults, progress=progress)
        self.writer_names = [f"writer-{index}" for index in range(writers)]
        self.reader_names = [f"reader-{index}" for index in range(readers)]

    # --- the cluster ----------------------------------------------------------------

    def _client_command(self, role: str, name: str, mesh: ProxyMesh) -> list[str]:
        address_map = {f"127.0.0.1:{self.bookies[bookie].port}": mesh.address(name, bookie) for bookie in self.bookie_names}
        return [
            sys.executable, "-m", "sim.jepsen.client", role, "--name", name,
            "--zk", mesh.address(name, ZK), "--root", ROOT,
            "--history", str(self.work_dir / f"history-{name}.jsonl"),
            "--start-monotonic", repr(self.start_monotonic), "--address-map", json.dumps(address_map),
            "--seed", str(self.seed), "--session-timeout-ms", str(CLIENT_SESSION_TIMEOUT_MS),
        ]

    def _links(self, zk_port: int) -> dict[tuple[str, str], tuple[str, int]]:
        clients = self.writer_names + self.reader_names + ["final"]
        links = {(name, ZK): ("127.0.0.1", zk_port) for name in self.bookie_names + clients}
        links.update({(client, bookie): ("127.0.0.1", self.ports[bookie]) for client in clients for bookie in self.bookie_names})
        return links

    async def _work(self, mesh: ProxyMesh) -> None:
        assert self.nemesis is not None
        await self._start_bookies(mesh)
        self.progress(f"{len(self.bookies)} bookies serving")
        for name in self.writer_names:
            self._start_client("writer", name, mesh)
        for name in self.reader_names:
            self._start_client("reader", name, mesh)
        self.progress(f"{len(self.writer_names)} writers and {len(self.reader_names)} readers running; nemesis on for {self.duration_s:.0f}s")
        await self.nemesis.run(self.duration_s, injector(self, mesh))
        await heal(mesh, self.bookies.values())
        for name in self.writer_names + self.reader_names:
            await self.clients[name].stop()
        self.progress("faults healed, clients stopped: the final reader recovers and reads every ledger")
        final = self._start_client("final", "final", mesh)
        with trio.move_on_after(FINAL_DEADLINE_S):
            while final.running:
                await trio.sleep(0.2)
        await final.stop()

    def _stop_leftovers(self) -> None:
        for process in list(self.clients.values()) + list(self.bookies.values()):
            process.kill()

    def _start_client(self, role: str, name: str, mesh: ProxyMesh) -> ManagedProcess:
        return self._start_client_process(name, self._client_command(role, name, mesh))

    # --- the nemesis: its targets --------------------------------------------------------

    async def _kill(self, mesh: ProxyMesh, fault_id: int, duration_s: float) -> None:
        await self.nemesis.kill(self.bookies[self.rng.choice(self.bookie_names)], fault_id, duration_s)

    async def _pause(self, mesh: ProxyMesh, fault_id: int, duration_s: float) -> None:
        await self.nemesis.pause(self.bookies[self.rng.choice(self.bookie_names)], fault_id, duration_s)

    async def _partition(self, mesh: ProxyMesh, fault_id: int, duration_s: float) -> None:
        client = self.rng.choice(self.writer_names + self.reader_names)
        bookies = sorted(self.rng.sample(self.bookie_names, self.rng.randint(1, 2)))
        direction = self.rng.choice(["both", "to_target", "from_target"])
        await self.nemesis.partition(mesh, client, bookies, direction, fault_id, duration_s)

    async def _expire_session(self, mesh: ProxyMesh, fault_id: int, duration_s: float) -> None:
        node = self.rng.choice(self.bookie_names + self.writer_names)
        timeout_ms = BOOKIE_SESSION_TIMEOUT_MS if node.startswith("bookie") else CLIENT_SESSION_TIMEOUT_MS
        session = await self._session_of(node)
        await self.nemesis.expire_session(mesh, node, session, timeout_ms, fault_id)

    async def _session_of(self, node: str) -> str | None:
        """The session of a bookie (owner of its registration) or a client
        (owner of its marker), as ZooKeeper lists them; None if none shows
        within SESSION_LOOKUP_S (a bookie still registering)."""
        if node in self.bookies:
            suffix = f"/127.0.0.1:{self.bookies[node].port}"
            return await self.nemesis.session_of(lambda path: path.startswith(f"{ROOT}/bookies/") and path.endswith(suffix))
        marker = CLIENT_SESSION_MARKER.format(name=node)
        return await self.nemesis.session_of(lambda path: path == marker)

    # --- the verdict ---------------------------------------------------------------------

    def _report(self) -> JepsenReport:
        def describe(operations: list[Operation], duration_s: float) -> str:
            return (f"quire jepsen: seed {self.seed}, {duration_s:.1f}s, {len(operations)} operations, "
                    f"{len(self.bookie_names)} bookies, {len(self.writer_names)} writers, {len(self.reader_names)} readers")

        assert self.nemesis is not None
        return write_report(self.work_dir, check, self.nemesis, describe=describe, plot_title=f"quire jepsen, seed {self.seed}")


def run_jepsen(work_dir: Path, *, duration_s: float = 60.0, writers: int = 2, readers: int = 1, bookies: int = 5,
               seed: int = 0, faults: Iterable[str] = FAULTS, progress=print) -> JepsenReport:
    run = JepsenRun(work_dir, duration_s=duration_s, writers=writers, readers=readers, bookies=bookies, seed=seed,
                    faults=faults, progress=progress)
    return trio.run(run.run)
