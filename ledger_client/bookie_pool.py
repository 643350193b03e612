"""Connections to bookies by id, shared by every ledger of one client: opened
on first use, each kept by a task in the pool's nursery, closed when the
pool ends. Requests are sent without waiting (the drivers of the pure cores
call this from synchronous code); answers, and failures, always come back
later through the callback, never from inside `send`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass, field
from typing import Callable

import trio

from bookie.protocol.wire import Request
from ledger_client.bookie_client import BookieClient, BookieConnectionError, BookieRefusedError, Callback, answer_add
from ledger_client.registry import BookieRegistry
from security.credentials import NO_CREDENTIALS, ClientCredentials

log = logging.getLogger(__name__)
REQUESTS_IN_FLIGHT_MAX = 100_000  # per bookie connection; callers bound their own work
CONNECTING_REQUESTS_MAX = 100_000  # queued while a connection is being opened
# After a failed connection attempt, requests to that bookie fail at once for
# this long instead of each trying to connect again.
RECONNECT_DELAY_S = 0.5
CONNECT_TIMEOUT_S = 5.0
# A client closing waits this long at most for its adds' last copies.
CLOSE_DRAIN_S = 1.0
DRAIN_POLL_S = 0.002


@dataclass(eq=False)
class _Connection:
    bookie_id: str
    client: BookieClient | None = None
    waiting: list[tuple[Callable[[BookieClient], None], Callback]] = field(default_factory=list)
    adds_waiting: int = 0  # of `waiting`, the adds (the rest wait to read or call)


class BookiePool:
    def __init__(self, registry: BookieRegistry, nursery: trio.Nursery, *, peer_name: str = "quire-ledger-client",
                 credentials: ClientCredentials = NO_CREDENTIALS) -> None:
        self.registry = registry
        self.credentials = credentials
        self._nursery = nursery
        self.peer_name = peer_name
        self._connections: dict[str, _Connection] = {}
        self._down_until: dict[str, float] = {}
        self._closed = False

    # --- sending --------------------------------------------------------------------

    def send_add_tail(self, bookie_id: str, tail: bytes, callback: Callback, ledger_id: int, entry_id: int) -> None:
        """The add of entry `entry_id` of `ledger_id`, encoded once for all its
        bookies (`encode_add_tail`); the answer, or a BookieConnectionError,
        comes back through `callback` (see BookieClient.submit_add_tail_nowait)."""
        connection = self._connections.get(bookie_id)
        if connection is not None and connection.client is not None and not self._closed:
            # The hot path: connected, no closure to build.
            try:
                connection.client.submit_add_tail_nowait(tail, callback, ledger_id, entry_id)
                return
            except (BookieConnectionError, trio.WouldBlock, ValueError):
                pass  # _dispatch reports it (later, through the callback)
        self._send_add_tail_waiting(bookie_id, tail, callback, ledger_id, entry_id)

    def _send_add_tail_waiting(self, bookie_id: str, tail: bytes, callback: Callback, ledger_id: int, entry_id: int) -> None:
        # Apart from `send_add_tail`: the closure's variables are cells,
        # made on every call of the function that holds it (four objects for
        # the garbage collector per send, where no closure is needed).
        self._dispatch(bookie_id, lambda client: client.submit_add_tail_nowait(tail, callback, ledger_id, entry_id), callback,
                       add=True)

    async def call(self, bookie_id: str, request_factory: Callable[[int], Request]):
        """Send one request and wait for its answer (or raise
        BookieConnectionError). Cancelled, it forgets the request and frees
        its slot (a long poll given up on holds nothing)."""
        client = await self._connected(bookie_id)
        return await client.call(request_factory)

    async def _connected(self, bookie_id: str) -> BookieClient:
        if self._closed:
            raise BookieConnectionError(f"the client is closed (bookie {bookie_id})")
        connection = self._connections.get(bookie_id)
        if connection is not None and connection.client is not None:
            return connection.client
        # Queue a no-op behind the connection attempt and wait for its outcome.
        ready = trio.Event()
        outcome: list = []

        def on_connected(client: BookieClient) -> None:
            outcome.append(client)
            ready.set()

        def on_failure(error) -> None:
            outcome.append(error)
            ready.set()

        self._dispatch(bookie_id, on_connected, on_failure)
        await ready.wait()
        if isinstance(outcome[0], BookieConnectionError):
            raise outcome[0]
        return outcome[0]

    def _dispatch(self, bookie_id: str, submit: Callable[[BookieClient], None], callback: Callback, *, add: bool = False) -> None:
        if self._closed:
            self._fail_later(bookie_id, callback, BookieConnectionError(f"the client is closed (bookie {bookie_id})"))
            return
        connection = self._connections.get(bookie_id)
        if connection is None:
            if trio.current_time() < self._down_until.get(bookie_id, 0.0):
                self._fail_later(bookie_id, callback, BookieConnectionError(f"bookie {bookie_id} is unreachable (retrying shortly)"))
                return
            connection = self._connections[bookie_id] = _Connection(bookie_id)
            self._nursery.start_soon(self._run_connection, connection)
        if connection.client is None:
            if len(connection.waiting) >= CONNECTING_REQUESTS_MAX:
                self._fail_later(bookie_id, callback, BookieConnectionError(f"too many requests wait for bookie {bookie_id}"))
            else:
                connection.waiting.append((submit, callback))
                connection.adds_waiting += add
            return
        self._submit(connection.client, submit, callback)

    def _submit(self, client: BookieClient, submit: Callable[[BookieClient], None], callback: Callback) -> None:
        try:
            submit(client)
        except BookieConnectionError as error:
            self._fail_later(client.bookie_id, callback, error)
        except trio.WouldBlock:
            self._fail_later(client.bookie_id, callback, BookieConnectionError(f"bookie {client.bookie_id}: {REQUESTS_IN_FLIGHT_MAX} requests in flight"))
        except ValueError as error:  # larger than the bookie's frame bound
            self._fail_later(client.bookie_id, callback, BookieConnectionError(f"bookie {client.bookie_id} refused a request: {error}"))

    def _fail_later(self, bookie_id: str, callback: Callback, error: BookieConnectionError) -> None:
        async def fail() -> None:
            answer_add(callback, bookie_id, error)

        self._nursery.start_soon(fail)

    # --- connections -------------------------------------------------------------------

    async def _run_connection(self, connection: _Connection) -> None:
        bookie_id = connection.bookie_id
        address = self.registry.address(bookie_id)
        failure: BookieConnectionError | None = None
        # TLS where the bookie's registration says it serves TLS: a cluster
        # may move to TLS one bookie at a time.
        credentials = self.credentials
        if not self.registry.serves_tls(bookie_id):
            credentials = dataclasses.replace(credentials, tls_context=None)
        try:
            if credentials.tls_context is None and self.registry.serves_tls(bookie_id):
                raise BookieRefusedError(f"bookie {bookie_id} serves TLS only, and this client has no TLS settings "
                                            f"(the CA that signed the bookies' certificates: --tls-trust-certs-file)")
            # The deadline covers connecting only: lifted once connected.
            with trio.CancelScope(deadline=trio.current_time() + CONNECT_TIMEOUT_S) as scope:
                async with BookieClient.connect(
                    address, peer_name=self.peer_name, requests_in_flight_max=REQUESTS_IN_FLIGHT_MAX,
                    expected_bookie_id=bookie_id, credentials=credentials,
                ) as client:
                    scope.deadline = math.inf
                    connection.client = client
                    self._submit_waiting(client, connection)
                    reason = await client.wait_closed()
                    log.info("connection to bookie %s closed: %s", bookie_id, reason)
            if scope.cancelled_caught:
                failure = BookieConnectionError(f"connecting to bookie {bookie_id} at {address} timed out")
        except BookieConnectionError as error:
            failure = error
        except OSError as error:
            failure = BookieConnectionError(f"cannot connect to bookie {bookie_id} at {address}: {error}")
        finally:
            if self._connections.get(bookie_id) is connection:
                del self._connections[bookie_id]
        if failure is not None and connection.client is None:
            # A refusal is the operator's to fix (a token, a role, TLS): said louder than a bookie that is down.
            log.log(logging.WARNING if isinstance(failure, BookieRefusedError) else logging.INFO, "%s", failure)
            self._down_until[bookie_id] = trio.current_time() + RECONNECT_DELAY_S
        waiting, connection.waiting, connection.adds_waiting = connection.waiting, [], 0
        for _, callback in waiting:
            answer_add(callback, bookie_id, failure or BookieConnectionError(f"connection to bookie {bookie_id} closed"))

    def _submit_waiting(self, client: BookieClient, connection: _Connection) -> None:
        # Apart from `_run_connection`, whose frame lives as long as the
        # connection: a local there would keep every request that waited,
        # entry bytes and all, for that long.
        waiting, connection.waiting, connection.adds_waiting = connection.waiting, [], 0
        for submit, callback in waiting:
            self._submit(client, submit, callback)

    async def drain_adds(self, deadline_s: float = CLOSE_DRAIN_S) -> None:
        """Wait, at most `deadline_s`, until every bookie still connected (or
        being connected to) has answered the adds sent to it. An add
        completes at the ack quorum; a client closed right after its last
        add would otherwise drop the copies still on their way to the
        slower bookies of its write sets, leaving them to auto-recovery."""
        with trio.move_on_after(deadline_s):
            while any(self._adds_unanswered(connection) for connection in self._connections.values()):
                await trio.sleep(DRAIN_POLL_S)

    @staticmethod
    def _adds_unanswered(connection: _Connection) -> bool:
        client = connection.client
        if client is None:
            return connection.adds_waiting > 0
        return not client.closed and client.adds_unanswered()

    def close(self) -> None:
        """Refuse new requests; the owner cancels the nursery to close
        the connections."""
        self._closed = True


__all__ = ["BookiePool"]
