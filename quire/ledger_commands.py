"""`quire ledger create|ls|show|read|recover|delete`: ledgers from the
command line, through the ledger client."""

from __future__ import annotations

import argparse
import base64
import collections
import contextlib
import json
import sys
from typing import AsyncIterator, Awaitable, Callable

import trio

from quire import cli_ranges as ranges
from quire.cli_parsing import UsageError
from quire.logging_setup import configure_logging

GENERATED_ENTRY_BYTES_DEFAULT = 1024
# Adds awaited in order while more are submitted: the ledger handle bounds
# what is in flight, this bounds what the command remembers of them.
PENDING_ADDS_REMEMBERED_MAX = 10_000


def _password(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--password", default="", help="ledger password (default: empty)")


def add_create(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ensemble-size", "-E", type=ranges.ensemble, default=3, help="bookies the ledger is spread over")
    parser.add_argument("--write-quorum", "-W", type=ranges.ensemble, default=None, help="default: the ensemble size")
    parser.add_argument("--ack-quorum", "-A", type=ranges.ensemble, default=None, help="default: write quorum - 1 (at least 1)")
    parser.add_argument("--digest", choices=["CRC32C", "HMAC_SHA256", "DUMMY"], default="CRC32C", help="digest of each entry (HMAC_SHA256 is keyed by the password; DUMMY is for tests)")
    _password(parser)
    parser.add_argument("--entries", type=ranges.entry_count, default=0, help="add this many generated entries")
    parser.add_argument("--entry-bytes", type=ranges.entry_bytes, default=None,
                        help=f"with --entries: size of each generated entry (default {GENERATED_ENTRY_BYTES_DEFAULT})")
    parser.add_argument("--stdin", action="store_true", help="add each line of standard input as an entry (instead of --entries)")
    parser.add_argument("--no-close", action="store_true", help="leave the ledger open (the writer exits: recover it later)")


def add_ledger_id(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("ledger_id", type=ranges.ledger_id, metavar="ID", help="the ledger's id (quire ledger ls lists them)")


def add_read(parser: argparse.ArgumentParser) -> None:
    add_ledger_id(parser)
    _password(parser)
    parser.add_argument("--first", type=ranges.entry_id, default=0, help="first entry id to print")
    parser.add_argument("--last", type=ranges.entry_id, default=None,
                        help="last entry id to print, not before --first (default: the last entry, or the LAC of an open ledger)")
    parser.add_argument("--no-recovery", action="store_true", help="do not fence an open ledger: read up to its LAC")
    parser.add_argument("--format", choices=["text", "json", "raw"], default="text", help="text: one entry per line; json: one object per line; raw: the payloads' bytes")


def add_recover(parser: argparse.ArgumentParser) -> None:
    add_ledger_id(parser)
    _password(parser)


@contextlib.asynccontextmanager
async def _client(arguments: argparse.Namespace) -> AsyncIterator:
    from coordination.store import MetadataError
    from ledger_client.bookkeeper import BookKeeper
    from quire.security_options import client_credentials_from

    try:
        async with BookKeeper.connect(arguments.zk, arguments.root, credentials=client_credentials_from(arguments)) as bk:
            yield bk
    except (MetadataError, ValueError) as error:
        raise UsageError(str(error)) from None


def _run(arguments: argparse.Namespace, body: Callable[..., Awaitable[None]]) -> int:
    from ledger_client.errors import BKError

    configure_logging("warning" if arguments.log_level == "info" else arguments.log_level, "ledger")

    async def go() -> None:
        async with _client(arguments) as bk:
            await body(bk)

    try:
        trio.run(go)
    except BKError as error:
        raise UsageError(f"{type(error).__name__}: {error}") from None
    return 0


def create(arguments: argparse.Namespace) -> int:
    from bookie.protocol.entry_format import DigestType

    # Checked before connecting, so that a typo is reported as such.
    ensemble_size = arguments.ensemble_size
    write_quorum = ensemble_size if arguments.write_quorum is None else arguments.write_quorum
    ack_quorum = max(1, write_quorum - 1) if arguments.ack_quorum is None else arguments.ack_quorum
    if not ensemble_size >= write_quorum >= ack_quorum:
        raise UsageError(f"need ensemble_size >= write_quorum >= ack_quorum, got {ensemble_size}/{write_quorum}/{ack_quorum}")
    if arguments.stdin and arguments.entries:
        raise UsageError("--stdin adds standard input's lines, --entries generated entries: give one of them")
    if arguments.entry_bytes is not None and not arguments.entries:
        raise UsageError("--entry-bytes is the size of generated entries: it goes with --entries")
    entry_bytes = GENERATED_ENTRY_BYTES_DEFAULT if arguments.entry_bytes is None else arguments.entry_bytes

    async def body(bk) -> None:
        lh = await bk.create_ledger(
            ensemble_size, write_quorum, ack_quorum,
            digest_type=DigestType[arguments.digest], password=arguments.password.encode(),
        )
        pending: collections.deque = collections.deque()
        added = 0

        def payloads():
            if arguments.stdin:
                for line in sys.stdin.buffer:
                    yield line.rstrip(b"\n")
            for index in range(arguments.entries):
                yield (b"entry-%d " % index).ljust(entry_bytes, b".")[:entry_bytes]

        for payload in payloads():
            pending.append(await lh.submit_add(payload))
            added += 1
            if len(pending) > PENDING_ADDS_REMEMBERED_MAX:
                await pending.popleft().wait()
        for add in pending:
            await add.wait()
        if not arguments.no_close:
            await lh.close()
        print(json.dumps({"ledger_id": lh.ledger_id, "entries": added, "last_add_confirmed": lh.last_add_confirmed,
                          "state": lh.metadata.state.value, "ensemble": list(lh.metadata.last_ensemble[1])}))

    return _run(arguments, body)


def list_(arguments: argparse.Namespace) -> int:
    async def body(bk) -> None:
        for ledger_id in await bk.list_ledgers():
            print(ledger_id)

    return _run(arguments, body)


def show(arguments: argparse.Namespace) -> int:
    async def body(bk) -> None:
        metadata = await bk.ledger_metadata(arguments.ledger_id)
        print(json.dumps(metadata.describe(), indent=2, sort_keys=True))

    return _run(arguments, body)


def read(arguments: argparse.Namespace) -> int:
    if arguments.last is not None and arguments.last < arguments.first:
        raise UsageError(f"--first {arguments.first} is after --last {arguments.last}: nothing would be read")

    async def body(bk) -> None:
        rh = await bk.open_ledger(arguments.ledger_id, arguments.password.encode(), recovery=not arguments.no_recovery)
        last = rh.last_add_confirmed if arguments.last is None else arguments.last
        if last < arguments.first:
            return
        out = sys.stdout.buffer
        async for entry in rh.read(arguments.first, last):
            if arguments.format == "raw":
                out.write(entry.data + b"\n")
            elif arguments.format == "json":
                out.write(json.dumps({"entry_id": entry.entry_id, "data": base64.b64encode(entry.data).decode()}).encode() + b"\n")
            else:
                out.write(b"%d\t%s\n" % (entry.entry_id, entry.data.decode(errors="backslashreplace").encode()))
        out.flush()

    return _run(arguments, body)


def recover(arguments: argparse.Namespace) -> int:
    async def body(bk) -> None:
        rh = await bk.open_ledger(arguments.ledger_id, arguments.password.encode(), recovery=True)
        print(json.dumps({"ledger_id": rh.ledger_id, "state": rh.metadata.state.value,
                          "last_entry_id": rh.metadata.last_entry_id, "length": rh.metadata.length}))

    return _run(arguments, body)


def delete(arguments: argparse.Namespace) -> int:
    async def body(bk) -> None:
        await bk.delete_ledger(arguments.ledger_id)
        print(json.dumps({"deleted": arguments.ledger_id}))

    return _run(arguments, body)
