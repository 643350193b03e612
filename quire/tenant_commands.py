"""`quire tenant ...` and `quire namespace ...`: Pulsar's tenants and
namespaces, and the grants that let a role produce or consume, through a
broker (which checks that the caller's role may change them).
"""

from __future__ import annotations

import argparse

from quire.topic_commands import _print, _run, add_brokers


def _names(text: str) -> list[str]:
    return [name.strip() for name in text.split(",") if name.strip()]


def add_tenant(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("tenant", metavar="TENANT")
    add_brokers(parser)


def add_tenant_create(parser: argparse.ArgumentParser) -> None:
    add_tenant(parser)
    parser.add_argument("--admin-roles", type=_names, default=[], metavar="ROLE,...",
                        help="roles that administer the tenant: its namespaces, grants and topics")
    parser.add_argument("--allowed-clusters", type=_names, default=[], metavar="CLUSTER,...",
                        help="clusters the tenant may use (kept for Pulsar's tools)")


def tenant_create(arguments: argparse.Namespace) -> int:
    async def body(client) -> None:
        _print(await client.create_tenant(arguments.tenant, admin_roles=arguments.admin_roles,
                                          allowed_clusters=arguments.allowed_clusters))

    return _run(arguments, body)


def tenant_update(arguments: argparse.Namespace) -> int:
    async def body(client) -> None:
        _print(await client.update_tenant(arguments.tenant, admin_roles=arguments.admin_roles,
                                          allowed_clusters=arguments.allowed_clusters))

    return _run(arguments, body)


def tenant_list(arguments: argparse.Namespace) -> int:
    async def body(client) -> None:
        for tenant in await client.list_tenants():
            print(tenant)

    return _run(arguments, body)


def tenant_delete(arguments: argparse.Namespace) -> int:
    async def body(client) -> None:
        await client.delete_tenant(arguments.tenant)
        print(f"deleted tenant {arguments.tenant}")

    return _run(arguments, body)


def _namespace(text: str) -> str:
    parts = text.split("/")
    if len(parts) != 2 or not all(parts):
        raise argparse.ArgumentTypeError(f"a namespace is TENANT/NAMESPACE, got {text[:200]!r}")
    return text


def add_namespace(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("namespace", metavar="TENANT/NAMESPACE", type=_namespace)
    add_brokers(parser)


def namespace_create(arguments: argparse.Namespace) -> int:
    async def body(client) -> None:
        await client.create_namespace(arguments.namespace)
        print(f"created namespace {arguments.namespace}")

    return _run(arguments, body)


def namespace_list(arguments: argparse.Namespace) -> int:
    async def body(client) -> None:
        for namespace in await client.list_namespaces(arguments.tenant):
            print(namespace)

    return _run(arguments, body)


def namespace_delete(arguments: argparse.Namespace) -> int:
    async def body(client) -> None:
        await client.delete_namespace(arguments.namespace)
        print(f"deleted namespace {arguments.namespace}")

    return _run(arguments, body)


def add_grant(parser: argparse.ArgumentParser) -> None:
    add_namespace(parser)
    parser.add_argument("--role", required=True, help="the role granted (a token's subject, a certificate's CN)")
    parser.add_argument("--actions", required=True, type=_actions, metavar="ACTION,...",
                        help="what the role may do: produce, consume or both (replaces what it had)")


def _actions(text: str) -> list[str]:
    from broker.authorization import parse_actions

    try:
        return sorted(parse_actions(text))
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def add_revoke(parser: argparse.ArgumentParser) -> None:
    add_namespace(parser)
    parser.add_argument("--role", required=True, help="the role whose grant goes")


def namespace_grant(arguments: argparse.Namespace) -> int:
    async def body(client) -> None:
        _print(await client.grant_permission(arguments.namespace, arguments.role, arguments.actions))

    return _run(arguments, body)


def namespace_revoke(arguments: argparse.Namespace) -> int:
    async def body(client) -> None:
        _print(await client.revoke_permission(arguments.namespace, arguments.role))

    return _run(arguments, body)


def namespace_permissions(arguments: argparse.Namespace) -> int:
    async def body(client) -> None:
        _print(await client.permissions(arguments.namespace))

    return _run(arguments, body)


def register(group, command):
    """The `tenant` and `namespace` command groups (cli.build_parser's
    helpers); returns the namespace group, for the commands of other modules."""
    tenant = group("tenant", "tenants: who administers them (Pulsar's pulsar-admin tenants)")
    add_tenant_create(command(tenant, "create", "create a tenant (superusers only)", tenant_create))
    add_tenant_create(command(tenant, "update", "replace a tenant's admin roles and clusters (superusers only)", tenant_update))
    add_brokers(command(tenant, "list", "list the tenants", tenant_list))
    add_tenant(command(tenant, "delete", "delete a tenant that has no namespaces left (superusers only)", tenant_delete))
    namespace = group("namespace", "namespaces: their topics' grants (Pulsar's pulsar-admin namespaces)")
    add_namespace(command(namespace, "create", "create a namespace (the tenant's admins)", namespace_create))
    add_tenant(command(namespace, "list", "list a tenant's namespaces", namespace_list))
    add_namespace(command(namespace, "delete", "delete a namespace that has no topics left (the tenant's admins)", namespace_delete))
    add_grant(command(namespace, "grant-permission", "let a role produce and/or consume in a namespace", namespace_grant))
    add_revoke(command(namespace, "revoke-permission", "take a role's grant on a namespace away", namespace_revoke))
    add_namespace(command(namespace, "permissions", "the roles granted actions on a namespace", namespace_permissions))
    return namespace


__all__ = ["register"]
