"""Time `python -m harness plan sweeps=finetune-7b` (4 searches over batch 1..64 at 2,048 tokens,
every card of the catalog) on the virtual GPU: `python benchmarks/plan_finetune_7b.py`.
Target on 2 cores: <= 90 s."""

import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        r = subprocess.run([sys.executable, "-m", "harness", "plan", "sweeps=finetune-7b", f"results_dir={tmp}"],
                           capture_output=True, text=True)
        wall = time.perf_counter() - t0
        rows = pd.read_parquet(next(Path(tmp).glob("*/*/results.parquet")))
    print(f"exit code        {r.returncode}")
    print(f"probes           {len(rows)} points ({rows['status'].value_counts().to_dict()})")
    print(f"wall             {wall:.1f} s (target <= 90 s)")


if __name__ == "__main__":
    main()
