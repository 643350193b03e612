"""The double-buffered write cache: durable entries wait here for a checkpoint.

Entries go into the active buffer; a checkpoint swaps it out as the flushing
buffer, writes it sorted by (ledger, entry) into the entry log, and drops it.
Reads consult both. The event loop owns mutation; dict lookups are safe from
reader threads. On a nearly full disk the driver lowers the flush trigger
(`flush_bytes`), so that each flush is small enough to fit.
"""

from __future__ import annotations


class WriteCache:
    def __init__(self, bytes_max: int) -> None:
        if bytes_max < 2:
            raise ValueError("write cache bytes_max must be at least 2")
        self.bytes_max = bytes_max
        self.half_bytes = bytes_max // 2
        self.flush_bytes = self.half_bytes  # the active half is flushed once it holds this much
        self._active: dict[int, dict[int, bytes]] = {}
        self.active_bytes = 0
        self.active_entries = 0
        self._flushing: dict[int, dict[int, bytes]] | None = None
        self.flushing_bytes = 0
        self.flushing_entries = 0

    def put(self, ledger_id: int, entry_id: int, data: bytes) -> None:
        entries = self._active.get(ledger_id)
        if entries is None:
            entries = self._active[ledger_id] = {}
        previous = entries.get(entry_id)
        if previous is None:
            self.active_entries += 1
        else:
            self.active_bytes -= len(previous)
        entries[entry_id] = data
        self.active_bytes += len(data)

    def get(self, ledger_id: int, entry_id: int) -> bytes | None:
        entries = self._active.get(ledger_id)
        if entries is not None:
            data = entries.get(entry_id)
            if data is not None:
                return data
        flushing = self._flushing
        if flushing is not None:
            entries = flushing.get(ledger_id)
            if entries is not None:
                return entries.get(entry_id)
        return None

    def entry_ids(self, ledger_id: int, first_entry_id: int, last_entry_id: int) -> list[int]:
        ids: set[int] = set()
        for buffer in (self._active, self._flushing):
            entries = buffer.get(ledger_id) if buffer is not None else None
            if entries:
                # list() copies the keys in one step under the GIL, so a
                # reader thread never iterates a dict that the loop changes.
                ids.update(entry_id for entry_id in list(entries) if first_entry_id <= entry_id <= last_entry_id)
        return sorted(ids)

    def wants_flush(self) -> bool:
        return self.active_bytes >= self.flush_bytes

    def is_full(self) -> bool:
        """No room: the active half is full and the other is still flushing
        (or held, on a full disk)."""
        return self.active_bytes >= self.flush_bytes and self._flushing is not None

    @property
    def flushing(self) -> bool:
        return self._flushing is not None

    def begin_flush(self) -> dict[int, dict[int, bytes]]:
        """Swap the active buffer out and return it; it is read-only from now
        on, so a checkpoint thread may sort and write it while the loop
        keeps serving reads from it."""
        assert self._flushing is None, "a flush is already in progress"
        self._flushing, self.flushing_bytes, self.flushing_entries = self._active, self.active_bytes, self.active_entries
        self._active, self.active_bytes, self.active_entries = {}, 0, 0
        return self._flushing

    def discard_ledgers(self, ledger_ids: set[int]) -> None:
        """Forget the ledgers' entries, in both buffers (garbage collection).
        The flushing buffer only between tries of a flush (one held for room
        on a full disk), never while one stages or writes it: the caller
        holds the lock checkpoints take."""
        for ledger_id in ledger_ids:
            entries = self._active.pop(ledger_id, None)
            if entries:
                self.active_entries -= len(entries)
                self.active_bytes -= sum(map(len, entries.values()))
            entries = self._flushing.pop(ledger_id, None) if self._flushing is not None else None
            if entries:
                self.flushing_entries -= len(entries)
                self.flushing_bytes -= sum(map(len, entries.values()))

    def end_flush(self) -> None:
        self._flushing = None
        self.flushing_bytes = 0
        self.flushing_entries = 0

