"""Who may do what, as Pulsar's authorization provider decides it: tenants
with admin roles, namespaces with grants of actions to roles, superusers.
Pure: the records come in, a decision or an AuthorizationError goes out.

A superuser may do anything. A tenant's admin roles administer the tenant
and its namespaces and topics (create, delete, policies, grants). Producing
needs the namespace's `produce` grant and consuming its `consume` grant;
looking a topic up, reading its schema or stats needs either. A topic made
by a first produce or subscribe needs only that grant, as in Pulsar.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field, replace
from typing import Any, Iterable

from broker.errors import AuthorizationError
from broker.topic_records import NAMESPACE_POLICY_NAMES, check_name, check_namespace_policies

ROLE_CHARS_MAX = 256
ROLES_MAX = 1_000  # admin roles of a tenant, granted roles of a namespace
CLUSTERS_MAX = 100


class Action(enum.StrEnum):
    """What a namespace grant gives a role (Pulsar's AuthAction, those quire has)."""

    PRODUCE = "produce"
    CONSUME = "consume"


def parse_actions(text: str | Iterable[str]) -> frozenset[Action]:
    """`produce,consume` (or a list of names) as actions; ValueError names the bad one."""
    names = [name.strip() for name in text.split(",")] if isinstance(text, str) else list(text)
    if not names or not all(isinstance(name, str) and name for name in names):
        raise ValueError("actions are a comma-separated list of: produce, consume")
    actions = set()
    for name in names:
        try:
            actions.add(Action(name))
        except ValueError:
            raise ValueError(f"unknown action {name[:50]!r}: the actions are produce and consume") from None
    return frozenset(actions)


def check_role(role: Any) -> str:
    if not isinstance(role, str) or not role or len(role) > ROLE_CHARS_MAX or not role.isprintable():
        raise ValueError(f"a role is 1-{ROLE_CHARS_MAX} printable characters")
    return role


def _roles(values: Any, what: str) -> tuple[str, ...]:
    if not isinstance(values, (list, tuple)) or len(values) > ROLES_MAX:
        raise ValueError(f"{what} is a list of at most {ROLES_MAX} roles")
    return tuple(sorted({check_role(value) for value in values}))


@dataclass(frozen=True)
class TenantInfo:
    """A tenant (`/tenants/<tenant>`): who administers it, where it may live."""

    admin_roles: tuple[str, ...] = ()
    allowed_clusters: tuple[str, ...] = ()

    @classmethod
    def from_dict(cls, data: Any) -> TenantInfo:
        if not isinstance(data, dict):
            raise ValueError("a tenant's record is an object")
        clusters = data.get("allowed_clusters", [])
        if not isinstance(clusters, list) or len(clusters) > CLUSTERS_MAX:
            raise ValueError(f"allowed_clusters is a list of at most {CLUSTERS_MAX} names")
        return cls(_roles(data.get("admin_roles", []), "admin_roles"),
                   tuple(sorted({check_name(name, "cluster") for name in clusters})))

    def to_dict(self) -> dict:
        return {"admin_roles": list(self.admin_roles), "allowed_clusters": list(self.allowed_clusters)}

    def to_bytes(self) -> bytes:
        return json.dumps(self.to_dict(), sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> TenantInfo:
        return cls.from_dict(json.loads(data) if data else {})


@dataclass(frozen=True)
class NamespacePolicies:
    """A namespace (`/tenants/<tenant>/<namespace>`): the roles granted
    actions on it, and the policies its topics take unless they set their
    own (retention, backlog quota, deduplication: NAMESPACE_POLICY_NAMES)."""

    permissions: dict[str, frozenset[Action]] = field(default_factory=dict)
    policies: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: Any) -> NamespacePolicies:
        if not isinstance(data, dict):
            raise ValueError("a namespace's record is an object")
        permissions = data.get("permissions", {})
        if not isinstance(permissions, dict) or len(permissions) > ROLES_MAX:
            raise ValueError(f"permissions map at most {ROLES_MAX} roles to actions")
        policies = data.get("policies", {})
        if not isinstance(policies, dict):
            raise ValueError("a namespace's policies are an object")
        return cls({check_role(role): parse_actions(actions) for role, actions in permissions.items()},
                   check_namespace_policies(policies))

    def to_dict(self) -> dict:
        return {"permissions": {role: sorted(actions) for role, actions in sorted(self.permissions.items())},
                "policies": dict(sorted(self.policies.items()))}

    def with_policies(self, changes: dict[str, Any], removed: Iterable[str] = ()) -> NamespacePolicies:
        """These policies with `changes` set and the `removed` ones no longer
        set by the namespace (its topics go back to the broker's defaults);
        ValueError for a policy a namespace cannot set."""
        removed = set(removed)
        policies = {name: value for name, value in self.policies.items() if name not in removed}
        policies.update(check_namespace_policies(changes))
        check_namespace_policies({name: None for name in removed if name not in NAMESPACE_POLICY_NAMES})
        return replace(self, policies=policies)

    def to_bytes(self) -> bytes:
        return json.dumps(self.to_dict(), sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> NamespacePolicies:
        return cls.from_dict(json.loads(data) if data else {})

    def granted(self, role: str, actions: frozenset[Action]) -> NamespacePolicies:
        """These policies with `actions` granted to `role` (replacing what it had, as Pulsar's grant does)."""
        if role not in self.permissions and len(self.permissions) >= ROLES_MAX:
            raise ValueError(f"a namespace grants at most {ROLES_MAX} roles")
        return replace(self, permissions={**self.permissions, role: frozenset(actions)})

    def revoked(self, role: str) -> NamespacePolicies:
        return replace(self, permissions={name: actions for name, actions in self.permissions.items() if name != role})


@dataclass(frozen=True)
class Authorizer:
    """The decisions. `enabled` is False when the broker authenticates
    nobody: then every request is allowed, as before security was set up."""

    enabled: bool = False
    superuser_roles: frozenset[str] = frozenset()

    def is_superuser(self, role: str | None) -> bool:
        return not self.enabled or (role is not None and role in self.superuser_roles)

    def is_tenant_admin(self, role: str | None, tenant: TenantInfo | None) -> bool:
        return self.is_superuser(role) or (role is not None and tenant is not None and role in tenant.admin_roles)

    def may(self, role: str | None, action: Action, tenant: TenantInfo | None, namespace: NamespacePolicies | None) -> bool:
        if self.is_tenant_admin(role, tenant):
            return True
        return role is not None and namespace is not None and action in namespace.permissions.get(role, frozenset())

    def may_look_up(self, role: str | None, tenant: TenantInfo | None, namespace: NamespacePolicies | None) -> bool:
        return any(self.may(role, action, tenant, namespace) for action in Action)

    # The same decisions, raising what a client is told.

    def check_superuser(self, role: str | None, what: str) -> None:
        if not self.is_superuser(role):
            raise AuthorizationError(f"{_who(role)} may not {what}: it needs a superuser role")

    def check_tenant_admin(self, role: str | None, tenant_name: str, tenant: TenantInfo | None, what: str) -> None:
        if not self.is_tenant_admin(role, tenant):
            raise AuthorizationError(f"{_who(role)} may not {what}: it needs to be an admin of tenant {tenant_name}")

    def check(self, role: str | None, action: Action | None, namespace_name: str, tenant: TenantInfo | None,
              namespace: NamespacePolicies | None, what: str) -> None:
        """`action` None: looking up (either grant does)."""
        allowed = (self.may_look_up(role, tenant, namespace) if action is None
                   else self.may(role, action, tenant, namespace))
        if not allowed:
            needed = "produce or consume" if action is None else action.value
            raise AuthorizationError(f"{_who(role)} may not {what}: it has no {needed} grant on namespace {namespace_name}")


def _who(role: str | None) -> str:
    return "a client without a role" if role is None else f"role {role[:100]!r}"


__all__ = ["Action", "Authorizer", "NamespacePolicies", "TenantInfo", "check_role", "parse_actions"]
