"""Optional parts of quire and the packages they need (pyproject.toml's
extras): a command that needs one says which extra to install, before it
does anything, instead of failing with an ImportError half-way."""

from __future__ import annotations

import importlib.util

from quire.cli_parsing import UsageError

EXTRAS = {
    "spark": ("pyspark", "pyarrow", "pandas", "numpy"),
    "jepsen": ("matplotlib",),
}


def missing(extra: str) -> list[str]:
    """The packages of `extra` that cannot be imported here."""
    return [module for module in EXTRAS[extra] if importlib.util.find_spec(module) is None]


def require(extra: str, what: str) -> None:
    """UsageError (exit 2) naming the extra when a package of it is missing."""
    absent = missing(extra)
    if absent:
        raise UsageError(f"{what} needs quire's {extra!r} extra ({', '.join(absent)} not installed): "
                         f"pip install 'quire[{extra}]'")
