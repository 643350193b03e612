"""Pulsar's `/admin/v2` paths for the cluster, its brokers, tenants and
namespaces. Each calls the broker's admin handler (broker/admin.py), the
same actions `quire tenant ...` and `quire namespace ...` ask for over
quire's protocol.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from broker.errors import NotFoundError, ServiceUnavailableError
from broker.web.endpoints import endpoint, no_content, query_flag, read_json
from broker.web.pulsar_json import (
    backlog_quota_json,
    backlog_quota_policies,
    deduplication_json,
    deduplication_policies,
    message_ttl_json,
    message_ttl_policies,
    namespace_json,
    retention_json,
    retention_policies,
    tenant_arguments,
    tenant_json,
)

V2 = "/admin/v2"


async def _admin(web: Any, action: str, arguments: dict, role: str | None) -> dict:
    return await web.server.admin.handle(action, arguments, role)


def _check_cluster(web: Any, cluster: str) -> None:
    if cluster != web.config.cluster_name:
        raise NotFoundError(f"cluster {cluster[:100]!r} does not exist (this is cluster {web.config.cluster_name!r})")


# --- clusters and brokers --------------------------------------------------------------------


@endpoint
async def list_clusters(web: Any, request: Request, role: str | None) -> Response:
    return JSONResponse([web.config.cluster_name])


@endpoint
async def get_cluster(web: Any, request: Request, role: str | None) -> Response:
    _check_cluster(web, request.path_params["cluster"])
    info = web.server.info
    data = {}
    for field, url in (("serviceUrl", info.web_url_for(None)), ("serviceUrlTls", info.web_url_for(None, tls=True))):
        if url is not None:
            data[field] = url
    for field, scheme, tls in (("brokerServiceUrl", "pulsar", False), ("brokerServiceUrlTls", "pulsar+ssl", True)):
        address = info.pulsar_address_for(None, tls=tls)
        if address is not None:
            data[field] = f"{scheme}://{address}"
    return JSONResponse(data)


@endpoint
async def list_brokers(web: Any, request: Request, role: str | None) -> Response:
    """The live brokers' web service addresses (host:port), as Pulsar lists them."""
    _check_cluster(web, request.path_params["cluster"])
    web.server.access.check_superuser(role, "list the brokers")
    brokers = await web.server.ownership.live_brokers()
    addresses = []
    for info in brokers.values():
        address = info.web_listeners.get("internal") or info.web_tls_listeners.get("internal") or info.address
        addresses.append(address)
    return JSONResponse(sorted(addresses))


@endpoint
async def health(web: Any, request: Request, role: str | None) -> Response:
    """`ok` while this broker is registered and serving (Pulsar's healthcheck)."""
    web.server.access.check_superuser(role, "check the broker's health")
    state = await _admin(web, "health", {}, role)
    if not state["registered"] or state["stopping"]:
        raise ServiceUnavailableError(f"broker {state['broker_id']} is "
                                      + ("stopping" if state["stopping"] else "not registered in ZooKeeper"))
    return PlainTextResponse("ok")


@endpoint
async def ready(web: Any, request: Request, role: str | None) -> Response:
    if web.server.stopping:
        raise ServiceUnavailableError("the broker is stopping")
    return PlainTextResponse("ok")


# --- tenants ------------------------------------------------------------------------------------


@endpoint
async def list_tenants(web: Any, request: Request, role: str | None) -> Response:
    return JSONResponse((await _admin(web, "list_tenants", {}, role))["tenants"])


@endpoint
async def get_tenant(web: Any, request: Request, role: str | None) -> Response:
    return JSONResponse(tenant_json(await _admin(web, "tenant", {"tenant": request.path_params["tenant"]}, role)))


@endpoint
async def create_tenant(web: Any, request: Request, role: str | None) -> Response:
    arguments = tenant_arguments(await read_json(request, default={}))
    await _admin(web, "create_tenant", {"tenant": request.path_params["tenant"], **arguments}, role)
    return no_content()


@endpoint
async def update_tenant(web: Any, request: Request, role: str | None) -> Response:
    arguments = tenant_arguments(await read_json(request))
    await _admin(web, "update_tenant", {"tenant": request.path_params["tenant"], **arguments}, role)
    return no_content()


@endpoint
async def delete_tenant(web: Any, request: Request, role: str | None) -> Response:
    query_flag(request, "force")  # checked; a tenant with namespaces is refused either way
    await _admin(web, "delete_tenant", {"tenant": request.path_params["tenant"]}, role)
    return no_content()


# --- namespaces ---------------------------------------------------------------------------------


def _namespace(request: Request) -> str:
    return f"{request.path_params['tenant']}/{request.path_params['namespace']}"


@endpoint
async def list_namespaces(web: Any, request: Request, role: str | None) -> Response:
    answer = await _admin(web, "list_namespaces", {"tenant": request.path_params["tenant"]}, role)
    return JSONResponse(answer["namespaces"])


@endpoint
async def create_namespace(web: Any, request: Request, role: str | None) -> Response:
    await read_json(request, default={})  # Pulsar's optional Policies: checked to be JSON
    await _admin(web, "create_namespace", {"namespace": _namespace(request)}, role)
    return no_content()


@endpoint
async def delete_namespace(web: Any, request: Request, role: str | None) -> Response:
    query_flag(request, "force")
    await _admin(web, "delete_namespace", {"namespace": _namespace(request)}, role)
    return no_content()


@endpoint
async def get_namespace(web: Any, request: Request, role: str | None) -> Response:
    answer = await _admin(web, "namespace_policies", {"namespace": _namespace(request)}, role)
    return JSONResponse(namespace_json(answer, web.config.cluster_name))


# A namespace's policies for its topics: (path, how a body becomes quire's
# policies, how quire's policies become the answer, the policies the path sets).
NAMESPACE_POLICIES = {
    "retention": (retention_policies, retention_json, ("retention_time_ms", "retention_bytes")),
    "deduplication": (deduplication_policies, deduplication_json, ("deduplication",)),
    "messageTTL": (message_ttl_policies, message_ttl_json, ("message_ttl_s",)),
}


def _policy_kind(request: Request) -> tuple:
    return NAMESPACE_POLICIES[request.url.path.rsplit("/", 1)[1]]


@endpoint
async def get_namespace_policy(web: Any, request: Request, role: str | None) -> Response:
    _, to_json, names = _policy_kind(request)
    answer = await _admin(web, "namespace_policies", {"namespace": _namespace(request)}, role)
    if not any(name in answer["policies"] for name in names):
        return no_content()  # not set by the namespace (Pulsar answers null)
    return JSONResponse(to_json(answer["policies"]))


@endpoint
async def set_namespace_policy(web: Any, request: Request, role: str | None) -> Response:
    from_body, _, _ = _policy_kind(request)
    policies = from_body(await read_json(request))
    await _admin(web, "set_namespace_policies", {"namespace": _namespace(request), "policies": policies}, role)
    return no_content()


@endpoint
async def remove_namespace_policy(web: Any, request: Request, role: str | None) -> Response:
    _, _, names = _policy_kind(request)
    await _admin(web, "set_namespace_policies", {"namespace": _namespace(request), "remove": list(names)}, role)
    return no_content()


@endpoint
async def get_backlog_quotas(web: Any, request: Request, role: str | None) -> Response:
    answer = await _admin(web, "namespace_policies", {"namespace": _namespace(request)}, role)
    return JSONResponse(backlog_quota_json(answer["policies"]))


@endpoint
async def set_backlog_quota(web: Any, request: Request, role: str | None) -> Response:
    policies = backlog_quota_policies(await read_json(request), request.query_params.get("backlogQuotaType"))
    await _admin(web, "set_namespace_policies", {"namespace": _namespace(request), "policies": policies}, role)
    return no_content()


@endpoint
async def remove_backlog_quota(web: Any, request: Request, role: str | None) -> Response:
    backlog_quota_policies({"limitSize": -1}, request.query_params.get("backlogQuotaType"))  # checks the type
    await _admin(web, "set_namespace_policies", {"namespace": _namespace(request), "remove": ["backlog_quota_bytes"]}, role)
    return no_content()


@endpoint
async def get_permissions(web: Any, request: Request, role: str | None) -> Response:
    answer = await _admin(web, "permissions", {"namespace": _namespace(request)}, role)
    return JSONResponse(answer["permissions"])


@endpoint
async def grant_permission(web: Any, request: Request, role: str | None) -> Response:
    actions = await read_json(request)
    await _admin(web, "grant_permission", {"namespace": _namespace(request), "role": request.path_params["role"],
                                           "actions": actions}, role)
    return no_content()


@endpoint
async def revoke_permission(web: Any, request: Request, role: str | None) -> Response:
    await _admin(web, "revoke_permission", {"namespace": _namespace(request), "role": request.path_params["role"]}, role)
    return no_content()


@endpoint
async def namespace_topics(web: Any, request: Request, role: str | None) -> Response:
    from broker.topic_lookup import topics_of_namespace

    mode = request.query_params.get("mode", "PERSISTENT").upper()
    names = await topics_of_namespace(web.server, _namespace(request), role)
    return JSONResponse([] if mode == "NON_PERSISTENT" else names)


NAMESPACE = V2 + "/namespaces/{tenant}/{namespace}"


def admin_routes() -> list[tuple[str, str, Any]]:
    return [
        ("GET", V2 + "/clusters", list_clusters),
        ("GET", V2 + "/clusters/{cluster}", get_cluster),
        ("GET", V2 + "/brokers/health", health),
        ("GET", V2 + "/brokers/ready", ready),
        ("GET", V2 + "/brokers/{cluster}", list_brokers),
        ("GET", V2 + "/tenants", list_tenants),
        ("GET", V2 + "/tenants/{tenant}", get_tenant),
        ("PUT", V2 + "/tenants/{tenant}", create_tenant),
        ("POST", V2 + "/tenants/{tenant}", update_tenant),
        ("DELETE", V2 + "/tenants/{tenant}", delete_tenant),
        ("GET", V2 + "/namespaces/{tenant}", list_namespaces),
        ("GET", NAMESPACE, get_namespace),
        ("PUT", NAMESPACE, create_namespace),
        ("DELETE", NAMESPACE, delete_namespace),
        ("GET", NAMESPACE + "/permissions", get_permissions),
        ("POST", NAMESPACE + "/permissions/{role}", grant_permission),
        ("DELETE", NAMESPACE + "/permissions/{role}", revoke_permission),
        ("GET", NAMESPACE + "/topics", namespace_topics),
        *[(method, f"{NAMESPACE}/{name}", handler) for name in NAMESPACE_POLICIES
          for method, handler in (("GET", get_namespace_policy), ("POST", set_namespace_policy),
                                  ("DELETE", remove_namespace_policy))],
        ("GET", NAMESPACE + "/backlogQuotaMap", get_backlog_quotas),
        ("POST", NAMESPACE + "/backlogQuota", set_backlog_quota),
        ("DELETE", NAMESPACE + "/backlogQuota", remove_backlog_quota),
    ]


__all__ = ["admin_routes"]
