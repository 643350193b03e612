"""Benchmark: what security costs. The same runs on two clusters, one after
the other on this machine: one open (plaintext, nobody authenticated), one
secured as `quire cluster up --secure` secures it (token authentication and
TLS on the broker's listeners, bookies serving TLS only and authenticating
their ledger clients, the broker reaching them with its certificate).

3 bookies and 1 broker on loopback, E=3 WQ=3 AQ=2, 1 KiB messages:
- the official Pulsar client (`pulsar-client`): publishing with batching
  (`--window` in flight), and sequential `send()` latency;
- quire's own client: publishing with batching.

    .venv/bin/python -m bench.security_overhead

Prints one JSON object per result, then a summary: with token + TLS,
publish throughput >= 80% of the open cluster's and p50 latency at most
1.25x its (the same 80%, as a speed), through both clients.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import trio

from bench.broker_pubsub import TOPIC_POLICIES, publish
from bench.cluster import bench_cluster, free_port
from bench.pulsar_client import pulsar_publish, pulsar_sequential
from broker.client import Client
from quire import cli_ranges as ranges
from quire.cli_parsing import Bounded, Parser
from security.certificates import SERVER_COMMON_NAME, write_tls_files
from security.credentials import NO_CREDENTIALS, ClientCredentials
from security.tls import client_context
from security.tokens import create_secret_key, create_token, write_key_file

RATIO_MIN = 0.8  # throughput with security / without
ROLE = "bench"


def secure_setup(directory: Path) -> dict:
    """Keys, a token, certificates, and the flags of a secured cluster."""
    files = write_tls_files(directory, hosts=["127.0.0.1", "localhost"], roles=[ROLE])
    secret_key = create_secret_key()
    key_file = write_key_file(directory / "secret.key", secret_key)
    token = create_token(ROLE, secret_key=secret_key, now=time.time())
    tls = ["--tls-cert-file", str(files["server.cert.pem"]), "--tls-key-file", str(files["server.key.pem"]),
           "--tls-trust-certs-file", str(files["ca.cert.pem"])]
    auth = ["--auth-token-secret-key", str(key_file)]
    return {
        "token": token,
        "ca": str(files["ca.cert.pem"]),
        "bookie_options": [*auth, *tls, "--client-roles", f"{ROLE},{SERVER_COMMON_NAME}"],
        "broker_options": [*auth, *tls, "--superuser-roles", ROLE],
        "bookie_credentials": ClientCredentials(token, client_context(files["ca.cert.pem"])),
    }


def run_cluster(label: str, arguments: argparse.Namespace, setup: dict | None) -> dict[str, dict]:
    """The runs on one cluster (secured when `setup` is given)."""
    pulsar_port, tls_port = free_port(), free_port()
    broker_options = ["--pulsar-port", str(pulsar_port)]
    pulsar_url, client_options, quire_options = f"pulsar://127.0.0.1:{pulsar_port}", {}, {}
    if setup is not None:
        import pulsar

        broker_options = ["--pulsar-tls-port", str(pulsar_port), "--tls-port", str(tls_port), *setup["broker_options"]]
        pulsar_url = f"pulsar+ssl://127.0.0.1:{pulsar_port}"
        client_options = {"authentication": pulsar.AuthenticationToken(setup["token"]),
                          "tls_trust_certs_file_path": setup["ca"]}
        quire_options = {"auth_token": setup["token"], "tls_context": client_context(setup["ca"])}
    results: dict[str, dict] = {}
    with bench_cluster(3, broker_count=1, broker_options=broker_options,
                       bookie_options=setup["bookie_options"] if setup else [],
                       bookie_credentials=setup["bookie_credentials"] if setup else NO_CREDENTIALS) as cluster:
        async def topics_and_quire_run() -> dict:
            async with Client.connect(cluster.zk_hosts, cluster.root, **quire_options) as client:
                for name in ("pulsar-publish", "pulsar-sequential", "quire-publish"):
                    await client.create_topic(name, **TOPIC_POLICIES)
                return await publish(client, "quire-publish", batching=True, window=arguments.window,
                                     message_bytes=arguments.message_bytes, seconds=arguments.seconds,
                                     warmup_s=arguments.warmup_seconds, label=f"quire client publish ({label})")

        results["quire_publish"] = trio.run(topics_and_quire_run)
        results["pulsar_publish"] = pulsar_publish(pulsar_url, "persistent://public/default/pulsar-publish", arguments,
                                                   client_options)
        results["pulsar_sequential"] = pulsar_sequential(pulsar_url, "persistent://public/default/pulsar-sequential",
                                                         arguments, client_options)
    for name, value in results.items():
        value["name"] = f"{value['name']}_{label}"
        value["parameters"]["security"] = label
        print(json.dumps(value), flush=True)
    return results


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = Parser(prog=prog or "bench/security_overhead.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=ranges.bench_seconds, default=10.0, help="measured seconds of each publish run")
    parser.add_argument("--warmup-seconds", type=ranges.warmup_seconds, default=2.0, help="seconds of publishing before measuring")
    parser.add_argument("--window", type=ranges.in_flight, default=10_000, help="messages in flight when publishing")
    parser.add_argument("--message-bytes", type=Bounded("size", 1, ranges.MESSAGE_BYTES_MAX,
                                                        why="the largest message a producer sends"),
                        default=1024, help="size of each message")
    return parser


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    arguments = build_parser(prog).parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="quire-bench-security-") as directory:
        setup = secure_setup(Path(directory))
        open_results = run_cluster("open", arguments, None)
        secure_results = run_cluster("token_tls", arguments, setup)
    summary: dict = {"name": "security_overhead_summary", "ratio_min": RATIO_MIN}
    met = {}
    for run in ("pulsar_publish", "quire_publish"):
        throughput = secure_results[run]["messages_per_s"] / open_results[run]["messages_per_s"]
        summary[f"{run}_messages_per_s_open"] = open_results[run]["messages_per_s"]
        summary[f"{run}_messages_per_s_token_tls"] = secure_results[run]["messages_per_s"]
        summary[f"{run}_throughput_ratio"] = round(throughput, 3)
        met[f"{run}_throughput"] = throughput >= RATIO_MIN
    for run in ("pulsar_publish", "quire_publish", "pulsar_sequential"):
        open_p50, secure_p50 = open_results[run]["latency_ms_p50"], secure_results[run]["latency_ms_p50"]
        summary[f"{run}_latency_ms_p50_open"] = open_p50
        summary[f"{run}_latency_ms_p50_token_tls"] = secure_p50
        speed = open_p50 / secure_p50 if secure_p50 else None
        summary[f"{run}_p50_speed_ratio"] = None if speed is None else round(speed, 3)
        met[f"{run}_p50"] = speed is not None and speed >= RATIO_MIN
    summary["met"] = met
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
