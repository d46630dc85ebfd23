"""Rank 0 of a point over several GPUs measured on this machine's one card, its peers faked
(torch's `fake` process group: every collective returns at once and sends nothing; its outputs
hold whatever the allocator handed out). What it allocates is rank 0's: its shards, FSDP2's
all-gather and reduce-scatter buffers on their own streams, the real caching allocator deciding;
what it lacks is NCCL's own memory (counted apart: config.nccl) and any wait on a peer. For
tests/test_cuda.py to compare with the virtual GPU's rank 0 (the same fake group, no card).

    python tests/scripts/fake_peers.py <point.json> <run_dir> [cuda|cpu]   (prints the row's figures as JSON;
    cpu: the job on this machine's CPU tensors, tracked as the virtual GPU tracks: the script's own check)
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from harness.config.point import Backend, Point
from harness.probe import worker

FIGURES = ("status", "error", "device_name", "peak_allocated_bytes", "peak_reserved_bytes", "peak_requested_bytes",
           "params_bytes", "grads_bytes", "optimizer_bytes", "num_alloc_retries", "attention_calls")


def main(point_json: Path, run_dir: Path, backend: Backend) -> None:
    point = Point.from_dict(json.loads(point_json.read_text())).replace(backend=backend)
    if backend == Backend.cuda:
        torch.cuda.set_device(0)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=point.parallel.world_size)
    try:
        rec = (worker.run_cuda if backend == Backend.cuda else worker.run_cpu)(point, run_dir)
    finally:
        dist.destroy_process_group()
    print(json.dumps({k: rec.get(k) for k in FIGURES}, default=str))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), Backend(sys.argv[3] if len(sys.argv) > 3 else "cuda"))
