"""Time the tour on a T4 (`sweeps=four-kinds`, 16 points of demo-1b), cold:
`python benchmarks/four_kinds.py [overrides]`.

Runs `python -m harness sweep sweeps=four-kinds` into a fresh results dir and prints its wall time
against README's "under a minute on 2 cores", the machine's speed, the points' own walls, and how
the cards whose attention kernels differ from the T4's were judged (trace_method: by a trace of
their own, or by another trace with its fused calls' rows rewritten).
"""

import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
from big_points import machine_speed  # (this script's folder is on sys.path)

# "<cards> judged by <how>" in trace_method, each clause after the first "; "
_JUDGED = re.compile(r"; ([^;]+?) judged by ([^;]+)")


def main(overrides: list[str]) -> None:
    print(f"machine: a 20M-iteration Python loop in {machine_speed():.2f} s")
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        r = subprocess.run([sys.executable, "-m", "harness", "sweep", "sweeps=four-kinds", *overrides,
                            f"results_dir={tmp}"], capture_output=True, text=True)
        wall = time.perf_counter() - t0
        df = pd.read_parquet(next(Path(tmp).glob("four-kinds/*/results.parquet")))
    ways: dict[str, int] = {}
    for method in df["trace_method"].fillna(""):
        for cards, how in _JUDGED.findall(method):
            ways[how] = ways.get(how, 0) + len(cards.split(", "))
    print(f"exit code        {r.returncode}")
    print(f"points           {len(df)} ({df['status'].value_counts().to_dict()}), kinds "
          f"{df['kind'].value_counts().to_dict()}")
    print(f"wall             {wall:.1f} s (target <= 60 s); the points' own {df['wall_s'].sum():.1f} s "
          f"(slowest {df['wall_s'].max():.1f} s)")
    for how, n in ways.items():
        print(f"cards judged by  {how}: {n}")


if __name__ == "__main__":
    main(sys.argv[1:])
