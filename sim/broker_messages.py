"""What simulated broker clients and brokers say to each other: the broker
protocol of `broker/protocol.py` cut down to what one partition needs
(producers, one durable subscription), as plain records carried by
`sim.broker_links` connections."""

from __future__ import annotations

from dataclasses import dataclass

from broker.errors import BrokerStatus

PARTITION = "sim-topic"
SUBSCRIPTION = "sim-subscription"


# --- client -> broker -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ProducerOpen:
    request_id: int
    handle: int
    producer_id: str


@dataclass(frozen=True, slots=True)
class Send:
    handle: int
    producer_id: str
    sequence_ids: tuple[int, ...]  # increasing; the batch is judged by the last
    keys: tuple[str | None, ...]

    @property
    def first_sequence_id(self) -> int:
        return self.sequence_ids[0]

    @property
    def last_sequence_id(self) -> int:
        return self.sequence_ids[-1]


@dataclass(frozen=True, slots=True)
class Subscribe:
    request_id: int
    handle: int
    subscription_type: str
    consumer_name: str
    priority: int


@dataclass(frozen=True, slots=True)
class Flow:
    handle: int
    permits: int


@dataclass(frozen=True, slots=True)
class Ack:
    request_id: int
    handle: int
    cumulative: bool
    offsets: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Redeliver:
    handle: int
    offsets: tuple[int, ...]


# --- broker -> client -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Response:
    request_id: int
    status: BrokerStatus
    detail: str = ""
    last_sequence_id: int = -1  # ProducerOpen: the last persisted for the producer
    owner: str | None = None  # NOT_OWNER: the broker that owns the partition, if known


@dataclass(frozen=True, slots=True)
class SendReceipt:
    handle: int
    last_sequence_id: int
    status: BrokerStatus
    first_offset: int = -1
    detail: str = ""


@dataclass(frozen=True, slots=True)
class Deliver:
    handle: int
    offsets: tuple[int, ...]
    keys: tuple[str | None, ...]
    redelivery_count: int


@dataclass(frozen=True, slots=True)
class Closed:
    """The broker dropped this producer or consumer: look the partition up again."""

    handle: int
    reason: str
