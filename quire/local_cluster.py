"""A local cluster of background processes under one data directory:
ZooKeeper, N bookies and M brokers. `cluster.json` in the
directory records every process (pid, address, command, log) as it starts,
so that `status` and `down` work even after a failed `up`."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

STATE_FILE = "cluster.json"
METRICS_BASE_PORT = 8000  # BookKeeper's prometheusStatsHttpPort
PULSAR_BASE_PORT = 6650  # Pulsar's brokerServicePort; broker i takes BASE+2i (and BASE+2i+1 for TLS)
BROKER_TLS_BASE_PORT = 6750  # with --secure: broker i serves quire's protocol over TLS on BASE+i
WEB_BASE_PORT = 8080  # Pulsar's webServicePort: broker i serves the REST admin API and HTTP lookup on BASE+i
WEB_TLS_BASE_PORT = 8443  # Pulsar's webServicePortTls: with --secure, broker i serves them over HTTPS on BASE+i
START_DEADLINE_S = 60.0
STOP_DEADLINE_S = 30.0
STATUS_ZK_PROBE_S = 1.0  # `ruok` to ZooKeeper
STATUS_REGISTRY_READ_S = 3.0  # connecting to ZooKeeper and reading the registrations


class ClusterError(Exception):
    """The cluster cannot do what was asked; the message says why."""


@dataclass
class ProcessRecord:
    role: str  # zookeeper | bookie | broker
    name: str
    pid: int
    address: str
    command: list[str]
    log: str
    data_dirs: list[str] = field(default_factory=list)
    metrics_address: str = ""  # HOST:PORT of its /metrics, if any
    pulsar_url: str = ""  # a broker's pulsar:// service URL, if it serves Pulsar's protocol
    web_url: str = ""  # a broker's web service (REST admin API, HTTP lookup), if it serves one


@dataclass
class ClusterState:
    data_dir: str
    zk_hosts: str
    root: str
    processes: list[ProcessRecord] = field(default_factory=list)
    security_dir: str = ""  # with --secure: keys, tokens, certificates and ZooKeeper's identity

    def use_zk_auth(self) -> None:
        """This process talks to the cluster's ZooKeeper as its processes do."""
        if self.security_dir:
            from coordination.zk_store import set_digest_auth

            set_digest_auth((Path(self.security_dir) / ZK_AUTH_FILE).read_text().strip())

    def save(self) -> None:
        path = Path(self.data_dir) / STATE_FILE
        temporary = path.with_suffix(".tmp")
        temporary.write_text(json.dumps(asdict(self), indent=2) + "\n")
        os.replace(temporary, path)

    @classmethod
    def load(cls, data_dir: Path) -> "ClusterState | None":
        path = Path(data_dir) / STATE_FILE
        if not path.exists():
            return None
        try:
            fields = json.loads(path.read_text())
            fields["processes"] = [ProcessRecord(**record) for record in fields["processes"]]
            return cls(**fields)
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise ClusterError(
                f"{path} is damaged ({type(error).__name__}: {error}); check that no quire process of this "
                "cluster still runs (pgrep -af quire), then remove the file"
            ) from None


ZK_AUTH_FILE = "zk.auth"
ADMIN_ROLE = "admin"


def make_security(directory: Path) -> dict[str, Path]:
    """What a secure local cluster uses, made once: a secret key and a
    superuser's token (role admin), a CA with a server certificate for
    127.0.0.1 and localhost (CN quire-server: how brokers and bookies
    authenticate to bookies) and a client certificate for admin, and a
    ZooKeeper digest identity. Key files are mode 0600."""
    import secrets

    from security.certificates import write_tls_files
    from security.tokens import create_secret_key, create_token, write_key_file

    directory.mkdir(parents=True, exist_ok=True)
    files = dict(write_tls_files(directory, hosts=["127.0.0.1", "localhost"], roles=[ADMIN_ROLE]))
    secret_key = create_secret_key()
    files["secret.key"] = write_key_file(directory / "secret.key", secret_key)
    files["admin.token"] = write_key_file(directory / "admin.token",
                                          create_token(ADMIN_ROLE, secret_key=secret_key, now=time.time()).encode())
    files[ZK_AUTH_FILE] = write_key_file(directory / ZK_AUTH_FILE, f"quire:{secrets.token_urlsafe(18)}".encode())
    return files


def secure_options(files: dict[str, Path]) -> dict[str, list[str]]:
    """The flags each role runs with in a secure local cluster."""
    tls = ["--tls-cert-file", str(files["server.cert.pem"]), "--tls-key-file", str(files["server.key.pem"]),
           "--tls-trust-certs-file", str(files["ca.cert.pem"])]
    common = ["--zk-auth-file", str(files[ZK_AUTH_FILE]), "--auth-token-secret-key", str(files["secret.key"]), *tls]
    from security.certificates import SERVER_COMMON_NAME

    return {"bookie": [*common, "--client-roles", f"{SERVER_COMMON_NAME},{ADMIN_ROLE}"],
            "broker": [*common, "--superuser-roles", ADMIN_ROLE]}


def quire_command(*arguments: str) -> list[str]:
    return [sys.executable, "-m", "quire", *arguments]


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False


# Processes this command started itself. Right after the fork a child's
# /proc cmdline is still its parent's until exec, so the cmdline check below
# would call it gone; its Popen knows better.
_started: dict[int, subprocess.Popen] = {}


def process_alive(record: ProcessRecord) -> bool:
    """Whether the recorded pid still runs our command (not a reused pid)."""
    process = _started.get(record.pid)
    if process is not None:
        return process.poll() is None
    try:
        cmdline = Path(f"/proc/{record.pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    try:
        with open(f"/proc/{record.pid}/stat") as stat:
            if stat.read().rsplit(")", 1)[1].split()[0] == "Z":
                return False
    except OSError:
        return False
    return [part.decode(errors="replace") for part in cmdline if part] == record.command


def log_tail(path: str, lines: int = 15) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _spawn(state: ClusterState, record_fields: dict, command: list[str], log_path: Path) -> ProcessRecord:
    try:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log:
            process = subprocess.Popen(
                command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
    except OSError as error:
        raise ClusterError(f"cannot start {record_fields['name']} (log {log_path}): {error.strerror or error}") from None
    _started[process.pid] = process
    record = ProcessRecord(pid=process.pid, command=command, log=str(log_path), **record_fields)
    state.processes.append(record)
    state.save()
    return record


def up(
    data_dir: Path,
    *,
    bookies: int = 3,
    zk_port: int = 2181,
    bookie_base_port: int = 3181,
    root: str = "/quire",
    bookie_options: list[str] | None = None,
    brokers: int = 1,
    broker_base_port: int = 6700,
    broker_options: list[str] | None = None,
    metrics_base_port: int = METRICS_BASE_PORT,
    pulsar_base_port: int = PULSAR_BASE_PORT,
    secure: bool = False,
    broker_tls_base_port: int = BROKER_TLS_BASE_PORT,
    web_base_port: int = WEB_BASE_PORT,
    web_tls_base_port: int = WEB_TLS_BASE_PORT,
    progress=print,
) -> ClusterState:
    """`metrics_base_port`: bookie i serves /metrics on BASE+i, broker j on
    BASE+bookies+j (0: no metrics). `pulsar_base_port`: broker i serves
    Pulsar's protocol on BASE+2i (the next port is its TLS listener's);
    0: no Pulsar listener. `secure`: tokens, TLS and ZooKeeper ACLs
    everywhere (see `make_security`); broker i then also serves quire's
    protocol over TLS on `broker_tls_base_port` + i and its web service
    over HTTPS on `web_tls_base_port` + i. `web_base_port`: broker i serves
    its web service (REST admin API, HTTP lookup, /metrics) on BASE+i; 0: none."""
    from bookie.durable_files import directory_problem

    # The ports first: they are arithmetic on the arguments, checked before
    # anything (even the data directory) is made.
    metrics_ports = [metrics_base_port + index for index in range(bookies + brokers)] if metrics_base_port else []
    pulsar_ports = [pulsar_base_port + 2 * index for index in range(brokers)] if pulsar_base_port else []
    ports = [zk_port] + [bookie_base_port + index for index in range(bookies)] + [broker_base_port + index for index in range(brokers)]
    web_ports = [web_base_port + index for index in range(brokers)] if web_base_port else []
    ports += metrics_ports + pulsar_ports + web_ports
    if secure:
        ports += [port + 1 for port in pulsar_ports] + [broker_tls_base_port + index for index in range(brokers)]
        ports += [web_tls_base_port + index for index in range(brokers)]
    if len(set(ports)) != len(ports):
        raise ClusterError(f"the ports of ZooKeeper, bookies, brokers, Pulsar listeners, web services and metrics overlap: "
                           f"{sorted(ports)}")
    if max(ports) > 65535:
        raise ClusterError(f"ports run past 65535: {sorted(ports)}")
    data_dir = Path(data_dir).resolve()
    problem = directory_problem(data_dir, "data directory")
    if problem is not None:
        raise ClusterError(problem)
    previous = ClusterState.load(data_dir)
    if previous is not None and any(process_alive(record) for record in previous.processes):
        raise ClusterError(f"a cluster is already running in {data_dir}; stop it with `quire cluster down --data-dir {data_dir}`")
    busy = [port for port in ports if port_in_use(port)]
    if busy:
        raise ClusterError(f"port{'s' if len(busy) > 1 else ''} {', '.join(map(str, busy))} already in use")
    zk_hosts = f"127.0.0.1:{zk_port}"
    state = ClusterState(str(data_dir), zk_hosts, root)
    options = {"bookie": [], "broker": []}
    if secure:
        security_dir = data_dir / "security"
        files = make_security(security_dir)
        state.security_dir = str(security_dir)
        options = secure_options(files)
        state.use_zk_auth()
    state.save()
    try:
        zk_dir = data_dir / "zookeeper"
        zk = _spawn(
            state,
            dict(role="zookeeper", name="zookeeper", address=zk_hosts, data_dirs=[str(zk_dir)]),
            quire_command("zk", "run", "--port", str(zk_port), "--data-dir", str(zk_dir)),
            data_dir / "logs" / "zookeeper.log",
        )
        _wait_for_zookeeper(zk, zk_port)
        progress(f"zookeeper serving on {zk_hosts}")
        for index in range(bookies):
            port = bookie_base_port + index
            name = f"bookie-{index + 1}"
            journal_dir, ledger_dir = data_dir / name / "journal", data_dir / name / "ledgers"
            metrics = _metrics_options(metrics_ports, index)
            _spawn(
                state,
                dict(role="bookie", name=name, address=f"127.0.0.1:{port}", data_dirs=[str(journal_dir), str(ledger_dir)],
                     metrics_address=_metrics_address(metrics)),
                quire_command(
                    "bookie", "run", "--zk", zk_hosts, "--root", root, "--port", str(port),
                    "--journal-dir", str(journal_dir), "--ledger-dir", str(ledger_dir), *metrics, *options["bookie"],
                    *(bookie_options or []),
                ),
                data_dir / "logs" / f"{name}.log",
            )
        _wait_for_bookies(state)
        for record in state.processes:
            if record.role == "bookie":
                progress(f"{record.name} serving on {record.address}")
        for index in range(brokers):
            port = broker_base_port + index
            name = f"broker-{index + 1}"
            metrics = _metrics_options(metrics_ports, bookies + index)
            pulsar = ["--pulsar-port", str(pulsar_ports[index])] if pulsar_ports else []
            pulsar_url = f"pulsar://127.0.0.1:{pulsar_ports[index]}" if pulsar_ports else ""
            if secure:
                pulsar += ["--pulsar-tls-port", str(pulsar_ports[index] + 1)] if pulsar_ports else []
                pulsar += ["--tls-port", str(broker_tls_base_port + index)]
                pulsar_url = f"pulsar+ssl://127.0.0.1:{pulsar_ports[index] + 1}" if pulsar_ports else ""
            web = ["--web-port", str(web_ports[index])] if web_ports else []
            web_url = f"http://127.0.0.1:{web_ports[index]}" if web_ports else ""
            if secure:
                web += ["--web-tls-port", str(web_tls_base_port + index)]
                web_url = f"https://127.0.0.1:{web_tls_base_port + index}"
            _spawn(
                state,
                dict(role="broker", name=name, address=f"127.0.0.1:{port}", metrics_address=_metrics_address(metrics),
                     pulsar_url=pulsar_url, web_url=web_url),
                quire_command(
                    "broker", "run", "--zk", zk_hosts, "--root", root, "--port", str(port), *pulsar, *web, *metrics,
                    *options["broker"], *(broker_options or []),
                ),
                data_dir / "logs" / f"{name}.log",
            )
        _wait_for_registrations(state, "broker")
        for record in state.processes:
            if record.role == "broker":
                progress(f"{record.name} serving on {record.address}")
    except BaseException:
        down(data_dir, progress=lambda message: None)
        raise
    return state


def _metrics_options(metrics_ports: list[int], index: int) -> list[str]:
    return ["--metrics-port", str(metrics_ports[index])] if metrics_ports else []


def _metrics_address(options: list[str]) -> str:
    return f"127.0.0.1:{options[1]}" if options else ""


def _wait_for_zookeeper(record: ProcessRecord, port: int) -> None:
    from coordination.zk_launcher import four_letter_word

    deadline = time.monotonic() + START_DEADLINE_S
    while time.monotonic() < deadline:
        if not process_alive(record):
            raise ClusterError(f"zookeeper exited during start:\n{log_tail(record.log)}")
        try:
            if four_letter_word("127.0.0.1", port, "ruok", 1.0) == "imok":
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise ClusterError(f"zookeeper did not answer within {START_DEADLINE_S:.0f}s:\n{log_tail(record.log)}")


def _wait_for_bookies(state: ClusterState) -> None:
    _wait_for_registrations(state, "bookie")


def registered_addresses(store) -> dict[str, str]:
    """Registered bookies and brokers: address -> writable / read-only / serving."""
    from broker.topic_records import BROKERS
    from coordination.cluster_layout import ClusterLayout, list_bookies
    from coordination.store import NoNodeError

    registered = {}
    for read_only in (False, True):
        for info in list_bookies(store, ClusterLayout(), read_only=read_only).values():
            registered[info.address] = "read-only" if read_only else "writable"
    try:
        for name in store.children(BROKERS):
            try:
                registered[json.loads(store.get(f"{BROKERS}/{name}")[0])["address"]] = "serving"
            except NoNodeError:
                continue
    except NoNodeError:
        pass
    return registered


def _wait_for_registrations(state: ClusterState, role: str) -> None:
    from coordination.zk_store import KazooMetadataStore

    # A ZooKeeper that has just started drops kazoo's first connections;
    # kazoo retries, and its warnings would only confuse.
    logging.getLogger("kazoo").setLevel(logging.ERROR)

    expected = {record.address: record for record in state.processes if record.role == role}
    deadline = time.monotonic() + START_DEADLINE_S
    with KazooMetadataStore.connect(state.zk_hosts, state.root) as store:
        while True:
            for record in expected.values():
                if not process_alive(record):
                    raise ClusterError(f"{record.name} exited during start:\n{log_tail(record.log)}")
            registered = registered_addresses(store)
            if set(expected) <= set(registered):
                return
            if time.monotonic() > deadline:
                missing = sorted(set(expected) - set(registered))
                raise ClusterError(f"{role}s {', '.join(missing)} did not register within {START_DEADLINE_S:.0f}s")
            time.sleep(0.1)


def stop_process(record: ProcessRecord, deadline_s: float = STOP_DEADLINE_S) -> bool:
    """SIGTERM, wait, SIGKILL. Return whether the process had to be killed."""
    if not process_alive(record):
        return False
    try:
        os.kill(record.pid, signal.SIGTERM)
    except ProcessLookupError:
        return False
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if not process_alive(record):
            return False
        time.sleep(0.05)
    try:
        os.kill(record.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return True


def down(data_dir: Path, *, progress=print) -> ClusterState | None:
    state = ClusterState.load(Path(data_dir).resolve())
    if state is None:
        return None
    # Bookies before ZooKeeper, so that they can unregister.
    order = {"broker": 0, "bookie": 1, "zookeeper": 2}
    for role in sorted({record.role for record in state.processes}, key=lambda role: order.get(role, 0)):
        records = [record for record in state.processes if record.role == role]
        was_alive = {record.name: process_alive(record) for record in records}
        for record in records:
            if was_alive[record.name]:
                os.kill(record.pid, signal.SIGTERM)
        for record in records:
            killed = stop_process(record)
            if not was_alive[record.name]:
                progress(f"{record.name} was not running")
            else:
                progress(f"{record.name} {'killed after the stop deadline' if killed else 'stopped'}")
    state.processes = []
    state.save()
    return state


def directory_bytes(paths: list[str]) -> int:
    total = 0
    for path in paths:
        for directory, _, files in os.walk(path):
            for name in files:
                try:
                    total += os.stat(os.path.join(directory, name)).st_blocks * 512
                except OSError:
                    pass
    return total


def status(data_dir: Path) -> tuple[ClusterState | None, list[dict]]:
    """One row per process: name, role, pid, address, state, disk bytes."""
    state = ClusterState.load(Path(data_dir).resolve())
    if state is None:
        return None, []
    state.use_zk_auth()
    zk_record = next((record for record in state.processes if record.role == "zookeeper"), None)
    zk_state, registrations, registry_error = "down", {}, "not running"
    if zk_record is not None and process_alive(zk_record):
        zk_state, registry_error = _probe_zookeeper(state.zk_hosts)
        if registry_error is None:
            registrations, registry_error = _read_registrations(state)
    rows = []
    for record in state.processes:
        alive = process_alive(record)
        if not alive:
            process_state = "down"
        elif record.role == "zookeeper":
            process_state = zk_state
        elif registry_error is not None:
            process_state = f"unknown (ZooKeeper: {registry_error})"
        else:
            process_state = registrations.get(record.address, "starting/unregistered")
        rows.append(
            dict(
                name=record.name, role=record.role, pid=record.pid, address=record.address,
                metrics=f"http://{record.metrics_address}/metrics" if record.metrics_address else "-",
                pulsar=record.pulsar_url or "-",
                web=record.web_url or "-",
                state=process_state, disk_bytes=directory_bytes(record.data_dirs), log=record.log,
            )
        )
    return state, rows


def _probe_zookeeper(zk_hosts: str) -> tuple[str, str | None]:
    """ZooKeeper's row ("serving" when it answers `ruok`) and, when it does
    not, why the registrations cannot be read."""
    from coordination.zk_launcher import four_letter_word

    host, port = zk_hosts.rsplit(":", 1)
    try:
        answer = four_letter_word(host, int(port), "ruok", STATUS_ZK_PROBE_S)
    except OSError as error:
        return "not answering", f"no answer to ruok within {STATUS_ZK_PROBE_S:.0f}s ({error.strerror or error})"
    if answer != "imok":
        return "not answering", f"ruok answered {answer!r}"
    return "serving", None


def _read_registrations(state: ClusterState) -> tuple[dict[str, str], str | None]:
    """The registered bookies and brokers, or why they could not be read
    within STATUS_REGISTRY_READ_S. kazoo's own bounds are longer (retries),
    so the read runs on a daemon thread that is left behind when it is late:
    status is a one-shot command."""
    outcome: dict = {}

    def read() -> None:
        try:
            from coordination.zk_store import KazooMetadataStore

            with KazooMetadataStore.connect(
                state.zk_hosts, state.root, connect_timeout_ms=int(STATUS_REGISTRY_READ_S * 1000)
            ) as store:
                outcome["registrations"] = registered_addresses(store)
        except Exception as error:  # status reports, it does not fail
            outcome["error"] = str(error)

    reader = threading.Thread(target=read, name="cluster-status-registry", daemon=True)
    reader.start()
    reader.join(STATUS_REGISTRY_READ_S)
    if "registrations" in outcome:
        return outcome["registrations"], None
    return {}, outcome.get("error", f"no answer within {STATUS_REGISTRY_READ_S:.0f}s")
