"""A broker's admin requests answer a peer's bad arguments with short
messages: a megabyte topic name or policy value is described by its type
and size, never copied into the response."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from broker.admin import AdminHandler
from broker.errors import BadRequestError
from broker.topic_records import TopicPolicies

MESSAGE_CHARS_MAX = 500


class NoStore:
    """Every request here is refused before ZooKeeper is asked."""

    def __getattr__(self, name):
        raise AssertionError(f"the topic store was asked for {name} about a refused request")


def handler() -> AdminHandler:
    return AdminHandler(SimpleNamespace(default_policies=TopicPolicies(), topic_store=NoStore()))


@pytest.mark.parametrize(
    "action, arguments, shown",
    [
        ("create_topic", {"topic": "t" * 1_000_000}, "bad topic name of 1000000 characters"),
        ("set_policies", {"topic": "t" * 1_000_000, "policies": {}}, "bad topic name of 1000000 characters"),
        ("unload", {"partition": "\x00" * 1_000_000}, "bad topic name of 1000000 characters"),
        ("create_topic", {"topic": "orders", "policies": {"retention_bytes": b"x" * 1_000_000}},
         "retention_bytes must be a non-negative integer or None, got binary of 1000000 bytes"),
        ("create_topic", {"topic": "orders", "policies": {"p" * 1_000_000: 1}}, "unknown topic policies ['ppp"),
        ("create_topic", {"topic": "orders", "policies": {"deduplication": "yes" * 300_000}}, "deduplication must be true or false"),
        ("x" * 256, {}, "unknown admin action 'xxx"),
    ],
)
async def test_a_huge_argument_gives_a_short_error(action, arguments, shown):
    with pytest.raises((ValueError, BadRequestError)) as raised:
        await handler().handle(action, arguments)
    message = str(raised.value)
    assert len(message) < MESSAGE_CHARS_MAX, message
    assert shown in message
