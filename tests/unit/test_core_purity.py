"""Pure cores stay pure in what Python loads, not only in their source: each
core module, imported alone in a fresh interpreter, loads no trio, no
socket, no kazoo, no RocksDB binding and no Spark (a package `__init__` that
imports its drivers eagerly would load them all)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = sorted(path.parent.name for path in ROOT.glob("*/__init__.py") if path.parent.name != "tests")

# The one list of core modules (DESIGN.md section 2). Every `*_core.py`
# of a package is a core as well and is added without being listed here;
# tests/unit/test_layering.py checks that pyproject.toml's import-linter
# contract "Pure cores import no drivers" names the same modules.
CORE_MODULES = (
    "framing.codec",
    "coordination.memory_store",
    "bookie.protocol.wire",
    "bookie.protocol.entry_format",
    "bookie.request_core",
    "bookie.core_actions",
    "bookie.ledger_storage",
    "bookie.startup_recovery",
    "bookie.gc_policy",
    "ledger_client.write_core",
    "ledger_client.recovery_core",
    "ledger_client.placement",
    "ledger_client.metadata",
    "ledger_client.autorecovery.replication_core",
    "ledger_client.autorecovery.audit_core",
    "broker.protocol",
    "broker.dedup",
    "broker.cursor",
    "broker.dispatcher",
    "broker.ledger_list",
    "broker.export_plan",
    "broker.message_format",
    "broker.topic_records",
)
DRIVERS = ("trio", "socket", "kazoo", "rocksdict", "pyspark")
# A driver that a core may load only through these modules, which are not
# ours: the crc32c package (every CRC32C digest) reads its own version with
# importlib.metadata, whose `email.utils` imports socket. It opens none.
# (A core's own `import socket` after that is caught by the import-linter
# contract, which reads the source.)
LOADED_BY_DEPENDENCY = {"socket": {"email.utils"}}
# Cores that import a driver today: known, to be fixed in the module, not
# here. A strict xfail fails once the module is pure, so the mark goes then.
KNOWN_IMPURE: dict[str, str] = {}


def discovered_cores() -> set[str]:
    """Every `*_core.py` module of the packages, at any depth."""
    return {
        ".".join(path.relative_to(ROOT).with_suffix("").parts)
        for package in PACKAGES
        for path in (ROOT / package).rglob("*_core.py")
    }


def core_modules() -> list[str]:
    return sorted(set(CORE_MODULES) | discovered_cores())


# Run in the fresh interpreter: an import hook notes, for each driver, the
# chain of modules whose import loaded it (outermost first).
_PROBE = """
import json, sys

DRIVERS = set(json.loads(sys.argv[1]))
chains = {}

class Watch:
    def find_spec(self, name, path=None, target=None):
        top = name.partition(".")[0]
        if top in DRIVERS and top not in chains:
            chain, frame = [], sys._getframe(1)
            while frame is not None:
                if frame.f_code.co_name == "<module>":
                    chain.append(frame.f_globals.get("__name__", "?"))
                frame = frame.f_back
            chains[top] = chain[::-1]
        return None

sys.meta_path.insert(0, Watch())
import importlib
importlib.import_module(sys.argv[2])
loaded = {name: chains.get(name, ["(loaded before the import)"]) for name in DRIVERS if name in sys.modules}
print(json.dumps(loaded))
"""


def drivers_loaded_by(module: str) -> dict[str, list[str]]:
    """The drivers importing `module` loads, each with the import chain that loaded it."""
    result = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(DRIVERS), module],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, f"importing {module} failed:\n{result.stderr}"
    return json.loads(result.stdout.strip().splitlines()[-1])


def _param(module: str):
    reason = KNOWN_IMPURE.get(module)
    return pytest.param(module, marks=pytest.mark.xfail(strict=True, reason=reason)) if reason else module


@pytest.mark.parametrize("module", [_param(module) for module in core_modules()])
def test_a_core_loads_no_driver(module):
    loaded = drivers_loaded_by(module)
    offending = {
        name: chain for name, chain in loaded.items()
        if not (len(chain) >= 2 and chain[-1] in LOADED_BY_DEPENDENCY.get(name, ()))
    }
    assert not offending, f"importing {module} loads " + "; ".join(
        f"{name} (through {' -> '.join(chain)})" for name, chain in sorted(offending.items()))


def test_the_listed_cores_exist():
    missing = [module for module in CORE_MODULES if not (ROOT / Path(*module.split("."))).with_suffix(".py").exists()]
    assert not missing, f"listed as cores but gone (update CORE_MODULES): {missing}"
    assert set(KNOWN_IMPURE) <= set(core_modules())


def test_the_probe_sees_a_driver():
    # The check can fail: a driver module loads trio, and the chain names it.
    loaded = drivers_loaded_by("framing.stream")
    assert loaded["trio"][:2] == ["__main__", "framing.stream"]
