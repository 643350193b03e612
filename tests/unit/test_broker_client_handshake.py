"""A broker that goes away during the handshake (killed: its socket reset)
is a connection error the client retries, never an escaping exception."""

from __future__ import annotations

import socket
import struct

import pytest
import trio

from broker.client.connection import BrokerConnection
from broker.errors import ConnectionClosedError


async def _listener() -> tuple[trio.SocketListener, str]:
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    return listeners[0], f"127.0.0.1:{port}"


@pytest.mark.parametrize("behaviour", ["reset", "close"])
async def test_a_broker_gone_during_the_handshake_is_a_connection_error(behaviour):
    listener, address = await _listener()

    async def broker() -> None:
        stream = await listener.accept()
        await stream.receive_some(1024)  # the client's CONNECT
        if behaviour == "reset":
            # SO_LINGER 0: closing sends RST, as a killed process's socket does.
            stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        stream.socket.close()

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(broker)
            with pytest.raises(ConnectionClosedError):
                await BrokerConnection.connect(address, "test", frame_bytes_max=1 << 20)
    await listener.aclose()
