"""What `quire export` ships to a Spark cluster's executors: an archive of a
Python environment holding quire's packages and what the data source needs
(pinned to this environment's versions, pyspark left out: executors have
their own), built once with venv-pack and cached by content hash; and how
the session is started so that executors and the driver's own Python worker
run it. `python -m quire.spark_shipping` prints the archive's path (for
spark-submit).
"""

from __future__ import annotations

import compileall
import contextlib
import fcntl
import hashlib
import importlib.metadata
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
import venv
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from quire.cli_parsing import UsageError

ALIAS = "quire-env"  # the folder executors unpack the archive into (spark.archives' #fragment)
WORKER_PYTHON = f"./{ALIAS}/bin/python"
# quire's top-level packages (pyproject.toml's, which tests/integration/test_packaging.py checks against).
PACKAGES = ("coordination", "framing", "security", "bookie", "ledger_client", "broker", "sim", "quire", "bench")
# Executors get these from their own Spark; venv-pack only packs.
NOT_SHIPPED = frozenset({"pyspark", "py4j", "venv-pack"})
# Bump when the way the environment is built changes: older archives are not used.
RECIPE = 1
ARCHIVES_KEPT = 4  # the most recently used archives of the cache; older ones are deleted
PIP_OUTPUT_TAIL_LINES = 20
# Left out of the archive: every executor of every application unpacks it
# (the test suites of pandas, numpy and pyarrow are a fifth of it).
PACKED_OUT = ("lib/python*/site-packages/*/tests/*", "lib/python*/site-packages/pyarrow/include/*")
# Settings holding local paths Spark resolves against the driver JVM's
# working directory (which is not the caller's: see Launch).
PATH_SETTINGS = ("spark.archives", "spark.files", "spark.jars", "spark.submit.pyFiles")


def is_local(master: str) -> bool:
    return master.startswith("local")


def cache_directory() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "quire" / "spark-env"


def _say(text: str) -> None:
    if os.environ.get("CI", "").lower() not in ("1", "true", "yes"):
        print(text, file=sys.stderr, flush=True)


# --- what the environment holds ---------------------------------------------------------------


def _name(requirement: str) -> str:
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    assert match, requirement
    return re.sub(r"[-_.]+", "-", match.group(1)).lower()


def _installed(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def requirements() -> list[str]:
    """quire's runtime dependencies and the spark extra's (pyspark aside),
    each pinned to the version installed here."""
    try:
        declared = importlib.metadata.requires("quire") or []
    except importlib.metadata.PackageNotFoundError:
        raise UsageError("quire is not installed in this Python (pip install -e .): "
                         "its dependencies for the Spark executors are not known") from None
    pinned = []
    for requirement in declared:
        marker = requirement.partition(";")[2]
        name = _name(requirement)
        if name in NOT_SHIPPED or (marker and marker.replace(" ", "") not in ('extra=="spark"', "extra=='spark'")):
            continue
        version = _installed(name)
        if version is None:
            raise UsageError(f"{name} is not installed here: pip install 'quire[spark]'")
        pinned.append(f"{name}=={version}")
    return sorted(pinned)


def constraints(pinned: list[str]) -> list[str]:
    """Every distribution the pinned ones need (through requirements that are
    not extras), pinned to the version installed here: pip installs what the
    executors' platform needs, at this environment's versions."""
    seen: dict[str, str] = {}
    todo = [_name(requirement) for requirement in pinned]
    while todo:
        name = todo.pop()
        version = _installed(name)
        if name in seen or name in NOT_SHIPPED or version is None:
            continue
        seen[name] = version
        for requirement in importlib.metadata.requires(name) or []:
            if "extra" not in requirement.partition(";")[2]:
                todo.append(_name(requirement))
    return sorted(f"{name}=={version}" for name, version in seen.items())


def package_files() -> list[tuple[str, Path]]:
    """quire's modules, from wherever they are imported (an editable install
    or site-packages): (path under site-packages, file)."""
    files = []
    for package in PACKAGES:
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise UsageError(f"quire's package {package} cannot be imported here")
        root = Path(list(spec.submodule_search_locations)[0])
        for path in sorted(root.rglob("*.py")):
            if "__pycache__" not in path.parts:
                files.append((f"{package}/{path.relative_to(root).as_posix()}", path))
    return files


def _interpreter() -> str:
    """The Python the environment links to (venv-pack does not pack it)."""
    return os.path.realpath(getattr(sys, "_base_executable", sys.executable))


@dataclass(frozen=True)
class Recipe:
    """What goes into the environment; its hashes name the cache's files."""

    requirements: tuple[str, ...]
    constraints: tuple[str, ...]
    files: tuple[tuple[str, Path], ...]
    interpreter: str = field(default_factory=_interpreter)
    python: str = field(default_factory=lambda: sys.version.split()[0])
    platform: str = field(default_factory=lambda: f"{sysconfig.get_platform()} {sys.implementation.cache_tag}")

    @classmethod
    def here(cls) -> "Recipe":
        pinned = requirements()
        return cls(tuple(pinned), tuple(constraints(pinned)), tuple(package_files()))

    def dependencies_hash(self) -> str:
        """Of the installed dependencies alone: the environment quire's code is copied into."""
        text = "\n".join([f"recipe {RECIPE}", self.python, self.platform, self.interpreter, *self.requirements,
                          "constraints", *self.constraints])
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def archive_hash(self) -> str:
        digest = hashlib.sha256(self.dependencies_hash().encode())
        for name, path in self.files:
            contents = path.read_bytes()
            digest.update(f"\0{name}\0{len(contents)}\0".encode())
            digest.update(contents)
        return digest.hexdigest()[:16]


# --- building, once ----------------------------------------------------------------------------


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive flock on `path`: builders of the same thing wait for
    each other, then find it built."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def _site_packages(prefix: Path) -> Path:
    return prefix / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"


def _dependencies(recipe: Recipe, cache: Path) -> Path:
    """A virtual environment with the pinned dependencies installed (no
    quire), made once per dependencies hash, in place (venv-pack packs it
    where pip wrote its scripts). Call with its lock held: a build that
    died left no `.complete` mark, and is made again."""
    target = cache / f"deps-{recipe.dependencies_hash()}"
    complete = cache / f"{target.name}.complete"
    if complete.exists():
        return target
    shutil.rmtree(target, ignore_errors=True)
    venv.EnvBuilder(symlinks=True, with_pip=False).create(target)
    if recipe.requirements:
        constraints_file = cache / f"{target.name}.constraints.txt"
        constraints_file.write_text("".join(f"{line}\n" for line in recipe.constraints))
        command = [sys.executable, "-m", "pip", "--python", str(target / "bin" / "python"), "install", "--no-input",
                   "--disable-pip-version-check", "--quiet", "--constraint", str(constraints_file), *recipe.requirements]
        completed = subprocess.run(command, capture_output=True, text=True, stdin=subprocess.DEVNULL)
        constraints_file.unlink()
        if completed.returncode != 0:
            tail = "\n".join((completed.stdout + completed.stderr).strip().splitlines()[-PIP_OUTPUT_TAIL_LINES:])
            raise UsageError(f"could not install the Spark executors' dependencies into {target} "
                             f"(give --no-ship when they have quire installed):\n{tail}")
    complete.touch()
    return target


def build_archive(recipe: Recipe | None = None, cache: Path | None = None) -> Path:
    """The archive of the environment for `recipe` (default: this one),
    from the cache or built now: `<hash>.tar.gz` under `cache`."""
    try:
        import venv_pack
    except ImportError:
        raise UsageError("shipping quire to Spark executors needs venv-pack: pip install 'quire[spark]' "
                         "(or give --no-ship when they have quire installed)") from None

    recipe = recipe or Recipe.here()
    cache = cache or cache_directory()
    archive = cache / f"{recipe.archive_hash()}.tar.gz"
    if archive.exists():
        os.utime(archive)  # recently used: kept by the pruning
        return archive
    # One lock per set of dependencies: quire's code is added to their
    # environment for the packing, then taken out again.
    with _locked(cache / f"deps-{recipe.dependencies_hash()}.lock"):
        if archive.exists():
            return archive
        began = time.monotonic()
        _say(f"building the environment for Spark executors (once): {len(recipe.requirements)} packages pinned "
             f"as here and quire's code, into {archive}")
        environment = _dependencies(recipe, cache)
        site_packages = _site_packages(environment)
        packages = sorted({name.split("/")[0] for name, _ in recipe.files})
        packed = cache / f"{archive.name}.partial"
        try:
            for package in packages:  # what a packing that died left
                shutil.rmtree(site_packages / package, ignore_errors=True)
            for name, path in recipe.files:
                (site_packages / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(path, site_packages / name)
            for package in packages:
                compileall.compile_dir(site_packages / package, quiet=1)  # here once, not in every Python worker
            venv_pack.pack(prefix=str(environment), output=str(packed), format="tar.gz", force=True, compress_level=1,
                           filters=[("exclude", pattern) for pattern in PACKED_OUT])
            os.rename(packed, archive)  # atomic: a reader sees a whole archive or none
        finally:
            for package in packages:
                shutil.rmtree(site_packages / package, ignore_errors=True)
            packed.unlink(missing_ok=True)
        _say(f"built {archive.name} ({archive.stat().st_size / 1e6:.0f} MB) in {time.monotonic() - began:.0f}s")
    _prune(cache, keep=archive)
    return archive


def _prune(cache: Path, keep: Path) -> None:
    """Delete all but the ARCHIVES_KEPT most recently used archives."""
    archives = sorted(cache.glob("*.tar.gz"), key=lambda path: path.stat().st_mtime, reverse=True)
    for old in archives[ARCHIVES_KEPT:]:
        if old != keep:
            with contextlib.suppress(OSError):
                old.unlink()


# --- starting a session that uses it ---------------------------------------------------------


def _absolute_paths(value: str) -> str:
    """A comma-separated list of paths or URIs with the relative local paths
    made absolute (a `#alias` kept)."""
    items = []
    for item in value.split(","):
        path, hash_sign, alias = item.strip().partition("#")
        if path and not re.match(r"^[A-Za-z][\w+.-]*:", path) and not os.path.isabs(path):
            path = os.path.abspath(path)
        items.append(f"{path}{hash_sign}{alias}")
    return ",".join(items)


@dataclass
class Launch:
    """How to start a session for `master`: its settings, the Python its
    workers run (PYSPARK_PYTHON, read by PySpark at start), and the folder
    the driver's JVM starts in. Spark 4 plans a Python data source in a
    Python worker that the driver's JVM starts with the same executable
    string as executors, relative to its own working directory: that
    folder holds a link from the executable's first folder (quire-env) to
    this environment, which has quire."""

    config: dict[str, str]
    python: str | None = None
    directory: Path | None = None

    def close(self) -> None:
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
            self.directory = None


def prepare(master: str, config: dict[str, str], *, ship: bool = True) -> Launch:
    """The Launch for `master` with the user's `config`: for a non-local
    master, unless `ship` is false, the archive added to spark.archives (a
    user's archives kept) and ./quire-env/bin/python as the workers' Python
    (unless spark.pyspark.python is given)."""
    config = dict(config)
    if is_local(master):
        return Launch(config)
    for name in PATH_SETTINGS:
        if config.get(name):
            config[name] = _absolute_paths(config[name])
    if ship:
        archives = [item.strip() for item in config.get("spark.archives", "").split(",") if item.strip()]
        if any(item.endswith(f"#{ALIAS}") for item in archives):
            raise UsageError(f"spark.archives already names #{ALIAS}: give --no-ship to use your own environment")
        archives.append(f"{build_archive()}#{ALIAS}")
        config["spark.archives"] = ",".join(archives)
        python = config.setdefault("spark.pyspark.python", WORKER_PYTHON)
    else:
        python = config.get("spark.pyspark.python") or os.environ.get("PYSPARK_PYTHON")
    directory = None
    if python and "/" in python and not os.path.isabs(python):
        directory = Path(tempfile.mkdtemp(prefix="quire-spark-driver-"))
        (directory / Path(python).parts[0]).symlink_to(sys.prefix)
    return Launch(config, python, directory)


def start_session(master: str, app_name: str, config: dict[str, str] | None = None, *, ship: bool = True,
                  quiet: bool = False) -> tuple[Any, Callable[[], None]]:
    """A session (data source registered) and the function that stops it
    and removes what its launch made."""
    from broker.spark_source import spark_session, stop_jvm

    launch = prepare(master, config or {}, ship=ship)
    try:
        session = spark_session(master, app_name, launch.config, quiet=quiet, python=launch.python,
                                launch_directory=launch.directory)
    except BaseException:
        launch.close()
        raise

    def stop() -> None:
        try:
            session.stop()
            if launch.directory is not None:
                stop_jvm()  # it runs in the directory removed now: no later session may use it
        finally:
            launch.close()

    return session, stop


def main() -> int:
    print(build_archive())
    return 0


if __name__ == "__main__":
    sys.exit(main())
