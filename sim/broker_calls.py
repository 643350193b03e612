"""What the simulated broker's drivers share: the partition's log entries as
the checkers see them, how they reach a client (its connection and its
handle there), and their metadata calls for
versioned records (as `TopicStore._write_versioned` does them with trio);
and the narrow views a partition and a subscription have of their broker
and partition (the simulated broker and partition are those)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from coordination.store import NoNodeError
from sim.broker_links import Connection
from sim.world import World

@dataclass(frozen=True, slots=True)
class LogEntry:
    """An entry of the partition: a producer's batch at (ledger, entry)."""

    ledger_id: int
    entry_id: int  # within that ledger
    producer_id: str
    sequence_ids: tuple[int, ...]
    keys: tuple[str | None, ...]
    first_offset: int

    @property
    def message_count(self) -> int:
        return len(self.sequence_ids)

    @property
    def last_offset(self) -> int:
        return self.first_offset + len(self.sequence_ids) - 1

    @property
    def last_sequence_id(self) -> int:
        return self.sequence_ids[-1]


Respond = Callable[..., None]


@dataclass(slots=True)
class ProducerLink:
    connection: Connection
    handle: int
    producer_id: str


@dataclass(slots=True)
class ConsumerLink:
    connection: Connection
    handle: int
    consumer_id: int
    name: str


def write_versioned(path: str, record: dict, expected_version: int | None,
                    on_written: Callable[[], None] = lambda: None):
    """`TopicStore._write_versioned` as a metadata call: create when there
    is no version yet, else compare-and-set; returns the new version.
    `on_written` runs where the write takes effect (for the checkers)."""
    data = json.dumps(record, separators=(",", ":")).encode()

    def write(store) -> int:
        if expected_version is None:
            store.create(path, data, make_parents=True)
            version = 0
        else:
            version = store.set(path, data, expected_version).version
        on_written()
        return version

    return write


def read_versioned(path: str):
    def read(store) -> tuple[dict, int] | None:
        try:
            data, stat = store.get(path)
        except NoNodeError:
            return None
        return json.loads(data), stat.version

    return read


class BrokerView(Protocol):
    """What a partition and its subscription need of their simulated broker."""

    world: World
    checker: Any  # sim.broker_checker.BrokerChecker
    parameters: Any  # sim.broker_parameters.BrokerSimParameters
    log: Any  # the partition's storage
    publish_core_class: type
    subscription_core_class: type
    subscription_class: type

    def after(self, delay_ms: float, callback: Callable[..., Any], *args: Any) -> None: ...

    def zk_call(self, function: Callable[[Any], Any], on_done: Callable[[Any, Exception | None], None], description: str) -> None: ...

    def send_to(self, connection: Connection, message: Any) -> None: ...

    def holds_lease(self, session_id: int) -> bool: ...

    def owns_now(self, session_id: int) -> bool: ...

    def partition_fenced(self, partition: Any) -> None: ...


class PartitionView(Protocol):
    """What a subscription needs of its simulated partition."""

    broker: BrokerView
    instance: str
    session_id: int
    confirmed_offset: int
    entries: list

    def entry_index_of(self, offset: int) -> int: ...

    def fence(self, reason: str) -> None: ...
