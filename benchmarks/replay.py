"""Replay speed of the allocator model: `python benchmarks/replay.py`.

Prints seconds for a synthetic 50,000-event trace (target: under 2 s) and for the shared real
snapshots (each checked against its recording).
"""

import random
import time
from pathlib import Path

from harness.allocator import snapshot as snap
from harness.allocator.replay import replay_events, replay_snapshot
from harness.allocator.settings import AllocSettings

MiB = 1024**2


def synthetic(n_events: int, seed: int = 0) -> list[tuple]:
    """Training-like churn: long- and short-lived tensors from 512 B to 64 MiB."""
    rng, rows, live, key = random.Random(seed), [], [], 0
    while len(rows) < n_events:
        if live and rng.random() < 0.48:
            rows.append(("free", live.pop(rng.randrange(len(live))), 0, None, 0))
        else:
            size = rng.choice([rng.randint(1, 8192), rng.randint(MiB, 64 * MiB)])
            rows.append(("alloc", key, size, None, 0))
            live.append(key)
            key += 1
    return rows


def main() -> None:
    rows = synthetic(50_000)
    for conf in ("", "expandable_segments:True", "max_split_size_mb:128"):
        t0 = time.perf_counter()
        result, _ = replay_events(rows, AllocSettings.from_conf(conf))
        dt = time.perf_counter() - t0
        print(f"synthetic 50,000 events [{conf or 'default'}]: {dt:.3f} s "
              f"(peak reserved {result.peak_reserved_bytes / MiB:.0f} MiB)")
    shared = Path(__file__).resolve().parents[1] / "tests" / "data" / "snapshots"
    for path in sorted(shared.glob("*.pickle")):
        data = snap.load(path)
        t0 = time.perf_counter()
        r = replay_snapshot(data)
        dt = time.perf_counter() - t0
        print(f"{path.name}: {r.requests} requests in {dt:.3f} s, exact={r.exact}")


if __name__ == "__main__":
    main()
