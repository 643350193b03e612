"""Authentication for quire's servers, as Apache Pulsar's: JSON Web Tokens
(`security.tokens`), a small certificate authority (`security.certificates`)
and TLS contexts with client certificates (`security.tls`).
"""

from security.certificates import (
    SERVER_COMMON_NAME,
    common_name_of,
    create_ca,
    create_certificate,
    write_tls_files,
)
from security.tls import (
    TLS_VERSION_MIN,
    client_context,
    peer_common_name,
    server_context,
)
from security.tokens import (
    KEY_FILE_BYTES_MAX,
    ROLE_CHARS_MAX,
    SECRET_KEY_BYTES,
    TOKEN_BYTES_MAX,
    AuthenticationError,
    Claims,
    TokenValidator,
    create_key_pair,
    create_secret_key,
    create_token,
    load_key,
    load_key_argument,
    show_token,
    write_key_file,
)

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
