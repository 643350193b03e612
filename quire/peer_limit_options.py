"""The flags that bound what peers may hold of a bookie or a broker
(connections, frames being received, keep-alive), shared by `bookie run`
and `broker run`."""

from __future__ import annotations

import argparse

from framing.peer_limits import (
    CONNECTIONS_MAX_DEFAULT,
    CONNECTIONS_PER_ADDRESS_MAX_DEFAULT,
    FRAME_BUFFER_BYTES_MAX_DEFAULT,
    FRAME_DEADLINE_S_DEFAULT,
)
from quire.cli_parsing import Bounded
from quire.cli_ranges import MEMORY_BYTES_MAX, FRAME_BYTES_MIN

CONNECTIONS_BOUND = 1_000_000  # file descriptors a process may hold, far past what one machine opens
HOUR_MS = 3_600_000
DAY_MS = 24 * HOUR_MS

connections = Bounded("integer", 1, CONNECTIONS_BOUND, why="more connections than a process can open")
frame_buffer_bytes = Bounded("size", FRAME_BYTES_MIN, MEMORY_BYTES_MAX, why="more memory than a machine holds")
frame_deadline = Bounded("duration", 1, HOUR_MS, why="an hour")
requests_per_connection_bound = Bounded("integer", 1, 1_000_000, why="a million requests in flight")
keepalive_interval = Bounded("duration", 100, DAY_MS, why="a day")


def add_peer_limits(parser: argparse.ArgumentParser, *, keepalive: bool, requests_per_connection: int | None) -> None:
    parser.add_argument("--connections-max", type=connections, default=CONNECTIONS_MAX_DEFAULT, metavar="N",
                        help="client connections open at once; a new one past it is closed at once")
    parser.add_argument("--connections-per-ip-max", type=connections, default=CONNECTIONS_PER_ADDRESS_MAX_DEFAULT,
                        metavar="N", help="client connections open at once from one address (Pulsar's maxConnectionsPerIp)")
    parser.add_argument("--frame-buffer-bytes", type=frame_buffer_bytes, default=FRAME_BUFFER_BYTES_MAX_DEFAULT,
                        metavar="SIZE", help="memory for frames being received beyond 16 KiB per connection, all "
                        "connections together; a large frame waits for room (at least --frame-bytes-max)")
    parser.add_argument("--frame-deadline", type=frame_deadline, default=int(FRAME_DEADLINE_S_DEFAULT * 1000),
                        metavar="DURATION", help="a frame, once its first byte arrived, must arrive whole within this "
                        "much waiting, and a client must take some of its answers within it, or its connection is closed")
    if requests_per_connection is not None:
        parser.add_argument("--requests-per-connection-max", type=requests_per_connection_bound,
                            default=requests_per_connection, metavar="N",
                            help="a client's requests read and not yet answered; past it, its next requests wait unread")
    if keepalive:
        parser.add_argument("--keepalive-interval", type=keepalive_interval, default=30_000, metavar="DURATION",
                            help="a client silent this long is sent a PING, and closed after two intervals of silence "
                            "(Pulsar's keepAliveIntervalSeconds)")


def peer_limits_from(arguments: argparse.Namespace) -> dict:
    """The flags above as BookieConfig / BrokerConfig fields."""
    fields = {
        "connections_max": arguments.connections_max,
        "connections_per_address_max": arguments.connections_per_ip_max,
        "frame_buffer_bytes_max": arguments.frame_buffer_bytes,
        "frame_deadline_s": arguments.frame_deadline / 1000,
    }
    if hasattr(arguments, "requests_per_connection_max"):
        fields["requests_per_connection_max"] = arguments.requests_per_connection_max
    if hasattr(arguments, "keepalive_interval"):
        fields["keepalive_interval_s"] = arguments.keepalive_interval / 1000
    return fields
