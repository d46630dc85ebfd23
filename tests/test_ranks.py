"""A job over several GPUs run for real as its ranks (launch.ranks, record.ranks): here on CPU tensors
in gloo processes (backend=cpu), launched as NCCL ranks on GPUs are (tests/test_cuda_backend.py);
on Slurm, one task per rank (tests/test_slurm.py)."""

import json
import os
import threading
import time
from pathlib import Path

import pandas as pd
import pytest

from harness.config.compose import slurm_gpus, slurm_gres, slurm_ranks_per_node
from harness.config.point import Parallel, Point
from harness.errors import ConfigError
from harness.launch import ranks
from harness.probe.sim.trace import run_point
from harness.record.ranks import DIED, STOPPED, merge
from harness.record.row import base_record
from tests.conftest import run_cli, train_point


def _cpu(steps=3, **parallel) -> Point:
    # an odd vocabulary: tensor parallel gives rank 0 the larger half of the embedding and the head
    return train_point(batch_size=2, seq_len=32, steps=steps, vocab_size=1001).replace(
        backend="cpu", parallel=Parallel(**parallel))


@pytest.mark.slow
def test_a_cpu_run_over_two_ranks_is_one_row_the_larger_rank_and_rank_0_is_the_fake_traces(tmp_path):
    """Tensor parallel over 2 gloo processes, from the command line: one row in the results, rank
    0's (its half of the odd vocabulary the larger), each rank's peaks beside it; rank 0 holds and
    keeps between steps what the fake trace of rank 0 says (CPU kernels; its peak may differ by a
    buffer gloo's thread frees late). On cards of one GPU a node: the job's 2 nodes' ranks run here."""
    r = run_cli("run", "model=tiny", "model.hf.vocab_size=1001", "batch_size=2", "seq_len=32", "workload.steps=3",
                "backend=cpu", "parallel.tp=2", "gpu=rtx4060", "parallel.nodes=auto", f"results_dir={tmp_path}")
    assert r.returncode == 0, r.stderr[-2000:]
    df = pd.read_parquet(next(tmp_path.rglob("results.parquet")))
    assert len(df) == 1
    rec = df.iloc[0].to_dict()
    run = next(tmp_path.rglob("rank0")).parent
    rows = {i: ranks.read_row(run, i) for i in (0, 1)}
    fake, _ = run_point(_cpu(tp=2).replace(backend="sim"), emulate_cuda=False, fake=True)
    assert rows[0]["params_bytes"] == fake["params_bytes"] > rows[1]["params_bytes"]
    assert rows[0]["step_allocated_bytes"] == fake["step_allocated_bytes"]
    assert (rec["status"], rec["backend"], rec["nodes"]) == ("ok", "cpu", 2)
    reserved = list(rec["rank_peak_reserved_bytes"])
    assert rec["rank"] == reserved.index(max(reserved)) and rec["peak_reserved_bytes"] == max(reserved)
    assert list(rec["rank_peak_allocated_bytes"]) == [rows[0]["peak_allocated_bytes"], rows[1]["peak_allocated_bytes"]]


def _rank_pid(rank_dir: Path) -> int | None:
    """The process of the rank in `rank_dir`: the one whose output goes to its worker.log (a rank
    forked from the zygote has the zygote's command line)."""
    log = str(rank_dir / "worker.log")
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and os.readlink(proc / "fd" / "1") == log:
                return int(proc.name)
        except OSError:
            continue
    return None



def test_a_cpu_rank_forks_from_the_zygote_and_a_killed_one_has_vanished(tmp_path):
    """launch.ranks.start: a CPU rank is a child of the zygote (torch imported there), its output
    its worker.log as a fresh interpreter's is; rank 0 alone waits at the rendezvous for its peer;
    killed, it ends without an answer (VANISHED: its status is the zygote's, its parent's)."""
    from harness.launch import zygote
    from harness.launch.exits import VANISHED

    point = _cpu(dp_shard=2)
    env = {**ranks.process_env(point, None, dict(os.environ), 2),
           **ranks.torch_env(0, 2, 0, 2, "127.0.0.1", ranks._free_port())}
    rank0 = ranks.start(point, tmp_path, 0, env, forked=True)
    assert isinstance(rank0, zygote.Forked)
    deadline = time.monotonic() + 60
    while _rank_pid(tmp_path / "rank0") is None:  # its output is its worker.log, as a fresh one's is
        assert rank0.poll() is None and time.monotonic() < deadline
        time.sleep(0.1)
    assert rank0.wait(1.0) is None  # waiting for rank 1
    rank0.kill()
    assert rank0.wait() is VANISHED and rank0.poll() is VANISHED

@pytest.mark.slow
def test_a_rank_that_dies_is_the_points_error_not_its_peers_lost_connection(tmp_path, monkeypatch):
    import os
    import signal

    monkeypatch.setattr(ranks, "GRACE_S", 2.0)  # killed before the rendezvous, rank 0 waits to be stopped

    point = _cpu(steps=100_000, dp_shard=2)  # steps enough to be running when rank 1 is killed
    out: dict = {}
    runner = threading.Thread(target=lambda: out.update(rec=ranks.run_here(point, tmp_path, None)))
    runner.start()
    deadline = time.monotonic() + 120
    while not (tmp_path / "rank1" / "worker.log").exists() or _rank_pid(tmp_path / "rank1") is None:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    time.sleep(4)  # into its start, or its steps
    os.kill(_rank_pid(tmp_path / "rank1"), signal.SIGKILL)
    runner.join(timeout=120)
    rec = out["rec"]
    assert (rec["status"], rec["rank"]) == ("error", 1)
    assert "rank 1 of 2" in rec["error"] and "SIGKILL" in rec["error"]
    # rank 0 waited for rank 1 in a collective: gloo told it its peer had gone, or it was stopped
    assert ranks.read_row(tmp_path, 0)["status"] == "error"


def test_a_rank_waiting_on_a_failed_peer_is_stopped_after_the_grace_and_says_for_whom(tmp_path, monkeypatch):
    """As NCCL leaves a rank whose peer ran out of memory: waiting in a collective, for ever."""
    import subprocess
    import sys

    monkeypatch.setattr(ranks, "GRACE_S", 1.0)
    point = _cpu(dp_shard=2)
    fail = ("import json, pathlib; d = pathlib.Path(r'{}'); d.mkdir(parents=True, exist_ok=True); "
            "(d / 'rank_result.json').write_text(json.dumps(dict(status='oom', rank=1)))").format(tmp_path / "rank1")
    procs = {0: subprocess.Popen(["sleep", "600"]), 1: subprocess.Popen([sys.executable, "-c", fail])}
    t0 = time.monotonic()
    ranks.supervise(procs, point, tmp_path, deadline=t0 + 300)
    assert time.monotonic() - t0 < 30 and procs[0].returncode is not None
    assert ranks.read_row(tmp_path, 0)[STOPPED] == 1
    rec = ranks.merged(point, tmp_path, "left no row")
    assert (rec["status"], rec["rank"]) == ("oom", 1)


def _row(rank, status="ok", reserved=0, fits=("t4", "a100-80gb"), tight=(), **kw):
    return dict(rank=rank, status=status, peak_reserved_bytes=reserved, peak_allocated_bytes=reserved // 2,
                fits_cards=list(fits), tight_cards=list(tight), retry_cards=[], **kw)


BASE = base_record(train_point().replace(parallel=Parallel(dp_shard=3)))


def test_the_rank_that_reserves_most_decides_and_a_card_holds_the_job_only_where_it_holds_every_rank():
    rec = merge(BASE, {0: _row(0, reserved=10), 1: _row(1, reserved=30, tight=("t4",)),
                       2: _row(2, reserved=30, fits=("a100-80gb",))}, {})
    assert (rec["status"], rec["rank"]) == ("ok", 1)  # the first of the largest
    assert rec["fits_cards"] == ["a100-80gb"] and rec["tight_cards"] == []
    assert rec["rank_peak_reserved_bytes"] == [10, 30, 30]
    rec = merge(BASE, {0: _row(0), 1: _row(1, tight=("t4",)), 2: _row(2)}, {})
    assert rec["fits_cards"] == ["t4", "a100-80gb"] and rec["tight_cards"] == ["t4"]


def test_the_rank_that_failed_first_is_named_before_those_stopped_for_it_or_that_left_no_row():
    rows = {0: _row(0, "error", error="stopped", **{STOPPED: 2}), 1: None,
            2: _row(2, "oom", error=None, oom_message="CUDA out of memory")}
    rec = merge(BASE, rows, {1: "left no row"})
    assert (rec["status"], rec["rank"], rec["error"]) == ("oom", 2, "rank 2 of 3")
    assert STOPPED not in rec and rec["rank_peak_reserved_bytes"] == [0, None, 0]
    rec = merge(BASE, {0: _row(0, "error", error="boom", **{STOPPED: 1}), 1: _row(1, "error", error="real"), 2: None},
                {2: "left no row"})
    assert (rec["rank"], rec["error"]) == (1, "rank 1 of 3: real")
    died = {0: _row(0, "error", error="Connection reset by peer"), 1: _row(1, "error", error="SIGKILL", **{DIED: True}),
            2: _row(2)}
    assert merge(BASE, died, {})["rank"] == 1  # its peers' errors came of its death
    rec = merge(BASE, {0: _row(0), 1: None, 2: _row(2)}, {1: "left no row"})
    assert (rec["status"], rec["rank"], rec["fits_cards"]) == ("error", 1, [])


def test_nodes_or_cards_this_machine_lacks_and_cpu_autocast_are_refused_by_name(tmp_path):
    over_two_nodes = _cpu(dp_shard=2).replace(parallel=Parallel(dp_shard=2, nodes=2))
    with pytest.raises(ConfigError) as e:
        ranks.check_here([over_two_nodes.replace(backend="cuda")], ["0", "1"])
    assert e.value.key == "parallel.nodes"
    ranks.check_here([over_two_nodes], [])  # CPU ranks: here, whatever the job's nodes
    with pytest.raises(ConfigError) as e:
        ranks.check_here([_cpu(tp=4).replace(backend="cuda")], ["0", "1"])
    assert e.value.key == "parallel.tp"
    ranks.check_here([_cpu(tp=2).replace(backend="cuda")], ["0", "1"])
    r = run_cli("run", "model=tiny", "backend=cpu", "precision=amp_bf16", f"results_dir={tmp_path}")
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith("harness: error: precision:")


def test_slurm_asks_for_a_task_and_a_gpu_per_rank_on_each_node():
    assert slurm_ranks_per_node("cuda", 8, 2, 4, 8) == 8 and slurm_ranks_per_node("sim", 8, 2, 4, 8) == 1
    assert slurm_gres("cuda", "gpu:a100:1", 8) == "gpu:a100:8"
    assert slurm_gres("cuda", "gpu:2", 4) == "gpu:4" and slurm_gres("auto", "gpu:h100", 4) == "gpu:h100:4"
    assert slurm_gres("cpu", "gpu:a100:1", 8) is None and slurm_gres("sim", "gpu:a100:1", 8) is None
    assert slurm_gpus("cuda", None, 8) == 8 and slurm_gpus("cuda", "gpu:a100:1", 8) is None


def test_a_rank_launched_without_torchruns_environment_says_so(tmp_path, monkeypatch):
    from harness.probe import worker
    from harness.record.ranks import RANK_RESULT_FILE

    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    (tmp_path / "point.json").write_text(json.dumps(_cpu(dp_shard=2).to_dict(), default=str))
    worker.main(tmp_path)
    row = json.loads((tmp_path / RANK_RESULT_FILE).read_text())
    assert row["status"] == "error" and "RANK" in row["error"]
