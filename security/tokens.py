"""JSON Web Tokens as Apache Pulsar's token authentication uses them: keys
(an HS256 secret, an RS256 key pair), making a token for a role, and
checking one. Pure but for reading and writing key files: keys and tokens
come in as bytes, the time as `now`.
"""

from __future__ import annotations

import base64
import binascii
import math
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

# PyJWT and `cryptography` are imported where they are used: a server with
# token authentication off never loads them (about 10 MB of its memory).
if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric import ec, rsa

# A longer token is refused before it is decoded: Pulsar's tokens are a few
# hundred bytes, and decoding costs memory and time in the token's length.
TOKEN_BYTES_MAX = 16 * 1024
# A key file longer than this is not a key (an RSA 8192 PEM is about 6 KiB).
KEY_FILE_BYTES_MAX = 64 * 1024
SECRET_KEY_BYTES = 32  # what `pulsar tokens create-secret-key` makes for HS256
# RFC 7518 section 3.2: an HMAC key must be at least as long as the hash.
# jjwt, which Pulsar uses, refuses shorter keys the same way.
SECRET_KEY_BYTES_MIN = 32
RSA_KEY_BITS = 2048
RSA_KEY_BITS_MIN = 2048
# The same rule as broker.authorization's roles: a token's subject is the
# role it authenticates as, and roles are logged and stored.
ROLE_CHARS_MAX = 256

_HMAC_ALGORITHMS = {"HS256": 32, "HS384": 48, "HS512": 64}  # name: key bytes at least
_RSA_ALGORITHMS = ("RS256", "RS384", "RS512")
_EC_ALGORITHMS = {"secp256r1": "ES256", "secp384r1": "ES384", "secp521r1": "ES512"}
# Algorithm names an error message may repeat: anything else in a header is
# the sender's text, and a message never echoes that.
_KNOWN_ALGORITHMS = {*_HMAC_ALGORITHMS, *_RSA_ALGORITHMS, *_EC_ALGORITHMS.values(),
                     "PS256", "PS384", "PS512", "EdDSA"}


class AuthenticationError(Exception):
    """A token was refused. The message says why in words of ours: it is
    safe to log and to send to the client, and never holds the token or a key."""


@dataclass(frozen=True)
class Claims:
    """What a valid token says: the role it authenticates as, when it
    expires (seconds since the epoch, None for never) and its audiences."""

    role: str
    expires_at: float | None
    audience: tuple[str, ...] = ()


# --- keys -------------------------------------------------------------------------


def create_secret_key() -> bytes:
    """A new HS256 secret: 32 random bytes, as `pulsar tokens create-secret-key`."""
    return secrets.token_bytes(SECRET_KEY_BYTES)


def create_key_pair() -> tuple[bytes, bytes]:
    """A new RSA key pair for RS256: (private key PEM, PKCS8 unencrypted;
    public key PEM, SubjectPublicKeyInfo), as `pulsar tokens create-key-pair`."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    private_key = rsa.generate_private_key(public_exponent=65537, key_size=RSA_KEY_BITS)
    private_pem = private_key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                            serialization.NoEncryption())
    public_pem = private_key.public_key().public_bytes(serialization.Encoding.PEM,
                                                       serialization.PublicFormat.SubjectPublicKeyInfo)
    return private_pem, public_pem


def load_key(path: str | os.PathLike) -> bytes:
    """The bytes of a key file (a raw secret or a PEM); ValueError names the
    file, never its content, when it is missing, unreadable, empty or too long."""
    path = Path(path)
    try:
        with open(path, "rb") as file:
            data = file.read(KEY_FILE_BYTES_MAX + 1)
    except FileNotFoundError:
        raise ValueError(f"key file {path}: no such file") from None
    except IsADirectoryError:
        raise ValueError(f"key file {path}: is a directory") from None
    except OSError as error:
        raise ValueError(f"key file {path}: cannot be read ({error.strerror or type(error).__name__})") from None
    if not data:
        raise ValueError(f"key file {path} is empty")
    if len(data) > KEY_FILE_BYTES_MAX:
        raise ValueError(f"key file {path} is longer than {KEY_FILE_BYTES_MAX} bytes: not a key")
    return data


def load_key_argument(text: str) -> bytes:
    """A key as Pulsar's settings name one: `file:///path`, `data:;base64,...`
    (a media type may come before `;base64`), or a plain path."""
    if text.startswith("data:"):
        media_type, separator, encoded = text[len("data:"):].partition(",")
        if not separator or not media_type.endswith(";base64"):
            raise ValueError("a data: key is data:;base64,<base64 of the key>")
        try:
            data = base64.b64decode(encoded, validate=True)
        except (binascii.Error, ValueError):
            raise ValueError("the data: key is not valid base64") from None
        if not data:
            raise ValueError("the data: key is empty")
        return data
    if text.startswith("file://"):
        path = text[len("file://"):]
        if not path.startswith("/"):
            raise ValueError("a file: key is file:///absolute/path")
        return load_key(path)
    if not text:
        raise ValueError("no key file given")
    return load_key(text)


def write_key_file(path: str | os.PathLike, data: bytes, *, mode: int = 0o600, exclusive: bool = False) -> Path:
    """Write a key (or certificate) file readable by its owner only (mode
    0600) unless `mode` says otherwise. With `exclusive`, an existing file
    is an error (FileExistsError) rather than a key silently replaced."""
    path = Path(path)
    flags = os.O_WRONLY | os.O_CREAT | (os.O_EXCL if exclusive else os.O_TRUNC)
    descriptor = os.open(path, flags, mode)
    with os.fdopen(descriptor, "wb") as file:
        # The mode of os.open applies to a new file only: an existing file
        # overwritten keeps its mode unless it is set again here.
        os.fchmod(file.fileno(), mode)
        file.write(data)
    return path


def _check_secret_key(secret_key: Any) -> bytes:
    if not isinstance(secret_key, bytes):
        raise TypeError(f"secret_key must be bytes, not {type(secret_key).__name__}")
    if secret_key.lstrip().startswith(b"-----BEGIN") or secret_key.startswith((b"ssh-", b"ecdsa-")):
        # The classic confusion: a public key used as an HMAC secret would let
        # anyone who has it sign tokens.
        raise ValueError("secret_key is a PEM or SSH key, not a secret: give a public key as public_key")
    if len(secret_key) < SECRET_KEY_BYTES_MIN:
        raise ValueError(f"secret_key must be at least {SECRET_KEY_BYTES_MIN} bytes, got {len(secret_key)}")
    return secret_key


def _load_private_key(private_key: Any) -> tuple[rsa.RSAPrivateKey | ec.EllipticCurvePrivateKey, str]:
    """The key object and the algorithm it signs with."""
    if not isinstance(private_key, bytes):
        raise TypeError(f"private_key must be bytes (a PEM), not {type(private_key).__name__}")
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives import serialization

    try:
        key = serialization.load_pem_private_key(private_key, password=None)
    except (ValueError, TypeError, UnsupportedAlgorithm):
        raise ValueError("private_key is not an unencrypted PEM private key") from None
    return key, _algorithms_of(key)[0]


def _load_public_key(public_key: Any) -> tuple[rsa.RSAPublicKey | ec.EllipticCurvePublicKey, tuple[str, ...]]:
    """The key object and the algorithms it verifies."""
    if not isinstance(public_key, bytes):
        raise TypeError(f"public_key must be bytes (a PEM), not {type(public_key).__name__}")
    if b"PRIVATE KEY-----" in public_key:
        raise ValueError("public_key is a private key: give the public key (quire token create-key-pair writes both)")
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives import serialization

    try:
        key = serialization.load_pem_public_key(public_key)
    except (ValueError, TypeError, UnsupportedAlgorithm):
        raise ValueError("public_key is not a PEM public key (-----BEGIN PUBLIC KEY-----)") from None
    return key, _algorithms_of(key)


def _algorithms_of(key: Any) -> tuple[str, ...]:
    """The signature algorithms a key takes part in, RSA or EC only."""
    from cryptography.hazmat.primitives.asymmetric import ec, rsa

    if isinstance(key, (rsa.RSAPrivateKey, rsa.RSAPublicKey)):
        if key.key_size < RSA_KEY_BITS_MIN:
            raise ValueError(f"an RSA key must have at least {RSA_KEY_BITS_MIN} bits, this one has {key.key_size}")
        return _RSA_ALGORITHMS
    if isinstance(key, (ec.EllipticCurvePrivateKey, ec.EllipticCurvePublicKey)):
        if key.curve.name not in _EC_ALGORITHMS:
            raise ValueError(f"an EC key must be on P-256, P-384 or P-521, not {key.curve.name}")
        return (_EC_ALGORITHMS[key.curve.name],)
    raise ValueError(f"the key is neither RSA nor EC ({type(key).__name__}): tokens are signed with RS256 or ES256")


# --- making a token ---------------------------------------------------------------


def create_token(subject: str, *, secret_key: bytes | None = None, private_key: bytes | None = None, now: float,
                 expiry_s: float | None = None, audience: str | None = None,
                 headers: dict[str, Any] | None = None) -> str:
    """A token for the role `subject`, signed HS256 with `secret_key` or
    RS256 (ES256 for an EC key) with the PEM `private_key`: exactly one.
    It expires `expiry_s` after `now` when given, and names `audience`."""
    if not isinstance(subject, str):
        raise TypeError(f"subject must be a string, not {type(subject).__name__}")
    if not subject or len(subject) > ROLE_CHARS_MAX or not subject.isprintable():
        raise ValueError(f"subject must be a role: 1-{ROLE_CHARS_MAX} printable characters")
    if (secret_key is None) == (private_key is None):
        raise ValueError("give exactly one of secret_key and private_key")
    if not isinstance(now, (int, float)) or not math.isfinite(now):
        raise ValueError("now must be a finite number of seconds")
    claims: dict[str, Any] = {"sub": subject}
    if expiry_s is not None:
        if not isinstance(expiry_s, (int, float)) or not math.isfinite(expiry_s) or expiry_s <= 0:
            raise ValueError("expiry_s must be a positive finite number of seconds")
        claims["exp"] = int(now + expiry_s)
    if audience is not None:
        if not isinstance(audience, str) or not audience:
            raise ValueError("audience must be a non-empty string")
        claims["aud"] = audience
    if headers is not None and (not isinstance(headers, dict) or "alg" in headers):
        raise ValueError("headers must be a dict without 'alg' (the key decides the algorithm)")
    if secret_key is not None:
        key: Any = _check_secret_key(secret_key)
        algorithm = "HS256"
    else:
        key, algorithm = _load_private_key(private_key)
    import jwt

    return jwt.encode(claims, key, algorithm=algorithm, headers=headers)


# --- checking a token ---------------------------------------------------------------


class TokenValidator:
    """Checks tokens against one key: an HS256/384/512 secret, or an RSA (or
    EC) public key. The algorithms come from the key, never from the token,
    so a token cannot choose `none` or use a public key as an HMAC secret."""

    def __init__(self, *, secret_key: bytes | None = None, public_key: bytes | None = None,
                 audience: str | None = None, leeway_s: float = 0) -> None:
        if (secret_key is None) == (public_key is None):
            raise ValueError("give exactly one of secret_key and public_key")
        if audience is not None and (not isinstance(audience, str) or not audience):
            raise ValueError("audience must be a non-empty string or None")
        if not isinstance(leeway_s, (int, float)) or not math.isfinite(leeway_s) or leeway_s < 0:
            raise ValueError("leeway_s must be a finite number of seconds, at least 0")
        self._key: Any
        if secret_key is not None:
            self._key = _check_secret_key(secret_key)
            # Only the HMACs whose hash the secret is as long as (RFC 7518).
            self.algorithms = tuple(name for name, key_bytes in _HMAC_ALGORITHMS.items() if len(secret_key) >= key_bytes)
        else:
            self._key, self.algorithms = _load_public_key(public_key)
        self.audience = audience
        self.leeway_s = float(leeway_s)

    def validate(self, token: str | bytes, *, now: float) -> Claims:
        """The claims of a valid token at time `now`; AuthenticationError with
        the reason otherwise. No other exception leaves, whatever the token."""
        if isinstance(now, bool) or not isinstance(now, (int, float)) or not math.isfinite(now):
            # A NaN `now` would compare false with every expiry: a caller's
            # bug that would accept expired tokens, so it is not let through.
            raise ValueError("now must be a finite number of seconds")
        token = _checked_bytes(token)
        header = _unverified_header(token)
        algorithm = header.get("alg")
        if not isinstance(algorithm, str) or not algorithm:
            raise AuthenticationError("the token's header names no algorithm (alg)")
        if algorithm.lower() == "none":
            raise AuthenticationError("unsigned token (alg none) refused")
        if algorithm not in self.algorithms:
            named = algorithm if algorithm in _KNOWN_ALGORITHMS else "of the token"
            raise AuthenticationError(f"algorithm {named} not accepted: this key verifies {', '.join(self.algorithms)}")
        import jwt

        try:
            claims = jwt.decode(token, self._key, algorithms=list(self.algorithms), options={
                # The claims that need the time are checked below against
                # `now`, which tests and the simulator pass in; PyJWT would
                # read the wall clock. So is the audience, whose rules are
                # Pulsar's (a token's audience with none configured is fine).
                "verify_exp": False, "verify_nbf": False, "verify_iat": False, "verify_aud": False,
                "verify_iss": False, "verify_sub": False, "verify_jti": False,
            })
        except jwt.InvalidSignatureError:
            raise AuthenticationError("signature does not verify") from None
        except jwt.InvalidAlgorithmError:
            raise AuthenticationError("algorithm not accepted") from None
        except jwt.InvalidKeyError:
            raise AuthenticationError("the key does not fit the token's algorithm") from None
        except jwt.DecodeError:
            raise AuthenticationError("malformed token") from None
        except jwt.PyJWTError:
            raise AuthenticationError("invalid token") from None
        return self._check_claims(claims, now)

    def _check_claims(self, claims: dict[str, Any], now: float) -> Claims:
        role = claims.get("sub")
        if role is None:
            raise AuthenticationError("token has no subject (sub)")
        if not isinstance(role, str) or not role or len(role) > ROLE_CHARS_MAX or not role.isprintable():
            raise AuthenticationError(f"the subject (sub) is not a role: 1-{ROLE_CHARS_MAX} printable characters")
        expires_at = _time_claim(claims, "exp")
        if expires_at is not None and now >= expires_at + self.leeway_s:
            raise AuthenticationError("token expired")
        not_before = _time_claim(claims, "nbf")
        if not_before is not None and now + self.leeway_s < not_before:
            raise AuthenticationError("token not valid yet (nbf)")
        audiences = _audiences(claims)
        if self.audience is not None:
            if audiences is None:
                raise AuthenticationError("token has no audience (aud), and this server requires one")
            if self.audience not in audiences:
                raise AuthenticationError("token is for another audience")
        return Claims(role=role, expires_at=expires_at, audience=audiences or ())


def _checked_bytes(token: Any) -> bytes:
    """The token as ASCII bytes, refused before any decoding when it is not
    a string or bytes, empty, too long, or not ASCII."""
    if not isinstance(token, (str, bytes)):
        raise AuthenticationError("a token is a string")
    if not token:
        raise AuthenticationError("empty token")
    if len(token) > TOKEN_BYTES_MAX:
        raise AuthenticationError(f"token longer than {TOKEN_BYTES_MAX} bytes")
    if not token.isascii():
        raise AuthenticationError("token is not ASCII")
    return token.encode("ascii") if isinstance(token, str) else token


def _unverified_header(token: bytes) -> dict[str, Any]:
    import jwt

    try:
        return jwt.get_unverified_header(token)
    except jwt.PyJWTError:
        raise AuthenticationError("malformed token") from None


def _time_claim(claims: dict[str, Any], name: str) -> float | None:
    """A NumericDate claim as seconds, None when absent; a value that is not
    a finite number (JSON allows NaN here, and booleans are ints in
    Python) is refused rather than compared."""
    if name not in claims:
        return None
    value = claims[name]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise AuthenticationError(f"the {name} claim is not a number")
    try:
        seconds = float(value)
    except OverflowError:
        raise AuthenticationError(f"the {name} claim is out of range") from None
    if not math.isfinite(seconds):
        raise AuthenticationError(f"the {name} claim is out of range")
    return seconds


def _audiences(claims: dict[str, Any]) -> tuple[str, ...] | None:
    """The `aud` claim as a tuple (a string or a list of strings in JWT), None when absent."""
    if "aud" not in claims:
        return None
    value = claims["aud"]
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and all(isinstance(item, str) for item in value):
        return tuple(value)
    raise AuthenticationError("the aud claim is not a string or a list of strings")


# --- showing a token ------------------------------------------------------------------


def show_token(token: str | bytes) -> dict[str, Any]:
    """A token's header and claims, NOT verified (`quire token show`):
    {"header": {...}, "claims": {...}}. AuthenticationError if it is not a JWT."""
    token = _checked_bytes(token)
    header = _unverified_header(token)
    import jwt

    try:
        claims = jwt.decode(token, options={"verify_signature": False})
    except jwt.PyJWTError:
        raise AuthenticationError("malformed token") from None
    return {"header": header, "claims": claims}


__all__ = [
    "KEY_FILE_BYTES_MAX",
    "ROLE_CHARS_MAX",
    "SECRET_KEY_BYTES",
    "TOKEN_BYTES_MAX",
    "AuthenticationError",
    "Claims",
    "TokenValidator",
    "create_key_pair",
    "create_secret_key",
    "create_token",
    "load_key",
    "load_key_argument",
    "show_token",
    "write_key_file",
]
