"""Who a client is, from what it presents: a token (its `sub` claim), a
trusted TLS client certificate (its CN), or nothing (the anonymous role, if
one is set), as Pulsar's token and TLS authentication providers decide.
Pure: the time comes in as `now`; the peer's certificate CN comes in read.
"""

from __future__ import annotations

from dataclasses import dataclass

from security.tokens import AuthenticationError, TokenValidator

TOKEN_METHOD = "token"
TLS_METHOD = "tls"
NO_METHODS = ("", "none")
METHOD_CHARS_MAX = 64


@dataclass(frozen=True)
class Principal:
    """An authenticated client: its role, and when its credentials expire
    (None: never, or authentication is off)."""

    role: str | None
    method: str
    expires_at: float | None = None


ANONYMOUS_WHEN_OFF = Principal(None, "none")


@dataclass(frozen=True)
class Authenticator:
    """`tokens`: validates tokens (None: tokens are not taken).
    `tls_certificates`: a client certificate the TLS layer verified
    authenticates as its CN. `anonymous_role`: the role of a client that
    presents nothing (None: such a client is refused)."""

    tokens: TokenValidator | None = None
    tls_certificates: bool = False
    anonymous_role: str | None = None

    @property
    def enabled(self) -> bool:
        return self.tokens is not None or self.tls_certificates

    def authenticate(self, method: str | None, data: bytes | str | None, *, peer_common_name: str | None,
                     now: float) -> Principal:
        """The principal of a client that presents `data` by `method`, or
        AuthenticationError (whose message never holds the credentials)."""
        if not self.enabled:
            return ANONYMOUS_WHEN_OFF
        method = (method or "").strip().lower()
        if len(method) > METHOD_CHARS_MAX:
            raise AuthenticationError(f"an authentication method name holds at most {METHOD_CHARS_MAX} characters")
        if method == TOKEN_METHOD or (method in NO_METHODS and data):
            if self.tokens is None:
                raise AuthenticationError("this server does not take tokens (no token key is configured)")
            claims = self.tokens.validate(data if data is not None else b"", now=now)
            return Principal(claims.role, TOKEN_METHOD, claims.expires_at)
        if method == TLS_METHOD or method in NO_METHODS:
            if self.tls_certificates and peer_common_name:
                return Principal(peer_common_name, TLS_METHOD)
            if method == TLS_METHOD:
                raise AuthenticationError("TLS authentication needs a client certificate signed by a trusted CA")
            if self.anonymous_role is not None:
                return Principal(self.anonymous_role, "anonymous")
            raise AuthenticationError("this server needs credentials: a token, or a trusted client certificate")
        raise AuthenticationError(f"unknown authentication method {method!r}: this server takes token and tls")

    def refresh(self, principal: Principal, data: bytes | str | None, *, now: float) -> Principal:
        """A fresh token for a connection that authenticated with one: it must
        name the same role (a connection does not change whom it serves)."""
        renewed = self.authenticate(TOKEN_METHOD, data, peer_common_name=None, now=now)
        if renewed.role != principal.role:
            raise AuthenticationError("a refreshed token must name the connection's role")
        return renewed


class RefusalLog:
    """At most one log line a second about refused credentials, with a count
    of those not logged: a client retrying a bad token in a loop must not
    flood a server's log. Time comes in as `now_s`."""

    def __init__(self, interval_s: float = 1.0) -> None:
        self.interval_s = interval_s
        self._logged_s = -float("inf")
        self._suppressed = 0

    def allows(self, now_s: float) -> bool:
        if now_s - self._logged_s < self.interval_s:
            self._suppressed += 1
            return False
        self._logged_s = now_s
        return True

    def take_suppressed(self) -> int:
        suppressed, self._suppressed = self._suppressed, 0
        return suppressed


__all__ = ["ANONYMOUS_WHEN_OFF", "RefusalLog", "Authenticator", "Principal", "TLS_METHOD", "TOKEN_METHOD"]
