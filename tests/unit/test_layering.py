"""The packages keep their layers (DESIGN.md section 1) and the pure cores
import no drivers: import-linter checks the contracts in pyproject.toml
against every import of the code, those inside functions and under
TYPE_CHECKING included."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

from tests.unit.test_core_purity import core_modules

ROOT = Path(__file__).resolve().parents[2]
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def importlinter_options() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]


def contract(contract_id: str) -> dict:
    return next(contract for contract in importlinter_options()["contracts"] if contract["id"] == contract_id)


def lint_imports(*arguments: str) -> subprocess.CompletedProcess:
    assert LINT_IMPORTS.exists(), f"{LINT_IMPORTS} is missing: install the test extra (scripts/install)"
    # No cache: it would be written into the working tree.
    return subprocess.run([str(LINT_IMPORTS), "--no-cache", "--no-logo", *arguments],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_the_import_contracts_are_kept():
    result = lint_imports()
    assert result.returncode == 0, f"lint-imports found broken contracts:\n{result.stdout}{result.stderr}"


def test_every_package_is_in_the_layers():
    packages = {path.parent.name for path in ROOT.glob("*/__init__.py")} - {"tests"}
    layered = {name.strip() for layer in contract("layers")["layers"] for name in layer.replace(":", "|").split("|")}
    assert packages == set(importlinter_options()["root_packages"]) == layered


def test_the_pure_cores_contract_names_every_core():
    listed = set(contract("pure-cores")["source_modules"])
    cores = set(core_modules())
    assert listed == cores, (
        "pyproject.toml's contract 'pure-cores' and tests/unit/test_core_purity.py disagree: "
        f"add {sorted(cores - listed)} to the contract's source_modules, "
        f"and {sorted(listed - cores)} to CORE_MODULES")


def test_lint_imports_reports_a_broken_contract(tmp_path):
    # The check can fail: with the layers upside down, every import of
    # coordination by a package above it breaks the contract.
    config = tmp_path / "upside_down.toml"
    config.write_text(
        "[tool.importlinter]\n"
        'root_packages = ["coordination", "bookie"]\n'
        "[[tool.importlinter.contracts]]\n"
        'name = "upside down"\n'
        'type = "layers"\n'
        'layers = ["coordination", "bookie"]\n'
    )
    result = lint_imports(str(config))
    assert result.returncode != 0
    assert "bookie" in result.stdout and "BROKEN" in result.stdout
