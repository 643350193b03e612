"""The broker's web service: its listeners (HTTP and HTTPS), served by
hypercorn on the broker's trio loop, and the HTTP client it calls other
brokers' web services with (a partitioned topic's partitions live on
several brokers).
"""

from __future__ import annotations

import functools
import logging
import socket
import ssl
from typing import Any

import httpx
import trio
from hypercorn.config import Config, Sockets
from hypercorn.trio.run import worker_serve
from hypercorn.utils import wrap_app

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from broker.web.admin_routes import admin_routes
from broker.web.schema_routes import schema_routes
from broker.web.topic_routes import topic_routes

log = logging.getLogger(__name__)

# hypercorn's bounds, with the broker's values: a request's head, a
# connection idle between requests, a request whose bytes stop coming.
REQUEST_HEAD_BYTES_MAX = 64 * 1024
KEEP_ALIVE_S = 30.0
READ_TIMEOUT_S = 60
# The broker's calls to other brokers' web services.
FORWARD_TIMEOUT_S = 30.0
FORWARD_CONNECTIONS_MAX = 32


async def _metrics(web: "WebFrontEnd", request: Request) -> Response:
    registry = web.server.metrics_registry
    if registry is None:
        return PlainTextResponse("metrics are off", status_code=404)
    # The collector reads the broker's state through the trio loop: not from it.
    body = await trio.to_thread.run_sync(generate_latest, registry)
    return Response(body, media_type=CONTENT_TYPE_LATEST)


def build_app(web: "WebFrontEnd") -> Starlette:
    routes = [Route("/metrics", functools.partial(_metrics, web), methods=["GET"])]
    routes += [Route(path, handler(web), methods=[method]) for method, path, handler in admin_routes() + topic_routes() + schema_routes()]
    return Starlette(routes=routes)


class _BrokerTLSConfig(Config):
    """hypercorn's settings, with the broker's own TLS context (the one
    its other TLS listeners use) in place of hypercorn's files."""

    def __init__(self, context: ssl.SSLContext | None) -> None:
        super().__init__()
        self._context = context

    def create_ssl_context(self) -> ssl.SSLContext | None:
        return self._context

    @property
    def ssl_enabled(self) -> bool:
        return self._context is not None


def _bind(host: str, port: int) -> socket.socket:
    """A listening socket, bound now: a busy port is reported at start-up."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


class WebFrontEnd:
    """`server` is the BrokerServer: the routes call its admin handler and lookups."""

    def __init__(self, server: Any) -> None:
        self.server = server
        self.config = server.config
        self._http: socket.socket | None = None
        self._https: socket.socket | None = None
        self.requests_refused = 0  # answered 401 or 403
        self.requests_in_flight = 0
        self.requests_refused_busy = 0  # answered 503: REQUESTS_IN_FLIGHT_MAX were being answered
        self.app = build_app(self)
        self._client: httpx.AsyncClient | None = None

    def listen(self, port: int | None, tls_port: int | None) -> tuple[int | None, int | None]:
        """Bind the listeners asked for (0 picks a port); returns their ports."""
        host = self.config.host
        try:
            if port is not None:
                self._http = _bind(host, port)
            if tls_port is not None:
                self._https = _bind(host, tls_port)
        except OSError:
            self.close()
            raise
        return tuple(None if sock is None else sock.getsockname()[1] for sock in (self._http, self._https))

    def close(self) -> None:
        for sock in (self._http, self._https):
            if sock is not None:
                sock.close()

    async def serve(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Serve until cancelled."""
        config = _BrokerTLSConfig(self.config.tls_context if self._https is not None else None)
        config.h11_max_incomplete_size = REQUEST_HEAD_BYTES_MAX
        config.keep_alive_timeout = KEEP_ALIVE_S
        config.read_timeout = READ_TIMEOUT_S
        config.ssl_handshake_timeout = self.config.tls_handshake_deadline_s
        config.accesslog = None
        # hypercorn's own lines ("Running on ...") repeat the broker's: its warnings and errors only.
        hypercorn_log = logging.getLogger("broker.web.hypercorn")
        hypercorn_log.setLevel(max(hypercorn_log.getEffectiveLevel(), logging.WARNING))
        config.errorlog = hypercorn_log
        config.include_server_header = False
        sockets = Sockets([self._https] if self._https is not None else [], [self._http] if self._http is not None else [], [])
        limits = httpx.Limits(max_connections=FORWARD_CONNECTIONS_MAX, max_keepalive_connections=FORWARD_CONNECTIONS_MAX)
        verify: Any = self.config.web_client_tls_context or True
        async with httpx.AsyncClient(timeout=FORWARD_TIMEOUT_S, limits=limits, verify=verify) as client:
            self._client = client
            try:
                await worker_serve(wrap_app(self.app, self.config.frame_bytes_max, "asgi"), config, sockets=sockets,
                                   task_status=task_status)
            finally:
                self._client = None
                self.close()

    @property
    def client(self) -> httpx.AsyncClient:
        assert self._client is not None, "the web service is not running"
        return self._client


__all__ = ["WebFrontEnd"]
