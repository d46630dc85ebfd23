"""The user's own memory code on the virtual GPU: torch.cuda's readings, snapshots and OOMs are the
virtual card's inside a job and in a whole script (`python -m harness script`)."""

import pytest
import torch

from harness.allocator import snapshot as snap
from harness.allocator.model import round_size
from harness.allocator.replay import replay_snapshot
from harness.allocator.settings import AllocSettings
from harness.config import cards
from harness.config.point import Workload
from harness.probe.sim.script import run_script
from harness.probe.sim.tracker import CUBLAS_WORKSPACE_BYTES
from harness.probe.worker import run_sim
from tests.conftest import REPO, run_cli, train_point

SCRIPT = REPO / "tests" / "scripts" / "profile_memory.py"


def _readings(out: str) -> dict:
    """The script's own printed readings: {label: [numbers]}."""
    got = {}
    for line in out.splitlines():
        words = line.split()
        if line.startswith("after model"):
            got["after model"] = [int(words[-1])]
        elif line.startswith("mem_get_info"):
            got["mem_get_info"] = [int(w) for w in words[1:]]
        elif line.startswith("step "):
            got[f"step {words[1]}"] = {words[i]: int(words[i + 1]) for i in range(4, len(words) - 1, 2)}
    return got


def test_a_profiling_script_reads_the_virtual_cards_memory(tmp_path, capsys):
    card = cards.by_key()["a100-80gb"]
    run = run_script(SCRIPT, [str(tmp_path / "snap.pickle")], card, AllocSettings())
    out = capsys.readouterr().out
    assert run.exit_code == 0 and run.error is None
    got = _readings(out)
    # Linear(1024, 4096) and Linear(4096, 1024) in fp32, as the allocator rounds each
    params = sum(round_size(n * 4) for n in (4096 * 1024, 4096, 1024 * 4096, 1024))
    assert got["after model"] == [params]  # built on the host, then moved: only the copies count
    after = got["step 0"]
    x, loss = round_size(64 * 1024 * 4), round_size(4)
    # parameters, AdamW's two moments, the step's input and loss, a cuBLAS workspace per thread
    assert after["allocated"] == 3 * params + x + loss + 2 * CUBLAS_WORKSPACE_BYTES
    assert after["max_allocated"] > after["allocated"] and after["max_reserved"] >= after["reserved"]
    assert got["step 1"] == got["step 2"]  # peaks reset each step: the steady state repeats
    free, total = got["mem_get_info"]
    assert total == card.memory_bytes and free == total - card.non_pytorch_bytes - after["reserved"]
    assert "PyTorch CUDA memory summary" in out and "GPU reserved memory" in out  # torch's own summary
    assert run.peaks["allocated_bytes"] == got["step 0"]["max_allocated"]  # the whole run, past the resets
    assert run.value_reads == [f"{SCRIPT}:26"]  # loss.item() in the print: a stand-in, reported with its line


def test_a_scripts_snapshot_holds_exactly_the_recorded_region_and_replays_exactly(tmp_path, capsys):
    path = tmp_path / "snap.pickle"
    run_script(SCRIPT, [str(path)], cards.by_key()["a100-80gb"], AllocSettings())
    data = snap.load(path)
    trace = data["device_traces"][0]
    assert trace[0]["action"] == "alloc" and trace[0]["frames"][0]["filename"] == str(SCRIPT)
    assert trace[0]["frames"][0]["line"] == 20  # the first allocation recorded: the step's input
    live_params = [b for s in data["segments"] for b in s["blocks"] if b["size"] == 4096 * 1024 * 4]
    assert len(live_params) >= 2  # the weights (and moments) allocated before recording began, still alive
    result = replay_snapshot(data)
    assert result.exact
    from torch.cuda import _memory_viz

    assert "segment" in _memory_viz.segsum(data) and len(_memory_viz.trace_plot(data)) > 1000  # memory_viz opens it


@pytest.mark.parametrize("settings", ["", "expandable_segments:True"])
def test_a_script_that_does_not_fit_the_card_raises_torch_out_of_memory_at_its_line(tmp_path, capsys, settings):
    run = run_script(SCRIPT, [str(tmp_path / "s.pickle"), "30000"], cards.by_key()["t4"], AllocSettings.from_conf(settings))
    assert isinstance(run.error, torch.OutOfMemoryError) and run.exit_code == 1
    assert "CUDA out of memory. Tried to allocate 13.41 GiB" in str(run.error)
    import traceback

    frames = [f for f in traceback.extract_tb(run.error.__traceback__) if f.filename == str(SCRIPT)]
    assert frames[-1].lineno == 13  # model.to(device): the second weight does not fit a T4
    assert run.stats["num_ooms"] == 1


SIDE_STREAM = REPO / "tests" / "scripts" / "side_stream.py"


def side_stream_readings(out: str) -> dict:
    """side_stream.py's printed readings: {label: {reading: bytes}} (tests/test_cuda.py reads a real run's)."""
    got = {}
    for line in out.splitlines():
        label, sep, rest = line.partition(" allocated ")
        if sep:
            words = ["allocated", *rest.split()]
            got[label] = {words[i]: int(words[i + 1]) for i in range(0, len(words), 2)}
    return got


def test_a_side_streams_free_block_is_reused_on_its_stream_only(capsys):
    """The caching allocator keys free blocks by stream: 100 MiB freed on a side stream is not the
    default stream's (a second segment: 200 MiB reserved), and is the side stream's again."""
    run = run_script(SIDE_STREAM, [], cards.by_key()["a100-80gb"], AllocSettings())
    out = capsys.readouterr().out
    assert run.exit_code == 0 and run.error is None, run.error
    MiB = 2**20
    got = side_stream_readings(out)
    assert got["side freed"] == {"allocated": 0, "max_allocated": 100 * MiB, "reserved": 100 * MiB}
    assert got["default"] == {"allocated": 100 * MiB, "max_allocated": 100 * MiB, "reserved": 200 * MiB}
    assert got["side again"] == {"allocated": 100 * MiB, "max_allocated": 100 * MiB, "reserved": 200 * MiB}
    assert "current is default True" in out


def test_a_jobs_side_stream_is_in_its_trace_and_its_replay(tmp_path):
    """What a job allocates inside `torch.cuda.stream(side)` is on that stream in the trace file,
    and the replay keeps it in that stream's pool (more reserved than the same trace on one stream)."""
    import pandas as pd

    from harness.allocator.replay import replay_events
    from harness.record import trace_store

    point = train_point(precision="fp32", batch_size=4, seq_len=128).replace(
        workload=Workload(name="custom", steps=3, target="tests.jobs.side_stream:build"), cwd=str(REPO))
    rec = run_sim(point, tmp_path)
    assert rec["status"] == "ok", rec.get("error")
    df = pd.read_parquet(rec["trace_path"])
    side = df[df["stream"] != 0]
    allocs = side[side["action"] == "alloc"]
    assert set(df["stream"]) == {0, 1} and set(allocs["module"]) == {"up"}
    assert (allocs["phase"] == "forward").all()  # the forward's projection only
    workspaces = df[(df["action"] == "alloc") & (df["kind"] == "workspace")]
    assert sorted(zip(workspaces["phase"], workspaces["stream"])) == [("backward", 0), ("forward", 0), ("forward", 1)]
    one_stream = replay_events(trace_store.replay_rows(df.assign(stream=0)), AllocSettings())[0]
    assert rec["peak_reserved_bytes"] > one_stream.peak_reserved_bytes
    assert rec["peak_allocated_bytes"] == one_stream.peak_allocated_bytes


def test_a_jobs_own_memory_readings_are_the_virtual_cards(tmp_path):
    from tests.jobs import reads_memory

    point = train_point(precision="bf16").replace(
        workload=Workload(name="custom", steps=3, target="tests.jobs.reads_memory:build"), cwd=str(REPO))
    rec = run_sim(point, tmp_path)
    peaks = [r[0] for r in reads_memory.READINGS]
    assert len(peaks) == 3 and peaks[1] == peaks[2]
    assert max(peaks[1:]) == rec["steady_peak_allocated_bytes"]  # what the step saw is the row's
    assert max(peaks) <= rec["peak_allocated_bytes"]  # the whole run also holds the build
    assert reads_memory.READINGS[-1][2] <= rec["peak_reserved_bytes"]


def test_the_script_verb_passes_its_args_and_takes_the_harness_options(tmp_path):
    ok = run_cli("script", str(SCRIPT), str(tmp_path / "snap.pickle"), "gpu=t4", "512",
                 "allocator=expandable", cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr
    assert "device cuda Tesla T4 total" in ok.stdout and "step 2 loss" in ok.stdout
    assert "virtual T4" in ok.stderr and (tmp_path / "snap.pickle").exists()
    oom = run_cli("script", str(SCRIPT), str(tmp_path / "s.pickle"), "30000", "gpu=t4", cwd=tmp_path)
    assert oom.returncode == 1 and "torch.OutOfMemoryError: CUDA out of memory" in oom.stderr
    assert f'File "{SCRIPT}", line 13' in oom.stderr
    missing = run_cli("script", "nope.py", cwd=tmp_path)
    assert missing.returncode == 2 and missing.stderr.strip() == "harness: error: nope.py: no such script"
    bad = run_cli("script", str(SCRIPT), "gpu=nope", cwd=tmp_path)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "gpu" in bad.stderr


def test_a_script_stopped_by_ctrl_c_ends_with_130_its_own_frames_and_its_peaks_so_far(tmp_path):
    script = tmp_path / "long.py"
    script.write_text("import os, signal, torch\n"
                      "signal.signal(signal.SIGINT, signal.default_int_handler)  # (as Python's own, if ignored here)\n"
                      "x = torch.empty(2**28, device='cuda')  # 1 GiB\n"
                      "os.kill(os.getpid(), signal.SIGINT)\n"
                      "while True: pass\n")
    r = run_cli("script", str(script), cwd=tmp_path)
    assert r.returncode == 130, r.stderr
    frames = r.stderr.split("KeyboardInterrupt")[0]
    assert f'File "{script}", line' in frames and "harness/" not in frames
    assert "peak allocated 1.00 GiB" in r.stderr and "virtual A100" in r.stderr


def test_mixed_precision_with_grad_scaler_events_and_compile_runs_its_steps(capfd):
    """GradScaler reads its found-inf count (a stand-in 0: the optimizer steps, its state exists);
    CUDA events and streams do nothing; torch.compile runs eagerly and says so; the profiler
    profiles the host (asked for CUDA, the CPU build would warn at every op)."""
    run = run_script(REPO / "tests" / "scripts" / "amp_scaler.py", [], cards.by_key()["a100-80gb"], AllocSettings())
    out, err = capfd.readouterr()
    assert "CUDA used in profiler but not enabled" not in err
    assert run.exit_code == 0, run.error
    params = round_size(1024 * 1024 * 4) + round_size(1024 * 4)
    scaler = 2 * round_size(4)  # its scale and growth tracker, on the card
    expected = 3 * params + round_size(32 * 1024 * 4) + round_size(4) + scaler + 2 * CUBLAS_WORKSPACE_BYTES
    assert f"step 1 states 2 allocated {expected} ms 0.0" in out
    assert run.compiled and run.compiled[0].endswith("amp_scaler.py:8")


def test_host_work_has_values_and_the_default_device_is_honoured(capsys):
    """Indices drawn on the host are real (a batch sliced with them has its shape); a model built
    under set_default_device("cuda") is on the card; a large host tensor is shapes only, not counted."""
    run = run_script(REPO / "tests" / "scripts" / "host_batches.py", [], cards.by_key()["a100-80gb"], AllocSettings())
    out = capsys.readouterr().out
    assert run.exit_code == 0, run.error
    batch = round_size(8 * 64 * 8)
    assert f"batch (8, 64) {2 * batch}" in out
    embedded = 2 * batch + round_size(1000 * 64 * 4) + round_size(8 * 64 * 8) + round_size(8 * 64 * 64 * 4)
    assert f"embedded (8, 64, 64) {embedded} on the host {1 << 22}" in out
    assert run.value_reads == []  # every value read was of a real host tensor


def test_a_script_and_the_same_job_have_the_same_steady_peak(tmp_path, capsys):
    """tests/jobs/hf_llama.py as a Job (workload=custom) and as a plain script (built on the host,
    moved to the card): from step 2 on the card holds the same tensors, so the same peak."""
    point = train_point(precision="bf16", batch_size=2, seq_len=64).replace(
        workload=Workload(name="custom", steps=3, target="tests.jobs.hf_llama:build"), cwd=str(REPO))
    rec = run_sim(point, tmp_path)
    run = run_script(REPO / "tests" / "scripts" / "hf_llama_train.py", ["2", "64"], cards.by_key()["a100-80gb"],
                     AllocSettings())
    assert run.exit_code == 0, run.error
    peaks = [int(line.split()[-1]) for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert len(peaks) == 3 and peaks[1] == peaks[2] == rec["steady_peak_allocated_bytes"]


def test_a_trace_that_read_the_card_is_not_reused_for_another_card(tmp_path):
    """One trace serves every card - unless the job asked torch.cuda about the card."""
    def rec(target, card, name):
        point = train_point(precision="fp32").replace(
            workload=Workload(name="custom", steps=1, target=target), cwd=str(REPO), gpu=cards.by_key()[card],
            trace_cache=str(tmp_path / "cache"))
        (tmp_path / name).mkdir()
        return run_sim(point, tmp_path / name)

    big, small = rec("tests.jobs.sized_by_card:build", "a100-80gb", "a"), rec("tests.jobs.sized_by_card:build", "t4", "b")
    assert not small.get("trace_reused")
    assert big["peak_allocated_bytes"] - small["peak_allocated_bytes"] == 2 * (64 - 16) * 1024 * 4  # input and output
    again = rec("tests.jobs.sized_by_card:build", "t4", "c")
    assert again["trace_reused"] and again["peak_allocated_bytes"] == small["peak_allocated_bytes"]
    plain = [rec("tests.jobs.first_step_spike:build", card, f"p{i}") for i, card in enumerate(("a100-80gb", "t4"))]
    assert plain[1]["trace_reused"]  # it never asked: the card's trace is every card's


def test_the_script_verb_takes_a_setting_of_several_keys_as_pytorch_writes_it():
    from harness.cli.script import _card_and_settings, split_args

    conf = "max_split_size_mb:128,expandable_segments:True"
    script, args, ours = split_args(["train.py", "--steps", "2", f"allocator.conf={conf}", "gpu=t4"])
    assert (script, args) == ("train.py", ["--steps", "2"])
    card, settings, source = _card_and_settings(ours)
    assert card.name == "T4" and settings == AllocSettings.from_conf(conf) and settings.expandable_segments
    assert source is None  # allocator= given: not the environment's


# Three 3 MiB allocations: one large segment holds them (20 MiB by default, 64 under large_segment_size_mb:64)
_SEGMENTS = """
import os, sys, torch
how = sys.argv[1] if len(sys.argv) > 1 else ""
if how == "environ":
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "large_segment_size_mb:64"
if how == "before":
    torch.cuda.memory._set_allocator_settings("large_segment_size_mb:64")
x = [torch.empty(3 * 2**20, dtype=torch.uint8, device="cuda") for _ in range(3)]
print("reserved", torch.cuda.memory_reserved())
if how == "after":
    torch.cuda.memory._set_allocator_settings("large_segment_size_mb:64")
"""


@pytest.fixture
def segments(tmp_path, monkeypatch):
    """The script above, and a clean allocator environment (restored after: the script may set it)."""
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    path = tmp_path / "segments.py"
    path.write_text(_SEGMENTS)
    return path


def _script(capsys, *args) -> tuple[int, int | None, str]:
    """(exit code, the script's reserved bytes, what the harness said on stderr)."""
    from harness.cli.script import main

    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    reserved = [int(line.split()[1]) for line in out.splitlines() if line.startswith("reserved ")]
    return rc, reserved[0] if reserved else None, err


@pytest.mark.parametrize("env,reserved", [
    ({}, 20 * 2**20), ({"PYTORCH_ALLOC_CONF": "large_segment_size_mb:40"}, 40 * 2**20),
    ({"PYTORCH_CUDA_ALLOC_CONF": "large_segment_size_mb:64"}, 64 * 2**20),
    # torch reads the old name first (tests/test_alloc_conf.py checks it on torch 2.13)
    ({"PYTORCH_CUDA_ALLOC_CONF": "large_segment_size_mb:64", "PYTORCH_ALLOC_CONF": "large_segment_size_mb:40"},
     64 * 2**20)])
def test_a_script_runs_under_the_allocator_settings_of_its_environment(segments, monkeypatch, capsys, env, reserved):
    for name, conf in env.items():
        monkeypatch.setenv(name, conf)
    rc, got, said = _script(capsys, segments)
    assert (rc, got) == (0, reserved)
    assert ("(PYTORCH_CUDA_ALLOC_CONF)" in said) == ("PYTORCH_CUDA_ALLOC_CONF" in env)


def test_settings_a_script_sets_before_its_first_allocation_are_taken_and_after_it_refused(segments, monkeypatch,
                                                                                         capsys):
    assert _script(capsys, segments, "environ")[:2] == (0, 64 * 2**20)  # os.environ, as torch reads it then
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")  # (what the script set)
    assert _script(capsys, segments, "before")[:2] == (0, 64 * 2**20)  # _set_allocator_settings
    rc, got, said = _script(capsys, segments, "after")
    assert (rc, got) == (1, 20 * 2**20)
    assert f"{segments}:11" in said and "after the card's first allocation" in said


def test_allocator_given_stands_in_for_the_environments_and_a_bad_one_is_refused(segments, monkeypatch, capsys):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "large_segment_size_mb:64")
    rc, got, said = _script(capsys, segments, "allocator.conf=large_segment_size_mb:40")
    assert (rc, got) == (0, 40 * 2**20) and "stands in for PYTORCH_CUDA_ALLOC_CONF" in said
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:true")  # torch refuses it
    rc, got, said = _script(capsys, segments)
    assert (rc, got) == (2, None)
    assert said.startswith("harness: error: PYTORCH_CUDA_ALLOC_CONF: ") and said.count("\n") == 1


def test_a_traced_job_that_changes_the_allocators_settings_is_refused_at_its_line():
    """A sweep's replays run under the point's allocator.conf: a job of its own that sets others would
    be answered under the wrong ones. Setting the same ones changes nothing."""
    from harness.probe.jobs import UserCodeError
    from harness.probe.sim.tracker import StorageTracker
    from harness.probe.sim.virtual_cuda import LiveAllocator

    live = LiveAllocator(StorageTracker(), AllocSettings.from_conf("expandable_segments:True"), cards.by_key()["t4"])
    live.set_settings("expandable_segments:True")
    with pytest.raises(UserCodeError, match="test_script.py:.*large_segment_size_mb:64"):
        live.set_settings("large_segment_size_mb:64")


def test_a_scripts_recurrent_layer_is_said_to_be_traced_as_the_cpu_runs_it(tmp_path, capsys):
    """A GRU the script runs on the card: cuDNN's RNN on a GPU, its memory not modelled; the harness
    says which layer, where the script first called it, and what that means; a script without one
    hears nothing."""
    script = tmp_path / "gru.py"
    script.write_text("import torch\nrnn = torch.nn.GRU(16, 16, batch_first=True).cuda()\n"
                      "for _ in range(2):\n    rnn(torch.randn(2, 8, 16, device='cuda'))[0].sum().backward()\n")
    rc, _, said = _script(capsys, script)
    assert rc == 0 and f"GRU (first at {script}:4): a GPU runs these through cuDNN" in said
    assert said.count("through cuDNN") == 1  # once, however many calls
    script.write_text("import torch\nx = torch.randn(2, 8, 16, device='cuda')\n")
    assert "cuDNN" not in _script(capsys, script)[2]
