"""hydra/launcher=harness_local (the default): a sweep's points run from threads of this process.

The points are the ones `prepare` composed (Hydra's composition, Hydra's BasicSweeper's grid), each
run as every point runs (launch.runner: a process forked from the zygote, a fresh interpreter, or
a card of its own) in runs/<n> of the sweep dir, or found done in an earlier run of the sweep
without starting anything. Hydra's multirun would compose every job twice more and start a
process per point (submitit_local, ~2 s each); here the cost of a point is its own run.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

from harness.config.compose import parallelism
from harness.config.point import Point
from harness.errors import ConfigError
from harness.launch.runner import GPU_DEVICES_ENV, run_point
from harness.launch.threads import map_threads
from harness.record import trace_store
from harness.record.results import done_rows

TARGET = "hydra_plugins.harness_launcher.HarnessLocalLauncher"


@dataclass
class HarnessLocalConf:
    _target_: str = TARGET  # selects this path in the CLI (Hydra's own multirun runs it as its basic launcher)
    workers: int | None = None  # points at once; None: one per core (and per 2 GiB free), or per GPU


def chosen(base) -> bool:
    """Whether the sweep's launcher is this one (hydra/launcher=harness_local)."""
    return str(base.hydra.launcher.get("_target_", "")) == TARGET


def workers(configured: int | None) -> int:
    """Points at once: hydra.launcher.workers, else one per core (and per 2 GiB free) or per GPU."""
    if configured is not None:
        if int(configured) < 1:
            raise ConfigError("hydra.launcher.workers", f"must be >= 1 (or null: one per core), got {configured}")
        return int(configured)
    devices = [d for d in os.environ.get(GPU_DEVICES_ENV, "").split(",") if d]
    return max(len(devices), parallelism())


def sweep(points: list[Point], n: int, out: Path, results_dir: Path, cwd: str) -> list[dict]:
    """Every point (resolved as its job runs it) run or reused, `n` at once; their rows, in order."""
    if cwd not in sys.path:  # a user's workload module lives where they ran us
        sys.path.insert(0, cwd)
    done = done_rows(results_dir, points[0].sweep, exclude=out) if points else {}
    # Points that differ only in allocator settings or card may share a trace (the card's attention
    # kernels permitting: probe.worker): one after the other, in one thread, so the first traces and
    # the others replay its trace where they can (not all tracing at once).
    groups: dict[str, list[int]] = {}
    for i, point in enumerate(points):
        groups.setdefault(trace_store.trace_id(point, attending=""), []).append(i)

    def run_group(indexes: list[int]) -> list[dict]:
        return [run_point(points[i], out / "runs" / str(i), results_dir, done) for i in indexes]
    rows: list[dict] = [{}] * len(points)
    for indexes, group_rows in zip(groups.values(), map_threads(run_group, list(groups.values()), n)):
        for i, row in zip(indexes, group_rows):
            rows[i] = row
    return rows
