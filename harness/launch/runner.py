"""Run one point in a process of its own; whatever happens, leave a result.json row.

The process is forked from the zygote (torch already imported) or, failing that, a fresh
interpreter. It isolates each point (allocator settings are read once per process; a crash or the
host OOM killer takes only that process) and lets a timeout become a row instead of a lost sweep.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from harness.config.point import Backend, Point
from harness.launch import gpus, ranks, zygote
from harness.launch.exits import NO_ZYGOTE, TIMED_OUT, describe_exit, leave_job_warning
from harness.launch.threads import POLL_S
from harness.probe.rank import runs_as_ranks
from harness.record.results import find_done
from harness.record.row import POINT_FILE, RESULT_FILE, base_record, run_id, write_row

# Set when the sweep is interrupted: a point whose process was stopped leaves no row (it did not
# fail; the resume runs it).
STOPPING = threading.Event()


class Stopped(RuntimeError):
    """The point's process was stopped with the sweep."""


def run_point(point: Point, run_dir: Path, results_dir: Path | None = None,
              done_rows: dict[str, Path] | None = None) -> dict:
    """The row for `point`, written to run_dir/result.json (Stopped: the sweep is being stopped).
    With `results_dir`, a row already done in an earlier run of the sweep is reused (`done_rows`:
    those rows, looked up once for a whole sweep)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    rid = run_id(point)
    if results_dir is not None:
        done = done_rows.get(rid) if done_rows is not None else find_done(results_dir, point.sweep, rid, run_dir)
        if done is not None:
            rec = json.loads(done.read_text())
            rec["reused_from"] = str(done)
            return write_row(run_dir, rec)
    (run_dir / POINT_FILE).write_text(json.dumps(point.to_dict(), indent=1, default=str))
    if runs_as_ranks(point):
        return _run_ranks(point, run_dir)
    log = run_dir / "worker.log"
    if point.backend == Backend.cuda:
        device, lock = _take_gpu()
        with lock:
            t0 = time.perf_counter()
            rc = _run_subprocess(run_dir, log, point.timeout_s, gpus.worker_env(device, point.allocator.conf))
    else:
        t0 = time.perf_counter()
        rc = _run_forked(run_dir, point.timeout_s) if zygote.enabled() else NO_ZYGOTE
        if rc is NO_ZYGOTE:  # one thread, as a zygote's child has (launch.zygote: a point a core)
            rc = _run_subprocess(run_dir, log, point.timeout_s, {"OMP_NUM_THREADS": "1", **os.environ})
    if STOPPING.is_set():
        raise Stopped(str(run_dir))
    if rc is TIMED_OUT:
        rec = base_record(point)
        rec.update(status="timeout", wall_s=time.perf_counter() - t0,
                   error=f"point did not finish within timeout_s={point.timeout_s} s")
        return write_row(run_dir, rec)
    result = run_dir / RESULT_FILE
    if rc == 0 and result.exists():
        return json.loads(result.read_text())
    rec = base_record(point)
    rec.update(status="error", wall_s=time.perf_counter() - t0, error=describe_exit(rc, log))
    return write_row(run_dir, rec)


def _run_ranks(point: Point, run_dir: Path) -> dict:
    """A job over several GPUs run for real: its ranks here, or this Slurm task's rank of it; the
    point's row (on Slurm, rank 0 writes it: another rank returns its own row, and writes none)."""
    t0 = time.perf_counter()
    if ranks.in_slurm_job():
        rank, rec = ranks.run_task(point, run_dir)
        if rank != 0:
            return rec
    elif point.backend == Backend.cuda:
        devices, held = _take_gpus(point.parallel.world_size)
        with held:
            rec = ranks.run_here(point, run_dir, devices)
    else:
        rec = ranks.run_here(point, run_dir, None)
    if STOPPING.is_set():
        raise Stopped(str(run_dir))
    rec["wall_s"] = time.perf_counter() - t0
    return write_row(run_dir, rec)


# The launching CLI's devices (a local sweep or run), as CUDA_VISIBLE_DEVICES names them there; the
# points' threads take one each. Absent on a cluster, where the job's own allocation
# (CUDA_VISIBLE_DEVICES) is the list.
GPU_DEVICES_ENV = "HARNESS_GPU_DEVICES"


def _devices() -> list[str]:
    listed = os.environ.get(GPU_DEVICES_ENV)
    return [d for d in listed.split(",") if d] if listed else gpus.visible_devices()


def _take_gpu():
    """A card of our own for a cuda point (waits while every card runs another point)."""
    return gpus.take(_devices())


# One job over several cards takes them one by one: two such jobs taking at once could each hold
# some and wait for the other's; one at a time, the holder only waits on points that give theirs back.
_TAKING_MANY = threading.Lock()


def _take_gpus(n: int) -> tuple[list[str], contextlib.ExitStack]:
    """`n` cards of our own for the ranks of one job, and what gives them back."""
    held = contextlib.ExitStack()
    devices: list[str] = []
    with _TAKING_MANY:
        try:
            for _ in range(n):
                device, lock = gpus.take([d for d in _devices() if d not in devices])
                held.enter_context(lock)
                devices.append(device)
        except BaseException:  # the cards taken so far go back
            held.close()
            raise
    return devices, held


def _run_subprocess(run_dir: Path, log: Path, timeout_s: float, env: dict | None = None):
    """A fresh interpreter for the point (cuda points: with their card and allocator settings in
    `env`, which CUDA reads once at start): exit code, or TIMED_OUT."""
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "harness.probe.worker", str(run_dir)],
                                stdout=out, stderr=subprocess.STDOUT, env=env, preexec_fn=leave_job_warning)
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            return TIMED_OUT
        except BaseException:  # this process stopped (Ctrl-C; submitit at a Slurm time limit): so is the point
            proc.kill()
            proc.wait()
            raise


def _run_forked(run_dir: Path, timeout_s: float):
    """The point in a child forked from the zygote (torch already imported): its exit code,
    TIMED_OUT, or NO_ZYGOTE when none could be had (VANISHED: it died without saying, killed)."""
    forked = zygote.fork(run_dir)
    if forked is None:
        return NO_ZYGOTE
    deadline = time.monotonic() + timeout_s
    with forked:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                forked.kill()
                return TIMED_OUT
            rc = forked.wait(min(remaining, POLL_S))  # awake for signals every POLL_S (launch.threads)
            if rc is not None:
                return rc
