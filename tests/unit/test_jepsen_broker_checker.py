"""The broker run's checker on hand-written histories: a clean history is
VALID, and each anomaly kind (lost, unseen, stored twice, delivered again
after a confirmed acknowledgement, first deliveries out of order, messages
no producer sent, two messages at one offset) is found, while what the
subscription types allow (redelivery of unacknowledged messages, shared
subscriptions out of order) is not reported. Also: `--nemesis` and the exit
status of `quire jepsen --broker`."""

from __future__ import annotations

import argparse
import itertools

import pytest

from quire.cli import build_parser
from quire.jepsen_commands import jepsen
from sim.jepsen import broker_runner
from sim.jepsen.broker_checker import (
    BrokerAnomaly,
    BrokerCheckResult,
    SubscriptionSummary,
    check_broker,
)
from sim.jepsen.history import HistoryFormatError, Operation
from sim.jepsen.runner import parse_nemesis
from tests.jepsen_support import report_for


def payload_of(producer: str, partition: int, seq: int) -> str:
    return f"{producer}:{partition}:{seq}"


class History:
    """Builds a history one record at a time, 1 ms apart."""

    def __init__(self) -> None:
        self.operations: list[Operation] = []
        self._op_ids = itertools.count()
        self._time_ms = 0.0

    def record(self, process: str, type: str, f: str, value: dict) -> None:
        self._time_ms += 1.0
        self.operations.append(Operation(len(self.operations), self._time_ms, process, type, f, value))

    def invoke(self, process: str, f: str, value: dict) -> str:
        op_id = f"op-{next(self._op_ids)}"
        self.record(process, "invoke", f, {"op_id": op_id, **value})
        return op_id

    def produce(self, producer: str, partition: int, seq: int, offset: int | None, *, key: str | None = None,
                outcome: str = "ok", duplicate: bool = False, payload: str | None = None) -> None:
        payload = payload or payload_of(producer, partition, seq)
        op_id = self.invoke(producer, "produce", {"producer": producer, "partition": partition, "seq": seq, "key": key, "payload": payload})
        if outcome == "ok" and duplicate:
            self.record(producer, "ok", "produce", {"op_id": op_id, "duplicate": True, "message_id": None, "offset": None})
        elif outcome == "ok":
            self.record(producer, "ok", "produce", {"op_id": op_id, "duplicate": False, "message_id": [7, offset, 0], "offset": offset})
        elif outcome == "info":
            self.record(producer, "info", "produce", {"op_id": op_id, "error": "ConnectionClosedError"})

    def subscribe(self, process: str, subscription: str, kind: str, session: str) -> None:
        op_id = self.invoke(process, "subscribe", {"subscription": subscription, "type": kind, "session": session})
        self.record(process, "ok", "subscribe", {"op_id": op_id, "subscription": subscription, "session": session})

    def receive(self, process: str, session: str, subscription: str, producer: str, partition: int, seq: int, offset: int,
                *, key: str | None = None, waited: bool = False, payload: str | None = None) -> None:
        op_id = self.invoke(process, "receive", {"session": session})
        self.record(process, "ok", "receive", {
            "op_id": op_id, "subscription": subscription, "session": session, "partition": partition, "offset": offset,
            "message_id": [7, offset, 0], "key": key, "producer": producer, "seq": seq,
            "payload": payload or payload_of(producer, partition, seq), "redelivery_count": 0, "waited": waited,
        })

    def idle(self, process: str, session: str) -> None:
        """A receive that found nothing: the session's queue was empty."""
        op_id = self.invoke(process, "receive", {"session": session})
        self.record(process, "fail", "receive", {"op_id": op_id, "session": session, "error": "idle"})

    def ack(self, process: str, session: str, subscription: str, partition: int, offset: int, *, cumulative: bool = False,
            outcome: str = "ok") -> None:
        op_id = self.invoke(process, "ack", {"subscription": subscription, "session": session, "partition": partition,
                                             "offset": offset, "cumulative": cumulative})
        self.record(process, outcome, "ack", {"op_id": op_id})

    def drain(self, subscription: str, kind: str, *, complete: bool = True) -> None:
        op_id = self.invoke("drain", "drain", {"subscription": subscription, "type": kind})
        self.record("drain", "ok", "drain", {"op_id": op_id, "subscription": subscription, "complete": complete})

    def fault(self, fault: str, fault_id: int) -> None:
        self.record("nemesis", "info", "fault-start", {"fault": fault, "targets": ["broker-0"], "fault_id": fault_id})
        self.record("nemesis", "info", "fault-end", {"fault": fault, "targets": ["broker-0"], "fault_id": fault_id})


def one_producer(count: int, *, keys: dict[int, str] | None = None) -> History:
    """A history in which producer-0 sent `count` messages to partition 0,
    each acknowledged at the offset equal to its sequence id."""
    history = History()
    for seq in range(count):
        history.produce("producer-0", 0, seq, seq, key=(keys or {}).get(seq))
    return history


def consume_all(history: History, subscription: str, kind: str, messages: list[tuple[str, int, int, int]], *,
                session: str | None = None, keys: dict | None = None) -> None:
    """A session that receives `messages` ((producer, partition, seq, offset)) and acknowledges each."""
    session = session or f"{subscription}-session"
    process = f"consumer-{subscription}"
    history.subscribe(process, subscription, kind, session)
    for producer, partition, seq, offset in messages:
        history.receive(process, session, subscription, producer, partition, seq, offset, key=(keys or {}).get(seq))
        history.ack(process, session, subscription, partition, offset)


def delivered_in(kind: str, order: list[int], *, keys: dict[int, str] | None = None) -> History:
    """producer-0's messages (see one_producer), then delivered to a
    subscription of `kind` in `order` of their sequence ids, each
    acknowledged, and the subscription drained."""
    history = one_producer(len(order), keys=keys)
    consume_all(history, f"sub-{kind}", kind, [("producer-0", 0, seq, seq) for seq in order], keys=keys)
    history.drain(f"sub-{kind}", kind)
    return history


def clean_history() -> tuple[History, list[tuple[str, int, int, int]]]:
    # Two producers on two partitions; every subscription type sees every
    # message once, acknowledges it, and is drained.
    history = History()
    messages = [("producer-0", 0, 0, 0), ("producer-1", 0, 0, 1), ("producer-0", 0, 1, 2), ("producer-1", 1, 0, 0)]
    for producer, partition, seq, offset in messages:
        history.produce(producer, partition, seq, offset)
    history.fault("kill", 1)
    for kind in ("exclusive", "failover", "shared", "key_shared"):
        consume_all(history, f"sub-{kind}", kind, messages)
    for kind in ("exclusive", "failover", "shared", "key_shared"):
        history.drain(f"sub-{kind}", kind)
    return history, messages


def assert_valid(history: History) -> BrokerCheckResult:
    result = check_broker(history.operations)
    assert result.verdict == "VALID", result.summary()
    return result


def only(result: BrokerCheckResult, kind: str) -> list[BrokerAnomaly]:
    others = {other: getattr(result, other) for other in ("lost", "duplicated", "reordered", "inconsistent", "unexpected", "unseen")
              if other != kind and getattr(result, other)}
    assert not others, others
    found = result.anomalies(kind)
    assert found, result.summary()
    return found


def test_a_clean_history_is_valid():
    history, _ = clean_history()
    result = assert_valid(history)
    assert (result.produces_invoked, result.produces_ok, result.messages_stored) == (4, 4, 4)
    assert set(result.subscriptions) == {"sub-exclusive", "sub-failover", "sub-shared", "sub-key_shared"}
    assert all(summary.messages == 4 and summary.acks_ok == 4 and summary.drained for summary in result.subscriptions.values())
    assert result.faults_by_kind == {"kill": 1}
    assert result.summary().startswith("VALID\n")


def test_an_acknowledged_message_missing_from_a_drained_subscription_is_lost():
    history, _ = clean_history()
    history.produce("producer-0", 1, 0, 1)  # acknowledged, never delivered anywhere
    result = check_broker(history.operations)
    lost = only(result, "lost")
    assert result.verdict == "INVALID"
    assert {anomaly.subscription for anomaly in lost} == {"sub-exclusive", "sub-failover", "sub-shared", "sub-key_shared"}
    assert all(anomaly.payload == "producer-0:1:0" and "no subscription" in anomaly.detail for anomaly in lost)


def test_a_stored_indeterminate_message_one_subscription_skipped_is_lost():
    # The send was never answered, but the message was stored (one
    # subscription got it): the other drained subscriptions must too.
    history, _ = clean_history()
    history.produce("producer-0", 1, 0, None, outcome="info")
    history.subscribe("late", "sub-shared", "shared", "late-session")
    history.receive("late", "late-session", "sub-shared", "producer-0", 1, 0, 1)
    result = check_broker(history.operations)
    lost = only(result, "lost")
    assert {anomaly.subscription for anomaly in lost} == {"sub-exclusive", "sub-failover", "sub-key_shared"}
    assert result.produces_info == 1 and result.produces_info_stored == 1


def test_a_first_send_answered_as_stored_before_and_never_stored_is_lost():
    # Deduplication that drops a message it never stored: the producer is
    # told "an earlier send stored it", but nothing did.
    history, _ = clean_history()
    history.produce("producer-0", 1, 5, None, duplicate=True)
    result = check_broker(history.operations)
    lost = only(result, "lost")
    assert all("as stored by an earlier send" in anomaly.detail for anomaly in lost)
    assert result.resends_persisted_before == 1


def test_a_message_missing_where_the_drain_did_not_finish_is_unseen():
    history = one_producer(1)
    history.subscribe("consumer", "sub-shared", "shared", "s")
    history.drain("sub-shared", "shared", complete=False)
    result = check_broker(history.operations)
    unseen = only(result, "unseen")
    assert result.verdict == "INCOMPLETE" and unseen[0].subscription == "sub-shared"


def test_an_undrained_subscription_leaves_the_history_incomplete():
    history, _ = clean_history()
    history.subscribe("consumer", "sub-extra", "shared", "extra")
    for producer, partition, seq, offset in [("producer-0", 0, 0, 0), ("producer-1", 0, 0, 1), ("producer-0", 0, 1, 2), ("producer-1", 1, 0, 0)]:
        history.receive("consumer", "extra", "sub-extra", producer, partition, seq, offset)
    result = check_broker(history.operations)
    assert result.valid and not result.unseen and result.verdict == "INCOMPLETE"
    assert result.subscriptions["sub-extra"].drained is None


def test_a_message_stored_twice_is_duplicated():
    # A resend after a restart stored the message a second time: two offsets
    # for one sequence id of one producer.
    history, _ = clean_history()
    history.produce("producer-0", 0, 1, 3)
    result = check_broker(history.operations)
    duplicated = only(result, "duplicated")
    assert duplicated[0].payload == "producer-0:0:1" and "offsets 2, 3" in duplicated[0].detail


def test_a_resend_answered_as_stored_before_is_no_duplicate():
    history, _ = clean_history()
    history.produce("producer-0", 0, 1, None, duplicate=True)
    result = assert_valid(history)
    assert result.resends_persisted_before == 1 and result.produce_attempts == 5


def test_redelivering_an_unacknowledged_message_is_allowed():
    # One consumer session takes the message and leaves without acknowledging
    # it; the next session gets it again.
    history = one_producer(1)
    history.subscribe("consumer", "sub-exclusive", "exclusive", "first")
    history.receive("consumer", "first", "sub-exclusive", "producer-0", 0, 0, 0)
    history.subscribe("consumer", "sub-exclusive", "exclusive", "second")
    history.receive("consumer", "second", "sub-exclusive", "producer-0", 0, 0, 0)
    history.ack("consumer", "second", "sub-exclusive", 0, 0)
    history.drain("sub-exclusive", "exclusive")
    result = assert_valid(history)
    assert result.subscriptions["sub-exclusive"].redeliveries == 1


def test_a_delivery_to_a_session_that_subscribed_after_the_acknowledgement_is_duplicated():
    history = one_producer(1)
    history.subscribe("consumer", "sub-failover", "failover", "first")
    history.receive("consumer", "first", "sub-failover", "producer-0", 0, 0, 0)
    history.ack("consumer", "first", "sub-failover", 0, 0)
    history.subscribe("drain", "sub-failover", "failover", "drain")
    history.receive("drain", "drain", "sub-failover", "producer-0", 0, 0, 0)
    history.drain("sub-failover", "failover")
    duplicated = only(check_broker(history.operations), "duplicated")
    assert "subscribed after its acknowledgement" in duplicated[0].detail and duplicated[0].offset == 0


def test_an_acknowledgement_that_was_never_confirmed_allows_redelivery():
    history = one_producer(1)
    history.subscribe("consumer", "sub-shared", "shared", "first")
    history.receive("consumer", "first", "sub-shared", "producer-0", 0, 0, 0)
    history.ack("consumer", "first", "sub-shared", 0, 0, outcome="info")
    history.subscribe("drain", "sub-shared", "shared", "drain")
    history.receive("drain", "drain", "sub-shared", "producer-0", 0, 0, 0)
    history.drain("sub-shared", "shared")
    assert_valid(history)


def test_a_cumulative_acknowledgement_covers_the_offsets_below_it():
    history = one_producer(3)
    history.subscribe("consumer", "sub-exclusive", "exclusive", "first")
    for seq in range(3):
        history.receive("consumer", "first", "sub-exclusive", "producer-0", 0, seq, seq)
    history.ack("consumer", "first", "sub-exclusive", 0, 2, cumulative=True)
    history.subscribe("drain", "sub-exclusive", "exclusive", "drain")
    history.receive("drain", "drain", "sub-exclusive", "producer-0", 0, 1, 1)  # covered by the ack of offset 2
    history.drain("sub-exclusive", "exclusive")
    duplicated = only(check_broker(history.operations), "duplicated")
    assert [anomaly.offset for anomaly in duplicated] == [1]


def test_the_acknowledging_session_may_hold_a_copy_queued_before_the_acknowledgement():
    # A copy that was already waiting in the session's queue (received
    # without waiting) may come after the acknowledgement; one that arrived
    # after the queue had been empty may not.
    def history_with(waited: bool) -> History:
        history = one_producer(1)
        history.subscribe("consumer", "sub-failover", "failover", "only")
        history.receive("consumer", "only", "sub-failover", "producer-0", 0, 0, 0)
        history.ack("consumer", "only", "sub-failover", 0, 0)
        history.receive("consumer", "only", "sub-failover", "producer-0", 0, 0, 0, waited=waited)
        history.drain("sub-failover", "failover")
        return history

    assert_valid(history_with(waited=False))
    duplicated = only(check_broker(history_with(waited=True).operations), "duplicated")
    assert "session that acknowledged it" in duplicated[0].detail


def test_an_empty_queue_between_the_acknowledgement_and_the_delivery_counts():
    history = one_producer(1)
    history.subscribe("consumer", "sub-shared", "shared", "only")
    history.receive("consumer", "only", "sub-shared", "producer-0", 0, 0, 0)
    history.ack("consumer", "only", "sub-shared", 0, 0)
    history.idle("consumer", "only")
    history.receive("consumer", "only", "sub-shared", "producer-0", 0, 0, 0)
    history.drain("sub-shared", "shared")
    only(check_broker(history.operations), "duplicated")


@pytest.mark.parametrize("kind", ["exclusive", "failover"])
def test_first_deliveries_out_of_partition_order_are_reordered(kind):
    reordered = only(check_broker(delivered_in(kind, [0, 2, 1]).operations), "reordered")
    assert [anomaly.offset for anomaly in reordered] == [1] and "offset 2" in reordered[0].detail


def test_a_redelivery_of_an_earlier_offset_is_not_reordered():
    history = one_producer(3)
    history.subscribe("consumer", "sub-exclusive", "exclusive", "only")
    for seq in (0, 1, 2, 1, 2):  # a reconnection: 1 and 2 again
        history.receive("consumer", "only", "sub-exclusive", "producer-0", 0, seq, seq)
    for seq in range(3):
        history.ack("consumer", "only", "sub-exclusive", 0, seq)
    history.drain("sub-exclusive", "exclusive")
    assert_valid(history)


def test_shared_subscriptions_promise_no_order():
    assert_valid(delivered_in("shared", [2, 0, 1]))


def test_key_shared_orders_each_key_not_the_partition():
    keys = {0: "a", 1: "b", 2: "a", 3: "b"}
    # Keys interleave out of partition order, each key in order: allowed.
    assert_valid(delivered_in("key_shared", [1, 0, 3, 2], keys=keys))
    # Key a's offset 2 before its offset 0: reordered.
    reordered = only(check_broker(delivered_in("key_shared", [2, 1, 0, 3], keys=keys).operations), "reordered")
    assert [anomaly.offset for anomaly in reordered] == [0] and "key 'a'" in reordered[0].detail


def test_a_producer_s_messages_stored_out_of_sequence_order_are_reordered():
    history = History()
    history.produce("producer-0", 0, 0, 1)
    history.produce("producer-0", 0, 1, 0)
    consume_all(history, "sub-shared", "shared", [("producer-0", 0, 1, 0), ("producer-0", 0, 0, 1)])
    history.drain("sub-shared", "shared")
    reordered = only(check_broker(history.operations), "reordered")
    assert reordered[0].payload == "producer-0:0:1" and "below sequence id 0 (offset 1)" in reordered[0].detail


def test_a_message_no_producer_sent_or_with_another_payload_is_unexpected():
    history = one_producer(1)
    history.subscribe("consumer", "sub-shared", "shared", "only")
    history.receive("consumer", "only", "sub-shared", "producer-0", 0, 0, 0)
    history.receive("consumer", "only", "sub-shared", "producer-9", 1, 0, 5)
    history.receive("consumer", "only", "sub-shared", "producer-0", 0, 0, 0, payload="something else")
    history.drain("sub-shared", "shared")
    unexpected = only(check_broker(history.operations), "unexpected")
    assert sorted(anomaly.payload for anomaly in unexpected) == ["producer-9:1:0", "something else"]


def test_two_messages_at_one_offset_are_inconsistent():
    history, _ = clean_history()
    history.produce("producer-0", 0, 2, 3)
    history.produce("producer-1", 0, 1, 3)  # the same offset of partition 0
    consume_all(history, "sub-shared", "shared", [("producer-0", 0, 2, 3), ("producer-1", 0, 1, 3)], session="more")
    result = check_broker(history.operations)
    inconsistent = [anomaly for anomaly in result.inconsistent if anomaly.offset == 3]
    assert inconsistent and result.verdict == "INVALID"


def test_a_history_the_recorder_got_wrong_is_refused():
    history = History()
    history.record("producer-0", "invoke", "produce", {"producer": "producer-0", "partition": 0, "seq": 0, "payload": "x"})
    with pytest.raises(HistoryFormatError, match="without an op_id"):
        check_broker(history.operations)
    history = History()
    history.produce("producer-0", 0, 0, 0, payload="first")
    history.produce("producer-0", 0, 0, 0, payload="second")
    with pytest.raises(HistoryFormatError, match="another payload"):
        check_broker(history.operations)


# --- the command line -----------------------------------------------------------------


def test_the_nemesis_selection_is_parsed_and_checked():
    assert parse_nemesis("kill,pause,partition,expiry") == ("kill", "pause", "partition", "expire-session")
    assert parse_nemesis(" expiry , kill ") == ("kill", "expire-session")
    for bad, message in [("", "names no fault"), ("kill,,pause", "an empty name"), ("kill,flood", "'flood' is not a fault")]:
        with pytest.raises(ValueError, match=message):
            parse_nemesis(bad)


def test_a_bad_nemesis_exits_2_saying_what_is_wrong(capsys):
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["jepsen", "--broker", "--nemesis", "kill,flood"])
    assert exited.value.code == 2
    assert "'flood' is not a fault; the nemesis knows kill, pause, partition, expiry" in capsys.readouterr().err


@pytest.mark.parametrize(
    "result, status",
    [
        (BrokerCheckResult(subscriptions={"sub": SubscriptionSummary("shared", drained=True)}), 0),
        (BrokerCheckResult(subscriptions={"sub": SubscriptionSummary("shared", drained=False)}), 1),
        (BrokerCheckResult(lost=[BrokerAnomaly("lost", "gone")], subscriptions={"sub": SubscriptionSummary("shared", drained=True)}), 1),
    ],
)
def test_quire_jepsen_broker_exits_zero_only_for_a_valid_verdict(result, status, tmp_path, monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(broker_runner, "run_broker_jepsen", lambda *args, **kwargs: calls.append(kwargs) or report_for(result, tmp_path))
    arguments = argparse.Namespace(duration=1, writers=None, readers=None, bookies=None, seed=3, work_dir=tmp_path / "run",
                                   broker=True, nemesis=("kill", "expire-session"))
    assert jepsen(arguments) == status
    assert capsys.readouterr().out.startswith(result.verdict + "\n")
    assert calls[0]["faults"] == ("kill", "expire-session") and calls[0]["seed"] == 3
