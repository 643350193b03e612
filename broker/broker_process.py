"""One broker process from start to stop: connect to ZooKeeper, open the
ledger client, listen, register, serve; on SIGTERM/SIGINT unload every
partition gracefully (another broker takes each on its next lookup),
unregister and exit."""

from __future__ import annotations

import functools
import logging
import signal

import trio

from broker.metrics import MetricsEndpoint, broker_registry, register_collector
from broker.config import BrokerConfig
from broker.server import BrokerServer
from coordination.startup import STARTUP_TIMEOUT_MS_DEFAULT, Startup, StartupFailedError
from coordination.store import MetadataError
from ledger_client import BookKeeper
from security.credentials import NO_CREDENTIALS, ClientCredentials
from ledger_client.exception_groups import unwrap_single_exception

log = logging.getLogger(__name__)


class BrokerStartupError(Exception):
    """The broker cannot start; the message is one clear line for the operator."""


async def run_broker(
    config: BrokerConfig,
    zk_hosts: str,
    root: str,
    *,
    session_timeout_ms: int = 10_000,
    startup_timeout_ms: int = STARTUP_TIMEOUT_MS_DEFAULT,
    handle_signals: bool = True,
    bookie_credentials: ClientCredentials = NO_CREDENTIALS,
    task_status=trio.TASK_STATUS_IGNORED,
) -> None:
    """Run one broker until SIGTERM/SIGINT (or cancellation). Its ports are
    bound first, so that a busy one is reported at once, not after waiting
    for ZooKeeper and bookies. Every start-up step that talks to ZooKeeper
    is tried again after a lost connection or session, with a fresh session,
    until `startup_timeout_ms`; then BrokerStartupError names the step."""
    startup = Startup("broker", startup_timeout_ms)
    try:
        listeners = await trio.open_tcp_listeners(config.port, host=config.host)
    except OSError as error:
        raise BrokerStartupError(f"cannot listen on {config.host}:{config.port}: {error.strerror or error}") from None
    registry, metrics, endpoint = None, None, None
    try:
        if config.metrics_port or config.web_port is not None or config.web_tls_port is not None:
            registry, metrics = broker_registry()
        if config.metrics_port:
            try:
                endpoint = MetricsEndpoint(registry, config.host, config.metrics_port)
            except OSError as error:
                raise BrokerStartupError(
                    f"cannot serve metrics on {config.host}:{config.metrics_port}: {error.strerror or error}"
                ) from None
        with startup.deadline():
            try:
                sync_store = await startup.connect(zk_hosts, root, session_timeout_ms=session_timeout_ms)
            except MetadataError as error:
                raise BrokerStartupError(str(error)) from None
            except ValueError as error:
                raise BrokerStartupError(f"bad ZooKeeper address {zk_hosts!r}: {error}") from None
            config.session_timeout_ms = session_timeout_ms
            # The ledger client's registry retries by itself until it has
            # read the bookie lists once; the deadline bounds that too.
            startup.begin("read the bookie registry (/bookies)")
            async with BookKeeper.open(sync_store, credentials=bookie_credentials) as bk:
                server = BrokerServer(config, bk, bk.store, metrics)
                try:
                    await server.listen(listeners)
                except OSError as error:
                    raise BrokerStartupError(f"cannot listen on one of the broker's ports ({describe_ports(config)}): "
                                             f"{error.strerror or error}") from None
                if registry is not None:
                    register_collector(registry, server)
                    server.metrics_registry = registry
                # A step's error would come out of _serve's nursery wrapped in a group.
                with unwrap_single_exception():
                    await _serve(server, startup, handle_signals, task_status)
    except StartupFailedError as error:  # a step refused, or the deadline passed
        raise BrokerStartupError(str(error)) from None
    except MetadataError as error:
        if startup.finished:
            raise
        # A ZooKeeper call of start-up outside its steps: still one line.
        raise BrokerStartupError(startup.refused_message(error)) from None
    finally:
        with trio.CancelScope(shield=True):
            for listener in listeners:
                await listener.aclose()
            if endpoint is not None:
                await trio.to_thread.run_sync(endpoint.close)


def describe_ports(config: BrokerConfig) -> str:
    ports = (("--tls-port", config.tls_port), ("--pulsar-port", config.pulsar_port), ("--pulsar-tls-port", config.pulsar_tls_port),
             ("--web-port", config.web_port), ("--web-tls-port", config.web_tls_port))
    return ", ".join(f"{flag} {port}" for flag, port in ports if port is not None)


async def _serve(server: BrokerServer, startup: Startup, handle_signals: bool, task_status) -> None:
    config = server.config
    async with trio.open_nursery() as nursery:
        await nursery.start(functools.partial(server.run, startup=startup))
        startup.finish()
        message = f"broker {server.info.broker_id} serving on {server.info.address}"
        if server.pulsar_port is not None:
            message += f"; Pulsar on pulsar://{server.info.pulsar_address_for(None)}"
        if server.pulsar_tls_port is not None:
            message += f"; Pulsar on pulsar+ssl://{server.info.pulsar_address_for(None, tls=True)}"
        if server.tls_port is not None:
            message += f"; TLS on {server.info.address_for(None, tls=True)}"
        for tls, port in ((False, server.web_port), (True, server.web_tls_port)):
            if port is not None:
                message += f"; web service on {server.info.web_url_for(None, tls=tls)}"
        if config.metrics_port:
            message += f"; metrics on http://{config.host}:{config.metrics_port}/metrics"
        elif server.web is not None:
            message += "; metrics at the web service's /metrics"
        else:
            message += "; metrics off (use --metrics-port P or --web-port P)"
        log.info(message)
        print(message, flush=True)
        task_status.started(server)
        if handle_signals:
            with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for signal_number in signals:
                    log.info("received %s: unloading partitions", signal.Signals(signal_number).name)
                    break
        else:
            await trio.sleep_forever()
        await server.shutdown()


__all__ = ["BrokerStartupError", "run_broker"]
