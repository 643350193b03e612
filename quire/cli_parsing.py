"""How the command line reads its arguments and refuses bad ones: the
argparse types (numbers with a range, `Bounded`, and the shared ranges of
each kind; HOST:PORT lists; broker listeners), the `Parser` whose errors
are one line and whose help shows each option's default and range, and
`UsageError`, which a command raises for what it finds wrong later (exit 2).
Every command module builds on these; `quire.cli` puts the commands together.
"""

from __future__ import annotations

import argparse
import decimal
import math
import re
from typing import Callable

EXIT_USAGE = 2
INT64_MAX = 2**63 - 1  # what msgpack, ZooKeeper records and the JVM hold as a long
PORT_MAX = 65535
# A number written with more characters than this is refused before it is
# parsed (int() of thousands of digits is slow, and the error would echo it).
NUMBER_CHARACTERS_MAX = 64
_SIZE = re.compile(r"^\s*([+-]?\d+)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_SIZE_FACTORS = {"": 1, "b": 1, "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4}
_DURATION = re.compile(r"^\s*([+-]?\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$", re.IGNORECASE)
_DURATION_FACTORS_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}


class UsageError(Exception):
    """A command was given something it cannot use; exit 2 with the message."""


# --- parsing numbers, unbounded ---------------------------------------------------


def parse_integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {_shown(text)}") from None


def parse_size(text: str) -> int:
    """'4096', '64MiB', '1g' into bytes."""
    match = _SIZE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"not a size in bytes: {_shown(text)} (examples: 4096, 64MiB, 1GiB)")
    unit = (match.group(2) or "").lower().rstrip("b").rstrip("i")
    return int(match.group(1)) * _SIZE_FACTORS[unit]


def parse_duration_ms(text: str) -> int:
    """'500ms', '30s', '10m', '4h', '7d' (a bare number is seconds) into milliseconds."""
    match = _DURATION.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"not a duration: {_shown(text)} (examples: 500ms, 30s, 10m, 4h, 7d)")
    # Decimal, not float: '1e400'-sized values must be refused by the range,
    # not overflow float on the way.
    return int(decimal.Decimal(match.group(1)) * _DURATION_FACTORS_MS[(match.group(2) or "s").lower()])


def parse_number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {_shown(text)}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"not a finite number: {_shown(text)}")
    return value


def _parse_port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {_shown(text)}") from None
    if not 0 < value <= PORT_MAX:
        raise argparse.ArgumentTypeError(f"port must be in 1..{PORT_MAX}, got {value}")
    return value


def _parse_port_or_zero(text: str, zero_means: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {_shown(text)}") from None
    if not 0 <= value <= PORT_MAX:
        raise argparse.ArgumentTypeError(f"must be 0 ({zero_means}) or a port in 1..{PORT_MAX}, got {value}")
    return value


def _parse_metrics_port(text: str) -> int:
    """A port for Prometheus's /metrics, or 0 for none."""
    return _parse_port_or_zero(text, "no endpoint")


def _parse_listener_port(text: str) -> int:
    """A port for a listener, or 0 for none."""
    return _parse_port_or_zero(text, "no listener")


def _parse_fraction(text: str) -> float:
    value = parse_number(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return value


def _shown(text: str) -> str:
    """A value as an error message quotes it: never more than a short line."""
    if len(text) <= 40:
        return repr(text)
    return f"{text[:20]!r}... ({len(text)} characters)"


def human_size(value: int) -> str:
    """64 MiB as '64MiB': the largest unit that divides the value."""
    for unit, factor in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if value >= factor and value % factor == 0:
            return f"{value // factor}{unit}"
    return str(value)


def human_duration(value_ms: int) -> str:
    """300000 ms as '5m': the largest unit that divides the value."""
    for unit, factor in (("d", 86_400_000), ("h", 3_600_000), ("m", 60_000), ("s", 1000)):
        if value_ms >= factor and value_ms % factor == 0:
            return f"{value_ms // factor}{unit}"
    return f"{value_ms}ms"


# --- numbers with a range -----------------------------------------------------------


class Bounded:
    """An argparse type for a number with a range: the text is parsed as its
    `kind` says, then refused unless `low <= value <= high` (`low < value`
    with `low_open`). `why` says where the upper bound comes from; the
    message for a value past it says so. The kind also says how a bound or
    a default is written back (sizes as 64MiB, durations as 30s)."""

    KINDS = {
        "integer": (parse_integer, str),
        "number": (parse_number, lambda value: f"{value:g}"),
        "size": (parse_size, human_size),
        "duration": (parse_duration_ms, human_duration),
        "port": (_parse_port, str),
        "metrics port": (_parse_metrics_port, str),
        "listener port": (_parse_listener_port, str),
        "fraction": (_parse_fraction, lambda value: f"{value:g}"),
    }

    def __init__(self, kind: str, low: int | float, high: int | float, *, why: str = "", low_open: bool = False,
                 parse: Callable[[str], int] | None = None) -> None:
        """`parse`: for a kind of number of its own (written back as digits)."""
        if parse is None and kind not in self.KINDS:
            raise ValueError(f"unknown kind {kind!r}")
        assert low < high if low_open else low <= high, (low, high)
        self.kind = kind
        self._parse, self._show = (parse, str) if parse is not None else self.KINDS[kind]
        self.low = low
        self.high = high
        self.why = why
        self.low_open = low_open
        self.__name__ = kind  # argparse names a type by it

    def __call__(self, text: str) -> int | float:
        parse, show = self._parse, self._show
        if len(text) > NUMBER_CHARACTERS_MAX:
            raise argparse.ArgumentTypeError(f"must be at most {self._high_text()}, got {_shown(text)}")
        value = parse(text)
        if value < self.low or (self.low_open and value == self.low):
            if self.low_open:
                raise argparse.ArgumentTypeError(f"must be more than {show(self.low)}, got {_shown(text)}")
            if self.low == 0:
                raise argparse.ArgumentTypeError(f"must not be negative, got {_shown(text)}")
            raise argparse.ArgumentTypeError(f"must be at least {show(self.low)}, got {_shown(text)}")
        if value > self.high:
            raise argparse.ArgumentTypeError(f"must be at most {self._high_text()}, got {_shown(text)}")
        return value

    def show(self, value: int | float) -> str:
        return self._show(value)

    def range_text(self) -> str:
        """'0..10000', '1..5MiB', '(0, 1]': the range as help and docs show it."""
        if self.low_open:
            return f"({self.show(self.low)}, {self.show(self.high)}]"
        return f"{self.show(self.low)}..{self.show(self.high)}"

    def _high_text(self) -> str:
        return self.show(self.high) + (f" ({self.why})" if self.why else "")

    def __repr__(self) -> str:
        return f"Bounded({self.kind!r}, {self.range_text()})"


# The shared types: ranges that fit any flag of their kind (64-bit at most,
# so that nothing overflows msgpack or a ZooKeeper record). A flag with a
# tighter bound of its own uses one of quire.cli_ranges.
byte_size = Bounded("size", 0, INT64_MAX, why="a 64-bit count of bytes")
duration_ms = Bounded("duration", 0, INT64_MAX, why="a 64-bit count of milliseconds")
nonnegative_int = Bounded("integer", 0, INT64_MAX, why="a 64-bit integer")
positive_int = Bounded("integer", 1, INT64_MAX, why="a 64-bit integer")
port_number = Bounded("port", 1, PORT_MAX)
metrics_port = Bounded("metrics port", 0, PORT_MAX)  # 0: no metrics endpoint
port_or_zero = Bounded("listener port", 0, PORT_MAX)  # 0: no listener
fraction = Bounded("fraction", 0, 1, low_open=True)


class HostPorts:
    """An argparse type for HOST:PORT[,HOST:PORT...]: every port that is a
    number must be a port. Anything else malformed is left to the code that
    connects, whose message names the expected form."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.__name__ = "HOST:PORT"

    def __call__(self, text: str) -> str:
        for address in text.split(","):
            port = address.strip().rpartition(":")[2]
            if port.isdigit() and (len(port) > len(str(PORT_MAX)) or not 0 < int(port) <= PORT_MAX):
                raise argparse.ArgumentTypeError(f"{self.what} port must be in 1..{PORT_MAX}, got {_shown(text)}")
        return text


class Listeners:
    """An argparse type for NAME:HOST:PORT[,NAME:HOST:PORT...] (a broker's
    advertised listeners): a dict of name to HOST:PORT, names unique."""

    __name__ = "NAME:HOST:PORT"

    def __call__(self, text: str) -> dict[str, str]:
        listeners: dict[str, str] = {}
        for item in text.split(","):
            name, _, address = item.strip().partition(":")
            host, _, port = address.rpartition(":")
            if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name) or not host or not port.isdigit():
                raise argparse.ArgumentTypeError(f"a listener is NAME:HOST:PORT, got {_shown(item)}")
            if name in listeners:
                raise argparse.ArgumentTypeError(f"listener {name!r} is named twice")
            listeners[name] = HostPorts("listener")(f"{host}:{port}")
        return listeners


def default_text(action: argparse.Action) -> str | None:
    """An option's default as a user writes it, or None where it has none worth showing."""
    default = action.default
    if action.required or action.nargs == 0 or default in (None, "", [], {}, argparse.SUPPRESS) or isinstance(default, bool):
        return None
    if isinstance(action.type, Bounded) and isinstance(default, (int, float)):
        return action.type.show(default)
    return str(default)


def range_text(action: argparse.Action) -> str | None:
    """An option's range as help and docs show it, or None for no number."""
    return action.type.range_text() if isinstance(action.type, Bounded) else None


class _HelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, unless the text already
    says it, and its range."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if not text:
            return text
        notes = []
        shown = default_text(action)
        if shown is not None and "default" not in text:
            notes.append(f"default {shown}")
        bounds = range_text(action)
        if bounds is not None:
            notes.append(f"range {bounds}")
        if notes:
            text += f" ({'; '.join(notes).replace('%', '%%')})"
        return text


class Parser(argparse.ArgumentParser):
    """Errors are one line (what is wrong, where to look), then exit 2; help
    shows each option's default and range. Every parser of ours is one,
    the benchmarks' (bench/*.py) too."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)
        # A word that starts like a negative number (-5, -5s, -1MiB) is a
        # value, not a flag: no flag of ours starts with a digit. Without
        # this argparse takes `--idle-timeout -5s` for a missing value
        # instead of letting the type say "must not be negative".
        self._negative_number_matcher = re.compile(r"^-\.?\d")

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


__all__ = [
    "EXIT_USAGE",
    "INT64_MAX",
    "PORT_MAX",
    "Bounded",
    "HostPorts",
    "Listeners",
    "Parser",
    "UsageError",
    "byte_size",
    "default_text",
    "duration_ms",
    "fraction",
    "human_duration",
    "human_size",
    "metrics_port",
    "nonnegative_int",
    "parse_duration_ms",
    "parse_integer",
    "parse_number",
    "parse_size",
    "port_number",
    "port_or_zero",
    "positive_int",
    "range_text",
]
