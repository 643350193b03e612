"""The read-only decision from disk usage (threshold, low water mark, byte
quota, each with hysteresis) fed with hand-made measurements; and `measure()`
on a real directory."""

from __future__ import annotations

import os
import shutil

import pytest

from bookie.disk_usage import DiskUsage, ReadOnlyPolicy, measure

GIB = 1024**3
MIB = 1024**2


def usage(used_fraction: float = 0.5, own_bytes: int = 0) -> DiskUsage:
    total_bytes = 100 * GIB
    free_bytes = int(total_bytes * (1 - used_fraction))
    return DiskUsage(used_fraction, free_bytes, total_bytes, own_bytes)


def policy(quota_bytes: int | None = None) -> ReadOnlyPolicy:
    return ReadOnlyPolicy(threshold=0.95, low_water_mark=0.90, quota_bytes=quota_bytes)


def feed(read_only_policy: ReadOnlyPolicy, *measurements: DiskUsage) -> list[bool]:
    return [read_only_policy.update(measurement) for measurement in measurements]


# --- disk fraction ----------------------------------------------------------


def test_starts_writable_with_no_reason():
    fresh = policy()
    assert fresh.read_only is False
    assert fresh.reason == ""
    assert fresh.update(usage(0.5)) is False
    assert fresh.reason == ""


def test_turns_read_only_at_the_threshold():
    # The threshold itself counts as full.
    read_only_policy = policy()
    assert feed(read_only_policy, usage(0.5), usage(0.9499), usage(0.95)) == [False, False, True]
    assert read_only_policy.read_only is True


def test_between_low_water_mark_and_threshold_a_writable_bookie_stays_writable():
    # Hysteresis works both ways: filling up to 94% never turned it read-only.
    assert feed(policy(), usage(0.91), usage(0.94), usage(0.92)) == [False, False, False]


def test_read_only_bookie_stays_read_only_until_below_the_low_water_mark():
    # A full disk that frees a little must not flap between the two modes:
    # the bookie only turns writable again once usage is under the low water mark.
    read_only_policy = policy()
    assert feed(
        read_only_policy,
        usage(0.97),  # full
        usage(0.94),  # below the threshold, above the lwm: still read-only
        usage(0.91),
        usage(0.90),  # exactly the lwm is not below it
        usage(0.8999),  # below: writable
        usage(0.94),  # and it takes the threshold again to turn read-only
        usage(0.95),
    ) == [True, True, True, True, False, False, True]


def test_reason_names_the_disk_limit_and_clears_when_writable():
    read_only_policy = policy()
    read_only_policy.update(usage(0.973))
    assert read_only_policy.reason == "disk 97.3% full, threshold 95.0%"
    read_only_policy.update(usage(0.92))
    assert read_only_policy.reason.startswith("disk ")
    read_only_policy.update(usage(0.5))
    assert read_only_policy.reason == ""


# --- byte quota -------------------------------------------------------------


def test_byte_quota_turns_read_only_with_an_empty_disk():
    quota_bytes = 1000 * MIB
    read_only_policy = policy(quota_bytes)
    assert feed(read_only_policy, usage(0.1, quota_bytes - 1), usage(0.1, quota_bytes)) == [False, True]
    assert read_only_policy.reason == f"bookie files use {quota_bytes} bytes, quota {quota_bytes}"


def test_byte_quota_has_its_own_hysteresis():
    # Back to writable only below quota * lwm / threshold (about 94.7% of the
    # quota here), so that deleting one entry log does not make it flap.
    quota_bytes = 1_000_000
    writable_below = quota_bytes * 0.90 / 0.95  # 947_368.4
    read_only_policy = policy(quota_bytes)
    assert feed(
        read_only_policy,
        usage(0.1, quota_bytes + 5),
        usage(0.1, quota_bytes - 1),  # under the quota, but not by enough
        usage(0.1, int(writable_below) + 1),
        usage(0.1, int(writable_below)),  # under the quota's low water mark
        usage(0.1, quota_bytes - 1),  # climbing again: writable until the quota
        usage(0.1, quota_bytes),
    ) == [True, True, True, False, False, True]


def test_quota_of_none_ignores_own_bytes():
    assert feed(policy(None), usage(0.1, 10**15)) == [False]


def test_both_limits_must_clear_before_turning_writable():
    # Read-only for the disk; the disk then empties but the bookie's own files
    # are still above the quota's low water mark: it stays read-only.
    read_only_policy = policy(quota_bytes=1000)
    assert feed(
        read_only_policy,
        usage(0.96, 1000),
        usage(0.5, 960),  # disk fine, quota in its hysteresis band
        usage(0.93, 100),  # quota fine, disk in its hysteresis band
        usage(0.5, 100),
    ) == [True, True, True, False]


def test_reason_says_which_limit_was_hit():
    read_only_policy = policy(quota_bytes=1000)
    read_only_policy.update(usage(0.96, 10))
    assert read_only_policy.reason == "disk 96.0% full, threshold 95.0%"
    # The quota is reported once it is hit, even if the disk is full too.
    read_only_policy.update(usage(0.96, 2000))
    assert read_only_policy.reason == "bookie files use 2000 bytes, quota 1000"
    read_only_policy.update(usage(0.97, 10))
    assert read_only_policy.reason == "disk 97.0% full, threshold 95.0%"


# --- measuring a real directory -------------------------------------------


def write_file(path, size_bytes: int) -> None:
    # Random bytes and fsync, so that neither compression nor delayed
    # allocation hides the blocks from st_blocks.
    with open(path, "wb") as file:
        file.write(os.urandom(size_bytes))
        file.flush()
        os.fsync(file.fileno())


def test_free_and_total_bytes_are_those_of_the_file_system(tmp_path):
    measured = measure([tmp_path], count_own_bytes=False)
    reference = shutil.disk_usage(tmp_path)
    assert measured.total_bytes == reference.total
    # Other processes write to this disk meanwhile: allow some drift.
    drift_bytes = max(256 * MIB, reference.total // 100)
    assert abs(measured.free_bytes - reference.free) <= drift_bytes
    assert 0 < measured.free_bytes <= measured.total_bytes
    assert 0.0 < measured.used_fraction < 1.0
    assert measured.used_fraction == pytest.approx(1 - reference.free / reference.total, abs=0.01)


def test_directories_on_one_file_system_count_its_size_once(tmp_path):
    journal, ledgers = tmp_path / "journal", tmp_path / "ledgers"
    journal.mkdir()
    ledgers.mkdir()
    alone = measure([journal], count_own_bytes=False)
    together = measure([journal, ledgers], count_own_bytes=False)
    assert together.total_bytes == alone.total_bytes
    assert together.used_fraction == pytest.approx(alone.used_fraction, abs=0.01)


def test_own_bytes_grow_when_the_bookie_writes(tmp_path):
    journal, ledgers = tmp_path / "journal", tmp_path / "ledgers"
    (ledgers / "entrylogs").mkdir(parents=True)
    journal.mkdir()
    before = measure([journal, ledgers], count_own_bytes=True).own_bytes
    assert before < 64 * 1024

    write_file(journal / "1.txn", 1 * MIB)
    after_journal = measure([journal, ledgers], count_own_bytes=True).own_bytes
    assert 1 * MIB <= after_journal - before < 2 * MIB

    # Files in subdirectories count too.
    write_file(ledgers / "entrylogs" / "0.log", 2 * MIB)
    after_entry_log = measure([journal, ledgers], count_own_bytes=True).own_bytes
    assert 2 * MIB <= after_entry_log - after_journal < 3 * MIB


def test_counting_own_bytes_can_be_switched_off(tmp_path):
    write_file(tmp_path / "1.txn", 1 * MIB)
    assert measure([tmp_path], count_own_bytes=True).own_bytes >= 1 * MIB
    assert measure([tmp_path], count_own_bytes=False).own_bytes == 0


def test_a_missing_directory_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError):
        measure([tmp_path / "gone"], count_own_bytes=False)
