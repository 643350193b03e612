"""`quire jepsen`: a real ZooKeeper, five real bookies and writer and reader
client processes, every client-bookie, client-ZooKeeper and bookie-ZooKeeper
link through a proxy the nemesis controls. The nemesis kills (-9) and
restarts bookies, pauses them, partitions a client from some bookies, and
expires ZooKeeper sessions (by cutting a node from ZooKeeper past its
session timeout, confirmed from ZooKeeper's own list of sessions). Then
everything heals, a final reader recovers and reads every ledger, and the
merged history is checked and plotted."""

from __future__ import annotations

import json
import random
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import trio

from coordination.zk_launcher import ZooKeeperServer, four_letter_word
from sim.jepsen.checker import CheckResult, check
from sim.jepsen.client import SESSION_MARKER
from sim.jepsen.history import HistoryWriter, merge_histories
from sim.jepsen.processes import ManagedProcess, free_port
from sim.jepsen.proxy import ProxyMesh

ZK = "zk"
BOOKIE_SESSION_TIMEOUT_MS = 4_000
CLIENT_SESSION_TIMEOUT_MS = 6_000
FAULT_S_MIN = 2.0
FAULT_S_MAX = 6.0
CALM_S_MIN = 1.0
CALM_S_MAX = 3.0
FINAL_DEADLINE_S = 240.0
FAULTS = ("kill", "pause", "partition", "expire-session")
ROOT = "/quire"
CLIENT_SESSION_MARKER = ROOT + SESSION_MARKER  # each client's ephemeral znode, as ZooKeeper names it
SESSION_LOOKUP_S = 10.0  # to find a node's session before cutting it off
SESSION_POLL_S = 0.25
FOUR_LETTER_WORD_S = 5.0


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
    result: CheckResult
    operations: int
    duration_s: float
    faults: dict[str, int]
    expiries_confirmed: int  # session expiries ZooKeeper was seen to carry out
    summary_path: Path
    plot_path: Path
    history_path: Path

    def summary(self) -> str:
        return self.summary_path.read_text()


class JepsenRun:
    def __init__(self, work_dir: Path, *, duration_s: float, writers: int, readers: int, bookies: int, seed: int,
                 progress=print) -> None:
        self.work_dir = work_dir
        self.duration_s = duration_s
        self.writer_names = [f"writer-{index}" for index in range(writers)]
        self.reader_names = [f"reader-{index}" for index in range(readers)]
        self.bookie_names = [f"bookie-{index}" for index in range(bookies)]
        self.rng = random.Random(seed)
        self.seed = seed
        self.progress = progress
        self.start_monotonic = time.monotonic()
        self.faults: dict[str, int] = {}
        self.expiries_confirmed = 0
        self._fault_id = 0
        self.zk_port: int | None = None
        self.bookies: dict[str, ManagedProcess] = {}
        self.clients: dict[str, ManagedProcess] = {}

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

    def _bookie_command(self, name: str, port: int, mesh: ProxyMesh) -> list[str]:
        directory = self.work_dir / name
        return [
            sys.executable, "-m", "quire", "bookie", "run", "--zk", mesh.address(name, ZK), "--root", ROOT,
            "--port", str(port), "--journal-dir", str(directory / "journal"), "--ledger-dir", str(directory / "ledgers"),
            "--session-timeout-ms", str(BOOKIE_SESSION_TIMEOUT_MS),
        ]

    async def run(self) -> JepsenReport:
        self.work_dir.mkdir(parents=True, exist_ok=True)
        zk = ZooKeeperServer(free_port(), self.work_dir / "zookeeper", die_with_parent=True)
        self.zk_port = zk.port
        ports = {name: free_port() for name in self.bookie_names}
        clients = self.writer_names + self.reader_names + ["final"]
        links = {(name, ZK): ("127.0.0.1", zk.port) for name in self.bookie_names + clients}
        links.update({(client, bookie): ("127.0.0.1", ports[bookie]) for client in clients for bookie in self.bookie_names})
        mesh = ProxyMesh(links)
        self.nemesis_history = HistoryWriter(self.work_dir / "history-nemesis.jsonl", origin_s=self.start_monotonic)
        zk.start()
        self.progress(f"zookeeper serving on {zk.address}")
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(mesh.run)
                await self._start_bookies(mesh, ports)
                for name in self.writer_names:
                    self._start_client("writer", name, mesh)
                for name in self.reader_names:
                    self._start_client("reader", name, mesh)
                self.progress(f"{len(self.writer_names)} writers and {len(self.reader_names)} readers running; nemesis on for {self.duration_s:.0f}s")
                await self._nemesis(mesh)
                await self._heal(mesh)
                for name in self.writer_names + self.reader_names:
                    await self.clients[name].stop()
                self.progress("faults healed, clients stopped: the final reader recovers and reads every ledger")
                final = self._start_client("final", "final", mesh)
                with trio.move_on_after(FINAL_DEADLINE_S):
                    while final.running:
                        await trio.sleep(0.2)
                await final.stop()
                nursery.cancel_scope.cancel()
        finally:
            for process in list(self.clients.values()) + list(self.bookies.values()):
                process.kill()
            self.nemesis_history.close()
            zk.stop()
        return self._report()

    async def _start_bookies(self, mesh: ProxyMesh, ports: dict[str, int]) -> None:
        for name in self.bookie_names:
            process = self.bookies[name] = ManagedProcess(
                name, self._bookie_command(name, ports[name], mesh), self.work_dir / name / "bookie.log", port=ports[name]
            )
            process.start()
        for process in self.bookies.values():
            await process.wait_serving()
        self.progress(f"{len(self.bookies)} bookies serving")

    def _start_client(self, role: str, name: str, mesh: ProxyMesh) -> ManagedProcess:
        process = self.clients[name] = ManagedProcess(name, self._client_command(role, name, mesh), self.work_dir / f"{name}.log")
        process.start()
        return process

    # --- the nemesis --------------------------------------------------------------------

    def _record(self, f: str, fault: str, targets: list[str], fault_id: int, **details) -> None:
        self.nemesis_history.append("nemesis", "info", f, {"fault": fault, "targets": targets, "fault_id": fault_id, **details})

    async def _nemesis(self, mesh: ProxyMesh) -> None:
        end = trio.current_time() + self.duration_s
        while trio.current_time() < end:
            await trio.sleep(self.rng.uniform(CALM_S_MIN, CALM_S_MAX))
            if trio.current_time() >= end:
                break
            fault = self.rng.choice(FAULTS)
            self._fault_id += 1
            self.faults[fault] = self.faults.get(fault, 0) + 1
            duration_s = min(self.rng.uniform(FAULT_S_MIN, FAULT_S_MAX), max(0.5, end - trio.current_time()))
            await getattr(self, "_" + fault.replace("-", "_"))(mesh, self._fault_id, duration_s)

    async def _kill(self, mesh: ProxyMesh, fault_id: int, duration_s: float) -> None:
        bookie = self.bookies[self.rng.choice(self.bookie_names)]
        self._record("fault-start", "kill", [bookie.name], fault_id)
        bookie.kill()
        await trio.sleep(duration_s)
        bookie.start()
        await bookie.wait_serving()
        self._record("fault-end", "kill", [bookie.name], fault_id)

    async def _pause(self, mesh: ProxyMesh, fault_id: int, duration_s: float) -> None:
        bookie = self.bookies[self.rng.choice(self.bookie_names)]
        self._record("fault-start", "pause", [bookie.name], fault_id)
        bookie.pause()
        await trio.sleep(duration_s)
        bookie.resume()
        self._record("fault-end", "pause", [bookie.name], fault_id)

    async def _partition(self, mesh: ProxyMesh, fault_id: int, duration_s: float) -> None:
        client = self.rng.choice(self.writer_names + self.reader_names)
        bookies = sorted(self.rng.sample(self.bookie_names, self.rng.randint(1, 2)))
        direction = self.rng.choice(["both", "to_target", "from_target"])
        self._record("fault-start", "partition", [client, *bookies], fault_id)
        mesh.cut(client, bookies, direction)
        await trio.sleep(duration_s)
        mesh.heal(client)
        self._record("fault-end", "partition", [client, *bookies], fault_id)

    async def _expire_session(self, mesh: ProxyMesh, fault_id: int, duration_s: float) -> None:
        # ZooKeeper expires a session it has not heard from for its timeout:
        # cut the node from ZooKeeper for longer than that, and confirm from
        # ZooKeeper's list of sessions that the node's session is gone.
        node = self.rng.choice(self.bookie_names + self.writer_names)
        timeout_ms = BOOKIE_SESSION_TIMEOUT_MS if node.startswith("bookie") else CLIENT_SESSION_TIMEOUT_MS
        session = await self._session_of(node)
        self._record("fault-start", "expire-session", [node], fault_id, session=session)
        mesh.cut(node, [ZK])
        await trio.sleep(timeout_ms / 1000 * 1.5)
        confirmed = False
        with trio.move_on_after(timeout_ms / 1000):
            while session is not None and not confirmed:
                dump = await self._zk_dump()
                confirmed = dump is not None and session not in live_sessions(dump)
                if not confirmed:
                    await trio.sleep(SESSION_POLL_S)
        mesh.heal(node)
        self.expiries_confirmed += confirmed
        self._record("fault-end", "expire-session", [node], fault_id, session=session, confirmed=confirmed)

    async def _zk_dump(self) -> str | None:
        """ZooKeeper's answer to `dump` (asked directly, not through a
        proxy), or None when it gave none."""
        assert self.zk_port is not None
        try:
            return await trio.to_thread.run_sync(four_letter_word, "127.0.0.1", self.zk_port, "dump", FOUR_LETTER_WORD_S)
        except OSError:
            return None

    async def _session_of(self, node: str) -> str | None:
        """The session of a bookie (owner of its registration) or a client
        (owner of its marker), as ZooKeeper lists them; None if none shows
        within SESSION_LOOKUP_S (a bookie still registering)."""
        if node in self.bookies:
            suffix = f"/127.0.0.1:{self.bookies[node].port}"
            matches = lambda path: path.startswith(f"{ROOT}/bookies/") and path.endswith(suffix)  # noqa: E731
        else:
            marker = CLIENT_SESSION_MARKER.format(name=node)
            matches = lambda path: path == marker  # noqa: E731
        with trio.move_on_after(SESSION_LOOKUP_S):
            while True:
                for path, session in ephemeral_owners(await self._zk_dump() or "").items():
                    if matches(path):
                        return session
                await trio.sleep(SESSION_POLL_S)
        return None

    async def _heal(self, mesh: ProxyMesh) -> None:
        mesh.heal()
        for bookie in self.bookies.values():
            bookie.resume()
            if not bookie.running:
                bookie.start()
        for bookie in self.bookies.values():
            await bookie.wait_serving()

    # --- the verdict ---------------------------------------------------------------------

    def _report(self) -> JepsenReport:
        from sim.jepsen.plot import plot_history

        paths = sorted(self.work_dir.glob("history-*.jsonl"))
        history_path = self.work_dir / "history.jsonl"
        operations = merge_histories(paths, history_path)
        result = check(operations)
        duration_s = operations[-1].time_ms / 1000 if operations else 0.0
        summary_path = self.work_dir / "summary.txt"
        faults = ", ".join(f"{kind} {count}" for kind, count in sorted(self.faults.items())) or "none"
        summary_path.write_text(
            f"quire jepsen: seed {self.seed}, {duration_s:.1f}s, {len(operations)} operations, "
            f"{len(self.bookie_names)} bookies, {len(self.writer_names)} writers, {len(self.reader_names)} readers\n"
            f"faults injected: {faults}; session expiries confirmed by ZooKeeper: "
            f"{self.expiries_confirmed} of {self.faults.get('expire-session', 0)}\n{result.summary()}\n"
        )
        plot_path = self.work_dir / "plot.png"
        plot_history(operations, plot_path, title=f"quire jepsen, seed {self.seed}: {result.verdict}")
        return JepsenReport(
            self.work_dir, result, len(operations), duration_s, dict(self.faults), self.expiries_confirmed,
            summary_path, plot_path, history_path,
        )


def run_jepsen(work_dir: Path, *, duration_s: float = 60.0, writers: int = 2, readers: int = 1, bookies: int = 5,
               seed: int = 0, progress=print) -> JepsenReport:
    run = JepsenRun(work_dir, duration_s=duration_s, writers=writers, readers=readers, bookies=bookies, seed=seed, progress=progress)
    return trio.run(run.run)
