"""The ownership core, driven directly: the dispatch lease a session's
replies give (a part of the session timeout, never shortened), and what a
lookup answers given the partition's owner and the live brokers."""

from __future__ import annotations

import pytest

from broker.ownership_core import LEASE_FRACTION, Answer, LeaseCore, decide_lookup, rendezvous_choice


def test_a_reply_gives_a_lease_of_part_of_the_session_timeout():
    lease = LeaseCore(10_000)
    assert not lease.valid(0)  # nothing is delivered before the first renewal
    assert lease.renewed(sent_ms=100, now_ms=150) is True  # valid again: wake the subscriptions
    assert lease.valid(100 + 10_000 * LEASE_FRACTION - 1) and not lease.valid(100 + 10_000 * LEASE_FRACTION)
    assert lease.renewed(sent_ms=50, now_ms=200) is False  # an older request never shortens it
    assert lease.until_ms == 100 + 10_000 * LEASE_FRACTION
    lease.lost()
    assert not lease.valid(200)
    with pytest.raises(ValueError):
        LeaseCore(10_000, fraction=1.5)


def test_a_lookup_serves_what_this_session_owns_and_sends_clients_to_the_owner():
    decide = lambda owner, **kw: decide_lookup("t", "b1", 7, owner, kw.pop("live", []), stopping=kw.pop("stopping", False),
                                                authoritative=kw.pop("authoritative", False))
    assert decide(("b1", 7)).answer is Answer.SERVE
    assert decide(("b1", 6)).answer is Answer.RETRY  # this broker's previous session still holds it
    assert decide(("b2", 9)) == decide(("b2", 1)) and decide(("b2", 9)).broker_id == "b2"
    live = ["b1", "b2", "b3"]
    chosen = rendezvous_choice("t", live)
    unowned = decide(None, live=live)
    assert (unowned.answer, unowned.broker_id) == ((Answer.CLAIM, None) if chosen == "b1" else (Answer.REDIRECT, chosen))
    assert decide(None, live=live, authoritative=True).answer is Answer.CLAIM
    stopping = decide(None, live=live, stopping=True)
    assert stopping.answer is Answer.REDIRECT and stopping.broker_id in ("b2", "b3")
    assert decide(None, live=["b1"], stopping=True).answer is Answer.RETRY
