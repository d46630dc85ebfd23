"""A point over several GPUs run for real (backend=cuda; backend=cpu: CPU processes and gloo) as one
job of N ranks, a process each with torchrun's environment. Every rank leaves a row in
run_dir/rank<r>/, and the point's row is made of them (record.ranks: the worst rank decides).

On this machine the N processes start here, a cuda rank on a card of its own (the one device it
sees, as submitit gives each task). On Slurm each of the job's tasks (hydra.launcher nodes and
tasks_per_node, from parallel.*) is one rank, its rank and peers from submitit; rank 0 then waits
for the others' rows and writes the point's.

A rank that fails (an OOM, an error, a crash) leaves its peers waiting in a collective that never
completes: each rank's supervisor watches its peers' rows and, GRACE_S after one says a rank failed,
stops its own rank and writes why.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from harness.config.compose import cores
from harness.config.point import Backend, Point
from harness.errors import ConfigError
from harness.launch import gpus, zygote
from harness.launch.exits import describe_exit, leave_job_warning
from harness.record.ranks import DIED, RANK_RESULT_FILE, STOPPED, merge, rank_dir
from harness.record.row import POINT_FILE, base_record, write_row

Worker = subprocess.Popen | zygote.Forked  # a rank's process, as it is waited on
GRACE_S = 10.0  # after a rank failed: its peers' time to end on their own before they are stopped
POLL_S = 0.5


def torch_env(rank: int, world_size: int, local_rank: int, local_world_size: int, master_addr: str,
              master_port: int) -> dict[str, str]:
    """What torchrun sets in each rank's process (init_process_group's env:// reads it)."""
    return {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(local_rank),
            "LOCAL_WORLD_SIZE": str(local_world_size), "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port)}


def process_env(point: Point, device: str | None, base: dict, local_world_size: int) -> dict:
    """A rank's process environment: its one card and the allocator settings (cuda); for CPU ranks,
    this host's cores shared among its ranks (as torchrun sets OMP_NUM_THREADS)."""
    if point.backend == Backend.cuda:
        assert device is not None
        return gpus.worker_env(device, point.allocator.conf, base)
    return {**base, "OMP_NUM_THREADS": str(max(1, cores() // local_world_size))}


def check_here(points: list[Point], devices: list[str]) -> None:
    """Points over several GPUs that this machine can run as their ranks: (cuda) one node, and a
    card for each rank. CPU ranks run here whatever the job's nodes (a rank holds what it holds on
    any count of them: a job on cards of one GPU a node is checked so too)."""
    for p in points:
        if p.backend != Backend.cuda or p.parallel.world_size == 1:
            continue
        if p.parallel.nodes != 1:  # (a point's nodes are a count: Point resolves auto)
            raise ConfigError("parallel.nodes", f"{p.parallel.nodes} nodes: this machine is one; run the job "
                              "on a cluster (hydra/launcher=harness_slurm), on the virtual GPU (backend=sim) "
                              "or as CPU ranks here (backend=cpu)")
        if p.parallel.world_size > len(devices):
            raise ConfigError(p.parallel.key, f"the job's {p.parallel.world_size} ranks need as many GPUs, and this "
                              f"machine shows {len(devices)} ({', '.join(devices) or 'none'})")


def run_here(point: Point, run_dir: Path, devices: list[str] | None) -> dict:
    """The point's ranks as processes on this machine (`devices`: a card for each cuda rank); the
    point's row, made of theirs."""
    world = point.parallel.world_size
    port = _free_port()
    deadline = time.monotonic() + point.timeout_s
    procs: dict[int, Worker] = {}
    try:
        for r in range(world):
            env = process_env(point, devices[r] if devices else None, dict(os.environ), world)
            procs[r] = start(point, run_dir, r, {**env, **torch_env(r, world, r, world, "127.0.0.1", port)},
                             forked=point.backend != Backend.cuda)
    except BaseException:
        _kill(procs)
        raise
    supervise(procs, point, run_dir, deadline)
    return merged(point, run_dir, "left no row")


def in_slurm_job() -> bool:
    """Whether this process is one task of a Slurm job of several (each a rank: run_task)."""
    return os.environ.get("SUBMITIT_EXECUTOR") == "slurm" and int(os.environ.get("SLURM_NTASKS", "1")) > 1


def run_task(point: Point, run_dir: Path) -> tuple[int, dict]:
    """This Slurm task's rank of the point, and a row: rank 0 waits for every rank's row and returns
    the point's, another rank its own."""
    from submitit.helpers import TorchDistributedEnvironment

    job = TorchDistributedEnvironment()
    world = point.parallel.world_size
    if job.world_size != world:  # hydra.launcher's nodes or tasks_per_node set by hand
        rec = base_record(point)
        rec.update(status="error", error=f"the Slurm job has {job.world_size} tasks and the point's job {world} ranks "
                   "(hydra.launcher.nodes x tasks_per_node: leave them to parallel.*)")
        return job.rank, rec
    device = None
    if point.backend == Backend.cuda:  # the node's GPUs, one per task in local-rank order
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        listed = [d for d in (visible or "").split(",") if d] or [str(i) for i in range(job.local_world_size)]
        device = listed[job.local_rank % len(listed)]
    env = process_env(point, device, dict(os.environ), job.local_world_size)
    env.update(torch_env(job.rank, world, job.local_rank, job.local_world_size, job.master_addr, job.master_port))
    deadline = time.monotonic() + point.timeout_s
    supervise({job.rank: start(point, run_dir, job.rank, env)}, point, run_dir, deadline)
    if job.rank != 0:
        return job.rank, read_row(run_dir, job.rank) or base_record(point)
    # The peers' supervisors write their rows by the deadline, a stopped one GRACE_S after a failure
    while any(read_row(run_dir, r) is None for r in range(world)) and time.monotonic() < deadline + 3 * GRACE_S:
        time.sleep(POLL_S)
    return 0, merged(point, run_dir, "its Slurm task left no row (a node failure, or Slurm stopped it; see the "
                     "job's logs)")


def start(point: Point, run_dir: Path, rank: int, env: dict, forked: bool = False) -> Worker:
    """Rank `rank`'s worker, in run_dir/rank<r>/ (its point.json, worker.log and row); `forked`: from
    the zygote where one can be had (a CPU rank: torch and transformers imported, 4-5 s a rank less),
    else a fresh interpreter (a cuda rank's: CUDA reads its card and allocator settings at start)."""
    where = rank_dir(run_dir, rank)
    where.mkdir(parents=True, exist_ok=True)
    (where / POINT_FILE).write_text(json.dumps(point.to_dict(), indent=1, default=str))
    if forked and zygote.enabled():
        child = zygote.fork(where, {**env, zygote.RANK_REQUEST: "1"})
        if child is not None:
            return child
    with open(where / "worker.log", "w") as log:
        return subprocess.Popen([sys.executable, "-m", "harness.probe.worker", str(where)], stdout=log,
                                stderr=subprocess.STDOUT, env=env, preexec_fn=leave_job_warning)


def supervise(procs: dict[int, Worker], point: Point, run_dir: Path, deadline: float) -> None:
    """Until each of this machine's ranks (`procs`) has ended: stopped GRACE_S after any rank of the
    job failed, all at `deadline` (time.monotonic()). Each leaves a row, its own or one written here."""
    world = point.parallel.world_size
    running = dict(procs)
    failed_at: float | None = None
    seen: dict[int, dict] = {}  # the rows written so far (each once, whole): read again never
    try:
        while running:
            for r, p in list(running.items()):
                rc = p.poll()
                if rc is not None:
                    del running[r]
                    if read_row(run_dir, r) is None:  # it died before writing one (a crash, a kill)
                        _rank_row(point, run_dir, r, "error", describe_exit(rc, rank_dir(run_dir, r) / "worker.log"),
                                  died=True)
            failed = first_failed(run_dir, world, seen)
            now = time.monotonic()
            if failed is not None and failed_at is None:
                failed_at = now
            if running and failed_at is not None and now - failed_at > GRACE_S:
                _stop(running, point, run_dir, "error", f"stopped once rank {failed} had failed (its peers wait "
                      "in a collective that never completes)", failed)
            elif running and now > deadline:
                _stop(running, point, run_dir, "timeout", f"did not finish within timeout_s={point.timeout_s} s")
            elif running:
                time.sleep(POLL_S)
    except BaseException:  # this process stopped (Ctrl-C; submitit at a Slurm time limit): so are its ranks
        _kill(running)
        raise


def first_failed(run_dir: Path, world_size: int, seen: dict[int, dict]) -> int | None:
    """The lowest rank whose row says it failed (and was not stopped for another's failure); `seen`:
    the rows read before, added to (only the ranks without one are looked for on disk)."""
    for r in range(world_size):
        row = seen.get(r) or read_row(run_dir, r)
        if row is None:
            continue
        seen[r] = row
        if row.get("status") != "ok" and row.get(STOPPED) is None:
            return r
    return None


def read_row(run_dir: Path, rank: int) -> dict | None:
    path = rank_dir(run_dir, rank) / RANK_RESULT_FILE
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):  # not yet written (or being written)
        return None


def merged(point: Point, run_dir: Path, missing: str) -> dict:
    """The point's row from its ranks' rows (`missing`: why a rank that left none left none)."""
    world = point.parallel.world_size
    rows = {r: read_row(run_dir, r) for r in range(world)}
    return merge(base_record(point), rows, {r: missing for r in range(world) if rows[r] is None})


def _rank_row(point: Point, run_dir: Path, rank: int, status: str, error: str, stopped_for: int | None = None,
              died: bool = False):
    rec = base_record(point)
    rec.update(status=status, error=error, rank=rank, **({STOPPED: stopped_for} if stopped_for is not None else {}),
               **({DIED: True} if died else {}))
    write_row(rank_dir(run_dir, rank), rec, RANK_RESULT_FILE)


def _stop(running: dict[int, Worker], point: Point, run_dir: Path, status: str, error: str,
          stopped_for: int | None = None) -> None:
    _kill(running)
    for r in running:
        if read_row(run_dir, r) is None:
            _rank_row(point, run_dir, r, status, error, stopped_for)
    running.clear()


def _kill(procs: dict[int, Worker]) -> None:
    for p in procs.values():
        if p.poll() is None:
            p.kill()
    for p in procs.values():
        p.wait()


def _free_port() -> int:
    """A TCP port free on this host now, for rank 0's store (MASTER_PORT)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
