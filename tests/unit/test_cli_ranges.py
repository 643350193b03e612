"""Every number the `quire` command line takes has a range, checked while
parsing: a value past either end is one error line and exit 2, before any
command runs (no ZooKeeper connection, no topic created, nothing written).
Arguments that contradict each other are refused the same way, before the
command does anything."""

from __future__ import annotations

import argparse
import contextlib
import io
import re
from pathlib import Path

import pytest
import trio

from quire import cli, cli_ranges, cli_reference
from quire.cli import build_parser, main
from quire.cli_parsing import EXIT_USAGE, Bounded, HostPorts, Listeners
from quire.export_commands import spark_setting
from quire.jepsen_commands import nemesis_faults
from quire.cli import _zk_auth
from quire.security_options import _roles
from quire.tenant_commands import _actions, _namespace, _names
from quire.subscription_commands import _message_id, _policy_names, _position

# Nothing listens there: a command that got as far as ZooKeeper would fail
# with "could not reach ZooKeeper", not with the range's message.
DEAD_ZOOKEEPER = "127.0.0.1:1"
ERROR_LINE = re.compile(r"^quire(?: [a-z-]+)*: error: ")
# Types of arguments that hold no number.
NOT_NUMBERS = (None, str, Path, spark_setting, nemesis_faults, _zk_auth, _roles, _names, _namespace, _actions,
               _position, _message_id, _policy_names)  # a message id's parts are bounded as ledger and entry ids
# Words in an argument's name that say it is a number: such an argument
# without a range would be a number nobody bounds.
NUMBER_WORDS = ("port", "count", "size", "bytes", "_ms", "seed", "jobs", "timeout", "interval", "partitions", "window",
                "quorum", "entries", "time", "delay", "grace", "_max", "first", "last", "writers", "readers", "bookies",
                "brokers", "duration", "show", "keys", "threshold", "lwm", "_id", "_s")
# ... and those that are names or addresses all the same.
NOT_NUMBER_NAMES = {"bookie_id", "broker_id", "producer_id", "advertised_host", "auth_token_secret_key", "message_id"}


def leaf_commands() -> list[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    return [(path, parser) for path, parser, _ in cli_reference.walk(build_parser()) if cli_reference.is_leaf(parser)]


def arguments_of(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [action for action in parser._actions
            if not isinstance(action, (argparse._HelpAction, argparse._SubParsersAction))]


def numeric_arguments() -> list[tuple[tuple[str, ...], str]]:
    """(command, argument name) of every argument with a range, the common ones once."""
    found, common_seen = [], set()
    for path, parser in leaf_commands():
        for action in arguments_of(parser):
            if not isinstance(action.type, (Bounded, HostPorts)):
                continue
            name = _name(action)
            if name in cli_reference.COMMON_OPTIONS:
                if name in common_seen:
                    continue
                common_seen.add(name)
            found.append((path, name))
    return found


def _name(action: argparse.Action) -> str:
    return action.option_strings[-1] if action.option_strings else action.metavar or action.dest


def _find(path: tuple[str, ...], name: str) -> tuple[argparse.ArgumentParser, argparse.Action]:
    parser = dict(leaf_commands())[path]
    return parser, next(action for action in arguments_of(parser) if _name(action) == name)


def valid_text(action: argparse.Action, tmp_path: Path) -> str:
    """A value the argument takes."""
    kind = action.type
    if isinstance(kind, Bounded):
        return kind.show(kind.high if kind.low_open else kind.low) if kind.kind != "duration" else f"{kind.low}ms"
    if isinstance(kind, HostPorts):
        return "127.0.0.1:1"
    if action.choices:
        return str(next(iter(action.choices)))
    if kind is Path or "dir" in action.dest or action.dest == "out":
        return str(tmp_path / action.dest)
    if kind is _namespace:
        return "tenant/namespace"
    return "x"


def out_of_range(action: argparse.Action) -> dict[str, str]:
    """Values past each end of the argument's range, and one absurdly large."""
    kind = action.type
    if isinstance(kind, HostPorts):
        return {"too large": "127.0.0.1:65536", "too small": "127.0.0.1:0", "absurd": "127.0.0.1:" + "9" * 30,
                "a thousand digits": "127.0.0.1:" + "9" * 1000}
    assert isinstance(kind, Bounded)
    suffix = "ms" if kind.kind == "duration" else ""
    too_small = kind.low if kind.low_open else kind.low - 1
    return {
        "too large": f"{kind.high + 1}{suffix}",
        "too small": f"{too_small}{suffix}",
        "absurd": "9" * 30 + suffix,
        "a thousand digits": "9" * 1000,
    }


def command_line(path: tuple[str, ...], parser: argparse.ArgumentParser, tested: argparse.Action | None, value: str,
                 tmp_path: Path) -> list[str]:
    """`quire PATH ...` with `value` for the tested argument and every
    required one filled in with a valid value."""
    required = {action for action in arguments_of(parser) if action.required or not action.option_strings}
    for group in parser._mutually_exclusive_groups:
        if group.required and tested not in group._group_actions:
            required.add(group._group_actions[0])
    words = [*path]
    if tested is not None and tested.option_strings:
        words += [tested.option_strings[-1], value]
    for action in arguments_of(parser):
        if action is tested or action not in required or action.nargs == argparse.REMAINDER:
            continue
        if action.option_strings:
            words += [action.option_strings[-1], valid_text(action, tmp_path)]
    if "--zk" in parser._option_string_actions and (tested is None or "--zk" not in tested.option_strings):
        words += ["--zk", DEAD_ZOOKEEPER]
    for action in arguments_of(parser):
        if action.option_strings or action.nargs == argparse.REMAINDER:
            continue
        words.append(value if action is tested else valid_text(action, tmp_path))
    return words


@pytest.fixture
def handlers_ran(monkeypatch) -> list[str]:
    """Every command's handler replaced by one that records that it ran."""
    ran: list[str] = []
    real_build_parser = cli.build_parser

    def build_parser_recording() -> argparse.ArgumentParser:
        parser = real_build_parser()
        for path, sub in [(path, sub) for path, sub, _ in cli_reference.walk(parser) if cli_reference.is_leaf(sub)]:
            sub.set_defaults(handler=lambda arguments, path=path: ran.append(" ".join(path)) or 0)
        return parser

    monkeypatch.setattr(cli, "build_parser", build_parser_recording)
    return ran


@pytest.fixture
def no_side_effects(monkeypatch) -> None:
    """The real handlers run, but nothing that connects or starts anything may."""

    def refused(*arguments, **options):
        raise AssertionError("a command ran its event loop (connected, started a process) despite bad arguments")

    monkeypatch.setattr(trio, "run", refused)


def run_quire(argv: list[str]) -> tuple[int, list[str]]:
    """Exit status and the non-empty lines of standard error of `quire argv`."""
    with contextlib.redirect_stderr(io.StringIO()) as errors, contextlib.redirect_stdout(io.StringIO()):
        try:
            status = main(argv)
        except SystemExit as exit_:
            status = exit_.code
    return status, [line for line in errors.getvalue().splitlines() if line.strip()]


def usage_error(argv: list[str], *key_words: str) -> str:
    """Check the rule for a refused command line and return its one error line."""
    status, lines = run_quire(argv)
    assert status == EXIT_USAGE, (argv, status, lines)
    assert len(lines) == 1, lines
    assert ERROR_LINE.match(lines[0]) and "Traceback" not in lines[0], lines
    assert "could not reach ZooKeeper" not in lines[0], lines
    for word in key_words:
        assert word in lines[0], (word, lines[0])
    return lines[0]


# --- every number has a range ------------------------------------------------------------


def test_every_number_has_a_range():
    unbounded = []
    for path, parser in leaf_commands():
        for action in arguments_of(parser):
            if isinstance(action.type, (Bounded, HostPorts, Listeners)):  # Listeners checks its ports as HostPorts
                continue
            name = action.dest
            if action.type not in NOT_NUMBERS or (
                action.nargs != 0 and not action.choices and name not in NOT_NUMBER_NAMES
                and any(word in name for word in NUMBER_WORDS)
            ):
                unbounded.append(f"quire {' '.join(path)} {_name(action)}")
    assert not unbounded, "numbers without a range: " + ", ".join(unbounded)


def test_the_walk_finds_the_numbers_of_every_kind():
    # A walk that found nothing would make the tests below pass vacuously.
    found = {(" ".join(path), name) for path, name in numeric_arguments()}
    for expected in [("topic create", "--partitions"), ("produce", "--size"), ("produce", "--count"),
                     ("consume", "--idle-timeout"), ("ledger read", "--last"), ("ledger read", "ID"),
                     ("bookie run", "--frame-bytes-max"), ("bookie run", "--gc-interval-s"), ("sim", "--jobs"),
                     ("bookie info", "address"), ("export", "--start-time")]:
        assert expected in found, expected
    assert len(found) > 80


@pytest.mark.parametrize("which", ["too large", "too small", "absurd", "a thousand digits"])
@pytest.mark.parametrize("path, name", numeric_arguments(), ids=lambda item: " ".join(item) if isinstance(item, tuple) else item)
def test_a_number_out_of_range_is_refused_while_parsing(path, name, which, tmp_path, handlers_ran):
    parser, action = _find(path, name)
    line = usage_error(command_line(path, parser, action, out_of_range(action)[which], tmp_path), name)
    assert line.startswith(f"quire {' '.join(path)}: error: "), line
    assert handlers_ran == []
    assert list(tmp_path.iterdir()) == []  # no directory made either


@pytest.mark.parametrize("path, name", [item for item in numeric_arguments()
                                        if isinstance(_find(*item)[1].type, Bounded)],
                         ids=lambda item: " ".join(item) if isinstance(item, tuple) else item)
def test_both_ends_of_a_range_are_taken(path, name, tmp_path):
    parser, action = _find(path, name)
    kind = action.type
    ends = [kind.high] if kind.low_open else [kind.low, kind.high]
    for end in ends:
        text = f"{end}ms" if kind.kind == "duration" else str(end)
        arguments = build_parser().parse_args(command_line(path, parser, action, text, tmp_path))
        assert getattr(arguments, action.dest) == end


def test_help_and_reference_show_each_range():
    help_text = io.StringIO()
    with contextlib.redirect_stdout(help_text), pytest.raises(SystemExit):
        main(["topic", "create", "--help"])
    assert "range 0..10000" in " ".join(help_text.getvalue().split())
    assert "| `--partitions` `PARTITIONS` | `0` | `0..10000` |" in cli_reference.REFERENCE_PATH.read_text()


def test_bounds_come_from_the_code_they_protect():
    from broker.client.producer import CHUNKED_MESSAGE_BYTES_MAX, MESSAGE_BYTES_MAX
    from broker.topic_records import PARTITIONS_MAX
    from ledger_client.ledger_handle import ENTRY_BYTES_MAX

    assert cli_ranges.partitions.high == PARTITIONS_MAX == 10_000
    assert cli_ranges.MESSAGE_BYTES_MAX == MESSAGE_BYTES_MAX == 5 * 1024**2  # past it, in chunks
    assert cli_ranges.message_bytes.high == CHUNKED_MESSAGE_BYTES_MAX
    assert cli_ranges.entry_bytes.high == ENTRY_BYTES_MAX
    assert cli_ranges.frame_bytes.high == 2**32 - 1


# --- the findings of issue 21 ---------------------------------------------------------------


def test_partitions_past_the_brokers_limit(handlers_ran):
    # Was an OverflowError traceback while the request was encoded.
    usage_error(["topic", "create", "t", "--partitions", "99999999999999999999", "--zk", DEAD_ZOOKEEPER],
                "quire topic create: error: ", "--partitions", "at most 10000")
    assert handlers_ran == []


def test_message_size_past_the_producers_limit(handlers_ran):
    # Was a MemoryError, after the topic had been created.
    usage_error(["produce", "t", "--count", "1", "--size", "99999999999999", "--zk", DEAD_ZOOKEEPER],
                "quire produce: error: ", "--size", "at most 1GiB")
    assert handlers_ran == []


def test_a_message_past_5_mib_needs_chunking():
    # Said before anything is connected to.
    usage_error(["produce", "t", "--count", "1", "--size", "6MiB", "--zk", DEAD_ZOOKEEPER],
                "quire produce: error: ", "--size 6291456", "add --chunking")


def test_first_entry_after_the_last_is_refused(no_side_effects):
    # Was exit 0 with nothing printed.
    usage_error(["ledger", "read", "0", "--first", "10", "--last", "2", "--zk", DEAD_ZOOKEEPER],
                "quire ledger read: error: ", "--first 10", "--last 2")


@pytest.mark.parametrize("words", [["--idle-timeout", "-5s"], ["--idle-timeout=-5s"]], ids=["space", "equals"])
def test_a_negative_duration_must_not_be_negative(words, handlers_ran):
    # `--idle-timeout -5s` said "expected one argument".
    line = usage_error(["consume", "t", "-s", "s", *words, "--zk", DEAD_ZOOKEEPER],
                       "quire consume: error: ", "--idle-timeout", "must not be negative", "'-5s'")
    assert "expected one argument" not in line
    assert handlers_ran == []


def test_a_negative_positional_must_not_be_negative(handlers_ran):
    usage_error(["ledger", "show", "-1", "--zk", DEAD_ZOOKEEPER], "ID", "must not be negative")
    assert handlers_ran == []


# --- arguments that contradict each other -------------------------------------------------


CONTRADICTIONS = [
    (["ledger", "create", "-E", "2", "-W", "3"], ["ensemble_size >= write_quorum >= ack_quorum", "2/3/"]),
    (["ledger", "create", "-E", "3", "-W", "2", "-A", "3"], ["3/2/3"]),
    (["ledger", "create", "--stdin", "--entries", "5"], ["--stdin", "--entries"]),
    (["ledger", "create", "--entry-bytes", "10"], ["--entry-bytes", "--entries"]),
    (["topic", "create", "t", "-W", "2", "-A", "3"], ["--ack-quorum 3", "--write-quorum 2"]),
    (["topic", "create", "t", "-E", "2", "-A", "3"], ["--ack-quorum 3", "--ensemble-size 2"]),
    (["topic", "set-policies", "t", "-E", "2", "-W", "3"], ["--write-quorum 3", "--ensemble-size 2"]),
    (["produce", "t", "--size", "10"], ["--size", "--count"]),
    (["produce", "t", "--keys", "3", "--key", "k"], ["--keys", "--count"]),
    (["produce", "t", "--count", "5", "--keys", "3"], ["--keys", "--key"]),
    (["sim", "--seed", "1", "--jobs", "2"], ["--jobs", "--seeds"]),
    (["sim", "--seed", "1", "--first-seed", "2"], ["--first-seed", "--seeds"]),
    (["sim", "--seeds", "10", "--first-seed", str(cli_ranges.SEED_MAX)], ["--first-seed", "--seeds", "past the last seed"]),
    (["bookie", "simpletest", "--count", "20000", "--entry-bytes", "16000KiB"], ["--count 20000", "--entry-bytes", "memory"]),
    (["export", "t", "--out", "{tmp}/out", "--start-time", "2000", "--end-time", "1000"], ["end_time", "start_time"]),
    (["bookie", "run", "--journal-dir", "{tmp}/j", "--ledger-dir", "{tmp}/l", "--disk-usage-threshold", "0.8",
      "--disk-usage-lwm", "0.9"], ["disk_usage_lwm", "disk_usage_threshold"]),
    (["broker", "run", "-E", "2", "-W", "3"], ["ensemble_size >= write_quorum"]),
    (["cluster", "up", "--data-dir", "{tmp}/cluster", "--bookie-base-port", "65534", "--bookies", "3"], ["65535"]),
    (["cluster", "up", "--data-dir", "{tmp}/cluster", "--bookie-base-port", "4000", "--broker-base-port", "4001"], ["overlap"]),
]


def command_of(argv: list[str]) -> tuple[str, ...]:
    """The command words at the start of `argv` (`topic create`, `produce`)."""
    paths = {path for path, _ in leaf_commands()}
    return next(tuple(argv[:length]) for length in (2, 1) if tuple(argv[:length]) in paths)


@pytest.mark.parametrize("argv, key_words", [pytest.param(argv, words, id=" ".join(argv)) for argv, words in CONTRADICTIONS])
def test_contradictory_arguments_are_refused_before_anything_happens(argv, key_words, tmp_path, no_side_effects):
    words = [word.format(tmp=tmp_path) for word in argv]
    line = usage_error([*words, "--zk", DEAD_ZOOKEEPER], *key_words)
    assert line.startswith(f"quire {' '.join(command_of(argv))}: error: "), line
    assert list(tmp_path.iterdir()) == []  # no directory made, no file written


def test_generated_messages_have_exactly_the_size_asked():
    # --size 8 used to give 16-byte messages (the number was never cut).
    from quire.topic_commands import _generated

    for size in (1, 8, 15, 16, 17, 1024, cli_ranges.MESSAGE_BYTES_MAX):
        for number in (0, 7, 10**15, 10**17):
            assert len(_generated(number, size)) == size, (number, size)
    assert _generated(42, 8) == b"00000042"
    assert _generated(42, 20) == b"000000000000042 xxxx"


# --- the benchmarks' own flags (`quire bench NAME ARGS`) ---------------------------------


def benchmark_parsers() -> list[tuple[str, argparse.ArgumentParser]]:
    import importlib

    from quire.bench_commands import BENCHMARKS

    return [(name, importlib.import_module(f"bench.{name}").build_parser()) for name in sorted(BENCHMARKS)]


def test_every_number_of_every_benchmark_has_a_range():
    # They took raw `type=int`/`float`: `--seconds -5` ran a benchmark of minus five seconds.
    unbounded = [f"quire bench {name} {_name(action)}" for name, parser in benchmark_parsers()
                 for action in arguments_of(parser) if action.type in (int, float)]
    assert not unbounded, "benchmark numbers without a range: " + ", ".join(unbounded)
    bounded = [action for _, parser in benchmark_parsers() for action in arguments_of(parser) if isinstance(action.type, Bounded)]
    assert len(bounded) > 30


BENCHMARK_REFUSALS = [
    (["ledger_write", "--seconds", "-5"], ["--seconds", "must be more than 0", "'-5'"]),
    (["ledger_write", "--window", "0"], ["--window", "at least 1"]),
    (["bookie_add", "--windows", "1,-3"], ["--windows", "at least 1"]),
    (["autorecovery", "--bookies", "3"], ["--bookies", "at least 4"]),
    (["broker_memory", "--messages", "99999999999999999999"], ["--messages", "at most"]),
    (["bookie_gc", "--ledgers", "9", "--keep", "4"], ["--ledgers 9", "--keep 4"]),
    (["soak", "--cycles", "0"], ["--cycles", "at least 1"]),
    # Ledgers and backlog messages took any 64-bit count: a typo of a few
    # digits ran for days, or exhausted ZooKeeper or memory, before failing.
    (["ledger_write", "--ledgers", "100001"], ["--ledgers", "at most 100000", "ZooKeeper"]),
    (["metrics_overhead", "--ledgers", "9223372036854775807"], ["--ledgers", "at most 100000"]),
    (["autorecovery", "--ledgers", "1000000"], ["--ledgers", "at most 100000"]),
    (["bookie_gc", "--ledgers", "200000"], ["--ledgers", "at most 100000"]),
    (["broker_pubsub", "--backlog", "100000001"], ["--backlog", "at most 100000000"]),
    (["broker_pubsub", "--backlog", "0"], ["--backlog", "at least 1"]),
]


@pytest.fixture
def no_benchmark_runs(monkeypatch, no_side_effects) -> None:
    """A benchmark that got past its arguments would start a cluster first."""
    import importlib

    from quire.bench_commands import BENCHMARKS

    def refused(*arguments, **options):
        raise AssertionError("a benchmark started despite bad arguments")

    for name in BENCHMARKS:
        module = importlib.import_module(f"bench.{name}")
        if hasattr(module, "bench_cluster"):
            monkeypatch.setattr(module, "bench_cluster", refused)


@pytest.mark.parametrize("argv, key_words", [pytest.param(argv, words, id=" ".join(argv)) for argv, words in BENCHMARK_REFUSALS])
def test_a_benchmark_flag_out_of_range_is_one_line_before_anything_runs(argv, key_words, no_benchmark_runs):
    status, lines = run_quire(["bench", *argv])
    assert status == EXIT_USAGE, (status, lines)
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"quire bench {argv[0]}: error: "), lines
    for word in key_words:
        assert word in lines[0], (word, lines[0])
