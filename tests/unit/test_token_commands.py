"""`quire token ...` through the real command line: keys written with the
right modes, a token made with them and validated (exit 0), a refused token
(exit 1, the reason on stderr), and bad arguments (one line, exit 2)."""

from __future__ import annotations

import base64
import contextlib
import io
import json
import os
import stat
import time
from pathlib import Path

import pytest

from quire.cli import main
from quire.cli_parsing import EXIT_USAGE
from security.tokens import create_secret_key, create_token


def quire(*argv: str) -> tuple[int, str, str]:
    """Exit status, standard output and standard error of `quire argv`."""
    with contextlib.redirect_stdout(io.StringIO()) as output, contextlib.redirect_stderr(io.StringIO()) as errors:
        try:
            status = main([str(word) for word in argv])
        except SystemExit as exit_:
            status = exit_.code
    return status, output.getvalue(), errors.getvalue()


def usage_error(*argv: str) -> str:
    """The one error line of a refused command line (exit 2)."""
    status, output, errors = quire(*argv)
    lines = [line for line in errors.splitlines() if line.strip()]
    assert status == EXIT_USAGE, (status, output, errors)
    assert len(lines) == 1 and "Traceback" not in errors, errors
    assert lines[0].startswith("quire token"), lines
    return lines[0]


def mode_of(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture
def secret_file(tmp_path) -> Path:
    status, _, errors = quire("token", "create-secret-key", "--output", tmp_path / "secret.key")
    assert status == 0, errors
    return tmp_path / "secret.key"


@pytest.fixture
def key_pair_files(tmp_path) -> tuple[Path, Path]:
    private, public = tmp_path / "private.pem", tmp_path / "public.pem"
    status, _, errors = quire("token", "create-key-pair", "--private-key", private, "--public-key", public)
    assert status == 0, errors
    return private, public


def token_for(*argv: str) -> str:
    status, output, errors = quire("token", "create", *argv)
    assert status == 0, errors
    return output.strip()


# --- keys -----------------------------------------------------------------------------------


def test_create_secret_key_writes_32_raw_bytes_owner_only(secret_file):
    assert len(secret_file.read_bytes()) == 32 and mode_of(secret_file) == 0o600


def test_create_secret_key_as_base64(tmp_path):
    assert quire("token", "create-secret-key", "--output", tmp_path / "secret.b64", "--base64")[0] == 0
    assert len(base64.b64decode((tmp_path / "secret.b64").read_bytes(), validate=False)) == 32
    assert mode_of(tmp_path / "secret.b64") == 0o600
    status, output, _ = quire("token", "create-secret-key")
    assert status == 0 and len(base64.b64decode(output.strip(), validate=True)) == 32


def test_an_existing_key_is_not_replaced(secret_file, key_pair_files):
    before = secret_file.read_bytes()
    assert "exists" in usage_error("token", "create-secret-key", "--output", secret_file)
    assert secret_file.read_bytes() == before
    private, public = key_pair_files
    fresh = private.parent / "fresh.pem"
    assert "exists" in usage_error("token", "create-key-pair", "--private-key", fresh, "--public-key", public)
    assert not fresh.exists()  # no half of a pair left behind


def test_create_key_pair_writes_pem_files(key_pair_files):
    private, public = key_pair_files
    assert private.read_bytes().startswith(b"-----BEGIN PRIVATE KEY-----") and mode_of(private) == 0o600
    assert public.read_bytes().startswith(b"-----BEGIN PUBLIC KEY-----")


def test_a_key_pair_needs_two_files(tmp_path):
    same = tmp_path / "key.pem"
    assert "same file" in usage_error("token", "create-key-pair", "--private-key", same, "--public-key", same)
    assert "cannot write" in usage_error("token", "create-key-pair", "--private-key", tmp_path / "absent" / "a.pem",
                                         "--public-key", tmp_path / "b.pem")


# --- create, show, validate ---------------------------------------------------------------------


def test_a_secret_key_token_round_trip(secret_file):
    token = token_for("--secret-key", secret_file, "--subject", "admin")
    status, output, errors = quire("token", "validate", token, "--secret-key", secret_file)
    assert (status, errors) == (0, "")
    assert output.splitlines() == ["role: admin", "expires: never"]


def test_a_key_pair_token_round_trip_with_expiry_and_audience(key_pair_files):
    private, public = key_pair_files
    before = time.time()
    token = token_for("--private-key", f"file://{private}", "--subject", "reader", "--expiry", "1h", "--audience", "quire")
    status, output, errors = quire("token", "validate", token, "--public-key", public, "--audience", "quire")
    assert status == 0, errors
    lines = output.splitlines()
    assert lines[0] == "role: reader" and lines[1].startswith("expires: 20") and lines[2] == "audience: quire"
    status, output, _ = quire("token", "show", token)
    shown = json.loads(output)
    assert status == 0 and shown["header"]["alg"] == "RS256"
    assert shown["claims"]["sub"] == "reader" and shown["claims"]["aud"] == "quire"
    assert int(before) + 3600 <= shown["claims"]["exp"] <= time.time() + 3600


def test_a_data_url_key_is_taken(secret_file):
    inline = "data:;base64," + base64.b64encode(secret_file.read_bytes()).decode()
    token = token_for("--secret-key", inline, "--subject", "admin")
    assert quire("token", "validate", token, "--secret-key", secret_file)[0] == 0


def test_a_token_file_with_a_newline(secret_file, tmp_path):
    token_file = tmp_path / "token.txt"
    token_file.write_text(token_for("--secret-key", secret_file, "--subject", "admin") + "\n")
    status, output, _ = quire("token", "validate", "--token-file", token_file, "--secret-key", secret_file)
    assert status == 0 and output.startswith("role: admin")
    assert json.loads(quire("token", "show", "--token-file", token_file)[1])["claims"] == {"sub": "admin"}


@pytest.mark.parametrize("case, reason", [
    ("another key", "signature does not verify"),
    ("expired", "token expired"),
    ("other audience", "another audience"),
    ("rsa token", "algorithm RS256 not accepted"),
    ("garbage", "malformed token"),
])
def test_a_refused_token_exits_1_with_the_reason(secret_file, key_pair_files, case, reason):
    secret = secret_file.read_bytes()
    token = {
        "another key": lambda: create_token("admin", secret_key=create_secret_key(), now=time.time()),
        "expired": lambda: create_token("admin", secret_key=secret, now=time.time() - 120, expiry_s=60),
        "other audience": lambda: create_token("admin", secret_key=secret, now=time.time(), audience="other"),
        "rsa token": lambda: token_for("--private-key", key_pair_files[0], "--subject", "admin"),
        "garbage": lambda: "not-a-token",
    }[case]()
    audience = ["--audience", "quire"] if case == "other audience" else []
    status, output, errors = quire("token", "validate", token, "--secret-key", secret_file, *audience)
    assert (status, output) == (1, "")
    assert len(errors.splitlines()) == 1 and errors.startswith("token refused: ") and reason in errors, errors
    assert token not in errors


# --- bad arguments: one line, exit 2 ---------------------------------------------------------


def test_bad_arguments_are_one_line_and_exit_2(tmp_path, secret_file, key_pair_files):
    private, public = key_pair_files
    absent = tmp_path / "absent.key"
    assert "no such file" in usage_error("token", "create", "--secret-key", absent, "--subject", "admin")
    assert str(absent) in usage_error("token", "validate", "x.y.z", "--secret-key", absent)
    assert "not allowed with argument" in usage_error("token", "create", "--secret-key", secret_file,
                                                      "--private-key", private, "--subject", "admin")
    assert "required" in usage_error("token", "create", "--subject", "admin")
    assert "required" in usage_error("token", "create", "--secret-key", secret_file)
    assert "--expiry" in usage_error("token", "create", "--secret-key", secret_file, "--subject", "a", "--expiry", "soon")
    assert "--expiry" in usage_error("token", "create", "--secret-key", secret_file, "--subject", "a", "--expiry", "0s")
    assert "--expiry" in usage_error("token", "create", "--secret-key", secret_file, "--subject", "a", "--expiry", "-1h")
    assert "subject" in usage_error("token", "create", "--secret-key", secret_file, "--subject", "")
    assert "PEM or SSH key" in usage_error("token", "create", "--secret-key", public, "--subject", "a")
    assert "private key" in usage_error("token", "validate", "x.y.z", "--public-key", private)
    assert "not a PEM public key" in usage_error("token", "validate", "x.y.z", "--public-key", secret_file)
    assert "exactly one" in usage_error("token", "validate", "--secret-key", secret_file)
    token_file = tmp_path / "token.txt"
    token_file.write_text("x.y.z")
    assert "exactly one" in usage_error("token", "validate", "x.y.z", "--token-file", token_file, "--secret-key", secret_file)
    assert "absent.txt" in usage_error("token", "show", "--token-file", tmp_path / "absent.txt")
    assert "not a token" in usage_error("token", "show", "garbage")
