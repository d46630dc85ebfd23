"""A 70B (GQA) training point and a 405B serving point on the virtual GPU, each in a fresh process
as the zygote's child would run it: `python benchmarks/big_points.py [rounds]`.

Prints per point the wall time of the worker's run (trace + replay for every card; imports and
the warm-up a zygote does once are not counted), its CPU time (steadier where the machine is
shared) and the process's peak RSS. Targets: 70B <= 15 s,
405B <= 30 s, RSS <= 4 GiB; one rank of 70B over 64 GPUs <= 15 s (issue 17: no more than the
70B point on one GPU), over 8 with DDP, and the 405B served over TP 8; Mistral-7B decoding 256
tokens across its sliding window <= 30 s. The one-GPU 70B job and its rank of 64 run `rounds`
times (default 3) in turn: the median of each round's ratio.
"""

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, resource, sys, tempfile, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from harness.launch.zygote import ready_to_fork
from harness.probe import worker
from tests.conftest import train_point
from harness.config.point import Parallel, Workload
spec = json.loads(sys.argv[2])
ready_to_fork(spec["model"])  # as the zygote a sweep of this model starts, then forks from
point = train_point(model=spec["model"], batch_size=spec["batch_size"], seq_len=spec["seq_len"],
                    checkpointing=spec.get("checkpointing", False))
shard, replicate, tp = spec.get("dp_shard", 1), spec.get("dp_replicate", 1), spec.get("tp", 1)
if shard * replicate * tp > 1:
    point = point.replace(parallel=Parallel(dp_shard=shard, dp_replicate=replicate, tp=tp, nodes="auto"))
if spec["workload"] == "infer":
    point = point.replace(workload=Workload(name="infer", new_tokens=spec.get("new_tokens", 16)))
traced = []  # the seconds of each trace the point takes (its own; one per card of other attention kernels)
def timed(*args, _traced=worker._traced):
    t = time.perf_counter()
    try:
        return _traced(*args)
    finally:
        traced.append(time.perf_counter() - t)
worker._traced = timed
t0, c0 = time.perf_counter(), time.process_time()
rec = worker.run_sim(point, Path(tempfile.mkdtemp()))
wall, cpu = time.perf_counter() - t0, time.process_time() - c0
print(json.dumps({"wall_s": wall, "cpu_s": cpu, "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "status": rec["status"], "method": rec["trace_method"], "reserved": rec["peak_reserved_bytes"],
                  "trace_s": traced[0], "fits": len(rec["fits_cards"])}))
"""

ONE_GPU, SPREAD = "70b train b1 s4096 ckpt (one GPU)", "70b train b1 s4096 ckpt over 64 (FSDP2)"

POINTS = [
    {"name": "70b train b1 s4096 bf16 adamw", "model": "70b", "workload": "train", "batch_size": 1, "seq_len": 4096,
     "target_s": 15},
    {"name": "llama3-405b infer b1 s8192 bf16", "model": "llama3-405b", "workload": "infer", "batch_size": 1,
     "seq_len": 8192, "target_s": 30},
    # issue 17: one rank of 64 should cost no more than the 70B point on one GPU; the same job on one
    # GPU (its replays differ: a card between a point's allocated and reserved peaks takes its own)
    {"name": ONE_GPU, "model": "70b", "workload": "train", "batch_size": 1, "seq_len": 4096, "checkpointing": True,
     "target_s": 15},
    {"name": SPREAD, "model": "70b", "workload": "train", "batch_size": 1, "seq_len": 4096, "checkpointing": True,
     "dp_shard": 64, "target_s": 15},
    # serving over tensor parallel: one rank of 8 (a node of A100s does not hold it: 94.5 GiB of weights a GPU)
    {"name": "llama3-405b infer b1 s8192 over TP 8", "model": "llama3-405b", "workload": "infer", "batch_size": 1,
     "seq_len": 8192, "tp": 8, "target_s": 30},
    # DDP: its setup traced at the model's depth, the rest synthesized (43 s traced in full)
    {"name": "70b train b1 s4096 ckpt over 8 (DDP)", "model": "70b", "workload": "train", "batch_size": 1,
     "seq_len": 4096, "checkpointing": True, "dp_replicate": 8, "target_s": 15},
    # a decode across Mistral's sliding window (4096), 152 steps past the prompt: the steps across it
    # traced from a prompt of 4091 and joined (22.7 s against 61.3 s with every step to 3 past the
    # window traced; 15.2 s decoding 256 after 4144 tokens, no window crossed)
    {"name": "mistral-7b infer b1 s4200, 256 decoded", "model": "mistral-7b", "workload": "infer", "batch_size": 1,
     "seq_len": 4200, "new_tokens": 256, "target_s": 30},
]


def machine_speed() -> float:
    """Seconds a 20M-iteration Python loop takes: this machine's speed at the moment (a shared one
    swings 2-2.7x within an hour; compare figures taken at the same speed)."""
    t0 = time.perf_counter()
    x = 0
    for i in range(20_000_000):
        x += i
    return time.perf_counter() - t0


def _run(spec: dict) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, str(REPO), json.dumps(spec)], capture_output=True,
                         text=True, check=True).stdout.strip().splitlines()[-1]
    return json.loads(out)


def main(rounds: int) -> None:
    print(f"machine: a 20M-iteration Python loop in {machine_speed():.2f} s")
    runs = {}
    for spec in POINTS:
        r = runs[spec["name"]] = _run(spec)
        print(f"{spec['name']:34s} {r['wall_s']:6.2f} s (target <= {spec['target_s']} s; CPU {r['cpu_s']:.2f} s)  peak RSS "
              f"{r['rss'] / 2**30:.2f} GiB (target <= 4)  {r['status']}, reserved {r['reserved'] / 2**30:.1f} GiB; "
              f"{r['method']}")
    # Issue 17's pair again, alternated: the machine's speed swings within a minute, so one run of
    # each can put either ahead; each round's ratio is taken at one speed, their median reported
    specs = {s["name"]: s for s in POINTS}
    pair = [[runs[n] for n in (ONE_GPU, SPREAD)]]
    pair += [[_run(specs[n]) for n in (ONE_GPU, SPREAD)] for _ in range(rounds - 1)]
    ratios = sorted(spread["wall_s"] / one["wall_s"] for one, spread in pair)
    one, spread = pair[0]
    print(f"one rank of 64 against the same job on one GPU: {statistics.median(ratios):.2f}x, the median of {rounds} "
          f"alternated rounds ({', '.join(f'{r:.2f}' for r in ratios)}; issue 17's target: <= 1); the first round's "
          f"trace {spread['trace_s']:.2f} s against {one['trace_s']:.2f} s ({spread['trace_s'] / one['trace_s']:.2f}x), "
          f"the rest (each card judged: {spread['fits']} hold the rank, {one['fits']} the one-GPU job) "
          f"{spread['wall_s'] - spread['trace_s']:.2f} s against {one['wall_s'] - one['trace_s']:.2f} s")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
