"""Run one point in a process of its own; whatever happens, leave a result.json row.

The process is forked from the zygote (torch already imported) or, failing that, a fresh
interpreter. It isolates each point (allocator settings are read once per process; a crash or the
host OOM killer takes only that process) and lets a timeout become a row instead of a lost sweep.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from harness.config.point import Backend, Point
from harness.launch import gpus, zygote
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
    log = run_dir / "worker.log"
    if point.backend == Backend.cuda:
        device, lock = _take_gpu()
        with lock:
            t0 = time.perf_counter()
            rc = _run_subprocess(run_dir, log, point.timeout_s, gpus.worker_env(device, point.allocator.conf))
    else:
        t0 = time.perf_counter()
        rc = _run_forked(run_dir, point.timeout_s) if _zygote_enabled() else _NO_ZYGOTE
        if rc is _NO_ZYGOTE:
            rc = _run_subprocess(run_dir, log, point.timeout_s)
    if STOPPING.is_set():
        raise Stopped(str(run_dir))
    if rc is _TIMED_OUT:
        rec = base_record(point)
        rec.update(status="timeout", wall_s=time.perf_counter() - t0,
                   error=f"point did not finish within timeout_s={point.timeout_s} s")
        return write_row(run_dir, rec)
    result = run_dir / RESULT_FILE
    if rc == 0 and result.exists():
        return json.loads(result.read_text())
    rec = base_record(point)
    rec.update(status="error", wall_s=time.perf_counter() - t0, error=_describe_exit(rc, log))
    return write_row(run_dir, rec)


_TIMED_OUT, _NO_ZYGOTE, _VANISHED = object(), object(), object()


def _zygote_enabled() -> bool:
    return os.environ.get("HARNESS_ZYGOTE", "1") != "0"


# The launching CLI's devices (a local sweep or run), as CUDA_VISIBLE_DEVICES names them there; the
# points' threads take one each. Absent on a cluster, where the job's own allocation
# (CUDA_VISIBLE_DEVICES) is the list.
GPU_DEVICES_ENV = "HARNESS_GPU_DEVICES"


def _take_gpu():
    """A card of our own for a cuda point (waits while every card runs another point)."""
    listed = os.environ.get(GPU_DEVICES_ENV)
    devices = [d for d in listed.split(",") if d] if listed else gpus.visible_devices()
    return gpus.take(devices)


def _run_subprocess(run_dir: Path, log: Path, timeout_s: float, env: dict | None = None):
    """A fresh interpreter for the point (cuda points: with their card and allocator settings in
    `env`, which CUDA reads once at start): exit code, or _TIMED_OUT."""
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "harness.probe.worker", str(run_dir)],
                                stdout=out, stderr=subprocess.STDOUT, env=env, preexec_fn=_leave_job_warning)
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            return _TIMED_OUT
        except BaseException:  # this process stopped (Ctrl-C; submitit at a Slurm time limit): so is the point
            proc.kill()
            proc.wait()
            raise


def _leave_job_warning() -> None:
    """In the point's process, before exec: Slurm sends its time-limit warning (SIGUSR2, submitit's
    signal) to every process of a job. It is for submitit in the job's own process, which stops the
    job and records the timeout; the point must not die of it first (its row would say `error`)."""
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)


def _run_forked(run_dir: Path, timeout_s: float):
    """The point in a child forked from the zygote (torch already imported): its exit code,
    _TIMED_OUT, or _NO_ZYGOTE when none could be had."""
    conn = zygote.connect()
    if conn is None:
        return _NO_ZYGOTE
    deadline = time.monotonic() + timeout_s
    with conn:
        conn.sendall(f"{run_dir}\n".encode())
        reader = conn.makefile("rb")
        pid = None
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([conn], [], [], remaining)[0]:
                if pid is not None:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                return _TIMED_OUT
            line = reader.readline().decode().split()
            if not line:  # the child died without answering: killed (the host's OOM killer?)
                return _VANISHED
            if line[0] == "pid":
                pid = int(line[1])
            elif line[0] == "rc":
                return int(line[1])


def _describe_exit(rc, log: Path) -> str:
    if rc is _VANISHED:  # a forked child's status goes to the zygote, not to us
        return (f"worker died without a result, killed by a signal (the host's OOM killer sends "
                f"SIGKILL); see {log}")
    if rc < 0:
        name = signal.Signals(-rc).name
        hint = " (the host's OOM killer sends SIGKILL)" if -rc == signal.SIGKILL else ""
        return f"worker killed by {name}{hint}; see {log}"
    tail = log.read_text(errors="replace").strip().splitlines()[-1:] if log.exists() else []
    return f"worker exited with code {rc}: {tail[0] if tail else 'no output'}; see {log}"
