"""Disk usage of a bookie's directories and the read-only decision it drives:
past `disk_usage_threshold` (or an optional byte quota on the bookie's own
files) the bookie turns read-only; it turns writable again below the low
water mark, so that it does not flap at the boundary."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class DiskUsage:
    used_fraction: float  # the fullest file system among the directories
    free_bytes: int  # the least free space among them
    total_bytes: int
    own_bytes: int  # bytes of the bookie's own files, all directories together


def measure(directories: list[Path], *, count_own_bytes: bool) -> DiskUsage:
    """Blocking (walks directories): call from a worker thread."""
    used_fraction = 0.0
    free_bytes = None
    total_bytes = 0
    seen_devices = set()
    for directory in directories:
        stats = os.statvfs(directory)
        total = stats.f_blocks * stats.f_frsize
        free = stats.f_bavail * stats.f_frsize
        if total:
            used_fraction = max(used_fraction, 1 - free / total)
        free_bytes = free if free_bytes is None else min(free_bytes, free)
        device = os.stat(directory).st_dev
        if device not in seen_devices:
            seen_devices.add(device)
            total_bytes += total
    own_bytes = sum(tree_bytes(directory) for directory in directories) if count_own_bytes else 0
    return DiskUsage(used_fraction, free_bytes or 0, total_bytes, own_bytes)


def ledger_disk_room(ledger_dir: Path, journal_dir: Path) -> tuple[int, bool]:
    """Free bytes on the ledger directory's file system, and whether the
    journal directory shares it. Blocking (a few syscalls): call from a
    worker thread."""
    stats = os.statvfs(ledger_dir)
    shares = os.stat(ledger_dir).st_dev == os.stat(journal_dir).st_dev
    return stats.f_bavail * stats.f_frsize, shares


def tree_bytes(directory: Path) -> int:
    """Disk space the files under `directory` take (allocated blocks)."""
    total = 0
    for root, _, files in os.walk(directory):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total


class ReadOnlyPolicy:
    def __init__(self, *, threshold: float, low_water_mark: float, quota_bytes: int | None) -> None:
        self.threshold = threshold
        self.low_water_mark = low_water_mark
        self.quota_bytes = quota_bytes
        self.read_only = False
        self.reason = ""

    def update(self, usage: DiskUsage) -> bool:
        """Feed a measurement; return whether the bookie should be read-only."""
        over_quota = self.quota_bytes is not None and usage.own_bytes >= self.quota_bytes
        if usage.used_fraction >= self.threshold or over_quota:
            self.read_only = True
            self.reason = (
                f"bookie files use {usage.own_bytes} bytes, quota {self.quota_bytes}"
                if over_quota
                else f"disk {usage.used_fraction:.1%} full, threshold {self.threshold:.1%}"
            )
        elif self.read_only:
            quota_low_water_bytes = None if self.quota_bytes is None else self.quota_bytes * self.low_water_mark / self.threshold
            under_quota = quota_low_water_bytes is None or usage.own_bytes < quota_low_water_bytes
            if usage.used_fraction < self.low_water_mark and under_quota:
                self.read_only = False
                self.reason = ""
            elif not under_quota:
                self.reason = f"bookie files use {usage.own_bytes} bytes, writable again below {quota_low_water_bytes:.0f}"
            else:
                self.reason = f"disk {usage.used_fraction:.1%} full, writable again below {self.low_water_mark:.1%}"
        return self.read_only
