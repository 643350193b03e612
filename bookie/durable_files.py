"""Small helpers for writing files safely: gathered positional writes,
directory fsync, and atomic replacement of a small file."""

from __future__ import annotations

import os
from pathlib import Path

IOV_MAX = min(os.sysconf("SC_IOV_MAX"), 1024)


def fsync_directory(directory: Path) -> None:
    """Make creations, renames and deletions inside `directory` durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_atomically(path: Path, data: bytes) -> None:
    """Replace `path` with `data` so that a crash leaves the old or the new
    contents, never a mix."""
    temporary = path.with_name(path.name + ".tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(temporary, path)
    fsync_directory(path.parent)


def write_parts_at(fd: int, parts: list[bytes], position: int) -> int:
    """Write `parts` back to back at `position` with pwritev (no join, which
    would copy every byte once more while holding the GIL); finish short
    writes; raise OSError when the disk refuses. Returns bytes written."""
    total = 0
    for start in range(0, len(parts), IOV_MAX):
        chunk = parts[start : start + IOV_MAX]
        expected = sum(map(len, chunk))
        written = os.pwritev(fd, chunk, position + total)
        if written != expected:
            rest = memoryview(b"".join(chunk))[written:]
            while rest:
                done = os.pwrite(fd, rest, position + total + expected - len(rest))
                if done == 0:
                    raise OSError(f"no progress writing {len(rest)} bytes at {position + total}")
                rest = rest[done:]
        total += expected
    return total


def directory_problem(path: Path, what: str = "directory") -> str | None:
    """Create `path` if need be and check that a file can be written in it
    (permission bits do not stop root, a read-only file system does, so a
    probe file is the real test). None if all is well, else one line naming
    the directory and what is wrong with it."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        return f"the {what} {path} is not a directory"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        return f"cannot create the {what} {path}: {error.strerror or error}"
    if not path.is_dir():
        return f"the {what} {path} is not a directory"
    if not os.access(path, os.W_OK | os.X_OK):
        return f"the {what} {path} is not writable by this user"
    probe = path / f".write-check-{os.getpid()}"
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as error:
        return f"the {what} {path} is not writable: {error.strerror or error}"
    return None
