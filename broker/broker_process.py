"""One broker process from start to stop: connect to ZooKeeper, open the
ledger client, listen, register, serve; on SIGTERM/SIGINT unload every
partition gracefully (another broker takes each on its next lookup),
unregister and exit."""

from __future__ import annotations

import logging
import signal

import trio

from broker.metrics import MetricsEndpoint, broker_registry, register_collector
from broker.server import BrokerConfig, BrokerServer
from coordination.store import MetadataError
from coordination.async_store import connect_zookeeper
from ledger_client import BookKeeper

log = logging.getLogger(__name__)


class BrokerStartupError(Exception):
    """The broker cannot start; the message is one clear line for the operator."""


async def run_broker(
    config: BrokerConfig,
    zk_hosts: str,
    root: str,
    *,
    session_timeout_ms: int = 10_000,
    handle_signals: bool = True,
    task_status=trio.TASK_STATUS_IGNORED,
) -> None:
    """Run one broker until SIGTERM/SIGINT (or cancellation). Its ports are
    bound first, so that a busy one is reported at once, not after waiting
    for ZooKeeper and bookies."""
    try:
        listeners = await trio.open_tcp_listeners(config.port, host=config.host)
    except OSError as error:
        raise BrokerStartupError(f"cannot listen on {config.host}:{config.port}: {error.strerror or error}") from None
    registry, metrics, endpoint = None, None, None
    try:
        if config.metrics_port:
            registry, metrics = broker_registry()
            try:
                endpoint = MetricsEndpoint(registry, config.host, config.metrics_port)
            except OSError as error:
                raise BrokerStartupError(
                    f"cannot serve metrics on {config.host}:{config.metrics_port}: {error.strerror or error}"
                ) from None
        try:
            sync_store = await connect_zookeeper(zk_hosts, root, session_timeout_ms=session_timeout_ms)
        except MetadataError as error:
            raise BrokerStartupError(str(error)) from None
        except ValueError as error:
            raise BrokerStartupError(f"bad ZooKeeper address {zk_hosts!r}: {error}") from None
        config.session_timeout_ms = session_timeout_ms
        async with BookKeeper.open(sync_store) as bk:
            server = BrokerServer(config, bk, bk.store, metrics)
            await server.listen(listeners)
            if registry is not None:
                register_collector(registry, server)
            await _serve(server, handle_signals, task_status)
    finally:
        with trio.CancelScope(shield=True):
            for listener in listeners:
                await listener.aclose()
            if endpoint is not None:
                await trio.to_thread.run_sync(endpoint.close)


async def _serve(server: BrokerServer, handle_signals: bool, task_status) -> None:
    config = server.config
    async with trio.open_nursery() as nursery:
        await nursery.start(server.run)
        message = f"broker {server.info.broker_id} serving on {server.info.address}"
        if config.metrics_port:
            message += f"; metrics on http://{config.host}:{config.metrics_port}/metrics"
        else:
            message += "; metrics off (use --metrics-port P)"
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
