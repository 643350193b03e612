"""Known broker mistakes, planted on purpose (test-only), as `sim/mistakes.py`
does for the ledger: each is a subclass of a real broker core
(`PublishCore`, `SubscriptionCore`, or the `Dedup` and `Dispatcher` they
use) that breaks one rule, so that tests can show the broker simulation
finds it. Production code never imports this module.

- `dedup-judges-first-sequence-id`: a batch is judged (and remembered) by
  its first sequence id instead of its last, so the broker tells a
  reconnecting producer an older "last persisted" id than the truth, and
  the messages after it are taken as new again;
- `dedup-snapshot-ahead`: the snapshot of the deduplication map counts
  batches still being written, so a new owner takes a batch that was lost
  with the old one for persisted, and answers its resend DUPLICATE;
- `dedup-replay-skipped`: a new owner rebuilds the map from the snapshot
  alone, without replaying the entries after it, and persists a resent
  batch a second time;
- `ack-before-durable`: an acknowledgement is answered as soon as the
  cursor took it, before a cursor write covering it is durable, so a crash
  or takeover delivers it again;
- `key-shared-overtakes-on-join`: the key-shared dispatcher without its
  check for earlier messages of a key still out elsewhere: a message held
  back or given back below a joining consumer's position goes to it while
  an earlier message of its key is still out at the consumer the key left;
- `dispatch-without-lease`: a broker dispatches whatever it knows of its
  ZooKeeper session, with no lease (`SubscriptionCore.may_dispatch` waits
  for a valid one), so one cut off from ZooKeeper (or paused) past its session
  timeout goes on delivering to its consumers messages acknowledged
  meanwhile through the new owner;
- `resume-after-last-persisted`: a (re)connecting producer is told its last
  *persisted* sequence id at once, without waiting for the batches of its
  earlier connection (`PublishCore.resume_after` waits): a producer started again
  after a crash resumes after it while a batch of its old process is still
  being written, and a batch of the new process that begins at or below
  that batch's last id is taken as new (judged by its last id): its first
  messages are persisted twice;
- `resume-after-last-taken`: a (re)connecting producer is told at once the
  last sequence id persisted *or being written*: a producer started again
  after a crash goes on after a batch of its old process that is still
  being written; when that write fails, nobody sends those messages again:
  they are lost;
- `open-without-recovery`: a new owner takes the previous owner's open
  ledger for empty and closed, without fencing and recovering it: the
  chain goes on from that ledger's first offset, over messages already
  acknowledged there (and the previous owner may go on appending);
- `acks-wait-on-unload`: when a partition is unloaded, the
  acknowledgements still waiting for a cursor write are never answered
  (`SubscriptionCore.close` hands them back to be answered TOPIC_FENCED), and the consumer's
  acknowledgement waits for ever (a liveness failure).
"""

from __future__ import annotations

from broker.dedup import Dedup, DedupSnapshot
from broker.dispatcher import Dispatcher
from broker.managed_ledger_core import ManagedLedgerCore
from broker.publish_core import PublishCore
from broker.subscription_core import SubscriptionCore


class JudgesFirstSequenceId(PublishCore):
    def judged_sequence_id(self, first_sequence_id: int, last_sequence_id: int) -> int:
        return first_sequence_id


class SnapshotAheadDedup(Dedup):
    def snapshot(self, ledger_id: int, entry_id: int, **bounds) -> DedupSnapshot:
        sequences = dict(self._persisted)
        for producer_id, sequence_id in self._pushed.items():
            sequences[producer_id] = max(sequences.get(producer_id, -1), sequence_id)
        return DedupSnapshot(ledger_id, entry_id, sequences)


class SnapshotAhead(PublishCore):
    dedup_class = SnapshotAheadDedup


class ReplaySkippedDedup(Dedup):
    def replayed(self, producer_id: str, last_sequence_id: int) -> None:
        pass


class ReplaySkipped(PublishCore):
    dedup_class = ReplaySkippedDedup


class AckBeforeDurable(SubscriptionCore):
    def _await_durable(self, waiter):
        # The mistake: answered now, as if a cursor write covering it were done.
        self.changed()
        return (waiter,)


class ResumeAfterLastPersisted(PublishCore):
    def resume_after(self, producer_id: str) -> int:
        return self.dedup.last_persisted(producer_id)


class ResumeAfterLastTaken(PublishCore):
    def resume_after(self, producer_id: str) -> int:
        return self.dedup.last_taken(producer_id)


class OvertakesOnJoinDispatcher(Dispatcher):
    def _earlier_out_elsewhere(self, key: str, consumer_id: int, offset: int) -> bool:
        return False


class OvertakesOnJoin(SubscriptionCore):
    dispatcher_class = OvertakesOnJoinDispatcher


class DispatchWithoutLease(SubscriptionCore):
    def may_dispatch(self, lease_valid: bool) -> bool:
        return not self.closed


class AcksWaitOnUnload(SubscriptionCore):
    def close(self) -> list:
        super().close()
        return []  # nothing answers them any more


class OpensWithoutRecovery(ManagedLedgerCore):
    def record_read(self, found):
        commands = super().record_read(found)
        if commands and type(commands[0]).__name__ == "RecoverLedger":
            # The mistake: the open ledger taken for empty, nobody fenced.
            return self.ledger_recovered(commands[0].ledger_id, 0, 0, None, None, self.record.ledgers[-1].created_ms)
        return commands


# The mistakes that break a safety rule (each found by a checker), and those
# that break liveness.
BROKER_SAFETY_MISTAKES = ("dedup-judges-first-sequence-id", "dedup-snapshot-ahead", "dedup-replay-skipped", "ack-before-durable",
                          "key-shared-overtakes-on-join", "dispatch-without-lease", "resume-after-last-persisted",
                          "open-without-recovery")
BROKER_LIVENESS_MISTAKES = ("acks-wait-on-unload", "resume-after-last-taken")

BROKER_MISTAKES = {
    "dedup-judges-first-sequence-id": {"publish_core_class": JudgesFirstSequenceId},
    "dedup-snapshot-ahead": {"publish_core_class": SnapshotAhead},
    "dedup-replay-skipped": {"publish_core_class": ReplaySkipped},
    "ack-before-durable": {"subscription_core_class": AckBeforeDurable},
    "key-shared-overtakes-on-join": {"subscription_core_class": OvertakesOnJoin},
    "dispatch-without-lease": {"subscription_core_class": DispatchWithoutLease},
    "resume-after-last-persisted": {"publish_core_class": ResumeAfterLastPersisted},
    "resume-after-last-taken": {"publish_core_class": ResumeAfterLastTaken},
    "acks-wait-on-unload": {"subscription_core_class": AcksWaitOnUnload},
    "open-without-recovery": {"managed_ledger_core_class": OpensWithoutRecovery},
}
