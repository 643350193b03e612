"""The broker's settings, with the bounds each one has."""

from __future__ import annotations

import ssl
from dataclasses import dataclass, field

from broker.cursor_ledger import CURSOR_WRITES_PER_S_DEFAULT
from broker.dispatcher import DELAYED_MAX_DEFAULT
from broker.publish_buffer import PUBLISH_BUFFER_BYTES_DEFAULT
from broker.topic_records import TopicPolicies
from security.authentication import Authenticator
from framing.peer_limits import (
    CONNECTIONS_MAX_DEFAULT,
    CONNECTIONS_PER_ADDRESS_MAX_DEFAULT,
    FRAME_BUFFER_BYTES_MAX_DEFAULT,
    FRAME_DEADLINE_S_DEFAULT,
)


@dataclass
class BrokerConfig:
    broker_id: str
    host: str = "127.0.0.1"
    port: int = 6700
    advertised_address: str | None = None  # host:port clients dial; default host:port
    # Other names clients may ask for by name, each host:port (Pulsar's
    # advertisedListeners): "external" for clients outside a container
    # network, say. The internal listener is the advertised address.
    advertised_listeners: dict[str, str] = field(default_factory=dict)
    ledger_password: bytes = b""
    entry_cache_bytes: int = 64 * 1024 * 1024
    # Delayed messages each subscription holds in memory; past it they are
    # spilled to a local file in runs sorted by time (broker/delayed_index.py).
    delayed_memory_messages: int = DELAYED_MAX_DEFAULT
    # Appends to cursor ledgers per second, all subscriptions together
    # (broker/cursor_ledger.py).
    cursor_writes_per_s: int = CURSOR_WRITES_PER_S_DEFAULT
    frame_bytes_max: int = 16 * 1024 * 1024
    requests_in_flight_max: int = 1_000  # per connection
    connection_output_bytes_max: int = 64 * 1024 * 1024  # a connection's unsent answers; past it, reading stops
    # Producers' batches taken and not yet answered, all partitions together
    # (Pulsar's maxMessagePublishBufferSizeInMB); past it the broker stops
    # reading from producers' connections until half of it is left.
    publish_buffer_bytes: int = PUBLISH_BUFFER_BYTES_DEFAULT
    connections_max: int = CONNECTIONS_MAX_DEFAULT  # open client connections; past it new ones are closed at once
    connections_per_address_max: int = CONNECTIONS_PER_ADDRESS_MAX_DEFAULT  # ... from one client address (maxConnectionsPerIp)
    frame_buffer_bytes_max: int = FRAME_BUFFER_BYTES_MAX_DEFAULT  # large frames being received, all connections together
    frame_deadline_s: float = FRAME_DEADLINE_S_DEFAULT  # a frame's bytes, once the first arrived, must all arrive within this
    # Pulsar's keepAliveIntervalSeconds: a connection silent this long is
    # sent a PING, and one silent for two intervals is closed.
    keepalive_interval_s: float = 30.0
    auto_topic_creation: bool = True
    default_policies: TopicPolicies = field(default_factory=TopicPolicies)
    retention_check_interval_s: float = 5.0
    session_timeout_ms: int = 10_000  # the broker's ZooKeeper session (its dispatch lease follows it)
    metrics_port: int = 0  # Prometheus /metrics on host:metrics_port; 0: no endpoint and nothing measured
    # Pulsar's binary protocol on host:pulsar_port (0 picks one); None: no Pulsar listener.
    pulsar_port: int | None = None
    # The Pulsar listeners other than the internal one, by name, each
    # host:port (the names of `advertised_listeners`).
    pulsar_advertised_listeners: dict[str, str] = field(default_factory=dict)
    pulsar_max_message_size: int = 5 * 1024 * 1024  # told to Pulsar clients (Pulsar's maxMessageSize)
    cluster_name: str = "standalone"  # Pulsar's clusterName: in the producer names the broker gives
    # Who clients are (tokens, TLS client certificates, the anonymous role).
    # Authorization is on exactly when authentication is: then a role needs
    # a grant (or to be a tenant admin or superuser) for what it asks.
    authenticator: Authenticator = field(default_factory=Authenticator)
    superuser_roles: frozenset[str] = frozenset()
    # TLS: quire's protocol on host:tls_port and Pulsar's (pulsar+ssl://) on
    # host:pulsar_tls_port, with this context (None: no TLS listener). A
    # handshake that does not finish within the deadline closes the connection.
    tls_context: ssl.SSLContext | None = None
    tls_port: int | None = None
    pulsar_tls_port: int | None = None
    tls_handshake_deadline_s: float = 10.0
    # The web service (REST admin API under /admin/v2, HTTP lookup under
    # /lookup/v2, /metrics) on host:web_port and over HTTPS on
    # host:web_tls_port (0 picks one); None: no such listener.
    web_port: int | None = None
    web_tls_port: int | None = None
    # How the broker checks other brokers' HTTPS certificates when it asks
    # them for a partitioned topic's partitions (None: the system's CAs).
    web_client_tls_context: ssl.SSLContext | None = None

    def __post_init__(self) -> None:
        if self.frame_buffer_bytes_max < self.frame_bytes_max:
            raise ValueError(f"the frame buffer ({self.frame_buffer_bytes_max} bytes) must hold at least one frame "
                             f"of the frame bound ({self.frame_bytes_max} bytes)")
        if self.connections_max < 1 or self.connections_per_address_max < 1 or self.requests_in_flight_max < 1:
            raise ValueError("connection and request bounds must be at least 1")
        if self.publish_buffer_bytes < 1:
            raise ValueError(f"the publish buffer must hold at least 1 byte, got {self.publish_buffer_bytes}")
        if self.pulsar_max_message_size + 64 * 1024 > self.frame_bytes_max:
            raise ValueError(f"the Pulsar message size ({self.pulsar_max_message_size} bytes) and its frame's headers "
                             f"must fit a frame ({self.frame_bytes_max} bytes)")
        if (self.tls_port is not None or self.pulsar_tls_port is not None) and self.tls_context is None:
            raise ValueError("a TLS listener needs a certificate and its key (--tls-cert-file, --tls-key-file)")
        if self.web_tls_port is not None and self.tls_context is None:
            raise ValueError("an HTTPS listener needs a certificate and its key (--tls-cert-file, --tls-key-file)")
        if not 0 < self.frame_deadline_s <= 3600 or not 0 < self.keepalive_interval_s <= 86_400:
            raise ValueError("the frame deadline and the keep-alive interval must be positive")


__all__ = ["BrokerConfig"]
