"""What the client processes of both Jepsen runs (client.py, broker_client.py)
share: the arguments every one takes, logging under its name, running its
role under trio, and SIGTERM or SIGINT as the word to stop."""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable

import trio

ERROR_TEXT_MAX = 300  # characters of an error kept in a history record


def error_text(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"[:ERROR_TEXT_MAX]


def client_parser(prog: str, roles: Iterable[str], *, name_help: str | None = None) -> argparse.ArgumentParser:
    """A parser with the arguments every client takes: its role, its name,
    the controller's start on the shared monotonic clock, and the seed."""
    parser = argparse.ArgumentParser(prog=prog)
    parser.add_argument("role", choices=sorted(roles))
    parser.add_argument("--name", required=True, help=name_help)
    parser.add_argument("--start-monotonic", type=float, required=True)
    parser.add_argument("--seed", type=int, default=0)
    return parser


@contextlib.asynccontextmanager
async def role_nursery(on_stop_signal: Callable[[], None] | None = None) -> AsyncIterator[trio.Nursery]:
    """A nursery for a client's role and what runs beside it, cancelled when
    the body ends. SIGTERM or SIGINT calls `on_stop_signal`, or cancels the
    nursery when there is none."""
    async with trio.open_nursery() as nursery:
        stop = on_stop_signal or nursery.cancel_scope.cancel

        async def stop_on_signal() -> None:
            with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for _ in signals:
                    stop()

        nursery.start_soon(stop_on_signal)
        yield nursery
        nursery.cancel_scope.cancel()


def run_client(parse_arguments: Callable[[list[str]], argparse.Namespace],
               main_async: Callable[[argparse.Namespace], Awaitable[None]], argv: list[str] | None) -> int:
    """A client process's main: its arguments (sys.argv's when `argv` is
    None), logging tagged with its name, and `main_async` under trio."""
    options = parse_arguments(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s %(levelname)s [{options.name}] %(name)s: %(message)s")
    trio.run(main_async, options)
    return 0
