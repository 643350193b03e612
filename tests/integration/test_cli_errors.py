"""The real `quire` command line under bad arguments and bad configuration:
each prints what is wrong on one line starting with `quire`, exits 2, and
never shows a traceback."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import trio

from tests.integration.bookie_processes import BookieProcess
from tests.support import free_port, free_port_run

REPOSITORY = Path(__file__).resolve().parents[2]
EXIT_USAGE = 2
# "quire bookie run: error: ..." from a command, "quire: error: ..." from the
# top-level parser (which reports unrecognised arguments).
ERROR_LINE = re.compile(r"^quire(?: [a-z-]+)*: error: ")


def quire(*arguments: str, timeout_s: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "quire", *map(str, arguments)],
        cwd=REPOSITORY,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def error_line(result: subprocess.CompletedProcess, *key_words: str) -> str:
    """Check the rule for operator errors and return the one error line."""
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == EXIT_USAGE, (result.returncode, result.stderr)
    lines = [line for line in result.stderr.splitlines() if ERROR_LINE.match(line)]
    assert len(lines) == 1, result.stderr
    for word in key_words:
        assert word in lines[0], (word, lines[0])
    return lines[0]


@pytest.fixture
def directories(tmp_path) -> list[str]:
    """--journal-dir and --ledger-dir in a fresh temporary directory."""
    return ["--journal-dir", str(tmp_path / "journal"), "--ledger-dir", str(tmp_path / "ledgers")]


@pytest.fixture
def dead_zookeeper() -> str:
    return f"127.0.0.1:{free_port()}"


@pytest.fixture
def busy_port():
    """A port something already listens on."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        yield listener.getsockname()[1]


# --- rejected by the parser -------------------------------------------------


def test_unknown_flag(directories):
    line = error_line(quire("bookie", "run", "--bogus", *directories), "unrecognized arguments", "--bogus")
    assert "--help" in line


def test_unknown_subcommand():
    line = error_line(quire("bookie", "runn"), "invalid choice", "'runn'")
    assert line.startswith("quire bookie: ")
    assert "'run'" in line  # says what would have been accepted


@pytest.mark.parametrize(
    "flag, value, key_words",
    [
        ("--port", "70000", ["--port", "1..65535", "70000"]),
        ("--port", "x", ["--port", "not a port number", "'x'"]),
        ("--port", "0", ["--port", "1..65535"]),
        ("--write-cache-bytes", "lots", ["--write-cache-bytes", "not a size in bytes", "'lots'"]),
        ("--disk-usage-threshold", "1.5", ["--disk-usage-threshold", "(0, 1]", "1.5"]),
        ("--disk-usage-threshold", "full", ["--disk-usage-threshold", "not a number"]),
        ("--session-timeout-ms", "0", ["--session-timeout-ms", "at least 1"]),
    ],
)
def test_bad_value_is_named(directories, flag, value, key_words):
    line = error_line(quire("bookie", "run", flag, value, *directories), *key_words)
    assert line.startswith("quire bookie run: error: ")


def test_inconsistent_disk_limits_are_refused(directories, dead_zookeeper):
    # Each value is a valid fraction; together they are not.
    error_line(
        quire("bookie", "run", "--zk", dead_zookeeper, "--disk-usage-threshold", "0.8", "--disk-usage-lwm", "0.9", *directories),
        "quire bookie run: error: ", "disk_usage_lwm", "disk_usage_threshold",
    )


def test_same_journal_and_ledger_directory_is_refused(tmp_path, dead_zookeeper):
    same = str(tmp_path / "data")
    error_line(
        quire("bookie", "run", "--zk", dead_zookeeper, "--journal-dir", same, "--ledger-dir", same),
        "quire bookie run: error: ", "must differ",
    )


# --- rejected when the bookie starts ----------------------------------------


def test_unreachable_zookeeper_is_named_within_the_startup_timeout(directories, dead_zookeeper):
    # Nothing listens at the address: the bookie tries again (ZooKeeper may
    # be starting too) and gives up at its start-up deadline, not never.
    started = time.monotonic()
    result = quire("bookie", "run", "--zk", dead_zookeeper, "--startup-timeout", "3s", *directories, timeout_s=30)
    elapsed_s = time.monotonic() - started
    error_line(result, "quire bookie run: error: ", "within 3s", "could not reach ZooKeeper", dead_zookeeper)
    assert elapsed_s < 15


@pytest.mark.parametrize("hosts", ["", "127.0.0.1:2181/quire"], ids=["empty", "chroot-in-hosts"])
def test_malformed_zookeeper_address_is_refused(directories, hosts):
    error_line(quire("bookie", "run", "--zk", hosts, *directories), "quire bookie run: error: ")


def test_journal_directory_that_cannot_be_created(tmp_path, dead_zookeeper):
    # Tests run as root, where permission bits do not stop writes; a path
    # under a regular file cannot be created by anyone.
    (tmp_path / "afile").write_text("not a directory\n")
    journal = tmp_path / "afile" / "journal"
    error_line(
        quire("bookie", "run", "--zk", dead_zookeeper, "--journal-dir", journal, "--ledger-dir", tmp_path / "ledgers"),
        "quire bookie run: error: ", "cannot create the journal directory", str(journal), "Not a directory",
    )


def test_ledger_directory_that_is_a_file(tmp_path, dead_zookeeper):
    afile = tmp_path / "afile"
    afile.write_text("not a directory\n")
    error_line(
        quire("bookie", "run", "--zk", dead_zookeeper, "--journal-dir", tmp_path / "journal", "--ledger-dir", afile),
        "quire bookie run: error: ", "ledger directory", str(afile),
    )


def test_port_in_use(tmp_path, zk_hosts, zk_root, busy_port):
    # ZooKeeper is up and the directories are fine: the bookie gets as far as
    # opening its listening socket, which another process holds.
    result = quire(
        "bookie", "run", "--zk", zk_hosts, "--root", zk_root, "--port", busy_port,
        "--journal-dir", tmp_path / "journal", "--ledger-dir", tmp_path / "ledgers",
    )
    error_line(result, "quire bookie run: error: ", f"cannot listen on 127.0.0.1:{busy_port}", "in use")
    # It wrote no cookie before it failed: the same directories start on a
    # free port, although the bookie's id (its address) is another now.
    bookie = BookieProcess(zk_hosts, zk_root, tmp_path, free_port(), [])
    try:
        trio.run(bookie.started)
    finally:
        if bookie.running:
            bookie.kill()


# --- other commands -----------------------------------------------------------


def test_format_without_force_deletes_nothing(tmp_path, dead_zookeeper):
    journal = tmp_path / "journal"
    journal.mkdir()
    (journal / "1.txn").write_bytes(b"data")
    result = quire(
        "bookie", "format", "--zk", dead_zookeeper, "--bookie-id", "127.0.0.1:3181",
        "--journal-dir", journal, "--ledger-dir", tmp_path / "ledgers",
    )
    error_line(result, "quire bookie format: error: ", "--force")
    assert (journal / "1.txn").read_bytes() == b"data"


def test_format_of_a_directory_that_is_a_file(tmp_path, zk_hosts, zk_root):
    afile = tmp_path / "afile"
    afile.write_text("not a directory\n")
    result = quire(
        "bookie", "format", "--force", "--zk", zk_hosts, "--root", zk_root, "--bookie-id", "127.0.0.1:3181",
        "--journal-dir", afile, "--ledger-dir", tmp_path / "ledgers",
    )
    error_line(result, "quire bookie format: error: ", str(afile))


def test_info_of_a_bookie_that_is_not_there():
    address = f"127.0.0.1:{free_port()}"
    error_line(quire("bookie", "info", address), "quire bookie info: error: ", "cannot connect", address)


@pytest.mark.parametrize("address", ["nonsense", "127.0.0.1", ":3181", "127.0.0.1:port"])
def test_info_of_a_malformed_address(address):
    error_line(quire("bookie", "info", address), "quire bookie info: error: ", "HOST:PORT", repr(address))


def test_status_of_a_directory_without_cluster(tmp_path):
    error_line(
        quire("cluster", "status", "--data-dir", tmp_path), "quire cluster status: error: ", "no cluster", str(tmp_path)
    )


def test_down_of_a_directory_without_cluster(tmp_path):
    error_line(quire("cluster", "down", "--data-dir", tmp_path), "quire cluster down: error: ", "no cluster")


@pytest.mark.parametrize("command", ["status", "down", "up"])
@pytest.mark.parametrize("contents", ["garbage\n", '{"data_dir": "x"}\n'], ids=["not-json", "fields-missing"])
def test_damaged_cluster_state_file(tmp_path, busy_port, command, contents):
    # A crash while saving, or a hand edit, damaged the state file. For `up`,
    # the busy ZooKeeper port makes sure nothing starts even once the file is
    # handled.
    (tmp_path / "cluster.json").write_text(contents)
    # status and down can only report the damage; up may refuse for another
    # reason (the busy port) once it copes with the file.
    extra = ["--zk-port", busy_port, "--bookie-base-port", free_port_run(3)] if command == "up" else []
    key_words = ["cluster.json"] if command != "up" else []
    error_line(quire("cluster", command, "--data-dir", tmp_path, *extra), f"quire cluster {command}: error: ", *key_words)


def test_cluster_data_directory_that_cannot_be_created(tmp_path, busy_port):
    (tmp_path / "afile").write_text("not a directory\n")
    data_dir = tmp_path / "afile" / "cluster"
    error_line(
        quire("cluster", "up", "--data-dir", data_dir, "--zk-port", busy_port, "--bookie-base-port", free_port_run(3)),
        "quire cluster up: error: ", str(data_dir),
    )


def test_cluster_up_with_a_negative_broker_count(tmp_path, busy_port):
    result = quire("cluster", "up", "--data-dir", tmp_path, "--brokers", "-1", "--zk-port", busy_port, "--bookie-base-port", free_port_run(3))
    error_line(result, "quire cluster up: error: ", "--brokers")


def test_cluster_up_with_a_busy_broker_port(tmp_path, busy_port):
    result = quire("cluster", "up", "--data-dir", tmp_path, "--zk-port", free_port(), "--bookie-base-port", free_port_run(3),
                   "--broker-base-port", busy_port)
    error_line(result, "quire cluster up: error: ", str(busy_port))


# --- every process command: bookie, broker, zk, cluster up ---------------------

PROCESS_COMMANDS = {
    "bookie run": ["bookie", "run", "--journal-dir", "{tmp}/journal", "--ledger-dir", "{tmp}/ledgers"],
    "broker run": ["broker", "run"],
    "zk run": ["zk", "run", "--data-dir", "{tmp}/zookeeper"],
    "cluster up": ["cluster", "up", "--data-dir", "{tmp}/cluster"],
}


def process_command(name: str, tmp_path: Path, *extra) -> list[str]:
    return [part.format(tmp=tmp_path) for part in PROCESS_COMMANDS[name]] + [str(part) for part in extra]


def only_line(result: subprocess.CompletedProcess, *key_words: str) -> str:
    """The error is the one line the command printed."""
    line = error_line(result, *key_words)
    assert [text for text in result.stderr.splitlines() if text.strip()] == [line], result.stderr
    return line


def read_only_directory() -> str:
    """An existing directory that even root cannot write in."""
    for candidate in ("/proc/sys", "/sys"):
        probe = Path(candidate) / f"quire-probe-{os.getpid()}"
        try:
            probe.write_bytes(b"")
        except OSError:
            return candidate
        probe.unlink()
    pytest.skip("no read-only directory on this machine")


@pytest.mark.parametrize("command", PROCESS_COMMANDS)
def test_unknown_flag_of_every_process_command(tmp_path, command):
    only_line(quire(*process_command(command, tmp_path, "--bogus")), "unrecognized arguments", "--bogus")


@pytest.mark.parametrize("command", ["bookie run", "broker run"])
@pytest.mark.parametrize("hosts", ["127.0.0.1:port", "127.0.0.1:99999"], ids=["port-not-a-number", "port-out-of-range"])
def test_unparsable_zookeeper_address(tmp_path, command, hosts):
    only_line(quire(*process_command(command, tmp_path, "--zk", hosts)), f"quire {command}: error: ", "ZooKeeper", repr(hosts))


def test_broker_names_an_unreachable_zookeeper_within_the_startup_timeout(tmp_path, dead_zookeeper):
    # Each try logs a warning; the error is the one line at the deadline.
    started = time.monotonic()
    result = quire(*process_command("broker run", tmp_path, "--zk", dead_zookeeper, "--startup-timeout", "3s"), timeout_s=30)
    error_line(result, "quire broker run: error: ", "within 3s", "could not reach ZooKeeper", dead_zookeeper)
    assert time.monotonic() - started < 15


@pytest.mark.parametrize("which", ["--journal-dir", "--ledger-dir"])
def test_bookie_directory_without_write_permission(tmp_path, dead_zookeeper, which):
    directory = read_only_directory()
    directories = {"--journal-dir": tmp_path / "journal", "--ledger-dir": tmp_path / "ledgers", which: directory}
    result = quire("bookie", "run", "--zk", dead_zookeeper, *[str(part) for pair in directories.items() for part in pair])
    only_line(result, "quire bookie run: error: ", directory, "not writable")


def test_bookie_directory_that_cannot_be_made_in_a_read_only_place(tmp_path, dead_zookeeper):
    journal = f"{read_only_directory()}/quire-journal"
    result = quire("bookie", "run", "--zk", dead_zookeeper, "--journal-dir", journal, "--ledger-dir", tmp_path / "ledgers")
    only_line(result, "quire bookie run: error: ", f"cannot create the journal directory {journal}")


@pytest.mark.parametrize("command", ["zk run", "cluster up"])
def test_data_directory_without_write_permission(tmp_path, command):
    directory = read_only_directory()
    arguments = [part if not part.startswith(str(tmp_path)) else directory for part in process_command(command, tmp_path)]
    only_line(quire(*arguments, "--zk-port" if command == "cluster up" else "--port", free_port()),
              f"quire {command}: error: ", f"data directory {directory}", "not writable")


def test_zookeeper_data_directory_under_a_file(tmp_path):
    (tmp_path / "afile").write_text("not a directory\n")
    data_dir = tmp_path / "afile" / "zookeeper"
    only_line(quire("zk", "run", "--port", free_port(), "--data-dir", data_dir),
              "quire zk run: error: ", f"cannot create the data directory {data_dir}", "Not a directory")


def test_zookeeper_port_in_use(tmp_path, busy_port):
    only_line(quire(*process_command("zk run", tmp_path, "--port", busy_port)), "quire zk run: error: ", str(busy_port), "in use")


def test_broker_port_in_use(tmp_path, zk_hosts, zk_root, busy_port):
    result = quire("broker", "run", "--zk", zk_hosts, "--root", zk_root, "--port", busy_port)
    error_line(result, "quire broker run: error: ", f"cannot listen on 127.0.0.1:{busy_port}", "in use")


@pytest.mark.parametrize("command", ["bookie run", "broker run"])
def test_metrics_port_that_is_the_service_port(tmp_path, dead_zookeeper, command):
    result = quire(*process_command(command, tmp_path, "--zk", dead_zookeeper, "--port", "7000", "--metrics-port", "7000"))
    only_line(result, f"quire {command}: error: ", "metrics", "7000")


@pytest.mark.parametrize("command", ["bookie run", "broker run"])
def test_metrics_port_that_is_not_a_port(tmp_path, command):
    only_line(quire(*process_command(command, tmp_path, "--metrics-port", "x")), "--metrics-port", "'x'")


def test_cluster_up_with_a_busy_bookie_port(tmp_path, busy_port):
    result = quire(*process_command("cluster up", tmp_path, "--zk-port", free_port(), "--bookie-base-port", busy_port,
                                    "--metrics-base-port", 0))
    only_line(result, "quire cluster up: error: ", str(busy_port), "in use")
    assert not (tmp_path / "cluster" / "zookeeper").exists()  # nothing started


def test_cluster_up_with_a_busy_metrics_port(tmp_path, busy_port):
    result = quire(*process_command("cluster up", tmp_path, "--zk-port", free_port(), "--bookie-base-port", free_port_run(3),
                                    "--broker-base-port", free_port_run(1), "--metrics-base-port", busy_port))
    only_line(result, "quire cluster up: error: ", str(busy_port), "in use")


def test_cluster_up_with_a_file_where_the_logs_go(tmp_path):
    data_dir = tmp_path / "cluster"
    data_dir.mkdir()
    (data_dir / "logs").write_text("not a directory")
    result = quire("cluster", "up", "--data-dir", data_dir, "--zk-port", free_port(), "--bookie-base-port", free_port_run(3),
                   "--broker-base-port", free_port_run(1), "--metrics-base-port", 0)
    only_line(result, "quire cluster up: error: ", "cannot start zookeeper", str(data_dir / "logs"))


@pytest.mark.parametrize("words", [
    ["bookie", "ls"], ["autorecovery", "status"], ["autorecovery", "disable"], ["autorecovery", "enable"],
    ["export", "some-topic", "--out", "{tmp}/out"],
], ids=" ".join)
def test_one_shot_commands_print_only_their_error_line_when_zookeeper_is_down(tmp_path, words):
    # kazoo's reconnect warnings would come first, one per try, without the
    # logging quire.cli.main sets up for every command.
    arguments = [word.format(tmp=tmp_path) for word in words]
    only_line(quire(*arguments, "--zk", "127.0.0.1:1"), f"quire {words[0]}", ": error: ", "could not reach ZooKeeper at 127.0.0.1:1")


def test_zookeeper_address_with_a_chroot_points_to_root(tmp_path):
    only_line(quire("bookie", "ls", "--zk", "127.0.0.1:2181/quire"), "quire bookie ls: error: ", "--root")


def test_a_zookeeper_that_accepts_but_never_answers_is_named_within_the_connect_timeout():
    with socket.socket() as silent:  # the kernel accepts connections; nobody answers them
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        started = time.monotonic()
        result = quire("bookie", "ls", "--zk", address)
        elapsed_s = time.monotonic() - started
    only_line(result, "quire bookie ls: error: ", f"could not reach ZooKeeper at {address} within 5.0s")
    assert elapsed_s < 8, elapsed_s  # 5 s and the interpreter's start, not twice 5 s


def test_cluster_up_with_metrics_ports_overlapping_the_bookies(tmp_path):
    base = free_port()
    result = quire(*process_command("cluster up", tmp_path, "--zk-port", free_port(), "--bookie-base-port", base,
                                    "--metrics-base-port", base + 1))
    only_line(result, "quire cluster up: error: ", "overlap", str(base + 1))


def every_command() -> list[list[str]]:
    """Every command line the parser knows, as its words (`bookie run`, `produce`, ...)."""
    from quire.cli import build_parser

    def walk(parser, words):
        actions = [action for action in parser._actions if action.__class__.__name__ == "_SubParsersAction"]
        if not actions:
            return [words]
        return [found for name, sub in actions[0].choices.items() for found in walk(sub, words + [name])]

    return walk(build_parser(), [])


@pytest.mark.parametrize("words", every_command(), ids=" ".join)
def test_unknown_flag_of_every_command_is_a_usage_error(words, capsys):
    # In-process: the parser alone decides, before any handler runs.
    from quire.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main([*words, "--bogus"])
    assert exit_info.value.code == EXIT_USAGE
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and ERROR_LINE.match(lines[0]) and "Traceback" not in lines[0], lines


# --- numbers out of range, and arguments that contradict each other ------------


@pytest.mark.parametrize("arguments, key_words", [
    (["topic", "create", "t", "--partitions", "99999999999999999999"], ["--partitions", "at most 10000"]),
    (["produce", "t", "--count", "1", "--size", "99999999999999"], ["--size", "at most 1GiB"]),
    (["ledger", "read", "0", "--first", "10", "--last", "2"], ["--first 10", "--last 2"]),
    (["consume", "t", "-s", "s", "--idle-timeout", "-5s"], ["--idle-timeout", "must not be negative"]),
    (["ledger", "create", "-E", "2", "-W", "3"], ["2/3/"]),
], ids=["topic create", "produce", "ledger read", "consume", "ledger create"])
def test_refused_before_zookeeper_is_touched(zk_hosts, zk_root, arguments, key_words):
    # A real ZooKeeper is there: connecting would have created the chroot
    # (and a topic or a ledger after it). The arguments are refused first.
    only_line(quire(*arguments, "--zk", zk_hosts, "--root", zk_root), *key_words)
    from coordination.zk_store import KazooMetadataStore

    with KazooMetadataStore.connect(zk_hosts, "/", session_timeout_ms=4_000) as whole_tree:
        assert whole_tree.exists(zk_root) is None


# --- ZooKeeper refusing a start-up step (no permission) -----------------------
#
# Not ZooKeeper slow or away, so not worth waiting out the start-up deadline
# for: one line naming the step, exit 2, at once. Each test makes part of its
# chroot read-only with a ZooKeeper ACL (anyone may read, delete and change
# the ACL back, nobody may create).

REFUSED_WITHIN_S = 30  # well inside the 60 s start-up deadline: refused at once, not timed out


@contextlib.contextmanager
def read_only_nodes(zk_hosts: str, *paths: str):
    """Make each of `paths` (created if missing) read-only, and writable again after."""
    from kazoo.client import KazooClient
    from kazoo.security import OPEN_ACL_UNSAFE, make_acl

    client = KazooClient(hosts=zk_hosts, timeout=10)
    client.start(timeout=10)
    try:
        for path in paths:
            client.ensure_path(path)
            client.set_acls(path, [make_acl("world", "anyone", read=True, delete=True, admin=True)])
        yield
    finally:
        for path in paths:
            if client.exists(path):
                client.set_acls(path, OPEN_ACL_UNSAFE)
        client.stop()
        client.close()


def timed_quire(*arguments) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    result = quire(*arguments, timeout_s=120)
    return result, time.monotonic() - started


def test_a_bookie_refused_its_cookie_says_so_in_one_line(tmp_path, zk_hosts, zk_root):
    with read_only_nodes(zk_hosts, zk_root):
        result, elapsed_s = timed_quire(*process_command("bookie run", tmp_path, "--zk", zk_hosts, "--root", zk_root,
                                                         "--port", free_port(), "--no-autorecovery"))
    error_line(result, "quire bookie run: error: ", "bookie did not start: could not check the bookie's cookies",
               "NoAuth")
    assert elapsed_s < REFUSED_WITHIN_S


def test_a_bookie_refused_its_registration_stops_cleanly_with_one_line(tmp_path, zk_hosts, zk_root):
    from coordination.cluster_layout import ClusterLayout, ensure_cluster_layout
    from coordination.zk_store import KazooMetadataStore

    layout = ClusterLayout()
    with KazooMetadataStore.connect(zk_hosts, zk_root, session_timeout_ms=4_000) as store:
        ensure_cluster_layout(store, layout)
    port = free_port()
    with read_only_nodes(zk_hosts, zk_root + layout.bookie_registration("x", read_only=False).rpartition("/")[0]):
        result, elapsed_s = timed_quire(*process_command("bookie run", tmp_path, "--zk", zk_hosts, "--root", zk_root,
                                                         "--port", port, "--no-autorecovery"))
    error_line(result, "quire bookie run: error: ", f"could not register bookie 127.0.0.1:{port} under /bookies",
               "NoAuth")
    assert elapsed_s < REFUSED_WITHIN_S
    assert "stopping bookie" in result.stderr  # the clean way: journal drained, then the line


def test_a_broker_refused_its_nodes_says_so_in_one_line(tmp_path, zk_hosts, zk_root):
    with read_only_nodes(zk_hosts, zk_root):
        result, elapsed_s = timed_quire(*process_command("broker run", tmp_path, "--zk", zk_hosts, "--root", zk_root,
                                                         "--port", free_port()))
    error_line(result, "quire broker run: error: ", "broker did not start: could not create the broker's nodes", "NoAuth")
    assert elapsed_s < REFUSED_WITHIN_S


def test_auto_recovery_refused_its_chroot_says_so_in_one_line(zk_hosts, zk_root):
    with read_only_nodes(zk_hosts, zk_root):
        result, elapsed_s = timed_quire("autorecovery", "run", "--zk", zk_hosts, "--root", zk_root + "/cluster")
    error_line(result, "quire autorecovery run: error: ", "auto-recovery did not start", "NoAuth")
    assert elapsed_s < REFUSED_WITHIN_S
