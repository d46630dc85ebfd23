"""One FSDP2 job over several shard counts, as a sweep or plan over counts runs it:
`python benchmarks/shard_counts_70b.py [rounds]`.

Llama-2-70B, bf16, checkpointing, batch 1 x 4096 per GPU. Each point runs in a fresh process as a
zygote's child runs it (imports and the zygote's warm-up not counted; its wall time is the worker's:
trace and the replays for every card). First 8 and 16 GPUs, sharing one trace cache (traced); then
`rounds` times (default 3), in turn: the job on one GPU, and over 32 and 64 GPUs each on a copy of
that cache (made from those two counts' traces: probe.sim.shard_counts); last, 32 and 64 each on a
cache of its own (traced). Prints each point's time, how its trace was made and its peaks; whether
the made points' rows equal the traced ones; and the median of the rounds' ratios of a made count's
time to the one-GPU point's (each round's taken at one machine speed, which swings 2-3x within an
hour here). Target (issue 17): a count made from others costs no more than the 70B point on one GPU.
"""

import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.big_points import machine_speed  # noqa: E402

CHILD = r"""
import json, sys, tempfile, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from harness.config.point import Parallel
from harness.launch.zygote import ready_to_fork
from harness.probe import worker
from tests.conftest import train_point
gpus, cache = int(sys.argv[2]), sys.argv[3]
ready_to_fork("70b")
point = train_point(model="70b", batch_size=1, seq_len=4096, checkpointing=True).replace(trace_cache=cache)
if gpus > 1:
    point = point.replace(parallel=Parallel(dp_shard=gpus, nodes="auto"))
t = time.perf_counter()
rec = worker.run_sim(point, Path(tempfile.mkdtemp()))
print(json.dumps({**rec, "wall_s": time.perf_counter() - t}, default=str))
"""

TRACED, MADE = (8, 16), (32, 64)
# what a row says of its own making or run, not of the job's memory
_OWN = {"run_id", "wall_s", "trace_method", "trace_path", "snapshot_path", "trace_reused"}


def run(gpus: int, cache: Path) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, str(REPO), str(gpus), str(cache)], capture_output=True,
                         text=True, check=True).stdout.strip().splitlines()[-1]
    return json.loads(out)


def said(name: str, rec: dict) -> str:
    return (f"{name:24s} {rec['wall_s']:5.2f} s  allocated {rec['peak_allocated_bytes'] / 2**30:6.2f} GiB  reserved "
            f"{rec['peak_reserved_bytes'] / 2**30:6.2f} GiB  {rec['trace_method'].split(';')[0]}")


def main(rounds: int) -> None:
    print(f"machine: a 20M-iteration Python loop in {machine_speed():.2f} s")
    root = Path(tempfile.mkdtemp())
    filled = root / "filled"
    for gpus in TRACED:
        print(said(f"over {gpus} GPUs, traced", run(gpus, filled)), flush=True)
    ratios: dict[int, list[float]] = {g: [] for g in MADE}
    made: dict[int, dict] = {}
    for i in range(rounds):
        one = run(1, root / f"one-{i}")
        print(said(f"round {i + 1}: on one GPU", one), flush=True)
        for gpus in MADE:
            copy = root / f"made-{gpus}-{i}"
            shutil.copytree(filled, copy)
            rec = made[gpus] = run(gpus, copy)
            ratios[gpus].append(rec["wall_s"] / one["wall_s"])
            print(said(f"  over {gpus} GPUs, made", rec) + f"  ({ratios[gpus][-1]:.2f}x)", flush=True)
    for gpus in MADE:
        rec = run(gpus, root / f"traced-{gpus}")
        same = {k: v for k, v in rec.items() if k not in _OWN} == {k: v for k, v in made[gpus].items() if k not in _OWN}
        print(said(f"over {gpus} GPUs, traced", rec) + f"  the same row as made: {same}", flush=True)
    for gpus in MADE:
        r = sorted(ratios[gpus])
        print(f"made over {gpus} GPUs against one GPU: {statistics.median(r):.2f}x, the median of {rounds} rounds "
              f"({', '.join(f'{x:.2f}' for x in r)}; issue 17's target: <= 1)")
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
