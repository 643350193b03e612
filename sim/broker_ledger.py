"""A simulated broker's managed ledger: the real `ManagedLedgerCore`, its
commands carried out as `broker/managed_ledger.py` carries them out with
trio, over the simulated ZooKeeper and bookies: the chain's record by
compare-and-set, ledgers created and written through the real `WriteCore`
(`sim.write_driver`), the previous owner's ledger fenced and closed through
the real `RecoveryCore` (`sim.recovery_driver`), and entries read back from
the bookies. Entries are in the broker's real format (`encode_entry`), one
producer batch each.

What it reports as the partition's log (for the checker and the
partition): every entry acknowledged to it, in order, and every entry of
the chain it reads at its load, including those a recovery found that
nobody was told of (BookKeeper keeps an entry found by recovery).
"""

from __future__ import annotations

import collections
from typing import Any, Callable

from bookie.protocol.entry_format import DigestManager, DigestType
from bookie.protocol.wire import ReadFlag, ReadRequest, Status
from broker.errors import TopicFencedError
from broker.managed_ledger_core import (
    ClosedDone,
    CloseLedger,
    CreateLedger,
    CreateRecord,
    DeleteLedgers,
    Fenced,
    ReadRecord,
    RecoverLedger,
    Writable,
    WriteRecord,
)
from broker.message_format import body_items, decode_entry, entry_of
from broker.pulsar_message import OutMessage
from broker.topic_records import ManagedLedgerRecord, TopicPolicies, managed_ledger_path
from coordination.store import BadVersionError, NodeExistsError, NoNodeError
from ledger_client.errors import BKError, NotEnoughBookiesError
from ledger_client.ledger_store import LedgerStore
from ledger_client.metadata import LedgerMetadata, password_hash
from ledger_client.placement import choose_ensemble
from ledger_client.recovery_core import RecoveryDone
from sim.broker_calls import LogEntry
from sim.broker_messages import PARTITION
from sim.recovery_driver import RecoveryDriver, intact
from sim.write_driver import WriteDriver
from sim.writer import MASTER_KEY, PASSWORD

READ_RETRY_MS = 100.0
READ_TRIES_MAX = 20  # per entry, each over every bookie of its write set; then the load fails
RECOVERY_MS_MAX = 10_000.0  # a recovery not done by then fails the load

OnAppended = Callable[[LogEntry | None, bool], None]


def entry_bytes(producer_id: str, sequence_ids: tuple[int, ...], keys: tuple[str | None, ...], first_offset: int,
                publish_ms: int) -> bytes:
    """A producer batch as the broker stores it (each message's sequence id in its metadata)."""
    return entry_of(producer_id, first_offset, publish_ms,
                    [OutMessage(sequence_id, b"", key) for sequence_id, key in zip(sequence_ids, keys)], batched=True)


def log_entry(ledger_id: int, entry_id: int, data: bytes) -> tuple[LogEntry, int]:
    """The log's view of a stored entry, and its publish time."""
    header, body = decode_entry(data)
    sequence_ids = tuple(item[0] for item in body_items(header, bytes(body)))
    keys = header.keys if header.keys is not None else (None,) * header.message_count
    return LogEntry(ledger_id, entry_id, header.producer_id, sequence_ids, tuple(keys), header.first_offset), header.publish_time_ms


class SimManagedLedger:
    def __init__(self, broker: Any, policies: TopicPolicies, *, on_fenced: Callable[[str], None],
                 on_persisted: Callable[[LogEntry], None]) -> None:
        """`broker` is the simulated broker (its ZooKeeper and bookie calls);
        `on_persisted(entry)` hears of every entry of the log as this load
        learns of it, in offset order."""
        self.broker = broker
        self.core = broker.managed_ledger_core_class(PARTITION, policies)
        self.on_fenced = on_fenced
        self.on_persisted = on_persisted
        self.writer: WriteDriver | None = None
        self.recovery: RecoveryDriver | None = None
        self._on_opened: Callable[[str | None, list[LogEntry]], None] | None = None
        self._recovered: dict[int, list[LogEntry]] = {}  # ledgers read while recovering them at the load
        self._waiting: collections.deque[Callable[[], None]] = collections.deque()  # appends waiting for Writable
        self._in_flight: dict[int, tuple[LogEntry, OnAppended]] = {}  # entry id of the open ledger -> its append
        self._closing_ledger = False
        self._on_closed: Callable[[], None] | None = None
        self.stopped = False  # the broker let the load go (crash): nothing more is carried out

    @property
    def world(self):
        return self.broker.world

    # --- opening ------------------------------------------------------------------------------

    def open(self, on_opened: Callable[[str | None, list[LogEntry]], None]) -> None:
        """Open the chain (fencing the previous owner); `on_opened(error,
        entries)` with every entry it holds, read from the bookies."""
        self._on_opened = on_opened
        self._run(self.core.open())

    def _opened(self) -> None:
        """The core is writable: read the closed ledgers of the chain."""
        ledgers = [info for info in self.core.record.ledgers if info.is_closed]
        entries: list[LogEntry] = []

        def next_ledger(index: int) -> None:
            if index == len(ledgers):
                return self._open_done(None, entries)
            info = ledgers[index]
            known = self._recovered.get(info.ledger_id)
            if known is not None or not info.entries:
                entries.extend(known or [])
                return next_ledger(index + 1)

            def read(found: list[LogEntry] | None) -> None:
                if found is None:
                    return self._open_done(f"entries of ledger {info.ledger_id} unreadable", [])
                entries.extend(found)
                next_ledger(index + 1)

            self._read_ledger(info.ledger_id, info.entries - 1, read)

        next_ledger(0)

    def _open_done(self, error: str | None, entries: list[LogEntry]) -> None:
        on_opened, self._on_opened = self._on_opened, None
        if on_opened is None or self.stopped:
            return
        if error is None:
            for entry in entries:
                self.on_persisted(entry)
        on_opened(error, entries)

    # --- carrying out the core's commands -------------------------------------------------------

    def _run(self, commands: list) -> None:
        for command in commands:
            self._carry_out(command)

    def _carry_out(self, command: Any) -> None:
        if self.stopped:
            return
        broker = self.broker
        kind = type(command)
        if kind is ReadRecord:
            broker.zk_call(_read_record, self._record_read, "read managed ledger")
        elif kind is CreateRecord:
            broker.zk_call(_create_record, self._record_read, "create managed ledger")
        elif kind is RecoverLedger:
            broker.read_metadata(command.ledger_id, lambda found: self._recover(command.ledger_id, found))
        elif kind is CreateLedger:
            self._create_ledger(command.policies)
        elif kind is WriteRecord:
            broker.zk_call(_write_record(command.record, command.expected_version), self._record_written,
                           f"write managed ledger v{command.expected_version} ({len(command.record.ledgers)} ledgers)")
        elif kind is CloseLedger:
            self._closing_ledger = True
            self._close_when_drained()
        elif kind is DeleteLedgers:
            # Orphans (never recorded) and trimmed ledgers: the simulation
            # keeps them (nothing reads them; the ledger checker keeps its view).
            self.world.log(f"{broker.name} leaves ledgers {list(command.ledger_ids)} out of the chain")
        elif kind is Writable:
            self.world.log(f"{broker.name} writes ledger {command.ledger_id} of the partition")
            if self._on_opened is not None:
                self._opened()
            self._resume_waiting()
        elif kind is Fenced:
            self._fail_waiting()
            self.on_fenced(str(command.error))
            if self._on_opened is not None:
                self._open_done(str(command.error), [])
            on_closed, self._on_closed = self._on_closed, None
            if on_closed is not None:
                on_closed()  # a graceful close given up (ManagedLedger.close returns then too)
        elif kind is ClosedDone:
            self._fail_waiting()
            on_closed, self._on_closed = self._on_closed, None
            if on_closed is not None:
                on_closed()
        else:
            raise AssertionError(f"unknown command {command!r}")

    def _record_read(self, result: Any, error: Exception | None) -> None:
        if self.stopped:
            return
        if error is not None:
            return self._run(self.core.fail(f"reading its ledgers failed: {type(error).__name__}"))
        if result == "exists":  # created meanwhile by another broker: read it
            return self._run([ReadRecord()])
        self._run(self.core.record_read(result))

    def _record_written(self, result: Any, error: Exception | None) -> None:
        if self.stopped:
            return
        if error is not None:
            return self._run(self.core.record_write_failed(isinstance(error, BadVersionError), type(error).__name__))
        self._run(self.core.record_written(result, int(self.world.now_ms)))

    # --- ledgers --------------------------------------------------------------------------------

    def _create_ledger(self, policies: TopicPolicies) -> None:
        broker = self.broker
        try:
            ensemble = choose_ensemble(broker.writable_bookies(), policies.ensemble_size, policies.write_quorum, rng=self.world.rng)
        except NotEnoughBookiesError as error:
            return self._run(self.core.fail(f"creating a ledger failed: {error}"))
        created_ms = int(self.world.now_ms)

        def build(ledger_id: int) -> LedgerMetadata:
            return LedgerMetadata(
                ledger_id=ledger_id, ensemble_size=policies.ensemble_size, write_quorum=policies.write_quorum,
                ack_quorum=policies.ack_quorum, ensembles=((0, tuple(ensemble)),), digest_type=DigestType.CRC32C,
                password_hash=password_hash(PASSWORD), creation_time_ms=created_ms,
                custom_metadata={"partition": PARTITION.encode()},
            )

        checker = broker.ledger_checker

        def create(store) -> tuple[LedgerMetadata, int]:
            metadata, version = LedgerStore(store).create(build)
            checker.metadata_written(metadata)
            return metadata, version

        def created(result: Any, error: Exception | None) -> None:
            if self.stopped:
                return
            if error is not None:
                return self._run(self.core.fail(f"creating a ledger failed: {type(error).__name__}"))
            metadata, version = result
            core = broker.write_core_class(
                metadata, version, DigestManager(metadata.ledger_id, DigestType.CRC32C, PASSWORD),
                bookies=broker.writable_bookies(), rng=self.world.rng, add_timeout_ms=broker.parameters.add_timeout_ms,
            )
            if self.writer is not None:
                self.writer.stopped = True
            driver = self.writer = WriteDriver(
                broker, core, MASTER_KEY, on_completed=lambda entry_ids: self._completed(driver, entry_ids),
                on_failed=lambda entry_ids, error: self._failed(driver, entry_ids, error),
                on_ended=lambda: self._writer_ended(driver), on_progress=self._close_when_drained,
                on_close_failed=lambda error: self._close_failed(driver, error),
            )
            self._in_flight = {}
            self._closing_ledger = False
            self._run(self.core.ledger_created(metadata.ledger_id, int(self.world.now_ms)))

        broker.metadata.call(create, created, "create ledger")

    def _recover(self, ledger_id: int, found: tuple[LedgerMetadata, int] | None) -> None:
        if self.stopped:
            return
        if found is None:
            return self._run(self.core.fail(f"reading ledger {ledger_id} failed"))
        metadata, version = found
        if metadata.is_closed:
            return self._recovered_read(metadata)
        broker = self.broker
        core = broker.recovery_core_class(
            metadata, version, DigestManager(ledger_id, metadata.digest_type, PASSWORD), bookies=broker.writable_bookies(),
            rng=self.world.rng, add_timeout_ms=broker.parameters.add_timeout_ms,
        )
        result: list[Any] = []

        def finished() -> None:
            if self.recovery is not driver or self.stopped:
                return
            self.recovery = None
            driver.stopped = True
            action = result[0]
            if type(action) is RecoveryDone:
                self._recovered_read(action.metadata)
            else:
                self._run(self.core.fail(f"recovering ledger {ledger_id} failed: {type(action.error).__name__}"))

        driver = self.recovery = RecoveryDriver(broker, core, MASTER_KEY, on_result=result.append, on_finished=finished)
        broker.after(RECOVERY_MS_MAX, self._recovery_timed_out, driver)
        driver.start()

    def _recovery_timed_out(self, driver: RecoveryDriver) -> None:
        if self.recovery is driver and not self.stopped:
            self.recovery = None
            driver.stopped = True
            self._run(self.core.fail(f"recovering ledger {driver.core.metadata.ledger_id} took too long"))

    def _recovered_read(self, metadata: LedgerMetadata) -> None:
        """The recovered ledger is closed: read its entries (the last one's
        header says where the chain goes on)."""
        ledger_id, last_entry_id = metadata.ledger_id, metadata.last_entry_id

        def read(entries: list[LogEntry] | None) -> None:
            if entries is None:
                return self._run(self.core.fail(f"entries of ledger {ledger_id} unreadable"))
            self._recovered[ledger_id] = entries
            last_offset = entries[-1].last_offset if entries else None
            self._run(self.core.ledger_recovered(ledger_id, last_entry_id + 1, metadata.length, last_offset,
                                                 self._last_publish_ms, int(self.world.now_ms)))

        self._last_publish_ms: int | None = None
        self._read_ledger(ledger_id, last_entry_id, read)

    def _read_ledger(self, ledger_id: int, last_entry_id: int, on_done: Callable[[list[LogEntry] | None], None]) -> None:
        """Read entries 0..last_entry_id of a closed ledger, each from any
        bookie of its write set (the next one on an error, a timeout or a
        digest mismatch), retried a while."""
        broker = self.broker
        entries: list[LogEntry] = []

        def got_metadata(found: tuple[LedgerMetadata, int] | None) -> None:
            if found is None:
                return on_done(None)
            metadata = found[0]
            digest = DigestManager(ledger_id, metadata.digest_type, PASSWORD)
            read_entry(metadata, digest, 0, 0, 0)

        def read_entry(metadata: LedgerMetadata, digest: DigestManager, entry_id: int, index: int, tries: int) -> None:
            if self.stopped:
                return
            if entry_id > last_entry_id:
                return on_done(entries)
            write_set = metadata.write_set(entry_id)
            if index == len(write_set):
                if tries + 1 >= READ_TRIES_MAX:
                    return on_done(None)
                return broker.after(READ_RETRY_MS, read_entry, metadata, digest, entry_id, 0, tries + 1)
            bookie_id = write_set[index]

            def answered(response: Any) -> None:
                if self.stopped:
                    return
                if response is None or response.status is not Status.OK or not intact(digest, response.entry, entry_id):
                    return read_entry(metadata, digest, entry_id, index + 1, tries)
                data = bytes(digest.decode(response.entry, expected_entry_id=entry_id).data)
                entry, publish_ms = log_entry(ledger_id, entry_id, data)
                entries.append(entry)
                self._last_publish_ms = publish_ms
                read_entry(metadata, digest, entry_id + 1, 0, 0)

            broker.call(bookie_id, lambda request_id: ReadRequest(request_id, ReadFlag.NONE, ledger_id, entry_id, MASTER_KEY),
                        answered)

        if last_entry_id < 0:
            return on_done([])
        broker.read_metadata(ledger_id, got_metadata)

    # --- appending ------------------------------------------------------------------------------

    def append(self, producer_id: str, sequence_ids: tuple[int, ...], keys: tuple[str | None, ...],
               admit: Callable[[], bool], on_done: OnAppended) -> None:
        """Append a producer's batch, in the order asked, waiting while the
        chain changes. Right before it goes to the ledger, `admit()` says
        whether it goes at all (the publishing core's judgement; when it
        says no, it answered the batch). Then `on_done(entry, True)` once
        persisted, `on_done(None, True)` once it failed (in append order);
        `on_done(None, False)` when the managed ledger takes no more appends."""
        core = self.core
        if self._waiting:
            self._waiting.append(lambda: self.append(producer_id, sequence_ids, keys, admit, on_done))
            return
        try:
            slot = core.next_append(int(self.world.now_ms))
        except TopicFencedError:
            return on_done(None, False)
        if slot is None:
            self._waiting.append(lambda: self.append(producer_id, sequence_ids, keys, admit, on_done))
            return
        if not admit():
            return
        data = entry_bytes(producer_id, sequence_ids, keys, slot.first_offset, slot.publish_ms)
        core.appended(slot, len(sequence_ids))
        writer = self.writer
        assert writer is not None and writer.ledger_id == slot.ledger_id
        try:
            entry_id = writer.add(data)
        except BKError as error:
            on_done(None, True)
            return self._run(core.add_failed(slot.ledger_id, type(error).__name__))
        self._in_flight[entry_id] = (LogEntry(slot.ledger_id, entry_id, producer_id, tuple(sequence_ids), tuple(keys),
                                              slot.first_offset), on_done)

    def _completed(self, writer: WriteDriver, entry_ids: list[int]) -> None:
        assert writer is self.writer, "a completion of a ledger this load no longer writes"
        core = self.core
        rollover = False
        for entry_id in entry_ids:
            entry, on_done = self._in_flight.pop(entry_id)
            rollover |= core.add_persisted(entry.ledger_id, entry.first_offset, entry.message_count,
                                           len(writer.payloads.pop(entry_id)), int(self.world.now_ms))
            self.on_persisted(entry)
            on_done(entry, True)
        if rollover:
            self._run(core.rollover(int(self.world.now_ms)))

    def _failed(self, writer: WriteDriver, entry_ids: list[int], error: BKError) -> None:
        assert writer is self.writer, "a failure of a ledger this load no longer writes"
        ledger_id = writer.ledger_id
        for entry_id in entry_ids:
            _, on_done = self._in_flight.pop(entry_id)
            on_done(None, True)
        self._run(self.core.add_failed(ledger_id, type(error).__name__))

    def _close_when_drained(self) -> None:
        """A close waits for the adds in flight (as LedgerHandle.close)."""
        writer = self.writer
        if self._closing_ledger and writer is not None and not writer.core.pending_count and not writer.core.closed:
            self._closing_ledger = False
            writer.close()

    def _writer_ended(self, writer: WriteDriver) -> None:
        if writer is not self.writer or writer.stopped:
            return
        writer.stopped = True  # closed or failed: nothing more comes of it
        if writer.core.closed and writer.core.error is None:
            return self._run(self.core.ledger_closed(int(self.world.now_ms)))
        failed, self._in_flight = self._in_flight, {}
        for _, on_done in failed.values():
            on_done(None, True)
        self._run(self.core.fail(f"ledger {writer.ledger_id} failed: {type(writer.core.error).__name__}"))

    def _resume_waiting(self) -> None:
        """The chain is writable again (or takes no more appends): the
        waiting appends go, in order, until one has to wait again."""
        waiting, self._waiting = self._waiting, collections.deque()
        while waiting:
            waiting.popleft()()
            if self._waiting:  # busy again: the rest waits behind it
                self._waiting.extend(waiting)
                return

    def _close_failed(self, writer: WriteDriver, error: BKError) -> None:
        """The close of the open ledger could not be recorded in its
        metadata (`LedgerHandle.close` raises then): fence, and the next
        owner recovers the ledger."""
        if writer is not self.writer or writer.stopped:
            return
        writer.stopped = True
        self._run(self.core.fail(f"closing ledger {writer.ledger_id} failed: {type(error).__name__}"))

    def _fail_waiting(self) -> None:
        self._resume_waiting()  # each is refused: the core takes no more appends

    def close(self, on_closed: Callable[[], None]) -> None:
        """A graceful unload: close the open ledger and record it closed
        (after a change of the chain under way); `on_closed()` once done or
        given up (the next owner recovers the ledger)."""
        self._on_closed = on_closed
        self._run(self.core.close())

    def stop(self) -> None:
        """The broker crashed: nothing of this load runs any more."""
        self.stopped = True
        for driver in (self.writer, self.recovery):
            if driver is not None:
                driver.stopped = True


def _read_record(store) -> tuple[ManagedLedgerRecord, int] | None:
    try:
        data, stat = store.get(managed_ledger_path(PARTITION))
    except NoNodeError:
        return None
    return ManagedLedgerRecord.from_bytes(data), stat.version


def _create_record(store) -> tuple[ManagedLedgerRecord, int] | str:
    try:
        store.create(managed_ledger_path(PARTITION), ManagedLedgerRecord().to_bytes(), make_parents=True)
    except NodeExistsError:
        return "exists"
    return ManagedLedgerRecord(), 0


def _write_record(record: ManagedLedgerRecord, expected_version: int):
    def write(store) -> int:
        return store.set(managed_ledger_path(PARTITION), record.to_bytes(), expected_version).version

    return write


__all__ = ["SimManagedLedger", "entry_bytes", "log_entry"]
