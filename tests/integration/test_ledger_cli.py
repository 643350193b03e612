"""`quire ledger ...` against a real cluster, as an operator would use it:
create with entries, list, show, read, leave one open and recover it,
delete; and one-line errors with exit 2 for what an operator can fix."""

from __future__ import annotations

import json

import trio

from tests.integration.bookie_processes import bookies  # noqa: F401  (fixture)
from tests.integration.test_cli_errors import error_line, quire


async def test_ledger_commands_end_to_end(bookies, zk_hosts, zk_root):
    for _ in range(3):
        bookies.new().start()
    async with trio.open_nursery() as nursery:
        for bookie in bookies.created:
            nursery.start_soon(bookie.wait_serving)
    where = ("--zk", zk_hosts, "--root", zk_root)

    created = quire("ledger", "create", *where, "--password", "pw", "--entries", "25", "--entry-bytes", "64")
    assert created.returncode == 0, created.stderr
    ledger = json.loads(created.stdout)
    assert ledger["entries"] == 25 and ledger["state"] == "CLOSED" and ledger["last_add_confirmed"] == 24

    left_open = json.loads(quire("ledger", "create", *where, "--password", "pw", "--entries", "5", "--no-close").stdout)
    assert left_open["state"] == "OPEN"

    listed = quire("ledger", "ls", *where)
    assert listed.stdout.split() == [str(ledger["ledger_id"]), str(left_open["ledger_id"])]

    shown = json.loads(quire("ledger", "show", *where, str(ledger["ledger_id"])).stdout)
    assert shown["state"] == "CLOSED" and shown["last_entry_id"] == 24 and len(shown["ensembles"]["0"]) == 3

    read = quire("ledger", "read", *where, "--password", "pw", str(ledger["ledger_id"]), "--first", "3", "--last", "5")
    assert read.returncode == 0, read.stderr
    lines = read.stdout.splitlines()
    assert [line.split("\t")[0] for line in lines] == ["3", "4", "5"]
    assert lines[0].split("\t")[1].startswith("entry-3 ")

    recovered = json.loads(quire("ledger", "recover", *where, "--password", "pw", str(left_open["ledger_id"])).stdout)
    assert recovered == {"ledger_id": left_open["ledger_id"], "state": "CLOSED", "last_entry_id": 4, "length": 5 * 1024}

    wrong = quire("ledger", "read", *where, "--password", "nope", str(ledger["ledger_id"]))
    assert "wrong password" in error_line(wrong)

    assert quire("ledger", "delete", *where, str(ledger["ledger_id"])).returncode == 0
    missing = quire("ledger", "show", *where, str(ledger["ledger_id"]))
    assert "does not exist" in error_line(missing)


def test_bad_ledger_arguments_exit_2():
    assert "must not be negative" in error_line(quire("ledger", "show", "-1"))
    assert "not an integer" in error_line(quire("ledger", "create", "--ensemble-size", "zero"))
    assert "ensemble_size >= write_quorum" in error_line(
        quire("ledger", "create", "--zk", "127.0.0.1:1", "-E", "2", "-W", "3")
    )
