"""One FSDP2 job over several shard counts, as a sweep or plan over counts runs it:
`python benchmarks/shard_counts_70b.py`.

Llama-2-70B, bf16, checkpointing, batch 1 x 4096 per GPU: first on one GPU; then over 8, 16, 32 and
64 GPUs sharing one trace cache (the first two counts traced, the others made from theirs:
probe.sim.shard_counts); then over 32 and 64 again, each with a cache of its own (traced). Prints
each point's wall time (the worker's run: trace and the replays for every card, in this one
process, as a zygote's child runs it), how its trace was made and its peaks; whether the made
points' rows equal the traced ones; and each made one's time against the one-GPU point's.
Target (issue 17): a count made from others costs no more than the 70B point on one GPU.
"""

import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from harness.config.point import Parallel  # noqa: E402
from harness.launch.zygote import ready_to_fork  # noqa: E402
from harness.probe import worker  # noqa: E402
from tests.conftest import train_point  # noqa: E402

COUNTS = (8, 16, 32, 64)
# what a row says of its own making or run, not of the job's memory
_OWN = {"run_id", "wall_s", "trace_method", "trace_path", "snapshot_path"}


def run(gpus: int, cache: str) -> dict:
    point = train_point(model="70b", batch_size=1, seq_len=4096, checkpointing=True).replace(trace_cache=cache)
    if gpus > 1:
        point = point.replace(parallel=Parallel(dp_shard=gpus, nodes="auto"))
    t = time.perf_counter()
    rec = worker.run_sim(point, Path(tempfile.mkdtemp()))
    return {**rec, "wall_s": time.perf_counter() - t}


def main() -> None:
    ready_to_fork("70b")
    one = run(1, tempfile.mkdtemp())
    print(f"on one GPU:                {one['wall_s']:5.2f} s  allocated {one['peak_allocated_bytes'] / 2**30:6.2f} GiB",
          flush=True)
    shared = tempfile.mkdtemp()
    made = {}
    for gpus in COUNTS:
        rec = made[gpus] = run(gpus, shared)
        print(f"over {gpus:>2} GPUs, one cache: {rec['wall_s']:5.2f} s  allocated {rec['peak_allocated_bytes'] / 2**30:6.2f} GiB"
              f"  reserved {rec['peak_reserved_bytes'] / 2**30:6.2f} GiB  {rec['trace_method'].split(';')[0]}", flush=True)
    for gpus in COUNTS[2:]:
        rec = run(gpus, tempfile.mkdtemp())
        same = {k: v for k, v in rec.items() if k not in _OWN} == {k: v for k, v in made[gpus].items() if k not in _OWN}
        print(f"over {gpus:>2} GPUs, traced:    {rec['wall_s']:5.2f} s  the same row as made: {same}; made "
              f"{made[gpus]['wall_s'] / one['wall_s']:.2f}x the one-GPU point (issue 17's target: <= 1)", flush=True)


if __name__ == "__main__":
    main()
