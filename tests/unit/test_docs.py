"""The documentation holds together: every relative link and `#anchor` in
README.md and docs/*.md resolves, every `quire` command shown in the README's
```sh blocks exists with the flags it uses, and no commit hash or numbered
run of this repository's history appears in code or docs."""

from __future__ import annotations

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
        for part in re.split(r"\s*(?:&&|\|\||;|\|)\s*", stripped):
            words = part.split()
            if words and words[0].endswith("quire") and "/" not in words[0].replace(".venv/bin/", ""):
                commands.append(part)
    return commands


def _parser_for(words: list[str]):
    parser, used = build_parser(), 0
    tree = {path: sub for path, sub, _ in cli_reference.walk(parser)}
    path: tuple[str, ...] = ()
    for word in words:
        if (*path, word) in tree:
            path = (*path, word)
            used += 1
        else:
            break
    return path, tree.get(path), words[used:]


def test_every_readme_command_exists_with_its_flags():
    commands = _shell_commands((ROOT / "README.md").read_text())
    assert commands, "the README shows no quire command"
    problems = []
    for command in commands:
        words = shlex.split(command.replace("[", " ").replace("]", " ").replace("|", " "))[1:]
        path, parser, rest = _parser_for(words)
        if parser is None or not cli_reference.is_leaf(parser):
            problems.append(f"{command!r}: no such command")
            continue
        for word in rest:
            if word.startswith("--"):
                flag = word.split("=", 1)[0]
                if flag not in parser._option_string_actions:
                    problems.append(f"{command!r}: quire {' '.join(path)} has no {flag}")
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
        for token in set(re.findall(r"(?<![0-9a-zA-Z_])[0-9a-f]{7,40}(?![0-9a-zA-Z_])", text)):
            if re.search(r"[a-f]", token) and re.search(r"[0-9]", token):
                tokens.setdefault(token, []).append(str(path.relative_to(ROOT)))
    if not tokens:
        return
    answers = subprocess.run(["git", "cat-file", "--batch-check"], cwd=ROOT, input="\n".join(tokens) + "\n",
                             capture_output=True, text=True, check=True).stdout.splitlines()
    commits = [(token, tokens[token]) for token, answer in zip(tokens, answers) if answer.split()[1:2] == ["commit"]]
    assert not commits, f"commit hashes in code or docs: {commits}"


HISTORY = re.compile(
    r"\b(?:[Rr]uns? [A-K](?:\b|[–-][A-K]\b)(?! *=)|(?:first|second|third|fourth|fifth|sixth) session\b)"
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
