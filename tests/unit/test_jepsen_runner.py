"""The Jepsen controller's small parts that need no cluster: reading
ZooKeeper's `dump` answer (to confirm a session expired), and the exit
status of `quire jepsen` for each verdict."""

from __future__ import annotations

import argparse

import pytest

from quire.jepsen_commands import jepsen
from sim.jepsen import runner
from sim.jepsen.checker import Anomaly, CheckResult
from sim.jepsen.runner import ephemeral_owners, live_sessions
from tests.jepsen_support import report_for

# What ZooKeeper 3.x answers `dump` with (taken from a real server): a bookie
# and a writer with an ephemeral znode each, and one more session without any.
DUMP = """SessionTracker dump:
Session Sets (2)/(3):
0 expire at Sun Nov 22 17:19:12 UTC 2026:
\t0x1000035bb170003
1 expire at Sun Nov 22 17:19:14 UTC 2026:
\t0x1000035bb170001
\t0x1000035bb170002
ephemeral nodes dump:
Sessions with Ephemerals (2):
0x1000035bb170001:
\t/quire/bookies/writable/127.0.0.1:40001
0x1000035bb170002:
\t/quire/jepsen/sessions/writer-0
Connections dump:
Connections Sets (1)/(1):
1 expire at Sun Nov 22 17:19:18 UTC 2026:
\tip: /127.0.0.1:40288 sessionId: 0x1000035bb170001
"""


def test_the_owner_of_each_ephemeral_znode_is_read_from_a_dump():
    assert ephemeral_owners(DUMP) == {
        "/quire/bookies/writable/127.0.0.1:40001": "0x1000035bb170001",
        "/quire/jepsen/sessions/writer-0": "0x1000035bb170002",
    }
    assert ephemeral_owners("") == {}


def test_live_sessions_are_the_session_trackers():
    assert live_sessions(DUMP) == {"0x1000035bb170001", "0x1000035bb170002", "0x1000035bb170003"}
    # Once expired, a session is in neither list.
    expired = DUMP.replace("\t0x1000035bb170002\n", "").replace("0x1000035bb170002:\n\t/quire/jepsen/sessions/writer-0\n", "")
    assert "0x1000035bb170002" not in live_sessions(expired)
    assert "/quire/jepsen/sessions/writer-0" not in ephemeral_owners(expired)


@pytest.mark.parametrize(
    "result, status",
    [
        (CheckResult(adds_ok=1, ledgers_acked=1, ledgers_acked_final_read=1), 0),
        # Nothing wrong found, but the final reads checked nothing.
        (CheckResult(adds_ok=1, ledgers_acked=1, ledgers_acked_final_read=0), 1),
        (CheckResult(unseen=[Anomaly("unseen", "no final read", 1, 0)], ledgers_acked=1, ledgers_acked_final_read=1), 1),
        (CheckResult(lost=[Anomaly("lost", "gone", 1, 0)]), 1),
    ],
)
def test_quire_jepsen_exits_zero_only_for_a_valid_verdict(result, status, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(runner, "run_jepsen", lambda *args, **kwargs: report_for(result, tmp_path))
    arguments = argparse.Namespace(duration=1, writers=1, readers=1, bookies=5, seed=0, work_dir=tmp_path / "run")
    assert jepsen(arguments) == status
    assert capsys.readouterr().out.startswith(result.verdict + "\n")
