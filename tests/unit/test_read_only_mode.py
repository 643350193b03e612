"""Why a bookie is read-only (bookie.read_only_mode): causes come and go,
the reason lists them most serious first, a change is reported once per
change of causes (not when a percentage moves), and failures that need a
restart stay."""

from __future__ import annotations

import pytest

from bookie.read_only_mode import UNTIL_RESTARTED, Cause, ReadOnlyMode


def test_a_fresh_bookie_is_writable_with_no_reason():
    mode = ReadOnlyMode()
    assert not mode.read_only and mode.reason == "" and mode.causes == frozenset()


def test_the_disk_turns_it_read_only_and_back():
    mode = ReadOnlyMode()
    change = mode.set(Cause.DISK_FULL, "disk 97.0% full, threshold 95.0%")
    assert change is not None and change.turned and change.read_only
    assert change.describe() == "bookie turns read-only: disk 97.0% full, threshold 95.0%"
    assert mode.reason == "disk 97.0% full, threshold 95.0%"
    change = mode.clear(Cause.DISK_FULL)
    assert change is not None and change.turned and not change.read_only
    assert change.describe() == "bookie turns writable (disk_full cleared)"
    assert mode.reason == ""


def test_a_new_reason_text_for_a_cause_that_holds_is_published_but_no_change():
    # A disk filling by the percent must not log at every check.
    mode = ReadOnlyMode()
    mode.set(Cause.DISK_FULL, "disk 96.0% full, threshold 95.0%")
    assert mode.set(Cause.DISK_FULL, "disk 97.5% full, threshold 95.0%") is None
    assert mode.reason == "disk 97.5% full, threshold 95.0%"
    assert mode.clear(Cause.CHECKPOINT_HELD) is None  # it did not hold


def test_causes_add_up_and_the_mode_turns_writable_only_when_the_last_goes():
    mode = ReadOnlyMode()
    mode.set(Cause.DISK_FULL, "disk 97.0% full, threshold 95.0%")
    change = mode.set(Cause.CHECKPOINT_HELD, "checkpoint held: 6.0 MiB to flush, 3.0 MiB free")
    assert change is not None and not change.turned
    assert change.describe() == (
        "bookie stays read-only, now also for checkpoint_held: "
        "checkpoint held: 6.0 MiB to flush, 3.0 MiB free; disk 97.0% full, threshold 95.0%"
    )
    # Space comes back under the low water mark, but the flush is still held.
    change = mode.clear(Cause.DISK_FULL)
    assert change is not None and not change.turned and mode.read_only
    assert change.describe() == "bookie stays read-only (disk_full cleared): checkpoint held: 6.0 MiB to flush, 3.0 MiB free"
    change = mode.clear(Cause.CHECKPOINT_HELD)
    assert change is not None and change.turned and not mode.read_only


def test_the_reason_lists_what_needs_an_operator_first():
    mode = ReadOnlyMode()
    for cause in reversed(list(Cause)):
        mode.set(cause, cause.value)
    assert mode.reason == "; ".join(cause.value for cause in Cause)
    assert mode.reason.startswith("journal_failed; index_failed; checkpoint_failed")


@pytest.mark.parametrize("cause", sorted(UNTIL_RESTARTED, key=lambda cause: cause.value))
def test_failures_that_need_a_restart_stay_and_keep_their_first_reason(cause):
    mode = ReadOnlyMode()
    mode.set(cause, "first failure")
    assert mode.set(cause, "second failure") is None
    assert mode.clear(cause) is None
    assert mode.read_only and mode.reason == "first failure"


def test_the_causes_that_clear_by_themselves():
    assert set(Cause) - UNTIL_RESTARTED == {Cause.JOURNAL_NO_FILE, Cause.CHECKPOINT_HELD, Cause.DISK_FULL}


def test_a_cause_needs_a_reason():
    with pytest.raises(ValueError):
        ReadOnlyMode().set(Cause.DISK_FULL, "")
