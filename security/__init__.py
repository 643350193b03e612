"""Authentication for quire's servers, as Apache Pulsar's: JSON Web Tokens
(`security.tokens`), a small certificate authority (`security.certificates`)
and TLS contexts with client certificates (`security.tls`).
"""

import importlib

# Where each name lives: imported on first use (PEP 562), so a process that
# needs one part (a server's TLS contexts, say) does not load the others'
# libraries (PyJWT, `cryptography`'s X.509).
_HOMES = {
    "certificates": ("SERVER_COMMON_NAME", "common_name_of", "create_ca", "create_certificate", "write_tls_files"),
    "tls": ("TLS_VERSION_MIN", "client_context", "peer_common_name", "server_context"),
    "tokens": ("KEY_FILE_BYTES_MAX", "ROLE_CHARS_MAX", "SECRET_KEY_BYTES", "TOKEN_BYTES_MAX", "AuthenticationError",
               "Claims", "TokenValidator", "create_key_pair", "create_secret_key", "create_token", "load_key",
               "load_key_argument", "show_token", "write_key_file"),
}
_HOME_OF = {name: module for module, names in _HOMES.items() for name in names}


def __getattr__(name: str):
    module = _HOME_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'security' has no attribute {name!r}")
    return getattr(importlib.import_module(f"security.{module}"), name)


__all__ = [
    "KEY_FILE_BYTES_MAX",
    "ROLE_CHARS_MAX",
    "SECRET_KEY_BYTES",
    "SERVER_COMMON_NAME",
    "TLS_VERSION_MIN",
    "TOKEN_BYTES_MAX",
    "AuthenticationError",
    "Claims",
    "TokenValidator",
    "client_context",
    "common_name_of",
    "create_ca",
    "create_certificate",
    "create_key_pair",
    "create_secret_key",
    "create_token",
    "load_key",
    "load_key_argument",
    "peer_common_name",
    "server_context",
    "show_token",
    "write_key_file",
    "write_tls_files",
]
