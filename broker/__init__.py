"""The broker: topics as chains of ledgers (managed ledgers), producer
deduplication, durable subscriptions with cursors, ownership and failover
between brokers, the broker protocol, and the Python client
(`broker.client`).

The server classes are imported on first use, so that code needing only
the message format (a Spark worker) or a pure core does not load the
server, trio or kazoo.
"""

from __future__ import annotations

from coordination.lazy_exports import lazy_exports
from broker.errors import BrokerError, BrokerStatus
from broker.topic_records import TopicPolicies

_LAZY = {"BrokerConfig": "broker.config", "BrokerServer": "broker.server"}

__getattr__ = lazy_exports(globals(), _LAZY)

__all__ = ["BrokerConfig", "BrokerError", "BrokerServer", "BrokerStatus", "TopicPolicies"]
