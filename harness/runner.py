"""Run one point in a fresh child process; whatever happens, leave a result.json row.

The child isolates each point (allocator settings are read once per process; a crash or the host
OOM killer takes only the child) and lets a timeout become a row instead of a lost sweep.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

from harness.record import base_record, run_id

RESULT_FILE = "result.json"
_REUSABLE = ("ok", "oom")


def find_done(results_dir: Path, sweep: str, rid: str, exclude: Path) -> Path | None:
    """A finished row with the same run_id from an earlier run of this sweep, if any."""
    for path in sorted((results_dir / sweep).glob(f"*/runs/*/{RESULT_FILE}"), reverse=True):
        if path.parent == exclude:
            continue
        try:
            rec = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if rec.get("run_id") == rid and rec.get("status") in _REUSABLE:
            return path
    return None


def run_point(point: dict, run_dir: Path, results_dir: Path | None = None) -> dict:
    """The row for `point`, written to run_dir/result.json."""
    run_dir.mkdir(parents=True, exist_ok=True)
    rid = run_id(point)
    if results_dir is not None:
        done = find_done(results_dir, point.get("sweep") or "", rid, run_dir)
        if done is not None:
            rec = json.loads(done.read_text())
            rec["reused_from"] = str(done)
            return _write(run_dir, rec)
    (run_dir / "point.json").write_text(json.dumps(point, indent=1, default=str))
    log = run_dir / "worker.log"
    t0 = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "harness.probe.worker", str(run_dir)],
                                stdout=out, stderr=subprocess.STDOUT)
        try:
            rc = proc.wait(timeout=point["timeout_s"])
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            rec = base_record(point)
            rec.update(status="timeout", wall_s=time.perf_counter() - t0,
                       error=f"point did not finish within timeout_s={point['timeout_s']} s")
            return _write(run_dir, rec)
    result = run_dir / RESULT_FILE
    if rc == 0 and result.exists():
        return json.loads(result.read_text())
    rec = base_record(point)
    rec.update(status="error", wall_s=time.perf_counter() - t0, error=_describe_exit(rc, log))
    return _write(run_dir, rec)


def _describe_exit(rc: int, log: Path) -> str:
    if rc < 0:
        name = signal.Signals(-rc).name
        hint = " (the host's OOM killer sends SIGKILL)" if -rc == signal.SIGKILL else ""
        return f"worker killed by {name}{hint}; see {log}"
    tail = log.read_text(errors="replace").strip().splitlines()[-1:] if log.exists() else []
    return f"worker exited with code {rc}: {tail[0] if tail else 'no output'}; see {log}"


def _write(run_dir: Path, rec: dict) -> dict:
    (run_dir / RESULT_FILE).write_text(json.dumps(rec, indent=1, default=str))
    return rec
