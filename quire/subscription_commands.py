"""`quire topic subscriptions|create-subscription|delete-subscription|skip|
expire|reset-cursor|compact|compaction-status` and `quire namespace policies|set-policies|
remove-policies`: the admin actions the REST API's subscription and
namespace-policy paths call, through a broker over quire's protocol.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import trio

from quire import cli_ranges as ranges
from quire.cli_parsing import Bounded, UsageError
from quire.tenant_commands import add_namespace
from quire.topic_commands import _print, _run, add_topic

# `quire namespace remove-policies --policies` names, as the policies' fields.
SKIP_COUNT = Bounded("integer", 1, 2**62, why="offsets are signed 64-bit")
UNLIMITED = "none"
COMPACTION_POLL_S = 0.5  # `compact --wait` asks for the status this often
SCHEMA_STRATEGIES = ("ALWAYS_COMPATIBLE", "ALWAYS_INCOMPATIBLE", "BACKWARD", "FORWARD", "FULL", "BACKWARD_TRANSITIVE",
                     "FORWARD_TRANSITIVE", "FULL_TRANSITIVE")
NAMESPACE_POLICY_FLAGS = {"retention-time": "retention_time_ms", "retention-size": "retention_bytes",
                          "backlog-quota": "backlog_quota_bytes", "deduplication": "deduplication",
                          "message-ttl": "message_ttl_s", "schema-compatibility-strategy": "schema_compatibility_strategy",
                          "compaction-threshold": "compaction_threshold_bytes"}


def _subscription(parser: argparse.ArgumentParser, *, required: bool = True) -> None:
    add_topic(parser)
    parser.add_argument("--subscription", required=required, metavar="NAME", help="the subscription's name")


def _message_id(text: str) -> list[int]:
    """LEDGER:ENTRY[:BATCH_INDEX], each part in its range."""
    parts = text.split(":")
    if len(parts) not in (2, 3):
        raise argparse.ArgumentTypeError(f"a message id is LEDGER:ENTRY[:BATCH_INDEX], got {text[:100]!r}")
    kinds = (ranges.ledger_id, ranges.entry_id, ranges.entry_id)
    return [kind(part) for kind, part in zip(kinds, parts)] + [0] * (3 - len(parts))


def _position(text: str) -> str | list[int]:
    return text if text in ("earliest", "latest") else _message_id(text)


def add_create(parser: argparse.ArgumentParser) -> None:
    _subscription(parser)
    parser.add_argument("--position", type=_position, default="latest", metavar="earliest|latest|LEDGER:ENTRY[:BATCH]",
                        help="where it starts: the first message kept, the next one published (default), or a message id")


def add_delete(parser: argparse.ArgumentParser) -> None:
    _subscription(parser)
    parser.add_argument("--force", action="store_true", help="disconnect its consumers first (else refused while they are connected)")


def add_skip(parser: argparse.ArgumentParser) -> None:
    _subscription(parser)
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--count", type=SKIP_COUNT, metavar="N",
                       help="acknowledge the next N unacknowledged messages of each partition")
    which.add_argument("--all", action="store_true", help="acknowledge everything: clear the backlog")


def add_expire(parser: argparse.ArgumentParser) -> None:
    _subscription(parser, required=False)
    parser.add_argument("--older-than", type=ranges.age, required=True, metavar="DURATION",
                        help="acknowledge the messages published longer ago than this (e.g. 1h); without --subscription, "
                             "on every durable subscription")


def add_reset(parser: argparse.ArgumentParser) -> None:
    _subscription(parser)
    to = parser.add_mutually_exclusive_group(required=True)
    to.add_argument("--ago", type=ranges.age, metavar="DURATION",
                    help="to the first message published at most this long ago (e.g. 10m)")
    to.add_argument("--publish-time", type=ranges.ledger_id, metavar="MS",
                    help="to the first message published at or after this time (milliseconds since the epoch)")
    to.add_argument("--message-id", type=_message_id, metavar="LEDGER:ENTRY[:BATCH]",
                    help="to this message (of a partition, or of a topic that is not partitioned)")


def subscriptions(arguments: argparse.Namespace) -> int:
    async def body(client) -> None:
        for name in await client.subscriptions(arguments.topic):
            print(name)

    return _run(arguments, body)


def create(arguments: argparse.Namespace) -> int:
    async def body(client) -> None:
        _print(await client.create_subscription(arguments.topic, arguments.subscription, position=arguments.position))

    return _run(arguments, body)


def delete(arguments: argparse.Namespace) -> int:
    async def body(client) -> None:
        await client.delete_subscription(arguments.topic, arguments.subscription, force=arguments.force)
        print(f"deleted subscription {arguments.subscription} of {arguments.topic}")

    return _run(arguments, body)


def skip(arguments: argparse.Namespace) -> int:
    async def body(client) -> None:
        _print(await client.skip_messages(arguments.topic, arguments.subscription, None if arguments.all else arguments.count))

    return _run(arguments, body)


def expire(arguments: argparse.Namespace) -> int:
    async def body(client) -> None:
        _print(await client.expire_messages(arguments.topic, arguments.older_than // 1000, arguments.subscription))

    return _run(arguments, body)


def reset(arguments: argparse.Namespace) -> int:
    async def body(client) -> None:
        if arguments.message_id is not None:
            _print(await client.reset_cursor(arguments.topic, arguments.subscription, message_id=arguments.message_id))
            return
        publish_time_ms = arguments.publish_time
        if publish_time_ms is None:
            publish_time_ms = int(time.time() * 1000) - arguments.ago
        _print(await client.reset_cursor(arguments.topic, arguments.subscription, publish_time_ms=publish_time_ms))

    return _run(arguments, body)


def add_compact(parser: argparse.ArgumentParser) -> None:
    add_topic(parser)
    parser.add_argument("--wait", action="store_true", help="wait until every partition's compaction has ended, and "
                                                            "exit 1 if one failed")


def compact(arguments: argparse.Namespace) -> int:
    failed = []

    async def body(client) -> None:
        statuses = await client.compact(arguments.topic)
        while arguments.wait and any(status["running"] for status in statuses.values()):
            await trio.sleep(COMPACTION_POLL_S)
            statuses = await client.compaction_status(arguments.topic)
        failed.extend(name for name, status in statuses.items() if status["status"] == "ERROR")
        _print(statuses)

    code = _run(arguments, body)
    return 1 if code == 0 and failed else code


def compaction_status(arguments: argparse.Namespace) -> int:
    async def body(client) -> None:
        _print(await client.compaction_status(arguments.topic))

    return _run(arguments, body)


# --- namespace policies ------------------------------------------------------------------------


class _OrUnlimited(Bounded):
    """A size or duration in its range, or `none` (UNLIMITED): no limit."""

    def __init__(self, bounded: Bounded) -> None:
        super().__init__(bounded.kind, bounded.low, bounded.high, why=bounded.why)

    def __call__(self, text: str):
        return UNLIMITED if text.strip().lower() == UNLIMITED else super().__call__(text)


def _limit(bounded: Bounded) -> Bounded:
    return _OrUnlimited(bounded)


def add_set_policies(parser: argparse.ArgumentParser) -> None:
    add_namespace(parser)
    parser.add_argument("--retention-time", type=_limit(ranges.age), metavar="DURATION|none",
                        help="the namespace's topics keep acknowledged messages this long (none: no limit)")
    parser.add_argument("--retention-size", type=_limit(ranges.storage_bytes), metavar="BYTES|none",
                        help="... and at most this much of them (none: no limit)")
    parser.add_argument("--backlog-quota", type=_limit(ranges.storage_bytes), metavar="BYTES|none",
                        help="refuse producers while a partition's backlog holds this much (none: no quota)")
    parser.add_argument("--deduplication", choices=["on", "off"], help="producer deduplication of the namespace's topics")
    parser.add_argument("--message-ttl", type=_limit(ranges.positive_age), metavar="DURATION|none",
                        help="acknowledge messages older than this on every subscription's behalf (none: never)")
    parser.add_argument("--schema-compatibility-strategy", choices=SCHEMA_STRATEGIES, metavar="STRATEGY",
                        help=f"which new schemas the namespace's topics take: {', '.join(SCHEMA_STRATEGIES)}")
    parser.add_argument("--compaction-threshold", type=_limit(ranges.positive_storage_bytes), metavar="BYTES|none",
                        help="compact a partition once the messages after its last compaction hold this much (none: only when asked)")


def add_remove_policies(parser: argparse.ArgumentParser) -> None:
    add_namespace(parser)
    parser.add_argument("--policies", required=True, type=_policy_names, metavar="POLICY,...",
                        help=f"the policies the namespace stops setting (its topics go back to the broker's defaults): "
                             f"{', '.join(NAMESPACE_POLICY_FLAGS)}")


def _policy_names(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in NAMESPACE_POLICY_FLAGS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"policies are some of {', '.join(NAMESPACE_POLICY_FLAGS)}; not {unknown or text!r}")
    return [NAMESPACE_POLICY_FLAGS[name] for name in names]


def namespace_policies(arguments: argparse.Namespace) -> int:
    async def body(client) -> None:
        _print(await client.namespace_policies(arguments.namespace))

    return _run(arguments, body)


def set_namespace_policies(arguments: argparse.Namespace) -> int:
    changes = {}
    for flag, name in NAMESPACE_POLICY_FLAGS.items():
        value = getattr(arguments, flag.replace("-", "_"))
        if value is not None:
            changes[name] = None if value == UNLIMITED else value
    if "deduplication" in changes:
        changes["deduplication"] = changes["deduplication"] == "on"
    if changes.get("message_ttl_s") is not None:
        changes["message_ttl_s"] = max(1, changes["message_ttl_s"] // 1000)
    if not changes:
        raise UsageError("name at least one policy to set (see --help)")

    async def body(client) -> None:
        _print(await client.set_namespace_policies(arguments.namespace, **changes))

    return _run(arguments, body)


def remove_namespace_policies(arguments: argparse.Namespace) -> int:
    async def body(client) -> None:
        _print(await client.set_namespace_policies(arguments.namespace, remove=arguments.policies))

    return _run(arguments, body)


# --- schemas ----------------------------------------------------------------------------------


def add_schema_show(parser: argparse.ArgumentParser) -> None:
    add_topic(parser)
    parser.add_argument("--version", type=ranges.ledger_id, metavar="N", help="this version (default: the latest)")


def add_schema_set(parser: argparse.ArgumentParser) -> None:
    add_topic(parser)
    parser.add_argument("--type", required=True, metavar="TYPE", help="AVRO, JSON, STRING, PROTOBUF, ... (Pulsar's schema types)")
    parser.add_argument("--definition-file", required=True, type=Path, metavar="FILE",
                        help="the definition (an Avro schema's JSON for AVRO and JSON)")
    parser.add_argument("--property", action="append", default=[], metavar="NAME=VALUE", help="a property of the schema (repeatable)")


def schema_show(arguments: argparse.Namespace) -> int:
    async def body(client) -> None:
        _print(await client.schema(arguments.topic, arguments.version))

    return _run(arguments, body)


def schema_list(arguments: argparse.Namespace) -> int:
    async def body(client) -> None:
        _print(await client.schemas(arguments.topic))

    return _run(arguments, body)


def schema_set(arguments: argparse.Namespace) -> int:
    from quire.topic_commands import _properties

    try:
        definition = arguments.definition_file.read_text()
    except (OSError, UnicodeDecodeError) as error:
        raise UsageError(f"--definition-file {arguments.definition_file}: {error}") from None
    properties = _properties(arguments.property)

    async def body(client) -> None:
        version = await client.add_schema(arguments.topic, arguments.type, definition, properties)
        print(f"{arguments.topic}: schema version {version}")

    return _run(arguments, body)


def schema_delete(arguments: argparse.Namespace) -> int:
    async def body(client) -> None:
        await client.delete_schema(arguments.topic)
        print(f"deleted the schema of {arguments.topic}")

    return _run(arguments, body)


def register_topic(topic, command) -> None:
    """The subscription and schema commands of the `topic` group."""
    add_schema_show(command(topic, "schema", "a topic's schema: its latest version, or one", schema_show))
    add_topic(command(topic, "schemas", "every version of a topic's schema", schema_list))
    add_schema_set(command(topic, "set-schema", "add a version of a topic's schema, if its compatibility strategy takes it",
                           schema_set))
    add_topic(command(topic, "delete-schema", "delete every version of a topic's schema", schema_delete))
    add_topic(command(topic, "subscriptions", "list a topic's subscriptions", subscriptions))
    add_create(command(topic, "create-subscription", "create a durable subscription without consumers", create))
    add_delete(command(topic, "delete-subscription", "delete a subscription and its cursor", delete))
    add_skip(command(topic, "skip", "acknowledge messages on a subscription's behalf (skip some, or clear its backlog)", skip))
    add_expire(command(topic, "expire", "acknowledge messages older than a duration on a subscription's behalf", expire))
    add_reset(command(topic, "reset-cursor", "move a subscription to a time or a message; its consumers subscribe again", reset))
    add_compact(command(topic, "compact", "compact a topic: keep the latest message of each key in its compacted view", compact))
    add_topic(command(topic, "compaction-status", "how each partition's last compaction went, and what its view holds",
                      compaction_status))


def register_namespace(namespace, command) -> None:
    """The policy commands of the `namespace` group."""
    add_namespace(command(namespace, "policies", "a namespace's grants and the policies it sets for its topics", namespace_policies))
    add_set_policies(command(namespace, "set-policies", "set retention, backlog quota or deduplication for a namespace's "
                             "topics (a topic's own setting wins)", set_namespace_policies))
    add_remove_policies(command(namespace, "remove-policies", "stop a namespace setting policies for its topics",
                                remove_namespace_policies))
