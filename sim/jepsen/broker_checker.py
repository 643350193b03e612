"""The checker of a broker run's history (`quire jepsen --broker`): finds
messages acknowledged to their producer and then lost, stored twice or
delivered again after their acknowledgement was confirmed, first deliveries
out of order, and deliveries that disagree with what was produced. Pure: it
reads the operations and nothing else.

A message is named by its producer, partition and sequence id (producers
deduplicate: each sequence id is stored once). The operations it reads:
`produce` (invoke: producer, partition, seq, key, payload; ok: the message id
[ledger, entry, batch index] and offset, or duplicate=true when the broker
said an earlier send had stored it), `subscribe` (a consumer session of a
subscription: invoke: subscription, type, session), `receive` (ok: the
message, its partition, offset and id, and `waited`: whether the session's
receive queue was empty when the receive began), `ack` (invoke: subscription,
session, partition, offset, cumulative; ok once the broker made it durable)
and `drain` (ok: whether the final drain of a subscription reached the end).
Every client operation carries an op_id, unique within its process."""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from sim.jepsen.history import (
    HistoryFormatError,
    Operation,
    OperationPair,
    integer_value,
    pair_operations,
)
from sim.jepsen.verdict import ANOMALY_KINDS, AnomalyText, CheckResultBase, count_faults

SUBSCRIPTION_TYPES = ("exclusive", "failover", "shared", "key_shared")
# First deliveries come in offset order per partition for these types, and
# per key for key_shared; shared promises no order at all.
ORDERED_BY_PARTITION = ("exclusive", "failover")
ORDERED_BY_KEY = ("key_shared",)

Identity = tuple[str, int, int]  # (producer, partition, sequence id)
Position = tuple[int, int]  # (partition, offset)


@dataclass(frozen=True, slots=True)
class BrokerAnomaly(AnomalyText):
    PLACES = (("subscription", "subscription {}"), ("partition", "partition {}"), ("offset", "offset {}"),
              ("payload", "message {!r}"))

    kind: str
    detail: str
    subscription: str | None = None
    partition: int | None = None
    offset: int | None = None
    payload: str | None = None
    operation_indexes: tuple[int, ...] = ()  # the records that show it


@dataclass(slots=True)
class SubscriptionSummary:
    type: str
    sessions: int = 0
    deliveries: int = 0
    redeliveries: int = 0  # deliveries of a message the subscription had delivered before
    messages: int = 0  # distinct messages delivered
    acks_ok: int = 0  # acknowledgements confirmed durable
    cumulative_acks_ok: int = 0
    drained: bool | None = None  # None: no drain recorded; False: its deadline passed first

    def describe(self) -> str:
        drain = {None: "not drained", False: "drain incomplete", True: "drained"}[self.drained]
        return (f"{self.sessions} sessions, {self.deliveries} deliveries ({self.redeliveries} redeliveries) of "
                f"{self.messages} messages, {self.acks_ok} acknowledgements confirmed ({self.cumulative_acks_ok} cumulative), "
                f"{drain}")


@dataclass(slots=True)
class BrokerCheckResult(CheckResultBase[BrokerAnomaly]):
    produces_invoked: int = 0  # distinct messages
    produce_attempts: int = 0  # sends, resends by a restarted producer included
    produces_ok: int = 0  # messages acknowledged to their producer
    produces_info: int = 0  # messages never acknowledged (indeterminate)
    produces_info_stored: int = 0  # ... of them found stored
    resends_persisted_before: int = 0  # sends answered "an earlier send stored it"
    messages_stored: int = 0  # distinct messages seen stored (an id from the broker, or delivered)
    subscriptions: dict[str, SubscriptionSummary] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        """Every subscription was drained to the end, so that every stored
        message was checked against every subscription."""
        return (not self.unseen and bool(self.subscriptions)
                and all(summary.drained for summary in self.subscriptions.values()))

    def count_lines(self) -> list[str]:
        lines = [
            f"messages: {self.produces_invoked} produced ({self.produce_attempts} sends), {self.produces_ok} acknowledged, "
            f"{self.produces_info} indeterminate ({self.produces_info_stored} of them stored), "
            f"{self.resends_persisted_before} sends answered as stored before; {self.messages_stored} stored",
        ]
        for name, summary in sorted(self.subscriptions.items()):
            lines.append(f"subscription {name} ({summary.type}): {summary.describe()}")
        lines.append(f"faults: {self.faults_text()}")
        return lines


@dataclass(slots=True)
class _Message:
    payload: str
    key: str | None
    invoke_index: int
    attempts: int = 0
    ok_index: int | None = None  # the first acknowledgement to its producer
    answered_stored_before: bool = False  # an acknowledgement said an earlier send stored it
    positions: dict[Position, int] = field(default_factory=dict)  # where it is stored -> the record showing it
    delivered_to: set[str] = field(default_factory=set)


@dataclass(frozen=True, slots=True)
class _Session:
    subscription: str
    type: str
    start_ms: float  # when it subscribed: anything acknowledged before is never delivered to it
    index: int


@dataclass(frozen=True, slots=True)
class _Delivery:
    index: int
    invoke_ms: float
    subscription: str
    session: str
    identity: Identity
    partition: int
    offset: int
    key: str | None
    payload: str


class _AckTimes:
    """When the acknowledgement of each offset of a partition was first
    confirmed, individually (that offset) or cumulatively (it and below)."""

    def __init__(self) -> None:
        self.individual: dict[int, tuple[float, int]] = {}  # offset -> (time, operation index)
        self.cumulative: list[tuple[int, float, int]] = []  # (offset, time, operation index)
        self._offsets: list[int] = []
        self._suffix_earliest: list[tuple[float, int]] = []

    def add(self, offset: int, time_ms: float, index: int, *, cumulative: bool) -> None:
        if cumulative:
            self.cumulative.append((offset, time_ms, index))
        elif offset not in self.individual or time_ms < self.individual[offset][0]:
            self.individual[offset] = (time_ms, index)

    def seal(self) -> None:
        self.cumulative.sort()
        self._offsets = [offset for offset, _, _ in self.cumulative]
        earliest: list[tuple[float, int]] = []
        best = (float("inf"), -1)
        for _, time_ms, index in reversed(self.cumulative):
            best = min(best, (time_ms, index))
            earliest.append(best)
        self._suffix_earliest = earliest[::-1]

    def earliest(self, offset: int) -> tuple[float, int] | None:
        """(time, operation index) of the first confirmed acknowledgement
        covering `offset`, or None."""
        found = self.individual.get(offset)
        position = bisect.bisect_left(self._offsets, offset)
        if position < len(self._offsets):
            cumulative = self._suffix_earliest[position]
            if found is None or cumulative < found:
                found = cumulative
        return found


class _Checker:
    def __init__(self) -> None:
        self.result = BrokerCheckResult()
        self.messages: dict[Identity, _Message] = {}
        self.positions: dict[Position, tuple[tuple[int, ...], Identity, int]] = {}  # -> (message id, message, index)
        self.offset_of_id: dict[tuple[int, ...], tuple[int, int]] = {}  # (partition, *message id) -> (offset, index)
        self.sessions: dict[str, _Session] = {}
        self.deliveries: list[_Delivery] = []
        self.empty_moments: dict[str, list[float]] = {}  # session -> times its receive queue was empty
        self.ack_times: dict[tuple[str, int], _AckTimes] = {}  # (subscription, partition)
        self.session_ack_times: dict[tuple[str, int], _AckTimes] = {}  # (session, partition)
        self.reported: set[tuple[Any, ...]] = set()

    def report(self, kind: str, detail: str, *, once: tuple[Any, ...] | None = None, **where: Any) -> None:
        if once is not None:
            if (kind, *once) in self.reported:
                return
            self.reported.add((kind, *once))
        self.result.anomalies(kind).append(BrokerAnomaly(kind, detail, **where))

    def subscription(self, name: str, kind: str, index: int) -> SubscriptionSummary:
        summary = self.result.subscriptions.get(name)
        if summary is None:
            summary = self.result.subscriptions[name] = SubscriptionSummary(kind)
        elif summary.type != kind:
            raise HistoryFormatError(f"operation {index}: subscription {name} is {summary.type}, not {kind}")
        return summary

    # --- gathering ------------------------------------------------------------------

    def gather(self, operations: list[Operation]) -> None:
        self.result.faults_by_kind = count_faults(operations)
        pairs = pair_operations(operations, op_ids_required=True)
        # Produces and sessions first: a delivery is judged against every
        # message invoked and the session it belongs to.
        for pair in pairs:
            if pair.invoke.f == "produce":
                self.gather_produce(pair)
            elif pair.invoke.f == "subscribe":
                self.gather_subscribe(pair)
        for pair in pairs:
            if pair.invoke.f == "receive":
                self.gather_receive(pair)
            elif pair.invoke.f == "ack" and pair.outcome == "ok":
                self.gather_ack(pair)
            elif pair.invoke.f == "drain" and pair.outcome == "ok":
                completion = pair.completion
                summary = self.subscription(_text(completion, "subscription"), _text(pair.invoke, "type"), completion.index)
                summary.drained = bool(summary.drained) or completion.value.get("complete") is True
        self.deliveries.sort(key=lambda delivery: delivery.index)
        for times in (*self.ack_times.values(), *self.session_ack_times.values()):
            times.seal()
        for moments in self.empty_moments.values():
            moments.sort()

    def gather_produce(self, pair: OperationPair) -> None:
        invoke = pair.invoke
        identity = (_text(invoke, "producer"), integer_value(invoke, "partition"), integer_value(invoke, "seq"))
        payload, key = _text(invoke, "payload"), _optional_text(invoke, "key")
        message = self.messages.get(identity)
        if message is None:
            message = self.messages[identity] = _Message(payload, key, invoke.index)
        elif (message.payload, message.key) != (payload, key):
            # A resend must be the same message, or the dedup check means nothing.
            raise HistoryFormatError(
                f"operation {invoke.index}: resends {_describe(identity)} with another payload or key than operation "
                f"{message.invoke_index}"
            )
        message.attempts += 1
        self.result.produce_attempts += 1
        if pair.outcome != "ok":
            return
        completion = pair.completion
        if message.ok_index is None:
            message.ok_index = completion.index
        if completion.value.get("duplicate") is True:
            message.answered_stored_before = True
            self.result.resends_persisted_before += 1
            return
        self.place(identity, payload, identity[1], integer_value(completion, "offset"), _message_id(completion), completion.index)

    def gather_subscribe(self, pair: OperationPair) -> None:
        invoke = pair.invoke
        kind = _text(invoke, "type")
        if kind not in SUBSCRIPTION_TYPES:
            raise HistoryFormatError(f"operation {invoke.index}: unknown subscription type {kind!r}")
        summary = self.subscription(_text(invoke, "subscription"), kind, invoke.index)
        session = _text(invoke, "session")
        if session in self.sessions:
            raise HistoryFormatError(f"operation {invoke.index}: session {session!r} subscribed twice")
        self.sessions[session] = _Session(_text(invoke, "subscription"), kind, invoke.time_ms, invoke.index)
        summary.sessions += pair.outcome == "ok"

    def gather_receive(self, pair: OperationPair) -> None:
        completion = pair.completion
        if completion is None:
            return
        session = _text(pair.invoke, "session")
        if completion.type != "ok" or completion.value.get("waited") is True:
            # The receive found the session's queue empty when it began.
            self.empty_moments.setdefault(session, []).append(pair.invoke.time_ms)
        if completion.type != "ok":
            return
        known = self.sessions.get(session)
        if known is None:
            raise HistoryFormatError(f"operation {completion.index}: a receive of session {session!r}, which never subscribed")
        partition = integer_value(completion, "partition")
        identity = (_text(completion, "producer"), partition, integer_value(completion, "seq"))
        delivery = _Delivery(completion.index, pair.invoke.time_ms, known.subscription, session, identity, partition,
                             integer_value(completion, "offset"), _optional_text(completion, "key"), _text(completion, "payload"))
        self.deliveries.append(delivery)
        self.place(identity, delivery.payload, partition, delivery.offset, _message_id(completion), completion.index)

    def gather_ack(self, pair: OperationPair) -> None:
        invoke, completion = pair.invoke, pair.completion
        session = self.sessions.get(_text(invoke, "session"))
        if session is None:
            raise HistoryFormatError(f"operation {invoke.index}: an acknowledgement of a session that never subscribed")
        partition, offset = integer_value(invoke, "partition"), integer_value(invoke, "offset")
        cumulative = invoke.value.get("cumulative") is True
        summary = self.result.subscriptions[session.subscription]
        summary.acks_ok += 1
        summary.cumulative_acks_ok += cumulative
        for key, table in (((session.subscription, partition), self.ack_times),
                           ((_text(invoke, "session"), partition), self.session_ack_times)):
            times = table.get(key)
            if times is None:
                times = table[key] = _AckTimes()
            times.add(offset, completion.time_ms, completion.index, cumulative=cumulative)

    def place(self, identity: Identity, payload: str, partition: int, offset: int, message_id: tuple[int, ...], index: int) -> None:
        """A message seen stored at `offset` of `partition` with `message_id`."""
        position = (partition, offset)
        held = self.positions.get(position)
        if held is None:
            self.positions[position] = (message_id, identity, index)
        elif held[:2] != (message_id, identity):
            self.report(
                "inconsistent", f"holds {_describe(held[1])} (id {_id_text(held[0])}) and {_describe(identity)} (id {_id_text(message_id)})",
                once=position, partition=partition, offset=offset, operation_indexes=(held[2], index),
            )
        id_key = (partition, *message_id)
        seen_offset = self.offset_of_id.setdefault(id_key, (offset, index))
        if seen_offset[0] != offset:
            self.report(
                "inconsistent", f"message id {_id_text(message_id)} is at offsets {seen_offset[0]} and {offset}",
                once=id_key, partition=partition, offset=offset, operation_indexes=(seen_offset[1], index),
            )
        message = self.messages.get(identity)
        if message is None:
            self.report("unexpected", f"{_describe(identity)} was stored, but no producer sent it", once=identity,
                        partition=partition, offset=offset, payload=payload, operation_indexes=(index,))
        elif message.payload != payload:
            self.report("unexpected", f"stored as {payload!r}, but {_describe(identity)} was sent as {message.payload!r}",
                        once=identity, partition=partition, offset=offset, payload=payload,
                        operation_indexes=(message.invoke_index, index))
        else:
            message.positions.setdefault(position, index)

    # --- judging --------------------------------------------------------------------

    def judge(self) -> None:
        self.judge_deliveries()
        self.judge_messages()

    def judge_deliveries(self) -> None:
        delivered: set[tuple[str, Position]] = set()  # (subscription, position) delivered before
        highest_first: dict[tuple[Any, ...], tuple[int, int]] = {}  # order group -> (offset, index) of the highest first delivery
        for delivery in self.deliveries:
            subscription = delivery.subscription
            summary = self.result.subscriptions[subscription]
            summary.deliveries += 1
            message = self.messages.get(delivery.identity)
            if message is not None and subscription not in message.delivered_to:
                message.delivered_to.add(subscription)
                summary.messages += 1
            position = (delivery.partition, delivery.offset)
            self.judge_after_acknowledgement(delivery, summary.type)
            if (subscription, position) in delivered:
                summary.redeliveries += 1
                continue
            delivered.add((subscription, position))
            if summary.type in ORDERED_BY_PARTITION:
                group: tuple[Any, ...] | None = (subscription, delivery.partition)
            elif summary.type in ORDERED_BY_KEY:
                group = (subscription, delivery.partition, delivery.key)
            else:
                group = None
            if group is None:
                continue
            highest = highest_first.get(group)
            if highest is None or delivery.offset > highest[0]:
                highest_first[group] = (delivery.offset, delivery.index)
                continue
            scope = "partition" if summary.type in ORDERED_BY_PARTITION else f"key {delivery.key!r}"
            self.report(
                "reordered",
                f"first delivered after offset {highest[0]}, which comes later in the {scope} ({summary.type})",
                subscription=subscription, partition=delivery.partition, offset=delivery.offset, payload=delivery.payload,
                operation_indexes=(highest[1], delivery.index),
            )

    def judge_after_acknowledgement(self, delivery: _Delivery, kind: str) -> None:
        """A message whose acknowledgement was confirmed is never delivered
        again to a session that subscribed after that, nor to the session
        that acknowledged it once its receive queue had been empty since
        (what it received before may have been sent before the broker took
        the acknowledgement; what arrived after an empty queue was not)."""
        session = self.sessions[delivery.session]
        times = self.ack_times.get((delivery.subscription, delivery.partition))
        earliest = times.earliest(delivery.offset) if times is not None else None
        if earliest is None:
            return
        if earliest[0] < session.start_ms:
            self.report(
                "duplicated", f"delivered to a session that subscribed after its acknowledgement was confirmed ({kind})",
                once=(delivery.subscription, delivery.partition, delivery.offset),
                subscription=delivery.subscription, partition=delivery.partition, offset=delivery.offset,
                payload=delivery.payload, operation_indexes=(earliest[1], session.index, delivery.index),
            )
            return
        own = self.session_ack_times.get((delivery.session, delivery.partition))
        acknowledged = own.earliest(delivery.offset) if own is not None else None
        if acknowledged is None:
            return
        moments = self.empty_moments.get(delivery.session, [])
        position = bisect.bisect_left(moments, acknowledged[0])
        if position < len(moments) and moments[position] <= delivery.invoke_ms:
            self.report(
                "duplicated",
                f"delivered again to the session that acknowledged it, after the acknowledgement was confirmed ({kind})",
                once=(delivery.subscription, delivery.partition, delivery.offset),
                subscription=delivery.subscription, partition=delivery.partition, offset=delivery.offset,
                payload=delivery.payload, operation_indexes=(acknowledged[1], delivery.index),
            )

    def judge_messages(self) -> None:
        result = self.result
        result.produces_invoked = len(self.messages)
        stored_order: dict[tuple[str, int], list[tuple[int, int, str, int]]] = {}  # (producer, partition) -> (seq, offset, payload, index)
        for identity, message in self.messages.items():
            acknowledged = message.ok_index is not None
            stored = bool(message.positions)
            result.produces_ok += acknowledged
            result.produces_info += not acknowledged
            result.produces_info_stored += not acknowledged and stored
            result.messages_stored += stored
            if len(message.positions) > 1:
                places = sorted(message.positions.items())
                self.report(
                    "duplicated", "stored twice: at offsets " + ", ".join(str(offset) for (_, offset), _ in places),
                    partition=identity[1], offset=places[1][0][1], payload=message.payload,
                    operation_indexes=tuple(index for _, index in places),
                )
            elif stored:
                ((_, offset), index), = message.positions.items()
                stored_order.setdefault(identity[:2], []).append((identity[2], offset, message.payload, index))
            if acknowledged or stored:
                self.judge_seen(identity, message)
        for (producer, partition), stored_messages in stored_order.items():
            stored_messages.sort()
            highest: tuple[int, int, str, int] | None = None
            for seq, offset, payload, index in stored_messages:
                if highest is not None and offset < highest[1]:
                    self.report(
                        "reordered", f"stored below sequence id {highest[0]} (offset {highest[1]}), which {producer} sent after it",
                        partition=partition, offset=offset, payload=payload, operation_indexes=(highest[3], index),
                    )
                if highest is None or offset > highest[1]:
                    highest = (seq, offset, payload, index)

    def judge_seen(self, identity: Identity, message: _Message) -> None:
        """A message acknowledged to its producer, or found stored, must be
        delivered to every subscription (they all exist from the start)."""
        shown = message.ok_index if message.ok_index is not None else min(message.positions.values())
        for name, summary in sorted(self.result.subscriptions.items()):
            if name in message.delivered_to:
                continue
            how = "acknowledged to its producer" if message.ok_index is not None else "stored"
            if message.answered_stored_before and not message.positions:
                how += " (as stored by an earlier send)"
            if summary.drained:
                seen = sorted(message.delivered_to)
                elsewhere = f"; delivered to {', '.join(seen)}" if seen else "; delivered to no subscription"
                self.report("lost", f"{how}, never delivered though the drain reached the end{elsewhere}",
                            subscription=name, partition=identity[1], payload=message.payload, operation_indexes=(shown,))
            else:
                self.report("unseen", f"{how}, never delivered, and the drain did not reach the end",
                            subscription=name, partition=identity[1], payload=message.payload, operation_indexes=(shown,))


def _text(operation: Operation, key: str) -> str:
    value = operation.value.get(key)
    if not isinstance(value, str):
        raise HistoryFormatError(f"operation {operation.index}: {operation.type} {operation.f} needs a string {key}, got {value!r}")
    return value


def _optional_text(operation: Operation, key: str) -> str | None:
    value = operation.value.get(key)
    if value is not None and not isinstance(value, str):
        raise HistoryFormatError(f"operation {operation.index}: {operation.type} {operation.f}: {key} must be a string or null")
    return value


def _message_id(operation: Operation) -> tuple[int, ...]:
    value = operation.value.get("message_id")
    if (not isinstance(value, list) or len(value) != 3
            or not all(isinstance(part, int) and not isinstance(part, bool) for part in value)):
        raise HistoryFormatError(f"operation {operation.index}: message_id must be [ledger, entry, batch index], got {value!r}")
    return tuple(value)


def _id_text(message_id: tuple[int, ...]) -> str:
    return ":".join(str(part) for part in message_id)


def _describe(identity: Identity) -> str:
    producer, partition, seq = identity
    return f"{producer}'s sequence id {seq} of partition {partition}"


def check_broker(operations: Iterable[Operation]) -> BrokerCheckResult:
    """Checks a broker run's history."""
    checker = _Checker()
    checker.gather(list(operations))
    checker.judge()
    return checker.result


__all__ = [
    "ANOMALY_KINDS",
    "BrokerAnomaly",
    "BrokerCheckResult",
    "SubscriptionSummary",
    "check_broker",
]
