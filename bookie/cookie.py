"""Bookie identity cookies: one in ZooKeeper, one in each directory.

A bookie whose directories were wiped or swapped would rejoin having forgotten
its entries and, worse, its fence bits, which breaks recovery. So on start the
cookies must agree, and a bookie that finds otherwise refuses to start until
an operator formats it as a new bookie (`quire bookie format`).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from bookie.durable_files import write_file_atomically

COOKIE_FILE = "COOKIE"
COOKIE_LAYOUT_VERSION = 1
# Entries a fresh directory may hold without counting as "used".
_IGNORED_NAMES = {"lost+found", COOKIE_FILE, COOKIE_FILE + ".tmp"}


class CookieError(Exception):
    """The bookie must not start: the message says why and what to do."""


@dataclass(frozen=True)
class Cookie:
    instance_id: str
    bookie_id: str
    journal_dir: str
    ledger_dir: str
    layout_version: int = COOKIE_LAYOUT_VERSION

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode() + b"\n"

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> "Cookie":
        try:
            fields = json.loads(data)
            return cls(**fields)
        except (ValueError, TypeError) as error:
            raise CookieError(f"cookie in {where} is unreadable ({error}); refusing to start") from None

    def differences(self, other: "Cookie") -> list[str]:
        return [
            f"{name} {getattr(other, name)!r} instead of {getattr(self, name)!r}"
            for name in ("instance_id", "bookie_id", "journal_dir", "ledger_dir", "layout_version")
            if getattr(self, name) != getattr(other, name)
        ]


def read_directory_cookie(directory: Path) -> Cookie | None:
    path = Path(directory) / COOKIE_FILE
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as error:
        raise CookieError(f"cannot read the cookie {path}: {error.strerror}; refusing to start") from None
    return Cookie.from_bytes(data, str(path))


def write_directory_cookie(directory: Path, cookie: Cookie) -> None:
    write_file_atomically(Path(directory) / COOKIE_FILE, cookie.to_bytes())


def directory_is_empty(directory: Path) -> bool:
    return all(name in _IGNORED_NAMES for name in os.listdir(directory))


FORMAT_HINT = (
    "If the bookie really is meant to start over, first make sure its ledgers are re-replicated, then run "
    "`quire bookie format --bookie-id {bookie_id} --journal-dir ... --ledger-dir ... --force` and start it again."
)


def check_cookies(
    expected: Cookie,
    registered: Cookie | None,
    directory_cookies: dict[str, Cookie | None],
    directories_empty: dict[str, bool],
) -> bool:
    """Decide whether the bookie may start. Return True when it is new (the
    caller writes the cookies), False when everything matches; raise
    CookieError otherwise."""
    hint = FORMAT_HINT.format(bookie_id=expected.bookie_id)
    present = {directory: cookie for directory, cookie in directory_cookies.items() if cookie is not None}
    for directory, cookie in present.items():
        differences = expected.differences(cookie)
        if differences:
            raise CookieError(
                f"directory {directory} belongs to another bookie or cluster (its cookie has "
                f"{'; '.join(differences)}): it was swapped or misconfigured; refusing to start. {hint}"
            )
    if registered is None:
        if present:
            raise CookieError(
                f"directories {', '.join(sorted(present))} hold a cookie of bookie {expected.bookie_id} but ZooKeeper "
                f"has none: the cluster metadata was reset or this is another cluster; refusing to start. {hint}"
            )
        used = sorted(directory for directory, empty in directories_empty.items() if not empty)
        if used:
            raise CookieError(
                f"directories {', '.join(used)} hold data but no cookie; refusing to start a new bookie on them. "
                "Empty them or point the bookie at empty directories."
            )
        return True
    differences = expected.differences(registered)
    if differences:
        raise CookieError(
            f"bookie {expected.bookie_id} is registered in ZooKeeper with a cookie that has {'; '.join(differences)}: "
            f"its directories changed; refusing to start. {hint}"
        )
    missing = sorted(directory for directory, cookie in directory_cookies.items() if cookie is None)
    if missing:
        raise CookieError(
            f"bookie {expected.bookie_id} is known to the cluster but directory {', '.join(missing)} has no cookie: "
            "it was wiped or replaced. A bookie that lost its data has also lost its fence bits and would break "
            f"ledger recovery, so it refuses to start. {hint}"
        )
    return False
