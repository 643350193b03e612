"""The security flags servers share (brokers now, bookies with their client
roles): how tokens are checked, the anonymous role, the superusers. Each
part is off unless its flag is given.
"""

from __future__ import annotations

import argparse

from quire.cli_parsing import UsageError


def _roles(text: str) -> frozenset[str]:
    roles = frozenset(role.strip() for role in text.split(",") if role.strip())
    if not roles:
        raise argparse.ArgumentTypeError("name at least one role")
    return roles


def add_authentication(parser: argparse.ArgumentParser) -> None:
    keys = parser.add_mutually_exclusive_group()
    keys.add_argument("--auth-token-secret-key", metavar="FILE",
                      help="authenticate clients by tokens signed with this secret key (HS256; quire token "
                           "create-secret-key); also file:///PATH or data:;base64,KEY as Pulsar takes them")
    keys.add_argument("--auth-token-public-key", metavar="FILE",
                      help="authenticate clients by tokens signed with the private key of this public key (RS256; "
                           "quire token create-key-pair)")
    parser.add_argument("--auth-token-audience", metavar="AUDIENCE",
                        help="refuse tokens whose aud claim does not name this audience")
    parser.add_argument("--anonymous-role", metavar="ROLE",
                        help="the role of a client that presents no credentials (default: such clients are refused "
                             "once authentication is on)")
    parser.add_argument("--superuser-roles", type=_roles, default=frozenset(), metavar="ROLE,...",
                        help="roles that may do anything: create tenants, administer every namespace and topic")


def authenticator_from(arguments: argparse.Namespace, *, tls_certificates: bool = False):
    """The Authenticator the flags describe; UsageError names a bad one."""
    from security.authentication import Authenticator
    from security.tokens import TokenValidator, load_key_argument

    secret, public = arguments.auth_token_secret_key, arguments.auth_token_public_key
    tokens = None
    if secret is not None or public is not None:
        flag, value = ("--auth-token-secret-key", secret) if secret is not None else ("--auth-token-public-key", public)
        try:
            key = load_key_argument(value)
            tokens = (TokenValidator(secret_key=key, audience=arguments.auth_token_audience) if secret is not None
                      else TokenValidator(public_key=key, audience=arguments.auth_token_audience))
        except (OSError, ValueError) as error:
            raise UsageError(f"{flag}: {error}") from None
    elif arguments.auth_token_audience is not None:
        raise UsageError("--auth-token-audience needs --auth-token-secret-key or --auth-token-public-key")
    authenticator = Authenticator(tokens=tokens, tls_certificates=tls_certificates, anonymous_role=arguments.anonymous_role)
    if not authenticator.enabled:
        for flag, value in (("--anonymous-role", arguments.anonymous_role), ("--superuser-roles", arguments.superuser_roles)):
            if value:
                raise UsageError(f"{flag} needs authentication: --auth-token-secret-key, --auth-token-public-key "
                                 f"or trusted client certificates")
    return authenticator


__all__ = ["add_authentication", "authenticator_from"]
