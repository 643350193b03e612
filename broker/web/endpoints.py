"""What every endpoint of the web service shares: who a request comes
from (`Authorization: Bearer TOKEN`), its bounded JSON body and query
parameters, and the broker's errors as Pulsar's status codes and
`{"reason": ...}` bodies. The routes (admin_routes, topic_routes) call the
broker's admin handler, the same functions quire's own admin commands reach.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from typing import Any, Awaitable, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from broker.errors import (
    AuthenticationError,
    AuthorizationError,
    BadRequestError,
    BrokerError,
    ConflictError,
    ConsumerBusyError,
    NotAllowedError,
    NotFoundError,
    NotOwnerError,
    PreconditionFailedError,
    ProducerBusyError,
    RetryLaterError,
    ServiceUnavailableError,
    SubscriptionNotFoundError,
    TopicExistsError,
    TopicFencedError,
    TopicNotFoundError,
)
from broker.topic_names import TopicNameError
from coordination.store import MetadataError
from ledger_client import BKError
from security.authentication import TOKEN_METHOD

log = logging.getLogger(__name__)

BODY_BYTES_MAX = 1024 * 1024  # an admin request's JSON body
# Requests being answered at once; past it a request gets 503 at once (each
# may hold a body of BODY_BYTES_MAX and a partitioned topic's fan-out).
REQUESTS_IN_FLIGHT_MAX = 256
BEARER = "bearer "

# The broker's errors as Pulsar's REST API answers them.
STATUS_BY_ERROR: tuple[tuple[type[BrokerError], int], ...] = (
    (AuthenticationError, 401),
    (AuthorizationError, 403),
    (NotFoundError, 404),
    (TopicNotFoundError, 404),
    (SubscriptionNotFoundError, 404),
    (ConflictError, 409),
    (TopicExistsError, 409),
    (ConsumerBusyError, 412),  # as Pulsar: the topic or subscription has clients connected
    (ProducerBusyError, 412),
    (PreconditionFailedError, 412),
    (BadRequestError, 400),
    (NotAllowedError, 501),  # something quire does not do
    (ServiceUnavailableError, 503),
    (RetryLaterError, 503),
    (TopicFencedError, 503),
    (NotOwnerError, 503),
)


def status_of(error: BrokerError) -> int:
    for kind, status in STATUS_BY_ERROR:
        if isinstance(error, kind):
            return status
    return 500


def error_response(status: int, reason: str) -> JSONResponse:
    return JSONResponse({"reason": reason[:2000]}, status_code=status)


def no_content() -> Response:
    return Response(status_code=204)


async def read_body(request: Request) -> bytes:
    """The request's body, at most BODY_BYTES_MAX bytes (read once: a relay
    to another broker sends it on)."""
    cached = getattr(request.state, "body", None)
    if cached is not None:
        return cached
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > BODY_BYTES_MAX:
            raise BadRequestError(f"a request body holds at most {BODY_BYTES_MAX} bytes")
    request.state.body = bytes(body)
    return request.state.body


async def read_json(request: Request, *, default: Any = ...) -> Any:
    """The request's JSON body; `default` when it is empty (none given: a
    body is required)."""
    body = await read_body(request)
    if not body.strip():
        if default is ...:
            raise BadRequestError("this request needs a JSON body")
        return default
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError) as error:
        raise BadRequestError(f"the body is not JSON: {str(error)[:200]}") from None


def query_flag(request: Request, name: str, default: bool = False) -> bool:
    value = request.query_params.get(name)
    if value is None:
        return default
    if value.lower() in ("true", "1", ""):
        return True
    if value.lower() in ("false", "0"):
        return False
    raise BadRequestError(f"query parameter {name} must be true or false, got {value[:50]!r}")


def int_parameter(value: str | None, name: str, *, default: int | None = None, minimum: int | None = None) -> int:
    if value is None:
        if default is None:
            raise BadRequestError(f"missing {name}")
        return default
    try:
        number = int(value)
    except ValueError:
        raise BadRequestError(f"{name} must be an integer, got {value[:50]!r}") from None
    if minimum is not None and number < minimum:
        raise BadRequestError(f"{name} must be at least {minimum}, got {number}")
    return number


Handler = Callable[[Any, Request, str | None], Awaitable[Response]]


def endpoint(handler: Handler) -> Callable[[Any], Callable[[Request], Awaitable[Response]]]:
    """Bind a route's handler to the web front-end: the request is
    authenticated, and what it raises becomes Pulsar's answer."""

    def bound(web: Any) -> Callable[[Request], Awaitable[Response]]:
        @functools.wraps(handler)
        async def respond(request: Request) -> Response:
            if web.requests_in_flight >= REQUESTS_IN_FLIGHT_MAX:
                web.requests_refused_busy += 1
                return error_response(503, f"the broker is answering {REQUESTS_IN_FLIGHT_MAX} requests: try again")
            web.requests_in_flight += 1
            try:
                role = authenticate(web, request)
                return await handler(web, request, role)
            except BrokerError as error:
                status = status_of(error)
                if status in (401, 403):
                    web.requests_refused += 1
                return error_response(status, str(error))
            except TopicNameError as error:
                return error_response(412 if "non-persistent" in str(error) else 400, str(error))
            except MetadataError as error:
                log.warning("%s %s: ZooKeeper: %s", request.method, request.url.path[:200], error)
                return error_response(503, f"the metadata store is unavailable: {error}")
            except BKError as error:
                log.warning("%s %s: bookies: %s", request.method, request.url.path[:200], error)
                return error_response(503, f"the bookies could not serve the request: {error}")
            finally:
                web.requests_in_flight -= 1

        return respond

    return bound


def authenticate(web: Any, request: Request) -> str | None:
    """The request's role: its bearer token's subject, or the anonymous
    role for a request without one (refused when the broker has none).
    None while authentication is off."""
    access = web.server.access
    if not access.enabled:
        return None
    header = request.headers.get("authorization")
    token = None
    if header is not None:
        if not header[:len(BEARER)].lower() == BEARER:
            raise AuthenticationError("the Authorization header must be 'Bearer TOKEN'")
        token = header[len(BEARER):].strip()
    peer = f"{request.client.host}:{request.client.port}" if request.client else "?"
    principal = access.authenticate(TOKEN_METHOD if token else None, token, peer=peer, peer_common_name=None,
                                    now=time.time(), protocol="HTTP")
    return principal.role


__all__ = ["BODY_BYTES_MAX", "endpoint", "error_response", "int_parameter", "no_content",
           "query_flag", "read_body", "read_json", "status_of"]
