"""Commands that need an extra say which one, exit 2, and do nothing else."""

from __future__ import annotations

import importlib.util

import pytest

from quire import cli, extras


def test_every_extra_is_installed_in_the_test_environment():
    for extra in extras.EXTRAS:
        assert extras.missing(extra) == [], extra


@pytest.mark.parametrize("argv, extra", [
    (["export", "t", "--zk", "127.0.0.1:1", "--out", "{tmp}/out"], "spark"),
    (["bench", "spark_export", "--help"], "spark"),
    (["jepsen", "--work-dir", "{tmp}/jepsen"], "jepsen"),
])
def test_a_command_without_its_extra_names_it_and_exits_2(argv, extra, monkeypatch, capsys, tmp_path):
    real_find_spec = importlib.util.find_spec
    absent = set(extras.EXTRAS[extra])
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *rest: None if name in absent else real_find_spec(name, *rest))
    assert cli.main([part.replace("{tmp}", str(tmp_path)) for part in argv]) == 2
    error = capsys.readouterr().err
    assert f"pip install 'quire[{extra}]'" in error and "Traceback" not in error
    assert not (tmp_path / "out").exists() and not (tmp_path / "jepsen").exists()
