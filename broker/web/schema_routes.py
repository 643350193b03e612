"""Pulsar's `/admin/v2/schemas` paths (a topic's schema versions) and a
namespace's `schemaCompatibilityStrategy`, over the admin handler's schema
and namespace-policy actions."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from broker.errors import BadRequestError
from broker.schema_compatibility import Strategy
from broker.topic_names import quire_name
from broker.web.endpoints import endpoint, int_parameter, no_content, read_json

V2 = "/admin/v2"
TOPIC = V2 + "/schemas/{tenant}/{namespace}/{topic}"
NAMESPACE = V2 + "/namespaces/{tenant}/{namespace}"
UNDEFINED = "UNDEFINED"  # Pulsar's "not set by the namespace"


def _topic(request: Request) -> str:
    params = request.path_params
    return quire_name(f"persistent://{params['tenant']}/{params['namespace']}/{params['topic']}")


async def _admin(web: Any, action: str, arguments: dict, role: str | None) -> dict:
    return await web.server.admin.handle(action, arguments, role)


def _schema_json(answer: dict) -> dict:
    """GetSchemaResponse."""
    return {"version": answer["version"], "type": answer["type"], "timestamp": 0, "data": answer["definition"],
            "properties": answer["properties"]}


async def _payload(request: Request) -> dict:
    """PostSchemaPayload ({"type", "schema", "properties"}) as the admin handler's arguments."""
    body = await read_json(request)
    if not isinstance(body, dict) or not isinstance(body.get("type"), str) or not isinstance(body.get("schema", ""), str):
        raise BadRequestError('a schema is {"type": "AVRO", "schema": "<definition>", "properties": {}}')
    properties = body.get("properties") or {}
    if not isinstance(properties, dict):
        raise BadRequestError("a schema's properties are an object")
    return {"type": body["type"], "definition": body.get("schema", ""), "properties": properties}


@endpoint
async def get_schema(web: Any, request: Request, role: str | None) -> Response:
    arguments = {"topic": _topic(request)}
    if "version" in request.path_params:
        arguments["version"] = int_parameter(request.path_params["version"], "the version", minimum=0)
    return JSONResponse(_schema_json(await _admin(web, "schema", arguments, role)))


@endpoint
async def get_schemas(web: Any, request: Request, role: str | None) -> Response:
    answer = await _admin(web, "schemas", {"topic": _topic(request)}, role)
    return JSONResponse({"getSchemaResponses": [_schema_json(schema) for schema in answer["schemas"]]})


@endpoint
async def post_schema(web: Any, request: Request, role: str | None) -> Response:
    answer = await _admin(web, "add_schema", {"topic": _topic(request), **await _payload(request)}, role)
    return JSONResponse({"version": {"version": answer["version"]}})


@endpoint
async def delete_schema(web: Any, request: Request, role: str | None) -> Response:
    answer = await _admin(web, "delete_schema", {"topic": _topic(request)}, role)
    return JSONResponse({"version": answer["version"]})


@endpoint
async def compatibility(web: Any, request: Request, role: str | None) -> Response:
    answer = await _admin(web, "schema_compatibility", {"topic": _topic(request), **await _payload(request)}, role)
    return JSONResponse({"isCompatibility": answer["compatible"], "schemaCompatibilityStrategy": answer["strategy"],
                         **({"reason": answer["reason"]} if answer["reason"] else {})})


def _namespace(request: Request) -> str:
    return f"{request.path_params['tenant']}/{request.path_params['namespace']}"


@endpoint
async def get_strategy(web: Any, request: Request, role: str | None) -> Response:
    answer = await _admin(web, "namespace_policies", {"namespace": _namespace(request)}, role)
    return JSONResponse(answer["policies"].get("schema_compatibility_strategy", UNDEFINED))


@endpoint
async def set_strategy(web: Any, request: Request, role: str | None) -> Response:
    body = await read_json(request)
    if not isinstance(body, str):
        raise BadRequestError(f"the body is a strategy's name in quotes: one of {', '.join(Strategy)}, or {UNDEFINED}")
    namespace = _namespace(request)
    if body.upper() == UNDEFINED:
        arguments = {"namespace": namespace, "remove": ["schema_compatibility_strategy"]}
    else:
        try:
            strategy = Strategy.parse(body)
        except ValueError as error:
            raise BadRequestError(str(error)) from None
        arguments = {"namespace": namespace, "policies": {"schema_compatibility_strategy": strategy.value}}
    await _admin(web, "set_namespace_policies", arguments, role)
    return no_content()


def schema_routes() -> list[tuple[str, str, Any]]:
    return [
        ("GET", TOPIC + "/schema", get_schema),
        ("GET", TOPIC + "/schema/{version}", get_schema),
        ("GET", TOPIC + "/schemas", get_schemas),
        ("POST", TOPIC + "/schema", post_schema),
        ("DELETE", TOPIC + "/schema", delete_schema),
        ("POST", TOPIC + "/compatibility", compatibility),
        ("GET", NAMESPACE + "/schemaCompatibilityStrategy", get_strategy),
        ("PUT", NAMESPACE + "/schemaCompatibilityStrategy", set_strategy),
        ("POST", NAMESPACE + "/schemaCompatibilityStrategy", set_strategy),
    ]


__all__ = ["schema_routes"]
