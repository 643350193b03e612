"""`quire topic create|ls|stats|delete|set-policies|unload`, `quire produce`
and `quire consume`: topics from the command line, through the brokers."""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import sys
import time
from typing import AsyncIterator, Awaitable, Callable

import trio

from broker.client.producer import MESSAGE_BYTES_MAX
from broker.codecs import Codec
from ledger_client.exception_groups import unwrap_single_exception
from quire import cli_ranges as ranges
from quire.broker_commands import add_policies, check_quorums, policies_from
from quire.cli_parsing import HostPorts, UsageError
from quire.security_options import add_credentials, auth_token_from
from quire.logging_setup import configure_logging

GENERATED_MESSAGE_BYTES_DEFAULT = 1024


def add_brokers(parser: argparse.ArgumentParser) -> None:
    """How a client command finds the brokers."""
    parser.add_argument("--service-url", type=HostPorts("broker"), help="HOST:PORT[,HOST:PORT] of brokers (default: find them through ZooKeeper)")
    parser.add_argument("--listener-name", metavar="NAME",
                        help="which of the brokers' advertised listeners to dial, e.g. external (default: the one --service-url "
                             "belongs to, else internal)")
    add_credentials(parser)


def add_topic(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("topic", metavar="TOPIC", help="the topic's name")
    add_brokers(parser)


def add_create(parser: argparse.ArgumentParser) -> None:
    add_topic(parser)
    parser.add_argument("--partitions", type=ranges.partitions, default=0, help="0: not partitioned (default)")
    add_policies(parser, defaults=False)


def add_set_policies(parser: argparse.ArgumentParser) -> None:
    add_topic(parser)
    add_policies(parser, defaults=False)


def add_delete(parser: argparse.ArgumentParser) -> None:
    add_topic(parser)
    parser.add_argument("--force", action="store_true", help="delete even with producers or consumers connected")


def add_ls(parser: argparse.ArgumentParser) -> None:
    add_brokers(parser)
    parser.add_argument("--namespace", metavar="TENANT/NAMESPACE", help="only the topics of this namespace (default: all you may see)")


def add_produce(parser: argparse.ArgumentParser) -> None:
    add_topic(parser)
    parser.add_argument("--count", type=ranges.message_count, help="send this many generated messages instead of standard input's lines")
    parser.add_argument("--size", type=ranges.message_bytes,
                        help=f"with --count: bytes of each generated message (default {GENERATED_MESSAGE_BYTES_DEFAULT})")
    parser.add_argument("--producer-id", help="for exactly-once publishing across runs (default: a new id)")
    parser.add_argument("--key", help="message key (generated messages: KEY-<n %% --keys>)")
    parser.add_argument("--keys", type=ranges.key_count, help="with --key and --count: this many distinct keys (default 1)")
    parser.add_argument("--property", action="append", default=[], metavar="NAME=VALUE", help="a property of every message (repeat for more)")
    parser.add_argument("--codec", choices=[codec.value for codec in Codec], default="none",
                        help="compression of each batch, as Pulsar frames it")
    parser.add_argument("--batching", action="store_true", help="batch messages into entries")
    parser.add_argument("--chunking", action="store_true",
                        help="send messages of more than 5 MiB in chunks that consumers put together (Pulsar's chunking)")
    parser.add_argument("--window", type=ranges.window, default=1000, help="messages in flight (default 1000)")


def add_consume(parser: argparse.ArgumentParser) -> None:
    add_topic(parser)
    parser.add_argument("--subscription", "-s", required=True, help="the durable subscription's name (created if new)")
    parser.add_argument("--type", choices=["exclusive", "failover", "shared", "key_shared"], default="exclusive", help="subscription type")
    parser.add_argument("--count", type=ranges.message_count, help="stop after this many messages")
    parser.add_argument("--initial-position", choices=["earliest", "latest"], default="earliest",
                        help="where a new subscription starts (default: earliest)")
    parser.add_argument("--idle-timeout", type=ranges.delay, default=None, metavar="DURATION",
                        help="stop once no message came for this long (default: wait for ever, or --count)")
    parser.add_argument("--format", choices=["text", "json"], default="text", help="text: message id, offset, key and payload per line; json: one object per message")
    parser.add_argument("--no-ack", action="store_true", help="do not acknowledge what is printed")
    parser.add_argument("--important", action="store_true", help="a new subscription holds its unacknowledged messages against retention")
    parser.add_argument("--read-compacted", action="store_true",
                        help="read the topic's compacted view (the latest message of each key) first, then what follows it "
                             "(exclusive and failover)")


@contextlib.asynccontextmanager
async def _client(arguments: argparse.Namespace) -> AsyncIterator:
    from broker.client import Client
    from coordination.store import MetadataError
    from quire.security_options import tls_client_context_from

    try:
        async with Client.connect(arguments.zk, arguments.root, service_url=getattr(arguments, "service_url", None),
                                  listener_name=getattr(arguments, "listener_name", None),
                                  auth_token=auth_token_from(arguments),
                                  tls_context=tls_client_context_from(arguments)) as client:
            yield client
    except (MetadataError, ValueError) as error:
        raise UsageError(str(error)) from None


def _run(arguments: argparse.Namespace, body: Callable[..., Awaitable[None]]) -> int:
    from broker.errors import BrokerError

    configure_logging("warning" if arguments.log_level == "info" else arguments.log_level, "client")

    async def go() -> None:
        async with _client(arguments) as client:
            with unwrap_single_exception():
                await body(client)

    try:
        with unwrap_single_exception():
            trio.run(go)
    except BrokerError as error:
        raise UsageError(f"{type(error).__name__}: {error}") from None
    return 0


def _print(value) -> None:
    print(json.dumps(value, indent=2, sort_keys=True))


def create(arguments: argparse.Namespace) -> int:
    check_quorums(policies_from(arguments))

    async def body(client) -> None:
        _print(await client.create_topic(arguments.topic, arguments.partitions, **policies_from(arguments)))

    return _run(arguments, body)


def set_policies(arguments: argparse.Namespace) -> int:
    changes = policies_from(arguments)
    if not changes:
        raise UsageError("name at least one policy to change (see --help)")
    check_quorums(changes)

    async def body(client) -> None:
        _print(await client.set_policies(arguments.topic, **changes))

    return _run(arguments, body)


def list_(arguments: argparse.Namespace) -> int:
    async def body(client) -> None:
        for topic in await client.list_topics(namespace=arguments.namespace):
            partitions = topic["partitions"]
            print(topic["topic"] if partitions == 0 else f"{topic['topic']} ({partitions} partitions)")

    return _run(arguments, body)


def add_stats(parser: argparse.ArgumentParser) -> None:
    add_topic(parser)
    parser.add_argument("--format", choices=["json", "text"], default="json", help="text: a summary for people")


def stats(arguments: argparse.Namespace) -> int:
    async def body(client) -> None:
        stats = await client.topic_stats(arguments.topic)
        if arguments.format == "json":
            _print(stats)
            return
        for name, partition in stats["partitions"].items():
            print(f"{name}: offsets {partition['first_offset']}..{partition['next_offset'] - 1}, "
                  f"{partition['stored_bytes']} bytes stored, {partition['messages_in_per_s']} msg/s in, "
                  f"{partition['messages_out_per_s']} msg/s out")
            for producer in partition["producers"]:
                print(f"  producer {producer['producer_id']}: last sequence id {producer['last_sequence_id']}")
            for subscription_name, subscription in partition["subscriptions"].items():
                important = ", important" if subscription["important"] else ""
                print(f"  subscription {subscription_name} ({subscription['type']}{important}): backlog "
                      f"{subscription['backlog_messages']}, mark-delete offset {subscription['mark_delete_offset']}, "
                      f"{len(subscription['consumers'])} consumers")
            for ledger in partition["ledgers"]:
                print(f"  ledger {ledger['ledger_id']}: {ledger['state']}, {ledger['entries']} entries, "
                      f"{ledger['messages']} messages from offset {ledger['first_offset']}, {ledger['bytes']} bytes")

    return _run(arguments, body)


def delete(arguments: argparse.Namespace) -> int:
    async def body(client) -> None:
        await client.delete_topic(arguments.topic, force=arguments.force)
        print(f"deleted topic {arguments.topic}")

    return _run(arguments, body)


def unload(arguments: argparse.Namespace) -> int:
    async def body(client) -> None:
        await client.unload(arguments.topic)
        print(f"unloaded topic {arguments.topic}")

    return _run(arguments, body)


def _properties(items: list[str]) -> dict[str, str]:
    properties = {}
    for item in items:
        name, separator, value = item.partition("=")
        if not separator or not name:
            raise UsageError(f"--property takes NAME=VALUE, got {item!r}")
        properties[name] = value
    return properties


def produce(arguments: argparse.Namespace) -> int:
    properties = _properties(arguments.property)
    # Flags for generated messages are refused without --count rather than
    # ignored: standard input's lines are sent as they are.
    if arguments.count is None:
        for flag, value in (("--size", arguments.size), ("--keys", arguments.keys)):
            if value is not None:
                raise UsageError(f"{flag} is for generated messages: it goes with --count (standard input's lines are sent as they are)")
    if arguments.keys is not None and arguments.key is None:
        raise UsageError("--keys makes keys KEY-0 .. KEY-(N-1): it goes with --key")
    size = GENERATED_MESSAGE_BYTES_DEFAULT if arguments.size is None else arguments.size
    if size > MESSAGE_BYTES_MAX and not arguments.chunking:
        raise UsageError(f"--size {size}: a message of more than {MESSAGE_BYTES_MAX} bytes goes in chunks: add --chunking")
    keys = 1 if arguments.keys is None else arguments.keys

    async def body(client) -> None:
        producer = await client.create_producer(arguments.topic, arguments.producer_id, batching=arguments.batching,
                                                codec=arguments.codec, pending_messages_max=arguments.window,
                                                chunking=arguments.chunking)
        started = time.monotonic()
        sent = 0
        first = last = None

        def messages():
            if arguments.count is not None:
                for number in range(arguments.count):
                    key = None if arguments.key is None else f"{arguments.key}-{number % keys}"
                    yield _generated(number, size), key
            else:
                for line in sys.stdin.buffer:
                    yield line.rstrip(b"\n"), arguments.key

        futures = []
        for data, key in messages():
            futures.append(await producer.send_async(data, key=key, properties=properties or None))
            if len(futures) >= arguments.window:
                result = await futures.pop(0).wait()
                first = first or result.message_id
                last = result.message_id
                sent += 1
        for future in futures:
            result = await future.wait()
            first = first or result.message_id
            last = result.message_id
            sent += 1
        elapsed = time.monotonic() - started
        await producer.close()
        _print({"topic": arguments.topic, "producer_id": producer.producer_id, "sent": sent,
                "first_message_id": str(first) if first else None, "last_message_id": str(last) if last else None,
                "seconds": round(elapsed, 3), "messages_per_s": round(sent / elapsed, 1) if elapsed > 0 else None})

    return _run(arguments, body)


def _generated(number: int, size: int) -> bytes:
    """Generated message `number` of exactly `size` bytes: its number, then
    filler (only the number's last digits when `size` is smaller)."""
    digits = f"{number:015d}".encode()
    if size <= len(digits):
        return digits[len(digits) - size:]
    return (digits + b" ").ljust(size, b"x")


ACKS_IN_FLIGHT_MAX = 1_000  # acknowledgements waiting for their cursor write


def consume(arguments: argparse.Namespace) -> int:
    async def body(client) -> None:
        consumer = await client.subscribe(
            arguments.topic, arguments.subscription, arguments.type,
            initial_position=arguments.initial_position, important=arguments.important,
            read_compacted=arguments.read_compacted,
        )
        received = 0
        idle_s = None if arguments.idle_timeout is None else arguments.idle_timeout / 1000
        # Acknowledgements run concurrently: each returns once durable, and
        # many share one cursor write.
        acks_in_flight = trio.Semaphore(ACKS_IN_FLIGHT_MAX)

        async def acknowledge(message) -> None:
            try:
                await consumer.acknowledge(message)
            finally:
                acks_in_flight.release()

        async with trio.open_nursery() as acks:
            while arguments.count is None or received < arguments.count:
                message = None
                with trio.move_on_after(idle_s if idle_s is not None else float("inf")):
                    message = await consumer.receive()
                if message is None:
                    break
                _show(message, arguments.format)
                received += 1
                if not arguments.no_ack:
                    await acks_in_flight.acquire()
                    acks.start_soon(acknowledge, message)
        await consumer.close()
        print(f"received {received} messages", file=sys.stderr)

    return _run(arguments, body)


def _show(message, output_format: str) -> None:
    if output_format == "json":
        try:
            data = {"data": message.data.decode()}
        except UnicodeDecodeError:
            data = {"data_base64": base64.b64encode(message.data).decode()}
        print(json.dumps({
            "message_id": str(message.message_id), "offset": message.offset, "key": message.key,
            "properties": message.properties, "publish_time_ms": message.publish_time_ms,
            "producer_id": message.producer_id, "sequence_id": message.sequence_id,
            "redelivery_count": message.redelivery_count, **data,
        }, sort_keys=True), flush=True)
    else:
        text = message.data.decode(errors="replace")
        key = f" key={message.key}" if message.key is not None else ""
        print(f"{message.message_id} offset={message.offset}{key} {text}", flush=True)
