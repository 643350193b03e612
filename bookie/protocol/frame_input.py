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
