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
