"""A bookie's configuration: addresses, directories and every bound it runs
under, checked up front so that a bad value is one clear error."""

from __future__ import annotations

import socket
import ssl
from dataclasses import dataclass, field
from pathlib import Path

from bookie.core_actions import CoreLimits
from framing.codec import FRAME_BYTES_MAX_DEFAULT
from framing.peer_limits import (
    CONNECTIONS_MAX_DEFAULT,
    CONNECTIONS_PER_ADDRESS_MAX_DEFAULT,
    FRAME_BUFFER_BYTES_MAX_DEFAULT,
    FRAME_DEADLINE_S_DEFAULT,
)

from security.authentication import Authenticator

MIB = 1024 * 1024


@dataclass(frozen=True)
class BookieConfig:
    journal_dir: Path
    ledger_dir: Path
    zk_hosts: str = "127.0.0.1:2181"
    root: str = "/quire"
    host: str = "127.0.0.1"  # address to listen on
    port: int = 3181
    advertised_host: str | None = None  # address clients use; default: host, or the hostname for 0.0.0.0
    bookie_id: str | None = None  # default: advertised_host:port
    rack: str | None = None
    session_timeout_ms: int = 10_000
    startup_timeout_ms: int = 60_000  # ZooKeeper steps of start-up are retried this long, then it exits (coordination.startup)
    metrics_port: int = 0  # Prometheus /metrics on host:metrics_port; 0: no endpoint and nothing measured
    # wire
    frame_bytes_max: int = FRAME_BYTES_MAX_DEFAULT
    connection_output_bytes_max: int = 16 * MIB  # stop reading a client whose responses pile up
    connections_max: int = CONNECTIONS_MAX_DEFAULT  # open client connections; past it new ones are closed at once
    connections_per_address_max: int = CONNECTIONS_PER_ADDRESS_MAX_DEFAULT  # ... from one client address
    frame_buffer_bytes_max: int = FRAME_BUFFER_BYTES_MAX_DEFAULT  # large frames being received, all connections together
    frame_deadline_s: float = FRAME_DEADLINE_S_DEFAULT  # a frame's bytes, once the first arrived, must all arrive within this
    requests_per_connection_max: int = 32_768  # a client's unanswered requests; past it, its requests are not read
    # journal
    journal_file_bytes_max: int = 256 * MIB
    journal_preallocate_bytes: int = 4 * MIB
    group_wait_ms: float = 0.0  # 0: flush as soon as the previous fsync ends
    group_bytes: int = 1 * MIB
    journal_queue_bytes_max: int = 64 * MIB  # stop reading clients past this much unjournalled data
    journal_inline_fsync: bool = True  # fsync small batches on the idle event loop (see BookieServer._may_fsync_inline)
    journal_inline_fsync_bytes_max: int = 32 * 1024  # a larger batch means load: overlap its fsync with the loop
    journal_inline_fsync_ms_max: float = 10.0  # an inline fsync slower than this sends fsyncs to the thread for a while (InlineFsyncBackoff)
    # ledger storage
    write_cache_bytes: int = 64 * MIB
    read_cache_bytes: int = 32 * MIB
    read_ahead_bytes: int = 256 * 1024
    entry_log_bytes_max: int = 1024 * MIB
    checkpoint_interval_ms: int = 10_000
    read_threads_max: int = 4
    # garbage collection (bookie.garbage_collector)
    gc_interval_s: float = 60.0  # 0: off
    # Compact a log whose live fraction is below this (0: never). One
    # threshold where BookKeeper has two (minor 0.2 hourly, major 0.8 daily):
    # at 0.5, compaction copies at most one byte per byte it frees.
    gc_compaction_threshold: float = 0.5
    gc_compaction_bytes_max: int = 1024 * MIB  # live bytes copied per round (one log at least)
    gc_compaction_stretch_bytes: int = 8 * MIB  # read and copied per hold of the checkpoint lock
    # disks
    disk_usage_threshold: float = 0.95  # fraction of a file system: past it, read-only
    disk_usage_lwm: float = 0.90  # back to writable below it
    disk_quota_bytes: int | None = None  # optional cap on this bookie's own files
    disk_check_interval_ms: int = 1_000
    limits: CoreLimits = field(default_factory=CoreLimits)
    # Ledger clients show a token or a TLS client certificate whose role is
    # one of `client_roles` before any add, read or fence (authenticator
    # off: every client is served, as before security was set up).
    authenticator: Authenticator = field(default_factory=Authenticator)
    client_roles: frozenset[str] = frozenset()
    # TLS on the bookie's port (None: plaintext); a handshake that does not
    # finish within the deadline closes the connection.
    tls_context: ssl.SSLContext | None = None
    tls_handshake_deadline_s: float = 10.0

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        if not 0 <= self.metrics_port < 65536 or self.metrics_port == self.port:
            raise ValueError(f"metrics port must be in 1..65535 (0: off) and differ from the port, got {self.metrics_port}")
        if not self.root.startswith("/") or self.root.endswith("/") and self.root != "/":
            raise ValueError(f"root must be an absolute ZooKeeper path like /quire, got {self.root!r}")
        if not 0 < self.disk_usage_lwm <= self.disk_usage_threshold <= 1:
            raise ValueError(
                f"need 0 < disk_usage_lwm ({self.disk_usage_lwm}) <= disk_usage_threshold ({self.disk_usage_threshold}) <= 1"
            )
        if self.disk_quota_bytes is not None and self.disk_quota_bytes < 1:
            raise ValueError("disk_quota_bytes must be positive")
        if self.frame_bytes_max < 64 * 1024:
            raise ValueError("frame_bytes_max must be at least 64 KiB")
        if self.frame_buffer_bytes_max < self.frame_bytes_max:
            raise ValueError(f"frame_buffer_bytes_max ({self.frame_buffer_bytes_max}) must hold at least one frame "
                             f"of frame_bytes_max ({self.frame_bytes_max})")
        if self.connections_max < 1 or self.connections_per_address_max < 1 or self.requests_per_connection_max < 1:
            raise ValueError("connection and request bounds must be at least 1")
        if not 0 < self.frame_deadline_s <= 3600:
            raise ValueError(f"frame_deadline_s must be in (0, 3600], got {self.frame_deadline_s}")
        if self.write_cache_bytes < 64 * 1024:
            raise ValueError("write_cache_bytes must be at least 64 KiB")
        for name in (
            "session_timeout_ms", "startup_timeout_ms", "connection_output_bytes_max", "journal_queue_bytes_max", "group_bytes",
            "checkpoint_interval_ms", "read_threads_max", "disk_check_interval_ms",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive")
        if self.group_wait_ms < 0:
            raise ValueError("group_wait_ms must not be negative")
        if self.gc_interval_s < 0:
            raise ValueError("gc_interval_s must not be negative (0 turns garbage collection off)")
        if not 0 <= self.gc_compaction_threshold <= 1:
            raise ValueError(f"gc_compaction_threshold must be in [0, 1], got {self.gc_compaction_threshold}")
        if self.gc_compaction_bytes_max < 1 or self.gc_compaction_stretch_bytes < 64 * 1024:
            raise ValueError("gc_compaction_bytes_max must be positive and gc_compaction_stretch_bytes at least 64 KiB")
        if Path(self.journal_dir).resolve() == Path(self.ledger_dir).resolve():
            raise ValueError("journal and ledger directories must differ")

    @property
    def advertised_address(self) -> str:
        host = self.advertised_host
        if host is None:
            host = socket.gethostname() if self.host in ("0.0.0.0", "::", "") else self.host
        return f"{host}:{self.port}"

    @property
    def identity(self) -> str:
        return self.bookie_id or self.advertised_address
