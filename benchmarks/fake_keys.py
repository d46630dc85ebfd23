"""What the fast FakeTensor cache key (probe.sim.fake_keys) saves a point, in one process:
`python benchmarks/fake_keys.py [rounds]`.

Each point runs as a zygote's child runs it (worker.run_sim after ready_to_fork), keyed by torch's
own code and by fake_keys' in turn, `rounds` times each, alternating; prints the least CPU time of
each and their ratio. Alternating in one process keeps the machine's speed, which swings 2-3x
within an hour here, out of the comparison. Says so and stops where fake_keys does not apply to
this torch.
"""

import contextlib
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness.config.point import Parallel  # noqa: E402
from harness.launch.zygote import ready_to_fork  # noqa: E402
from harness.probe import worker  # noqa: E402
from harness.probe.sim import fake_keys, trace  # noqa: E402
from tests.conftest import train_point  # noqa: E402

POINTS = {
    "tiny b4 s256 (a test's point)": lambda: train_point(batch_size=4, seq_len=256),
    "7b b4 s1024 ckpt (the default grid's)": lambda: train_point(model="7b", batch_size=4, seq_len=1024,
                                                                 checkpointing=True),
    "70b b1 s4096 ckpt, a rank of 64 (FSDP2)": lambda: train_point(
        model="70b", batch_size=1, seq_len=4096, checkpointing=True).replace(parallel=Parallel(dp_shard=64, nodes="auto")),
}
KEYS = {"torch's key": contextlib.nullcontext, "fake_keys'": fake_keys.fast_keys}


def main(rounds: int) -> None:
    if not fake_keys.applies():
        print("fake_keys does not apply to this torch: its points keep torch's key")
        return
    ready_to_fork("7b")
    for name, make in POINTS.items():
        point = make()
        worker.run_sim(point, Path(tempfile.mkdtemp()))  # (its first run warms FakeTensor's cache)
        cpu: dict[str, list[float]] = {k: [] for k in KEYS}
        for i in range(rounds):
            for key in (list(KEYS) if i % 2 == 0 else list(KEYS)[::-1]):
                trace.fast_keys = KEYS[key]
                t = time.process_time()
                worker.run_sim(point, Path(tempfile.mkdtemp()))
                cpu[key].append(time.process_time() - t)
        old, new = (min(cpu[k]) for k in KEYS)
        print(f"{name:42s} CPU {old:.2f} s with torch's key, {new:.2f} s with fake_keys' ({new / old:.2f}x; "
              f"least of {rounds} each)")
    trace.fast_keys = fake_keys.fast_keys


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
