"""Sweeps on a real Slurm (scripts/slurm-local.sh: munge, MariaDB + slurmdbd, slurmctld, slurmd on
this machine; node features stand for the cards): submitted through submitit, one array per card,
rows with job ids, and every way a job can end without its point's help becoming a row."""

import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
import pytest

from tests.conftest import REPO, run_cli

# One worker runs them, one after another, from the suite's start: they wait on Slurm far more than
# they compute, so the other workers have the cores meanwhile (the suite on 2 cores is CPU-bound).
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("slurm")]

SLURM = ["hydra/launcher=harness_slurm", "hydra.launcher.cpus_per_task=1", "backend=sim"]
SLEEPY = ["sweeps=smoke", "batch_size=1", "seq_len=32", "workload=custom", "workload.target=tests.jobs.sleepy:build"]


def _up() -> bool:
    try:
        return subprocess.run(["sinfo", "-h"], capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


@pytest.fixture(scope="module")
def slurm():
    """The local cluster: already up, or started here (root, packages installed); else a skip
    saying how to get one (CI sets HARNESS_REQUIRE_SLURM=1: there it must run). One worker starts
    it: the others wait on the lock, then find it up."""
    with open(Path(tempfile.gettempdir()) / "harness-slurm-start.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not _up() and os.geteuid() == 0 and shutil.which("slurmctld") and shutil.which("slurmdbd"):
            subprocess.run([str(REPO / "scripts" / "slurm-local.sh"), "start"], check=True, timeout=300)
    if not _up():
        reason = "no Slurm here: run scripts/slurm-local.sh install && scripts/slurm-local.sh start (root)"
        if os.environ.get("HARNESS_REQUIRE_SLURM") == "1":
            pytest.fail(reason)
        pytest.skip(reason)


@pytest.fixture(autouse=True)
def one_after_another(request):
    """Under xdist's --dist loadgroup these tests are one group, run on one worker one after another
    (pytest 9.2 silently undid that: pytest-xdist#1386; pyproject pins pytest below it)."""
    config = request.config
    if os.environ.get("PYTEST_XDIST_WORKER") and config.getvalue("loadgroup"):
        assert request.node.nodeid.endswith("@slurm"), "xdist ran a Slurm test outside its group"


def _rows(sweep_dir: Path) -> pd.DataFrame:
    return pd.read_parquet(sweep_dir / "results.parquet")


def _sweep_dir(results: Path, name: str) -> Path:
    dirs = sorted((results / name).iterdir())
    return dirs[-1]


def _sacct(array_id: str, field: str) -> set[str]:
    out = subprocess.run(["sacct", "-n", "-P", "-X", "-j", array_id, "-o", field], capture_output=True,
                         text=True, check=True).stdout
    return {ln.strip() for ln in out.splitlines() if ln.strip()}


def test_a_sweep_runs_as_one_array_per_card_and_a_rerun_submits_only_what_is_missing(slurm, tmp_path):
    args = ["sweep", "sweeps=smoke", "seq_len=32", "batch_size=1,2", "gpu=t4,l4", *SLURM, f"results_dir={tmp_path}"]
    r = run_cli(*args)
    assert r.returncode == 0, r.stderr[-3000:]
    first = _sweep_dir(tmp_path, "smoke")
    df = _rows(first)
    assert list(df["status"]) == ["ok"] * 4 and df["job_id"].notna().all()
    arrays = {j.split("_")[0] for j in df["job_id"]}
    assert len(arrays) == 2  # one array per card
    for gpu, jobs in df.groupby("gpu")["job_id"]:
        array = jobs.iloc[0].split("_")[0]
        assert _sacct(array, "Constraints") == {gpu.lower()}  # the card's node feature was asked for
        assert all(j.startswith(array + "_") for j in jobs)
    assert (first / "report.html").exists()

    # One row lost: the re-run submits that point alone and reuses the other three.
    lost = next(p for p in sorted((first / "runs").glob("*/result.json")))
    lost.unlink()
    r = run_cli(*args)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Slurm: 1 of 4 point(s) to submit (3 done before)" in r.stdout + r.stderr
    again = _rows(_sweep_dir(tmp_path, "smoke"))
    assert list(again["status"]) == ["ok"] * 4
    assert again["reused_from"].notna().sum() == 3


def _start(args: list[str]) -> subprocess.Popen:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.Popen([sys.executable, "-m", "harness", *args], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _wait_for(what, predicate, timeout_s: float = 120):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(1)
    raise AssertionError(f"timed out waiting for {what}")


def _running_task(feature: str, task: int) -> str | None:
    out = subprocess.run(["squeue", "-h", "-t", "RUNNING", "-o", "%i %f"], capture_output=True, text=True).stdout
    for line in out.splitlines():
        job, features = line.split()
        if features == feature and job.endswith(f"_{task}"):
            return job
    return None


def _running_job_of(results: Path) -> str | None:
    """The running Slurm job of the one sweep under `results` (submitit's folder is named by its id)."""
    ids = [d.name for d in results.rglob(".submitit/*") if d.name.isdigit()]
    out = subprocess.run(["squeue", "-h", "-t", "RUNNING", "-o", "%i", "-j", ",".join(ids)], capture_output=True,
                         text=True).stdout.split() if ids else []
    return out[0] if out else None


def test_killed_and_timed_out_jobs_are_rows_and_the_others_are_intact(slurm, tmp_path):
    # Over its time limit: timeout_min=1 (submitit stops it at Slurm's warning signal, or Slurm does).
    late = _start(["sweep", *SLEEPY, "+workload.args.sleep_s=600", "gpu=a10g", *SLURM,
                   "hydra.launcher.timeout_min=1", f"results_dir={tmp_path / 'late'}"])
    # Cancelled: the second point of an array, while the first finishes normally.
    cancelled = _start(["sweep", *SLEEPY, "+workload.args.sleep_s=0,600", "gpu=rtx4090", *SLURM,
                        "hydra.launcher.timeout_min=10", f"results_dir={tmp_path / 'cancelled'}"])
    try:
        job = _wait_for("the sleeping point to run", lambda: _running_task("rtx4090", 1))
        subprocess.run(["scancel", job], check=True)
        out_c = cancelled.communicate(timeout=300)[0]
        out_l = late.communicate(timeout=300)[0]
    finally:
        for p in (late, cancelled):
            p.kill()
    assert cancelled.returncode == 1, out_c[-3000:]  # an error row: exit 1, the sweep finished
    df = _rows(_sweep_dir(tmp_path / "cancelled", "smoke"))
    by_sleep = {json.loads(a)["sleep_s"]: row for a, row in zip(df["workload_args"], df.to_dict("records"))}
    assert by_sleep[0]["status"] == "ok" and by_sleep[0]["job_id"].endswith("_0")
    killed = by_sleep[600]
    assert killed["status"] == "error" and "CANCELLED" in killed["error"] and killed["job_id"] == job, killed

    assert late.returncode == 1, out_l[-3000:]
    row = _rows(_sweep_dir(tmp_path / "late", "smoke")).iloc[0]
    assert row["status"] == "timeout" and "time limit" in row["error"] and row["job_id"], row.to_dict()

    r = run_cli("report", str(_sweep_dir(tmp_path / "cancelled", "smoke")))
    assert r.returncode == 1 and (_sweep_dir(tmp_path / "cancelled", "smoke") / "report.html").exists()


@pytest.mark.parametrize("signum,code", [("SIGINT", 130), ("SIGTERM", 143)])
def test_ctrl_c_on_a_slurm_sweep_cancels_its_jobs_and_sigterm_leaves_them_running(slurm, tmp_path, signum, code):
    """Ctrl-C stops every process the sweep started (README): on Slurm, its jobs are cancelled, not
    left to run (and write rows) after the sweep said it stopped. SIGTERM leaves them running: a
    launcher that is itself a Slurm job gets it at its time limit, and loses nothing."""
    import signal

    proc = _start(["sweep", *SLEEPY, "+workload.args.sleep_s=600", "gpu=l40s", *SLURM, f"results_dir={tmp_path}"])
    job = None
    try:
        job = _wait_for("the sleeping point to run", lambda: _running_job_of(tmp_path))
        proc.send_signal(getattr(signal, signum))
        out = proc.communicate(timeout=120)[0]
        assert proc.returncode == code, out[-3000:]
        assert out.strip().splitlines()[-1].startswith(f"harness: interrupted by {signum}: 0 of 1 point(s)")
        if signum == "SIGINT":
            _wait_for("Slurm to record the cancel", lambda: _sacct(job, "State") == {"CANCELLED by 0"}, 60)
            assert not list(tmp_path.rglob("result.json"))
        else:
            time.sleep(3)
            assert _running_job_of(tmp_path) == job
    finally:
        proc.kill()
        if job:
            subprocess.run(["scancel", job], capture_output=True)


def test_jobs_that_never_start_are_rows_with_slurms_reason(slurm, tmp_path):
    r = run_cli("sweep", "sweeps=smoke", "seq_len=32", "batch_size=1", "gpu=t4", "gpu.slurm.constraint=nosuchgpu",
                *SLURM, f"results_dir={tmp_path / 'refused'}")
    assert r.returncode == 1, r.stderr[-2000:]
    row = _rows(_sweep_dir(tmp_path / "refused", "smoke")).iloc[0]
    assert row["status"] == "error" and row["error"].startswith("sbatch refused the job:")
    assert "feature" in row["error"].lower()

    r = run_cli("sweep", "sweeps=smoke", "seq_len=32", "batch_size=1", "gpu=t4", *SLURM,
                "+hydra.launcher.additional_parameters.hold=true", "hydra.launcher.pending_timeout_s=3",
                f"results_dir={tmp_path / 'held'}")
    assert r.returncode == 1, r.stderr[-2000:]
    row = _rows(_sweep_dir(tmp_path / "held", "smoke")).iloc[0]
    assert row["status"] == "error" and "never started within pending_timeout_s=3" in row["error"]
    assert "JobHeldUser" in row["error"]


def test_a_job_ended_in_its_time_limits_warning_window_is_a_timeout_whatever_it_was_doing():
    # Slurm's warning signal can land mid-import; what submitit then records is not its timeout text.
    from harness.config.compose import compose
    from harness.launch.point import to_point
    from harness.launch.slurm import ended_row

    point = to_point(compose(["model=tiny", "backend=sim"]), [])
    garbled = "The underlying op of 'aten._chunk_cat' has no overload name 'out'"
    row = ended_row(point, "66", "COMPLETED", "66_0_log.err", garbled, in_last_minutes=True)
    assert row["status"] == "timeout" and row["error"].startswith("Slurm job 66 reached its time limit")
    row = ended_row(point, "67", "CANCELLED by 0", None, "", in_last_minutes=False)
    assert row["status"] == "error" and row["error"] == "Slurm job 67 ended CANCELLED by 0 before its point wrote a row"


def test_a_row_the_point_wrote_as_failed_is_a_timeout_when_its_job_reached_the_time_limit():
    # The warning signal or the limit's SIGTERM killed the worker: its row says error, the limit is why.
    from harness.launch.slurm import failed_row

    rec = {"status": "error", "error": "worker killed by SIGTERM"}
    late = failed_row(rec, "68", "COMPLETED", timed_out=True)
    assert late["status"] == "timeout" and "68 reached its time limit" in late["error"]
    cancelled = failed_row(rec, "69", "CANCELLED by 0", timed_out=False)
    assert cancelled["status"] == "error" and cancelled["error"].endswith("(Slurm job 69: CANCELLED by 0)")
    assert failed_row(rec, "70", "COMPLETED", timed_out=False) == rec


def test_a_job_over_two_ranks_runs_as_two_tasks_of_one_slurm_job_and_rank_0_writes_its_row(slurm, tmp_path):
    """backend=cpu over 2 ranks (gloo): one Slurm job of 2 tasks on the node, each a rank with
    submitit's rank and peers; the sweep's row is the point's, each rank's peaks in it."""
    r = run_cli("sweep", "sweeps=smoke", "seq_len=32", "batch_size=2", "backend=cpu", "parallel.dp_shard=2",
                "hydra/launcher=harness_slurm", "hydra.launcher.cpus_per_task=1", f"results_dir={tmp_path}")
    assert r.returncode == 0, r.stderr[-3000:]
    df = _rows(_sweep_dir(tmp_path, "smoke"))
    assert list(df["status"]) == ["ok"] and len(df["rank_peak_reserved_bytes"].iloc[0]) == 2
    job = str(df["job_id"].iloc[0])
    steps = subprocess.run(["sacct", "-n", "-P", "-j", job, "-o", "JobID,NTasks"], capture_output=True, text=True,
                           check=True).stdout.split()
    assert f"{job}.0|2" in steps  # the job's one step ran 2 tasks
    run = next(_sweep_dir(tmp_path, "smoke").glob("runs/*"))
    assert {json.loads(p.read_text())["rank"] for p in run.glob("rank*/rank_result.json")} == {0, 1}
