"""The broker's dispatch lease in trio time: `LeaseCore`'s rule (of one
session at a time), with an event that subscriptions wait on while it has
lapsed."""

from __future__ import annotations

import trio

from broker.ownership_core import LeaseCore


class Lease:
    def __init__(self, session_timeout_ms: float = 10_000) -> None:
        self.core = LeaseCore(session_timeout_ms)
        self._renewed = trio.Event()

    def valid(self, session_id: int) -> bool:
        """Whether a partition owned by `session_id` may deliver now."""
        return self.core.valid(trio.current_time() * 1000, session_id)

    def renew(self, sent_at_s: float, session_id: int) -> None:
        """A ZooKeeper request sent at `sent_at_s` (trio time) in
        `session_id` was answered in that session."""
        self.core.renewed(sent_at_s * 1000, trio.current_time() * 1000, session_id)
        renewed, self._renewed = self._renewed, trio.Event()
        renewed.set()

    async def wait_valid(self, session_id: int) -> None:
        while not self.valid(session_id):
            await self._renewed.wait()


__all__ = ["Lease"]
