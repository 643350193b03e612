"""The publishing rules of one loaded partition, as a pure state machine:
which producers are connected (and with which access: Pulsar's Shared,
Exclusive, WaitForExclusive, ExclusiveWithFencing), what a (re)connecting producer is told to
continue after, what each batch gets (taken, a duplicate, "retry", refused
over the backlog quota, or refused because the partition is unloading),
and when the deduplication map is snapshotted.

The trio driver (broker/topic.py) and the simulator (sim/broker_partition.py)
feed it what happens and carry out what it decides; it does no I/O and
reads no clock. The deduplication map itself is `broker.dedup.Dedup`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Generic, TypeVar

from broker.dedup import Dedup, DedupSnapshot, Verdict
from broker.errors import BrokerStatus

DEDUP_SNAPSHOT_ENTRIES = 1_000  # entries between two snapshots of the deduplication map

Link = TypeVar("Link")


class AccessMode(str, enum.Enum):
    """How a producer shares the partition (Pulsar's ProducerAccessMode)."""

    SHARED = "shared"  # with any other shared producer
    EXCLUSIVE = "exclusive"  # alone: refused while other producers are connected
    WAIT_FOR_EXCLUSIVE = "wait_for_exclusive"  # alone: waits until the others are gone
    EXCLUSIVE_WITH_FENCING = "exclusive_with_fencing"  # alone: the others are closed and refused from then on


class ProducerAnswer(enum.Enum):
    """What a producer asking to publish is told."""

    OK = "ok"  # registered: continue after `last_sequence_id`
    BUSY = "busy"  # a producer with this id is connected already
    WAIT = "wait"  # batches of an earlier connection are still being written: ask again once they are done
    FENCED = "fenced"  # the partition is being unloaded
    EXCLUDED = "excluded"  # another producer has (or, shared, others have) the access it asks for
    WAIT_EXCLUSIVE = "wait_exclusive"  # other producers are connected: ask again once producers leave


@dataclass(frozen=True, slots=True)
class Judgement:
    """What a batch gets: `status` OK means take it (append it, then call
    `pushed` right before it goes to the ledger); any other status is the
    answer, and the batch is dropped. `deduplicated`: whether deduplication
    judged it, which `pushed`, `persisted` and `failed` are told again (the
    policy may change while the batch is being written)."""

    status: BrokerStatus
    detail: str = ""
    deduplicated: bool = False


TAKE = Judgement(BrokerStatus.OK)
TAKE_DEDUPLICATED = Judgement(BrokerStatus.OK, deduplicated=True)


class PublishCore(Generic[Link]):
    """`Link` is whatever a driver keeps per producer (its connection, say)."""

    dedup_class: type[Dedup] = Dedup

    def __init__(self, name: str, *, deduplication: bool = True, snapshot_entries: int = DEDUP_SNAPSHOT_ENTRIES) -> None:
        self.name = name
        self.deduplication = deduplication  # a policy: the driver changes it when the topic's policies change
        self.snapshot_entries = snapshot_entries
        self.dedup: Dedup = self.dedup_class()
        self.producers: dict[str, Link] = {}
        self.exclusive: str | None = None  # the producer that has the partition to itself, if one has
        self.fenced_by: str | None = None  # the exclusive producer that fenced the others out, while it is connected
        self.topic_epoch = 0  # one more each time a producer is given exclusive access (Pulsar's topic epoch)
        self._to_close: list[Link] = []  # producers fenced out, for the driver to close
        self.stopped: str | None = None  # why it takes no more batches (fenced or unloading)
        self._batches_taken: dict[str, int] = {}  # producer id -> batches taken and not yet answered
        self._entries_since_snapshot = 0
        self._snapshot_pending: DedupSnapshot | None = None  # the newest snapshot not yet written
        self._snapshot_writing: DedupSnapshot | None = None
        self._snapshot_written: DedupSnapshot | None = None
        self.snapshot_version: int | None = None  # of the stored snapshot (None: none stored)
        self.last_position: tuple[int, int] | None = None  # (ledger id, entry id) of the last entry persisted
        self.replayed_entries = 0
        self.snapshot_problem: str | None = None  # why the stored snapshot was unreadable (every entry is replayed)

    # --- loading ---------------------------------------------------------------------------

    def restore(self, stored: tuple[dict, int] | None) -> tuple[int, int] | None:
        """Start from the stored snapshot (record, version), if any; returns
        the position it covers: every entry after it must be `replayed`. An
        unreadable snapshot counts as none (every entry is replayed)."""
        snapshot = None
        self.snapshot_problem = None
        if stored is not None:
            record, self.snapshot_version = stored
            try:
                snapshot = DedupSnapshot.from_record(record)
            except (ValueError, KeyError, TypeError) as error:
                self.snapshot_problem = str(error)  # the driver says so
        self.dedup = self.dedup_class.from_snapshot(snapshot)
        return None if snapshot is None else (snapshot.ledger_id, snapshot.entry_id)

    def replayed(self, producer_id: str, last_sequence_id: int) -> None:
        """An entry stored after the snapshot, in order."""
        self.dedup.replayed(producer_id, last_sequence_id)
        self.replayed_entries += 1

    def loaded(self, last_position: tuple[int, int] | None) -> DedupSnapshot | None:
        """Replay is done; `last_position` is the last entry the partition
        holds (None: it holds none). Returns the snapshot of what this owner
        starts from, to be written at once: its version moves on, so that a
        write the previous owner still had in flight can no longer land."""
        self.last_position = last_position
        if last_position is None:
            return None
        self._snapshot_pending = self.dedup.snapshot(*last_position)
        return self.next_snapshot()

    # --- producers ---------------------------------------------------------------------------

    def add_producer(self, producer_id: str, link: Link, access: AccessMode = AccessMode.SHARED) -> tuple[ProducerAnswer, int]:
        """Register a producer; with OK, the last sequence id persisted for
        it. Not while a batch it sent on an earlier connection is taken and
        unanswered: until then its last persisted id is not known, and a
        producer that took the wrong one would lose messages (new ones taken
        for copies, or copies of ones that then failed taken for new).

        Access: a shared producer is refused while one has exclusive access;
        an exclusive one while any other is connected (WAIT_FOR_EXCLUSIVE
        is told to wait instead); EXCLUSIVE_WITH_FENCING takes the partition
        from the others, which the driver closes (`take_fenced`)."""
        if self.stopped is not None:
            return ProducerAnswer.FENCED, -1
        if producer_id in self.producers:
            return ProducerAnswer.BUSY, -1
        others = [other for other in self.producers if other != producer_id]
        if self.exclusive is not None and access is not AccessMode.EXCLUSIVE_WITH_FENCING:
            return ProducerAnswer.EXCLUDED, -1
        if access is AccessMode.EXCLUSIVE and others:
            return ProducerAnswer.EXCLUDED, -1
        if access is AccessMode.WAIT_FOR_EXCLUSIVE and others:
            return ProducerAnswer.WAIT_EXCLUSIVE, -1
        if access is AccessMode.SHARED and self.fenced_by is not None:
            return ProducerAnswer.EXCLUDED, -1
        last_sequence_id = self.resume_after(producer_id)
        if last_sequence_id is None:
            return ProducerAnswer.WAIT, -1
        if access is AccessMode.EXCLUSIVE_WITH_FENCING:
            self._to_close += [self.producers.pop(other) for other in others]
            self.fenced_by = producer_id
        if access is not AccessMode.SHARED:
            self.exclusive = producer_id
            self.topic_epoch += 1
        self.producers[producer_id] = link
        return ProducerAnswer.OK, last_sequence_id

    def take_fenced(self) -> list[Link]:
        """The producers an exclusive one fenced out, to be closed (once)."""
        fenced, self._to_close = self._to_close, []
        return fenced

    def resume_after(self, producer_id: str) -> int | None:
        """What a (re)connecting producer continues after, once known."""
        if self._batches_taken.get(producer_id):
            return None
        return self.dedup.last_persisted(producer_id)

    def remove_producer(self, producer_id: str, link: Link) -> bool:
        """A producer went away; True if it was registered (producers
        waiting for exclusive access may ask again)."""
        if self.producers.get(producer_id) is not link:
            return False
        del self.producers[producer_id]
        if self.exclusive == producer_id:
            self.exclusive = None
            self.fenced_by = None
        return True

    def last_persisted(self, producer_id: str) -> int:
        return self.dedup.last_persisted(producer_id)

    # --- batches -----------------------------------------------------------------------------

    def taken(self, producer_id: str) -> None:
        """A batch was taken from the producer's connection (queued for the
        appender); `finished` once it is answered, whatever the answer."""
        self._batches_taken[producer_id] = self._batches_taken.get(producer_id, 0) + 1

    def finished(self, producer_id: str) -> bool:
        """A taken batch was answered (or dropped); True when it was the
        producer's last one (a producer waiting to register may ask again)."""
        remaining = self._batches_taken[producer_id] - 1
        if remaining:
            self._batches_taken[producer_id] = remaining
            return False
        del self._batches_taken[producer_id]
        return True

    def judged_sequence_id(self, first_sequence_id: int, last_sequence_id: int) -> int:
        """The sequence id deduplication judges a batch by: its highest."""
        return last_sequence_id

    def judge(self, producer_id: str, first_sequence_id: int, last_sequence_id: int, *,
              stored_bytes: int, backlog_quota_bytes: int | None, partial_chunk: bool = False) -> Judgement:
        """What a batch taken from `producer_id` gets, right before it would
        be appended. `partial_chunk`: a chunk of a chunked message other
        than its last, which shares its message's sequence id: taken without
        deduplication, as Pulsar does (the message is judged by its last
        chunk, and a consumer drops a chunk it holds already)."""
        if self.stopped is not None:
            return Judgement(BrokerStatus.TOPIC_FENCED, f"partition {self.name} is being unloaded")
        if backlog_quota_bytes is not None and stored_bytes >= backlog_quota_bytes:
            return Judgement(BrokerStatus.PARTITION_OVERFLOW,
                             f"partition overflow: {self.name} has a backlog of {stored_bytes} bytes, its backlog quota is "
                             f"{backlog_quota_bytes} (acknowledge messages, or raise the quota)")
        if not self.deduplication or partial_chunk:
            return TAKE
        sequence_id = self.judged_sequence_id(first_sequence_id, last_sequence_id)
        verdict = self.dedup.check(producer_id, sequence_id)
        if verdict is Verdict.DUPLICATE:
            return Judgement(BrokerStatus.DUPLICATE, f"sequence id {sequence_id} of {producer_id!r} was persisted before")
        if verdict is Verdict.IN_FLIGHT:
            return Judgement(BrokerStatus.RETRY, f"sequence id {sequence_id} of {producer_id!r} is being written")
        return TAKE_DEDUPLICATED

    def pushed(self, producer_id: str, first_sequence_id: int, last_sequence_id: int, judgement: Judgement) -> None:
        """A judged batch goes to the ledger now (no scheduling point between
        `judge` and this, other than the appender's own)."""
        if judgement.deduplicated:
            self.dedup.pushed(producer_id, self.judged_sequence_id(first_sequence_id, last_sequence_id))

    def persisted(self, producer_id: str, first_sequence_id: int, last_sequence_id: int, position: tuple[int, int],
                  judgement: Judgement) -> bool:
        """A pushed batch is durable at `position` (in append order). True
        when a snapshot of the map is due: write `next_snapshot()`."""
        self.last_position = position
        if not judgement.deduplicated:
            return False
        self.dedup.persisted(producer_id, self.judged_sequence_id(first_sequence_id, last_sequence_id))
        self._entries_since_snapshot += 1
        if self._entries_since_snapshot < self.snapshot_entries:
            return False
        self._entries_since_snapshot = 0
        self._snapshot_pending = self.dedup.snapshot(*position)
        return True

    def failed(self, producer_id: str, judgement: Judgement) -> None:
        """A pushed batch failed (the partition is fenced by it)."""
        if judgement.deduplicated:
            self.dedup.failed(producer_id)

    # --- snapshots ---------------------------------------------------------------------------

    def final_snapshot(self) -> DedupSnapshot | None:
        """A graceful unload: the snapshot of everything persisted, to write
        if it is not written yet (and no other write is in flight)."""
        if not self.deduplication or self.last_position is None:
            return None
        written = self._snapshot_written
        if written is not None and (written.ledger_id, written.entry_id) == self.last_position:
            return None
        self._snapshot_pending = self.dedup.snapshot(*self.last_position)
        return self.next_snapshot()

    def next_snapshot(self) -> DedupSnapshot | None:
        """The newest snapshot not yet written, to write now (one write at a
        time: None while one is in flight or when there is nothing new)."""
        snapshot = self._snapshot_pending
        if self._snapshot_writing is not None or snapshot is None or snapshot is self._snapshot_written:
            return None
        self._snapshot_writing = snapshot
        return snapshot

    def snapshot_written(self, snapshot: DedupSnapshot, version: int) -> DedupSnapshot | None:
        """A snapshot write succeeded; returns the next one to write, if a newer one is due."""
        assert self._snapshot_writing is snapshot, "a snapshot written that was not being written"
        self._snapshot_writing = None
        self._snapshot_written = snapshot
        self.snapshot_version = version
        return self.next_snapshot()

    def snapshot_failed(self, snapshot: DedupSnapshot) -> None:
        """A snapshot write failed: the driver fences the partition (its
        version may have moved under another owner)."""
        assert self._snapshot_writing is snapshot, "a snapshot failed that was not being written"
        self._snapshot_writing = None

    # --- stopping ----------------------------------------------------------------------------

    def stop(self, reason: str) -> None:
        """Take no more batches (fenced or unloading). The producers stay
        registered until the driver has told them to look the partition up
        again (`forget_producers`)."""
        if self.stopped is None:
            self.stopped = reason

    def forget_producers(self) -> dict[str, Link]:
        """The producers, let go of (the driver tells each to look the partition up again)."""
        producers, self.producers = self.producers, {}
        self.exclusive = self.fenced_by = None
        return producers

    @property
    def producer_count(self) -> int:
        return self.dedup.producer_count


__all__ = ["DEDUP_SNAPSHOT_ENTRIES", "TAKE", "TAKE_DEDUPLICATED", "AccessMode", "Judgement", "ProducerAnswer", "PublishCore"]
