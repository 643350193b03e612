"""Every `quire` command and subcommand answers `--help` with exit 0 and no
traceback, and docs/cli.md is what the parser renders today."""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys

import pytest

from quire import cli_reference
from quire.cli import build_parser, main

COMMAND_PATHS = [()] + [path for path, _, _ in cli_reference.walk(build_parser())]


@pytest.mark.parametrize("path", COMMAND_PATHS, ids=lambda path: " ".join(path) or "quire")
def test_help_exits_zero_with_usage(path):
    output = io.StringIO()
    with contextlib.redirect_stdout(output), contextlib.redirect_stderr(io.StringIO()) as errors:
        with pytest.raises(SystemExit) as exit_:
            main([*path, "--help"])
    assert exit_.value.code == 0, errors.getvalue()
    assert output.getvalue().startswith("usage: quire")
    assert "Traceback" not in errors.getvalue()


def test_the_tree_has_every_command_of_the_design():
    # The commands docs/cli.md documents; a command lost from the tree would
    # silently drop out of the parametrised test above.
    names = {" ".join(path) for path in COMMAND_PATHS}
    for expected in ("cluster up", "cluster down", "cluster status", "zk run", "bookie run", "bookie info",
                     "broker run", "ledger create", "ledger ls", "ledger show", "ledger read", "ledger recover",
                     "ledger delete", "topic create", "topic ls", "topic stats", "topic delete", "produce",
                     "consume", "export", "sim", "jepsen"):
        assert expected in names


def test_help_through_the_installed_entry_point():
    # The console script, not just main(): a help text with a stray `%`
    # fails only when argparse formats it.
    result = subprocess.run([sys.executable, "-m", "quire", "produce", "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    assert "--producer-id" in result.stdout


def test_cli_reference_is_current():
    rendered = cli_reference.render(build_parser())
    assert cli_reference.REFERENCE_PATH.read_text() == rendered, "docs/cli.md is stale: run scripts/cli-reference"


def test_cli_reference_lists_every_flag_of_every_command():
    text = cli_reference.REFERENCE_PATH.read_text()
    for path, parser, _ in cli_reference.walk(build_parser()):
        if not cli_reference.is_leaf(parser):
            continue
        section = text.split(f"\n## quire {' '.join(path)}\n", 1)[1].split("\n## ", 1)[0]
        for option in parser._option_string_actions:
            if option.startswith("--") and option not in ("--help", *cli_reference.COMMON_OPTIONS):
                assert f"`{option}`" in section, (path, option)


def test_quire_bench_offers_every_benchmark():
    from pathlib import Path

    from quire.bench_commands import BENCHMARKS

    modules = {path.stem for path in (Path(__file__).resolve().parents[2] / "bench").glob("*.py")
               if "def main(" in path.read_text()}
    assert set(BENCHMARKS) == modules


@pytest.mark.parametrize("benchmark", sorted(__import__("quire.bench_commands").bench_commands.BENCHMARKS))
def test_each_benchmark_answers_help(benchmark):
    output = io.StringIO()
    with contextlib.redirect_stdout(output), contextlib.redirect_stderr(io.StringIO()):
        with pytest.raises(SystemExit) as exit_:
            main(["bench", benchmark, "--help"])
    assert exit_.value.code == 0
    assert output.getvalue().startswith("usage:")
