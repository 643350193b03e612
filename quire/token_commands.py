"""`quire token create-secret-key|create-key-pair|create|show|validate`: the
keys and tokens of token authentication, as Pulsar's `pulsar tokens` tool
makes and checks them. Nothing here talks to a cluster.
"""

from __future__ import annotations

import argparse
import base64
import datetime
import json
import sys
import time
from pathlib import Path

from quire.cli_parsing import Bounded, UsageError
from quire.cli_ranges import AGE_MS_MAX
from security.tokens import (
    TOKEN_BYTES_MAX,
    AuthenticationError,
    Claims,
    TokenValidator,
    create_key_pair,
    create_secret_key,
    create_token,
    load_key_argument,
    show_token,
    write_key_file,
)

# A token that outlives the people who made it is a token nobody will revoke.
token_expiry = Bounded("duration", 0, AGE_MS_MAX, low_open=True, why="a hundred years")
# A token file holds one token and perhaps a newline: read a little past the
# limit, so that an oversized token is refused by the validator's own check.
TOKEN_FILE_BYTES_MAX = TOKEN_BYTES_MAX + 1024
KEY_HELP = "a file, file:///path, or data:;base64,<key>"


# --- arguments -----------------------------------------------------------------------


def add_create_secret_key(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--output", "-o", type=Path, metavar="FILE",
                        help="write the key here, mode 0600 (default: print it as base64)")
    parser.add_argument("--base64", action="store_true", help="write the file as base64 text instead of the 32 raw bytes")


def add_create_key_pair(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--private-key", type=Path, required=True, metavar="FILE", help="where the private key goes (mode 0600)")
    parser.add_argument("--public-key", type=Path, required=True, metavar="FILE", help="where the public key goes")


def _add_token_source(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("token", nargs="?", metavar="TOKEN", help="the token (or give --token-file)")
    parser.add_argument("--token-file", type=Path, metavar="FILE", help="read the token from this file instead")


def add_create(parser: argparse.ArgumentParser) -> None:
    keys = parser.add_mutually_exclusive_group(required=True)
    keys.add_argument("--secret-key", metavar="KEY", help=f"sign with this HS256 secret: {KEY_HELP}")
    keys.add_argument("--private-key", metavar="KEY", help=f"sign with this RSA (RS256) or EC (ES256) private key: {KEY_HELP}")
    parser.add_argument("--subject", required=True, metavar="ROLE", help="the role the token authenticates as")
    parser.add_argument("--expiry", type=token_expiry, metavar="DURATION",
                        help="the token expires this long from now, e.g. 30m, 1h, 7d (default: never)")
    parser.add_argument("--audience", metavar="AUDIENCE", help="the token's audience (aud claim)")


def add_show(parser: argparse.ArgumentParser) -> None:
    _add_token_source(parser)


def add_validate(parser: argparse.ArgumentParser) -> None:
    _add_token_source(parser)
    keys = parser.add_mutually_exclusive_group(required=True)
    keys.add_argument("--secret-key", metavar="KEY", help=f"the HS256 secret the token was signed with: {KEY_HELP}")
    keys.add_argument("--public-key", metavar="KEY", help=f"the public key of the token's private key: {KEY_HELP}")
    parser.add_argument("--audience", metavar="AUDIENCE", help="refuse tokens not for this audience (default: any)")


# --- commands -------------------------------------------------------------------------


def create_secret_key_command(arguments: argparse.Namespace) -> int:
    key = create_secret_key()
    if arguments.output is None:
        print(base64.b64encode(key).decode("ascii"))
        return 0
    _refuse_existing(arguments.output)
    _write(arguments.output, base64.b64encode(key) + b"\n" if arguments.base64 else key, mode=0o600)
    return 0


def create_key_pair_command(arguments: argparse.Namespace) -> int:
    if arguments.private_key.resolve() == arguments.public_key.resolve():
        raise UsageError("--private-key and --public-key name the same file")
    # Both checked before either is written: no half of a pair left behind.
    _refuse_existing(arguments.private_key)
    _refuse_existing(arguments.public_key)
    private_pem, public_pem = create_key_pair()
    _write(arguments.private_key, private_pem, mode=0o600)
    _write(arguments.public_key, public_pem, mode=0o644)
    return 0


def create_command(arguments: argparse.Namespace) -> int:
    keys = {"secret_key": _key(arguments.secret_key, "--secret-key")} if arguments.secret_key is not None else {
        "private_key": _key(arguments.private_key, "--private-key")}
    expiry_s = arguments.expiry / 1000 if arguments.expiry is not None else None
    try:
        token = create_token(arguments.subject, now=time.time(), expiry_s=expiry_s, audience=arguments.audience, **keys)
    except (ValueError, TypeError) as error:
        raise UsageError(str(error)) from None
    print(token)
    return 0


def show_command(arguments: argparse.Namespace) -> int:
    try:
        shown = show_token(_token(arguments))
    except AuthenticationError as error:
        raise UsageError(f"not a token: {error}") from None
    print(json.dumps(shown, indent=2))
    return 0


def validate_command(arguments: argparse.Namespace) -> int:
    token = _token(arguments)
    try:
        if arguments.secret_key is not None:
            validator = TokenValidator(secret_key=_key(arguments.secret_key, "--secret-key"), audience=arguments.audience)
        else:
            validator = TokenValidator(public_key=_key(arguments.public_key, "--public-key"), audience=arguments.audience)
    except (ValueError, TypeError) as error:
        raise UsageError(str(error)) from None
    try:
        claims = validator.validate(token, now=time.time())
    except AuthenticationError as error:
        print(f"token refused: {error}", file=sys.stderr)
        return 1
    print(_describe(claims))
    return 0


# --- helpers --------------------------------------------------------------------------


def _key(text: str, flag: str) -> bytes:
    try:
        return load_key_argument(text)
    except ValueError as error:
        raise UsageError(f"{flag}: {error}") from None


def _token(arguments: argparse.Namespace) -> str:
    """The token from the command line or from --token-file, exactly one."""
    if (arguments.token is None) == (arguments.token_file is None):
        raise UsageError("give the token or --token-file, exactly one of them")
    if arguments.token is not None:
        return arguments.token
    try:
        with open(arguments.token_file, "rb") as file:
            data = file.read(TOKEN_FILE_BYTES_MAX)
    except OSError as error:
        raise UsageError(f"--token-file {arguments.token_file}: {error.strerror or type(error).__name__}") from None
    # Pulsar's token files end with a newline more often than not.
    return data.strip().decode("ascii", "replace")


def _refuse_existing(path: Path) -> None:
    # A new key over an old one would make every token signed with the old
    # one fail to validate, with no way back.
    if path.exists() or path.is_symlink():
        raise UsageError(f"{path} exists: not replacing a key (remove it first)")


def _write(path: Path, data: bytes, *, mode: int) -> None:
    try:
        write_key_file(path, data, mode=mode, exclusive=True)
    except OSError as error:
        raise UsageError(f"cannot write {path}: {error.strerror or type(error).__name__}") from None


def _describe(claims: Claims) -> str:
    lines = [f"role: {claims.role}", f"expires: {_when(claims.expires_at)}"]
    if claims.audience:
        lines.append(f"audience: {', '.join(claims.audience)}")
    return "\n".join(lines)


def _when(seconds: float | None) -> str:
    if seconds is None:
        return "never"
    try:
        moment = datetime.datetime.fromtimestamp(seconds, tz=datetime.UTC)
    except (OverflowError, ValueError, OSError):
        return f"{seconds:.0f} (seconds since 1970)"
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


__all__ = [
    "add_create",
    "add_create_key_pair",
    "add_create_secret_key",
    "add_show",
    "add_validate",
    "create_command",
    "create_key_pair_command",
    "create_secret_key_command",
    "show_command",
    "token_expiry",
    "validate_command",
]
