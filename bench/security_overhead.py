"""Benchmark: what security costs. The same runs on clusters started one
after the other on this machine, open and secured.

3 bookies and 1 broker on loopback, E=3 WQ=3 AQ=2, 1 KiB messages:
- the official Pulsar client (`pulsar-client`): publishing with batching
  (`--window` in flight), and sequential `send()` latency;
- quire's own client: publishing with batching.

    .venv/bin/python -m bench.security_overhead

Three clusters: `open`; `token_tls`, what clients meet (tokens required,
the broker's listeners TLS); `token_tls_everywhere`, bookies too (TLS only,
client roles), as `quire cluster up --secure` runs. Prints one JSON object
per result, then a summary: with token + TLS (`token_tls`), publish
throughput >= 80% of the open cluster's and p50 latency at most 1.25x its
(the same 80%, as a speed), through both clients; `token_tls_everywhere`'s
ratios are reported beside them.
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


def secure_setups(directory: Path) -> dict[str, dict]:
    """Keys, a token, certificates, and the flags of the two secured
    clusters: `token_tls`, what clients meet (the broker's listeners TLS
    only, tokens required), and `token_tls_everywhere`, bookies too (TLS
    only, their client roles; the broker reaches them with its
    certificate), as `quire cluster up --secure` runs."""
    files = write_tls_files(directory, hosts=["127.0.0.1", "localhost"], roles=[ROLE])
    secret_key = create_secret_key()
    key_file = write_key_file(directory / "secret.key", secret_key)
    token = create_token(ROLE, secret_key=secret_key, now=time.time())
    server = ["--tls-cert-file", str(files["server.cert.pem"]), "--tls-key-file", str(files["server.key.pem"])]
    trust = ["--tls-trust-certs-file", str(files["ca.cert.pem"])]
    auth = ["--auth-token-secret-key", str(key_file)]
    common = {"token": token, "ca": str(files["ca.cert.pem"])}
    return {
        "token_tls": {**common, "bookie_options": [], "broker_options": [*auth, *server, "--superuser-roles", ROLE],
                      "bookie_credentials": NO_CREDENTIALS},
        "token_tls_everywhere": {
            **common,
            "bookie_options": [*auth, *server, *trust, "--client-roles", f"{ROLE},{SERVER_COMMON_NAME}"],
            "broker_options": [*auth, *server, *trust, "--superuser-roles", ROLE],
            "bookie_credentials": ClientCredentials(token, client_context(files["ca.cert.pem"])),
        },
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
    results = {}
    with tempfile.TemporaryDirectory(prefix="quire-bench-security-") as directory:
        setups = secure_setups(Path(directory))
        results["open"] = run_cluster("open", arguments, None)
        for label, setup in setups.items():
            results[label] = run_cluster(label, arguments, setup)
    summary: dict = {"name": "security_overhead_summary", "ratio_min": RATIO_MIN, "targets_on": "token_tls"}
    met = {}
    for label in ("token_tls", "token_tls_everywhere"):
        for run in ("pulsar_publish", "quire_publish"):
            throughput = results[label][run]["messages_per_s"] / results["open"][run]["messages_per_s"]
            summary[f"{run}_messages_per_s_open"] = results["open"][run]["messages_per_s"]
            summary[f"{run}_messages_per_s_{label}"] = results[label][run]["messages_per_s"]
            summary[f"{run}_throughput_ratio_{label}"] = round(throughput, 3)
            if label == "token_tls":
                met[f"{run}_throughput"] = throughput >= RATIO_MIN
        for run in ("pulsar_publish", "quire_publish", "pulsar_sequential"):
            open_p50, secure_p50 = results["open"][run]["latency_ms_p50"], results[label][run]["latency_ms_p50"]
            summary[f"{run}_latency_ms_p50_open"] = open_p50
            summary[f"{run}_latency_ms_p50_{label}"] = secure_p50
            speed = open_p50 / secure_p50 if secure_p50 else None
            summary[f"{run}_p50_speed_ratio_{label}"] = None if speed is None else round(speed, 3)
            if label == "token_tls":
                met[f"{run}_p50"] = speed is not None and speed >= RATIO_MIN
    summary["met"] = met
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
