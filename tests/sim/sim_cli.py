"""What the simulator's tests share: `quire sim` in a fresh process, the
check that a seed's run does not depend on the hash seed, and a trio that
refuses to start (a simulated run must never use it)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Sequence

REPOSITORY = Path(__file__).resolve().parents[2]
QUIRE = [sys.executable, "-m", "quire"]


def quire_sim(*arguments: str, timeout_s: float = 300, hash_seed: str | None = None) -> subprocess.CompletedProcess:
    env = None if hash_seed is None else {**os.environ, "PYTHONHASHSEED": hash_seed}
    return subprocess.run([*QUIRE, "sim", *arguments], cwd=REPOSITORY, capture_output=True, text=True,
                          timeout=timeout_s, env=env)


def digest_of(stdout: str) -> str:
    return re.search(r"event log digest: ([0-9a-f]{64})", stdout).group(1)


def assert_same_run_under_other_hash_seeds(arguments: Sequence[str], seed: int, fault_kinds: Sequence[str]) -> None:
    """The seed runs ok with every fault kind on and injected (the ones that
    are rates aside), with one digest whatever PYTHONHASHSEED is: set
    iteration order depends on it, a run must not."""
    digests = set()
    for hash_seed in ("1", "2"):
        completed = quire_sim(*arguments, "--seed", str(seed), hash_seed=hash_seed)
        assert completed.returncode == 0, completed.stdout + completed.stderr
        assert f"seed {seed}: ok" in completed.stdout
        assert f"faults={','.join(fault_kinds)} " in completed.stdout
        injected = re.search(r" faults=(\{[^}]*\})", completed.stdout).group(1)
        for kind in fault_kinds:
            if kind not in ("drop", "duplicate"):  # not injected one by one: rates on the network
                assert f"'{kind}': " in injected, injected
        digests.add(digest_of(completed.stdout))
    assert len(digests) == 1


def forbid_trio(monkeypatch) -> None:
    import trio

    def refuse(*args, **kwargs):
        raise AssertionError("a simulated run must not start trio")

    monkeypatch.setattr(trio, "run", refuse)
    monkeypatch.setattr(trio.lowlevel, "start_guest_run", refuse)
