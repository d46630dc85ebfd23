"""The largest value of a monotone knob that fits each card, found with few probes.

Peak memory grows with batch and sequence, so "fits" flips once along the axis. One probe (a run
on the virtual GPU) answers for every card at once; the search interpolates the bytes it measured
to guess each card's boundary, and stops only when a fitting value and the next one up, which
does not fit, have both been probed: every frontier is checked at its boundary.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Probe:
    value: int
    bytes: int  # what the boundary is interpolated on (peak reserved)
    fits: dict[str, bool]  # card key -> fits


@dataclass
class Frontier:
    card: str
    largest: int | None  # None: not even the smallest value fits
    first_oom: int | None  # the next value up, probed and not fitting; None: the top of the range fits
    monotone: bool = True  # False: some value above `largest` fitted again (reported, not hidden)


@dataclass
class Search:
    values: list[int]  # the grid searched
    probes: dict[int, Probe] = field(default_factory=dict)
    frontiers: dict[str, Frontier] = field(default_factory=dict)


def grid(lo: int, hi: int, step: int) -> list[int]:
    return list(range(lo, hi + 1, step))


def search(probe: Callable[[int], Probe], rooms: dict[str, int], values: list[int],
           width: int = 1, probe_many: Callable[[list[int]], list[Probe]] | None = None,
           ends: bool = False) -> Search:
    """Frontier per card. `rooms`: card key -> the bytes the run may use on it (the interpolation
    target); `probe(v)` runs value v. Probes are shared across cards, largest room first.

    With `width` > 1, each round guesses for up to `width` cards whose brackets are still open
    and runs those probes together (`probe_many`): fewer rounds, sometimes a probe more. `ends`:
    the top of the range is probed with the bottom (a count search's fewest GPUs: each card that
    holds the job there is settled by it, where interpolating on bytes that barely move with the
    count walked every count down to it)."""
    s = Search(values)
    probe_many = probe_many or (lambda vs: [probe(v) for v in vs])
    first = [values[0], values[-1]] if ends and len(values) > 1 else [values[0]]
    s.probes.update(zip(first, probe_many(first) if width > 1 else map(probe, first), strict=True))
    cards = sorted(rooms, key=rooms.get, reverse=True)
    bisect_next = dict.fromkeys(cards, False)
    while True:
        guesses: dict[int, list] = {}  # index -> [(card, closed bracket width)]
        for card in cards:
            lo, hi = _bracket(s, values, card)
            h = len(values) if hi is None else hi  # past the end: "nothing above fails"
            if lo is None or h - lo <= 1:
                continue
            guess = lo + (h - lo) // 2 if bisect_next[card] else _interpolate(s, values, card, rooms[card], lo, hi)
            guess = min(max(guess, lo + 1), h - 1)
            guesses.setdefault(guess, []).append((card, None if hi is None else h - lo))
            if len(guesses) == width:
                break
        if not guesses:
            break
        order = sorted(guesses)
        for i, p in zip(order, probe_many([values[i] for i in order])):
            s.probes[values[i]] = p
        for entries in guesses.values():
            for card, was in entries:
                lo2, hi2 = _bracket(s, values, card)
                # Safeguard: when a guess did not halve a closed bracket, bisect once.
                bisect_next[card] = was is not None and lo2 is not None and hi2 is not None and (hi2 - lo2) * 2 > was
    for card in cards:
        s.frontiers[card] = _frontier(s, values, card)
    return s


def _bracket(s: Search, values: list[int], card: str) -> tuple[int | None, int | None]:
    """(index of the largest probed value that fits below the first failure, index of the first
    probed failure) for `card`."""
    probed = sorted(values.index(v) for v in s.probes)
    fails = [i for i in probed if not s.probes[values[i]].fits[card]]
    hi = fails[0] if fails else None
    fits = [i for i in probed if s.probes[values[i]].fits[card] and (hi is None or i < hi)]
    return (fits[-1] if fits else None), hi


def _interpolate(s: Search, values: list[int], card: str, room: int, lo: int, hi: int | None) -> int:
    """Index where the bytes, linear in the value between two probes, reach `room` (floor)."""
    a = s.probes[values[lo]]
    if hi is not None:
        b = s.probes[values[hi]]
    else:  # extrapolate from the two largest probes below, or double
        below = [values.index(v) for v in s.probes if values.index(v) < lo]
        if not below:
            return _index_at_or_below(values, 2 * values[lo])
        b, a = a, s.probes[values[max(below)]]
    if b.bytes == a.bytes:
        return lo + 1 if hi is None else (lo + hi) // 2
    target = a.value + (room - a.bytes) * (b.value - a.value) / (b.bytes - a.bytes)
    return _index_at_or_below(values, int(target))


def _index_at_or_below(values: list[int], v: int) -> int:
    """The index of the largest of the (increasing) `values` at or below `v`; 0 below them all."""
    return max(0, bisect_right(values, v) - 1)


def _frontier(s: Search, values: list[int], card: str) -> Frontier:
    lo, hi = _bracket(s, values, card)
    largest = values[lo] if lo is not None else None
    first_oom = values[hi] if hi is not None else None
    above = [v for v, p in s.probes.items() if first_oom is not None and v > first_oom and p.fits[card]]
    return Frontier(card, largest, first_oom, monotone=not above)
