"""The authorization decisions (pure), the names of topics in namespaces,
and how a client presents itself (security.authentication)."""

from __future__ import annotations

import pytest

from broker.authorization import Action, Authorizer, NamespacePolicies, TenantInfo, parse_actions
from broker.errors import AuthorizationError
from broker.topic_names import namespace_of_topic, pulsar_name, quire_name
from broker.topic_records import check_name, name_of_node, node_name, topic_path
from security.authentication import Authenticator
from security.tokens import AuthenticationError, TokenValidator, create_secret_key, create_token

ON = Authorizer(enabled=True, superuser_roles=frozenset({"root"}))
TENANT = TenantInfo(admin_roles=("acme-admin",))
GRANTS = NamespacePolicies({"writer": frozenset({Action.PRODUCE}), "reader": frozenset({Action.CONSUME})})


@pytest.mark.parametrize("role, action, allowed", [
    ("root", Action.PRODUCE, True),          # superusers may do anything
    ("acme-admin", Action.CONSUME, True),    # so may the tenant's admins
    ("writer", Action.PRODUCE, True),
    ("writer", Action.CONSUME, False),
    ("reader", Action.CONSUME, True),
    ("reader", Action.PRODUCE, False),
    ("stranger", Action.PRODUCE, False),
    (None, Action.CONSUME, False),           # no role: nothing
])
def test_a_role_may_do_what_its_namespace_grants(role, action, allowed):
    assert ON.may(role, action, TENANT, GRANTS) is allowed
    if allowed:
        ON.check(role, action, "acme/app", TENANT, GRANTS, "produce to x")
    else:
        with pytest.raises(AuthorizationError, match="acme/app"):
            ON.check(role, action, "acme/app", TENANT, GRANTS, "produce to x")


def test_a_lookup_needs_either_grant_and_admin_needs_the_tenant():
    assert ON.may_look_up("writer", TENANT, GRANTS) and ON.may_look_up("reader", TENANT, GRANTS)
    assert not ON.may_look_up("stranger", TENANT, GRANTS)
    assert ON.is_tenant_admin("acme-admin", TENANT) and not ON.is_tenant_admin("writer", TENANT)
    with pytest.raises(AuthorizationError, match="admin of tenant acme"):
        ON.check_tenant_admin("writer", "acme", TENANT, "delete topic x")
    with pytest.raises(AuthorizationError, match="superuser"):
        ON.check_superuser("acme-admin", "create tenant t")


def test_without_authentication_everything_is_allowed():
    off = Authorizer()
    assert off.may(None, Action.PRODUCE, None, None) and off.is_superuser(None)


def test_grants_replace_and_revoke_and_round_trip():
    policies = NamespacePolicies().granted("r", parse_actions("produce,consume")).granted("r", parse_actions("consume"))
    assert policies.permissions == {"r": frozenset({Action.CONSUME})}
    assert NamespacePolicies.from_bytes(policies.to_bytes()) == policies
    assert policies.revoked("r").permissions == {}
    assert TenantInfo.from_bytes(TENANT.to_bytes()) == TENANT
    for bad in ("", "produce,delete", ","):
        with pytest.raises(ValueError):
            parse_actions(bad)
    with pytest.raises(ValueError):
        NamespacePolicies.from_dict({"permissions": {"r": ["everything"]}})


def test_topics_of_other_namespaces_keep_their_namespace_in_their_names():
    assert quire_name("persistent://public/default/orders") == "orders"
    assert quire_name("persistent://acme/app/orders") == "acme/app/orders"
    assert quire_name("acme/app/orders-partition-3") == "acme/app/orders-partition-3"
    assert pulsar_name("acme/app/orders") == "persistent://acme/app/orders"
    assert pulsar_name("orders") == "persistent://public/default/orders"
    assert namespace_of_topic("acme/app/orders") == "acme/app" and namespace_of_topic("orders") == "public/default"
    assert check_name("acme/app/orders") == "acme/app/orders"
    for bad in ("acme/orders", "acme//orders", "a/b/c/d", "acme/app/%2F", "../app/x"):
        with pytest.raises(ValueError):
            check_name(bad)
    with pytest.raises(ValueError):
        check_name("acme/app/orders", "subscription")  # only topics have namespaces
    # One ZooKeeper node per topic, whatever its namespace.
    assert topic_path("acme/app/orders") == "/topics/acme%2Fapp%2Forders"
    assert name_of_node(node_name("acme/app/orders")) == "acme/app/orders"


def test_clients_present_a_token_a_certificate_or_nothing():
    key = create_secret_key()
    now = 1_000_000.0
    token = create_token("alice", secret_key=key, now=now, expiry_s=60)
    tokens_only = Authenticator(tokens=TokenValidator(secret_key=key))
    principal = tokens_only.authenticate("token", token, peer_common_name=None, now=now)
    assert (principal.role, principal.expires_at) == ("alice", now + 60)
    with pytest.raises(AuthenticationError, match="expired"):
        tokens_only.authenticate("token", token, peer_common_name=None, now=now + 61)
    with pytest.raises(AuthenticationError, match="needs credentials"):
        tokens_only.authenticate("", b"", peer_common_name=None, now=now)
    with pytest.raises(AuthenticationError, match="client certificate"):
        tokens_only.authenticate("tls", b"", peer_common_name="alice", now=now)  # certificates not trusted here
    with pytest.raises(AuthenticationError, match="unknown authentication method"):
        tokens_only.authenticate("athenz", b"x", peer_common_name=None, now=now)
    both = Authenticator(tokens=TokenValidator(secret_key=key), tls_certificates=True, anonymous_role="guest")
    assert both.authenticate("tls", b"", peer_common_name="svc", now=now).role == "svc"
    assert both.authenticate("", b"", peer_common_name=None, now=now).role == "guest"
    # A refreshed token must name the same role.
    fresh = create_token("alice", secret_key=key, now=now + 50, expiry_s=60)
    assert tokens_only.refresh(principal, fresh, now=now + 55).expires_at == now + 110
    with pytest.raises(AuthenticationError, match="connection.s role"):
        tokens_only.refresh(principal, create_token("mallory", secret_key=key, now=now), now=now)
    # Authentication off: nobody is asked for anything.
    assert Authenticator().authenticate("token", "garbage", peer_common_name=None, now=now).role is None
