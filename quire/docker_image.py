"""Build quire's image (`scripts/docker-build`) on a machine that cannot
reach Docker Hub, and start a Docker engine for the compose tests.

- The base is `debian:bookworm-slim` when it is here or can be pulled;
  otherwise `quire-base:bookworm`, made once with `debootstrap --variant=
  minbase bookworm` and `docker import`, and kept as that image.
- quire and its dependencies are built as wheels on this machine (pip here
  can reach the package index; pip inside a build container may not be able
  to verify it) into `.docker-wheels/`, and the image installs them with
  `--no-index`. Without wheels the Dockerfile installs from the source with
  pip, which is what a plain `docker-compose build` does where pulling works.

    python -m quire.docker_image [--tag quire:latest]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROJECT = Path(__file__).resolve().parent.parent
IMAGE = "quire:latest"
PULLED_BASE = "debian:bookworm-slim"
LOCAL_BASE = "quire-base:bookworm"
WHEELS = ".docker-wheels"  # in the build context; .gitignore'd
DEBIAN_MIRROR = "http://deb.debian.org/debian"
PULL_TIMEOUT_S = 60
ENGINE_START_S = 60


class DockerUnavailable(RuntimeError):
    """No Docker engine can run here (a reason, for a test to skip with)."""


class BuildFailed(RuntimeError):
    """A step of the image's build failed; the message says which and why."""


def docker(*arguments: str, timeout: float | None = None, stdin=None, quiet: bool = True) -> subprocess.CompletedProcess:
    """Run the docker client; its output is captured when `quiet`."""
    return subprocess.run(["docker", *arguments], stdin=stdin, timeout=timeout, text=True,
                          capture_output=quiet)


def engine_running() -> bool:
    if shutil.which("docker") is None:
        return False
    try:
        return docker("info", "--format", "{{.ServerVersion}}", timeout=20).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def start_engine(log_path: Path, *, die_with_parent: bool = False) -> subprocess.Popen | None:
    """Start `dockerd` unless an engine already answers; returns the
    process started (the caller stops it with `stop_engine`), or None.
    With `die_with_parent` the kernel kills it if this process dies (tests).
    DockerUnavailable when there is no engine and none can be started."""
    if engine_running():
        return None
    if shutil.which("docker") is None or shutil.which("dockerd") is None:
        raise DockerUnavailable("Docker is not installed (Debian: apt-get install docker.io)")
    if os.geteuid() != 0:
        raise DockerUnavailable("no Docker engine runs, and starting dockerd needs root")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        hook = None
        if die_with_parent:
            from coordination.zk_launcher import die_with_parent_hook

            hook = die_with_parent_hook()
        process = subprocess.Popen(["dockerd"], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   start_new_session=True, preexec_fn=hook)
    deadline = time.monotonic() + ENGINE_START_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise DockerUnavailable(f"dockerd exited with {process.returncode}: {_tail(log_path)}")
        if engine_running():
            return process
        time.sleep(0.5)
    stop_engine(process)
    raise DockerUnavailable(f"dockerd did not answer within {ENGINE_START_S}s: {_tail(log_path)}")


def stop_engine(process: subprocess.Popen | None) -> None:
    """Stop a `dockerd` that `start_engine` started (it stops its containers)."""
    from coordination.zk_launcher import stop_children

    if process is not None:
        stop_children([process], deadline_s=60)


def _tail(path: Path, lines: int = 5) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return "(no log)"


def image_exists(name: str) -> bool:
    return docker("image", "inspect", name, timeout=60).returncode == 0


def base_image(say=print) -> str:
    """The image to build on: Debian's slim image if it is here or can be
    pulled, else one made here with debootstrap (and kept for next time)."""
    if image_exists(PULLED_BASE):
        return PULLED_BASE
    try:
        if docker("pull", PULLED_BASE, timeout=PULL_TIMEOUT_S).returncode == 0:
            return PULLED_BASE
    except subprocess.TimeoutExpired:
        pass
    if image_exists(LOCAL_BASE):
        return LOCAL_BASE
    if shutil.which("debootstrap") is None:
        raise BuildFailed(f"{PULLED_BASE} cannot be pulled and debootstrap is not installed (Debian: apt-get install debootstrap)")
    say(f"{PULLED_BASE} cannot be pulled: making {LOCAL_BASE} with debootstrap (once)")
    with tempfile.TemporaryDirectory(prefix="quire-base-") as scratch:
        root = Path(scratch) / "root"
        result = subprocess.run(["debootstrap", "--variant=minbase", "bookworm", str(root), DEBIAN_MIRROR],
                                capture_output=True, text=True)
        if result.returncode != 0:
            raise BuildFailed(f"debootstrap failed: {result.stdout[-2000:]}{result.stderr[-2000:]}")
        # As the slim image: updates and security fixes, and apt keeps no
        # downloaded packages.
        (root / "etc/apt/sources.list").write_text(
            f"deb {DEBIAN_MIRROR} bookworm main\n"
            f"deb {DEBIAN_MIRROR} bookworm-updates main\n"
            "deb http://deb.debian.org/debian-security bookworm-security main\n")
        (root / "etc/apt/apt.conf.d/docker-clean").write_text(
            'DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/*.bin || true"; };\n'
            'Dir::Cache::pkgcache ""; Dir::Cache::srcpkgcache "";\n')
        # As the slim image, packages installed later leave out their
        # manuals, documentation and translations.
        (root / "etc/dpkg/dpkg.cfg.d/docker-slim").write_text(
            "path-exclude /usr/share/doc/*\npath-include /usr/share/doc/*/copyright\n"
            "path-exclude /usr/share/man/*\npath-exclude /usr/share/info/*\n"
            "path-exclude /usr/share/locale/*\npath-include /usr/share/locale/locale.alias\n")
        shutil.rmtree(root / "var/cache/apt/archives", ignore_errors=True)
        (root / "var/cache/apt/archives/partial").mkdir(parents=True)
        for cache in (root / "var/cache/apt").glob("*.bin"):
            cache.unlink()
        tar = subprocess.Popen(["tar", "-C", str(root), "--numeric-owner", "-c", "."], stdout=subprocess.PIPE)
        imported = docker("import", "--change", 'CMD ["bash"]', "-", LOCAL_BASE, stdin=tar.stdout, timeout=600)
        tar.stdout.close()
        if tar.wait() != 0 or imported.returncode != 0:
            raise BuildFailed(f"docker import of the debootstrap base failed: {imported.stderr.strip()}")
    return LOCAL_BASE


def build_wheels(project: Path = PROJECT, python: str = sys.executable) -> Path:
    """quire and its dependencies (no extras) as wheels, for the image."""
    wheels = project / WHEELS
    wheels.mkdir(exist_ok=True)
    for old in wheels.glob("*.whl"):
        old.unlink()
    result = subprocess.run([python, "-m", "pip", "wheel", "--quiet", "--wheel-dir", str(wheels), str(project)],
                            capture_output=True, text=True)
    if result.returncode != 0:
        raise BuildFailed(f"pip wheel failed: {result.stderr.strip()[-3000:]}")
    return wheels


def build_image(tag: str = IMAGE, project: Path = PROJECT, say=print) -> str:
    """Build `tag` offline from a base this machine has and wheels built
    here; returns the tag."""
    base = base_image(say)
    say(f"building wheels of quire and its dependencies into {WHEELS}/")
    build_wheels(project)
    say(f"docker build -t {tag} (base {base})")
    # The classic builder: BuildKit would look the base up in a registry.
    environment = {**os.environ, "DOCKER_BUILDKIT": "0"}
    result = subprocess.run(["docker", "build", "--build-arg", f"BASE={base}", "--tag", tag, str(project)],
                            env=environment, capture_output=True, text=True)
    if result.returncode != 0:
        raise BuildFailed(f"docker build failed:\n{result.stdout[-4000:]}{result.stderr[-2000:]}")
    return tag


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/docker-build", description=__doc__.split("\n\n")[0])
    parser.add_argument("--tag", default=IMAGE, help="name of the image built")
    parser.add_argument("--start-engine", action="store_true",
                        help="start dockerd if no Docker engine answers (it keeps running afterwards)")
    arguments = parser.parse_args(argv)
    try:
        if arguments.start_engine:
            start_engine(PROJECT / ".quire" / "dockerd.log")
        elif not engine_running():
            raise DockerUnavailable("no Docker engine answers: start dockerd, or pass --start-engine")
        build_image(arguments.tag, say=lambda line: print(f"== {line}", flush=True))
    except (DockerUnavailable, BuildFailed) as error:
        print(f"scripts/docker-build: error: {error}", file=sys.stderr)
        return 1
    print(f"built {arguments.tag}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
