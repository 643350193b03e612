"""The receiving half of a handshake, shared by the bookie, the broker and
their clients: read until the first whole frame is in."""

from __future__ import annotations

from typing import Any

import trio

from bookie.protocol.wire import FrameDecoder

RECEIVE_BYTES = 256 * 1024


async def receive_first_frames(stream: trio.SocketStream, decoder: FrameDecoder) -> list[list[Any]]:
    """Every frame decoded once at least one is whole (a peer may send more
    behind its handshake); [] if the peer closed the connection first.
    Raises ProtocolError for a malformed frame."""
    while True:
        frames = list(decoder.frames())
        if frames:
            return frames
        data = await stream.receive_some(RECEIVE_BYTES)
        if not data:
            return []
        decoder.feed(data)


KEEPALIVE_IDLE_S = 30  # a silent connection is probed after this long
KEEPALIVE_INTERVAL_S = 10
KEEPALIVE_PROBES = 3  # unanswered probes before the kernel drops it


def enable_keepalive(stream: trio.SocketStream) -> None:
    """TCP keepalive on a connection, so that a peer whose host died (no
    FIN, no RST) is found within about a minute instead of never: a broker
    would otherwise keep a dead client's producer id or exclusive
    subscription taken for good."""
    import socket

    stream.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in (("TCP_KEEPIDLE", KEEPALIVE_IDLE_S), ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
                          ("TCP_KEEPCNT", KEEPALIVE_PROBES)):
        if hasattr(socket, option):
            stream.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)
