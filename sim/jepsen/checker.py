"""The checker of a Jepsen-style history: finds acknowledged entries lost,
payloads duplicated or reordered, reads that disagree, and phantom data, each
reported with its ledger, entry, payload and operation indexes. The verdict
is VALID only when nothing is wrong and every acknowledged add was checked
against a final read of its ledger; INCOMPLETE when some were not."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from operator import itemgetter
from typing import Any, Iterable

from sim.jepsen.history import (
    HistoryFormatError,
    Operation,
    OperationPair,
    integer_value,
    pair_operations,
)

# The kinds and the summary's length, shared with the broker run's checker,
# are still named here (noqa: they are not used, only re-exported).
from sim.jepsen.verdict import (  # noqa: F401
    ANOMALY_KINDS,
    INVALIDATING_KINDS,
    SUMMARY_EXAMPLES_MAX,
    AnomalyText,
    CheckResultBase,
    count_faults,
)


@dataclass(frozen=True, slots=True)
class Anomaly(AnomalyText):
    PLACES = (("ledger", "ledger {}"), ("entry", "entry {}"), ("payload", "payload {!r}"))

    kind: str
    detail: str
    ledger: int | None = None
    entry: int | None = None
    payload: str | None = None
    operation_indexes: tuple[int, ...] = ()  # the records that show it


@dataclass(slots=True)
class CheckResult(CheckResultBase[Anomaly]):
    adds_invoked: int = 0
    adds_ok: int = 0
    adds_fail: int = 0
    adds_info: int = 0  # indeterminate, including adds the run cut short
    adds_info_read: int = 0  # indeterminate adds found in some read
    adds_fail_read: int = 0  # failed adds found in some read (see check())
    reads_ok: int = 0
    reads_final: int = 0
    recoveries_ok: int = 0  # recover operations that closed (or found closed) a ledger
    ledgers: int = 0
    ledgers_acked: int = 0  # ledgers with an acknowledged add
    ledgers_acked_final_read: int = 0  # ... of them, read whole after healing

    @property
    def complete(self) -> bool:
        """Every acknowledged add was checked against a final read."""
        return not self.unseen and self.ledgers_acked_final_read == self.ledgers_acked

    def count_lines(self) -> list[str]:
        return [
            f"adds: {self.adds_invoked} invoked, {self.adds_ok} ok, {self.adds_fail} fail, "
            f"{self.adds_info} info ({self.adds_info_read} of them read, {self.adds_fail_read} failed adds read)",
            f"reads: {self.reads_ok} ok ({self.reads_final} final); recoveries: {self.recoveries_ok} ok; "
            f"ledgers: {self.ledgers}, {self.ledgers_acked} with acknowledged adds, "
            f"{self.ledgers_acked_final_read} of them read whole after healing; faults: {self.faults_text()}",
        ]


@dataclass(slots=True)
class _Add:
    process: str
    sequence: int  # position among its writer's add invokes
    invoke_index: int
    outcome: str
    ledger: int | None = None  # where the add was acknowledged, when it was
    entry: int | None = None
    completion_index: int | None = None
    read: bool = False


@dataclass(frozen=True, slots=True)
class _ClosedClaim:
    last_entry: int
    operation_index: int
    source: str  # "read", "recover" or "close"


@dataclass(frozen=True, slots=True)
class _FinalRead:
    operation_index: int
    last_entry: int
    payloads: dict[int, str]  # entry -> payload


class _Checker:
    """One pass over the pairs gathering facts, then a pass per anomaly kind
    over what was gathered; every pass is linear in what it walks."""

    def __init__(self) -> None:
        self.result = CheckResult()
        self.adds: dict[str, _Add] = {}  # payload -> its add
        self.add_invokes_by_process: Counter[str] = Counter()
        self.ledgers: set[int] = set()
        # (ledger, entry) -> (payload, operation index) of the first read of it.
        self.first_read: dict[tuple[int, int], tuple[str, int]] = {}
        self.inconsistent_positions: set[tuple[int, int]] = set()
        # payload -> first (ledger, entry, operation index) a read put it at.
        self.read_position: dict[str, tuple[int, int, int]] = {}
        self.duplicated_positions: set[tuple[str, int, int]] = set()
        self.unexpected_payloads: set[str] = set()
        self.reordered_pairs: set[tuple[int, str, str]] = set()
        self.closed_claims: dict[int, list[_ClosedClaim]] = {}
        # ledger -> highest entry an open (not yet closed) read returned.
        self.open_read_highest: dict[int, tuple[int, int]] = {}
        self.final_reads: dict[int, list[_FinalRead]] = {}

    def report(self, kind: str, detail: str, **where: Any) -> None:
        self.result.anomalies(kind).append(Anomaly(kind, detail, **where))

    # --- gathering ------------------------------------------------------------------

    def gather(self, operations: list[Operation]) -> None:
        self.result.faults_by_kind = count_faults(operations)
        pairs = pair_operations(operations)
        # Adds first: a read may come before the completion of the add it
        # sees, and telling phantom data from real needs every add invoked.
        for pair in pairs:
            if pair.invoke.f == "add":
                self.gather_add(pair)
        for pair in pairs:
            if pair.invoke.f == "read" and pair.outcome == "ok":
                self.gather_read(pair.completion)
            elif pair.invoke.f in ("recover", "close") and pair.outcome == "ok":
                completion = pair.completion
                self.result.recoveries_ok += pair.invoke.f == "recover"
                ledger = integer_value(completion, "ledger")
                self.ledgers.add(ledger)
                claim = _ClosedClaim(integer_value(completion, "last_entry"), completion.index, pair.invoke.f)
                self.closed_claims.setdefault(ledger, []).append(claim)
            elif pair.invoke.f == "create" and pair.outcome == "ok":
                self.ledgers.add(integer_value(pair.completion, "ledger"))
        self.result.ledgers = len(self.ledgers)
        self.check_acknowledgement_order(pairs)

    def gather_add(self, pair: OperationPair) -> None:
        invoke = pair.invoke
        payload = invoke.value.get("payload")
        if not isinstance(payload, str):
            raise HistoryFormatError(f"operation {invoke.index}: an add whose payload is not a string")
        if payload in self.adds:
            # Duplicates are found by payload, so payloads must be unique.
            raise HistoryFormatError(
                f"operation {invoke.index}: payload {payload!r} was already added by operation "
                f"{self.adds[payload].invoke_index}"
            )
        sequence = self.add_invokes_by_process[invoke.process]
        self.add_invokes_by_process[invoke.process] += 1
        add = _Add(invoke.process, sequence, invoke.index, pair.outcome)
        self.adds[payload] = add
        self.result.adds_invoked += 1
        if "ledger" in invoke.value:
            self.ledgers.add(integer_value(invoke, "ledger"))
        if pair.outcome == "ok":
            self.result.adds_ok += 1
            add.ledger = integer_value(pair.completion, "ledger")
            add.entry = integer_value(pair.completion, "entry")
            add.completion_index = pair.completion.index
            self.ledgers.add(add.ledger)
        elif pair.outcome == "fail":
            self.result.adds_fail += 1
        else:
            self.result.adds_info += 1

    def gather_read(self, completion: Operation) -> None:
        self.result.reads_ok += 1
        ledger = integer_value(completion, "ledger")
        last_entry = integer_value(completion, "last_entry")
        closed = completion.value.get("closed") is True
        entries = _entries(completion)
        self.ledgers.add(ledger)
        # A read asks for every entry up to the close (or the LAC, when
        # open): it returns them all, in order, or fails.
        if [entry for entry, _ in entries] != list(range(last_entry + 1)):
            self.report(
                "inconsistent",
                f"read of the {'closed' if closed else 'open'} ledger returned entries {_describe_ids(entries)}, "
                f"not 0..{last_entry} in order",
                ledger=ledger,
                operation_indexes=(completion.index,),
            )
        if closed:
            self.closed_claims.setdefault(ledger, []).append(_ClosedClaim(last_entry, completion.index, "read"))
        elif entries:
            highest = max(entry for entry, _ in entries)
            if highest > self.open_read_highest.get(ledger, (-1, -1))[0]:
                self.open_read_highest[ledger] = (highest, completion.index)
        # A final read counts for finding lost adds only when it read a closed
        # ledger; after healing every ledger should be closed, and one that is
        # not leaves its adds unseen, which the summary shows.
        if completion.value.get("final") is True and closed:
            self.result.reads_final += 1
            final = _FinalRead(completion.index, last_entry, dict(entries))
            self.final_reads.setdefault(ledger, []).append(final)
        for entry, payload in entries:
            self.gather_read_entry(ledger, entry, payload, completion.index)
        self.check_read_order(ledger, entries, completion.index)

    def gather_read_entry(self, ledger: int, entry: int, payload: str, operation_index: int) -> None:
        position = (ledger, entry)
        first = self.first_read.get(position)
        if first is None:
            self.first_read[position] = (payload, operation_index)
        elif first[0] != payload and position not in self.inconsistent_positions:
            self.inconsistent_positions.add(position)
            self.report(
                "inconsistent",
                f"reads disagree: {first[0]!r} and {payload!r}",
                ledger=ledger,
                entry=entry,
                payload=payload,
                operation_indexes=(first[1], operation_index),
            )
        add = self.adds.get(payload)
        if add is None:
            if payload not in self.unexpected_payloads:
                self.unexpected_payloads.add(payload)
                self.report(
                    "unexpected",
                    "read a payload that no add invoked",
                    ledger=ledger,
                    entry=entry,
                    payload=payload,
                    operation_indexes=(operation_index,),
                )
            return
        add.read = True
        seen_at = self.read_position.get(payload)
        if seen_at is None:
            self.read_position[payload] = (ledger, entry, operation_index)
        elif seen_at[:2] != position and (payload, ledger, entry) not in self.duplicated_positions:
            self.duplicated_positions.add((payload, ledger, entry))
            self.report(
                "duplicated",
                f"also read at ledger {seen_at[0]} entry {seen_at[1]}",
                ledger=ledger,
                entry=entry,
                payload=payload,
                operation_indexes=(seen_at[2], operation_index),
            )

    def check_read_order(self, ledger: int, entries: list[tuple[int, str]], operation_index: int) -> None:
        # Walking the read in entry order, each writer's sequence numbers must
        # rise; a payload below the highest seen so far was written earlier
        # but landed later. Reads come back sorted, which Timsort sorts in
        # linear time.
        highest: dict[str, tuple[int, str, int]] = {}  # process -> (sequence, payload, entry)
        for entry, payload in sorted(entries, key=itemgetter(0)):
            add = self.adds.get(payload)
            if add is None:
                continue
            before = highest.get(add.process)
            if before is None or add.sequence > before[0]:
                highest[add.process] = (add.sequence, payload, entry)
            elif add.sequence < before[0] and (ledger, before[1], payload) not in self.reordered_pairs:
                self.reordered_pairs.add((ledger, before[1], payload))
                self.report(
                    "reordered",
                    f"{add.process} wrote it before {before[1]!r}, which is at the lower entry {before[2]}",
                    ledger=ledger,
                    entry=entry,
                    payload=payload,
                    operation_indexes=(add.invoke_index, self.adds[before[1]].invoke_index, operation_index),
                )

    def check_acknowledgement_order(self, pairs: list[OperationPair]) -> None:
        """A writer's acknowledgements of one ledger come in entry order
        (completions are delivered in order): walking them as they were
        recorded, each entry must be above the one before."""
        acknowledged: list[tuple[int, str, _Add]] = []
        for pair in pairs:
            if pair.invoke.f == "add" and pair.outcome == "ok":
                payload = pair.invoke.value["payload"]
                acknowledged.append((pair.completion.index, payload, self.adds[payload]))
        acknowledged.sort(key=itemgetter(0))
        previous: dict[tuple[str, int], tuple[int, str, int]] = {}  # (writer, ledger) -> (entry, payload, index)
        for completion_index, payload, add in acknowledged:
            assert add.ledger is not None and add.entry is not None
            before = previous.get((add.process, add.ledger))
            previous[(add.process, add.ledger)] = (add.entry, payload, completion_index)
            if before is None or add.entry > before[0]:
                continue
            kind, problem = ("inconsistent", "at the same entry") if add.entry == before[0] else ("reordered", "at a higher entry")
            self.report(
                kind,
                f"acknowledged after {before[1]!r}, which was acknowledged {problem} ({before[0]})",
                ledger=add.ledger,
                entry=add.entry,
                payload=payload,
                operation_indexes=(before[2], completion_index),
            )

    # --- judging --------------------------------------------------------------------

    def judge(self) -> None:
        closed_last_entry = self.judge_closed_claims()
        self.judge_open_reads(closed_last_entry)
        ledgers_acked = {add.ledger for add in self.adds.values() if add.outcome == "ok"}
        self.result.ledgers_acked = len(ledgers_acked)
        self.result.ledgers_acked_final_read = len(ledgers_acked.intersection(self.final_reads))
        for payload, add in self.adds.items():
            if add.read and add.outcome == "info":
                self.result.adds_info_read += 1
            elif add.read and add.outcome == "fail":
                self.result.adds_fail_read += 1
            if add.outcome == "ok":
                self.judge_acknowledged(payload, add, closed_last_entry)

    def judge_closed_claims(self) -> dict[int, int]:
        """Every read, recovery and close of a ledger must agree on where it
        ends; returns each ledger's lowest claimed last entry."""
        closed_last_entry: dict[int, int] = {}
        for ledger, claims in self.closed_claims.items():
            last_entries = sorted({claim.last_entry for claim in claims})
            closed_last_entry[ledger] = last_entries[0]
            if len(last_entries) > 1:
                described = ", ".join(f"{claim.source} {claim.last_entry}" for claim in claims)
                self.report(
                    "inconsistent",
                    f"closed with different last entries: {described}",
                    ledger=ledger,
                    operation_indexes=tuple(claim.operation_index for claim in claims),
                )
        return closed_last_entry

    def judge_open_reads(self, closed_last_entry: dict[int, int]) -> None:
        for ledger, (highest, operation_index) in self.open_read_highest.items():
            last_entry = closed_last_entry.get(ledger)
            if last_entry is not None and highest > last_entry:
                self.report(
                    "inconsistent",
                    f"a read of the open ledger returned entry {highest}, beyond its closed last entry {last_entry}",
                    ledger=ledger,
                    entry=highest,
                    operation_indexes=(operation_index,),
                )

    def judge_acknowledged(self, payload: str, add: _Add, closed_last_entry: dict[int, int]) -> None:
        ledger, entry = add.ledger, add.entry
        assert ledger is not None and entry is not None and add.completion_index is not None
        where = {"ledger": ledger, "entry": entry, "payload": payload}
        first = self.first_read.get((ledger, entry))
        if first is not None and first[0] != payload:
            self.report(
                "inconsistent",
                f"acknowledged, but a read returned {first[0]!r} there",
                operation_indexes=(add.completion_index, first[1]),
                **where,
            )
        # Every recovery, close or read of the closed ledger says where it
        # ends: an entry acknowledged beyond that is lost. Acknowledged after
        # a recovery that closed the ledger below it, it shows a fenced
        # writer acknowledged past the close.
        last_entry = closed_last_entry.get(ledger)
        claim = None
        if last_entry is not None and entry > last_entry:
            claim = min(self.closed_claims[ledger], key=lambda claim: (claim.last_entry, claim.operation_index))
            if add.completion_index > claim.operation_index:
                self.report(
                    "lost",
                    f"acknowledged after a {claim.source} closed the ledger at entry {last_entry}: "
                    "a fenced writer was acknowledged past the close",
                    operation_indexes=(claim.operation_index, add.completion_index),
                    **where,
                )
                return
        finals = self.final_reads.get(ledger, [])
        for final in finals:
            if entry > final.last_entry:
                problem = f"the final read ends at entry {final.last_entry}"
            elif final.payloads.get(entry) != payload:
                problem = f"the final read has {final.payloads.get(entry)!r} there"
            else:
                continue
            self.report(
                "lost",
                f"acknowledged, but {problem}",
                operation_indexes=(add.completion_index, final.operation_index),
                **where,
            )
            return
        if claim is not None:
            self.report(
                "lost",
                f"acknowledged, but a {claim.source} closed the ledger at entry {last_entry}",
                operation_indexes=(add.completion_index, claim.operation_index),
                **where,
            )
        elif not finals:
            self.report("unseen", "acknowledged, but no final read of its ledger", operation_indexes=(add.completion_index,), **where)


def _entries(operation: Operation) -> list[tuple[int, str]]:
    raw = operation.value.get("entries")
    if not isinstance(raw, list):
        raise HistoryFormatError(f"operation {operation.index}: a read without an entries list")
    entries = []
    for item in raw:
        if (
            not isinstance(item, (list, tuple))
            or len(item) != 2
            or not isinstance(item[0], int)
            or isinstance(item[0], bool)
            or not isinstance(item[1], str)
        ):
            raise HistoryFormatError(f"operation {operation.index}: entry {item!r} is not an [entry id, payload] pair")
        entries.append((item[0], item[1]))
    return entries


def _describe_ids(entries: list[tuple[int, str]]) -> str:
    ids = [entry for entry, _ in entries]
    if len(ids) > 8:
        return f"{ids[:4]} ... {ids[-2:]} ({len(ids)} in all)"
    return str(ids)


def check(operations: Iterable[Operation]) -> CheckResult:
    """Checks a history. A failed add read back is counted (adds_fail_read)
    but not called an anomaly: an add the client reported failed may still
    have reached the bookies and been kept by recovery."""
    checker = _Checker()
    checker.gather(list(operations))
    checker.judge()
    return checker.result

