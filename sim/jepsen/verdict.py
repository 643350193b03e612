"""What the checkers of the ledger run (checker.py) and the broker run
(broker_checker.py) share: the anomaly kinds, how an anomaly reads, a
result's anomalies, faults and verdict, and its summary around what each
checker counted."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import ClassVar, Generic, TypeVar

from sim.jepsen.history import FAULT_START, NEMESIS_PROCESS, Operation

ANOMALY_KINDS = ("lost", "duplicated", "reordered", "inconsistent", "unexpected", "unseen")
# Unseen data makes a history incomplete, not invalid: nothing read it at the
# end (no final read of its ledger, no drain of its subscription that reached
# the end), so there was nothing to check it against.
INVALIDATING_KINDS = ("lost", "duplicated", "reordered", "inconsistent", "unexpected")
SUMMARY_EXAMPLES_MAX = 5


class AnomalyText:
    """The text of an anomaly: where it is, what is wrong and the records
    that show it. A subclass (a frozen dataclass with `detail` and
    `operation_indexes` fields) names in PLACES its location fields, in the
    order they read, each with its template; one that is None is left out."""

    __slots__ = ()
    PLACES: ClassVar[tuple[tuple[str, str], ...]] = ()
    detail: str
    operation_indexes: tuple[int, ...]

    def __str__(self) -> str:
        where = [template.format(value) for name, template in self.PLACES if (value := getattr(self, name)) is not None]
        noun = "operation" if len(self.operation_indexes) == 1 else "operations"
        operations = ", ".join(str(index) for index in self.operation_indexes)
        return f"{' '.join(where) or '-'}: {self.detail} ({noun} {operations or '-'})"


AnomalyT = TypeVar("AnomalyT", bound=AnomalyText)


@dataclass(slots=True)
class CheckResultBase(Generic[AnomalyT]):
    """A checker's result: the anomalies found, by kind, the faults the
    nemesis started, and the verdict. A subclass (a dataclass adding what
    its checker counted) says when it is `complete` and what its summary
    counts (`count_lines`)."""

    lost: list[AnomalyT] = field(default_factory=list)
    unseen: list[AnomalyT] = field(default_factory=list)
    duplicated: list[AnomalyT] = field(default_factory=list)
    reordered: list[AnomalyT] = field(default_factory=list)
    inconsistent: list[AnomalyT] = field(default_factory=list)
    unexpected: list[AnomalyT] = field(default_factory=list)
    faults_by_kind: dict[str, int] = field(default_factory=dict)

    @property
    def valid(self) -> bool:
        """No anomaly found (which says little unless `complete` too)."""
        return not any(getattr(self, kind) for kind in INVALIDATING_KINDS)

    @property
    def complete(self) -> bool:
        raise NotImplementedError

    @property
    def verdict(self) -> str:
        """VALID, INVALID (an anomaly), or INCOMPLETE (no anomaly, but some
        of what was acknowledged was never checked)."""
        if not self.valid:
            return "INVALID"
        return "VALID" if self.complete else "INCOMPLETE"

    def anomalies(self, kind: str) -> list[AnomalyT]:
        if kind not in ANOMALY_KINDS:
            raise ValueError(f"kind must be one of {', '.join(ANOMALY_KINDS)}, got {kind!r}")
        return getattr(self, kind)

    def faults_text(self) -> str:
        return ", ".join(f"{kind} {count}" for kind, count in sorted(self.faults_by_kind.items())) or "none"

    def count_lines(self) -> list[str]:
        """The summary's lines between the verdict and the anomalies."""
        raise NotImplementedError

    def summary(self, examples_max: int = SUMMARY_EXAMPLES_MAX) -> str:
        lines = [
            self.verdict,
            *self.count_lines(),
            "anomalies: " + ", ".join(f"{kind} {len(getattr(self, kind))}" for kind in ANOMALY_KINDS),
        ]
        for kind in ANOMALY_KINDS:
            found = getattr(self, kind)
            for anomaly in found[:examples_max]:
                lines.append(f"  {kind}: {anomaly}")
            if len(found) > examples_max:
                lines.append(f"  {kind}: ... and {len(found) - examples_max} more")
        return "\n".join(lines)


def count_faults(operations: Iterable[Operation]) -> dict[str, int]:
    """How many faults the nemesis started, by kind."""
    counts: dict[str, int] = {}
    for operation in operations:
        if operation.process == NEMESIS_PROCESS and operation.f == FAULT_START:
            fault = str(operation.value.get("fault", "unknown"))
            counts[fault] = counts.get(fault, 0) + 1
    return counts
