"""The ownership core, driven directly: the dispatch lease a session's
replies give (a part of the session timeout, never shortened), and what a
lookup answers given the partition's owner and the live brokers."""

from __future__ import annotations

import pytest

from broker.ownership_core import (
    LEASE_FRACTION,
    Access,
    Answer,
    CloseClients,
    Held,
    LeaseCore,
    OwnershipCore,
    Register,
    Release,
    StartLoad,
    CancelLoad,
    StopPartition,
    decide_lookup,
    rendezvous_choice,
)


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


# --- what a broker does with the partitions it holds (OwnershipCore) -------------------------


def holding(*serving: str, session_id: int = 1, lease: LeaseCore | None = None) -> OwnershipCore:
    """A core whose session `session_id` claimed and loaded `serving`."""
    core = OwnershipCore(session_id, lease=lease)
    for partition in serving:
        assert core.claimed(partition, session_id, core.releases) == [StartLoad(partition, session_id)]
        assert core.loaded(partition, True) == []
    return core


def test_access_follows_the_partition_through_its_load_and_hand_over():
    core = OwnershipCore(1)
    assert (core.access("t"), core.held("t")) == (Access.ABSENT, None)
    assert core.claimed("t", 1, core.releases) == [StartLoad("t", 1)]
    assert (core.access("t"), core.held("t")) == (Access.WAIT, Held.LOADING)
    assert core.loaded("t", True) == []
    assert (core.access("t"), core.held("t")) == (Access.SERVE, Held.SERVING)
    assert core.unload("t", graceful=True) == [StopPartition("t", graceful=True)]
    assert (core.access("t"), core.held("t")) == (Access.MOVING, Held.UNLOADING)
    assert core.stopped("t") == [Release("t", 1)]
    assert (core.access("t"), core.held("t")) == (Access.MOVING, Held.RELEASING)
    assert core.released("t") == [CloseClients("t")]  # the clients are told only once the node is gone
    assert (core.access("t"), core.held("t")) == (Access.ABSENT, None)
    assert core.holdings == {}
    assert core.access("other") is Access.ABSENT


def test_with_no_session_or_while_stopping_an_absent_partition_is_moving_and_not_claimed():
    core = OwnershipCore()
    assert core.session_id is None
    assert core.access("t") is Access.MOVING
    assert core.claimed("t", 1, core.releases) == [] and core.held("t") is None
    stopping = OwnershipCore(1)
    assert stopping.stop() == []
    assert stopping.access("t") is Access.MOVING
    assert stopping.claimed("t", 1, stopping.releases) == [] and stopping.held("t") is None


def test_a_partition_is_claimed_only_in_the_current_session_and_only_once():
    core = OwnershipCore(2)
    assert core.claimed("t", 1, core.releases) == []  # the node of an earlier session
    assert core.claimed("t", 3, core.releases) == []
    assert core.held("t") is None
    assert core.claimed("t", 2, core.releases) == [StartLoad("t", 2)]
    assert core.claimed("t", 2, core.releases) == []  # loading already
    core.loaded("t", True)
    assert core.claimed("t", 2, core.releases) == []  # serving already
    assert core.held("t") is Held.SERVING


def test_a_failed_load_releases_the_node_then_closes_the_clients():
    core = OwnershipCore(1)
    core.claimed("t", 1, core.releases)
    assert core.loaded("t", False) == [Release("t", 1)]
    assert (core.access("t"), core.held("t")) == (Access.MOVING, Held.RELEASING)
    assert core.claimed("t", 1, core.releases) == []  # a release arriving after a new claim would delete the new node
    assert core.released("t") == [CloseClients("t")]
    assert core.access("t") is Access.ABSENT
    assert core.claimed("t", 1, core.releases) == [StartLoad("t", 1)]  # claimed again once released


def test_unloading_a_partition_that_is_not_serving_does_nothing():
    core = holding("a", "b")
    assert core.unload("absent", graceful=True) == []
    assert core.unload("a", graceful=False) == [StopPartition("a", graceful=False)]
    assert core.unload("a", graceful=True) == []  # already unloading
    assert core.unload("a", graceful=False) == []
    core.stopped("a")
    assert core.unload("a", graceful=True) == []  # releasing
    assert core.held("a") is Held.RELEASING


def test_loaded_or_stopped_out_of_turn_is_a_driver_bug():
    core = holding("a")
    with pytest.raises(AssertionError, match="a: loaded while serving"):
        core.loaded("a", True)
    with pytest.raises(AssertionError, match="absent: loaded while not held"):
        core.loaded("absent", True)
    with pytest.raises(AssertionError, match="a: stopped while serving"):
        core.stopped("a")
    with pytest.raises(AssertionError, match="absent: stopped while not held"):
        core.stopped("absent")
    with pytest.raises(AssertionError, match="a: released while serving"):
        core.released("a")


def test_a_partition_being_handed_over_cannot_be_claimed_again_until_released():
    core = holding("t")
    core.unload("t", graceful=True)
    assert core.claimed("t", 1, core.releases) == [] and core.held("t") is Held.UNLOADING
    assert core.stopped("t") == [Release("t", 1)]
    assert core.claimed("t", 1, core.releases) == [] and core.held("t") is Held.RELEASING
    assert core.released("t") == [CloseClients("t")]
    assert core.claimed("t", 1, core.releases) == [StartLoad("t", 1)]


def test_losing_the_session_stops_every_partition_at_once_fenced():
    lease = LeaseCore(10_000)
    lease.renewed(sent_ms=0, now_ms=0)
    core = holding("b", "a", "d", "e", lease=lease)
    assert core.claimed("c", 1, core.releases) == [StartLoad("c", 1)]  # loading when the session goes
    core.unload("d", graceful=True)  # a graceful hand-over under way
    core.unload("e", graceful=True)
    core.stopped("e")  # its release under way
    assert lease.valid(100)
    assert core.session_lost() == [StopPartition("a", graceful=False), StopPartition("b", graceful=False), CancelLoad("c")]
    assert core.session_id is None and not lease.valid(100)
    assert {partition: core.access(partition) for partition in "abcdex"} == {
        "a": Access.MOVING, "b": Access.MOVING, "c": Access.MOVING, "d": Access.MOVING, "e": Access.MOVING,
        "x": Access.MOVING}
    assert core.claimed("x", 1, core.releases) == []  # no session to own anything with
    assert core.session_lost() == []  # once
    # The loading one is cancelled; if it loaded all the same, it is stopped, fenced.
    assert core.held("c") is Held.LOADING
    assert core.loaded("c", True) == [StopPartition("c", graceful=False)]
    assert core.held("c") is Held.UNLOADING
    # Its node went with the session: nothing to release, the clients are told at once.
    assert core.stopped("a") == [CloseClients("a")]
    assert core.stopped("c") == [CloseClients("c")]
    assert core.stopped("d") == [CloseClients("d")]
    assert core.released("e") == [CloseClients("e")]
    assert core.held("a") is None and core.held("c") is None and core.held("d") is None
    assert core.stopped("b") == [CloseClients("b")]
    assert core.holdings == {}


def test_a_load_failing_after_the_session_went_closes_the_clients_at_once():
    core = OwnershipCore(1)
    core.claimed("t", 1, core.releases)
    assert core.session_lost() == [CancelLoad("t")]  # nothing serving yet: the load is cancelled
    assert core.loaded("t", False) == [CloseClients("t")]
    assert core.held("t") is None


def test_a_load_ending_after_a_new_session_began_is_stopped_and_its_clients_closed():
    core = OwnershipCore(1)
    core.claimed("t", 1, core.releases)
    assert core.session_started(2) == [CancelLoad("t"), Register()]
    assert core.access("t") is Access.MOVING
    assert core.claimed("t", 2, core.releases) == []  # the old session's load is still under way
    assert core.loaded("t", True) == [StopPartition("t", graceful=False)]
    assert core.stopped("t") == [CloseClients("t")]  # not released: the old session's node is gone
    assert core.claimed("t", 2, core.releases) == [StartLoad("t", 2)]


def test_a_new_session_registers_again_and_stops_what_the_old_one_held():
    lease = LeaseCore(10_000)
    lease.renewed(sent_ms=0, now_ms=0)
    core = holding("b", "a", lease=lease)
    assert core.session_started(1) == [Register()]  # the same session: only registered again (harmless)
    assert lease.valid(1)
    # A new session without a loss seen first: the old one expired.
    assert core.session_started(2) == [StopPartition("a", graceful=False), StopPartition("b", graceful=False), Register()]
    assert core.session_id == 2 and not lease.valid(1)
    assert core.access("a") is Access.MOVING and core.access("x") is Access.ABSENT
    assert core.claimed("a", 2, core.releases) == []  # handed over first
    assert core.claimed("x", 1, core.releases) == []  # the old session's
    assert core.stopped("a") == [CloseClients("a")]
    assert core.claimed("a", 2, core.releases) == [StartLoad("a", 2)]
    assert core.loaded("a", True) == []
    assert core.access("a") is Access.SERVE
    # The new session's partitions are released with it.
    core.unload("a", graceful=True)
    assert core.stopped("a") == [Release("a", 2)]
    # After a loss seen first, the new session only registers ("b" is stopping, "a" releasing: nothing serves).
    assert core.session_lost() == []
    assert core.session_started(3) == [Register()]
    assert core.session_id == 3
    assert core.stopped("b") == [CloseClients("b")]
    assert core.released("a") == [CloseClients("a")]
    assert core.holdings == {}
    assert lease.renewed(sent_ms=10, now_ms=10) is True  # renewed in the new session: valid again
    assert lease.valid(11)


def test_stopping_unloads_everything_gracefully_and_refuses_new_claims():
    core = holding("b", "a", "c")
    core.unload("c", graceful=False)  # fenced already
    assert core.stop() == [StopPartition("a", graceful=True), StopPartition("b", graceful=True)]
    assert core.stopping
    assert core.claimed("x", 1, core.releases) == [] and core.access("x") is Access.MOVING
    assert core.access("a") is Access.MOVING
    assert core.stopped("a") == [Release("a", 1)]
    assert core.released("a") == [CloseClients("a")]
    assert core.claimed("a", 1, core.releases) == []  # released, but the broker takes nothing more
    assert core.stop() == []  # nothing serving is left


def test_stopping_during_a_load_stops_the_partition_once_loaded():
    core = OwnershipCore(1)
    core.claimed("t", 1, core.releases)
    assert core.stop() == []  # not loaded yet
    assert core.access("t") is Access.MOVING
    (stop,) = core.loaded("t", True)
    assert isinstance(stop, StopPartition) and stop.partition == "t"
    assert core.stopped("t") == [Release("t", 1)]  # the session is still current: its node is released
    assert core.released("t") == [CloseClients("t")]


def test_stopping_during_a_load_unloads_the_partition_gracefully_once_loaded():
    core = OwnershipCore(1)
    core.claimed("t", 1, core.releases)
    core.stop()
    assert core.loaded("t", True) == [StopPartition("t", graceful=True)]


def test_a_claim_on_an_ownership_read_made_before_a_release_is_refused():
    # A request read the node as this broker's, then the partition was
    # loaded, handed over and released by another request: the node it read
    # is gone, and claiming on it would serve a partition nobody owns.
    core = OwnershipCore(1)
    releases = core.releases
    core.claimed("t", 1, core.releases)
    core.loaded("t", True)
    core.unload("t", graceful=True)
    core.stopped("t")
    core.released("t")
    assert core.claimed("t", 1, releases) == []
    assert core.claimed("t", 1, core.releases) == [StartLoad("t", 1)]


def test_a_partition_is_deleted_only_by_the_session_that_still_holds_it():
    core = OwnershipCore(1)
    core.claimed("t", 1, core.releases)
    core.loaded("t", True)
    assert not core.may_delete("t")  # serving: not stopped yet
    core.unload("t", graceful=True)
    assert core.may_delete("t")
    core.session_lost()
    assert not core.may_delete("t")  # another broker may serve it already


def test_a_stopping_broker_does_not_register_again():
    core = OwnershipCore(1)
    core.stop()
    assert core.session_started(2) == []
