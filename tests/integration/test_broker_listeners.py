"""Advertised listeners (Pulsar's advertisedListeners): a broker whose
internal address clients outside its network cannot dial (here a name that
does not resolve) is reached through its external listener, chosen by name
or told by the address a client was given."""

from __future__ import annotations

import subprocess
import sys

import pytest
import trio

from broker.client import Client
from broker.ownership import NoSuchListenerError
from tests.integration.bookie_processes import bookies  # noqa: F401 (a fixture)
from tests.integration.broker_processes import brokers  # noqa: F401 (a fixture)
from tests.support import free_port

pytestmark = pytest.mark.integration


async def test_clients_dial_the_listener_they_name_or_were_given(zk_hosts, zk_root, bookies, brokers):
    for _ in range(3):
        await bookies.started()
    ports = [free_port(), free_port()]
    started = []
    for index, port in enumerate(ports):
        broker = brokers.new("--advertised-address", f"broker-{index}.invalid:{port}",
                             "--advertised-listeners", f"external:127.0.0.1:{port}")
        broker.port = port
        started.append(await broker.started())
    external = ",".join(f"127.0.0.1:{port}" for port in ports)

    # Through ZooKeeper, naming the external listener.
    with trio.fail_after(60):
        async with Client.connect(zk_hosts, zk_root, listener_name="external") as client:
            await client.create_topic("outside", partitions=4)
            producer = await client.create_producer("outside", producer_id="p")
            for number in range(40):
                await producer.send(f"m{number}".encode(), key=f"k{number}")
            brokers_seen = (await client.admin("brokers"))["brokers"]
    assert sorted(broker["listeners"]["external"] for broker in brokers_seen) == sorted(external.split(","))
    assert all(broker["listeners"]["internal"].endswith(".invalid:" + broker["listeners"]["external"].rpartition(":")[2])
               for broker in brokers_seen)

    # Given an external address, a client keeps to that listener unasked:
    # every partition (on either broker) is reached.
    with trio.fail_after(60):
        async with Client.connect(service_url=f"127.0.0.1:{ports[0]}") as client:
            consumer = await client.subscribe("outside", "audit", initial_position="earliest")
            received = set()
            while len(received) < 40:
                message = await consumer.receive()
                received.add(message.data)
                await consumer.acknowledge(message)
    assert received == {f"m{number}".encode() for number in range(40)}

    # A listener no broker advertises is a clear error, not a hang.
    with trio.fail_after(60):
        async with Client.connect(zk_hosts, zk_root, listener_name="nope") as client:
            with pytest.raises(NoSuchListenerError) as raised:
                await client.create_producer("outside", producer_id="q")
    assert "advertises no listener named 'nope'" in str(raised.value)

    # The command line: --service-url with the external address, and --listener-name.
    produced = subprocess.run([sys.executable, "-m", "quire", "produce", "outside", "--service-url", f"127.0.0.1:{ports[1]}",
                               "--count", "5", "--size", "16"], capture_output=True, text=True, timeout=120)
    assert produced.returncode == 0, produced.stderr
    wrong = subprocess.run([sys.executable, "-m", "quire", "produce", "outside", "--zk", zk_hosts, "--root", zk_root,
                            "--listener-name", "nope", "--count", "1"], capture_output=True, text=True, timeout=120)
    assert wrong.returncode == 2 and "advertises no listener named 'nope'" in wrong.stderr, wrong.stderr
    assert "Traceback" not in wrong.stderr
