"""The command reference, docs/cli.md, rendered from the argparse tree.

The page is generated so that it cannot drift from the parser:
`scripts/cli-reference` rewrites it, and a test fails when it is stale.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Iterator

from quire.cli import build_parser
from quire.cli_parsing import default_text, range_text

REFERENCE_PATH = Path(__file__).resolve().parent.parent / "docs" / "cli.md"
COMMON_OPTIONS = ("--zk", "--root", "--log-level", "--log-format")

HEADER = """\
# Command reference

Every `quire` command and its flags, generated from the command line's own
parser by `scripts/cli-reference` (a test fails when this page is stale).
[operations.md](operations.md) explains the same flags grouped by task.

Every number has a range, checked before the command does anything: a
value outside it is an error (exit 2). Sizes take units (4096, 64KiB,
16MiB, 1GiB), durations too (500ms, 30s, 10m, 4h, 7d; a bare number is
seconds).

Every command also takes the common flags:

| flag | default | range | what |
|---|---|---|---|
"""


def walk(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser, str]]:
    """Yield (command path, parser, one-line help) for every command, depth first, in the parser's order."""
    for action in parser._actions:
        if not isinstance(action, argparse._SubParsersAction):
            continue
        helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
        for name, sub in action.choices.items():
            yield (*path, name), sub, helps.get(name, "")
            yield from walk(sub, (*path, name))


def is_leaf(parser: argparse.ArgumentParser) -> bool:
    return not any(isinstance(action, argparse._SubParsersAction) for action in parser._actions)


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _flag_names(action: argparse.Action) -> str:
    if not action.option_strings:
        return f"`{action.metavar or action.dest.upper()}`"
    names = ", ".join(f"`{name}`" for name in action.option_strings)
    if action.nargs == 0:
        return names
    metavar = action.metavar or (
        "{" + ",".join(str(choice) for choice in action.choices) + "}" if action.choices else action.dest.upper()
    )
    return f"{names} `{metavar}`"


def _default(action: argparse.Action) -> str:
    if action.required and action.nargs != argparse.REMAINDER:
        return "required"
    shown = default_text(action)
    return "" if shown is None else f"`{shown}`"


def _range(action: argparse.Action) -> str:
    shown = range_text(action)
    return "" if shown is None else f"`{shown}`"


def _help(action: argparse.Action) -> str:
    text = action.help or ""
    if "%" in text:
        text = text % {**vars(action), "prog": "", "default": action.default}
    # The default has a column of its own: a parenthesis that only repeats it goes.
    shown = default_text(action)
    if shown is not None:
        text = re.sub(rf"\s*\(default:? {re.escape(shown)}\)", "", text)
    return _cell(text)


def _option_rows(parser: argparse.ArgumentParser, skip: tuple[str, ...]) -> list[str]:
    rows = []
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)) or action.help == argparse.SUPPRESS:
            continue
        if any(name in skip for name in action.option_strings):
            continue
        rows.append(f"| {_flag_names(action)} | {_default(action)} | {_range(action)} | {_help(action)} |")
    return rows


def render(parser: argparse.ArgumentParser) -> str:
    commands = [(path, sub, help_text) for path, sub, help_text in walk(parser) if is_leaf(sub)]
    first = commands[0][1]
    lines = [HEADER.rstrip("\n")]
    lines += _option_rows(first, skip=tuple(name for name in first._option_string_actions if name not in COMMON_OPTIONS))
    lines += ["", "## Commands", ""]
    lines += [f"- [`quire {' '.join(path)}`](#{_anchor(path)}): {_cell(help_text)}" for path, _, help_text in commands]
    for path, sub, help_text in commands:
        lines += ["", f"## quire {' '.join(path)}", ""]
        description = sub.description or help_text
        if description:
            lines += [_cell(description)[0].upper() + _cell(description)[1:] + ".", ""]
        usage = " ".join(sub.format_usage().split())
        usage = usage.removeprefix("usage: ")
        for name in COMMON_OPTIONS:
            usage = _drop_optional(usage, name)
        lines += ["```", usage, "```"]
        rows = _option_rows(sub, skip=COMMON_OPTIONS)
        if rows:
            lines += ["", "| flag | default | range | what |", "|---|---|---|---|", *rows]
    return "\n".join(lines) + "\n"


def _drop_optional(usage: str, name: str) -> str:
    """Take `[--name ...]` out of a usage line (the common flags are listed once, at the top)."""
    start = usage.find(f"[{name}")
    if start < 0:
        return usage
    depth = 0
    for index in range(start, len(usage)):
        if usage[index] == "[":
            depth += 1
        elif usage[index] == "]":
            depth -= 1
            if depth == 0:
                return (usage[:start] + usage[index + 1:]).replace("  ", " ")
    return usage


def _anchor(path: tuple[str, ...]) -> str:
    """GitHub's slug of the heading `quire <path>`."""
    return "-".join(("quire", *path)).lower()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/cli-reference", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/cli.md is not what the parser renders")
    arguments = parser.parse_args(argv)
    text = render(build_parser())
    if arguments.check:
        current = REFERENCE_PATH.read_text() if REFERENCE_PATH.exists() else ""
        if current != text:
            print(f"{REFERENCE_PATH} is stale: run scripts/cli-reference", file=sys.stderr)
            return 1
        return 0
    REFERENCE_PATH.parent.mkdir(exist_ok=True)
    REFERENCE_PATH.write_text(text)
    print(f"wrote {REFERENCE_PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
