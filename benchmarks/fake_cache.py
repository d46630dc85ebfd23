"""What the fast FakeTensor cache key and hit (probe.sim.fake_cache) save a point, in one process:
`python benchmarks/fake_cache.py [rounds]`.

Each point runs as a zygote's child runs it (worker.run_sim after ready_to_fork), its FakeTensor
cache keyed and its hits made by torch's own code, by fake_cache's key alone, and by fake_cache's
key and hit, in turn, `rounds` times each, alternating; prints the least CPU time of each and their
ratios to torch's: the median of each round's ratio (a round's runs are seconds apart). Alternating in
one process keeps the machine's speed, which swings 2-3x within an hour here (and within a minute:
the least of a few runs each can still mislead), out of the comparison. Says so and stops where
fake_cache does not apply to this torch.
"""

import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

from harness.config.point import Parallel  # noqa: E402
from harness.launch.zygote import ready_to_fork  # noqa: E402
from harness.probe import worker  # noqa: E402
from harness.probe.sim import fake_cache, trace  # noqa: E402
from harness.probe.sim.patches import patched  # noqa: E402
from tests.conftest import train_point  # noqa: E402

POINTS = {
    "tiny b4 s256 (a test's point)": lambda: train_point(batch_size=4, seq_len=256),
    "7b b4 s1024 ckpt (the default grid's)": lambda: train_point(model="7b", batch_size=4, seq_len=1024,
                                                                 checkpointing=True),
    "70b b1 s4096 ckpt, a rank of 64 (FSDP2)": lambda: train_point(
        model="70b", batch_size=1, seq_len=4096, checkpointing=True).replace(parallel=Parallel(dp_shard=64, nodes="auto")),
}
CACHES = {
    "torch's": contextlib.nullcontext,
    "fake_cache's key": lambda: patched([(FakeTensorMode, "_prep_args_for_hash", fake_cache._prep_args_for_hash)]),
    "fake_cache's key and hit": fake_cache.fast_cache,
}


def main(rounds: int) -> None:
    if not (fake_cache.applies() and fake_cache.hit_applies()):
        print("fake_cache does not apply to this torch: its points keep torch's cache code")
        return
    ready_to_fork("7b")
    for name, make in POINTS.items():
        point = make()
        worker.run_sim(point, Path(tempfile.mkdtemp()))  # (its first run warms FakeTensor's cache)
        cpu: dict[str, list[float]] = {k: [] for k in CACHES}
        for i in range(rounds):
            for cache in (list(CACHES) if i % 2 == 0 else list(CACHES)[::-1]):
                trace.fast_cache = CACHES[cache]
                t = time.process_time()
                worker.run_sim(point, Path(tempfile.mkdtemp()))
                cpu[cache].append(time.process_time() - t)
        torchs = cpu.pop("torch's")
        said = ", ".join(f"{min(v):.2f} s with {k} (median ratio {statistics.median(a / b for a, b in zip(v, torchs)):.2f}x)"
                         for k, v in cpu.items())
        print(f"{name:42s} CPU {min(torchs):.2f} s with torch's cache code, {said}; least of {rounds} each")
    trace.fast_cache = fake_cache.fast_cache


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 8)
