"""Ensemble placement: which bookies store a new ledger, in which order, and
which bookie replaces a failed one. Pure: the registered bookies and their
racks come in as a mapping, randomness as an injected `random.Random`.

The order matters because entry e goes to positions (e + i) mod E, i < WQ
(its write quorum). Placement spreads every write quorum over as many racks
as it can, so that losing one rack loses as few replicas of an entry as it can.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Protocol

from ledger_client.errors import NotEnoughBookiesError


class RandomSource(Protocol):
    """The randomness placement and the pure cores take, injected: a
    `random.Random` (seeded by the simulator), never the module's state."""

    def shuffle(self, x: list) -> None: ...

    def randrange(self, stop: int) -> int: ...

    def choice(self, seq: Sequence[str]) -> str: ...

# Bookies registered without a rack share this one, as in BookKeeper.
DEFAULT_RACK = "/default-rack"
# Rounds of pairwise swaps tried on an ensemble whose write quorums do not
# yet span min(WQ, racks) racks (see _improve_order).
SWAP_ROUNDS_MAX = 32


def rack_of(bookie_id: str, bookies: Mapping[str, str | None]) -> str:
    """The bookie's rack; `DEFAULT_RACK` when it has none or is not in
    `bookies` (a bookie that left the registry: its rack is unknown)."""
    rack = bookies.get(bookie_id)
    return DEFAULT_RACK if rack is None else rack


def write_quorum_starts(ensemble_size: int, write_quorum: int, index: int) -> list[int]:
    """First positions of the write quorums that contain position `index`:
    the quorum starting at s holds s, s+1, ..., s+WQ-1 (mod E)."""
    return sorted({(index - offset) % ensemble_size for offset in range(write_quorum)})


def min_racks_per_write_quorum(ensemble: Sequence[str], bookies: Mapping[str, str | None], write_quorum: int) -> int:
    """The fewest distinct racks any write quorum of `ensemble` spans."""
    _check_quorum(len(ensemble), write_quorum)
    racks = [rack_of(bookie_id, bookies) for bookie_id in ensemble]
    return min(_distinct_racks(racks, write_quorum, range(len(racks))))


def choose_ensemble(
    bookies: Mapping[str, str | None],
    ensemble_size: int,
    write_quorum: int,
    *,
    exclude: Collection[str] = (),
    rng: RandomSource,
) -> list[str]:
    """`ensemble_size` distinct bookies of `bookies` (bookie id -> rack or
    None), none of them in `exclude`, ordered so that write quorums span as
    many racks as they can.

    Bookies are drawn from the racks in turns (one per rack per round; racks,
    and bookies inside a rack, in random order), which keeps the per-rack
    counts as even as the racks' sizes allow. Two orders of the drawn
    bookies are built and the better kept (see `_rows_order` and
    `_even_spread_order`), then improved by swaps when its write quorums
    still span fewer than min(WQ, racks) racks. Checked against an
    exhaustive search on small clusters by the unit tests.
    """
    _check_quorum(ensemble_size, write_quorum)
    candidates = [bookie_id for bookie_id in sorted(bookies) if bookie_id not in exclude]
    if len(candidates) < ensemble_size:
        raise NotEnoughBookiesError(
            f"need {ensemble_size} bookies for the ensemble, {len(candidates)} available "
            f"({len(bookies)} registered{_excluded_note(bookies, exclude)})"
        )
    by_rack: dict[str, list[str]] = {}
    for bookie_id in candidates:
        by_rack.setdefault(rack_of(bookie_id, bookies), []).append(bookie_id)
    racks = sorted(by_rack)
    rng.shuffle(racks)
    for rack in racks:
        rng.shuffle(by_rack[rack])

    drawn: dict[str, list[str]] = {rack: [] for rack in racks}
    remaining = ensemble_size
    while remaining:
        for rack in racks:
            if remaining and len(drawn[rack]) < len(by_rack[rack]):
                drawn[rack].append(by_rack[rack][len(drawn[rack])])
                remaining -= 1
    groups = [members for members in drawn.values() if members]

    orders = [_rows_order(groups), _even_spread_order(groups)]
    best = max(orders, key=lambda order: _spread_score([rack_of(b, bookies) for b in order], write_quorum))
    ensemble = _improve_order(best, bookies, write_quorum)
    # Rotating keeps every write quorum's racks and spreads which bookie
    # takes entry 0 (and so the most entries of a short ledger).
    rotation = rng.randrange(ensemble_size)
    return ensemble[rotation:] + ensemble[:rotation]


def choose_replacement(
    ensemble: Sequence[str],
    index: int,
    bookies: Mapping[str, str | None],
    write_quorum: int,
    *,
    exclude: Collection[str] = (),
    rng: RandomSource,
) -> str:
    """A bookie of `bookies` to take position `index` of `ensemble`: not in
    the ensemble, not in `exclude`. Among those, one that keeps the write
    quorums containing `index` on the most distinct racks (first the fewest
    racks of any such quorum, then their total), chosen at random among
    equals. Ensemble members missing from `bookies` count as `DEFAULT_RACK`."""
    _check_quorum(len(ensemble), write_quorum)
    if len(set(ensemble)) != len(ensemble):
        raise ValueError(f"ensemble members must be distinct, got {list(ensemble)}")
    if not 0 <= index < len(ensemble):
        raise ValueError(f"index must be within [0, {len(ensemble)}), got {index}")
    candidates = [
        bookie_id for bookie_id in sorted(bookies) if bookie_id not in exclude and bookie_id not in ensemble
    ]
    if not candidates:
        raise NotEnoughBookiesError(
            f"no bookie can replace {ensemble[index]} at position {index}: all {len(bookies)} registered "
            f"are in the ensemble or excluded{_excluded_note(bookies, exclude)}"
        )
    racks = [rack_of(bookie_id, bookies) for bookie_id in ensemble]
    starts = write_quorum_starts(len(ensemble), write_quorum, index)
    scores: dict[str, tuple[int, int]] = {}
    for bookie_id in candidates:
        racks[index] = rack_of(bookie_id, bookies)
        spans = _distinct_racks(racks, write_quorum, starts)
        scores[bookie_id] = (min(spans), sum(spans))
    best = max(scores.values())
    return rng.choice([bookie_id for bookie_id in candidates if scores[bookie_id] == best])


# -- orders ---------------------------------------------------------------------


def _rows_order(groups: list[list[str]]) -> list[str]:
    """Deal the bookies, largest rack first, into as many rows as the largest
    rack has bookies; lay the rows end to end. A rack then appears at most
    once a row, and rows are at least WQ long when `largest * WQ <= E`, so
    every write quorum spans WQ racks: the best there is, since a rack with
    c bookies needs c gaps of WQ positions. Largest racks first so that only
    smaller racks wrap from the last row to the first, where a gap of one
    row plus one position still holds."""
    # A stable sort keeps the random rack order among racks of equal size.
    grouped = [bookie_id for members in sorted(groups, key=len, reverse=True) for bookie_id in members]
    rows_count = max(len(members) for members in groups)
    return [bookie_id for row in range(rows_count) for bookie_id in grouped[row::rows_count]]


def _even_spread_order(groups: list[list[str]]) -> list[str]:
    """Start from the smallest rack and insert each larger rack's bookies at
    evenly spaced positions (a Euclidean rhythm). This wins when one rack
    holds most of the ensemble: the few others end up evenly spaced, so
    every write quorum catches one of them."""
    order: list[str] = []
    for members in sorted(groups, key=len):
        total = len(order) + len(members)
        new_positions = {(index * total) // len(members) for index in range(len(members))}
        existing, inserted = iter(order), iter(members)
        order = [next(inserted) if position in new_positions else next(existing) for position in range(total)]
    return order


def _distinct_racks(racks: Sequence[str], write_quorum: int, starts: Iterable[int]) -> list[int]:
    size = len(racks)
    return [len({racks[(start + offset) % size] for offset in range(write_quorum)}) for start in starts]


def _spread_score(racks: Sequence[str], write_quorum: int) -> tuple[int, int, int]:
    """Higher is better: the fewest racks of any write quorum, then fewer
    quorums at that low, then more racks over all quorums."""
    spans = _distinct_racks(racks, write_quorum, range(len(racks)))
    low = min(spans)
    return low, -spans.count(low), sum(spans)


def _improve_order(ensemble: list[str], bookies: Mapping[str, str | None], write_quorum: int) -> list[str]:
    """Swap positions while that spreads the write quorums better; only
    uneven racks get here. Each kept swap raises a bounded score, so the
    rounds end by themselves; the bound caps the work for large ensembles."""
    racks = [rack_of(bookie_id, bookies) for bookie_id in ensemble]
    target = min(write_quorum, len(set(racks)))
    score = _spread_score(racks, write_quorum)
    for _ in range(SWAP_ROUNDS_MAX):
        if score[0] >= target:
            break
        improved = False
        for first, second in itertools.combinations(range(len(racks)), 2):
            if racks[first] == racks[second]:
                continue
            racks[first], racks[second] = racks[second], racks[first]
            swapped = _spread_score(racks, write_quorum)
            if swapped > score:
                score, improved = swapped, True
                ensemble[first], ensemble[second] = ensemble[second], ensemble[first]
            else:
                racks[first], racks[second] = racks[second], racks[first]
        if not improved:
            break
    return ensemble


def _check_quorum(ensemble_size: int, write_quorum: int) -> None:
    if not ensemble_size >= write_quorum >= 1:
        raise ValueError(
            f"need ensemble_size >= write_quorum >= 1, got ensemble_size={ensemble_size}, write_quorum={write_quorum}"
        )


def _excluded_note(bookies: Mapping[str, str | None], exclude: Collection[str]) -> str:
    excluded = sorted(bookie_id for bookie_id in exclude if bookie_id in bookies)
    return f", excluded: {', '.join(excluded)}" if excluded else ""


__all__ = [
    "DEFAULT_RACK",
    "SWAP_ROUNDS_MAX",
    "choose_ensemble",
    "choose_replacement",
    "min_racks_per_write_quorum",
    "rack_of",
    "write_quorum_starts",
]
