"""`quire cluster up|status|down`: a local cluster in the background."""

from __future__ import annotations

import argparse
from pathlib import Path

from quire import cli_ranges as ranges
from quire.cli_parsing import UsageError, metrics_port, port_number, port_or_zero


def add_data_dir(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data-dir", type=Path, required=True, metavar="DIR", help="the cluster's directory: each process's data and log, and cluster.json")


def add_up(parser: argparse.ArgumentParser) -> None:
    add_data_dir(parser)
    parser.add_argument("--bookies", type=ranges.processes, default=3, help="bookies to start")
    parser.add_argument("--brokers", type=ranges.processes_or_none, default=1, help="brokers to start")
    parser.add_argument("--zk-port", type=port_number, default=2181, help="port of the cluster's ZooKeeper")
    parser.add_argument("--bookie-base-port", type=port_number, default=3181, help="bookie i listens on BASE+i")
    parser.add_argument("--broker-base-port", type=port_number, default=6700, help="broker i serves quire's protocol on BASE+i")
    parser.add_argument("--pulsar-base-port", type=port_or_zero, default=6650,
                        help="broker i serves Pulsar's protocol on BASE+2i (0: no Pulsar listener; default %(default)s)")
    parser.add_argument("--secure", action="store_true",
                        help="make keys, an admin token, TLS certificates and a ZooKeeper identity under DIR/security, and "
                             "run every process with them: tokens, TLS (Pulsar's on BASE+2i+1) and ZooKeeper ACLs")
    parser.add_argument("--broker-tls-base-port", type=port_number, default=6750,
                        help="with --secure: broker i serves quire's protocol over TLS on BASE+i (default %(default)s)")
    parser.add_argument("--web-base-port", type=port_or_zero, default=8080,
                        help="broker i serves its web service (Pulsar's REST admin API, HTTP lookup, /metrics) on BASE+i "
                             "(0: none; default %(default)s)")
    parser.add_argument("--web-tls-base-port", type=port_number, default=8443,
                        help="with --secure: broker i serves its web service over HTTPS on BASE+i (default %(default)s)")
    parser.add_argument(
        "--metrics-base-port", type=metrics_port, default=8000,
        help="Prometheus /metrics: bookie i on BASE+i, broker j on BASE+BOOKIES+j (0: no metrics; default %(default)s)",
    )


def up(arguments: argparse.Namespace) -> int:
    from quire.local_cluster import ClusterError
    from quire.local_cluster import up as cluster_up

    if not arguments.root.startswith("/"):
        raise UsageError(f"--root must be an absolute path, got {arguments.root!r}")
    try:
        state = cluster_up(
            arguments.data_dir,
            bookies=arguments.bookies,
            zk_port=arguments.zk_port,
            bookie_base_port=arguments.bookie_base_port,
            brokers=arguments.brokers,
            broker_base_port=arguments.broker_base_port,
            metrics_base_port=arguments.metrics_base_port,
            pulsar_base_port=arguments.pulsar_base_port,
            root=arguments.root,
            secure=arguments.secure,
            broker_tls_base_port=arguments.broker_tls_base_port,
            web_base_port=arguments.web_base_port,
            web_tls_base_port=arguments.web_tls_base_port,
        )
    except ClusterError as error:
        raise UsageError(str(error)) from None
    print(f"cluster up: --zk {state.zk_hosts} --root {state.root}; logs in {arguments.data_dir}/logs")
    pulsar_urls = [record.pulsar_url.split("://", 1)[1] for record in state.processes if record.pulsar_url]
    scheme = "pulsar+ssl" if arguments.secure else "pulsar"
    if pulsar_urls:
        print(f"Pulsar clients: {scheme}://{','.join(pulsar_urls)}")
    web_urls = [record.web_url for record in state.processes if record.web_url]
    if web_urls:
        print(f"REST admin API: {web_urls[0]}/admin/v2 (HTTP lookup for Pulsar clients: {web_urls[0]})")
    if arguments.secure:
        security = Path(state.security_dir)
        print(f"secured: tokens, TLS and ZooKeeper ACLs; keys, certificates and tokens in {security}\n"
              f"  quire commands:  export QUIRE_AUTH_TOKEN=$(cat {security}/admin.token) "
              f"QUIRE_ZK_AUTH=$(cat {security}/zk.auth)\n"
              f"                   and add --tls-trust-certs-file {security}/ca.cert.pem\n"
              f"  Pulsar clients:  pulsar.Client('{scheme}://{pulsar_urls[0] if pulsar_urls else '...'}', "
              f"tls_trust_certs_file_path='{security}/ca.cert.pem', "
              f"authentication=pulsar.AuthenticationToken(open('{security}/admin.token').read()))")
    return 0


def status(arguments: argparse.Namespace) -> int:
    from quire.local_cluster import ClusterError
    from quire.local_cluster import status as cluster_status

    try:
        state, rows = cluster_status(arguments.data_dir)
    except ClusterError as error:
        raise UsageError(str(error)) from None
    if state is None:
        raise UsageError(f"no cluster in {arguments.data_dir} (start one with `quire cluster up --data-dir ...`)")
    if not rows:
        print(f"cluster in {arguments.data_dir} is stopped")
        return 1
    print(f"{'NAME':<12} {'ROLE':<10} {'PID':>7} {'ADDRESS':<21} {'STATE':<22} {'DISK':>10}  {'PULSAR':<28} "
          f"{'WEB':<24} METRICS")
    for row in rows:
        print(
            f"{row['name']:<12} {row['role']:<10} {row['pid']:>7} {row['address']:<21} "
            f"{row['state']:<22} {row['disk_bytes'] / 1e6:>8.1f}MB  {row['pulsar']:<28} {row['web']:<24} {row['metrics']}"
        )
    return 0 if all(row["state"] != "down" for row in rows) else 1


def down(arguments: argparse.Namespace) -> int:
    from quire.local_cluster import ClusterError
    from quire.local_cluster import down as cluster_down

    try:
        stopped = cluster_down(arguments.data_dir)
    except ClusterError as error:
        raise UsageError(str(error)) from None
    if stopped is None:
        raise UsageError(f"no cluster in {arguments.data_dir}")
    return 0
