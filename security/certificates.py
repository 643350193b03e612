"""A small certificate authority for TLS between quire's processes and their
clients: a CA, server and client certificates signed by it (a client
certificate's common name is the role it authenticates as), and the files
of a secure local cluster (`quire cluster up --secure`).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import re
from collections.abc import Iterable
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from security.tokens import write_key_file

CA_DAYS_DEFAULT = 3650
# What browsers and most TLS stacks accept at most for a leaf certificate.
LEAF_DAYS_DEFAULT = 825
# Clocks of the machines of a cluster differ a little: a certificate made a
# moment ago must already be valid on a machine whose clock is behind.
CLOCK_SKEW = datetime.timedelta(minutes=5)
SERVER_COMMON_NAME = "quire-server"
# A role names two files (<role>.cert.pem, <role>.key.pem): a plain file
# name, and not one of the files the CA and the servers use.
_ROLE_FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")
_RESERVED_ROLE_NAMES = {"ca", "server"}


def _new_key() -> ec.EllipticCurvePrivateKey:
    # P-256: made in microseconds, accepted by every TLS 1.2 and 1.3 stack.
    return ec.generate_private_key(ec.SECP256R1())


def _private_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())


def _check_days(days: int) -> None:
    if isinstance(days, bool) or not isinstance(days, int) or not 1 <= days <= 100 * 365:
        raise ValueError(f"days must be an integer in 1..36500, got {days!r}")


def _check_common_name(common_name: str) -> None:
    # X.509 (RFC 5280, ub-common-name) allows 64 characters.
    if not isinstance(common_name, str) or not 1 <= len(common_name) <= 64 or not common_name.isprintable():
        raise ValueError("common_name must be 1-64 printable characters")


def create_ca(common_name: str = "quire-ca", *, days: int = CA_DAYS_DEFAULT,
              now: datetime.datetime | None = None) -> tuple[bytes, bytes]:
    """A self-signed CA: (certificate PEM, private key PEM). `now` (aware,
    UTC) is when its validity starts, the wall clock if not given."""
    _check_common_name(common_name)
    _check_days(days)
    start = (now or datetime.datetime.now(datetime.UTC)) - CLOCK_SKEW
    key = _new_key()
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(start + datetime.timedelta(days=days))
        # path_length 0: the CA signs leaf certificates only, no other CA.
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False, key_cert_sign=True, crl_sign=True,
                                     encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return certificate.public_bytes(serialization.Encoding.PEM), _private_pem(key)


def _subject_alternative_names(hosts: Iterable[str]) -> list[x509.GeneralName]:
    names: list[x509.GeneralName] = []
    for host in hosts:
        if not isinstance(host, str) or not host or not host.isascii() or not host.isprintable():
            raise ValueError(f"a host is an IP address or an ASCII DNS name, got {host!r:.80}")
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return names


def _load_ca(ca_cert_pem: bytes, ca_key_pem: bytes) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    try:
        ca_certificate = x509.load_pem_x509_certificate(ca_cert_pem)
    except (ValueError, TypeError):
        raise ValueError("ca_cert_pem is not a PEM certificate") from None
    try:
        ca_key = serialization.load_pem_private_key(ca_key_pem, password=None)
    except (ValueError, TypeError, UnsupportedAlgorithm):
        raise ValueError("ca_key_pem is not an unencrypted PEM private key") from None
    if ca_key.public_key() != ca_certificate.public_key():
        raise ValueError("ca_key_pem is not the key of ca_cert_pem")
    return ca_certificate, ca_key


def create_certificate(ca_cert_pem: bytes, ca_key_pem: bytes, common_name: str, *,
                       hosts: Iterable[str] = ("127.0.0.1", "localhost"), client: bool = False, server: bool = True,
                       days: int = LEAF_DAYS_DEFAULT, now: datetime.datetime | None = None) -> tuple[bytes, bytes]:
    """A leaf certificate signed by the CA: (certificate PEM, private key PEM).
    `hosts` become its subject alternative names (IP addresses or DNS
    names); `server` and `client` its extended key usages. A client
    certificate's common name is the role it authenticates as."""
    _check_common_name(common_name)
    _check_days(days)
    if not server and not client:
        raise ValueError("a certificate is for a server, a client, or both")
    hosts = list(hosts)
    if server and not hosts:
        raise ValueError("a server certificate needs at least one host")
    ca_certificate, ca_key = _load_ca(ca_cert_pem, ca_key_pem)
    start = (now or datetime.datetime.now(datetime.UTC)) - CLOCK_SKEW
    key = _new_key()
    usages = ([ExtendedKeyUsageOID.SERVER_AUTH] if server else []) + ([ExtendedKeyUsageOID.CLIENT_AUTH] if client else [])
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
        .issuer_name(ca_certificate.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        # Never past the CA: a chain is only as valid as its shortest link.
        .not_valid_after(min(start + datetime.timedelta(days=days), ca_certificate.not_valid_after_utc))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False, key_cert_sign=False, crl_sign=False,
                                     encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
    )
    if hosts:
        builder = builder.add_extension(x509.SubjectAlternativeName(_subject_alternative_names(hosts)), critical=False)
    certificate = builder.sign(ca_key, hashes.SHA256())
    return certificate.public_bytes(serialization.Encoding.PEM), _private_pem(key)


def _check_role_file_name(role: str) -> None:
    if not isinstance(role, str) or not _ROLE_FILE_NAME.fullmatch(role) or role in _RESERVED_ROLE_NAMES:
        raise ValueError(f"a role here names its files: 1-64 of A-Z a-z 0-9 _ . - (not starting with . or -), "
                         f"and not {' or '.join(sorted(_RESERVED_ROLE_NAMES))}; got {role!r:.80}")


def write_tls_files(directory: str | os.PathLike, *, hosts: Iterable[str], roles: Iterable[str] = (),
                    now: datetime.datetime | None = None) -> dict[str, Path]:
    """Write a CA, a server certificate for `hosts` and a client certificate
    for each role into `directory` (made if missing); the key files are
    mode 0600. Returns each file's name (`ca.cert.pem`, `server.key.pem`,
    `<role>.cert.pem`...) with its path.

    The server certificate serves as a client certificate too (common name
    quire-server), so the cluster's processes can use it to reach each other."""
    roles = list(roles)
    for role in roles:
        _check_role_file_name(role)
    if len(set(roles)) != len(roles):
        raise ValueError("a role is named twice")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    ca_cert, ca_key = create_ca(now=now)
    files: dict[str, bytes] = {"ca.cert.pem": ca_cert, "ca.key.pem": ca_key}
    files["server.cert.pem"], files["server.key.pem"] = create_certificate(
        ca_cert, ca_key, SERVER_COMMON_NAME, hosts=hosts, server=True, client=True, now=now)
    for role in roles:
        files[f"{role}.cert.pem"], files[f"{role}.key.pem"] = create_certificate(
            ca_cert, ca_key, role, hosts=(), server=False, client=True, now=now)
    paths = {}
    for name, data in files.items():
        paths[name] = write_key_file(directory / name, data, mode=0o600 if name.endswith(".key.pem") else 0o644)
    return paths


def common_name_of(certificate: bytes) -> str | None:
    """The subject's common name of a certificate (DER or PEM), None when it
    has none, or more than one (which of them would be the role is not clear)."""
    if not isinstance(certificate, bytes):
        raise TypeError(f"certificate must be bytes, not {type(certificate).__name__}")
    try:
        if certificate.lstrip().startswith(b"-----BEGIN"):
            loaded = x509.load_pem_x509_certificate(certificate)
        else:
            loaded = x509.load_der_x509_certificate(certificate)
    except (ValueError, TypeError):
        raise ValueError("not a DER or PEM certificate") from None
    names = loaded.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    if len(names) != 1:
        return None
    value = names[0].value
    return value if isinstance(value, str) else value.decode("utf-8", "replace")


__all__ = [
    "SERVER_COMMON_NAME",
    "common_name_of",
    "create_ca",
    "create_certificate",
    "write_tls_files",
]
