"""Diagnosis: an OOM message's verdict, the kind of a run's peak, a snapshot's kind and shape."""

import json
from pathlib import Path

import pytest

from harness.analysis.kinds import kind, shape, with_kinds
from harness.analysis.oom_text import diagnose
from harness.record.results import to_frame
from tests.conftest import run_cli

SHARED = Path(__file__).resolve().parent / "data"
GiB, MiB = 1024**3, 1024**2


def _shared_messages() -> dict[str, str]:
    out = {}
    for block in (SHARED / "oom-messages.txt").read_text().split("\n\n"):
        name = [ln[3:] for ln in block.splitlines() if ln.startswith("#>")]
        text = " ".join(ln for ln in block.splitlines() if ln and not ln.startswith("#"))
        if name and text:
            out[name[0]] = text
    return out


MESSAGES = _shared_messages()


@pytest.mark.parametrize("name,verdict", [
    ("1.x (cached)", "capacity"),  # 10.62 of 11.17 GiB allocated: 0.13 GiB headroom at best
    ("1.x-2.0", "capacity"),
    ("2.0 with a per-process fraction", "capacity"),  # 15.20 + 2 GiB > 16 GiB allowed
    ("2.1 (note the misspelling)", "fragmentation"),  # 3.43 GiB cached, 2.5 GiB headroom once cured
    ("2.2-2.7", "capacity"),  # 650 MiB cached, but only 0.5 GiB headroom on 79 GiB
    ("2.2-2.7, another process on the card", "other_process"),
    ("2.2-2.7, CUDA graphs in private pools, per-process fraction", "fragmentation"),
    ("2.8+ (newer documentation link), nothing free", "fragmentation"),  # 17.66 GiB cached
])
def test_shared_messages_get_the_right_verdict(name, verdict):
    assert diagnose(MESSAGES[name]).verdict == verdict


def test_every_number_is_parsed_within_rounding():
    r = diagnose(MESSAGES["2.2-2.7, another process on the card"])
    assert r.tried_bytes == 4 * GiB and abs(r.capacity_bytes - 23.55 * GiB) <= 0.005 * GiB
    assert abs(r.free_bytes - 2.81 * GiB) <= 0.005 * GiB and abs(r.process_bytes - 11.60 * GiB) <= 0.005 * GiB
    assert abs(r.other_processes_bytes - 9.12 * GiB) <= 0.005 * GiB
    assert abs(r.allocated_bytes - 10.45 * GiB) <= 0.005 * GiB
    assert abs(r.reserved_unallocated_bytes - 711.35 * MiB) <= 0.005 * MiB
    old = diagnose(MESSAGES["2.0 with a per-process fraction"])
    assert old.allowed_bytes == 16 * GiB and old.tried_bytes == 2 * GiB
    assert diagnose(MESSAGES["2.8+ (newer documentation link), nothing free"]).free_bytes == 0


@pytest.mark.parametrize("text,verdict", [
    # github.com/kerrj/lerf/issues/73 (2.1): 4.84 GiB cached on a 24 GiB card
    ("torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 3.00 GiB. GPU 0 has a total capacty of "
     "23.65 GiB of which 1.66 GiB is free. Including non-PyTorch memory, this process has 20.81 GiB memory in use. "
     "Of the allocated memory 12.09 GiB is allocated by PyTorch, and 4.84 GiB is reserved by PyTorch but "
     "unallocated.", "fragmentation"),
    # github.com/Zheng-Chong/CatVTON/issues/133: a 36 GiB request on a T4
    ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 36.00 GiB. GPU 0 has a total capacity of "
     "14.56 GiB of which 10.22 GiB is free. Including non-PyTorch memory, this process has 4.11 GiB memory in use. "
     "Process 17435 has 240.00 MiB memory in use. Of the allocated memory 3.72 GiB is allocated by PyTorch, and "
     "264.21 MiB is reserved by PyTorch but unallocated.", "capacity"),
    # github.com/AlphaGPU/leetgpu-challenges/issues/52: "Process 1" is the process itself, in a container
    ("CUDA out of memory. Tried to allocate 7.45 GiB. GPU 0 has a total capacity of 14.56 GiB of which 3.24 GiB "
     "is free. Process 1 has 11.32 GiB memory in use. Of the allocated memory 8.40 GiB is allocated by PyTorch, "
     "and 2.80 GiB is reserved by PyTorch but unallocated.", "capacity"),
    # github.com/mahmoodlab/Patch-GCN/issues/28 (4090, old wording): 2.3 GiB cached, still capacity
    ("RuntimeError: CUDA out of memory. Tried to allocate 2.92 GiB (GPU 0; 23.65 GiB total capacity; 19.63 GiB "
     "already allocated; 188.56 MiB free; 21.93 GiB reserved in total by PyTorch)", "capacity"),
    # github.com/QwenLM/Qwen3-VL/issues/1046 (T4)
    ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 6.10 GiB. GPU 0 has a total capacity of "
     "14.57 GiB of which 4.17 GiB is free. Including non-PyTorch memory, this process has 10.40 GiB memory in "
     "use. Of the allocated memory 10.23 GiB is allocated by PyTorch, and 44.39 MiB is reserved by PyTorch but "
     "unallocated.", "capacity"),
])
def test_real_messages_from_public_reports(text, verdict):
    assert diagnose(text).verdict == verdict


def test_diagnose_stdin_prints_one_json_object():
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "harness", "diagnose", "-", "--json"], input=MESSAGES["2.1 (note the misspelling)"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    for key in ("verdict", "tried_bytes", "capacity_bytes", "free_bytes", "allocated_bytes",
                "reserved_unallocated_bytes", "process_bytes", "non_pytorch_bytes", "reasoning"):
        assert key in out
    assert out["verdict"] == "fragmentation" and "expandable_segments" in out["reasoning"]
    old = subprocess.run([sys.executable, "-m", "harness", "diagnose", "-", "--json"], input=MESSAGES["1.x-2.0"],
                         capture_output=True, text=True)
    assert json.loads(old.stdout)["process_bytes"] is None  # the old wording has none


def test_diagnose_stdin_rejects_what_is_not_an_oom():
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "harness", "diagnose", "-"], input="hello", capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.startswith("harness: error: stdin:")


def test_diagnose_reads_an_oom_message_saved_to_a_file_and_refuses_broken_json(tmp_path):
    saved = tmp_path / "my_oom.txt"
    saved.write_text(MESSAGES["2.1 (note the misspelling)"])
    r = run_cli("diagnose", str(saved), "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["verdict"] == "fragmentation"
    broken = tmp_path / "result.json"
    broken.write_text('{"status": "ok"')
    r = run_cli("diagnose", str(broken))
    assert r.returncode == 2 and str(broken) in r.stderr and len(r.stderr.splitlines()) == 1
    (tmp_path / "notes.txt").write_text("hello")
    r = run_cli("diagnose", str(tmp_path / "notes.txt"))
    assert r.returncode == 2 and str(tmp_path / "notes.txt") in r.stderr


def _record(**kw):
    rec = {"status": "oom", "workload": "train", "gpu_memory_bytes": 16 * GiB, "gpu_non_pytorch_bytes": 0,
           "params_bytes": 2 * GiB, "optimizer_bytes": 4 * GiB, "peak_allocated_bytes": 10 * GiB,
           "peak_reserved_bytes": 11 * GiB, "step_allocated_bytes": [8 * GiB] * 3,
           "step_peak_bytes": [10 * GiB] * 3}
    rec.update(kw)
    return rec


@pytest.mark.parametrize("rec,expected", [
    (_record(status="ok"), "fits"),
    (_record(params_bytes=6 * GiB, optimizer_bytes=12 * GiB, peak_allocated_bytes=30 * GiB), "static"),
    (_record(peak_allocated_bytes=20 * GiB, peak_reserved_bytes=21 * GiB), "activations"),
    (_record(peak_allocated_bytes=15 * GiB, peak_reserved_bytes=17 * GiB), "fragmentation"),
    (_record(step_allocated_bytes=[8 * GiB, 9 * GiB, 10 * GiB, 11 * GiB]), "retained"),
])
def test_a_run_is_named_by_the_memory_that_decides_its_peak(rec, expected):
    assert kind(rec).kind == expected


def test_timeline_shapes():
    assert shape([8, 8, 8], [8, 8, 8], True).shape == "plateau"
    assert shape([8 * GiB] * 3, [20 * GiB] * 3, True).shape == "spike"
    assert shape([8 * GiB, 9 * GiB, 10 * GiB, 11 * GiB], [12 * GiB] * 4, True).shape == "staircase"


def test_results_carry_a_kind_column():
    df = to_frame(with_kinds([
        _record(status="ok", model="m", precision="bf16", checkpointing=False, batch_size=1, seq_len=8),
        _record(peak_allocated_bytes=20 * GiB, model="m", precision="bf16", checkpointing=False, batch_size=2, seq_len=8)]))
    assert list(df["kind"]) == ["fits", "activations"]


@pytest.mark.parametrize("path", sorted((SHARED / "snapshots").glob("*.pickle")), ids=lambda p: p.stem)
def test_diagnose_names_a_snapshots_kind_shape_and_sites(path):
    r = run_cli("diagnose", str(path), "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["kind"] in ("static", "activations", "fragmentation", "retained")
    assert out["shape"] in ("spike", "staircase", "plateau")
    assert out["peak_sites"] and out["peak_sites"][0]["bytes"] > 0
    assert sum(s["bytes"] for s in out["peak_sites"]) <= out["peak_requested_bytes"]


# 2.2+ wording: 13.4 GiB of the card is neither free nor this process's nor a listed process's.
_HELD_OUTSIDE = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity "
                 "of 23.65 GiB of which 256.00 MiB is free. Including non-PyTorch memory, this process has 10.00 GiB "
                 "memory in use. Of the allocated memory 9.50 GiB is allocated by PyTorch, and 204.00 MiB is reserved "
                 "by PyTorch but unallocated. If reserved but unallocated memory is large try setting "
                 "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.")


def test_memory_the_message_leaves_unaccounted_is_held_outside_not_headroom():
    r = diagnose(_HELD_OUTSIDE)
    assert r.verdict == "other_process" and "held_outside" in r.rules
    assert abs(r.unlisted_bytes - (23.65 * GiB - 256 * MiB - 10 * GiB)) <= 0.01 * GiB
    # what this process could have is free + its reserve, not the card less its context
    assert abs(r.limit_bytes - (256 * MiB + 9.50 * GiB + 204 * MiB)) <= 0.02 * GiB


def test_fragmentation_needs_cached_memory_that_could_serve_the_request():
    judged = [diagnose(t) for t in [*MESSAGES.values(), _HELD_OUTSIDE]]
    frags = [r for r in judged if r.verdict == "fragmentation"]
    assert len(frags) >= 3
    for r in frags:  # the cache it holds, with the free memory, serves the request with real headroom
        assert r.reserved_unallocated_bytes + r.free_bytes >= r.tried_bytes + r.margin_bytes - 0.02 * GiB


@pytest.mark.parametrize("torch_version,conf,name", [
    ("2.7.1+cu126", "expandable_segments:True", "PYTORCH_CUDA_ALLOC_CONF"),
    ("2.8.0", "expandable_segments:True", "PYTORCH_ALLOC_CONF"),
    ("2.9.1+cu128", "expandable_segments:True", "PYTORCH_CUDA_ALLOC_CONF"),  # pytorch/pytorch#183387
    ("2.9.1+cu128", "max_split_size_mb:512", "PYTORCH_ALLOC_CONF"),
    ("2.13.0+cpu", "expandable_segments:True", "PYTORCH_ALLOC_CONF"),
])
def test_allocator_advice_names_the_variable_the_users_torch_reads(torch_version, conf, name):
    from harness.config.alloc_conf import env_name
    from harness.report.words import change

    assert env_name(torch_version, conf) == name
    assert change({"kind": "allocator", "value": conf}, torch_version).startswith(f"{name}=")


def test_a_pasted_message_is_advised_the_variable_it_names():
    text = MESSAGES["2.1 (note the misspelling)"]
    named = "PYTORCH_CUDA_ALLOC_CONF" if "PYTORCH_CUDA_ALLOC_CONF" in text else "PYTORCH_ALLOC_CONF"
    assert diagnose(text).alloc_conf_env == named
    assert diagnose(_HELD_OUTSIDE).alloc_conf_env == "PYTORCH_CUDA_ALLOC_CONF"


def _rows_on_disk(tmp_path: Path) -> Path:
    """A sweep dir of two runs of one job: on one GPU, and one GPU's share of it over 8 (FSDP2)."""
    common = dict(model="m", batch_size=1, seq_len=8, precision="bf16", checkpointing=False, gpu="A100 80GB")
    for i, parallel in enumerate([{}, {"world_size": 8, "dp_shard": 8, "dp_replicate": 1, "tp": 1}]):
        (tmp_path / "runs" / str(i)).mkdir(parents=True)
        (tmp_path / "runs" / str(i) / "result.json").write_text(json.dumps(_record(run_id=str(i), **common, **parallel)))
    return tmp_path


def test_diagnose_tells_a_jobs_share_over_several_gpus_from_the_job_on_one(tmp_path):
    """Runs of one job over other GPU counts read alike but for their figures: each says how many
    GPUs its figures are one of, and how the job is spread over them."""
    r = run_cli("diagnose", str(_rows_on_disk(tmp_path)), "--json")
    assert r.returncode == 0, r.stderr
    assert {(o["gpus"], o["layout"]) for o in json.loads(r.stdout)} == {(1, None), (8, "FSDP2")}


def test_output_whose_reader_went_away_ends_without_a_traceback(tmp_path):
    """`harness diagnose <dir> | head -1`: the pipe closes under it; exit 141 (SIGPIPE's), no traceback."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "harness", "diagnose", str(_rows_on_disk(tmp_path))],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=Path(__file__).resolve().parents[1])
    proc.stdout.close()  # before it writes: its first line meets a closed pipe
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141 and "Traceback" not in err, err


def test_diagnose_tells_runs_of_one_job_under_other_allocator_settings_and_leaks_apart(tmp_path):
    """A sweep of one job under two allocator settings, with and without a leak: each run's line
    says which it is (the lines read alike in pairs before), as the report's labels do."""
    common = dict(model="m", batch_size=1, seq_len=8, precision="bf16", checkpointing=False, gpu="T4")
    variants = [("", "none"), ("expandable_segments:True", "none"), ("", "graph"), ("expandable_segments:True", "graph")]
    for i, (conf, leak) in enumerate(variants):
        (tmp_path / "runs" / str(i)).mkdir(parents=True)
        (tmp_path / "runs" / str(i) / "result.json").write_text(
            json.dumps(_record(run_id=str(i), allocator_conf=conf, leak=leak, **common)))
    r = run_cli("diagnose", str(tmp_path))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 4 and len({ln.split(" on ", 1)[0] for ln in lines}) == 4
    out = {(o["allocator_conf"], o["leak"]): o["label"] for o in json.loads(run_cli("diagnose", str(tmp_path),
                                                                                     "--json").stdout)}
    assert "alloc=expandable_segments:True leak=graph" in out["expandable_segments:True", "graph"]
