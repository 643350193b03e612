"""Real bookie processes for integration tests: started with the `quire`
command line on ports chosen at run time, killed -9 or stopped on demand, and
always stopped by the fixture, even when the test fails.

Tests import the `bookies` fixture from here."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import trio

from ledger_client.bookie_client import BookieClient, BookieConnectionError
from security.credentials import NO_CREDENTIALS, ClientCredentials
from tests.integration.processes import QuireProcess, print_logs
from tests.support import free_port

START_DEADLINE_S = 30.0


@dataclass
class BookieProcess(QuireProcess):
    role = "bookie"
    # What the readiness probe shows a bookie that authenticates its clients.
    credentials: ClientCredentials = NO_CREDENTIALS

    @property
    def journal_dir(self) -> Path:
        return self.directory / "journal"

    @property
    def ledger_dir(self) -> Path:
        return self.directory / "ledgers"

    def arguments(self) -> list[str]:
        return [
            "bookie", "run",
            "--zk", self.zk_hosts, "--root", self.root, "--port", str(self.port),
            "--journal-dir", str(self.journal_dir), "--ledger-dir", str(self.ledger_dir),
            "--session-timeout-ms", "4000",
        ]

    async def wait_serving(self, deadline_s: float = START_DEADLINE_S) -> dict:
        """Wait until the bookie answers GET_INFO; return its info."""
        async def info() -> dict | None:
            try:
                with trio.fail_after(2):
                    async with BookieClient.connect(self.address, credentials=self.credentials) as client:
                        return (await client.get_info()).info
            except (BookieConnectionError, trio.TooSlowError):
                return None

        return await self.wait_until_probe_answers(info, deadline_s)

    async def started(self) -> "BookieProcess":
        self.start()
        await self.wait_serving()
        return self

    async def restarted(self) -> "BookieProcess":
        self.kill()
        return await self.started()

    def run_until_exit(self, deadline_s: float = START_DEADLINE_S) -> tuple[int, str]:
        """Start and wait for the process to exit by itself (it is expected
        to refuse to start); return its exit code and the log of this run."""
        before = self.log_path.stat().st_size if self.log_path.exists() else 0
        self.start()
        try:
            code = self.process.wait(timeout=deadline_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"bookie kept running instead of refusing to start:\n{self.log_tail()}")
        return code, self.log_path.read_bytes()[before:].decode(errors="replace")

    def flip_stored_byte(self, ledger_id: int, entry_id: int, *, from_end: int = 100) -> None:
        """Corrupt the stored copy of an entry in its entry log (the bookie
        must be stopped, after a clean stop that checkpointed it there)."""
        from bookie.entry_index import RocksEntryIndex
        from bookie.entry_log import entry_log_name

        assert not self.running, "stop the bookie before corrupting its files"
        index = RocksEntryIndex(self.ledger_dir / "index")
        try:
            location = index.get(ledger_id, entry_id)
        finally:
            index.close()
        assert location is not None, f"entry {ledger_id}/{entry_id} is not in the entry logs"
        log_path = self.ledger_dir / "entrylogs" / entry_log_name(location.log_id)
        with open(log_path, "r+b") as log_file:
            log_file.seek(location.offset + location.size - from_end)
            byte = log_file.read(1)
            log_file.seek(-1, 1)
            log_file.write(bytes([byte[0] ^ 0x10]))


def bookie_takes_an_add(address: str, ledger_id: int) -> None:
    """One add of a one-entry ledger straight to the bookie at `address`,
    answered OK within 10 s (for tests that check a bookie still serves)."""
    from bookie.protocol.entry_format import DigestManager, DigestType, master_key

    async def add() -> None:
        digest = DigestManager(ledger_id, DigestType.CRC32C, b"check")
        with trio.fail_after(10):
            async with BookieClient.connect(address) as client:
                response = await client.add(digest.encode(0, -1, 5, b"check"), master_key(b"check"))
                assert response.status == 0, response

    trio.run(add)


@dataclass
class BookieFactory:
    zk_hosts: str
    root: str
    base: Path
    created: list[BookieProcess] = field(default_factory=list)

    def new(self, *options: str, port: int | None = None) -> BookieProcess:
        index = len(self.created) + 1
        bookie = BookieProcess(self.zk_hosts, self.root, self.base / f"bookie-{index}", port or free_port(), list(options))
        self.created.append(bookie)
        return bookie

    async def started(self, *options: str) -> BookieProcess:
        return await self.new(*options).started()

    def stop_all(self) -> None:
        for bookie in self.created:
            if bookie.running:
                bookie.kill()


@pytest.fixture
def bookies(zk_hosts, zk_root, tmp_path):
    factory = BookieFactory(zk_hosts, zk_root, tmp_path)
    try:
        yield factory
    finally:
        factory.stop_all()
        print_logs(factory.created)
