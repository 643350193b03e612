"""The simulated entry log's two kinds of corruption: bad bytes its own
checksum catches (the bookie answers IO_ERROR), and bad bytes served as
intact (a checksum written over them), which only a reader's digest can tell."""

from __future__ import annotations

import pytest

from bookie.sim_storage import SimEntryLog
from bookie.storage_interfaces import CorruptEntryError


def test_bad_bytes_served_as_intact_pass_the_entry_logs_checksum():
    entry_log = SimEntryLog()
    first = entry_log.append(1, 0, b"entry zero")
    second = entry_log.append(1, 1, b"entry one")
    entry_log.sync()
    assert entry_log.corrupt(1, 0) == 1
    with pytest.raises(CorruptEntryError):
        entry_log.read(first, 1, 0)
    assert entry_log.corrupt_served(1, 1) == 1
    assert entry_log.read(second, 1, 1) == b"\x9antry one"
    assert entry_log.intact_copy(second, 1, 1) == b"\x9antry one"
