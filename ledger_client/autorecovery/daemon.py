"""The auto-recovery daemon: a ledger client of its own with an auditor
candidate and a replication worker, as `quire autorecovery run` runs it and
`quire bookie run` embeds it (BookKeeper's AutoRecoveryMain). It reconnects
and starts over, with backoff, after anything goes wrong, so that a bookie
that embeds it keeps serving whatever happens to auto-recovery."""

from __future__ import annotations

import logging
import os
import random
import socket

import trio

from ledger_client.autorecovery.auditor import Auditor
from security.credentials import NO_CREDENTIALS, ClientCredentials
from ledger_client.autorecovery.config import AutoRecoveryConfig
from ledger_client.autorecovery.replication_worker import ReplicationWorker
from ledger_client.autorecovery.waits import jittered
from ledger_client.bookkeeper import BookKeeper

log = logging.getLogger(__name__)
RESTART_DELAY_S_INITIAL = 1.0
RESTART_DELAY_S_MAX = 60.0


def default_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


class AutoRecoveryDaemon:
    """The parts running over one client session (for status and tests)."""

    def __init__(self, bookkeeper: BookKeeper, config: AutoRecoveryConfig, name: str, rng: random.Random) -> None:
        self.auditor = Auditor(bookkeeper, config, name) if config.auditor else None
        self.worker = ReplicationWorker(bookkeeper, config, name, rng=rng) if config.worker else None

    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            if self.auditor is not None:
                nursery.start_soon(self.auditor.run)
            if self.worker is not None:
                nursery.start_soon(self.worker.run)


async def run_autorecovery(
    zk_hosts: str,
    root: str,
    config: AutoRecoveryConfig,
    *,
    name: str | None = None,
    session_timeout_ms: int = 10_000,
    rng: random.Random | None = None,
    credentials: ClientCredentials = NO_CREDENTIALS,
    task_status=trio.TASK_STATUS_IGNORED,
) -> None:
    """Run auto-recovery until cancelled. `task_status.started()` once it
    is first connected to ZooKeeper. `credentials`: what it shows bookies."""
    name = name or default_name()
    rng = rng or random.Random()
    delay_s = RESTART_DELAY_S_INITIAL
    started = False
    while True:
        try:
            async with BookKeeper.connect(zk_hosts, root, session_timeout_ms=session_timeout_ms, rng=rng,
                                          credentials=credentials) as bookkeeper:
                daemon = AutoRecoveryDaemon(bookkeeper, config, name, rng)
                if not started:
                    started = True
                    task_status.started(daemon)
                log.info("auto-recovery %s running (auditor candidate: %s, worker: %s)", name, config.auditor, config.worker)
                delay_s = RESTART_DELAY_S_INITIAL
                await daemon.run()
        except Exception as error:  # noqa: BLE001  (ExceptionGroups too; never trio.Cancelled)
            # Whatever broke (ZooKeeper gone for good, a bug), the bookie that
            # embeds this must keep serving: log it and start over later.
            log.error("auto-recovery stopped (%r); restarting in about %.0fs", error, delay_s, exc_info=error)
        await trio.sleep(jittered(delay_s, rng))
        delay_s = min(delay_s * 2, RESTART_DELAY_S_MAX)


__all__ = ["AutoRecoveryDaemon", "default_name", "run_autorecovery"]
