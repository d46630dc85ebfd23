"""The default 7B grid's points one after another in one process, as a zygote's children run them
(trace, record and replays; no CLI, no report, no parallelism): `python benchmarks/grid_points_7b.py
[--profile N]`.

What a sweep's points cost of themselves, apart from how many run at once: the sweep's wall time
on 2 cores is about half of it (benchmarks/sweep_7b.py). Prints the wall and CPU seconds of the 48
points and the machine's speed; `--profile N` also the N costliest functions.
"""

import argparse
import cProfile
import pstats
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.big_points import machine_speed  # noqa: E402
from harness.cli.common import prepare  # noqa: E402
from harness.launch.zygote import ready_to_fork  # noqa: E402
from harness.probe import worker  # noqa: E402


def main(profile: int) -> None:
    print(f"machine: a 20M-iteration Python loop in {machine_speed():.2f} s")
    out = Path(tempfile.mkdtemp(prefix="grid-points-"))
    prepared = prepare("sweep", ["model=7b", f"results_dir={out}"])
    # one trace cache for the grid, as a sweep's points share theirs
    points = [p.replace(trace_cache=str(out / ".traces")) for p in prepared.resolved(str(REPO), False, [], out)]
    ready_to_fork("7b")  # as the zygote does once before it forks
    profiler = cProfile.Profile() if profile else None
    t0, c0 = time.perf_counter(), time.process_time()
    if profiler:
        profiler.enable()
    for i, point in enumerate(points):
        run_dir = out / "runs" / str(i)
        run_dir.mkdir(parents=True)
        worker.run_sim(point, run_dir)
    if profiler:
        profiler.disable()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    print(f"{len(points)} points: {wall:.1f} s wall, {cpu:.1f} s CPU ({wall / len(points):.2f} s a point)")
    if profiler:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(profile)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--profile", type=int, default=0, metavar="N")
    main(parser.parse_args().profile)
