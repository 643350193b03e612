"""`quire broker run`: a broker in the foreground until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import socket

import trio

from broker.cursor_ledger import CURSOR_WRITES_PER_S_DEFAULT
from broker.dispatcher import DELAYED_MAX_DEFAULT
from broker.publish_buffer import PUBLISH_BUFFER_BYTES_DEFAULT
from broker.topic_records import TopicPolicies
from quire import cli_ranges as ranges
from quire.cli_parsing import Bounded, HostPorts, Listeners, UsageError, human_duration, human_size, metrics_port, port_number
from quire.gc_tuning import tune_gc
from quire.logging_setup import configure_logging


def add_policies(parser: argparse.ArgumentParser, *, defaults: bool) -> None:
    """Topic policy flags; with `defaults`, they set the broker's defaults for new topics."""
    scope = "default for new topics: " if defaults else ""
    built_in = TopicPolicies()

    def unless_set(text: str) -> str:
        # The broker's own default is the built-in one unless its flag sets
        # it; a topic's is the broker's.
        return f" ({text} unless set)" if defaults else f" (default: the broker's; {text} unless set there)"

    parser.add_argument("--retention-time", type=ranges.age, metavar="DURATION",
                        help=f"{scope}delete closed ledgers older than this (e.g. 7d) once the subscriptions the retention "
                             f"model counts have acknowledged them")
    parser.add_argument("--retention-size", type=ranges.storage_bytes, metavar="BYTES",
                        help=f"{scope}keep at most this much beyond what the subscriptions the retention model counts need")
    parser.add_argument("--retention-model", choices=["pulsar", "ydb"],
                        help=f"{scope}pulsar: every durable subscription's backlog is kept until acknowledged and retention "
                             f"applies to acknowledged data; ydb: retention deletes anything but what important subscriptions "
                             f"have not acknowledged" + unless_set(built_in.retention_model))
    parser.add_argument("--backlog-quota", type=ranges.storage_bytes, metavar="BYTES",
                        help=f"{scope}refuse producers (partition overflow) while a partition holds this much")
    parser.add_argument("--rollover-entries", type=ranges.entries_per_ledger, help=f"{scope}entries per ledger" + unless_set(str(built_in.rollover_entries)))
    parser.add_argument("--rollover-size", type=ranges.positive_storage_bytes, metavar="BYTES", help=f"{scope}bytes per ledger" + unless_set(human_size(built_in.rollover_bytes)))
    parser.add_argument("--rollover-time", type=ranges.positive_age, metavar="DURATION", help=f"{scope}age of a ledger" + unless_set(human_duration(built_in.rollover_time_ms)))
    parser.add_argument("--rollover-idle", type=ranges.positive_age, metavar="DURATION", help=f"{scope}close a ledger nobody wrote to for this long" + unless_set(human_duration(built_in.rollover_idle_ms)))
    parser.add_argument("--rollover-min-time", type=ranges.age, metavar="DURATION",
                        help=f"{scope}no rollover for entries or size before a ledger is this old" + unless_set(human_duration(built_in.rollover_min_time_ms)))
    parser.add_argument("--deduplication", choices=["on", "off"], help=f"{scope}producer deduplication" + unless_set("on" if built_in.deduplication else "off"))
    parser.add_argument("--message-ttl", type=ranges.positive_age, metavar="DURATION",
                        help=f"{scope}acknowledge messages older than this on every subscription's behalf (Pulsar's "
                             f"message TTL, checked every --retention-check-interval; whole seconds)" + unless_set("none"))
    parser.add_argument("--compaction-threshold", type=ranges.positive_storage_bytes, metavar="BYTES",
                        help=f"{scope}compact a partition once the messages after its last compaction hold this much "
                             f"(Pulsar's compaction threshold)" + unless_set("none: only when asked"))
    parser.add_argument("--ensemble-size", "-E", type=ranges.ensemble, help=f"{scope}bookies per ledger" + unless_set(str(built_in.ensemble_size)))
    parser.add_argument("--write-quorum", "-W", type=ranges.ensemble, help=f"{scope}copies of each entry" + unless_set(str(built_in.write_quorum)))
    parser.add_argument("--ack-quorum", "-A", type=ranges.ensemble, help=f"{scope}copies acknowledged before a message is persisted" + unless_set(str(built_in.ack_quorum)))


def policies_from(arguments: argparse.Namespace) -> dict:
    """The policy flags given, as TopicPolicies field names."""
    names = {
        "retention_time": "retention_time_ms", "retention_size": "retention_bytes", "backlog_quota": "backlog_quota_bytes",
        "rollover_entries": "rollover_entries", "rollover_size": "rollover_bytes", "rollover_time": "rollover_time_ms",
        "rollover_idle": "rollover_idle_ms", "rollover_min_time": "rollover_min_time_ms", "ensemble_size": "ensemble_size", "write_quorum": "write_quorum",
        "ack_quorum": "ack_quorum", "retention_model": "retention_model",
    }
    policies = {field: getattr(arguments, flag) for flag, field in names.items() if getattr(arguments, flag) is not None}
    if arguments.deduplication is not None:
        policies["deduplication"] = arguments.deduplication == "on"
    if arguments.message_ttl is not None:
        policies["message_ttl_s"] = max(1, arguments.message_ttl // 1000)
    if arguments.compaction_threshold is not None:
        policies["compaction_threshold_bytes"] = arguments.compaction_threshold
    return policies


def check_quorums(policies: dict) -> None:
    """The ensemble, write quorum and ack quorum given must be in that order
    (each one not given is the broker's, which it checks itself)."""
    flags = (("ensemble_size", "--ensemble-size"), ("write_quorum", "--write-quorum"), ("ack_quorum", "--ack-quorum"))
    given = [(flag, policies[name]) for name, flag in flags if name in policies]
    for (larger_flag, larger), (smaller_flag, smaller) in zip(given, given[1:]):
        if larger < smaller:
            raise UsageError(f"{smaller_flag} {smaller} is more than {larger_flag} {larger}: "
                             "need ensemble size >= write quorum >= ack quorum")


def add_run(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--port", type=port_number, default=6700, help="port of the broker protocol")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s)")
    parser.add_argument("--advertised-address", type=HostPorts("advertised"), help="HOST:PORT clients dial (default: HOST:PORT, or the host name for 0.0.0.0)")
    parser.add_argument("--advertised-listeners", type=Listeners(), default={}, metavar="NAME:HOST:PORT,...",
                        help="more addresses clients may dial, each under a name they ask for with --listener-name "
                             "(Pulsar's advertisedListeners), e.g. external:localhost:6700; 'internal' is the advertised address")
    parser.add_argument("--pulsar-port", type=port_number, metavar="PORT",
                        help="serve Pulsar's binary protocol on this port, for Pulsar's own clients (no Pulsar listener without it)")
    parser.add_argument("--pulsar-advertised-listeners", type=Listeners(), default={}, metavar="NAME:HOST:PORT,...",
                        help="the Pulsar listeners other than the internal one, each under the name a Pulsar client asks "
                             "for with its listener name, e.g. external:localhost:6650")
    parser.add_argument("--web-port", type=port_number, metavar="PORT",
                        help="serve the web service on this port: Pulsar's REST admin API (/admin/v2), HTTP lookup "
                             "(/lookup/v2, for Pulsar clients given an http:// service URL) and /metrics")
    parser.add_argument("--web-tls-port", type=port_number, metavar="PORT",
                        help="serve the web service over HTTPS on this port (needs --tls-cert-file and --tls-key-file)")
    parser.add_argument("--cluster-name", default="standalone",
                        help="the cluster's name (Pulsar's clusterName): the REST API's /admin/v2/clusters, the clusters "
                             "tenants may be allowed, the producer names the broker gives (default %(default)s)")
    parser.add_argument("--broker-id", help="stable identity (default: the advertised address)")
    parser.add_argument(
        "--metrics-port", type=metrics_port, default=0, metavar="PORT",
        help="serve Prometheus metrics on http://HOST:PORT/metrics (default 0: no endpoint, nothing measured)",
    )
    parser.add_argument("--ledger-password", default="", help="password of the topics' ledgers (Spark export needs the same)")
    parser.add_argument("--session-timeout-ms", type=ranges.session_timeout_ms, default=10_000, help="ZooKeeper session timeout; its partitions move to other brokers this long after it is gone")
    parser.add_argument(
        "--startup-timeout", type=ranges.interval, default=60_000, metavar="DURATION",
        help="retry the ZooKeeper steps of start-up (connect, bookie registry, registration) this long, then exit 2 naming the step",
    )
    parser.add_argument("--entry-cache-bytes", type=ranges.memory_bytes, default=64 * 1024**2, help="memory the entries kept for consumers may hold, their objects included, all partitions together")
    parser.add_argument("--delayed-memory-messages", type=Bounded("integer", 1, 10_000_000, why="memory"), metavar="N",
                        default=DELAYED_MAX_DEFAULT,
                        help="delayed messages each shared subscription holds in memory; past it they are spilled to an unnamed "
                             "file in $TMPDIR, in runs sorted by time (Pulsar's delayed delivery bucket tracker does the same "
                             "with ledgers)")
    parser.add_argument("--cursor-writes-per-s", type=Bounded("integer", 1, 10_000_000, why="a bound, not a target"), metavar="N",
                        default=CURSOR_WRITES_PER_S_DEFAULT,
                        help="appends to cursor ledgers the broker makes per second, all subscriptions together (each "
                             "subscription has one write in flight; acknowledgements arriving meanwhile go into its next)")
    parser.add_argument("--publish-buffer-bytes", type=ranges.positive_memory_bytes, default=PUBLISH_BUFFER_BYTES_DEFAULT,
                        help="producers' batches taken and not yet persisted or answered, all partitions together "
                             "(Pulsar's maxMessagePublishBufferSizeInMB); past it the broker stops reading from producers' "
                             "connections until half of it is left")
    parser.add_argument("--frame-bytes-max", type=ranges.frame_bytes, default=16 * 1024**2, help="largest frame a client may send; a longer one closes its connection")
    parser.add_argument("--no-auto-topic-creation", action="store_true", help="refuse producers and consumers of unknown topics")
    parser.add_argument("--retention-check-interval", type=ranges.interval, default=5_000, metavar="DURATION", help="how often each partition checks its policies, message TTL and retention")
    add_policies(parser, defaults=True)
    from quire.security_options import add_authentication, add_bookie_client, add_tls_server

    add_authentication(parser)
    add_tls_server(parser)
    add_bookie_client(parser)
    parser.add_argument("--tls-port", type=port_number, metavar="PORT",
                        help="serve quire's protocol over TLS on this port too (needs --tls-cert-file and --tls-key-file)")
    parser.add_argument("--tls-handshake-timeout", type=ranges.interval, default=10_000, metavar="DURATION",
                        help="close a TLS connection whose handshake has not finished by then (default 10s)")
    parser.add_argument("--pulsar-tls-port", type=port_number, metavar="PORT",
                        help="serve Pulsar's protocol over TLS (pulsar+ssl://) on this port (needs --tls-cert-file and --tls-key-file)")
    from quire.peer_limit_options import add_peer_limits

    add_peer_limits(parser, keepalive=True, requests_per_connection=None)


def run(arguments: argparse.Namespace) -> int:
    from broker.broker_process import BrokerStartupError, run_broker
    from broker.config import BrokerConfig
    from broker.topic_records import TopicPolicies

    host = arguments.host
    if arguments.metrics_port == arguments.port:
        raise UsageError(f"--metrics-port must differ from --port ({arguments.port})")
    if arguments.pulsar_port is not None and arguments.pulsar_port != 0 and arguments.pulsar_port in (arguments.port, arguments.metrics_port):
        raise UsageError(f"--pulsar-port must differ from --port and --metrics-port ({arguments.pulsar_port})")
    if arguments.pulsar_advertised_listeners and arguments.pulsar_port is None:
        raise UsageError("--pulsar-advertised-listeners needs --pulsar-port")
    if "internal" in arguments.pulsar_advertised_listeners:
        raise UsageError("--pulsar-advertised-listeners: the internal Pulsar listener is the advertised host with --pulsar-port")
    if arguments.startup_timeout < 1:
        raise UsageError(f"--startup-timeout must be positive, got {arguments.startup_timeout}ms")
    listeners = arguments.advertised_listeners
    internal = listeners.get("internal")
    if internal is not None and arguments.advertised_address not in (None, internal):
        raise UsageError(f"the internal listener ({internal}) must be the --advertised-address ({arguments.advertised_address})")
    advertised = (arguments.advertised_address or internal
                  or f"{socket.gethostname() if host in ('0.0.0.0', '::') else host}:{arguments.port}")
    from quire.peer_limit_options import peer_limits_from
    from quire.security_options import authenticator_from, bookie_credentials_from, tls_server_context_from

    tls_context = tls_server_context_from(arguments)
    if tls_context is None and any(port is not None for port in (arguments.tls_port, arguments.pulsar_tls_port, arguments.web_tls_port)):
        raise UsageError("--tls-port, --pulsar-tls-port and --web-tls-port need --tls-cert-file and --tls-key-file")
    ports = [port for port in (arguments.port, arguments.metrics_port, arguments.pulsar_port, arguments.tls_port,
                               arguments.pulsar_tls_port, arguments.web_port, arguments.web_tls_port) if port]
    if len(ports) != len(set(ports)):
        raise UsageError(f"the broker's ports must differ from each other (--port, --metrics-port, --pulsar-port, "
                         f"--tls-port, --pulsar-tls-port, --web-port, --web-tls-port): {', '.join(map(str, ports))}")
    web_client_context = None
    if arguments.tls_trust_certs_file is not None:
        from security.tls import client_context

        try:
            web_client_context = client_context(arguments.tls_trust_certs_file)
        except (OSError, ValueError) as error:
            raise UsageError(f"TLS: {error}") from None
    authenticator = authenticator_from(arguments, tls_certificates=arguments.tls_trust_certs_file is not None)
    try:
        config = BrokerConfig(
            broker_id=arguments.broker_id or advertised,
            host=host,
            port=arguments.port,
            advertised_address=advertised,
            advertised_listeners=listeners,
            ledger_password=arguments.ledger_password.encode(),
            entry_cache_bytes=arguments.entry_cache_bytes,
            delayed_memory_messages=arguments.delayed_memory_messages,
            cursor_writes_per_s=arguments.cursor_writes_per_s,
            publish_buffer_bytes=arguments.publish_buffer_bytes,
            frame_bytes_max=arguments.frame_bytes_max,
            auto_topic_creation=not arguments.no_auto_topic_creation,
            default_policies=TopicPolicies.from_dict(policies_from(arguments)),
            retention_check_interval_s=arguments.retention_check_interval / 1000,
            metrics_port=arguments.metrics_port,
            pulsar_port=arguments.pulsar_port,
            pulsar_advertised_listeners=arguments.pulsar_advertised_listeners,
            cluster_name=arguments.cluster_name,
            authenticator=authenticator,
            superuser_roles=arguments.superuser_roles,
            tls_context=tls_context,
            tls_port=arguments.tls_port,
            pulsar_tls_port=arguments.pulsar_tls_port,
            web_port=arguments.web_port,
            web_tls_port=arguments.web_tls_port,
            web_client_tls_context=web_client_context,
            tls_handshake_deadline_s=arguments.tls_handshake_timeout / 1000,
            **peer_limits_from(arguments),
        )
    except ValueError as error:
        raise UsageError(str(error)) from None
    configure_logging(arguments.log_level, "broker", config.broker_id, arguments.log_format)
    try:
        bookie_credentials = bookie_credentials_from(arguments)
        tune_gc()
        trio.run(lambda: run_broker(config, arguments.zk, arguments.root, session_timeout_ms=arguments.session_timeout_ms,
                                    startup_timeout_ms=arguments.startup_timeout, bookie_credentials=bookie_credentials))
    except BrokerStartupError as error:
        raise UsageError(str(error)) from None
    return 0
