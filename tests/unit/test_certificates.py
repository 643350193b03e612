"""The certificate authority (security/certificates.py) and the TLS contexts
(security/tls.py), with real certificates and real handshakes over a socket
pair: a client certificate's common name reaches the server as its role,
an untrusted one is refused, the server's name is checked against its SANs."""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
import ssl
import stat
import threading
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from security.certificates import (
    SERVER_COMMON_NAME,
    common_name_of,
    create_ca,
    create_certificate,
    write_tls_files,
)
from security.tls import client_context, peer_common_name, server_context

HANDSHAKE_TIMEOUT_S = 20


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory) -> dict[str, Path]:
    return write_tls_files(tmp_path_factory.mktemp("tls"), hosts=["127.0.0.1", "localhost"], roles=["admin", "reader"])


@pytest.fixture(scope="module")
def stranger_files(tmp_path_factory) -> dict[str, Path]:
    """Certificates of another CA, which tls_files' servers do not trust."""
    return write_tls_files(tmp_path_factory.mktemp("stranger"), hosts=["127.0.0.1"], roles=["admin"])


def load(pem: bytes) -> x509.Certificate:
    return x509.load_pem_x509_certificate(pem)


# --- certificates ---------------------------------------------------------------------------


def test_a_ca_is_self_signed_and_may_sign_only_leaves():
    certificate_pem, key_pem = create_ca("test-ca", days=10)
    certificate = load(certificate_pem)
    assert certificate.subject == certificate.issuer
    assert common_name_of(certificate_pem) == "test-ca"
    constraints = certificate.extensions.get_extension_for_class(x509.BasicConstraints)
    assert constraints.critical and constraints.value.ca and constraints.value.path_length == 0
    certificate.verify_directly_issued_by(certificate)
    assert serialization.load_pem_private_key(key_pem, password=None).public_key() == certificate.public_key()


def test_a_leaf_has_its_names_usages_and_issuer():
    ca_pem, ca_key_pem = create_ca()
    certificate_pem, key_pem = create_certificate(ca_pem, ca_key_pem, "broker-1", hosts=["127.0.0.1", "::1", "broker.example"],
                                                  server=True, client=True)
    certificate = load(certificate_pem)
    certificate.verify_directly_issued_by(load(ca_pem))
    assert certificate.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "broker-1"
    names = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("::1")]
    assert names.get_values_for_type(x509.DNSName) == ["broker.example"]
    usages = certificate.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(usages) == [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    assert certificate.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is False
    assert serialization.load_pem_private_key(key_pem, password=None).public_key() == certificate.public_key()


def test_a_client_certificate_is_for_clients_only():
    ca_pem, ca_key_pem = create_ca()
    certificate = load(create_certificate(ca_pem, ca_key_pem, "admin", hosts=(), client=True, server=False)[0])
    assert list(certificate.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    with pytest.raises(x509.ExtensionNotFound):
        certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName)


def test_a_leaf_never_outlives_its_ca():
    now = datetime.datetime(2030, 1, 1, tzinfo=datetime.UTC)
    ca_pem, ca_key_pem = create_ca(days=30, now=now)
    leaf = load(create_certificate(ca_pem, ca_key_pem, "server", days=825, now=now)[0])
    assert leaf.not_valid_after_utc == load(ca_pem).not_valid_after_utc
    assert leaf.not_valid_before_utc < now  # a little clock skew allowed


@pytest.mark.parametrize("arguments, words", [
    ({"server": False, "client": False}, "server, a client, or both"),
    ({"hosts": ()}, "at least one host"),
    ({"hosts": ["bad host\n"]}, "a host is"),
    ({"common_name": ""}, "common_name"),
    ({"common_name": "x" * 65}, "common_name"),
    ({"days": 0}, "days"),
])
def test_create_certificate_refuses_bad_arguments(arguments, words):
    ca_pem, ca_key_pem = create_ca()
    common_name = arguments.pop("common_name", "server")
    with pytest.raises(ValueError, match=words):
        create_certificate(ca_pem, ca_key_pem, common_name, **arguments)


def test_create_certificate_refuses_a_bad_ca():
    ca_pem, ca_key_pem = create_ca()
    _, other_key_pem = create_ca()
    with pytest.raises(ValueError, match="not a PEM certificate"):
        create_certificate(b"garbage", ca_key_pem, "server")
    with pytest.raises(ValueError, match="not an unencrypted PEM private key"):
        create_certificate(ca_pem, b"garbage", "server")
    with pytest.raises(ValueError, match="not the key of"):
        create_certificate(ca_pem, other_key_pem, "server")


def test_write_tls_files(tls_files):
    directory = tls_files["ca.cert.pem"].parent
    assert sorted(tls_files) == sorted(["ca.cert.pem", "ca.key.pem", "server.cert.pem", "server.key.pem",
                                        "admin.cert.pem", "admin.key.pem", "reader.cert.pem", "reader.key.pem"])
    assert sorted(path.name for path in directory.iterdir()) == sorted(tls_files)
    for name, path in tls_files.items():
        assert path == directory / name
        expected_mode = 0o600 if name.endswith(".key.pem") else 0o644
        assert stat.S_IMODE(os.stat(path).st_mode) == expected_mode, name
    assert common_name_of(tls_files["admin.cert.pem"].read_bytes()) == "admin"
    assert common_name_of(tls_files["server.cert.pem"].read_bytes()) == SERVER_COMMON_NAME
    ca = load(tls_files["ca.cert.pem"].read_bytes())
    for name in ("server", "admin", "reader"):
        load(tls_files[f"{name}.cert.pem"].read_bytes()).verify_directly_issued_by(ca)


@pytest.mark.parametrize("roles, words", [
    (["ca"], "not ca or server"),
    (["server"], "not ca or server"),
    (["../escape"], "names its files"),
    ([".hidden"], "names its files"),
    (["a/b"], "names its files"),
    (["admin", "admin"], "named twice"),
])
def test_write_tls_files_refuses_roles_that_are_not_file_names(tmp_path, roles, words):
    with pytest.raises(ValueError, match=words):
        write_tls_files(tmp_path / "tls", hosts=["127.0.0.1"], roles=roles)
    assert not (tmp_path / "tls").exists()


def test_common_name_of_pem_and_der():
    ca_pem, _ = create_ca("the-ca")
    der = load(ca_pem).public_bytes(serialization.Encoding.DER)
    assert common_name_of(der) == common_name_of(ca_pem) == "the-ca"
    with pytest.raises(ValueError, match="not a DER or PEM certificate"):
        common_name_of(b"garbage")


# --- TLS contexts: files -----------------------------------------------------------------------


def test_context_files_that_are_missing_or_wrong_are_named_not_shown(tmp_path, tls_files):
    secret_looking = tmp_path / "wrong.pem"
    secret_looking.write_text("SECRET-CONTENT-NOT-A-CERTIFICATE\n")
    cases = [
        (lambda: server_context(tmp_path / "absent.pem", tls_files["server.key.pem"]), ["absent.pem", "no such file"]),
        (lambda: server_context(tls_files["server.cert.pem"], tmp_path), ["is a directory"]),
        (lambda: server_context(secret_looking, tls_files["server.key.pem"]), ["wrong.pem", "not a PEM certificate"]),
        (lambda: server_context(tls_files["server.cert.pem"], tls_files["admin.key.pem"]), ["does not belong"]),
        (lambda: server_context(tls_files["server.cert.pem"], tls_files["server.key.pem"], secret_looking),
         ["trusted certificates file", "wrong.pem"]),
        (lambda: server_context(tls_files["server.cert.pem"], tls_files["server.key.pem"], require_client_cert=True),
         ["trusted certificates file"]),
        (lambda: client_context(tmp_path / "absent-ca.pem"), ["absent-ca.pem", "no such file"]),
        (lambda: client_context(key_file=tls_files["admin.key.pem"]), ["needs its certificate file"]),
    ]
    for make, words in cases:
        with pytest.raises(ValueError) as error:
            make()
        for word in words:
            assert word in str(error.value), str(error.value)
        assert "SECRET-CONTENT" not in str(error.value)


def test_contexts_are_tls_1_2_or_later(tls_files):
    server = server_context(tls_files["server.cert.pem"], tls_files["server.key.pem"], tls_files["ca.cert.pem"])
    client = client_context(tls_files["ca.cert.pem"])
    assert server.minimum_version == client.minimum_version == ssl.TLSVersion.TLSv1_2
    assert server.verify_mode == ssl.CERT_OPTIONAL
    assert client.verify_mode == ssl.CERT_REQUIRED and client.check_hostname


# --- TLS: real handshakes ----------------------------------------------------------------------


def handshake(server: ssl.SSLContext, client: ssl.SSLContext, server_hostname: str | None) -> dict:
    """Connect a client to a server over a socket pair, each side in its own
    thread; what each side saw: the role the server read, what the client
    received, and the error of either side."""
    server_socket, client_socket = socket.socketpair()
    for each in (server_socket, client_socket):
        each.settimeout(HANDSHAKE_TIMEOUT_S)
    seen: dict = {"role": None, "received": None, "server_error": None, "client_error": None}

    def serve() -> None:
        try:
            with server.wrap_socket(server_socket, server_side=True) as connection:
                seen["role"] = peer_common_name(connection)
                connection.sendall(b"hello")
        except (ssl.SSLError, OSError) as error:
            seen["server_error"] = error

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        with client.wrap_socket(client_socket, server_hostname=server_hostname) as connection:
            received = connection.recv(5)
            # TLS 1.3: a client learns only here that the server refused its
            # certificate (the server's alert, or the connection closed).
            seen["received"] = received
    except (ssl.SSLError, OSError) as error:
        seen["client_error"] = error
    finally:
        thread.join(HANDSHAKE_TIMEOUT_S)
    assert not thread.is_alive(), "the server side of the handshake did not finish"
    return seen


def test_a_client_certificate_authenticates_as_its_common_name(tls_files):
    server = server_context(tls_files["server.cert.pem"], tls_files["server.key.pem"], tls_files["ca.cert.pem"])
    client = client_context(tls_files["ca.cert.pem"], cert_file=tls_files["admin.cert.pem"], key_file=tls_files["admin.key.pem"])
    seen = handshake(server, client, "127.0.0.1")
    assert seen == {"role": "admin", "received": b"hello", "server_error": None, "client_error": None}


def test_a_client_without_a_certificate_has_no_role_when_optional(tls_files):
    server = server_context(tls_files["server.cert.pem"], tls_files["server.key.pem"], tls_files["ca.cert.pem"])
    seen = handshake(server, client_context(tls_files["ca.cert.pem"]), "localhost")
    assert seen == {"role": None, "received": b"hello", "server_error": None, "client_error": None}


def test_a_server_without_trusted_certificates_asks_for_none(tls_files):
    server = server_context(tls_files["server.cert.pem"], tls_files["server.key.pem"])
    client = client_context(tls_files["ca.cert.pem"], cert_file=tls_files["admin.cert.pem"], key_file=tls_files["admin.key.pem"])
    assert handshake(server, client, "127.0.0.1")["role"] is None


@pytest.mark.parametrize("require", [False, True], ids=["optional", "required"])
def test_an_untrusted_client_certificate_is_refused(tls_files, stranger_files, require):
    # Signed by another CA, with the same common name: it must not pass as admin.
    server = server_context(tls_files["server.cert.pem"], tls_files["server.key.pem"], tls_files["ca.cert.pem"],
                            require_client_cert=require)
    client = client_context(tls_files["ca.cert.pem"], cert_file=stranger_files["admin.cert.pem"],
                            key_file=stranger_files["admin.key.pem"])
    seen = handshake(server, client, "127.0.0.1")
    assert isinstance(seen["server_error"], ssl.SSLError) and seen["role"] is None
    assert seen["received"] in (None, b"")


def test_a_required_client_certificate_that_is_missing_is_refused(tls_files):
    server = server_context(tls_files["server.cert.pem"], tls_files["server.key.pem"], tls_files["ca.cert.pem"],
                            require_client_cert=True)
    seen = handshake(server, client_context(tls_files["ca.cert.pem"]), "127.0.0.1")
    assert isinstance(seen["server_error"], ssl.SSLError) and seen["received"] in (None, b"")


def test_the_server_name_is_checked_against_its_subject_alternative_names(tls_files):
    server = server_context(tls_files["server.cert.pem"], tls_files["server.key.pem"])
    trusting = client_context(tls_files["ca.cert.pem"])
    assert handshake(server, trusting, "127.0.0.1")["received"] == b"hello"
    for wrong_name in ("10.0.0.1", "other.example"):
        seen = handshake(server, trusting, wrong_name)
        assert isinstance(seen["client_error"], ssl.SSLCertVerificationError), seen
        assert "mismatch" in str(seen["client_error"]) or "match" in str(seen["client_error"])
    unchecked = client_context(tls_files["ca.cert.pem"], verify_hostname=False)
    assert handshake(server, unchecked, "other.example")["received"] == b"hello"


def test_a_server_of_another_ca_is_refused_unless_insecure(tls_files, stranger_files):
    server = server_context(stranger_files["server.cert.pem"], stranger_files["server.key.pem"])
    seen = handshake(server, client_context(tls_files["ca.cert.pem"]), "127.0.0.1")
    assert isinstance(seen["client_error"], ssl.SSLCertVerificationError), seen
    # Even without the name check the chain is checked.
    seen = handshake(server, client_context(tls_files["ca.cert.pem"], verify_hostname=False), "127.0.0.1")
    assert isinstance(seen["client_error"], ssl.SSLCertVerificationError), seen
    assert handshake(server, client_context(allow_insecure=True), "127.0.0.1")["received"] == b"hello"
