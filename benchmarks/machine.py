"""This machine's speed now, beside the other benchmarks' wall times: a fixed pure-Python loop (20 M
additions, one core, best of three). On the 2-core VM the benchmarks were measured on, it took
0.95-1.10 s in one afternoon while the default grid's cold wall time ranged over 55-67 s: a hint of
a slow hour, not a correction for it."""

import time

LOOP = 20_000_000


def reference_s() -> float:
    """Seconds for the loop, the best of three (a moment's interruption is not the machine's speed)."""
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        x = 0
        for i in range(LOOP):
            x += i
        best = min(best, time.perf_counter() - t0)
    return best


if __name__ == "__main__":
    print(f"reference loop   {reference_s():.2f} s")
