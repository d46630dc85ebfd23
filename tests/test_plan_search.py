import random

import pytest

from harness.plan.search import Probe, grid, search


def linear_job(base: int, per_unit: int, rooms: dict[str, int], noise=lambda v: 0):
    """A job whose bytes are base + per_unit x value (+ noise), fitting where bytes <= room."""
    calls = []

    def probe(v: int) -> Probe:
        calls.append(v)
        b = base + per_unit * v + noise(v)
        return Probe(v, b, {k: b <= r for k, r in rooms.items()})

    return probe, calls


def exhaustive(probe, values, cards):
    out = {}
    for card in cards:
        fitting = [v for v in values if probe(v).fits[card]]
        out[card] = max(fitting) if fitting else None
    return out


@pytest.mark.parametrize("width", [1, 3])
@pytest.mark.parametrize("seed", range(40))
def test_frontier_agrees_with_exhaustive_sweep_at_a_fraction_of_the_probes(seed, width):
    rng = random.Random(seed)
    rooms = {f"card{i}": rng.randrange(10, 200) * 2**30 for i in range(6)}
    base, per = rng.randrange(1, 40) * 2**30, rng.randrange(1, 4 * 2**30)
    # Not quite linear (the allocator rounds, segments come in sizes), but still increasing.
    wobble = lambda v: (v * 7919 % 13) * per // 26
    probe, calls = linear_job(base, per, rooms, wobble)
    values = grid(1, 512, 1)
    rounds = []

    def probe_many(vs):
        rounds.append(vs)
        return [probe(v) for v in vs]

    s = search(probe, rooms, values, width=width, probe_many=probe_many)
    expected = exhaustive(lambda v: linear_job(base, per, rooms, wobble)[0](v), values, rooms)
    assert {k: f.largest for k, f in s.frontiers.items()} == expected
    assert len(set(calls)) == len(calls)  # no value probed twice
    assert len(calls) <= (4 if width == 1 else 6) * len(rooms) + 2  # of 512 values
    assert all(len(r) <= width for r in rounds)


def test_every_frontier_is_probed_on_both_sides_of_its_boundary():
    rooms = {"small": 20 * 2**30, "big": 80 * 2**30}
    probe, calls = linear_job(10 * 2**30, 2**30, rooms)
    s = search(probe, rooms, grid(1, 256, 1))
    assert s.frontiers["small"].largest == 10 and s.frontiers["small"].first_oom == 11
    assert s.frontiers["big"].largest == 70 and s.frontiers["big"].first_oom == 71
    assert {10, 11, 70, 71} <= set(calls)


def test_nothing_fits_and_everything_fits_are_reported_as_such():
    rooms = {"tiny": 2**30, "huge": 2**50}
    probe, calls = linear_job(2 * 2**30, 2**20, rooms)
    s = search(probe, rooms, grid(8, 64, 8))
    assert s.frontiers["tiny"].largest is None and s.frontiers["tiny"].first_oom == 8
    assert s.frontiers["huge"].largest == 64 and s.frontiers["huge"].first_oom is None
    assert calls[0] == 8 and 64 in calls


def test_step_granularity_is_respected():
    rooms = {"c": 40 * 2**30}
    probe, calls = linear_job(0, 2**20, rooms)  # 1 MiB per token: boundary at 40960 tokens
    s = search(probe, rooms, grid(128, 65536, 128))
    assert s.frontiers["c"].largest == 40960 and all(v % 128 == 0 for v in calls)


def test_a_non_monotone_card_is_flagged_not_hidden():
    fits = {1: True, 2: True, 3: False, 4: True, 5: False}

    def probe(v):
        return Probe(v, v * 10, {"c": fits[v]})

    from harness.plan.search import Search, _frontier

    s = Search([1, 2, 3, 4, 5], probes={v: probe(v) for v in fits})

    f = _frontier(s, [1, 2, 3, 4, 5], "c")
    assert f.largest == 2 and f.first_oom == 3 and not f.monotone


@pytest.mark.parametrize("width", [1, 2])
def test_a_count_search_settles_the_cards_that_hold_the_job_at_the_top_with_two_probes(width):
    """A count search (places from the most GPUs to one) probes both ends first: a job whose bytes
    barely move with the count and that one GPU of every card holds costs two probes, not one per
    count; cards that need more GPUs still find theirs, checked at the place above."""
    counts = [64, 32, 16, 8, 4, 2, 1]
    places = list(range(len(counts)))

    def job(rooms, per_gpu):
        calls = []

        def probe(x):
            calls.append(x)
            b = per_gpu(counts[x])
            return Probe(x, b, {k: b <= r for k, r in rooms.items()})
        return probe, calls

    flat, calls = job({"a": 10 * 2**30, "b": 80 * 2**30}, lambda n: 2**30 + 2**20 // n)
    s = search(flat, {"a": 10 * 2**30, "b": 80 * 2**30}, places, width, lambda xs: [flat(x) for x in xs], ends=True)
    assert sorted(calls) == [0, 6] and {f.largest for f in s.frontiers.values()} == {6}
    rooms = {"small": 12 * 2**30, "mid": 40 * 2**30, "big": 200 * 2**30}
    sharded, calls = job(rooms, lambda n: 2**30 + 100 * 2**30 // n)
    s = search(sharded, rooms, places, width, lambda xs: [sharded(x) for x in xs], ends=True)
    fewest = {k: counts[f.largest] for k, f in s.frontiers.items()}
    assert fewest == {"small": 16, "mid": 4, "big": 1}  # 1 + 100/n GiB per GPU
    assert all(f.first_oom == f.largest + 1 for k, f in s.frontiers.items() if k != "big")


@pytest.mark.parametrize("width", [1, 2])
def test_counts_searched_by_their_share_of_the_most_gpus_interpolate_on_a_grid_of_powers_of_two(width):
    """A count plan searches the share of the most GPUs each count holds (1, 2, ..., 64), in which
    per-GPU sharded state grows linearly: the grid is not evenly stepped, and each card's fewest
    GPUs is found, checked at the share above, with fewer probes than there are counts."""
    shares = [1, 2, 4, 8, 16, 32, 64]
    rooms = {"small": 12 * 2**30, "mid": 40 * 2**30, "big": 200 * 2**30}
    probe, calls = linear_job(2**30, 100 * 2**30 // 64, rooms)  # 1 + 100/n GiB on n = 64/share GPUs
    s = search(probe, rooms, shares, width, lambda vs: [probe(v) for v in vs], ends=True)
    assert {k: 64 // f.largest for k, f in s.frontiers.items()} == {"small": 16, "mid": 4, "big": 1}
    assert s.frontiers["small"].first_oom == 8 and s.frontiers["mid"].first_oom == 32
    assert len(calls) < len(shares)
    # one card of 30 GiB: both ends, then the share the bytes reach its room at (18.6: 16) and the one
    # above; a grid read as evenly stepped guessed 64's index and bisected its way down (6 probes)
    probe, calls = linear_job(2**30, 100 * 2**30 // 64, {"a": 30 * 2**30})
    s = search(probe, {"a": 30 * 2**30}, shares, width, lambda vs: [probe(v) for v in vs], ends=True)
    assert s.frontiers["a"].largest == 16 and sorted(calls) == [1, 16, 32, 64]
