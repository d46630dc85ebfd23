"""`python -m harness run|sweep|report` end to end, as users type it (tiny model, CPU)."""

import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest

from harness.config.point import Card
from harness.launch import runner
from harness.record.row import COLUMNS
from harness.report.tables import fits_table
from tests.conftest import REPO, run_cli, train_point

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smoke_sweep(shared, tmp_path_factory):
    """The smoke sweep (run once a session) and a results dir of this module's own holding it."""
    def sweep(results: Path) -> None:
        r = run_cli("sweep", "sweeps=smoke", f"results_dir={results}")
        (results / "run.json").write_text(json.dumps(dict(returncode=r.returncode, stdout=r.stdout, stderr=r.stderr)))

    results = shared.copy("cli-smoke", sweep, tmp_path_factory.mktemp("cli") / "results")
    return SimpleNamespace(**json.loads((results / "run.json").read_text())), results


def _sweep_dirs(results):
    return sorted((results / "smoke").iterdir())


def test_sweep_writes_one_row_per_point_and_a_parquet(smoke_sweep):
    r, results = smoke_sweep
    assert r.returncode == 0, r.stderr
    [sweep_dir] = _sweep_dirs(results)
    df = pd.read_parquet(sweep_dir / "results.parquet")
    assert len(df) == 4
    assert set(df["status"]) == {"ok"}
    assert (df["peak_allocated_bytes"] > 0).all()
    assert set(df["batch_size"]) == {1, 2} and set(df["seq_len"]) == {32, 64}
    assert (sweep_dir / "results.csv").exists()
    for run in (sweep_dir / "runs").iterdir():
        assert (run / "trace.parquet").exists()
    assert "alloc GiB" in r.stdout and "h100-80gb" in r.stdout and "fits +" in r.stdout
    for name in ("report.md", "report.html", "fit.csv", "fit.parquet"):
        assert (sweep_dir / name).exists(), name
    assert "4/4 points done (ok 4, oom 0, failed 0)" in r.stderr


def test_rerunning_a_sweep_skips_points_already_done(smoke_sweep):
    _, results = smoke_sweep
    r = run_cli("sweep", "sweeps=smoke", f"results_dir={results}")
    assert r.returncode == 0, r.stderr
    newest = _sweep_dirs(results)[-1]
    df = pd.read_parquet(newest / "results.parquet")
    assert len(df) == 4 and df["reused_from"].notna().all()
    assert not list((newest / "runs").glob("*/trace.parquet"))  # nothing was traced again


def test_report_aggregates_a_partial_sweep(smoke_sweep, tmp_path):
    _, results = smoke_sweep
    partial = tmp_path / "partial"
    shutil.copytree(_sweep_dirs(results)[0], partial)
    (partial / "results.parquet").unlink()
    gone = json.loads((partial / "runs" / "3" / "result.json").read_text())
    (partial / "runs" / "3" / "result.json").unlink()  # an interrupted point
    r = run_cli("report", str(partial))
    assert r.returncode == 1, r.stderr  # not a finished sweep
    assert len(pd.read_parquet(partial / "results.parquet")) == 3
    [named] = [ln for ln in r.stderr.splitlines() if "have no row" in ln]
    assert f"batch_size={gone['batch_size']}" in named and f"seq_len={gone['seq_len']}" in named


def test_a_point_whose_row_names_code_edited_after_the_sweep_began_has_its_row(smoke_sweep, tmp_path):
    """harness edited while a sweep runs: a point run after the edit names the code that made it,
    another run_id than the one the manifest wrote at the start; its row in its run dir is still its
    row (the sweep finished: exit 0, nothing said missing)."""
    _, results = smoke_sweep
    done = tmp_path / "done"
    shutil.copytree(_sweep_dirs(results)[0], done)
    row_file = done / "runs" / "1" / "result.json"
    row = json.loads(row_file.read_text())
    row_file.write_text(json.dumps({**row, "run_id": "0123456789ab"}))  # as the edited code names it
    r = run_cli("report", str(done))
    assert r.returncode == 0, r.stderr
    assert "have no row" not in r.stderr
    assert "0123456789ab" in set(pd.read_parquet(done / "results.parquet")["run_id"])


def test_a_report_whose_reader_went_away_writes_every_file_and_ends_with_sigpipes_code(smoke_sweep, tmp_path):
    """`harness report <dir> | head -1` (as `sweep ... | head`): the terminal's reader gone loses no
    file; exit 141 as README documents (rich's own exit would be 1, a failed row's), no traceback."""
    _, results = smoke_sweep
    done = tmp_path / "done"
    shutil.copytree(_sweep_dirs(results)[0], done)
    for name in ("report.md", "report.html", "fit.csv", "results.parquet"):
        (done / name).unlink()
    proc = subprocess.Popen([sys.executable, "-m", "harness", "report", str(done)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd=REPO)
    proc.stdout.close()  # before it writes: its first table meets a closed pipe
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 141 and "Traceback" not in err, err
    for name in ("report.md", "report.html", "fit.csv", "results.parquet"):
        assert (done / name).exists(), name
    assert str(done / "report.html") in err


def test_ctrl_c_outside_a_sweeps_points_ends_with_130_and_one_line(tmp_path):
    """`diagnose -` waiting for an OOM message on stdin, stopped by Ctrl-C: one line, exit 130 as
    README documents, no traceback (any verb: composing, reporting)."""
    import signal

    proc = subprocess.Popen([sys.executable, "-c", "import signal, runpy, sys; "  # SIGINT as a terminal's
                             "signal.signal(signal.SIGINT, signal.default_int_handler); print('ready', flush=True); "
                             "sys.argv = ['harness', 'diagnose', '-']; runpy.run_module('harness', run_name='__main__')"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO, text=True)
    assert proc.stdout.readline().strip() == "ready"
    time.sleep(2)  # (importing or reading stdin by now: either way the same stop)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    proc.stdin.close()
    assert proc.returncode == 130 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1].startswith("harness: interrupted by SIGINT")


@pytest.mark.parametrize("args", [["model=tiny", "--cfg", "job", "seq_len=32"], ["--cfg", "job", "model=tiny", "seq_len=32"],
                                  ["model=tiny", "--info"]])
def test_hydras_own_flags_take_their_values_wherever_they_stand_and_run_nothing(args, tmp_path):
    """`run model=tiny --cfg job seq_len=32` prints the job's config as Hydra does, the overrides
    applied (the flag's value is its own, not an override); `--info` after an override takes none
    for its value. Nothing runs."""
    import yaml

    r = run_cli("run", *args, f"results_dir={tmp_path}")
    assert r.returncode == 0, r.stderr
    if "--cfg" in args:
        cfg = yaml.safe_load(r.stdout)
        assert (cfg["model"]["name"], cfg["seq_len"]) == ("tiny", 32)
    else:
        assert r.stdout.startswith("Hydra ")  # its info, not a usage error
    assert not list(tmp_path.rglob("result.json"))


@pytest.mark.parametrize("args", [["model=tiny", "batch_size=1,2", "-m"], ["--multirun", "model=tiny"],
                                  ["-cn", "mine", "model=tiny"]])
def test_a_hydra_flag_that_would_run_points_past_the_harness_is_refused_naming_it(args, tmp_path):
    """`run ... -m` ran the default grid inside this process through Hydra alone: no point validated
    first, no progress, no report. Such a flag is refused by name before anything runs."""
    r = run_cli("run", *args, f"results_dir={tmp_path}")
    flag = next(a for a in args if a.startswith("-"))
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith(f"harness: error: {flag}:"), r.stderr
    assert not list(tmp_path.rglob("result.json"))


def test_a_results_dir_the_override_grammar_cannot_read_as_typed_holds_the_run(tmp_path):
    """`results_dir=.../a (b)`: the run's own dir under it is quoted for Hydra too (the run wrote
    nothing there and said 'no result.json under ...')."""
    out = tmp_path / "a (b)"
    r = run_cli("run", "model=tiny", "seq_len=32", f"results_dir={out}")
    assert r.returncode == 0, r.stderr
    assert len(list(out.rglob("result.json"))) == 1


def test_run_records_every_column(tmp_path):
    r = run_cli("run", "model=tiny", "batch_size=2", "seq_len=32", "results_dir=results", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    [result] = tmp_path.glob("results/runs/*/result.json")
    rec = json.loads(result.read_text())
    assert set(COLUMNS) <= set(rec)
    # the typed results_dir once, as the CLI resolved it (a job elsewhere writes where this one did)
    said = rec["overrides"].split()
    assert [o for o in said if o.startswith("results_dir=")] == [f"results_dir={tmp_path.resolve() / 'results'}"]
    assert said[:3] == ["model=tiny", "batch_size=2", "seq_len=32"]
    assert rec["status"] == "ok" and rec["backend"] == "sim" and rec["n_params"] > 0
    assert rec["torch_version"] and rec["harness_version"]
    assert rec["peak_allocated_bytes"] >= rec["params_bytes"] + rec["optimizer_bytes"]


def test_inference_point_runs_prefill_and_decode(tmp_path):
    r = run_cli("run", "model=tiny", "workload=infer", "batch_size=4", "seq_len=64", f"results_dir={tmp_path}")
    assert r.returncode == 0, r.stderr
    rec = json.loads(next(tmp_path.glob("runs/*/result.json")).read_text())
    assert rec["status"] == "ok" and len(rec["step_allocated_bytes"]) == 1 + 16
    assert rec["optimizer_bytes"] == 0 and rec["grads_bytes"] == 0
    # the report names no optimizer for it (the config's default is none it runs)
    header, [row] = fits_table(pd.read_parquet(next(tmp_path.glob("runs/*/results.parquet"))),
                               pd.DataFrame(columns=["run_id", "card", "edge", "headroom_pct"]))
    assert row[header.index("optimizer")] == "-"


def test_point_beyond_the_card_is_an_oom_row_not_a_failure(tmp_path):
    """7B full fine-tuning cannot fit a T4: the row says oom, where, and the exit code is 0."""
    r = run_cli("run", "model=7b", "gpu=t4", "batch_size=1", "seq_len=128", f"results_dir={tmp_path}")
    assert r.returncode == 0, r.stderr
    rec = json.loads(next(tmp_path.glob("runs/*/result.json")).read_text())
    # bf16 weights (12.55 GiB) fit a T4; the gradients arriving in the first backward do not.
    assert rec["status"] == "oom" and (rec["oom_phase"], rec["oom_step"]) == ("backward", 0)
    assert rec["peak_allocated_bytes"] > rec["gpu_memory_bytes"]


def test_timeouts_are_rows_and_the_sweep_goes_on(tmp_path):
    r = run_cli("sweep", "sweeps=smoke", "model=7b", "batch_size=1", "seq_len=32,64", "timeout_s=1",
                f"results_dir={tmp_path}")
    assert r.returncode == 1
    df = pd.read_parquet(next((tmp_path / "smoke").iterdir()) / "results.parquet")
    assert len(df) == 2 and set(df["status"]) == {"timeout"}


def test_a_killed_worker_is_an_error_row(tmp_path, monkeypatch):
    """A worker killed by a signal (e.g. the host's OOM killer) leaves an error row."""
    suicide = tmp_path / "python"
    suicide.write_text("#!/bin/sh\nkill -9 $$\n")
    suicide.chmod(suicide.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("HARNESS_ZYGOTE", "0")  # a fresh interpreter per point: the one we replace
    monkeypatch.setattr(runner.sys, "executable", str(suicide))
    point = train_point().replace(backend="sim", timeout_s=60, sweep="t", gpu=Card(name="T4", memory_bytes=1))
    rec = runner.run_point(point, tmp_path / "run")
    assert rec["status"] == "error" and "SIGKILL" in rec["error"]
    assert json.loads((tmp_path / "run" / "result.json").read_text())["status"] == "error"


def _stdout_of(pid: str) -> Path | None:
    try:
        return Path(os.readlink(f"/proc/{pid}/fd/1")).resolve()
    except OSError:  # gone, or not ours to read
        return None


def test_a_forked_point_killed_mid_run_is_an_error_row(tmp_path):
    """The zygote path: a child killed by a signal leaves an error row, not a lost sweep."""
    import threading
    import time as _time

    from harness.launch import zygote
    point = train_point(model="7b", seq_len=64).replace(
        backend="sim", timeout_s=120, sweep="t", gpu=Card(name="T4", device_name="Tesla T4", memory_bytes=16 * 1024**3))
    run_dir = tmp_path / "run"

    def kill_when_running():
        for _ in range(600):
            log = run_dir / "worker.log"
            if log.exists():
                import subprocess as sp

                # Only this point's child: the zygote is shared by every test of this code (its
                # socket is per code), and a child's stdout is its point's worker.log
                out = sp.run(["pgrep", "-f", str(zygote.socket_path())], capture_output=True, text=True).stdout.split()
                children = [pid for pid in sp.run(["pgrep", "-P", ",".join(out) or "0"], capture_output=True,
                                                  text=True).stdout.split() if _stdout_of(pid) == log.resolve()]
                if children:
                    _time.sleep(0.5)
                    for pid in children:
                        os.kill(int(pid), 9)
                    return
            _time.sleep(0.05)

    killer = threading.Thread(target=kill_when_running)
    killer.start()
    rec = runner.run_point(point, run_dir)
    killer.join()
    assert rec["status"] == "error" and "SIGKILL" in rec["error"]


def test_the_zygote_is_started_early_only_where_points_will_fork_from_it(tmp_path, monkeypatch):
    from harness.launch import gpus, zygote

    spawned = []
    monkeypatch.setattr(zygote, "socket_path", lambda: tmp_path / "z.sock")
    monkeypatch.setattr(zygote, "_spawn", lambda path, model=None: spawned.append((path, model)))
    monkeypatch.setattr(gpus, "driver_present", lambda: False)
    monkeypatch.delenv("HARNESS_ZYGOTE", raising=False)
    for argv in (["backend=cuda"], ["hydra/launcher=harness_slurm"]):
        zygote.start_early(argv)
    monkeypatch.setenv("HARNESS_ZYGOTE", "0")
    zygote.start_early(["model=7b"])
    assert spawned == []
    monkeypatch.delenv("HARNESS_ZYGOTE")
    monkeypatch.setattr(gpus, "driver_present", lambda: True)
    zygote.start_early(["model=7b"])  # a GPU here: the points may well be cuda ones
    assert spawned == []
    zygote.start_early(["model=13b", "backend=sim"])  # warmed up on the model asked for
    assert spawned == [(tmp_path / "z.sock", "13b")]
    zygote.start_early(["backend=sim"])  # config.yaml's
    assert spawned[-1] == (tmp_path / "z.sock", "7b")
    assert zygote._model_asked(["sweeps=finetune-7b"]) == "7b"  # the grid file's
    # One that is alive (importing, warming up or serving) is not started again.
    monkeypatch.setattr(zygote, "_alive", lambda path: True)
    zygote.start_early(["backend=sim"])
    assert len(spawned) == 2


@pytest.mark.parametrize("ended_by", ["idling out", "SIGTERM"])
def test_a_zygote_leaves_neither_its_socket_nor_its_pid_file_nor_its_slots(tmp_path, ended_by):
    """Idle for IDLE_S or killed (`pkill`, a job's teardown), the zygote takes its files with it:
    a socket, a pid file and a slots folder in /tmp each time were left by every kill."""
    import signal

    sock = tmp_path / "z.sock"
    code = ("import sys; from pathlib import Path; import harness.launch.zygote as z; "
            f"z.IDLE_S = {1 if ended_by == 'idling out' else 300}; z.serve(Path(sys.argv[1]))")
    # its slots folder where the socket is (tempfile's folder)
    proc = subprocess.Popen([sys.executable, "-c", code, str(sock)], cwd=REPO, env={**os.environ, "TMPDIR": str(tmp_path)})
    (tmp_path / "z.sock.pid").write_text(str(proc.pid))  # as _spawn writes it
    if ended_by == "SIGTERM":
        deadline = time.monotonic() + 300
        while not sock.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert sock.exists() and len(list(tmp_path.glob("harness-zygote-slots-*"))) == 1  # serving
        proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=300) == (0 if ended_by == "idling out" else 128 + signal.SIGTERM)
    assert not sock.exists() and not (tmp_path / "z.sock.pid").exists()
    assert not list(tmp_path.glob("harness-zygote-slots-*"))


def _served(sock: Path, cwd: Path, point, run_dir: Path, before=lambda: None) -> str:
    """`point` run by a zygote serving `sock`, started in `cwd` (`before()` once it serves), asked
    from this process's directory; its answers."""
    import subprocess as sp

    from harness.launch import zygote
    from harness.record.row import POINT_FILE

    code = "import sys; from pathlib import Path; import harness.launch.zygote as z; z.serve(Path(sys.argv[1]))"
    proc = sp.Popen([sys.executable, "-c", code, str(sock)], cwd=cwd)
    try:
        deadline = time.monotonic() + 120
        while not sock.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        before()
        run_dir.mkdir()
        (run_dir / POINT_FILE).write_text(json.dumps(point.to_dict(), default=str))
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(str(sock))
        conn.sendall(zygote.request(run_dir))
        answers = conn.makefile("rb").read().decode()
        conn.close()
    finally:
        proc.kill()
    return answers


def test_a_zygotes_points_name_the_code_it_loaded_though_its_files_change_after(tmp_path):
    """An edit to harness while a zygote serves starts a fresh zygote for the sweeps after it; a
    point the old one still forks runs the old code, and its row says so (its run_id with it)."""
    from harness.record.row import RESULT_FILE, run_id

    shutil.copytree(REPO / "harness", tmp_path / "harness")

    def edit():
        with open(tmp_path / "harness" / "units.py", "a") as f:
            f.write("# an edit after the zygote started\n")

    point = train_point().replace(sweep="z")
    answers = _served(tmp_path / "z.sock", tmp_path, point, tmp_path / "run", edit)
    assert "rc 0" in answers
    row = json.loads((tmp_path / "run" / RESULT_FILE).read_text())
    # this checkout's code is the copy's as it was when the zygote started
    assert row["status"] == "ok" and row["run_id"] == run_id(point)


def test_a_zygotes_point_runs_where_its_client_runs(tmp_path, monkeypatch):
    """A zygote started from one directory (another sweep's) serves a client in another (a Slurm
    node runs in a directory of its own alike): the point reads a relative model.config_json from
    the directory it was asked from."""
    from harness.launch.point import to_point
    from harness.record.row import RESULT_FILE
    from tests.conftest import on_config

    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "config.json").write_text((REPO / "tests/data/architectures/gpt2.json").read_text())
    monkeypatch.chdir(tmp_path / "mine")
    mine = on_config(train_point(batch_size=1, seq_len=32), "config.json").replace(sweep="z")
    point = to_point(None, [], built=mine)  # as the CLI makes it here
    answers = _served(tmp_path / "z.sock", REPO, point, tmp_path / "run")
    assert "rc 0" in answers
    row = json.loads((tmp_path / "run" / RESULT_FILE).read_text())
    assert row["status"] == "ok", row.get("error")


def test_a_zygote_whose_code_is_not_the_code_its_socket_names_serves_nothing(tmp_path):
    """A client names the socket by the code it reads; a zygote that loaded other code (an edit
    while it imported) would give that client's points rows under other run_ids: it exits instead,
    its pid file gone, and the client starts another or runs without one."""
    import subprocess as sp

    from harness.launch import zygote

    sock = tmp_path / "harness-zygote-0-000000000000.sock"
    assert zygote.socket_path().name != sock.name
    proc = sp.Popen([sys.executable, "-m", "harness.launch.zygote", str(sock)], cwd=REPO)
    zygote._pid_file(sock).write_text(str(proc.pid))  # as _spawn writes it
    try:
        deadline = time.monotonic() + 120
        while proc.poll() is None and not sock.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        served = sock.exists()
    finally:
        proc.kill()
    assert not served and proc.wait() == 0 and not zygote._pid_file(sock).exists()


def test_the_zygote_warms_up_on_the_model_asked_for_else_tiny_and_leaves_its_points_nothing_to_import(tmp_path):
    """The zygote's warm-up traces a layer of the preset asked for, else the tiny point; and what
    a point needs is imported (and warmed up) once there, not in each point it forks: pandas and
    pyarrow alone cost 0.7 s a point when the zygote did not import them."""
    code = ("import json, sys; from pathlib import Path; from harness.launch import zygote; zygote.preload(); "
            "warmed = [zygote._warm_up(m) for m in ('7b', 'no-such-model', None)]; "
            "from harness.probe import worker; from tests.conftest import train_point; before = set(sys.modules); "
            "worker.run_sim(train_point(), Path(sys.argv[1])); "
            "print(json.dumps([warmed, sorted({m.split('.')[0] for m in set(sys.modules) - before})]))")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    warmed, imported = json.loads(out.stdout.splitlines()[-1])
    assert warmed == [["7b"], ["tiny"], ["tiny"]]
    assert not set(imported) & {"pandas", "pyarrow", "torch", "transformers", "matplotlib"}, imported


def test_the_zygotes_warm_up_leaves_autograd_working_in_the_points_it_forks():
    """Autograd's engine decides at its first backward whether to start a thread per GPU, and a
    child forked after that cannot run backward: the warm-up's first backward is a real one on
    the host (a CUDA build of torch on a machine without a GPU counted one under FakeTensorMode,
    and every point failed; with torch's CPU build, as here, it never did), and where a GPU driver
    is present it traces inference, no backward at all."""
    code = ("import os, sys, torch; from harness.launch import zygote, gpus; import harness.probe.sim.trace as t; "
            "seen = []; run = t.run_point; "
            "t.run_point = lambda p, *a, **k: (seen.append(str(p.workload.name.value)), run(p, *a, **k))[1]; "
            "gpus.driver_present = lambda: sys.argv[1] == 'driver'; zygote._warm_up('tiny'); pid = os.fork()\n"
            "if pid == 0:\n (torch.ones(2, requires_grad=True) * 2).sum().backward(); os._exit(0)\n"
            "print(seen, os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))")
    for host, workload in (("none", "train"), ("driver", "infer")):
        out = subprocess.run([sys.executable, "-c", code, host], cwd=REPO, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.split() == [f"['{workload}']", "0"]  # the child's backward ran


def test_an_edit_to_a_module_the_job_imports_runs_the_job_again(tmp_path):
    """The identity of a job is its code, the modules it imports included: an edited helper
    is traced again, not served from the row and trace of the old model."""
    from harness.config.compose import compose
    from harness.launch.point import to_point

    proj = tmp_path / "proj"
    (proj / "my_project").mkdir(parents=True)
    (proj / "my_project" / "__init__.py").write_text("")
    (proj / "my_project" / "layers.py").write_text("WIDTH = 32\n")
    (proj / "memjob.py").write_text(
        "import torch\nfrom harness.workload import Job\n\n\n"
        "def build(k):\n"
        "    from my_project.layers import WIDTH  # imported while building, not at module level\n"
        "    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Linear(WIDTH, 4))\n"
        "    return Job(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(k.batch_size, WIDTH))\n")
    results = tmp_path / "results"
    cfg = compose(["workload=custom", "workload.target=memjob:build", "precision=fp32", "sweep=t"])
    point = to_point(cfg, [], str(proj), results_dir=results)

    def sweep(n):  # a run dir of a sweep, as Hydra lays them out
        return runner.run_point(point, results / "t" / f"{n}" / "runs" / "0", results)

    first = sweep(1)
    assert first["status"] == "ok", first.get("error")
    assert "layers.py" in first["user_code"]
    assert sweep(2)["reused_from"]  # unchanged: reused
    (proj / "my_project" / "layers.py").write_text("WIDTH = 64\n")
    edited = sweep(3)
    assert edited["status"] == "ok" and not edited.get("reused_from") and not edited.get("trace_reused")
    assert edited["n_params"] > first["n_params"]
    assert sweep(4)["reused_from"]  # the new row serves from now on


def test_an_edit_to_a_file_the_job_reads_runs_the_job_again(tmp_path):
    """A job that reads its model's size from a file of its own: the file is part of the row's
    identity (user_code), as the job's modules are; the files it writes are not."""
    from harness.config.compose import compose
    from harness.launch.point import to_point

    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "sizes.json").write_text('{"width": 32}')
    (proj / "filejob.py").write_text(
        "import json, os, torch\nfrom harness.workload import Job\n\n\n"
        "def build(k):\n"
        "    width = json.load(open('sizes.json'))['width']  # relative: the job's own folder\n"
        "    with open(os.path.join(k.args['out'], 'built.txt'), 'w') as f:\n"
        "        f.write(str(width))\n"
        "    model = torch.nn.Linear(width, width)\n"
        "    return Job(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(k.batch_size, width))\n")
    results = tmp_path / "results"
    cfg = compose(["workload=custom", "workload.target=filejob:build", "precision=fp32", "sweep=t",
                   f"+workload.args.out={tmp_path}"])
    point = to_point(cfg, [], str(proj), results_dir=results)

    def sweep(n):
        return runner.run_point(point, results / "t" / f"{n}" / "runs" / "0", results)

    first = sweep(1)
    assert first["status"] == "ok", first.get("error")
    read = json.loads(first["user_code"])
    assert str((proj / "sizes.json").resolve()) in read and str(tmp_path / "built.txt") not in read
    assert sweep(2)["reused_from"]  # unchanged: reused
    (proj / "sizes.json").write_text('{"width": 64}')
    edited = sweep(3)
    assert edited["status"] == "ok" and not edited.get("reused_from") and not edited.get("trace_reused")
    assert edited["n_params"] > first["n_params"]
    assert sweep(4)["reused_from"]


def test_an_edit_to_the_models_config_json_runs_it_again(tmp_path):
    """model=hf reads its architecture from the user's file: an edited file is traced again, not
    served from the row and trace of the old architecture."""
    from harness.config.compose import compose
    from harness.launch.point import to_point

    config = tmp_path / "config.json"
    arch = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 2,
            "num_key_value_heads": 2, "num_hidden_layers": 1, "vocab_size": 256, "max_position_embeddings": 128}
    config.write_text(json.dumps(arch))
    results = tmp_path / "results"

    def sweep(n):  # a run dir of a sweep, as Hydra lays them out; the point made as a sweep makes it
        cfg = compose(["model=hf", f"model.config_json={config}", "seq_len=32", "batch_size=1", "sweep=t"])
        return runner.run_point(to_point(cfg, [], str(tmp_path), results_dir=results),
                                results / "t" / f"{n}" / "runs" / "0", results)

    first = sweep(1)
    assert first["status"] == "ok", first.get("error")
    assert sweep(2)["reused_from"]  # unchanged: reused
    config.write_text(json.dumps({**arch, "num_hidden_layers": 3}))
    edited = sweep(3)
    assert edited["status"] == "ok" and not edited.get("reused_from") and not edited.get("trace_reused")
    assert edited["n_params"] > first["n_params"]
    assert sweep(4)["reused_from"]  # the new row serves from now on


def test_a_row_judged_against_another_catalog_runs_again_and_its_trace_serves(tmp_path, monkeypatch):
    """Calibrate's measurements change the catalog's cards, and with them every row's fit verdicts:
    a re-run judges the row again (from its cached trace), not serves the old verdicts. The points
    fork from the zygote, which reads the measurements where this process's environment says."""
    from harness.config import cards
    from harness.config.compose import compose
    from harness.launch.point import to_point

    monkeypatch.setenv(cards.MEASURED_ENV, str(tmp_path / "measured.json"))
    results = tmp_path / "results"
    point = to_point(compose(["model=tiny", "seq_len=64", "sweep=t"]), [], str(tmp_path), results_dir=results)

    def sweep(n):
        return runner.run_point(point, results / "t" / f"{n}" / "runs" / "0", results)

    first = sweep(1)
    assert first["status"] == "ok" and sweep(2)["reused_from"]
    t4 = cards.by_key()["t4"]
    cards.record_measured([{"gpu": "T4", "status": "ok", "emulated_gpu": False,
                            "device_memory_bytes": t4.memory_bytes, "measured_non_pytorch_bytes": 400 * 2**20}],
                          {"T4": "t4"})
    judged_again = sweep(3)
    assert not judged_again.get("reused_from") and judged_again["trace_reused"]
    assert judged_again["catalog_sha"] == cards.digest() != first["catalog_sha"]
    assert sweep(4)["reused_from"]


def test_the_identity_of_a_run_covers_torch_transformers_and_harness():
    from harness.record import provenance
    from harness.record.row import point_identity

    versions = point_identity(train_point())["versions"]
    assert set(versions) == {"torch", "transformers", "harness"} and all(versions.values())
    assert versions == provenance.versions()


@pytest.mark.parametrize("verb,signum,code", [("sweep", "SIGINT", 130), ("run", "SIGTERM", 143),
                                               ("plan", "SIGINT", 130)])
def test_an_interrupted_sweep_stops_every_point_and_says_how_to_resume(tmp_path, verb, signum, code):
    import signal
    import subprocess
    import sys
    import time

    from harness.cli.interrupt import descendants
    from tests.conftest import REPO

    args = [sys.executable, "-m", "harness", verb, "workload=custom", "workload.target=tests.jobs.sleepy:build",
            "+workload.args.sleep_s=120", "precision=fp32", f"results_dir={tmp_path}"]
    if verb in ("sweep", "plan"):  # (a plan's searches would go on past the stop, each probe a point)
        args += ["batch_size=1,2" if verb == "sweep" else "plan.cards=[t4,l4]", "seq_len=8",
                 "checkpointing=false"]
    proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not list(tmp_path.rglob("worker.log")):  # a point is running
        time.sleep(0.2)
    assert list(tmp_path.rglob("worker.log")), "no point started"
    started = descendants(proc.pid)
    proc.send_signal(getattr(signal, signum))
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == code, err
    lines = [ln for ln in err.strip().splitlines() if "points done" not in ln]
    assert lines[-1].startswith(f"harness: interrupted by {signum}: ") and f"python -m harness {verb}" in lines[-1]
    assert verb == "plan" or lines[-1].startswith(f"harness: interrupted by {signum}: 0 of ")
    assert "Traceback" not in err
    time.sleep(3)
    assert not [p for p in started if os.path.exists(f"/proc/{p}")], "a process of the sweep kept running"
    from harness.cli.interrupt import _processes

    def writes_here(pid: int) -> bool:  # its stdout is one of this sweep's worker.logs
        try:
            return os.readlink(f"/proc/{pid}/fd/1").startswith(str(tmp_path))
        except OSError:
            return False

    procs = _processes()  # a point forked from the zygote is the zygote's child, not ours: it ends too
    forked = [p for p, (ppid, cmd) in procs.items()  # (the zygote is shared: other sweeps' points may run)
              if "harness.launch.zygote" in cmd and "harness.launch.zygote" in procs.get(ppid, (0, ""))[1]
              and writes_here(p)]
    assert not forked, "a point forked from the zygote kept running"
    assert not list(tmp_path.rglob("result.json"))  # and nothing wrote a row after the stop


def test_a_local_sweep_refuses_fewer_than_one_worker_before_writing_anything(tmp_path):
    r = run_cli("sweep", "model=tiny", "hydra.launcher.workers=0", f"results_dir={tmp_path}")
    assert r.returncode == 2 and "hydra.launcher.workers" in r.stderr
    assert not list(tmp_path.rglob("points.json"))


@pytest.mark.parametrize("verb", ["run", "plan"])
def test_a_results_dir_nobody_can_write_is_refused_naming_it_before_anything_runs(verb, tmp_path):
    (tmp_path / "a-file").write_text("")
    r = run_cli(verb, "model=tiny", "seq_len=64", f"results_dir={tmp_path / 'a-file' / 'results'}")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("harness: error: results_dir: "), r.stderr
    assert not list(tmp_path.glob("**/result.json"))


def test_report_of_a_file_or_directory_that_holds_no_result_is_refused_and_writes_nothing(tmp_path):
    grid = tmp_path / "grid.yaml"
    grid.write_text("hydra: {}\n")
    r = run_cli("report", str(grid))
    assert r.returncode == 2 and str(grid) in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["grid.yaml"]
    # a directory no sweep or run made: no rows, no manifest
    r = run_cli("report", str(tmp_path))
    assert r.returncode == 2 and str(tmp_path) in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["grid.yaml"]


def test_the_launcher_refuses_bad_input_before_importing_the_report():
    """pandas, matplotlib and the analysis (a second of imports) are loaded where rows become a
    table, not by the launcher that checks a command first."""
    code = ("import sys; import harness.cli.main; "
            "print(sorted(m for m in ('pandas', 'matplotlib', 'torch') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_a_zygote_serves_only_its_own_clone_and_configuration(tmp_path):
    """The zygote's socket is keyed by where harness lies and its conf/ too: another clone of the
    same sources (or its card catalog edited) gets a zygote of its own, not one that read another
    clone's cards."""
    import shutil
    import subprocess
    import sys

    from tests.conftest import REPO

    def key(root):
        return subprocess.run([sys.executable, "-c", "from harness.launch.zygote import _code_key; print(_code_key())"],
                              capture_output=True, text=True, check=True, cwd=tmp_path,
                              env={**os.environ, "PYTHONPATH": str(root)}).stdout.strip()

    clone = tmp_path / "clone"
    shutil.copytree(REPO / "harness", clone / "harness", ignore=shutil.ignore_patterns("__pycache__"))
    here, there = key(REPO), key(clone)
    card = clone / "harness" / "conf" / "gpu" / "t4.yaml"
    card.write_text(card.read_text().replace("multiprocessors: 40", "multiprocessors: 41"))
    assert len({here, there, key(clone)}) == 3
