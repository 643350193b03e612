"""Helpers shared by the test suites: free ports, waiting for a condition,
and ledger metadata to store."""

from __future__ import annotations

import inspect
import socket
import time
import tracemalloc
from typing import TYPE_CHECKING, Any, Callable, TypeVar

if TYPE_CHECKING:
    from ledger_client.metadata import LedgerMetadata

T = TypeVar("T")


def peak_bytes_of(call: Callable[[], Any]) -> int:
    """The most Python's allocator held while `call` ran (what a bomb would
    cost; protobuf's own memory is not Python's and is not seen)."""
    tracemalloc.start()
    try:
        call()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return peak


def cannot_run_here(reason: str) -> None:
    """Skip a test whose machinery (Docker, a Spark cluster, a tmpfs) this
    machine lacks; fail it under CI (CI=true), whose machine has them all:
    a test skipped there would prove nothing."""
    import os

    import pytest

    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason} (CI's machine must run this test)")
    pytest.skip(reason)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on at the time of the call."""
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """`count` different TCP ports on 127.0.0.1 that nothing listens on at
    the time of the call: bound all at once, so that the kernel cannot give
    the same port twice (two `free_port` calls in a row can)."""
    sockets = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def free_port_run(count: int, *, tries_max: int = 200) -> int:
    """The first of `count` consecutive TCP ports on 127.0.0.1 that nothing
    uses at the time of the call (a launcher that numbers its processes'
    ports from a base needs them all: the ports after one `free_port` gave
    may be the ephemeral ports of other connections). Chosen below the
    kernel's ephemeral range, where connections do not take ports."""
    import random

    rng = random.Random()
    for _ in range(tries_max):
        base = rng.randrange(20_000, 30_000 - count)
        sockets = []
        try:
            for port in range(base, base + count):
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sockets.append(sock)
                sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
    raise AssertionError(f"no run of {count} free ports found in {tries_max} tries")


def wait_until(condition: Callable[[], T], *, deadline_s: float, what: str, poll_s: float = 0.02) -> T:
    """Poll `condition` until it returns something truthy; fail the test with
    `what` once `deadline_s` has passed. Exceptions from `condition` count as
    "not yet" until the deadline, then are re-raised."""
    end = time.monotonic() + deadline_s
    while True:
        try:
            result = condition()
        except Exception:
            if time.monotonic() >= end:
                raise
            result = None
        if result:
            return result
        if time.monotonic() >= end:
            raise AssertionError(f"timed out after {deadline_s}s waiting for {what}")
        time.sleep(poll_s)


async def wait_until_async(condition: Callable[[], Any], *, deadline_s: float, what: str, poll_s: float = 0.01) -> Any:
    """`wait_until` for trio tests: `condition` may be a plain or an async
    function; polls it on trio's clock (virtual under an autojump clock)."""
    import trio

    with trio.move_on_after(deadline_s) as scope:
        while True:
            result = condition()
            if inspect.isawaitable(result):
                result = await result
            if result:
                return result
            await trio.sleep(poll_s)
    assert not scope.cancelled_caught, f"timed out after {deadline_s}s waiting for {what}"


def ledger_metadata_for(ledger_id: int) -> LedgerMetadata:
    """Valid metadata of an open ledger (E=3 on bookies b1..b3, WQ=AQ=2),
    shaped to be `LedgerStore.create`'s build function."""
    # Imported here: every suite imports this module, most without needing
    # the ledger client.
    from bookie.protocol.entry_format import DigestType
    from ledger_client.metadata import LedgerMetadata, password_hash

    return LedgerMetadata(
        ledger_id=ledger_id,
        ensemble_size=3,
        write_quorum=2,
        ack_quorum=2,
        ensembles=((0, ("b1", "b2", "b3")),),
        digest_type=DigestType.CRC32C,
        password_hash=password_hash(b"pw"),
        creation_time_ms=1_000,
    )


def raw_exchange(address: str, data: bytes, *, prefix: bytes = b"") -> None:
    """Send `prefix` (a handshake, say) then raw bytes on a fresh
    connection, then read until the server closes it or a short while passes."""
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.settimeout(0.3)
        try:
            if prefix:
                sock.sendall(prefix)
            sock.sendall(data)
            while sock.recv(65536):
                pass
        except (socket.timeout, ConnectionError):
            pass

