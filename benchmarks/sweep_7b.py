"""Time the default 7B grid on the virtual GPU, cold and then fully cached:
`python benchmarks/sweep_7b.py [overrides]`.

Runs `python -m harness sweep model=7b` twice into one fresh results dir (the second run finds
every row done) and prints both wall times, the points, how their traces were made and the
parallelism. Targets on 2 cores: cold <= 60 s, cached <= 5 s.
"""

import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd

from harness.config.compose import parallelism


def _sweep(overrides: list[str], results: str) -> tuple[float, int]:
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "harness", "sweep", "model=7b", *overrides, f"results_dir={results}"],
                       capture_output=True, text=True)
    return time.perf_counter() - t0, r.returncode


def main(overrides: list[str]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        cold, rc = _sweep(overrides, tmp)
        cached, rc2 = _sweep(overrides, tmp)
        first, *_ = sorted(Path(tmp).glob("*/*/results.parquet"))
        df = pd.read_parquet(first)
    methods = df["trace_method"].fillna("").str.split(":").str[0].value_counts().to_dict()
    print(f"exit codes       {rc}, {rc2}")
    print(f"points           {len(df)} ({df['status'].value_counts().to_dict()}); traces {methods}")
    print(f"parallelism      {parallelism()}")
    print(f"cold             {cold:.1f} s (target <= 60 s); {cold / len(df):.2f} s a point, "
          f"{df['wall_s'].mean():.2f} s traced and replayed (mean)")
    print(f"cached re-run    {cached:.1f} s (target <= 5 s)")


if __name__ == "__main__":
    main(sys.argv[1:])
