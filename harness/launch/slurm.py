"""A sweep on Slurm through submitit: one job array per card, every point a row whatever Slurm does.

hydra-submitit-launcher submits a sweep with one set of sbatch options (the sweep's card), and
`job.results()` raises for a job Slurm killed, which ends the sweep. This launcher:

- resolves each point's own `hydra.launcher` (its card's partition / constraint / gres, its time
  limit) and submits one array per distinct set of options;
- skips points whose row an earlier run of the sweep already has (ok / oom: the runner's reuse),
  writing the reused row at once, so a re-run resubmits only what is missing;
- waits for every job, and where a job ended without writing its row (scancel, over its time or
  memory limit, a node failure, sbatch refusing it, pending past `pending_timeout_s`) writes the row
  itself from Slurm's state. The status is the row's, never Slurm's COMPLETED.
"""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, filter_overrides
from hydra_plugins.hydra_submitit_launcher.config import SlurmQueueConf
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher
from omegaconf import OmegaConf, open_dict

from harness.config.compose import as_dict
from harness.config.point import Point
from harness.errors import Interrupted
from harness.launch.point import to_point
from harness.record.results import find_done
from harness.record.row import RESULT_FILE, base_record, run_id, write_row

log = logging.getLogger(__name__)

POLL_S = 2.0
# Our own keys, not sbatch options.
_OWN = ("pending_timeout_s",)


@dataclass
class HarnessSlurmConf(SlurmQueueConf):
    _target_: str = "hydra_plugins.harness_launcher.HarnessSlurmLauncher"
    # A job still pending after this many seconds is cancelled and its row says why (Slurm's
    # reason, e.g. Resources, ReqNodeNotAvail); null: wait as long as Slurm keeps it.
    pending_timeout_s: float | None = None


@dataclass
class _Point:
    idx: int
    overrides: list[str]
    run_dir: Path
    point: Point
    params: dict


def slurm_job_id(env: Mapping[str, str]) -> str | None:
    """The job's id as sacct prints it: ARRAY_TASK for an array task, else the job id."""
    if env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID"):
        return f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    return env.get("SLURM_JOB_ID")


def job_row(point: Point, job_id: str | None, status: str, error: str) -> dict:
    """A row the launcher writes for a point whose job could not write its own."""
    rec = base_record(point)
    rec.update(status=status, job_id=job_id, error=error)
    return rec


def _timed_out(state: str) -> bool:
    return state.upper().startswith(("TIMEOUT", "DEADLINE"))


def ended_row(point: Point, job_id: str | None, state: str, log_path: str | None, detail: str = "",
              in_last_minutes: bool = False) -> dict:
    """The row of a job that ended without writing one: `timeout` when its time limit ended it
    (Slurm's TIMEOUT; or submitit stopping it at Slurm's warning signal, which comes once the job is
    `in_last_minutes` of its limit and may interrupt anything, an import included), else `error`;
    Slurm's state and what submitit recorded are the reason."""
    timed_out = _timed_out(state) or "timed-out" in detail or in_last_minutes
    what = (f"Slurm job {job_id} reached its time limit (Slurm: {state})" if timed_out
            else f"Slurm job {job_id} ended {state}")
    return job_row(point, job_id, "timeout" if timed_out else "error",
                   f"{what} before its point wrote a row" + (f"; submitit: {detail}" if detail else "")
                   + (f"; log: {log_path}" if log_path else ""))


def failed_row(rec: dict, job_id: str, state: str, timed_out: bool) -> dict:
    """A failed row the point wrote itself, with Slurm's word on its job: `timeout` when the job's
    time limit ended it (Slurm's SIGTERM at the limit, or its warning signal, reached the point's
    process before submitit stopped the job: the row saw a killed worker, the limit is why). The row
    itself where Slurm has nothing to add."""
    if timed_out:
        return {**rec, "status": "timeout", "error": f"{rec.get('error')} (Slurm job {job_id} reached its time limit: {state})"}
    if not state.startswith("COMPLETED"):
        return {**rec, "error": f"{rec.get('error')} (Slurm job {job_id}: {state})"}
    return rec


def _outcome(job) -> str:
    """What submitit recorded for a finished job (its result pickle), in one line; '' if nothing."""
    if job.num_tasks > 1:  # a job of several ranks: task 0 is rank 0, which writes the point's row
        job = job.task(0)
    try:
        res = job.result()
    except Exception as e:  # no result at all (killed): submitit says so with Slurm's state
        exc = e
    else:  # Hydra's job caught what ended it (e.g. submitit's timeout at Slurm's warning signal)
        failed = isinstance(res, JobReturn) and res.status == JobStatus.FAILED
        exc = res._return_value if failed else None
    if exc is None:
        return ""
    lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
    return lines[-1].strip() if lines else type(exc).__name__


class SlurmArrays(SlurmLauncher):
    """The launcher's work; Hydra loads it as hydra_plugins.harness_launcher.HarnessSlurmLauncher."""

    def launch(self, job_overrides, initial_job_idx: int):
        assert self.config is not None and self.hydra_context is not None
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        results_dir = Path(str(self.config.results_dir))
        points: list[_Point] = []
        for i, overrides in enumerate(job_overrides):
            idx = initial_job_idx + i
            cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
            with open_dict(cfg.hydra.job):
                cfg.hydra.job.num = idx
            run_dir = sweep_dir / str(cfg.hydra.sweep.subdir)
            params = as_dict(cfg.hydra.launcher)
            point = to_point(cfg, list(overrides), str(cfg.hydra.runtime.cwd or Path.cwd()), cluster=True)
            points.append(_Point(idx, list(overrides), run_dir, point, params))

        todo, rows = [], {}
        for p in points:
            done = find_done(results_dir, p.point.sweep or "", run_id(p.point), p.run_dir)
            if done is not None:  # an earlier run has it: no job
                rec = json.loads(done.read_text())
                rec["reused_from"] = str(done)
                rows[p.idx] = write_row(p.run_dir, rec)
            else:
                todo.append(p)
        log.info(f"Slurm: {len(todo)} of {len(points)} point(s) to submit ({len(points) - len(todo)} done before)")

        jobs: list = []  # (point, submitit job)
        try:
            self._submit(todo, rows, jobs)
            self._wait(jobs, rows)
        except BaseException as e:
            # Ctrl-C (cli.interrupt's, SIGINT) is the user stopping the sweep: its jobs too (the resume
            # submits them again). Killed otherwise (SIGTERM: a launcher job's time limit, a kill), the
            # launcher loses nothing: the jobs run on and write their rows (README).
            if isinstance(e, Interrupted) and e.signum == signal.SIGINT:
                _cancel([job for p, job in jobs if p.idx not in rows])
            raise
        return [JobReturn(overrides=p.overrides, status=JobStatus.COMPLETED, _return_value=rows[p.idx]["status"],
                          working_dir=str(p.run_dir), task_name="harness") for p in points]

    def _submit(self, todo: list[_Point], rows: dict, jobs: list) -> None:
        """One array per card; `jobs` gets each (point, job) as its array is submitted."""
        import submitit

        for params, group in _groups(todo):
            executor = submitit.AutoExecutor(cluster="slurm", folder=params["submitit_folder"],
                                             slurm_max_num_timeout=params.get("max_num_timeout", 0))
            executor.update_parameters(**_executor_params(params))
            for p in group:
                log.info(f"\t#{p.idx} : {' '.join(filter_overrides(p.overrides))}")
            try:
                submitted = executor.map_array(self, *zip(*[
                    (p.overrides, "hydra.sweep.dir", p.idx, f"job_id_for_{p.idx}", Singleton.get_state())
                    for p in group]))
            except Exception as e:  # sbatch refused the array (no such partition or feature, ...)
                reason = str(e).strip().splitlines()
                for p in group:
                    rows[p.idx] = write_row(p.run_dir, job_row(
                        p.point, None, "error", f"sbatch refused the job: {reason[-1] if reason else type(e).__name__}"))
                continue
            jobs += list(zip(group, submitted))

    def _wait(self, jobs: list, rows: dict) -> None:
        """Until every job has a row: the job's own, or one written here from Slurm's state."""
        started = time.monotonic()
        waiting = list(jobs)
        while waiting:
            still = []
            for p, job in waiting:
                if job.done():
                    rows[p.idx] = _row_of(p, job)
                    continue
                limit = p.params.get("pending_timeout_s")
                if limit is not None and time.monotonic() - started > limit and _state(job) == "PENDING":
                    reason = _pending_reason(job.job_id)
                    job.cancel(check=False)
                    rows[p.idx] = write_row(p.run_dir, job_row(
                        p.point, job.job_id, "error", f"Slurm job {job.job_id} never started within "
                        f"pending_timeout_s={limit} (Slurm's reason: {reason}); cancelled"))
                    continue
                still.append((p, job))
            waiting = still
            if waiting:
                time.sleep(POLL_S)


def _cancel(jobs: list) -> None:
    """scancel for `jobs` at once (a sweep being stopped: no time for one call a job)."""
    if jobs:
        try:
            subprocess.run(["scancel", *[str(j.job_id) for j in jobs]], capture_output=True, timeout=30)
        except (OSError, subprocess.SubprocessError):  # the stop goes on; squeue shows what is left
            pass


def _row_of(p: _Point, job) -> dict:
    """The point's own row decides its status; a failed one gets Slurm's word on the job added.
    No row: one from Slurm's state and submitit's record."""
    row_file = p.run_dir / RESULT_FILE
    signal_delay_s = p.params.get("signal_delay_s")
    if row_file.exists():
        rec = json.loads(row_file.read_text())
        if rec.get("status") in ("error", "timeout"):
            state = _final_state(job)
            worded = failed_row(rec, job.job_id, state, _timed_out(state) or _in_warning_window(job.job_id, signal_delay_s))
            if worded is not rec:  # Slurm had something to add
                write_row(p.run_dir, worded)
            return worded
        return rec
    return write_row(p.run_dir, ended_row(p.point, job.job_id, _final_state(job), str(job.paths.stderr),
                                       _outcome(job), _in_warning_window(job.job_id, signal_delay_s)))


def _in_warning_window(job_id: str, signal_delay_s, wait_s: float = 30.0) -> bool:
    """Whether the job ran into the last `signal_delay_s` of its time limit, where Slurm sends the
    warning signal on which submitit stops it (sacct: ElapsedRaw s, TimelimitRaw min). sacct may
    not know a job that just ended (slurmdbd lags under load): asked again for up to `wait_s`."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            out = subprocess.run(["sacct", "-n", "-P", "-X", "-j", job_id, "-o", "ElapsedRaw,TimelimitRaw"],
                                 capture_output=True, text=True, timeout=30, check=True).stdout.split()
            elapsed_s, limit_min = (int(x) for x in out[0].split("|"))
        except (ValueError, OSError):  # no time limit; no sacct here
            return False
        except (subprocess.SubprocessError, IndexError):  # not recorded yet, or slurmdbd not answering
            if time.monotonic() > deadline:
                return False
            time.sleep(1)
            continue
        return elapsed_s >= 60 * limit_min - int(signal_delay_s or 0)


def _final_state(job, wait_s: float = 30.0) -> str:
    """Slurm's state once it has left RUNNING/COMPLETING (a job can be done, by its result file,
    a moment before sacct says so)."""
    deadline = time.monotonic() + wait_s
    while True:
        state = _state(job)
        if state.upper() not in ("RUNNING", "COMPLETING", "PENDING", "UNKNOWN") or time.monotonic() > deadline:
            return state
        time.sleep(1)


def _state(job) -> str:
    try:
        return job.watcher.get_state(job.job_id, mode="force")
    except Exception as e:  # sacct unreachable: say so rather than guess
        return f"UNKNOWN (sacct: {e})"


def _pending_reason(job_id: str) -> str:
    try:
        out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%r"], capture_output=True, text=True,
                             timeout=30)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _groups(points: list[_Point]) -> list[tuple[dict, list[_Point]]]:
    """Points with the same sbatch options: one array each."""
    groups: dict[str, tuple[dict, list[_Point]]] = {}
    for p in points:
        key = json.dumps(p.params, sort_keys=True, default=str)
        groups.setdefault(key, (p.params, []))[1].append(p)
    return list(groups.values())


def _executor_params(params: dict) -> dict[str, Any]:
    """hydra.launcher keys -> submitit's update_parameters (slurm_ prefix where submitit wants it)."""
    from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf

    base = set(OmegaConf.structured(BaseQueueConf).keys())
    skip = {"submitit_folder", "max_num_timeout", "_target_", *_OWN}
    return {(k if k in base else f"slurm_{k}"): v for k, v in params.items() if k not in skip}
