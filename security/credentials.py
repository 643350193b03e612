"""What a client shows the servers it connects to: a token (or a function
giving the current one) and a TLS context (the servers' CA, and a client
certificate if it holds one). One type for the broker's client and the
ledger client's connections to bookies.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from typing import Callable

from security.authentication import TOKEN_METHOD


@dataclass(frozen=True)
class ClientCredentials:
    token: str | Callable[[], str] | None = None
    tls_context: ssl.SSLContext | None = None

    def current_token(self) -> str | None:
        """The token to show now (a function is asked again each time)."""
        token = self.token() if callable(self.token) else self.token
        return token or None

    def auth_fields(self) -> tuple[str, bytes]:
        """(method, data) for a handshake: the token, or nothing (a TLS
        client certificate, if any, speaks for itself)."""
        token = self.current_token()
        return (TOKEN_METHOD, token.encode()) if token else ("", b"")


NO_CREDENTIALS = ClientCredentials()

__all__ = ["NO_CREDENTIALS", "ClientCredentials"]
