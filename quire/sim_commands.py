"""`quire sim`: run the deterministic simulator. `--seed N` reproduces one run
exactly; `--seeds COUNT` runs COUNT seeds with a progress bar and prints the seeds
that failed. Every run prints its seed and parameters. Exit status 1 when
any run broke an invariant, crashed or livelocked. `--broker` simulates the
broker (one partition, its brokers, producers and consumers) instead of the
bookies and ledger clients."""

from __future__ import annotations

import argparse
import ctypes
import multiprocessing
import os
import signal
import sys
import time
from pathlib import Path

from quire import cli_ranges as ranges


def add_sim(parser: argparse.ArgumentParser) -> None:
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--seed", type=ranges.seed, metavar="N", help="run seed N (reproduces a run exactly)")
    which.add_argument("--seeds", type=ranges.seed_count, metavar="COUNT", help="run COUNT seeds: --first-seed .. --first-seed + COUNT - 1")
    # No argparse defaults: given with --seed, these are a mistake to report.
    parser.add_argument("--first-seed", type=ranges.seed, metavar="S", help="with --seeds: the first seed (default 0)")
    parser.add_argument("--jobs", type=ranges.processes, metavar="J", help="with --seeds: processes running seeds (default 1)")
    parser.add_argument(
        "--broker", action="store_true",
        help="simulate the broker: the real dedup, cursor and dispatcher cores under faults (sim/broker_*.py)",
    )
    parser.add_argument(
        "--mistake", metavar="NAME", default=None,
        help="plant a known mistake to show the checkers find it (for tests): "
        "unfenced-recovery-reads, io-error-is-negative, ack-before-ensemble-written; "
        "assert-in-write-core shows a crash is reported; with --broker: dedup-judges-first-sequence-id, "
        "dedup-snapshot-ahead, dedup-replay-skipped, ack-before-durable, key-shared-overtakes-on-join, dispatch-without-lease, "
        "resume-after-last-persisted; acks-wait-on-unload and resume-after-last-taken break liveness",
    )
    parser.add_argument("--trace", type=Path, metavar="FILE", help="with --seed: write the run's event log to FILE")
    parser.add_argument(
        "--check-determinism", action="store_true",
        help="with --seed: run the seed twice and compare the digests of the event logs",
    )


_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent_pid: int) -> None:
    """Pool worker initializer: the kernel kills the worker when the batch's
    process dies (killed on a timeout, say), so that no worker goes on
    running seeds for nobody."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent_pid:
        os._exit(1)  # the parent died before the prctl


def _run(job: tuple[int, str | None, bool]):
    seed, mistake, broker = job
    return _runner(broker)(seed, mistake=mistake)


def _runner(broker: bool):
    """The run of one seed: the broker simulation's, or the ledger's."""
    if broker:
        from sim.broker_runner import run_broker_seed

        return run_broker_seed
    from sim.runner import run_seed

    return run_seed


def _parameters(broker: bool, seed: int):
    if broker:
        from sim.broker_parameters import choose_broker_parameters

        return choose_broker_parameters(seed)
    from sim.parameters import choose_parameters

    return choose_parameters(seed)


def sim(arguments: argparse.Namespace) -> int:
    from quire.cli_parsing import UsageError

    if arguments.broker:
        from sim.broker_mistakes import BROKER_MISTAKES as MISTAKES
    else:
        from sim.mistakes import MISTAKES
    run_seed = _runner(arguments.broker)
    if arguments.mistake is not None and arguments.mistake not in MISTAKES:
        raise UsageError(f"unknown --mistake {arguments.mistake!r}; known: {', '.join(sorted(MISTAKES))}")
    if arguments.seed is None and (arguments.trace or arguments.check_determinism):
        raise UsageError("--trace and --check-determinism go with --seed")
    if arguments.seed is not None and (arguments.first_seed is not None or arguments.jobs is not None):
        raise UsageError("--first-seed and --jobs go with --seeds (--seed runs one seed)")
    if arguments.seeds is not None:
        arguments.first_seed = arguments.first_seed or 0
        arguments.jobs = arguments.jobs or 1
        if arguments.first_seed + arguments.seeds - 1 > ranges.SEED_MAX:
            raise UsageError(f"--first-seed {arguments.first_seed} + --seeds {arguments.seeds} run past the last seed, {ranges.SEED_MAX}")
    if arguments.trace is not None and not arguments.trace.parent.is_dir():
        raise UsageError(f"--trace {arguments.trace}: no directory {arguments.trace.parent}")
    if arguments.seed is not None:
        # Said before the run, so that a run that never ends still names them.
        print(f"seed {arguments.seed}: parameters {_parameters(arguments.broker, arguments.seed).describe()}", flush=True)
        result = run_seed(arguments.seed, mistake=arguments.mistake, trace=arguments.trace is not None)
        print(result.summary())
        if arguments.trace is not None:
            arguments.trace.write_text("\n".join(result.trace or []) + "\n")
            print(f"event log: {arguments.trace} ({len(result.trace or [])} events)")
        status = 0 if result.ok else 1
        if arguments.check_determinism:
            again = run_seed(arguments.seed, mistake=arguments.mistake)
            same = again.digest == result.digest
            print(f"determinism: second run digest {again.digest} {'matches' if same else 'DIFFERS'}")
            status = status or (0 if same else 1)
        return status
    return _batch(arguments)


def _batch(arguments: argparse.Namespace) -> int:
    from quire.progress import Progress

    seeds = range(arguments.first_seed, arguments.first_seed + arguments.seeds)
    jobs = [(seed, arguments.mistake, arguments.broker) for seed in seeds]
    failing: list[int] = []
    crashed: list[int] = []  # failing by an exception or a livelock, not an invariant
    started = time.monotonic()
    with Progress("sim --broker" if arguments.broker else "sim", total=len(jobs), unit="seeds") as bar:
        if arguments.jobs > 1:
            pool = multiprocessing.get_context("spawn").Pool(arguments.jobs, initializer=_die_with_parent, initargs=(os.getpid(),))
            results = pool.imap(_run, jobs)
        else:
            pool = None
            results = map(_run, jobs)
        try:
            for done, result in enumerate(results, start=1):
                if result.ok:
                    print(f"seed {result.seed}: ok digest {result.digest[:16]} parameters {result.parameters.describe()}", flush=True)
                else:
                    failing.append(result.seed)
                    if any(violation.invariant in ("crash", "livelock") for violation in result.violations):
                        crashed.append(result.seed)
                    print(result.summary(), flush=True)
                bar.update(done)
        finally:
            if pool is not None:
                pool.terminate()
    elapsed_s = time.monotonic() - started
    print(
        f"{len(jobs)} seeds in {elapsed_s:.1f}s ({len(jobs) / elapsed_s:.2f} seeds/s): "
        f"{len(jobs) - len(failing)} without violation, {len(failing)} failing"
        + (f": {' '.join(map(str, failing))}" if failing else "")
        + (f" (crashed or livelocked: {' '.join(map(str, crashed))})" if crashed else "")
    )
    if failing:
        print(f"reproduce one with: quire sim {'--broker ' if arguments.broker else ''}--seed {failing[0]}"
              + (f" --mistake {arguments.mistake}" if arguments.mistake else ""))
    sys.stdout.flush()
    return 1 if failing else 0
