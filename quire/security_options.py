"""The security flags servers share (brokers now, bookies with their client
roles): how tokens are checked, the anonymous role, the superusers. Each
part is off unless its flag is given.
"""

from __future__ import annotations

import argparse
import os

from quire.cli_parsing import UsageError


def _roles(text: str) -> frozenset[str]:
    roles = frozenset(role.strip() for role in text.split(",") if role.strip())
    if not roles:
        raise argparse.ArgumentTypeError("name at least one role")
    return roles


def add_authentication(parser: argparse.ArgumentParser, *, bookie: bool = False) -> None:
    """The token flags; a broker's roles (superusers, anonymous) or a
    bookie's (the roles of the ledger clients it serves)."""
    keys = parser.add_mutually_exclusive_group()
    keys.add_argument("--auth-token-secret-key", metavar="FILE",
                      help="authenticate clients by tokens signed with this secret key (HS256; quire token "
                           "create-secret-key); also file:///PATH or data:;base64,KEY as Pulsar takes them")
    keys.add_argument("--auth-token-public-key", metavar="FILE",
                      help="authenticate clients by tokens signed with the private key of this public key (RS256; "
                           "quire token create-key-pair)")
    parser.add_argument("--auth-token-audience", metavar="AUDIENCE",
                        help="refuse tokens whose aud claim does not name this audience")
    if bookie:
        parser.add_argument("--client-roles", type=_roles, default=frozenset(), metavar="ROLE,...",
                            help="once the bookie authenticates (a token key, or --tls-trust-certs-file), the roles of the "
                                 "ledger clients it serves (brokers, auto-recovery, tools): a token's subject or a "
                                 "certificate's CN; any other client is refused before any add, read or fence")
        return
    parser.add_argument("--anonymous-role", metavar="ROLE",
                        help="the role of a client that presents no credentials (default: such clients are refused "
                             "once authentication is on)")
    parser.add_argument("--superuser-roles", type=_roles, default=frozenset(), metavar="ROLE,...",
                        help="roles that may do anything: create tenants, administer every namespace and topic")


def add_tls_server(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tls-cert-file", metavar="FILE", help="the server's certificate (PEM), for its TLS listeners")
    parser.add_argument("--tls-key-file", metavar="FILE", help="the key of --tls-cert-file (PEM)")
    parser.add_argument("--tls-trust-certs-file", metavar="FILE",
                        help="CA certificates (PEM) whose client certificates authenticate clients as their CN")
    parser.add_argument("--tls-require-trusted-client-cert", action="store_true",
                        help="refuse TLS clients without a certificate signed by --tls-trust-certs-file (mutual TLS)")


def tls_server_context_from(arguments: argparse.Namespace):
    """The server's TLS context the flags describe (None without a
    certificate); UsageError names a bad flag or file."""
    from security.tls import server_context

    cert, key, trust = arguments.tls_cert_file, arguments.tls_key_file, arguments.tls_trust_certs_file
    if (cert is None) != (key is None):
        raise UsageError("--tls-cert-file and --tls-key-file go together")
    if cert is None:
        for flag, value in (("--tls-trust-certs-file", trust),
                            ("--tls-require-trusted-client-cert", arguments.tls_require_trusted_client_cert)):
            if value:
                raise UsageError(f"{flag} needs --tls-cert-file and --tls-key-file")
        return None
    if arguments.tls_require_trusted_client_cert and trust is None:
        raise UsageError("--tls-require-trusted-client-cert needs --tls-trust-certs-file")
    try:
        return server_context(cert, key, trust, require_client_cert=arguments.tls_require_trusted_client_cert)
    except (OSError, ValueError) as error:
        raise UsageError(f"TLS: {error}") from None


def add_tls_client(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tls-trust-certs-file", metavar="FILE",
                        help="connect over TLS, trusting servers whose certificates these CA certificates (PEM) signed")
    parser.add_argument("--tls-cert-file", metavar="FILE", help="a client certificate (PEM) to authenticate with, over TLS")
    parser.add_argument("--tls-key-file", metavar="FILE", help="the key of --tls-cert-file (PEM)")


def tls_client_context_from(arguments: argparse.Namespace):
    """The client's TLS context (None: plaintext); UsageError names a bad flag or file."""
    from security.tls import client_context

    trust = getattr(arguments, "tls_trust_certs_file", None)
    cert, key = getattr(arguments, "tls_cert_file", None), getattr(arguments, "tls_key_file", None)
    if (cert is None) != (key is None):
        raise UsageError("--tls-cert-file and --tls-key-file go together")
    if trust is None:
        if cert is not None:
            raise UsageError("--tls-cert-file needs --tls-trust-certs-file (the servers' CA)")
        return None
    try:
        return client_context(trust, cert_file=cert, key_file=key)
    except (OSError, ValueError) as error:
        raise UsageError(f"TLS: {error}") from None


def add_credentials(parser: argparse.ArgumentParser) -> None:
    """What a client command shows the servers it reaches (brokers, and
    bookies for the commands that read or write ledgers): a token, and TLS."""
    add_tls_client(parser)
    credentials = parser.add_mutually_exclusive_group()
    credentials.add_argument("--auth-token", metavar="TOKEN",
                             help="the token to show servers (quire token create); default: $QUIRE_AUTH_TOKEN")
    credentials.add_argument("--auth-token-file", metavar="FILE",
                             help="a file holding the token (read again for each new connection, so it may be replaced)")


def _token_file_reader(flag: str, token_file: str):
    def read() -> str:
        try:
            with open(token_file) as file:
                return file.read().strip()
        except OSError as error:
            raise UsageError(f"{flag}: cannot read {token_file}: {error.strerror}") from None

    read()  # a missing file is said at once, before anything else is done
    return read


def auth_token_from(arguments: argparse.Namespace):
    """The client's token, a function reading it from its file, or None."""
    token_file = getattr(arguments, "auth_token_file", None)
    if token_file is not None:
        return _token_file_reader("--auth-token-file", token_file)
    token = getattr(arguments, "auth_token", None) or os.environ.get("QUIRE_AUTH_TOKEN") or None
    return token.strip() if token else None


def client_credentials_from(arguments: argparse.Namespace):
    """A client command's credentials (security.credentials.ClientCredentials)."""
    from security.credentials import ClientCredentials

    return ClientCredentials(auth_token_from(arguments), tls_client_context_from(arguments))


def add_bookie_client(parser: argparse.ArgumentParser) -> None:
    """For servers that reach bookies (brokers, bookies' auto-recovery)."""
    parser.add_argument("--bookie-auth-token-file", metavar="FILE",
                        help="a token to show bookies that authenticate their clients (read again for each connection); "
                             "over TLS, the server's own certificate (--tls-cert-file) is shown to bookies too")


def bookie_credentials_from(arguments: argparse.Namespace):
    """What a server shows bookies: its --bookie-auth-token-file, and over
    TLS (--tls-trust-certs-file: the CA that signed the bookies' certificates)
    its own certificate as its client certificate."""
    from security.credentials import ClientCredentials
    from security.tls import client_context

    token_file = arguments.bookie_auth_token_file
    token = None if token_file is None else _token_file_reader("--bookie-auth-token-file", token_file)
    tls_context = None
    if arguments.tls_trust_certs_file is not None:
        try:
            tls_context = client_context(arguments.tls_trust_certs_file, cert_file=arguments.tls_cert_file,
                                         key_file=arguments.tls_key_file)
        except (OSError, ValueError) as error:
            raise UsageError(f"TLS: {error}") from None
    return ClientCredentials(token, tls_context)


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
    anonymous_role = getattr(arguments, "anonymous_role", None)
    authenticator = Authenticator(tokens=tokens, tls_certificates=tls_certificates, anonymous_role=anonymous_role)
    roles = [(flag, getattr(arguments, name, None)) for flag, name in (
        ("--anonymous-role", "anonymous_role"), ("--superuser-roles", "superuser_roles"), ("--client-roles", "client_roles"))]
    if not authenticator.enabled:
        for flag, value in roles:
            if value:
                raise UsageError(f"{flag} needs authentication: --auth-token-secret-key, --auth-token-public-key "
                                 f"or trusted client certificates (--tls-trust-certs-file)")
    elif hasattr(arguments, "client_roles") and not arguments.client_roles:
        raise UsageError("a bookie that authenticates needs --client-roles: the roles of the ledger clients it serves")
    return authenticator


__all__ = ["add_authentication", "add_bookie_client", "add_credentials", "auth_token_from", "bookie_credentials_from",
           "client_credentials_from", "add_tls_client", "add_tls_server", "authenticator_from", "tls_client_context_from",
           "tls_server_context_from"]
