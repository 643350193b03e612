"""The broker: topics as chains of ledgers (managed ledgers), producer
deduplication, durable subscriptions with cursors, ownership and failover
between brokers, the broker protocol, and the Python client
(`broker.client`).

The server classes are imported on first use, so that code needing only the
message format (a Spark worker) does not load the server.
"""

from __future__ import annotations

import importlib
from typing import Any

from broker.errors import BrokerError, BrokerStatus
from broker.topic_store import TopicPolicies

_LAZY = {"BrokerConfig": "broker.server", "BrokerServer": "broker.server"}


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value
    return value


__all__ = ["BrokerConfig", "BrokerError", "BrokerServer", "BrokerStatus", "TopicPolicies"]
