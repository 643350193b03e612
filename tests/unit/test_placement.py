"""Placement of ensembles and replacements: distinct bookies from the
candidates, racks spread over every write quorum (as well as an exhaustive
search manages, on small clusters), load spread by the seed, clear errors."""

from __future__ import annotations

import itertools
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ledger_client.errors import NotEnoughBookiesError
from ledger_client.placement import (
    DEFAULT_RACK,
    choose_ensemble,
    choose_replacement,
    min_racks_per_write_quorum,
    rack_of,
    write_quorum_starts,
)


def cluster(bookies_per_rack: dict[str | None, int]) -> dict[str, str | None]:
    """Bookie id -> rack, `count` bookies in each rack."""
    return {
        f"{rack or 'norack'}-b{index}:3181": rack
        for rack, count in bookies_per_rack.items()
        for index in range(count)
    }


def best_spread_by_search(bookies: dict[str, str | None], ensemble_size: int, write_quorum: int) -> int:
    """The best `min_racks_per_write_quorum` of any ensemble, by trying every
    sequence of racks the cluster can fill."""
    capacity: dict[str, int] = {}
    for bookie_id in bookies:
        rack = rack_of(bookie_id, bookies)
        capacity[rack] = capacity.get(rack, 0) + 1
    best = 0
    for racks in itertools.product(sorted(capacity), repeat=ensemble_size):
        if all(racks.count(rack) <= count for rack, count in capacity.items()):
            spans = [len({racks[(start + i) % ensemble_size] for i in range(write_quorum)}) for start in range(ensemble_size)]
            best = max(best, min(spans))
    return best


# -- examples ------------------------------------------------------------------


def test_every_write_quorum_spans_write_quorum_racks_when_racks_allow():
    bookies = cluster({"rack-a": 2, "rack-b": 2, "rack-c": 2})
    ensemble = choose_ensemble(bookies, 6, 3, rng=random.Random(1))
    assert sorted(ensemble) == sorted(bookies)
    assert min_racks_per_write_quorum(ensemble, bookies, 3) == 3


def test_one_large_rack_gets_the_small_ones_spread_evenly():
    # 6 bookies outside rack-a among 30: one in every 5 consecutive positions.
    bookies = cluster({"rack-a": 40, "rack-b": 3, "rack-c": 3})
    ensemble = choose_ensemble(bookies, 30, 5, rng=random.Random(0))
    assert min_racks_per_write_quorum(ensemble, bookies, 5) == 2


def test_uneven_counts_still_reach_the_best_spread():
    # Seven bookies from five racks: two racks give two each. A quorum of
    # five leaves out two neighbouring positions, which cannot split both
    # pairs for every quorum, so four racks is the best; the two first
    # orders reach three, swapping positions reaches four.
    bookies = cluster({f"rack-{index}": 2 for index in range(5)})
    for seed in range(10):
        ensemble = choose_ensemble(bookies, 7, 5, rng=random.Random(seed))
        assert min_racks_per_write_quorum(ensemble, bookies, 5) == 4


def test_bookies_without_a_rack_share_the_default_rack():
    bookies = cluster({None: 3, "rack-a": 3})
    assert rack_of("norack-b0:3181", bookies) == DEFAULT_RACK
    assert rack_of("unknown:3181", bookies) == DEFAULT_RACK
    ensemble = choose_ensemble(bookies, 4, 2, rng=random.Random(3))
    assert min_racks_per_write_quorum(ensemble, bookies, 2) == 2


def test_min_racks_per_write_quorum_counts_cyclic_quorums():
    bookies = {"a1": "a", "a2": "a", "b1": "b"}
    assert min_racks_per_write_quorum(["a1", "b1", "a2"], bookies, 2) == 1  # a2, a1 wrap around
    assert min_racks_per_write_quorum(["a1", "b1", "a2"], bookies, 3) == 2
    assert write_quorum_starts(5, 3, 1) == [0, 1, 4]


def test_load_is_spread_over_every_bookie_by_the_seed():
    bookies = cluster({"rack-a": 5, "rack-b": 5})
    chosen = {bookie_id for seed in range(100) for bookie_id in choose_ensemble(bookies, 3, 2, rng=random.Random(seed))}
    assert chosen == set(bookies)
    first = {choose_ensemble(bookies, 3, 2, rng=random.Random(seed))[0] for seed in range(100)}
    assert len(first) == len(bookies)


def test_too_few_bookies_says_how_many_and_which_were_excluded():
    bookies = cluster({"rack-a": 2, "rack-b": 2})
    with pytest.raises(NotEnoughBookiesError) as caught:
        choose_ensemble(bookies, 3, 2, exclude=["rack-a-b0:3181", "rack-b-b1:3181", "gone:3181"], rng=random.Random(0))
    message = str(caught.value)
    assert "need 3 bookies" in message and "2 available" in message and "4 registered" in message
    assert "excluded: rack-a-b0:3181, rack-b-b1:3181" in message
    with pytest.raises(NotEnoughBookiesError, match="need 1 bookies for the ensemble, 0 available"):
        choose_ensemble({}, 1, 1, rng=random.Random(0))


@pytest.mark.parametrize("ensemble_size, write_quorum", [(2, 3), (3, 0)])
def test_quorums_that_do_not_fit_are_refused(ensemble_size, write_quorum):
    with pytest.raises(ValueError, match="ensemble_size >= write_quorum >= 1"):
        choose_ensemble(cluster({"rack-a": 5}), ensemble_size, write_quorum, rng=random.Random(0))


def test_replacement_keeps_the_failed_bookies_quorums_on_distinct_racks():
    bookies = {"a1": "a", "a2": "a", "b1": "b", "b2": "b", "c1": "c", "d1": "d"}
    ensemble = ["a1", "b1", "c1"]
    chosen = {
        choose_replacement(ensemble, 1, bookies, 3, exclude={"b1"}, rng=random.Random(seed)) for seed in range(40)
    }
    # a2 would put rack a twice in every quorum; b2 and d1 keep three racks.
    assert chosen == {"b2", "d1"}


def test_replacement_errors():
    bookies = {"a1": "a", "b1": "b", "c1": "c"}
    with pytest.raises(NotEnoughBookiesError, match="no bookie can replace b1 at position 1.*excluded: c1"):
        choose_replacement(["a1", "b1"], 1, bookies, 2, exclude={"c1"}, rng=random.Random(0))
    with pytest.raises(ValueError, match="index"):
        choose_replacement(["a1", "b1"], 2, bookies, 2, rng=random.Random(0))
    with pytest.raises(ValueError, match="distinct"):
        choose_replacement(["a1", "a1"], 0, bookies, 2, rng=random.Random(0))


# -- properties ----------------------------------------------------------------

bookie_ids = st.integers(0, 99).map(lambda number: f"bk{number}:3181")
racks = st.sampled_from([None, "rack-a", "rack-b", "rack-c", "rack-d", "rack-e"])
clusters = st.dictionaries(bookie_ids, racks, min_size=1, max_size=14)


@st.composite
def placements(draw, bookies_strategy=clusters):
    bookies = draw(bookies_strategy)
    ensemble_size = draw(st.integers(1, len(bookies) + 1))
    write_quorum = draw(st.integers(1, ensemble_size))
    exclude = draw(st.sets(st.sampled_from(sorted(bookies)), max_size=3))
    return bookies, ensemble_size, write_quorum, exclude


@settings(max_examples=200, deadline=None)
@given(placement=placements(), seed=st.integers(0, 2**32))
def test_an_ensemble_is_distinct_candidates_or_a_clear_error(placement, seed):
    bookies, ensemble_size, write_quorum, exclude = placement
    candidates = set(bookies) - exclude
    try:
        ensemble = choose_ensemble(bookies, ensemble_size, write_quorum, exclude=exclude, rng=random.Random(seed))
    except NotEnoughBookiesError as error:
        assert len(candidates) < ensemble_size
        assert f"{len(candidates)} available" in str(error)
        return
    assert len(ensemble) == ensemble_size == len(set(ensemble))
    assert set(ensemble) <= candidates
    # The same seed gives the same ensemble.
    assert ensemble == choose_ensemble(bookies, ensemble_size, write_quorum, exclude=exclude, rng=random.Random(seed))


@settings(max_examples=150, deadline=None)
@given(sizes=st.data(), spare=st.integers(0, 2), seed=st.integers(0, 2**32))
def test_with_enough_racks_every_write_quorum_spans_distinct_racks(sizes, spare, seed):
    # A rack holding c bookies of the ensemble needs c gaps of WQ positions,
    # so the racks are "enough" when ceil(E / racks) * WQ <= E: each of at
    # least WQ racks then has ceil(E / racks) bookies to give (or more).
    racks_count = sizes.draw(st.integers(1, 6))
    write_quorum = sizes.draw(st.integers(1, racks_count))
    per_rack = sizes.draw(st.integers(1, 3))
    sizes_allowed = [size for size in range((per_rack - 1) * racks_count + 1, per_rack * racks_count + 1)
                     if size >= write_quorum and per_rack * write_quorum <= size]
    ensemble_size = sizes.draw(st.sampled_from(sizes_allowed))
    bookies = cluster({f"rack-{index}": per_rack + spare for index in range(racks_count)})
    ensemble = choose_ensemble(bookies, ensemble_size, write_quorum, rng=random.Random(seed))
    assert min_racks_per_write_quorum(ensemble, bookies, write_quorum) == write_quorum


small_clusters = st.dictionaries(bookie_ids, st.sampled_from([None, "r1", "r2", "r3"]), min_size=1, max_size=9)


@settings(max_examples=80, deadline=None)
@given(bookies=small_clusters, sizes=st.data(), seed=st.integers(0, 2**32))
def test_racks_are_spread_as_well_as_an_exhaustive_search_can(bookies, sizes, seed):
    ensemble_size = sizes.draw(st.integers(1, min(6, len(bookies))))
    write_quorum = sizes.draw(st.integers(1, ensemble_size))
    ensemble = choose_ensemble(bookies, ensemble_size, write_quorum, rng=random.Random(seed))
    assert min_racks_per_write_quorum(ensemble, bookies, write_quorum) == best_spread_by_search(
        bookies, ensemble_size, write_quorum
    )


@settings(max_examples=200, deadline=None)
@given(placement=placements(), data=st.data(), seed=st.integers(0, 2**32))
def test_a_replacement_is_outside_the_ensemble_and_the_best_rack_for_its_quorums(placement, data, seed):
    bookies, ensemble_size, write_quorum, exclude = placement
    ensemble_size = min(ensemble_size, len(bookies))
    write_quorum = min(write_quorum, ensemble_size)
    ensemble = choose_ensemble(bookies, ensemble_size, write_quorum, rng=random.Random(seed))
    index = data.draw(st.integers(0, ensemble_size - 1))
    candidates = set(bookies) - set(ensemble) - exclude
    try:
        replacement = choose_replacement(ensemble, index, bookies, write_quorum, exclude=exclude, rng=random.Random(seed))
    except NotEnoughBookiesError:
        assert not candidates
        return
    assert replacement in candidates

    def fewest_racks_of_its_quorums(bookie_id: str) -> int:
        replaced = list(ensemble)
        replaced[index] = bookie_id
        quorums = [[replaced[(start + i) % ensemble_size] for i in range(write_quorum)] for start in
                   write_quorum_starts(ensemble_size, write_quorum, index)]
        return min(len({rack_of(member, bookies) for member in quorum}) for quorum in quorums)

    assert fewest_racks_of_its_quorums(replacement) == max(map(fewest_racks_of_its_quorums, candidates))
