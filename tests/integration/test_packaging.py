"""The distribution a plain `pip install .` builds (what the Docker image
installs) holds every package of the repository, not only what an editable
install happens to see."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from quire.spark_shipping import PACKAGES as TOP_LEVEL

REPOSITORY = Path(__file__).resolve().parents[2]


def test_one_list_of_top_level_packages():
    # The wheel's (pyproject.toml), the one shipped to Spark's executors, and
    # every top-level folder of the repository that is a package.
    import tomllib

    included = tomllib.loads((REPOSITORY / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    assert {name.rstrip("*") for name in included} == set(TOP_LEVEL)
    folders = {path.parent.name for path in REPOSITORY.glob("*/__init__.py")} - {"tests", "build"}
    assert folders == set(TOP_LEVEL)


def test_the_wheel_contains_every_package(tmp_path):
    # Built from a clean copy: setuptools reuses a build/ directory left in
    # the tree, which would hide a package missing from the configuration.
    source = tmp_path / "source"
    shutil.copytree(
        REPOSITORY, source,
        ignore=shutil.ignore_patterns(".venv", "build", "*.egg-info", ".git", ".quire", ".bench", "__pycache__", ".hypothesis"),
    )
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(tmp_path), str(source)],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    (wheel,) = tmp_path.glob("quire-*.whl")
    packaged = {Path(name).parent.as_posix() for name in zipfile.ZipFile(wheel).namelist() if name.endswith("__init__.py")}
    in_repository = {
        init.parent.relative_to(REPOSITORY).as_posix()
        for top in TOP_LEVEL
        for init in (REPOSITORY / top).rglob("__init__.py")
        if "__pycache__" not in init.parts
    }
    assert in_repository <= packaged, f"missing from the wheel: {sorted(in_repository - packaged)}"
    entry_points = [name for name in zipfile.ZipFile(wheel).namelist() if name.endswith("entry_points.txt")]
    assert entry_points and "quire = quire.cli:main" in zipfile.ZipFile(wheel).read(entry_points[0]).decode()
