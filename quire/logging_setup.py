"""How every quire process logs: one line per record on standard error,
naming the process's role and id, as text or as JSON (`--log-format`).

    2026-11-22T19:00:00.123 INFO bookie 127.0.0.1:3181 bookie.server: message
    {"time": "2026-11-22T19:00:00.123", "level": "INFO", "role": "bookie", "id": "127.0.0.1:3181", ...}
"""

from __future__ import annotations

import json
import logging
import sys
import time

LOG_FORMATS = ("text", "json")


class _ProcessFormatter(logging.Formatter):
    def __init__(self, role: str, process_id: str, log_format: str) -> None:
        super().__init__()
        self.role = role
        self.process_id = process_id or "-"
        self.json = log_format == "json"

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        # ISO 8601 in UTC with milliseconds: sortable across processes and hosts.
        return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        if record.exc_info:
            message += "\n" + self.formatException(record.exc_info)
        if self.json:
            return json.dumps({
                "time": self.formatTime(record), "level": record.levelname, "role": self.role, "id": self.process_id,
                "logger": record.name, "message": message,
            })
        return f"{self.formatTime(record)} {record.levelname} {self.role} {self.process_id} {record.name}: {message}"


class _QuietUntilConnected(logging.Filter):
    """kazoo logs every reconnect attempt. Until the process's first
    ZooKeeper session is established, a refused connection is what the
    startup's own error line reports ("could not reach ZooKeeper at ..."),
    so only errors pass; after it, warnings pass too (a dropped connection
    then matters to an operator). Its INFO lines pass only at debug level."""

    def __init__(self, level: int) -> None:
        super().__init__()
        self.level = level
        self.connected = False

    def filter(self, record: logging.LogRecord) -> bool:
        if not self.connected and record.levelno == logging.INFO and "connection established" in record.getMessage():
            self.connected = True
        threshold = max(self.level, logging.WARNING if self.connected else logging.ERROR)
        return record.levelno >= threshold or self.level <= logging.DEBUG


def configure_logging(level: str, role: str, process_id: str = "", log_format: str = "text") -> None:
    """Set up the root logger of a process once: `role` is zookeeper, bookie,
    broker or a command's name; `process_id` says which one (its address or
    id)."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, got {log_format!r}")
    numeric_level = getattr(logging, level.upper())
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_ProcessFormatter(role, process_id, log_format))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(numeric_level)
    logging.getLogger("kazoo").setLevel(max(logging.WARNING, numeric_level))
    kazoo = logging.getLogger("kazoo.client")
    for old_filter in list(kazoo.filters):
        kazoo.removeFilter(old_filter)
    kazoo.addFilter(_QuietUntilConnected(numeric_level))
    kazoo.setLevel(logging.INFO)  # the filter decides


__all__ = ["LOG_FORMATS", "configure_logging"]
