"""Bookie identity cookies: the start-up decision (`check_cookies`) for a new
bookie, a restart, and every way directories and ZooKeeper can disagree; and
the directory cookie files themselves."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

from bookie.cookie import (
    COOKIE_FILE,
    Cookie,
    CookieError,
    check_cookies,
    directory_is_empty,
    read_directory_cookie,
    write_directory_cookie,
)

JOURNAL = "/data/bookie-1/journal"
LEDGERS = "/data/bookie-1/ledgers"
EXPECTED = Cookie(instance_id="instance-a", bookie_id="10.0.0.1:3181", journal_dir=JOURNAL, ledger_dir=LEDGERS)


def both(value):
    return {JOURNAL: value, LEDGERS: value}


def refusal(registered, directory_cookies, directories_empty) -> str:
    """The CookieError message for a start that must be refused."""
    with pytest.raises(CookieError) as raised:
        check_cookies(EXPECTED, registered, directory_cookies, directories_empty)
    return str(raised.value)


# --- the start-up decision -------------------------------------------------


def test_new_bookie_on_empty_directories_may_start_and_writes_cookies():
    # Nothing anywhere: a brand-new bookie; True tells the caller to write the cookies.
    assert check_cookies(EXPECTED, None, both(None), both(True)) is True


def test_restart_with_every_cookie_matching_starts_without_writing():
    # A normal restart: ZooKeeper and both directories hold this bookie's cookie.
    assert check_cookies(EXPECTED, EXPECTED, both(EXPECTED), both(False)) is False


def test_restart_does_not_care_whether_directories_hold_data():
    # Emptiness matters only for a new bookie; a known one may have empty directories.
    assert check_cookies(EXPECTED, EXPECTED, both(EXPECTED), both(True)) is False


@pytest.mark.parametrize("wiped_directory_holds_data", [False, True], ids=["emptied", "replaced"])
def test_wiped_directory_of_a_known_bookie_is_refused(wiped_directory_holds_data):
    # ZooKeeper knows the bookie, the journal still has its cookie, but the
    # ledger directory lost it: the bookie would rejoin without its fence bits.
    message = refusal(
        EXPECTED,
        {JOURNAL: EXPECTED, LEDGERS: None},
        {JOURNAL: False, LEDGERS: not wiped_directory_holds_data},
    )
    assert "wiped or replaced" in message
    assert "fence bits" in message
    assert "quire bookie format" in message
    assert LEDGERS in message
    assert JOURNAL not in message
    assert EXPECTED.bookie_id in message


def test_every_wiped_directory_is_named():
    message = refusal(EXPECTED, both(None), both(True))
    assert "wiped or replaced" in message
    assert JOURNAL in message and LEDGERS in message
    assert "fence bits" in message
    assert "quire bookie format" in message


@pytest.mark.parametrize(
    "field, foreign_value",
    [("bookie_id", "10.0.0.2:3181"), ("instance_id", "instance-b")],
    ids=["another-bookie", "another-cluster"],
)
@pytest.mark.parametrize("zookeeper_knows_the_bookie", [True, False], ids=["known", "new"])
def test_swapped_directory_is_refused(field, foreign_value, zookeeper_knows_the_bookie):
    # The ledger directory holds the cookie of another bookie (or of this
    # bookie id in another cluster): the disks were swapped or misconfigured.
    # That is refused whether or not ZooKeeper knows this bookie.
    foreign = dataclasses.replace(EXPECTED, **{field: foreign_value})
    message = refusal(
        EXPECTED if zookeeper_knows_the_bookie else None,
        {JOURNAL: EXPECTED, LEDGERS: foreign},
        both(False),
    )
    assert "belongs to another bookie" in message
    assert LEDGERS in message
    assert repr(foreign_value) in message
    assert repr(getattr(EXPECTED, field)) in message
    assert "quire bookie format" in message


def test_directory_cookie_naming_other_directories_is_refused():
    # A cookie of this very bookie, but written for another directory layout.
    moved = dataclasses.replace(EXPECTED, ledger_dir="/old/ledgers")
    message = refusal(EXPECTED, {JOURNAL: EXPECTED, LEDGERS: moved}, both(False))
    assert "belongs to another bookie" in message
    assert "/old/ledgers" in message


def test_directory_cookies_without_one_in_zookeeper_are_refused():
    # The directories say they belong to this bookie, but ZooKeeper has never
    # heard of it: its metadata was reset, or this is another cluster.
    message = refusal(None, both(EXPECTED), both(False))
    assert "ZooKeeper has none" in message
    assert JOURNAL in message and LEDGERS in message
    assert "quire bookie format" in message


def test_one_directory_cookie_without_one_in_zookeeper_is_refused():
    message = refusal(None, {JOURNAL: None, LEDGERS: EXPECTED}, {JOURNAL: True, LEDGERS: False})
    assert "ZooKeeper has none" in message
    assert LEDGERS in message


def test_new_bookie_on_a_directory_with_data_but_no_cookie_is_refused():
    # Starting a new bookie on a directory that holds something else would mix
    # foreign files with the bookie's.
    message = refusal(None, both(None), {JOURNAL: True, LEDGERS: False})
    assert "hold data but no cookie" in message
    assert LEDGERS in message
    assert JOURNAL not in message


def test_zookeeper_cookie_for_other_directories_is_refused():
    # The bookie was pointed at new, empty directories: ZooKeeper's cookie
    # still names the old ones. Reported as changed directories, not as a wipe.
    registered = dataclasses.replace(EXPECTED, journal_dir="/old/journal", ledger_dir="/old/ledgers")
    message = refusal(registered, both(None), both(True))
    assert "directories changed" in message
    assert "/old/journal" in message and "/old/ledgers" in message
    assert "wiped" not in message
    assert "quire bookie format" in message


def test_zookeeper_cookie_of_another_instance_is_refused_even_if_directories_match():
    registered = dataclasses.replace(EXPECTED, instance_id="instance-b")
    message = refusal(registered, both(EXPECTED), both(False))
    assert "directories changed" in message
    assert "'instance-b'" in message


def test_differences_name_each_differing_field():
    other = dataclasses.replace(EXPECTED, bookie_id="x:1", layout_version=2)
    assert EXPECTED.differences(EXPECTED) == []
    assert EXPECTED.differences(other) == [
        f"bookie_id 'x:1' instead of {EXPECTED.bookie_id!r}",
        "layout_version 2 instead of 1",
    ]


# --- cookie files ---------------------------------------------------------


def test_directory_cookie_round_trips(tmp_path):
    write_directory_cookie(tmp_path, EXPECTED)
    assert read_directory_cookie(tmp_path) == EXPECTED


def test_writing_a_cookie_replaces_the_old_one(tmp_path):
    write_directory_cookie(tmp_path, dataclasses.replace(EXPECTED, bookie_id="old:1"))
    write_directory_cookie(tmp_path, EXPECTED)
    assert read_directory_cookie(tmp_path) == EXPECTED


def test_atomic_write_leaves_only_the_cookie_behind(tmp_path):
    write_directory_cookie(tmp_path, EXPECTED)
    write_directory_cookie(tmp_path, EXPECTED)
    assert os.listdir(tmp_path) == [COOKIE_FILE]


def test_directory_without_cookie_reads_as_none(tmp_path):
    assert read_directory_cookie(tmp_path) is None


def test_cookie_bytes_are_json_of_every_field():
    assert json.loads(EXPECTED.to_bytes()) == dataclasses.asdict(EXPECTED)
    assert Cookie.from_bytes(EXPECTED.to_bytes(), "test") == EXPECTED


@pytest.mark.parametrize(
    "contents",
    [
        b"",
        b"\x00\xff\xfe garbage",
        EXPECTED.to_bytes()[:20],  # torn write
        b"[1, 2, 3]",
        b"null",
        json.dumps({"instance_id": "instance-a", "bookie_id": "b"}).encode(),  # fields missing
        json.dumps({**dataclasses.asdict(EXPECTED), "surprise": 1}).encode(),  # unknown field
    ],
    ids=["empty", "binary", "truncated", "list", "null", "missing-fields", "unknown-field"],
)
def test_unreadable_cookie_file_refuses_to_start(tmp_path, contents):
    (tmp_path / COOKIE_FILE).write_bytes(contents)
    with pytest.raises(CookieError) as raised:
        read_directory_cookie(tmp_path)
    message = str(raised.value)
    assert str(tmp_path / COOKIE_FILE) in message
    assert "unreadable" in message
    assert "refusing to start" in message


def test_unreadable_cookie_in_zookeeper_names_where_it_came_from():
    with pytest.raises(CookieError, match="cookie in ZooKeeper /cookies/b is unreadable"):
        Cookie.from_bytes(b"{", "ZooKeeper /cookies/b")


def test_new_directory_is_empty(tmp_path):
    assert directory_is_empty(tmp_path)


@pytest.mark.parametrize("name", ["lost+found", COOKIE_FILE, COOKIE_FILE + ".tmp"])
def test_file_system_and_cookie_leftovers_do_not_count_as_data(tmp_path, name):
    # A fresh file system's lost+found, or a cookie from a start that crashed
    # before registering, leaves the directory fit for a new bookie.
    if name == "lost+found":
        (tmp_path / name).mkdir()
    else:
        (tmp_path / name).write_bytes(EXPECTED.to_bytes())
    assert directory_is_empty(tmp_path)


def test_cookie_written_by_the_helper_keeps_directory_empty(tmp_path):
    write_directory_cookie(tmp_path, EXPECTED)
    assert directory_is_empty(tmp_path)


@pytest.mark.parametrize("name", ["journal", ".hidden", "COOKIE.bak", "lost+found2"])
@pytest.mark.parametrize("kind", ["file", "directory"])
def test_anything_else_makes_a_directory_non_empty(tmp_path, name, kind):
    (tmp_path / "lost+found").mkdir()
    write_directory_cookie(tmp_path, EXPECTED)
    if kind == "file":
        (tmp_path / name).write_bytes(b"")
    else:
        (tmp_path / name).mkdir()
    assert not directory_is_empty(tmp_path)
