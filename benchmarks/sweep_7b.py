"""Time the default 7B grid on the virtual GPU: `python benchmarks/sweep_7b.py [overrides]`.

Prints wall time, points, seconds per point and the parallelism used. Target: a grid of dozens
of points in about a minute on a laptop-class CPU.
"""

import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd

from harness.config.compose import parallelism


def main(overrides: list[str]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        r = subprocess.run([sys.executable, "-m", "harness", "sweep", "model=7b", *overrides,
                            f"results_dir={tmp}"], capture_output=True, text=True)
        wall = time.perf_counter() - t0
        [parquet] = Path(tmp).glob("*/*/results.parquet")
        df = pd.read_parquet(parquet)
    print(f"exit code        {r.returncode}")
    print(f"points           {len(df)} ({df['status'].value_counts().to_dict()})")
    print(f"parallelism      {parallelism()}")
    print(f"wall             {wall:.1f} s")
    print(f"per point        {wall / len(df):.2f} s wall, {df['wall_s'].mean():.2f} s traced (mean)")


if __name__ == "__main__":
    main(sys.argv[1:])
