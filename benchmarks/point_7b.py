"""One 7B training point (b1 s1024 bf16 AdamW, 3 steps) two ways, side by side in one process:
`python benchmarks/point_7b.py`.

- harness: the point as a sweep traces it (probe.sim.shortcut: 1, 2 and 3 layers traced, 32
  synthesized and checked) plus the allocator replay for every card of the catalog;
- MemTracker: a plain FakeTensorMode trace of the same 32-layer steps under PyTorch's MemTracker
  (tests/memtracker_ref.py: the same model, CUDA emulations and steps).

Both run after one warm-up trace (FakeTensor's dispatch cache, lazy imports). Target: >= 20x.
"""

import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from harness.allocator.settings import AllocSettings  # noqa: E402
from harness.config import cards as catalog  # noqa: E402
from harness.probe.sim import reserved, shortcut  # noqa: E402
from harness.probe.sim.trace import run_point  # noqa: E402
from harness.record import trace_store  # noqa: E402
from tests.conftest import train_point  # noqa: E402
from tests.memtracker_ref import memtracker_peak  # noqa: E402


def harness_point(point) -> tuple[dict, dict]:
    traced = shortcut.trace(point)
    rows = trace_store.replay_rows(trace_store.to_frame(traced.events))
    replay = reserved.analyse(rows, AllocSettings.from_conf(point.allocator.conf), point.gpu, catalog.cards(),
                              torch.__version__, None)
    return traced.measurements, replay


def main() -> None:
    point = train_point(model="7b", batch_size=1, seq_len=1024, precision="bf16")
    run_point(shortcut.at_depth(point, 1))  # warm-up, for both
    t0 = time.perf_counter()
    m, replay = harness_point(point)
    ours = time.perf_counter() - t0
    t0 = time.perf_counter()
    peak = memtracker_peak(point)
    theirs = time.perf_counter() - t0
    print(f"point            7b train b1 s1024 bf16 adamw, {point.workload.steps} steps")
    print(f"harness          {ours:.2f} s ({m['trace_method']}; replay on {len(catalog.cards())} cards)")
    print(f"MemTracker       {theirs:.2f} s (plain FakeTensorMode trace of 32 layers)")
    print(f"speed-up         {theirs / ours:.1f}x (target >= 20x)")
    print(f"peaks            harness allocated {replay['peak_allocated_bytes'] / 2**30:.2f} GiB, reserved "
          f"{replay['peak_reserved_bytes'] / 2**30:.2f} GiB; MemTracker {peak / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
