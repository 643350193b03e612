"""Kill -9 cycles under a deduplicating producer, against real processes.

Bookies and brokers (one bookie more than a ledger's ensemble, two brokers)
run from the `quire` command line; a producer with a fixed producer id
publishes numbered messages with explicit sequence ids, sending each again
after any failure until it is acknowledged; meanwhile a nemesis kills a
random bookie or broker with SIGKILL every few seconds and starts it again.
Afterwards one subscription reads the topic from the start: every
acknowledged message must be there, and no message may be stored twice
(one number at two offsets).

`quire bench soak` and the slow integration test run it.
"""

from __future__ import annotations

import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import trio

from sim.jepsen.processes import ManagedProcess, free_server_ports

SESSION_TIMEOUT_MS = 4_000  # a killed process's ZooKeeper nodes go this long after it
SEND_DEADLINE_S = 60.0  # one message's sends and resends, through every fault
DRAIN_IDLE_S = 10.0  # the check's subscription stops once nothing came for this long


@dataclass
class KillCycleReport:
    cycles: int
    kills: dict[str, int]
    sent: int
    acknowledged: int
    consumed: int
    lost: list[int] = field(default_factory=list)
    duplicated: list[int] = field(default_factory=list)
    elapsed_s: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.lost and not self.duplicated

    def summary(self) -> str:
        verdict = "OK" if self.ok else "VIOLATION"
        return (f"{verdict}: {self.cycles} kill -9 cycles ({', '.join(f'{role} {count}' for role, count in sorted(self.kills.items()))}), "
                f"{self.acknowledged} acknowledged of {self.sent} sent, {self.consumed} consumed, "
                f"{len(self.lost)} lost {self.lost[:10]}, {len(self.duplicated)} stored twice {self.duplicated[:10]}, "
                f"{self.elapsed_s:.0f}s")


class KillCycles:
    def __init__(self, work_dir: Path, zk_hosts: str, *, cycles: int, seed: int, root: str = "/kill-cycles",
                 bookies: int = 4, brokers: int = 2, interval_s: tuple[float, float] = (2.0, 5.0),
                 topic: str = "kill-cycles", window: int = 100) -> None:
        self.work_dir = work_dir
        self.zk_hosts = zk_hosts
        self.root = root
        self.cycles = cycles
        self.rng = random.Random(seed)
        self.interval_s = interval_s
        self.topic = topic
        self.window = window
        # Every server's port chosen at once, below the ephemeral range (as
        # the Jepsen runs do): one at a time, two could get the same port.
        ports = free_server_ports(bookies + brokers)
        self.bookies = [self._process("bookie", index, ports[index]) for index in range(bookies)]
        self.brokers = [self._process("broker", index, ports[bookies + index]) for index in range(brokers)]
        self.kills: dict[str, int] = {"bookie": 0, "broker": 0}
        self.acknowledged: set[int] = set()
        self.sent = 0
        self.on_cycle = lambda done: None  # progress: called with the cycles done

    def _process(self, role: str, index: int, port: int) -> ManagedProcess:
        directory = self.work_dir / f"{role}-{index + 1}"
        common = ["--zk", self.zk_hosts, "--root", self.root, "--port", str(port), "--session-timeout-ms", str(SESSION_TIMEOUT_MS)]
        if role == "bookie":
            arguments = ["bookie", "run", *common, "--journal-dir", str(directory / "journal"),
                         "--ledger-dir", str(directory / "ledgers")]
        else:
            arguments = ["broker", "run", *common, "--retention-check-interval", "1s"]
        return ManagedProcess(f"{role}-{index + 1}", [sys.executable, "-m", "quire", *arguments], directory / f"{role}.log",
                              port=port)

    async def run(self) -> KillCycleReport:
        started = time.monotonic()
        try:
            for process in self.bookies:
                process.start()
            for process in self.bookies:
                await process.wait_serving()
            for process in self.brokers:
                process.start()
            for process in self.brokers:
                await process.wait_serving()
            await self._produce_under_faults()
            consumed = await self._consume_all()
        finally:
            for process in self.brokers + self.bookies:
                process.kill()
        return self._report(consumed, time.monotonic() - started)

    async def _produce_under_faults(self) -> None:
        from broker.client import Client

        async with Client.connect(self.zk_hosts, self.root) as client:
            producer = await client.create_producer(self.topic, producer_id="kill-cycles")
            async with trio.open_nursery() as nursery:
                done = trio.Event()
                nursery.start_soon(self._nemesis, done)
                limiter = trio.CapacityLimiter(self.window)
                number = 0
                while not done.is_set():
                    await limiter.acquire_on_behalf_of(number)
                    nursery.start_soon(self._send_until_acknowledged, producer, number, limiter)
                    number += 1
                    self.sent = number
                # Every message sent gets its acknowledgement or its deadline.
            await producer.close()

    async def _send_until_acknowledged(self, producer, number: int, limiter: trio.CapacityLimiter) -> None:
        from broker.errors import BrokerError

        try:
            with trio.move_on_after(SEND_DEADLINE_S):
                while True:
                    try:
                        await producer.send(str(number).encode(), sequence_id=number)
                    except BrokerError:
                        await trio.sleep(0.2)  # sent again with the same sequence id: stored at most once
                        continue
                    self.acknowledged.add(number)
                    return
        finally:
            limiter.release_on_behalf_of(number)

    async def _nemesis(self, done: trio.Event) -> None:
        try:
            for cycle in range(self.cycles):
                await trio.sleep(self.rng.uniform(*self.interval_s))
                role = self.rng.choice(("bookie", "broker"))
                process = self.rng.choice(self.bookies if role == "bookie" else self.brokers)
                process.kill()
                self.kills[role] += 1
                await trio.sleep(self.rng.uniform(0.2, 2.0))
                process.start()
                await process.wait_serving()
                self.on_cycle(cycle + 1)
        finally:
            done.set()

    async def _consume_all(self) -> dict[int, set[int]]:
        """Number -> the offsets it is stored at, read by a new subscription from the start."""
        from broker.client import Client

        offsets: dict[int, set[int]] = {}
        async with Client.connect(self.zk_hosts, self.root) as client:
            consumer = await client.subscribe(self.topic, "check", initial_position="earliest", receiver_queue_size=5_000)
            received = 0
            while True:
                with trio.move_on_after(DRAIN_IDLE_S) as idle:
                    message = await consumer.receive()
                if idle.cancelled_caught:
                    break
                offsets.setdefault(int(message.data), set()).add(message.offset)
                received += 1
                if received % 1_000 == 0:
                    # The broker gives a consumer nothing more past its unacknowledged bound.
                    await consumer.acknowledge_cumulative(message)
        return offsets

    def _report(self, consumed: dict[int, set[int]], elapsed_s: float) -> KillCycleReport:
        return KillCycleReport(
            cycles=sum(self.kills.values()),
            kills=dict(self.kills),
            sent=self.sent,
            acknowledged=len(self.acknowledged),
            consumed=len(consumed),
            lost=sorted(number for number in self.acknowledged if number not in consumed),
            duplicated=sorted(number for number, stored in consumed.items() if len(stored) > 1),
            elapsed_s=elapsed_s,
        )


async def run_kill_cycles(work_dir: Path, zk_hosts: str, *, cycles: int, seed: int = 0, **options) -> KillCycleReport:
    return await KillCycles(work_dir, zk_hosts, cycles=cycles, seed=seed, **options).run()


__all__ = ["KillCycleReport", "KillCycles", "run_kill_cycles"]
