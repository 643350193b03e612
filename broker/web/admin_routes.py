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
from broker.web.endpoints import endpoint, int_parameter, no_content, query_flag, read_json
from broker.web.pulsar_json import (
    backlog_quota_json,
    backlog_quota_policies,
    compaction_threshold_json,
    compaction_threshold_policies,
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


# The policies a namespace sets for its topics, or a topic for itself:
# (path, how a body becomes quire's policies, how quire's policies become
# the answer, the policies the path sets).
POLICY_PATHS = {
    "retention": (retention_policies, retention_json, ("retention_time_ms", "retention_bytes")),
    "deduplication": (deduplication_policies, deduplication_json, ("deduplication",)),
    "deduplicationEnabled": (deduplication_policies, deduplication_json, ("deduplication",)),
    "messageTTL": (message_ttl_policies, message_ttl_json, ("message_ttl_s",)),
    "compactionThreshold": (compaction_threshold_policies, compaction_threshold_json, ("compaction_threshold_bytes",)),
}


class _Scope:
    """Where a policy path sets policies: a namespace (for its topics) or a
    topic (its own, which win over its namespace's)."""

    def __init__(self, topic: bool) -> None:
        self.topic = topic

    def target(self, request: Request) -> dict:
        if self.topic:
            from broker.web.topic_routes import topic_of_request

            return {"topic": topic_of_request(request)}
        return {"namespace": _namespace(request)}

    async def read(self, web: Any, request: Request, role: str | None) -> dict:
        """The policies set here (a topic's applied ones with ?applied=true)."""
        if not self.topic:
            return (await _admin(web, "namespace_policies", self.target(request), role))["policies"]
        answer = await _admin(web, "topic_policies", self.target(request), role)
        return answer["applied"] if query_flag(request, "applied") else answer["own"]

    async def set(self, web: Any, request: Request, role: str | None, policies: dict) -> None:
        action = "set_policies" if self.topic else "set_namespace_policies"
        await _admin(web, action, {**self.target(request), "policies": policies}, role)

    async def remove(self, web: Any, request: Request, role: str | None, names: list[str]) -> None:
        if self.topic:
            await _admin(web, "remove_policies", {**self.target(request), "names": names}, role)
        else:
            await _admin(web, "set_namespace_policies", {**self.target(request), "remove": names}, role)


def _policy_path(request: Request) -> tuple:
    return POLICY_PATHS[request.url.path.rsplit("/", 1)[1]]


def policy_endpoints(scope: _Scope) -> dict[str, Any]:
    """The handlers of the policy paths, for a namespace's or a topic's."""

    @endpoint
    async def get_policy(web: Any, request: Request, role: str | None) -> Response:
        _, to_json, names = _policy_path(request)
        policies = await scope.read(web, request, role)
        if not any(name in policies for name in names):
            return no_content()  # not set here (Pulsar answers null)
        return JSONResponse(to_json(policies))

    @endpoint
    async def set_policy(web: Any, request: Request, role: str | None) -> Response:
        from_body, _, _ = _policy_path(request)
        if "messageTTL" in request.query_params:  # a topic's TTL: Pulsar's clients send it in the query
            body = int_parameter(request.query_params["messageTTL"], "messageTTL", minimum=0)
        else:
            body = await read_json(request)
        await scope.set(web, request, role, from_body(body))
        return no_content()

    @endpoint
    async def remove_policy(web: Any, request: Request, role: str | None) -> Response:
        _, _, names = _policy_path(request)
        await scope.remove(web, request, role, list(names))
        return no_content()

    @endpoint
    async def get_backlog_quotas(web: Any, request: Request, role: str | None) -> Response:
        return JSONResponse(backlog_quota_json(await scope.read(web, request, role)))

    @endpoint
    async def set_backlog_quota(web: Any, request: Request, role: str | None) -> Response:
        policies = backlog_quota_policies(await read_json(request), request.query_params.get("backlogQuotaType"))
        await scope.set(web, request, role, policies)
        return no_content()

    @endpoint
    async def remove_backlog_quota(web: Any, request: Request, role: str | None) -> Response:
        backlog_quota_policies({"limitSize": -1}, request.query_params.get("backlogQuotaType"))  # checks the type
        await scope.remove(web, request, role, ["backlog_quota_bytes"])
        return no_content()

    return {"get": get_policy, "set": set_policy, "remove": remove_policy, "get_quotas": get_backlog_quotas,
            "set_quota": set_backlog_quota, "remove_quota": remove_backlog_quota}


def policy_routes(prefix: str, scope: _Scope) -> list[tuple[str, str, Any]]:
    handlers = policy_endpoints(scope)
    return [
        *[(method, f"{prefix}/{name}", handlers[kind]) for name in POLICY_PATHS
          for method, kind in (("GET", "get"), ("POST", "set"), ("DELETE", "remove"))],
        # Pulsar sets a namespace's compaction threshold with PUT (a topic's with POST): both take either.
        ("PUT", prefix + "/compactionThreshold", handlers["set"]),
        ("GET", prefix + "/backlogQuotaMap", handlers["get_quotas"]),
        ("POST", prefix + "/backlogQuota", handlers["set_quota"]),
        ("DELETE", prefix + "/backlogQuota", handlers["remove_quota"]),
    ]


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
        *policy_routes(NAMESPACE, _Scope(topic=False)),
        *policy_routes(V2 + "/persistent/{tenant}/{namespace}/{topic}", _Scope(topic=True)),
    ]


__all__ = ["admin_routes"]
