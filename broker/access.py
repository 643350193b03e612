"""Authentication and authorization of a broker's clients, for both of its
protocols and its admin requests: who a connection is (security's
Authenticator) and whether its role may do what it asks (broker's
Authorizer, over the tenants and namespaces in ZooKeeper).
"""

from __future__ import annotations

import logging
import time

from broker.authorization import Action, Authorizer
from broker.errors import AuthenticationError as BrokerAuthenticationError, NotFoundError
from broker.tenant_store import TenantStore, split_namespace
from broker.topic_names import NAMESPACE, namespace_of_topic
from security.authentication import Authenticator, Principal, RefusalLog
from security.tokens import AuthenticationError

log = logging.getLogger(__name__)


class AccessControl:
    def __init__(self, authenticator: Authenticator, superuser_roles: frozenset[str], tenants: TenantStore) -> None:
        self.authenticator = authenticator
        self.authorizer = Authorizer(enabled=authenticator.enabled, superuser_roles=frozenset(superuser_roles))
        self.tenants = tenants
        self.authentication_refusals = 0
        self.authorization_refusals = 0
        self._refusal_log = RefusalLog()

    @property
    def enabled(self) -> bool:
        return self.authenticator.enabled

    def authenticate(self, method: str | None, data: bytes | str | None, *, peer: str, peer_common_name: str | None,
                     now: float, protocol: str) -> Principal:
        """The connection's principal, or the broker's AuthenticationError
        (counted and logged with the peer's address, never the token)."""
        try:
            return self.authenticator.authenticate(method, data, peer_common_name=peer_common_name, now=now)
        except AuthenticationError as error:
            self.refused_authentication(peer, protocol, str(error))
            raise BrokerAuthenticationError(f"authentication failed: {error}") from None

    def refresh(self, principal: Principal, data: bytes | str | None, *, peer: str, now: float, protocol: str) -> Principal:
        try:
            return self.authenticator.refresh(principal, data, now=now)
        except AuthenticationError as error:
            self.refused_authentication(peer, protocol, str(error))
            raise BrokerAuthenticationError(f"authentication failed: {error}") from None

    def refused_authentication(self, peer: str, protocol: str, reason: str) -> None:
        self.authentication_refusals += 1
        # One line a second at most: a client retrying a bad token in a
        # loop must not flood the log (the counter has them all).
        if self._refusal_log.allows(time.monotonic()):
            suppressed = self._refusal_log.take_suppressed()
            log.warning("refused %s connection from %s: %s%s", protocol, peer, reason,
                        f" ({suppressed} more refused since the last line)" if suppressed else "")

    async def check_namespace(self, topic: str) -> None:
        """The namespace of a topic about to be made exists."""
        namespace = namespace_of_topic(topic)
        if namespace != NAMESPACE and await self.tenants.namespace(namespace) is None:
            raise NotFoundError(f"namespace {namespace} does not exist: create it first (quire namespace create {namespace})")

    async def check_topic(self, role: str | None, topic: str, action: Action | None, what: str) -> None:
        """The topic's namespace exists and `role` holds `action` on it
        (None: either action, as a lookup needs)."""
        await self.check_in_namespace(role, namespace_of_topic(topic), action, f"{what} {topic}")

    async def check_in_namespace(self, role: str | None, namespace: str, action: Action | None, what: str) -> None:
        if not self.enabled and namespace == NAMESPACE:
            return  # always there; nothing to check
        tenant_name, _ = split_namespace(namespace)
        policies = await self.tenants.namespace(namespace)
        if policies is None:
            raise NotFoundError(f"namespace {namespace} does not exist: create it first (quire namespace create {namespace})")
        tenant = await self.tenants.tenant(tenant_name)
        self._counted(lambda: self.authorizer.check(role, action, namespace, tenant, policies, what))

    async def check_topic_admin(self, role: str | None, topic: str, what: str) -> None:
        namespace = namespace_of_topic(topic)
        if not self.enabled and namespace == NAMESPACE:
            return
        if await self.tenants.namespace(namespace) is None:
            raise NotFoundError(f"namespace {namespace} does not exist")
        await self.check_tenant_admin(role, split_namespace(namespace)[0], f"{what} {topic}")

    async def check_tenant_admin(self, role: str | None, tenant_name: str, what: str) -> None:
        if self.authorizer.is_superuser(role):
            return
        tenant = await self.tenants.tenant(tenant_name)
        self._counted(lambda: self.authorizer.check_tenant_admin(role, tenant_name, tenant, what))

    def check_superuser(self, role: str | None, what: str) -> None:
        self._counted(lambda: self.authorizer.check_superuser(role, what))

    async def may_look_up(self, role: str | None, topic: str) -> bool:
        """Whether `role` sees the topic in a listing."""
        if self.authorizer.is_superuser(role):
            return True
        namespace = namespace_of_topic(topic)
        policies = await self.tenants.namespace(namespace)
        tenant = await self.tenants.tenant(split_namespace(namespace)[0])
        return self.authorizer.may_look_up(role, tenant, policies)

    def _counted(self, check) -> None:
        try:
            check()
        except Exception:
            self.authorization_refusals += 1
            raise


__all__ = ["AccessControl"]
