"""Hostile frames against a real bookie and a real broker (both its
protocols, quire's and Pulsar's): random bytes,
truncations, values nested at many depths, wrong types, huge declared counts
and lengths, valid requests with invalid fields (sim/frame_fuzz.py). Each
case closes only its own connection: after every batch the process is still
running and serves a normal add (bookie) or produce and consume (broker).

The default suite sends a few thousand cases per process; `-m slow` sends
100,000."""

from __future__ import annotations

import random

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from broker.client import Client
from sim.frame_fuzz import BOOKIE, BROKER, PULSAR, fuzz_case, send_case
from tests.integration.bookie_processes import bookie_takes_an_add
from tests.integration.broker_processes import shared_cluster  # noqa: F401 (a fixture)

CASES_DEFAULT = 2_000
CASES_SLOW = 100_000
CHECK_EVERY = 500  # cases between checks that the process still serves


def _broker_serves(cluster, topic: str) -> None:
    async def produce_and_consume() -> None:
        with trio.fail_after(30):
            async with Client.connect(cluster.zk_hosts, cluster.root) as client:
                producer = await client.create_producer(topic, producer_id=f"{topic}-producer")
                await producer.send(b"check")
                consumer = await client.subscribe(topic, "check", initial_position="earliest")
                message = await consumer.receive()
                assert message.data == b"check"
                await consumer.acknowledge(message)

    trio.run(produce_and_consume)


def _pulsar_client_serves(url: str, topic: str) -> None:
    import pulsar

    client = pulsar.Client(url, operation_timeout_seconds=20, logger=pulsar.ConsoleLogger(pulsar.LoggerLevel.Error))
    try:
        consumer = client.subscribe(f"persistent://public/default/{topic}", "check")
        client.create_producer(f"persistent://public/default/{topic}").send(b"check")
        message = consumer.receive(20_000)
        assert message.data() == b"check"
        consumer.acknowledge(message)
    finally:
        client.close()


def _fuzz(cluster, protocol: str, cases: int) -> None:
    process = cluster.bookies[0] if protocol == BOOKIE else cluster.brokers[0]
    host, port = process.address.rsplit(":", 1)
    if protocol == PULSAR:
        port = process.pulsar_port
    sent = {"cases": 0, "checks": 0}

    def check() -> None:
        assert process.running, f"{protocol} exited:\n{process.log_tail()}"
        sent["checks"] += 1
        if protocol == BOOKIE:
            bookie_takes_an_add(process.address, (1 << 50) + sent["checks"])
        elif protocol == PULSAR:
            _pulsar_client_serves(process.pulsar_url, f"fuzz-pulsar-check-{sent['checks']}")
        else:
            _broker_serves(cluster, f"fuzz-check-{sent['checks']}")

    @settings(max_examples=cases, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(st.randoms(use_true_random=False))
    def one_case(rng: random.Random) -> None:
        case = fuzz_case(rng, protocol)
        try:
            send_case(host, int(port), protocol, case)
        except ConnectionRefusedError:
            raise AssertionError(f"{protocol} refuses connections after a {case.kind} case:\n{process.log_tail()}")
        sent["cases"] += 1
        if sent["cases"] % CHECK_EVERY == 0:
            check()

    check()
    one_case()
    check()
    assert sent["cases"] >= cases // 2  # hypothesis may stop early only on a tiny space


@pytest.mark.parametrize("protocol", [BOOKIE, BROKER, PULSAR])
def test_hostile_frames_close_only_their_own_connection(shared_cluster, protocol):
    _fuzz(shared_cluster, protocol, CASES_DEFAULT)


@pytest.mark.slow(seconds=380)
@pytest.mark.parametrize("protocol", [BOOKIE, BROKER, PULSAR])
def test_a_hundred_thousand_hostile_frames(shared_cluster, protocol):
    _fuzz(shared_cluster, protocol, CASES_SLOW)


def test_the_frame_that_killed_processes_closes_only_its_connection(shared_cluster):
    # About 1,000 levels of nesting in 1 KB: formatting the bad value for
    # the error message overflowed the stack, on a bookie in a request and
    # on a broker as the first frame.
    from sim.frame_fuzz import FuzzCase, handshake, nested

    body = b"\x95" + nested(1000, 1) + b"\x01\x00\xc4\x00\xc4\x00"
    deep = len(body).to_bytes(4, "big") + body
    bookie, broker = shared_cluster.bookies[0], shared_cluster.brokers[0]
    for process, protocol, with_handshake in ((bookie, BOOKIE, True), (bookie, BOOKIE, False), (broker, BROKER, False),
                                              (broker, BROKER, True)):
        host, port = process.address.rsplit(":", 1)
        send_case(host, int(port), protocol, FuzzCase("nested", with_handshake, deep))
        assert process.running, process.log_tail()
    assert handshake(BOOKIE) and handshake(BROKER)
    bookie_takes_an_add(bookie.address, 1 << 51)
    _broker_serves(shared_cluster, "fuzz-deep-check")
