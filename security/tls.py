"""TLS contexts for quire's servers and clients (Python's `ssl`), and the
role a verified client certificate authenticates as. A file that is
missing or is not what it should be is a ValueError naming the file.
"""

from __future__ import annotations

import os
import ssl
from pathlib import Path
from typing import Any

TLS_VERSION_MIN = ssl.TLSVersion.TLSv1_2


def _readable(path: str | os.PathLike, what: str) -> str:
    """The path as text once it is a readable file; ValueError naming it otherwise."""
    path = Path(path)
    try:
        with open(path, "rb") as file:
            file.read(1)
    except FileNotFoundError:
        raise ValueError(f"{what} {path}: no such file") from None
    except IsADirectoryError:
        raise ValueError(f"{what} {path}: is a directory") from None
    except OSError as error:
        raise ValueError(f"{what} {path}: cannot be read ({error.strerror or type(error).__name__})") from None
    return str(path)


def _load_chain(context: ssl.SSLContext, cert_file: str | os.PathLike, key_file: str | os.PathLike | None) -> None:
    certificate = _readable(cert_file, "certificate file")
    key = _readable(key_file, "key file") if key_file is not None else None
    try:
        context.load_cert_chain(certificate, key)
    except ssl.SSLError:
        # The message names the files, never their content: a key file's
        # content is the secret.
        where = f"{certificate} and {key}" if key else certificate
        raise ValueError(f"{where}: not a PEM certificate and its unencrypted private key, "
                         f"or the key does not belong to the certificate") from None


def _load_trust(context: ssl.SSLContext, trust_certs_file: str | os.PathLike) -> None:
    trusted = _readable(trust_certs_file, "trusted certificates file")
    try:
        context.load_verify_locations(cafile=trusted)
    except ssl.SSLError:
        raise ValueError(f"trusted certificates file {trusted}: no PEM certificate in it") from None


def _new_context(protocol: int) -> ssl.SSLContext:
    context = ssl.SSLContext(protocol)
    context.minimum_version = TLS_VERSION_MIN
    return context


def server_context(cert_file: str | os.PathLike, key_file: str | os.PathLike,
                   trust_certs_file: str | os.PathLike | None = None, *,
                   require_client_cert: bool = False) -> ssl.SSLContext:
    """A server's context: its certificate chain and key, TLS 1.2 or later.
    With `trust_certs_file`, a client may present a certificate signed by
    one of those CAs and authenticates as its common name (see
    `peer_common_name`); `require_client_cert` refuses clients without one."""
    if require_client_cert and trust_certs_file is None:
        raise ValueError("requiring client certificates needs a trusted certificates file to check them against")
    context = _new_context(ssl.PROTOCOL_TLS_SERVER)
    _load_chain(context, cert_file, key_file)
    if trust_certs_file is not None:
        _load_trust(context, trust_certs_file)
        # CERT_OPTIONAL still refuses a certificate that does not verify: a
        # client without one authenticates some other way (a token).
        context.verify_mode = ssl.CERT_REQUIRED if require_client_cert else ssl.CERT_OPTIONAL
    return context


def client_context(trust_certs_file: str | os.PathLike | None = None, *, cert_file: str | os.PathLike | None = None,
                   key_file: str | os.PathLike | None = None, verify_hostname: bool = True,
                   allow_insecure: bool = False) -> ssl.SSLContext:
    """A client's context, TLS 1.2 or later. It trusts `trust_certs_file`
    (the system's CAs when not given) and checks the server's name against
    its certificate unless `verify_hostname` is off; `allow_insecure`
    checks nothing at all (Pulsar's tlsAllowInsecureConnection, for tests).
    `cert_file` (and `key_file`, unless the key is in the same file) is
    the client's certificate, whose common name is its role."""
    if key_file is not None and cert_file is None:
        raise ValueError("a client key file needs its certificate file")
    context = _new_context(ssl.PROTOCOL_TLS_CLIENT)
    if allow_insecure:
        # check_hostname must be off before verify_mode may be CERT_NONE.
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    else:
        if trust_certs_file is not None:
            _load_trust(context, trust_certs_file)
        else:
            context.load_default_certs(ssl.Purpose.SERVER_AUTH)
        context.check_hostname = verify_hostname
    if cert_file is not None:
        _load_chain(context, cert_file, key_file)
    return context


def client_context_from_pem(trust_certs_pem: str) -> ssl.SSLContext:
    """A client's context trusting the CA certificates given as PEM text (for
    processes that get them in a setting, not a file: Spark's executors)."""
    context = _new_context(ssl.PROTOCOL_TLS_CLIENT)
    try:
        context.load_verify_locations(cadata=trust_certs_pem)
    except (ssl.SSLError, ValueError) as error:
        raise ValueError(f"the trusted CA certificates are not PEM certificates: {error}") from None
    context.check_hostname = True
    return context


def peer_common_name(ssl_object: Any) -> str | None:
    """The common name of the peer's verified certificate, None when the
    peer sent none (or it was not verified, or has not exactly one common
    name). `ssl_object` is an `ssl.SSLObject`, an `ssl.SSLSocket`, or
    anything with their `getpeercert()` (a trio SSLStream forwards it)."""
    # getpeercert() returns {} for a certificate that was not verified
    # (CERT_NONE): such a certificate proves nothing, so it names no role.
    certificate = ssl_object.getpeercert()
    if not certificate:
        return None
    names = [value for relative_name in certificate.get("subject", ()) for key, value in relative_name
             if key == "commonName"]
    return names[0] if len(names) == 1 else None


def stream_peer_common_name(stream: Any) -> str | None:
    """The CN of the client certificate a TLS stream (trio's SSLStream)
    verified; None on a plain stream, or before its handshake."""
    if not hasattr(stream, "getpeercert"):
        return None
    try:
        return peer_common_name(stream)
    except ValueError:  # the handshake has not happened
        return None


__all__ = [
    "TLS_VERSION_MIN",
    "client_context",
    "client_context_from_pem",
    "peer_common_name",
    "server_context",
    "stream_peer_common_name",
]
