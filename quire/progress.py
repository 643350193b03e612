"""A progress bar for long work (benchmarks, exports, simulator batches):
drawn on a terminal, silent when output is not a terminal or CI is set."""

from __future__ import annotations

import os
import sys

from tqdm import tqdm


def progress_enabled() -> bool:
    return sys.stderr.isatty() and os.environ.get("CI", "").lower() not in ("1", "true", "yes")


class Progress:
    """`with Progress("export", total=n) as bar: bar.update(done_so_far)`."""

    def __init__(self, description: str, *, total: float, unit: str = "it") -> None:
        self._bar = tqdm(
            total=total, desc=description, unit=unit, disable=not progress_enabled(), leave=False, file=sys.stderr,
            bar_format="{desc}: {percentage:3.0f}%|{bar}| {n:.1f}/{total:.1f} {unit}",
        )
        self._done = 0.0

    def update(self, done: float) -> None:
        """Set how much is done so far (absolute, not an increment)."""
        done = min(done, self._bar.total)
        if done > self._done:
            self._bar.update(done - self._done)
            self._done = done

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._bar.close()
