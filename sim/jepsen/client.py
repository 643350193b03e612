"""The client processes of a Jepsen-style run, each recording its operations
to its own history file (merged by the controller): a writer creates ledgers
and pipelines adds into them, a reader reads ledgers as it finds them and
now and then recovers the newest open ledger while its writer is still
writing (fencing it), and the final reader (after the faults heal) recovers
every ledger and reads it whole. Each keeps an ephemeral znode, so that the
controller can tell its ZooKeeper session from ZooKeeper's own list. Run as
`python -m sim.jepsen.client writer|reader|final ...`."""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys

import trio

from coordination.store import MetadataError, MetadataStore, NodeExistsError
from coordination.zk_store import KazooMetadataStore
from ledger_client import BookKeeper
from ledger_client.errors import BKError
from ledger_client.metadata import LedgerState
from sim.jepsen.client_process import (
    client_parser,
    error_text,
    role_nursery,
    run_client,
)
from sim.jepsen.history import HistoryWriter

PASSWORD = b"jepsen"
CALL_DEADLINE_S = 30.0  # one create/close/read/recover
RETRY_DELAY_S = 0.5
FINAL_DEADLINE_S = 180.0  # every ledger recovered and read back
RECENT_LEDGERS = 10  # readers read (and recover) among the newest ledgers
# How often a reader's turn recovers the newest open ledger instead of
# reading: each such recovery fences a writer in the middle of its adds.
READER_RECOVER_PROBABILITY = 0.1
SESSION_MARKER = "/jepsen/sessions/{name}"  # under the root; ephemeral
SESSION_MARKER_INTERVAL_S = 0.5

log = logging.getLogger("quire.jepsen.client")


async def writer(bk: BookKeeper, history: HistoryWriter, name: str, options: argparse.Namespace) -> None:
    rng = random.Random(f"{options.seed}-{name}")
    sequence = 0
    while True:
        history.append(name, "invoke", "create", {})
        try:
            with trio.fail_after(CALL_DEADLINE_S):
                handle = await bk.create_ledger(
                    options.ensemble_size, options.write_quorum, options.ack_quorum, password=PASSWORD
                )
        except (BKError, MetadataError, trio.TooSlowError) as error:
            # The ledger may exist (a create that timed out): indeterminate.
            history.append(name, "info", "create", {"error": error_text(error)})
            await trio.sleep(RETRY_DELAY_S)
            continue
        ledger_id = handle.ledger_id
        history.append(name, "ok", "create", {"ledger": ledger_id})

        def completed(pending, op_id: int, payload: str) -> None:
            if pending.error is None:
                history.append(name, "ok", "add", {"op_id": op_id, "ledger": ledger_id, "entry": pending.entry_id, "payload": payload})
            else:
                # Failed adds may still be in the ledger (recovery keeps what
                # reached an ack quorum): indeterminate.
                history.append(name, "info", "add", {"op_id": op_id, "ledger": ledger_id, "payload": payload, "error": error_text(pending.error)})

        for _ in range(rng.randint(1, options.entries_per_ledger_max)):
            sequence += 1
            payload = f"{name}:{sequence}"
            history.append(name, "invoke", "add", {"op_id": sequence, "ledger": ledger_id, "payload": payload})
            try:
                await handle.submit_add(
                    payload.encode(), on_done=lambda pending, op_id=sequence, payload=payload: completed(pending, op_id, payload)
                )
            except BKError as error:
                history.append(name, "info", "add", {"op_id": sequence, "ledger": ledger_id, "payload": payload, "error": error_text(error)})
                break
            if options.add_gap_ms:
                await trio.sleep(rng.uniform(0, 2 * options.add_gap_ms) / 1000)
        history.append(name, "invoke", "close", {"ledger": ledger_id})
        try:
            with trio.fail_after(CALL_DEADLINE_S):
                await handle.close()
        except (BKError, trio.TooSlowError) as error:
            # The compare-and-set may have landed: indeterminate.
            history.append(name, "info", "close", {"ledger": ledger_id, "error": error_text(error)})
            continue
        history.append(name, "ok", "close", {"ledger": ledger_id, "last_entry": handle.last_add_confirmed})


async def _read(bk: BookKeeper, history: HistoryWriter, name: str, ledger_id: int, *, final: bool) -> bool:
    """Read a ledger whole (up to its LAC if open) and record it."""
    history.append(name, "invoke", "read", {"ledger": ledger_id})
    try:
        with trio.fail_after(CALL_DEADLINE_S):
            handle = await bk.open_ledger(ledger_id, PASSWORD, recovery=False)
            last_entry_id = handle.last_add_confirmed
            entries = []
            if last_entry_id >= 0:
                async for entry in handle.read(0, last_entry_id):
                    entries.append([entry.entry_id, bytes(entry.data).decode()])
    except (BKError, MetadataError, trio.TooSlowError) as error:
        history.append(name, "fail", "read", {"ledger": ledger_id, "error": error_text(error)})
        return False
    value = {"ledger": ledger_id, "closed": handle.is_closed, "last_entry": last_entry_id, "entries": entries}
    if final:
        value["final"] = True
    history.append(name, "ok", "read", value)
    return True


async def _recover(bk: BookKeeper, history: HistoryWriter, name: str, ledger_id: int) -> bool:
    """Open a ledger with recovery (fencing its writer, closing it) and
    record where it ends."""
    history.append(name, "invoke", "recover", {"ledger": ledger_id})
    try:
        with trio.fail_after(CALL_DEADLINE_S):
            handle = await bk.open_ledger(ledger_id, PASSWORD, recovery=True)
    except (BKError, MetadataError, trio.TooSlowError) as error:
        history.append(name, "fail", "recover", {"ledger": ledger_id, "error": error_text(error)})
        return False
    history.append(name, "ok", "recover", {"ledger": ledger_id, "last_entry": handle.last_add_confirmed})
    return True


async def _newest_open_ledger(bk: BookKeeper, ledger_ids: list[int]) -> int | None:
    for ledger_id in reversed(ledger_ids[-RECENT_LEDGERS:]):
        try:
            metadata = await bk.ledger_metadata(ledger_id)
        except (BKError, MetadataError):
            continue
        if metadata.state is LedgerState.OPEN:
            return ledger_id
    return None


async def reader(bk: BookKeeper, history: HistoryWriter, name: str, options: argparse.Namespace) -> None:
    rng = random.Random(f"{options.seed}-{name}")
    while True:
        try:
            ledger_ids = await bk.list_ledgers()
        except (BKError, MetadataError):
            ledger_ids = []
        if ledger_ids and rng.random() < READER_RECOVER_PROBABILITY:
            # Recovery racing a live writer, as a broker taking over a topic
            # whose owner still writes: the writer is fenced, its adds
            # beyond the close fail (info), and it must never be told one of
            # them is safe.
            ledger_id = await _newest_open_ledger(bk, ledger_ids)
            if ledger_id is not None and await _recover(bk, history, name, ledger_id):
                await _read(bk, history, name, ledger_id, final=False)
        elif ledger_ids:
            # Mostly recent ledgers: the ones being written and recovered.
            await _read(bk, history, name, rng.choice(ledger_ids[-RECENT_LEDGERS:]), final=False)
        await trio.sleep(rng.uniform(0.05, 0.3))


async def final(bk: BookKeeper, history: HistoryWriter, name: str, options: argparse.Namespace) -> None:
    """Recover every ledger, then read each one whole; retry until done."""
    with trio.move_on_after(FINAL_DEADLINE_S):
        remaining = sorted(await bk.list_ledgers())
        while remaining:
            ledger_id = remaining[0]
            if not await _recover(bk, history, name, ledger_id):
                remaining.append(remaining.pop(0))
                await trio.sleep(RETRY_DELAY_S)
                continue
            if await _read(bk, history, name, ledger_id, final=True):
                remaining.pop(0)
            else:
                remaining.append(remaining.pop(0))


async def keep_session_marker(store: MetadataStore, name: str) -> None:
    """Keep an ephemeral znode of this client's session (created again
    under each new session after one expires), so that the controller can
    find the session in ZooKeeper and confirm the nemesis expired it."""
    path = SESSION_MARKER.format(name=name)

    def ensure() -> None:
        try:
            store.create(path, b"", ephemeral=True, make_parents=True)
        except NodeExistsError:
            pass

    while True:
        try:
            await trio.to_thread.run_sync(ensure, abandon_on_cancel=True)
        except MetadataError:
            pass  # ZooKeeper unreachable: try again
        await trio.sleep(SESSION_MARKER_INTERVAL_S)


ROLES = {"writer": writer, "reader": reader, "final": final}


async def main_async(options: argparse.Namespace) -> None:
    # Times are taken from the controller's start, on the shared monotonic clock.
    with HistoryWriter(options.history, origin_s=options.start_monotonic) as history:
        store = await trio.to_thread.run_sync(
            lambda: KazooMetadataStore.connect(options.zk, options.root, session_timeout_ms=options.session_timeout_ms)
        )
        async with BookKeeper.open(
            store, address_map=json.loads(options.address_map), pending_adds_max=options.window,
            add_timeout_ms=options.add_timeout_ms,
        ) as bk:
            async with role_nursery() as nursery:
                nursery.start_soon(keep_session_marker, store, options.name)
                await ROLES[options.role](bk, history, options.name, options)


def parse_arguments(argv: list[str]) -> argparse.Namespace:
    parser = client_parser("python -m sim.jepsen.client", ROLES)
    parser.add_argument("--zk", required=True)
    parser.add_argument("--root", default="/quire")
    parser.add_argument("--history", required=True)
    parser.add_argument("--address-map", default="{}", help="JSON: registered bookie address -> address to dial")
    parser.add_argument("--ensemble-size", type=int, default=3)
    parser.add_argument("--write-quorum", type=int, default=3)
    parser.add_argument("--ack-quorum", type=int, default=2)
    parser.add_argument("--entries-per-ledger-max", type=int, default=200)
    parser.add_argument("--window", type=int, default=32)
    parser.add_argument("--add-gap-ms", type=float, default=2.0)
    parser.add_argument("--add-timeout-ms", type=int, default=3_000)
    parser.add_argument("--session-timeout-ms", type=int, default=6_000)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    return run_client(parse_arguments, main_async, argv)


if __name__ == "__main__":
    sys.exit(main())
