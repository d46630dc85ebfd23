"""The cuda path on a real GPU (scripts/gpu-check.sh runs these): a small model trained for a few
steps, an OOM provoked under an emulated small card, a snapshot replayed exactly, calibrate on two
points, a user's job run for real. Skipped, with the reason, where no GPU is visible."""

import json

import pandas as pd
import pytest

from harness.config import cards as catalog
from harness.launch import gpus
from tests.conftest import run_cli

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not gpus.visible_devices(), reason="needs a CUDA GPU (none visible here)")]

GiB, MiB = 1024**3, 1024**2


def _native_card() -> str | None:
    import torch

    name = torch.cuda.get_device_name(0)
    return next((c.key for c in catalog.cards() if c.device_name == name), None)


def _rows(out) -> pd.DataFrame:
    return pd.read_parquet(next(out.glob("**/results.parquet")))


def _figures(tag: str, row) -> None:
    """What the closing note needs, in the test log."""
    keys = ("status", "device_name", "peak_allocated_bytes", "peak_reserved_bytes", "peak_requested_bytes",
            "num_alloc_retries", "num_ooms", "step_time_s", "tokens_per_s", "measured_non_pytorch_bytes",
            "oom_phase", "oom_step", "oom_tried_bytes", "oom_allowed_bytes", "oom_verdict", "error")
    print(f"\n[gpu-check] {tag}: " + json.dumps({k: row.get(k) for k in keys}, default=str))


def test_a_small_model_trains_on_the_card_with_every_reading(tmp_path):
    card = _native_card()
    args = ["run", "model=tiny", "backend=cuda", "workload.steps=4", f"results_dir={tmp_path}"]
    r = run_cli(*args, *([f"gpu={card}"] if card else []))
    assert r.returncode == 0, r.stderr
    row = _rows(tmp_path).iloc[0].to_dict()
    _figures("tiny train", row)
    assert row["status"] == "ok" and row["backend"] == "cuda"
    assert row["emulated_gpu"] == (card is None)
    assert 0 < row["peak_allocated_bytes"] <= row["peak_reserved_bytes"]
    assert row["peak_requested_bytes"] <= row["peak_allocated_bytes"]
    assert len(row["step_allocated_bytes"]) == len(row["step_times_s"]) == 4
    assert row["step_time_s"] > 0 and row["tokens_per_s"] > 0
    assert row["measured_non_pytorch_bytes"] > 0  # the CUDA context at least
    assert row["params_bytes"] > 0 and row["optimizer_bytes"] == 2 * row["params_bytes"]  # AdamW: two moments


def test_the_allocator_takes_the_settings_asked_for(tmp_path):
    r = run_cli("sweep", "sweeps=smoke", "batch_size=2", "seq_len=64", "backend=cuda",
                "allocator=default,expandable,max_split_512", f"results_dir={tmp_path}")
    df = _rows(tmp_path)
    assert r.returncode == 0, r.stderr + str(df[["allocator_conf", "error"]])
    assert list(df["status"]) == ["ok"] * 3  # a setting the allocator ignored would be an error row


def test_an_oom_under_an_emulated_small_card_is_a_row_with_its_numbers(tmp_path):
    # A 1 GiB card: 512 MiB for PyTorch; the virtual GPU predicts 0.83 GiB allocated, OOM in forward.
    r = run_cli("run", "model=tiny", "backend=cuda", "batch_size=32", "seq_len=2048", "gpu=t4",
                "gpu.memory_bytes=1073741824", f"results_dir={tmp_path}")
    assert r.returncode == 0, r.stderr  # an OOM is data, not a failure
    row = _rows(tmp_path).iloc[0].to_dict()
    _figures("provoked OOM", row)
    assert row["status"] == "oom" and row["emulated_gpu"]
    assert row["num_ooms"] >= 1 and row["oom_phase"] == "forward"
    assert row["oom_tried_bytes"] > 0 and row["oom_allowed_bytes"] == pytest.approx(512 * MiB, abs=10 * MiB)
    assert row["peak_reserved_bytes"] <= 512 * MiB
    assert row["kind"] in ("activations", "fragmentation") and row["fits_cards"].tolist() == []


def test_an_emulated_t4_attends_as_a_t4_would(tmp_path):
    """bf16 on a T4 takes the math path (config.attention); a T4 emulated on a bigger card has each
    call pinned to it, and holds the B x H x S x S scores."""
    r = run_cli("run", "model=tiny", "backend=cuda", "batch_size=2", "seq_len=2048", "gpu=t4",
                f"results_dir={tmp_path}")
    assert r.returncode == 0, r.stderr
    row = _rows(tmp_path).iloc[0].to_dict()
    _figures("emulated T4, bf16 attention", row)
    if not row["emulated_gpu"]:
        pytest.skip("this GPU is a T4: nothing is emulated")
    assert row["status"] == "ok"
    assert {c["kernel"] for c in json.loads(row["attention_calls"])} == {"math"}
    assert row["peak_allocated_bytes"] >= 2 * 4 * 2048 * 2048 * 2  # one layer's scores in bf16 at least


def test_a_snapshot_replays_exactly_through_the_allocator_model(tmp_path):
    r = run_cli("run", "model=tiny", "backend=cuda", "snapshot=true", f"results_dir={tmp_path}")
    assert r.returncode == 0, r.stderr
    row = _rows(tmp_path).iloc[0]
    replay = run_cli("replay", row["snapshot_path"], "--json")
    assert replay.returncode == 0, replay.stderr
    out = json.loads(replay.stdout)
    print(f"\n[gpu-check] snapshot replay: {json.dumps({k: out[k] for k in out if k != 'ooms'})}")
    assert out["allocs_address_matched"] == out["allocs_total"] > 0
    assert out["segments_matched"] == out["segments_total"]
    assert out["reserved_matched"] == out["reserved_checked"]
    assert out["final_layout_matched"]
    assert out["peak_reserved_bytes"] == row["peak_reserved_bytes"]


def test_calibrate_compares_two_points(tmp_path):
    r = run_cli("calibrate", "sweeps=smoke", "batch_size=1,4", "seq_len=256", f"results_dir={tmp_path}")
    print(r.stdout[-4000:])
    assert r.returncode == 0, r.stderr
    df = pd.read_parquet(next(tmp_path.glob("**/calibration.parquet")))
    for row in df.to_dict("records"):
        print(f"[gpu-check] calibrate: {json.dumps(row, default=str)}")
    assert len(df) == 2 and df["status_agrees"].all()
    # the bar: within max(0.1%, 256 KiB) of the card (an emulated A100 on a newer card included:
    # its cuBLAS workspaces are the A100's)
    off = (df["predicted_allocated_bytes"] - df["measured_allocated_bytes"]).abs()
    assert (off <= (0.001 * df["measured_allocated_bytes"]).clip(lower=256 * 1024)).all(), off.tolist()


def test_a_users_job_runs_for_real_with_its_value_reads(tmp_path):
    r = run_cli("sweep", "sweeps=smoke", "workload=custom",
                "workload.target=examples.gpt:build,tests.jobs.item_in_step:build",
                "batch_size=4", "seq_len=128", "backend=cuda", f"results_dir={tmp_path}")
    df = _rows(tmp_path)
    assert r.returncode == 0, r.stderr + str(df[["workload_target", "error"]])
    assert list(df["status"]) == ["ok", "ok"]  # .item() is fine on a card
    # the job names itself as on the virtual GPU
    virtual = run_cli("run", "workload=custom", "workload.target=examples.gpt:build", "batch_size=4", "seq_len=128",
                      "backend=sim", f"results_dir={tmp_path / 'sim'}")
    assert virtual.returncode == 0, virtual.stderr
    named = df.set_index("workload_target")["model"]
    assert named["examples.gpt:build"] == _rows(tmp_path / "sim").iloc[0]["model"]


def test_a_side_streams_blocks_are_reused_as_on_the_virtual_gpu(tmp_path):
    """tests/scripts/side_stream.py on the card and on the virtual GPU: the same readings (a block
    freed on a side stream is reused on that stream only)."""
    import subprocess
    import sys

    from tests.conftest import REPO
    from tests.test_script import SIDE_STREAM, side_stream_readings

    real = subprocess.run([sys.executable, str(SIDE_STREAM)], capture_output=True, text=True, cwd=REPO)
    assert real.returncode == 0, real.stderr
    virtual = run_cli("script", str(SIDE_STREAM), cwd=tmp_path)
    assert virtual.returncode == 0, virtual.stderr
    print("\n[gpu-check] side stream: " + json.dumps(side_stream_readings(real.stdout)))
    assert side_stream_readings(real.stdout) == side_stream_readings(virtual.stdout)


# A program of allocations (MiB; frees by index) whose reserved bytes follow the large segment size:
# requests of 1-10 MiB, one over 10, freed and asked again
_SEGMENT_PROGRAM = [("alloc", 3), ("alloc", 5), ("alloc", 9), ("free", 1), ("alloc", 12), ("alloc", 2), ("free", 0),
                    ("alloc", 7)]
_SEGMENT_RUN = """
import json, sys, torch
program, MiB, live, reserved = json.loads(sys.argv[1]), 1024**2, [], []
for action, n in program:
    if action == "alloc":
        live.append(torch.empty(n * MiB, dtype=torch.uint8, device="cuda"))
    else:
        live[n] = None
    reserved.append(torch.cuda.memory_reserved())
print(json.dumps(reserved))
"""


@pytest.mark.parametrize("conf", ["large_segment_size_mb:40", "large_segment_size_mb:64,max_split_size_mb:64",
                                  "expandable_segments:True,large_segment_size_mb:32"])
def test_a_large_segment_size_reserves_on_the_card_what_the_model_reserves(conf):
    """torch 2.13's large_segment_size_mb: the segment a 1-10 MiB request makes (and an expandable
    segment's page) on the card, against the allocator model's replay of the same requests."""
    import os
    import subprocess
    import sys

    from harness.allocator.model import CachingAllocator, Device
    from harness.allocator.settings import AllocSettings

    env = {**os.environ, "PYTORCH_ALLOC_CONF": conf, "PYTORCH_CUDA_ALLOC_CONF": conf}
    real = subprocess.run([sys.executable, "-c", _SEGMENT_RUN, json.dumps(_SEGMENT_PROGRAM)], capture_output=True,
                          text=True, env=env)
    assert real.returncode == 0, real.stderr
    model, live, modelled = CachingAllocator(AllocSettings.from_conf(conf), Device()), [], []
    for action, n in _SEGMENT_PROGRAM:
        if action == "alloc":
            live.append(model.malloc(n * MiB))
        else:
            model.free(live[n])
        modelled.append(model.stats.reserved_bytes.current)
    print(f"\n[gpu-check] {conf}: reserved after each request {json.loads(real.stdout)}")
    assert json.loads(real.stdout) == modelled


@pytest.mark.parametrize("conf,taken", [
    ("release_lock_on_cudamalloc:True,graph_capture_record_stream_reuse:False", True),
    ("pinned_num_register_threads:8,pinned_reserve_segment_size_mb:64,pinned_free_catch_all:True", True),
    ("per_process_memory_fraction:0.9,throw_on_cudamalloc_oom:False", True),
    ("large_segment_size_mb:40,pinned_max_cached_size_mb:100", True),
    ("pinned_num_register_threads:3", False), ("per_process_memory_fraction:1.5", False),
    ("expandable_segments:true", False), ("bogus_key:1", False)])
def test_cudas_own_parser_takes_what_the_harness_takes(conf, taken):
    """The CUDA-only keys, which a CPU build of torch does not check (tests/test_alloc_conf.py holds the
    common ones to it): the card's first allocation under each setting."""
    import os
    import subprocess
    import sys

    from harness.config import alloc_conf
    from harness.errors import ConfigError

    env = {**os.environ, "PYTORCH_ALLOC_CONF": conf, "PYTORCH_CUDA_ALLOC_CONF": conf}
    real = subprocess.run([sys.executable, "-c", "import torch; torch.empty(1, device='cuda')"], capture_output=True,
                          text=True, env=env)
    try:
        alloc_conf.parse(conf)
        harness_takes = True
    except ConfigError:
        harness_takes = False
    assert (real.returncode == 0, harness_takes) == (taken, taken), real.stderr[-400:]


@pytest.mark.parametrize("spread", ["workload.steps=3 parallel.dp_shard=4", "workload.steps=3 parallel.tp=2",
                                    "workload=infer workload.new_tokens=4 checkpointing=false parallel.tp=2"],
                         ids=["fsdp2", "tp", "tp-serving"])
def test_rank_0_on_the_card_its_peers_faked_allocates_what_the_virtual_gpus_rank_0_does(tmp_path, spread):
    """One card plays rank 0 of a job over several (tests/scripts/fake_peers.py: torch's fake group
    for its peers, as the virtual GPU has): its shards, FSDP2's buffers on their own streams or tensor
    parallel's slices (training, or serving under inference_mode), decided by the real caching
    allocator. The virtual GPU's rank 0 within the bar on allocated; reserved printed for the note."""
    import subprocess
    import sys

    from tests.conftest import REPO

    card = _native_card() or "a100-80gb"
    args = ["run", "model=demo-1b", "batch_size=2", "seq_len=1024", "precision=bf16", f"gpu={card}", *spread.split()]
    r = run_cli(*args, "backend=sim", f"results_dir={tmp_path / 'sim'}")
    assert r.returncode == 0, r.stderr
    sim = _rows(tmp_path / "sim").iloc[0].to_dict()
    assert sim["status"] == "ok", sim.get("error")
    (tmp_path / "cuda").mkdir()
    real = subprocess.run([sys.executable, str(REPO / "tests" / "scripts" / "fake_peers.py"),
                           str(next((tmp_path / "sim").glob("**/point.json"))), str(tmp_path / "cuda")],
                          capture_output=True, text=True, cwd=REPO)
    assert real.returncode == 0, real.stderr[-4000:]
    row = json.loads(real.stdout.strip().splitlines()[-1])
    keys = ("peak_allocated_bytes", "peak_reserved_bytes", "params_bytes", "grads_bytes", "optimizer_bytes")
    print(f"\n[gpu-check] rank 0 of {spread} (peers faked): real " + json.dumps(row, default=str)
          + " sim " + json.dumps({k: sim.get(k) for k in keys}, default=str))
    assert row["status"] == "ok", row.get("error")
    measured = row["peak_allocated_bytes"]
    assert abs(sim["peak_allocated_bytes"] - measured) <= max(0.001 * measured, 256 * 1024)

def _two_gpus() -> bool:
    return len(gpus.visible_devices()) >= 2


@pytest.mark.skipif(not _two_gpus(), reason="needs 2 GPUs: NCCL puts no two ranks on one device")
def test_a_job_over_two_gpus_runs_as_two_nccl_ranks_and_the_virtual_gpu_predicts_each(tmp_path):
    """FSDP2 over 2 cards: one row, rank 0's or the larger's, with each rank's peaks; the virtual
    GPU's rank (one process, a fake group) within 2.5% of each real rank's allocated peak."""
    args = ["run", "model=tiny", "batch_size=2", "seq_len=64", "parallel.dp_shard=2", "workload.steps=4"]
    r = run_cli(*args, "backend=cuda", f"results_dir={tmp_path / 'cuda'}")
    assert r.returncode == 0, r.stderr
    real = _rows(tmp_path / "cuda").iloc[0].to_dict()
    _figures("fsdp2 over 2 gpus", real)
    assert real["status"] == "ok" and len(real["rank_peak_allocated_bytes"]) == 2
    assert real["measured_non_pytorch_bytes"] > 0  # the context and NCCL's communicator
    r = run_cli(*args, "backend=sim", f"results_dir={tmp_path / 'sim'}")
    sim = _rows(tmp_path / "sim").iloc[0].to_dict()
    print(f"[gpu-check] fsdp2 over 2: sim allocated {sim['peak_allocated_bytes']}, "
          f"real {list(real['rank_peak_allocated_bytes'])}")
    for measured in real["rank_peak_allocated_bytes"]:
        assert abs(sim["peak_allocated_bytes"] - measured) <= 0.025 * measured


def _history_of(call) -> str:
    """The card's allocations and frees while `call()` runs ("a<bytes> f<bytes> ..."), its result
    held until the history is taken."""
    import torch

    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=1000)
    out = call()
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    del out
    return " ".join(f"{e['action'][0]}{e['size']}" for e in snap["device_traces"][0]
                    if e["action"] in ("alloc", "free_requested"))


@pytest.mark.parametrize("batch,heads,kv_heads,keys", [(1, 32, 8, 1021), (4, 32, 8, 8192), (1, 16, 16, 3000)])
def test_a_flash_decode_step_allocates_its_split_kv_accumulators_as_the_virtual_gpu_says(batch, heads, kv_heads,
                                                                                         keys):
    """One query over a KV cache (Llama-3-8B's grouped heads, and heads alike), flash pinned: the card's
    memory history of the call (its output, log-sum-exp, split-KV accumulators, RNG state) is the
    virtual GPU's on this card's SMs (config.kernels.flash_splitkv_bytes)."""
    import torch
    import torch.nn.functional as F
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from harness.config import kernels
    from harness.probe.sim import cuda_emulation as cu
    from harness.probe.sim.tracker import StorageTracker

    props = torch.cuda.get_device_properties(0)
    if props.major < 8:
        pytest.skip("flash attention needs sm80 or newer")
    d = 128

    def call(device=None):
        q = torch.randn(batch, heads, 1, d, dtype=torch.bfloat16, device=device)
        k, v = (torch.randn(batch, kv_heads, keys, d, dtype=torch.bfloat16, device=device) for _ in range(2))
        return q, k, v

    q, k, v = call("cuda")
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        real = _history_of(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=heads != kv_heads))

    g = kernels.Geometry(props.multi_processor_count, kernels.threads_per_multiprocessor((props.major, props.minor)))
    tr = StorageTracker(emulate_cublas_workspace=False, geometry=g)
    with FakeTensorMode(), cu.cuda_kernels((props.major, props.minor)), tr, sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        q, k, v = call()
        start = len(tr.events)
        out = F.scaled_dot_product_attention(q, k, v, enable_gqa=heads != kv_heads)  # (kept, as above)
        virtual = " ".join(f"{e.action[0]}{e.size}" for e in tr.events[start:])
        del out
    print(f"\n[gpu-check] flash decode {batch}x{heads}/{kv_heads}x{keys}: real {real} | virtual {virtual}")
    assert real == virtual


def test_an_fp32_call_over_grouped_heads_takes_the_kernel_and_memory_the_virtual_gpu_says():
    """fp32 queries over grouped key/value heads with enable_gqa, as transformers passes them without a
    mask, every backend enabled: torch 2.13's memory-efficient kernel refuses grouped heads, so the
    card takes the math path (config.attention.efficient_takes_grouped); the card's memory history
    of the forward is the virtual GPU's."""
    import torch
    import torch.nn.functional as F
    from torch._subclasses.fake_tensor import FakeTensorMode

    from harness.config import attention
    from harness.probe.sim import cuda_emulation as cu
    from harness.probe.sim.tracker import StorageTracker

    props = torch.cuda.get_device_properties(0)
    b, heads, kv_heads, s, d = 2, 8, 2, 512, 64

    def call(device=None):
        q = torch.randn(b, heads, s, d, device=device, requires_grad=True)
        k, v = (torch.randn(b, kv_heads, s, d, device=device, requires_grad=True) for _ in range(2))
        return q, k, v

    q, k, v = call("cuda")
    real = _history_of(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))

    tr = StorageTracker(emulate_cublas_workspace=False)
    with FakeTensorMode(), cu.cuda_kernels((props.major, props.minor)), tr:
        q, k, v = call()
        start = len(tr.events)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # (kept, as above)
        virtual = " ".join(f"{e.action[0]}{e.size}" for e in tr.events[start:])
        del out
    chosen = attention.kernel((props.major, props.minor), attention.call_of(q, k, v, is_causal=True, enable_gqa=True))
    print(f"\n[gpu-check] fp32 grouped {b}x{heads}/{kv_heads}x{s}: {chosen}; real {real} | virtual {virtual}")
    assert real == virtual


@pytest.mark.parametrize("tokens,rows,width,deterministic", [(3072, 32000, 4096, False), (8192, 32000, 4096, False),
                                                             (4096, 120, 64, False), (4096, 120, 64, True)])
def test_an_embedding_backward_allocates_what_the_virtual_gpu_says(tokens, rows, width, deterministic):
    """nn.Embedding's weight gradient in bf16 (config.embedding_kernels): the card's memory history of
    the call is the virtual GPU's on this card's SMs, but for CUB's storage (allocated and freed at
    once), whose size the model estimates: within 16 KiB each."""
    import torch
    import torch.nn.functional as F
    from torch._subclasses.fake_tensor import FakeTensorMode

    from harness.config import kernels
    from harness.probe.sim.tracker import StorageTracker

    def call(device=None):
        weight = torch.randn(rows, width, dtype=torch.bfloat16, device=device, requires_grad=True)
        ids = torch.randint(0, rows, (tokens,), device=device)
        out = F.embedding(ids, weight)
        return out, weight, torch.ones_like(out)

    def transient(seq: list[str]) -> list[bool]:  # allocated and freed at once (CUB's storage), and its free
        at_once = [s[0] == "a" and i + 1 < len(seq) and seq[i + 1] == "f" + s[1:] for i, s in enumerate(seq)]
        return [a or (i > 0 and at_once[i - 1]) for i, a in enumerate(at_once)]

    props = torch.cuda.get_device_properties(0)
    torch.use_deterministic_algorithms(deterministic)
    try:
        out, weight, ones = call("cuda")
        real = _history_of(lambda: torch.autograd.grad(out, weight, ones)).split()
        g = kernels.Geometry(props.multi_processor_count, kernels.threads_per_multiprocessor((props.major, props.minor)))
        tr = StorageTracker(emulate_cublas_workspace=False, geometry=g)
        with FakeTensorMode(), tr:
            out, weight, ones = call()
            start = len(tr.events)
            grad = torch.autograd.grad(out, weight, ones)  # (kept, as above)
            virtual = [f"{e.action[0]}{e.size}" for e in tr.events[start:] if e.size]
            del grad
    finally:
        torch.use_deterministic_algorithms(False)
    print(f"\n[gpu-check] embedding backward {tokens}x{rows}x{width} det={deterministic}: real {' '.join(real)} | "
          f"virtual {' '.join(virtual)}")
    assert len(real) == len(virtual)
    for r, v, estimated in zip(real, virtual, transient(virtual), strict=True):
        assert r[0] == v[0]
        assert abs(int(r[1:]) - int(v[1:])) <= (16384 if estimated else 0), (r, v)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_clip_grad_norm_allocates_what_the_virtual_gpu_says(dtype):
    """clip_grad_norm_ over a 7B layer's gradients and an embedding's (one _foreach_norm: its chunks'
    partial norms, then the norms; the total and the clip after): the card's memory history of the
    call is the virtual GPU's, byte for byte (probe.sim.kernel_scratch._foreach_norm)."""
    import torch

    from tests.test_exactness import _clipped

    shapes = [(32000, 4096), (11008, 4096), (4096, 4096), (4096,)]
    on = getattr(torch, dtype)
    params = [torch.nn.Parameter(torch.randn(s, dtype=on, device="cuda")) for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p)
    real = _history_of(lambda: torch.nn.utils.clip_grad_norm_(params, 1.0)).split()
    virtual = _clipped(shapes, dtype=on)
    print(f"\n[gpu-check] clip_grad_norm_ {dtype}: real {' '.join(real)} | virtual {' '.join(virtual)}")
    assert real == virtual
