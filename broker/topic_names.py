"""Pulsar's topic names and quire's: a quire topic `orders` is
`persistent://public/default/orders` to Pulsar clients, and its partitions
`orders-partition-N` are `persistent://public/default/orders-partition-N`.
A topic of another namespace keeps its namespace in its quire name:
`persistent://acme/payments/orders` is `acme/payments/orders`. Every quire
command and client call takes either form (or Pulsar's short
`TENANT/NAMESPACE/TOPIC`).

quire serves persistent topics; a `non-persistent://` topic is refused with
a clear error (TopicNameError says what quire does not do). Whether a
namespace exists is the broker's to check (broker.tenant_store).
"""

from __future__ import annotations

PERSISTENT = "persistent://"
NON_PERSISTENT = "non-persistent://"
DEFAULT_TENANT = "public"
DEFAULT_NAMESPACE = "default"
NAMESPACE = f"{DEFAULT_TENANT}/{DEFAULT_NAMESPACE}"


class TopicNameError(ValueError):
    """A topic name quire cannot serve."""


class NotPersistentError(TopicNameError):
    """A `non-persistent://` topic: quire stores every message."""


def quire_name(name: str) -> str:
    """The quire name of a topic or partition given in either form."""
    if not isinstance(name, str):
        raise TopicNameError(f"a topic name is a string, got {type(name).__name__}")
    if name.startswith(NON_PERSISTENT):
        raise NotPersistentError(f"non-persistent topics are not supported by quire brokers ({name[:200]!r}): "
                                 f"every quire topic is persistent")
    rest = name[len(PERSISTENT):] if name.startswith(PERSISTENT) else name
    if "://" in rest:
        raise TopicNameError(f"unknown topic domain in {name[:200]!r}: quire serves persistent:// topics")
    parts = rest.split("/")
    if len(parts) == 1:
        if name.startswith(PERSISTENT):
            raise TopicNameError(f"a Pulsar topic name is persistent://TENANT/NAMESPACE/TOPIC, got {name[:200]!r}")
        return rest
    if len(parts) != 3 or not all(parts):
        raise TopicNameError(f"a topic name is TOPIC, TENANT/NAMESPACE/TOPIC or persistent://TENANT/NAMESPACE/TOPIC, "
                             f"got {name[:200]!r}")
    tenant, namespace, topic = parts
    if (tenant, namespace) != (DEFAULT_TENANT, DEFAULT_NAMESPACE):
        return rest
    return topic


def pulsar_name(name: str) -> str:
    """The full Pulsar name of a quire topic or partition."""
    return f"{PERSISTENT}{name}" if "/" in name else f"{PERSISTENT}{NAMESPACE}/{name}"


def namespace_of_topic(name: str) -> str:
    """TENANT/NAMESPACE of a quire topic or partition name."""
    return name.rsplit("/", 1)[0] if "/" in name else NAMESPACE


def namespace_of(namespace: str) -> str:
    """A namespace as Pulsar's clients name it (TENANT/NAMESPACE), checked
    for its form (not for existence)."""
    parts = namespace.split("/") if isinstance(namespace, str) else []
    if len(parts) != 2 or not all(parts):
        raise TopicNameError(f"a namespace is TENANT/NAMESPACE, got {str(namespace)[:200]!r}")
    return namespace


__all__ = ["NAMESPACE", "NotPersistentError", "TopicNameError", "namespace_of", "namespace_of_topic", "pulsar_name", "quire_name"]
