"""A frontier against the exhaustive sweep of the same grid: `python benchmarks/frontier_7b.py [overrides]`.

Searches, per card of the catalog, the largest batch of 7B bf16 training with checkpointing at
2,048 tokens (batch 1..32) that fits; then sweeps every batch of the grid and checks that each
frontier is the largest fitting value. Prints both wall times and the points each cost.
"""

import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd

from harness.config import cards as catalog
from harness.plan import fit

GRID = ["sweeps=smoke", "model=7b", "seq_len=2048", "precision=bf16", "checkpointing=true", "sweep=frontier"]


def _run(verb: str, args: list[str]) -> tuple[float, int]:
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "harness", verb, *args], capture_output=True, text=True, check=False)
    return time.perf_counter() - t0, r.returncode


def main(overrides: list[str]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        common = [*GRID, *overrides, f"results_dir={tmp}"]
        plan_s, rc_plan = _run("plan", [*common, "plan.hi=32"])
        [plan_dir] = Path(tmp, "frontier").iterdir()
        fr = pd.read_parquet(plan_dir / "frontier.parquet")
        sweep_s, rc_sweep = _run("sweep", [*common, "batch_size=range(1,33)"])
        [sweep_dir] = [d for d in Path(tmp, "frontier").iterdir() if d != plan_dir]
        rows = pd.read_parquet(sweep_dir / "results.parquet").to_dict("records")
    cards = {c["key"]: c for c in catalog.cards()}
    agree = 0
    print(f"{'card':<10} {'frontier':>8} {'exhaustive':>10}")
    for f in fr.itertuples():
        fitting = [r["batch_size"] for r in rows if fit.fits(r, cards[f.card])]
        best = max(fitting) if fitting else None
        largest = None if pd.isna(f.largest) else int(f.largest)
        agree += largest == best
        print(f"{f.card:<10} {largest!s:>8} {best!s:>10}")
    print(f"exit codes       plan {rc_plan}, sweep {rc_sweep}")
    print(f"agreement        {agree}/{len(fr)} cards")
    print(f"plan             {int(fr['probes'].iloc[0])} probes of {int(fr['grid_points'].iloc[0])} grid points, "
          f"{plan_s:.1f} s")
    print(f"exhaustive sweep {len(rows)} points ({sum(isinstance(r['reused_from'], str) for r in rows)} reused "
          f"from the plan), {sweep_s:.1f} s")


if __name__ == "__main__":
    main(sys.argv[1:])
