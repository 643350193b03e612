"""The documentation holds together: every relative link and `#anchor` in
README.md and docs/*.md resolves, every `quire` command shown in the README's
```sh blocks exists with the flags it uses, and no commit hash or numbered
run of this repository's history appears in code or docs."""

from __future__ import annotations

import contextlib
import io
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from quire import cli_reference
from quire.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "bench" / "RESULTS.md"]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~)")


def _prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks (links in code are not links)."""
    lines, inside = [], False
    for line in text.splitlines():
        if FENCE.match(line.strip()):
            inside = not inside
            continue
        if not inside:
            lines.append(line)
    return lines


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())  # a link's text only
    text = text.lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    counts: dict[str, int] = {}
    for line in _prose_lines(path.read_text()):
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        anchor = github_anchor(match.group(1))
        seen = counts.get(anchor, 0)
        counts[anchor] = seen + 1
        found.add(anchor if seen == 0 else f"{anchor}-{seen}")
    found.update(re.findall(r"<a (?:name|id)=\"([^\"]+)\"", path.read_text()))
    return found


def test_the_documents_exist():
    for name in ("architecture.md", "operations.md", "testing.md", "decisions.md", "cli.md"):
        assert (ROOT / "docs" / name).is_file(), name
    assert (ROOT / "bench" / "RESULTS.md").is_file()
    assert len((ROOT / "README.md").read_text().splitlines()) <= 320, "README.md is the front page: keep it short"


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda path: str(path.relative_to(ROOT)))
def test_relative_links_and_anchors_resolve(document):
    broken = []
    for line in _prose_lines(document.read_text()):
        for target in LINK.findall(line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            path_part, _, anchor = target.partition("#")
            linked = (document.parent / path_part).resolve() if path_part else document
            if not linked.exists():
                broken.append(f"{target}: no such file")
                continue
            if anchor and linked.suffix == ".md" and anchor not in anchors(linked):
                broken.append(f"{target}: no heading with anchor #{anchor} in {linked.name}")
    assert not broken, f"{document.name}: " + "; ".join(broken)


def test_anchor_slugs_follow_github():
    assert github_anchor("Bounds and limits") == "bounds-and-limits"
    assert github_anchor("`quire cluster up`: a local cluster") == "quire-cluster-up-a-local-cluster"
    assert github_anchor("Recovery (fencing, then closing)") == "recovery-fencing-then-closing"


def _shell_commands(text: str) -> list[str]:
    """The `quire ...` command lines of ```sh blocks, continuations joined, comments dropped."""
    commands, inside, pending = [], False, ""
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("```"):
            inside = stripped in ("```sh", "```bash", "```shell")
            continue
        if not inside:
            continue
        stripped = pending + re.sub(r"\s+#.*$", "", stripped).removeprefix("$ ")
        if stripped.endswith("\\"):
            pending = stripped[:-1] + " "
            continue
        pending = ""
        for part in re.split(r"\s*(?:&&|\|\||;|\||[0-9]?[<>])\s*", stripped):
            words = part.split()
            if words and words[0].endswith("quire") and "/" not in words[0].replace(".venv/bin/", ""):
                commands.append(part)
    return commands


@pytest.mark.parametrize("document", [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))],
                         ids=lambda path: str(path.relative_to(ROOT)))
def test_every_command_shown_parses(document):
    # Each `quire ...` line of a ```sh block goes through the real parser:
    # the command, its flags and their values must all be accepted.
    commands = _shell_commands(document.read_text())
    if document.name == "README.md":
        assert commands, "the README shows no quire command"
    problems = []
    for command in commands:
        words = shlex.split(command)[1:]
        errors = io.StringIO()
        try:
            with contextlib.redirect_stderr(errors), contextlib.redirect_stdout(io.StringIO()):
                build_parser().parse_args(words)
        except SystemExit as exit_:
            if exit_.code != 0:
                problems.append(f"{command!r}: {errors.getvalue().strip()}")
    assert not problems, "\n".join(problems)


def _tracked_text_files() -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True)
    files = []
    for name in listed.stdout.decode().split("\0"):
        path = ROOT / name
        if name and path.suffix in (".py", ".md", ".toml", ".yml", ".yaml", ".cfg", ".txt", "") and path.is_file():
            files.append(path)
    return files


def _is_git_checkout() -> bool:
    return subprocess.run(["git", "rev-parse", "--git-dir"], cwd=ROOT, capture_output=True).returncode == 0


@pytest.mark.skipif(not _is_git_checkout(), reason="not a git checkout")
def test_no_commit_hash_of_this_repository_in_code_or_docs():
    # Comments and docs say what code does and why; which commit changed it
    # is what git log is for.
    tokens: dict[str, list[str]] = {}
    for path in _tracked_text_files():
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        # Any 7-40 hex characters, digits only included: git decides whether
        # the token names a commit (a number that happens to prefix one is
        # about one in a million).
        for token in set(re.findall(r"(?<![0-9a-zA-Z_])[0-9a-fA-F]{7,40}(?![0-9a-zA-Z_])", text)):
            tokens.setdefault(token.lower(), []).append(str(path.relative_to(ROOT)))
    if not tokens:
        return
    answers = subprocess.run(["git", "cat-file", "--batch-check"], cwd=ROOT, input="\n".join(tokens) + "\n",
                             capture_output=True, text=True, check=True).stdout.splitlines()
    commits = [(token, tokens[token]) for token, answer in zip(tokens, answers) if answer.split()[1:2] == ["commit"]]
    assert not commits, f"commit hashes in code or docs: {commits}"


HISTORY = re.compile(
    r"\b(?:[Rr]uns? [A-Z](?:\b|[–-][A-Z]\b)(?! *=)|(?:first|second|third|fourth|fifth|sixth) session\b"
    r"|[Ss]ession \d+\b|[Ss]top \d+\b)"
)


@pytest.mark.skipif(not _is_git_checkout(), reason="not a git checkout")
def test_no_numbered_runs_or_sessions_in_code_or_docs():
    found = []
    for path in _tracked_text_files():
        if path == Path(__file__).resolve():
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if HISTORY.search(line):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not found, "\n".join(found)
