"""What every simulated process shares: a name, whether it is up or paused,
an incarnation that a restart bumps, and timers that a crash cancels and a
pause (SIGSTOP) holds until the process runs again."""

from __future__ import annotations

from typing import Any, Callable

from sim.network import Network
from sim.world import World


class SimNode:
    def __init__(self, name: str, world: World, network: Network) -> None:
        self.name = name
        self.world = world
        self.network = network
        self.incarnation = 0
        self.up = False
        self.paused = False
        self._held_timers: list[tuple[Callable[..., Any], tuple]] = []
        network.add(self)

    # --- timers ---------------------------------------------------------------

    def after(self, delay_ms: float, callback: Callable[..., Any], *args: Any) -> None:
        """Run `callback(*args)` on this node after `delay_ms`, unless it
        crashed meanwhile; a paused node runs it once resumed."""
        self.world.after(delay_ms, self._timer, self.incarnation, callback, args)

    def _timer(self, incarnation: int, callback: Callable[..., Any], args: tuple) -> None:
        if not self.up or incarnation != self.incarnation:
            return
        if self.paused:
            self._held_timers.append((callback, args))
            return
        callback(*args)

    def send(self, destination: str, message: Any, *, faults: bool = True) -> None:
        self.network.send(self.name, destination, message, faults=faults)

    # --- faults ---------------------------------------------------------------------

    def start(self) -> None:
        """Bring the process up (first start or restart)."""
        self.incarnation += 1
        self.up = True
        self.paused = False
        self._held_timers = []

    def crash(self) -> None:
        """kill -9: memory is gone; subclasses drop what was not durable."""
        self.up = False
        self.paused = False
        self._held_timers = []
        self.network.crashed(self.name)

    def pause(self) -> None:
        self.paused = True

    def resume(self) -> None:
        if not self.paused:
            return
        self.paused = False
        held, self._held_timers = self._held_timers, []
        for callback, args in held:
            if self.up and not self.paused:
                callback(*args)
        self.network.resumed(self.name)

    # --- the network's calls ----------------------------------------------------------

    def deliver(self, source: str, message: Any) -> None:
        raise NotImplementedError

    def connection_lost(self, peer: str) -> None:
        pass
