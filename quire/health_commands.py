"""`quire zk|bookie|broker health HOST:PORT`: whether one process serves,
for health checks (docker-compose, Kubernetes probes, monitoring). Exit 0
and one line when it does; exit 1 and one line saying why when it does
not; exit 2 for a bad argument.

- ZooKeeper: answers `ruok` with `imok` and `srvr` with its mode (it serves
  requests, not only runs).
- A bookie: answers GET_INFO, is writable, and is registered as writable
  in ZooKeeper (clients will choose it for new ensembles).
- A broker: answers the `health` admin request, which says that it is
  registered in ZooKeeper under its id and not stopping (its lookups and
  partitions work).
"""

from __future__ import annotations

import argparse

import trio

from quire import cli_ranges as ranges
from quire.cli_parsing import HostPorts, UsageError

EXIT_UNHEALTHY = 1
PROBE_TIMEOUT_MS = 5_000


def add_health(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("address", type=HostPorts(what), metavar="HOST:PORT", help=f"the {what}'s address")
    parser.add_argument("--timeout", type=ranges.interval, default=PROBE_TIMEOUT_MS, metavar="DURATION",
                        help="how long to wait for answers before calling it unhealthy")
    if what != "ZooKeeper":
        from quire.security_options import add_credentials

        add_credentials(parser)


def _split(address: str, what: str) -> tuple[str, int]:
    from ledger_client.bookie_client import parse_address

    try:
        return parse_address(address, what)
    except ValueError as error:
        raise UsageError(str(error)) from None


def _verdict(what: str, address: str, problem: str | None, detail: str = "") -> int:
    if problem is None:
        print(f"{what} {address}: healthy{detail}")
        return 0
    print(f"{what} {address}: unhealthy: {problem}")
    return EXIT_UNHEALTHY


def zk_health(arguments: argparse.Namespace) -> int:
    from coordination.zk_launcher import four_letter_word

    host, port = _split(arguments.address, "ZooKeeper")
    problem = None
    mode = ""
    try:
        if four_letter_word(host, port, "ruok", arguments.timeout / 1000) != "imok":
            problem = "does not answer ruok with imok"
        else:
            status = four_letter_word(host, port, "srvr", arguments.timeout / 1000)
            mode = next((line.split(":", 1)[1].strip() for line in status.splitlines() if line.startswith("Mode:")), "")
            if not mode:
                problem = "runs but does not serve requests yet"
    except (OSError, ValueError) as error:
        problem = f"cannot be reached ({error})"
    return _verdict("zookeeper", arguments.address, problem, f" ({mode})" if mode else "")


def bookie_health(arguments: argparse.Namespace) -> int:
    from coordination.cluster_layout import ClusterLayout
    from coordination.store import MetadataError
    from ledger_client.bookie_client import BookieClient, BookieConnectionError
    from quire.metadata_access import open_metadata

    _split(arguments.address, "bookie")

    from quire.security_options import client_credentials_from

    credentials = client_credentials_from(arguments)

    async def probe() -> str | None:
        try:
            async with BookieClient.connect(arguments.address, credentials=credentials) as client:
                info = (await client.get_info()).info
        except BookieConnectionError as error:
            return str(error)
        if info.get("read_only"):
            return f"read-only: {info.get('read_only_reason') or 'no reason given'}"
        path = ClusterLayout().bookie_registration(str(info["bookie_id"]), read_only=False)
        try:
            async with open_metadata(arguments.zk, arguments.root, connect_timeout_ms=arguments.timeout) as metadata:
                if not await metadata.exists(path):
                    return f"not registered as writable in ZooKeeper ({arguments.root}{path})"
        except (MetadataError, UsageError) as error:
            return f"cannot check its registration in ZooKeeper: {error}"
        return None

    return _verdict("bookie", arguments.address, _run(probe, arguments.timeout / 1000 * 3))


def broker_health(arguments: argparse.Namespace) -> int:
    from broker.client.connection import BrokerConnection
    from broker.errors import BrokerError
    from broker.protocol import Admin

    _split(arguments.address, "broker")
    answer: dict = {}

    from quire.security_options import client_credentials_from

    credentials = client_credentials_from(arguments)

    async def probe() -> str | None:
        try:
            connection = await BrokerConnection.connect(arguments.address, "quire-health", frame_bytes_max=1 << 20,
                                                        auth_token=credentials.current_token(),
                                                        tls_context=credentials.tls_context)
        except BrokerError as error:
            return str(error)
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(connection.run)
                try:
                    answer.update(await connection.request(lambda request_id: Admin(request_id, "health", {})))
                finally:
                    nursery.cancel_scope.cancel()
        except BrokerError as error:
            return str(error)
        finally:
            await connection.aclose()
        if answer.get("stopping"):
            return f"broker {answer.get('broker_id')} is stopping"
        if not answer.get("registered"):
            return f"broker {answer.get('broker_id')} is not registered in ZooKeeper"
        return None

    problem = _run(probe, arguments.timeout / 1000)
    return _verdict("broker", arguments.address, problem, f" ({answer.get('broker_id')})" if answer else "")


def _run(probe, timeout_s: float) -> str | None:
    async def bounded() -> str | None:
        with trio.move_on_after(timeout_s):
            return await probe()
        return f"no answer within {timeout_s:g}s"

    return trio.run(bounded)
