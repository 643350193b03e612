"""Package names imported on first use, so that importing a package for one
light part of it (a codec, the in-memory store) does not load its heavy
parts (a server, kazoo, RocksDB)."""

from __future__ import annotations

import importlib
from typing import Any, Callable


def lazy_exports(package_globals: dict[str, Any], modules_by_name: dict[str, str]) -> Callable[[str], Any]:
    """A module `__getattr__` that imports `name` from `modules_by_name[name]`
    on first use and keeps it in the package's namespace."""

    def __getattr__(name: str) -> Any:
        module_name = modules_by_name.get(name)
        if module_name is None:
            raise AttributeError(f"module {package_globals['__name__']!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module_name), name)
        package_globals[name] = value
        return value

    return __getattr__
