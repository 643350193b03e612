"""What the simulated clients share: requests to bookies with request ids and
a timeout (no answer in time, or a broken connection, reports None), a
ZooKeeper link, the registry of writable bookies, and a core's timer."""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping

from bookie.protocol.wire import AddBatchRequest, Response
from coordination.store import BadVersionError, MetadataError
from ledger_client.errors import BKError
from ledger_client.ledger_store import LedgerStore
from ledger_client.metadata import LedgerMetadata
from ledger_client.write_core import SendAdd, WriteMetadata
from sim.bookie_node import LAYOUT
from sim.checker import SimChecker
from sim.metadata_node import MetadataLink, MetadataReply, ZkNode
from sim.network import Network
from sim.node import SimNode
from sim.world import World

OnResponse = Callable[[Response | None], None]


class BookieCalls:
    """A simulated process's requests to bookies and its ledger metadata
    calls, for any node that writes or reads ledgers (a client, a broker).
    The node provides `world`, `after`, `send`, `metadata` (its ZooKeeper
    link), `zk`, `ledger_checker` (the ledger simulation's checker) and
    `request_timeout_ms`, and calls `_reset_bookie_calls` when it starts."""

    # Request ids go on growing across restarts, so that an answer to a
    # request of an earlier incarnation matches none.
    _next_request_id = 1

    def _reset_bookie_calls(self) -> None:
        """A (re)start: nothing is pending."""
        self._requests: dict[int, tuple[str, OnResponse]] = {}
        self._core_timer_ms: float | None = None

    # --- bookies --------------------------------------------------------------------

    def call(self, bookie_id: str, make_request: Callable[[int], Any], on_response: OnResponse, *,
             timeout_ms: float | None = None) -> None:
        """Send a request; `on_response` gets the answer, or None on a
        broken connection or after `timeout_ms` (math.inf: wait for ever, as
        the real drivers do for adds, whose timeout is the write core's)."""
        request_id = self._next_request_id
        self._next_request_id += 1
        self._requests[request_id] = (bookie_id, on_response)
        self.send(bookie_id, make_request(request_id))
        timeout_ms = self.request_timeout_ms if timeout_ms is None else timeout_ms
        if timeout_ms != math.inf:
            self.after(timeout_ms, self._timed_out, request_id)

    def send_add_batches(self, sends: list[SendAdd], flags: int, master_key: bytes,
                         on_add: Callable[[str, int, Any], None]) -> None:
        """A step's adds, one ADD_BATCH per bookie, as BookieClient sends the
        adds that queue up behind others. `on_add(bookie_id, entry_id,
        status)` hears each add's status (None: the connection broke); adds
        wait for ever, their timeout is the core's (tick)."""
        by_bookie: dict[str, list[SendAdd]] = {}
        for send in sends:
            by_bookie.setdefault(send.bookie_id, []).append(send)
        for bookie_id, batch in by_bookie.items():
            entry_ids = [send.entry_id for send in batch]
            adds = [field for send in batch for field in (flags, master_key, send.entry)]

            def answered(response: Any, bookie_id: str = bookie_id, entry_ids: list[int] = entry_ids) -> None:
                statuses = [None] * len(entry_ids) if response is None else response.statuses
                assert len(statuses) == len(entry_ids), f"an answer for {len(statuses)} adds to a batch of {len(entry_ids)}"
                for entry_id, status in zip(entry_ids, statuses):
                    on_add(bookie_id, entry_id, status)

            self.call(bookie_id, lambda request_id, adds=adds: AddBatchRequest(request_id, adds), answered, timeout_ms=math.inf)

    def _timed_out(self, request_id: int) -> None:
        pending = self._requests.pop(request_id, None)
        if pending is not None:
            pending[1](None)

    def bookie_answered(self, source: str, message: Any) -> None:
        """An answer from a bookie (late or duplicate ones are dropped)."""
        pending = self._requests.get(message.request_id)
        if pending is None or pending[0] != source:
            return  # late (timed out) or a duplicate
        del self._requests[message.request_id]
        pending[1](message)

    def connection_lost(self, peer: str) -> None:
        """Requests to a crashed bookie fail at once, as on a TCP reset."""
        lost = [request_id for request_id, (bookie_id, _) in self._requests.items() if bookie_id == peer]
        for request_id in lost:
            _, on_response = self._requests.pop(request_id)
            on_response(None)

    def writable_bookies(self) -> Mapping[str, str | None]:
        """The registry as a watcher would see it (read directly: a
        simplification, the registry's own watches are tested elsewhere)."""
        return self.zk.registered(LAYOUT.writable_bookies)

    # --- metadata ------------------------------------------------------------------------

    def write_metadata(self, action: WriteMetadata, on_result: Callable[[str, Any], None]) -> None:
        """Compare-and-set as `carry_out_metadata_write` does: on a version
        conflict read the current value; report ("written", version),
        ("conflict", (metadata, version)) or ("failed", BKError)."""
        metadata, expected_version = action.metadata, action.expected_version

        def written(result: Any, error: Exception | None) -> None:
            if error is None:
                on_result("written", result)
            elif isinstance(error, BadVersionError):
                self.metadata.call(
                    lambda store: LedgerStore(store).read(metadata.ledger_id),
                    reread, f"read ledger {metadata.ledger_id}",
                )
            else:
                on_result("failed", as_bk_error(error))

        def reread(result: Any, error: Exception | None) -> None:
            if error is None:
                on_result("conflict", result)
            else:
                on_result("failed", as_bk_error(error))

        checker = self.ledger_checker

        def write(store) -> int:
            version = LedgerStore(store).write(metadata, expected_version)
            checker.metadata_written(metadata)  # the linearization point
            return version

        self.metadata.call(write, written, f"write ledger {metadata.ledger_id} {metadata.state.value} v{expected_version}")

    def read_metadata(self, ledger_id: int, on_done: Callable[[tuple[LedgerMetadata, int] | None], None]) -> None:
        self.metadata.call(
            lambda store: LedgerStore(store).read(ledger_id),
            lambda result, error: on_done(result if error is None else None),
            f"read ledger {ledger_id}",
        )

    # --- a core's timer ------------------------------------------------------------------

    def arm_core_timer(self, deadline_ms: float | None, fire: Callable[[], None]) -> None:
        """Call `fire` at the core's next deadline (one timer at a time)."""
        if deadline_ms is None or (self._core_timer_ms is not None and self._core_timer_ms <= deadline_ms):
            return
        self._core_timer_ms = deadline_ms
        self.after(max(0.0, deadline_ms - self.world.now_ms), self._core_timer, deadline_ms, fire)

    def _core_timer(self, deadline_ms: float, fire: Callable[[], None]) -> None:
        if self._core_timer_ms != deadline_ms:
            return
        self._core_timer_ms = None
        fire()


class SimClient(BookieCalls, SimNode):
    def __init__(self, name: str, world: World, network: Network, zk: ZkNode, checker: SimChecker, *,
                 session_timeout_ms: int, request_timeout_ms: float) -> None:
        super().__init__(name, world, network)
        self.zk = zk
        self.checker = checker
        self.request_timeout_ms = request_timeout_ms
        self.metadata = MetadataLink(self, zk, session_timeout_ms=session_timeout_ms, call_timeout_ms=request_timeout_ms)
        self._reset_bookie_calls()

    def start(self) -> None:
        super().start()
        self._reset_bookie_calls()
        self.metadata.start()

    @property
    def ledger_checker(self) -> SimChecker:
        return self.checker

    def deliver(self, source: str, message: Any) -> None:
        if isinstance(message, MetadataReply):
            self.metadata.reply(message)
        else:
            self.bookie_answered(source, message)


def answer_metadata_write(core, outcome: str, value: Any, now_ms: float) -> list:
    """Tell a WriteCore or RecoveryCore how its compare-and-set went."""
    if outcome == "written":
        return core.metadata_written(value, now_ms)
    if outcome == "conflict":
        return core.metadata_conflict(value[0], value[1], now_ms)
    return core.metadata_failed(value)


def as_bk_error(error: Exception) -> BKError:
    if isinstance(error, BKError):
        return error
    if isinstance(error, MetadataError):
        return BKError(f"metadata store failed: {error}")
    return BKError(str(error))
