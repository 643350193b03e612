"""A bounded least-recently-used cache of entries read from entry logs,
filled by read-ahead; shared by reader threads, so guarded by a lock."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Iterable


class ReadCache:
    def __init__(self, bytes_max: int) -> None:
        self.bytes_max = bytes_max
        self.bytes = 0
        self._entries: OrderedDict[tuple[int, int], bytes] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, ledger_id: int, entry_id: int) -> bytes | None:
        key = (ledger_id, entry_id)
        with self._lock:
            data = self._entries.get(key)
            if data is not None:
                self._entries.move_to_end(key)
            return data

    def put(self, ledger_id: int, entry_id: int, data: bytes) -> None:
        self.put_many(ledger_id, ((entry_id, data),))

    def put_many(self, ledger_id: int, entries: Iterable[tuple[int, bytes]]) -> None:
        """Entries of one ledger, (entry id, data) each, under one lock."""
        bytes_max = self.bytes_max
        cached = self._entries
        with self._lock:
            for entry_id, data in entries:
                if len(data) > bytes_max:
                    continue
                key = (ledger_id, entry_id)
                previous = cached.pop(key, None)
                if previous is not None:
                    self.bytes -= len(previous)
                cached[key] = data
                self.bytes += len(data)
            while self.bytes > bytes_max:
                _, evicted = cached.popitem(last=False)
                self.bytes -= len(evicted)

    def discard(self, ledger_id: int, entry_id: int) -> None:
        with self._lock:
            previous = self._entries.pop((ledger_id, entry_id), None)
            if previous is not None:
                self.bytes -= len(previous)

    def discard_ledgers(self, ledger_ids: set[int]) -> None:
        with self._lock:
            for key in [key for key in self._entries if key[0] in ledger_ids]:
                self.bytes -= len(self._entries.pop(key))

    def __len__(self) -> int:
        return len(self._entries)
