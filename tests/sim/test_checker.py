"""The simulator's checkers on hand-written stories: each invariant is reported
when broken, and a correct story reports nothing."""

from __future__ import annotations

from bookie.protocol.entry_format import DigestType
from ledger_client.metadata import LedgerMetadata
from sim.checker import SimChecker

BOOKIES = ("a", "b", "c")


def metadata(ledger_id: int = 1, *, closed_at: int | None = None, ensembles=((0, BOOKIES),), quorums=(3, 3, 2)) -> LedgerMetadata:
    ensemble_size, write_quorum, ack_quorum = quorums
    opened = LedgerMetadata(
        ledger_id=ledger_id, ensemble_size=ensemble_size, write_quorum=write_quorum, ack_quorum=ack_quorum,
        ensembles=ensembles, digest_type=DigestType.CRC32C, password_hash=b"", creation_time_ms=0,
    )
    if closed_at is None:
        return opened
    return opened.with_recovery_started().with_closed(closed_at, 0)


class Bookie:
    def __init__(self, name: str, entries: dict) -> None:
        self.name = name
        self.entries = entries

    def durable_entries(self):
        return self.entries


def written(checker: SimChecker, ledger_id: int, count: int) -> None:
    for entry_id in range(count):
        checker.entry_written(ledger_id, entry_id, f"entry-{entry_id}".encode(), f"payload-{entry_id}".encode())


def new_checker() -> SimChecker:
    return SimChecker(lambda: 0.0)


def acknowledge(checker: SimChecker, ledger_id: int, entry_id: int, bookies=BOOKIES[:2], write_set=BOOKIES) -> None:
    """`bookies` took the writer's add, then the writer completed it."""
    for bookie in bookies:
        checker.add_accepted(bookie, ledger_id, entry_id)
    checker.entry_acked(ledger_id, entry_id, "writer-0", write_set)


def test_a_correct_story_reports_nothing():
    # Three entries written and acknowledged, stored on every bookie, read
    # back, and the ledger closed at its last entry.
    checker = new_checker()
    checker.metadata_written(metadata())
    written(checker, 1, 3)
    for entry_id in range(3):
        acknowledge(checker, 1, entry_id)
        checker.entry_read(1, entry_id, f"payload-{entry_id}".encode(), "reader-0", ledger_closed=False)
    stored = {(1, entry_id): f"entry-{entry_id}".encode() for entry_id in range(3)}
    checker.check_durability([Bookie(name, stored) for name in BOOKIES], "a check")
    checker.metadata_written(metadata(closed_at=2))
    assert checker.ok, checker.violations


def test_a_close_below_an_acknowledged_entry_is_reported():
    # Recovery truncated the ledger below an entry the writer saw acknowledged.
    checker = new_checker()
    checker.metadata_written(metadata())
    written(checker, 1, 2)
    acknowledge(checker, 1, 0)
    acknowledge(checker, 1, 1)
    checker.metadata_written(metadata(closed_at=0))
    # An ack quorum took entry 1, so the fenced-writer rule is broken too.
    assert [violation.invariant for violation in checker.violations] == [
        "closed ledger holds every acknowledged entry", "a fenced writer gets no acknowledgement",
    ]


def test_an_acknowledgement_after_the_close_is_reported():
    # The writer learns of an acknowledgement beyond the recovered end.
    checker = new_checker()
    checker.metadata_written(metadata())
    written(checker, 1, 2)
    checker.metadata_written(metadata(closed_at=0))
    acknowledge(checker, 1, 1)
    assert "a fenced writer gets no acknowledgement" in [violation.invariant for violation in checker.violations]


def test_bookies_acknowledging_the_entry_after_the_close_is_reported():
    # An ack quorum of bookies took the writer's entry 1 after recovery closed
    # at 0: whether the writer hears of it is only a race.
    checker = new_checker()
    checker.metadata_written(metadata())
    written(checker, 1, 2)
    acknowledge(checker, 1, 0)
    checker.metadata_written(metadata(closed_at=0))
    checker.add_accepted("a", 1, 1)
    assert checker.ok  # one bookie is below the ack quorum
    checker.add_accepted("b", 1, 1)
    assert [violation.invariant for violation in checker.violations] == ["a fenced writer gets no acknowledgement"]


def test_bookies_beyond_a_gap_cannot_acknowledge_the_writer():
    # Entry 2 has an ack quorum but entry 1 does not: completions are in
    # order, so the writer can never complete 2 and nothing is reported.
    checker = new_checker()
    checker.metadata_written(metadata())
    written(checker, 1, 3)
    acknowledge(checker, 1, 0)
    checker.metadata_written(metadata(closed_at=0))
    checker.add_accepted("a", 1, 1)
    checker.add_accepted("a", 1, 2)
    checker.add_accepted("b", 1, 2)
    assert checker.ok, checker.violations


def test_the_writers_ensemble_counts_not_the_one_a_close_dropped():
    # The writer replaced c by b... at entry 1 (ensemble keyed 1); a close at
    # 0 drops that ensemble. Bookies of the old ensemble that took entry 1
    # before the replacement do not count towards the writer's ack quorum.
    checker = new_checker()
    changed = metadata(ensembles=((0, ("a", "b", "c")), (1, ("a", "b", "d"))))
    checker.metadata_written(changed)
    written(checker, 1, 2)
    acknowledge(checker, 1, 0)
    checker.metadata_written(changed.with_recovery_started().with_closed(0, 0))
    checker.add_accepted("c", 1, 1)
    checker.add_accepted("a", 1, 1)
    assert checker.ok, checker.violations
    checker.add_accepted("d", 1, 1)
    assert not checker.ok


def test_reads_that_disagree_or_differ_from_what_was_written_are_reported():
    checker = new_checker()
    checker.metadata_written(metadata())
    written(checker, 1, 1)
    checker.entry_read(1, 0, b"payload-0", "reader-0", ledger_closed=False)
    checker.entry_read(1, 0, b"something else", "reader-1", ledger_closed=False)
    assert [violation.invariant for violation in checker.violations] == ["reads return what was written", "reads agree"]


def test_an_entry_read_beyond_the_close_is_reported_either_way_round():
    # Read while open, then closed below it...
    checker = new_checker()
    checker.metadata_written(metadata())
    written(checker, 1, 2)
    checker.entry_read(1, 1, b"payload-1", "reader-0", ledger_closed=False)
    checker.metadata_written(metadata(closed_at=0))
    assert [violation.invariant for violation in checker.violations] == ["no entry beyond the close is returned"]
    # ... or read after the close.
    checker = new_checker()
    checker.metadata_written(metadata())
    written(checker, 1, 2)
    checker.metadata_written(metadata(closed_at=0))
    checker.entry_read(1, 1, b"payload-1", "reader-0", ledger_closed=True)
    assert [violation.invariant for violation in checker.violations] == ["no entry beyond the close is returned"]


def test_an_acknowledged_entry_without_an_intact_durable_copy_is_reported():
    # Entry 0 is acknowledged; one copy is corrupt (None), the others are gone.
    checker = new_checker()
    checker.metadata_written(metadata())
    written(checker, 1, 1)
    acknowledge(checker, 1, 0)
    bookies = [Bookie("a", {(1, 0): None}), Bookie("b", {}), Bookie("c", {(1, 0): b"another entry"})]
    checker.check_durability(bookies, "a crash")
    assert [violation.invariant for violation in checker.violations] == ["acknowledged entries stay durable"]
    # One intact copy on a bookie of the write set is enough.
    checker = new_checker()
    checker.metadata_written(metadata())
    written(checker, 1, 1)
    acknowledge(checker, 1, 0)
    checker.check_durability([Bookie("a", {(1, 0): None}), Bookie("c", {(1, 0): b"entry-0"})], "a crash")
    assert checker.ok


def test_a_close_that_changes_is_reported():
    checker = new_checker()
    checker.metadata_written(metadata())
    checker.metadata_written(metadata(closed_at=3))
    checker.metadata_written(metadata(closed_at=2))
    assert "close is final" in [violation.invariant for violation in checker.violations]


def test_an_acknowledgement_without_an_ack_quorum_of_the_write_set_is_reported():
    # The writer completed entry 0 with one bookie's acknowledgement (AQ 2).
    checker = new_checker()
    checker.metadata_written(metadata())
    written(checker, 1, 2)
    acknowledge(checker, 1, 0, bookies=("a",))
    assert [violation.invariant for violation in checker.violations] == ["an acknowledged entry reached an ack quorum"]
    assert "only ['a']" in checker.violations[0].detail


def test_acknowledgements_from_a_replaced_bookie_do_not_count():
    # c took entry 0, then the writer replaced c by d: the write set when it
    # completed is a, b, d, and c's acknowledgement is not one of them.
    checker = new_checker()
    checker.metadata_written(metadata())
    written(checker, 1, 1)
    acknowledge(checker, 1, 0, bookies=("a", "c"), write_set=("a", "b", "d"))
    assert [violation.invariant for violation in checker.violations] == ["an acknowledged entry reached an ack quorum"]
    # With b's acknowledgement too, it did reach AQ 2 of a, b, d.
    checker = new_checker()
    checker.metadata_written(metadata())
    written(checker, 1, 1)
    acknowledge(checker, 1, 0, bookies=("a", "b", "c"), write_set=("a", "b", "d"))
    assert checker.ok, checker.violations


def test_recovery_cannot_decide_an_entry_only_when_the_copies_left_say_neither():
    # E/WQ/AQ 3/3/2: present needs one intact copy, absent needs 2 bookies
    # without the entry; a corrupt copy (None, or other bytes) is neither,
    # and so is a bookie that does not answer (left out of `stored`).
    checker = new_checker()
    checker.metadata_written(metadata())
    written(checker, 1, 1)
    intact, key = b"entry-0", (1, 0)

    def why(a, b, c):
        stored = {
            name: ({} if copy == "none" else {key: copy})
            for name, copy in zip(BOOKIES, (a, b, c)) if copy != "down"
        }
        return checker.recovery_cannot_decide(stored, 1, 0)

    assert why(intact, intact, None) is None  # present
    assert why(intact, "none", None) is None  # one intact copy is enough
    assert why(intact, "down", "down") is None
    assert why("none", "none", None) is None  # absent
    assert why(None, "none", b"bad bytes") is not None  # one "no entry", the rest corrupt
    assert why("none", "down", None) is not None
    assert "no intact copy" in why("none", None, b"bad bytes")
    assert "1 bookies without it (absent needs 2)" in why("none", "down", None)
