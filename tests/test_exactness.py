"""Where fake CPU tensors behave unlike eager CUDA, the virtual GPU does as eager CUDA does
(fidelity.md): dropout's mask, backward formulas that fill zeros in place, the cuBLAS workspace,
host tensors, and the windows a row's peaks are read over."""

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from harness.allocator.model import round_plain
from harness.config.point import Workload
from harness.probe.jobs import UserCodeError
from harness.probe.sim import cuda_emulation as cu
from harness.probe.sim.cuda_script import CARD_DEVICE, cuda_script_on_cpu
from harness.probe.sim.fake_code import module_conversion_on_fake_tensors
from harness.probe.sim.trace import run_point
from harness.probe.sim.tracker import CUBLAS_WORKSPACE_BYTES, StorageTracker
from harness.probe.worker import run_sim
from tests.conftest import REPO, train_point

MiB = 2**20


def _custom(target, steps=3, args=None, **kw):
    return train_point(**kw).replace(workload=Workload(name="custom", steps=steps, target=target, args=args or {}),
                                     cwd=str(REPO))


# ---- dropout --------------------------------------------------------------------------------

def test_dropout_keeps_a_bool_mask_for_backward_as_cuda_does():
    """CUDA's fused dropout keeps the output and a 1-byte mask; the CPU path a 4-byte noise tensor."""
    n = 1 << 20
    tr = StorageTracker(emulate_cublas_workspace=False)
    with FakeTensorMode(), cu.cuda_kernels(), tr:
        x = torch.randn(n, requires_grad=True)
        before = tr.allocated
        y = torch.nn.Dropout(0.1)(x)
        assert tr.allocated - before == 4 * n + n  # output (fp32) + bool mask
        y.sum().backward()
        tr.allocated  # noqa: B018 - the backward ran on the mask
        z = F.dropout(x, 0.1, training=False)
        assert z is x  # evaluation: nothing allocated, as on every device
    assert F.dropout is cu._original_dropout


# ---- backward formulas ----------------------------------------------------------------------

class _OutOfPlaceByHand(torch.autograd.Function):
    """A user's backward that fills zeros out of place: the code says so, eager CUDA does so."""

    @staticmethod
    def forward(ctx, x, idx):
        ctx.save_for_backward(idx)
        ctx.shape = x.shape
        return x.gather(1, idx)

    @staticmethod
    def backward(ctx, grad):
        (idx,) = ctx.saved_tensors
        return torch.zeros(ctx.shape).scatter_add(1, idx, grad), None


@pytest.mark.parametrize("op,copies", [
    (lambda x, i: x.gather(1, i), 2),
    (lambda x, i: x[:, i[0]], 2),
    (lambda x, i: x.index_select(1, i[0]), 2),
    (lambda x, i: x.take(i), 2),
    (lambda x, i: x.max(1)[0], 2),
    (lambda x, i: x.topk(3, 1)[0], 2),
    (lambda x, i: _OutOfPlaceByHand.apply(x, i), 3),
], ids=["gather", "index", "index_select", "take", "max", "topk", "custom_function"])
@pytest.mark.parametrize("script", [False, True], ids=["bare", "device_mode"])
def test_backward_formulas_fill_their_zeros_in_place_as_eager_cuda_does(op, copies, script):
    """Under any dispatch mode autograd's formulas take their out-of-place branch (one more
    input-sized tensor); eager CUDA takes the in-place one. At most x and its gradient are alive,
    the engine run inside a job's device mode too (cuda_script.backward_inside)."""
    tr = StorageTracker(emulate_cublas_workspace=False)
    with FakeTensorMode(), cuda_script_on_cpu(tr) if script else contextlib.nullcontext(), tr:
        x = torch.randn(64, 1000, requires_grad=True)
        idx = torch.randint(0, 1000, (64, 10))
        op(x, idx).sum().backward()
    size = 64 * 1000 * 4
    alive = most = 0
    for e in tr.events:
        if e.size == size:
            alive += 1 if e.action == "alloc" else -1
            most = max(most, alive)
    assert most == copies


# ---- cuBLAS workspace -----------------------------------------------------------------------

_GEMMS = {
    "mm": lambda a: torch.mm(a, a), "matmul": lambda a: a @ a, "linear": lambda a: F.linear(a, a),
    "addmm": lambda a: torch.addmm(a, a, a), "bmm": lambda a: torch.bmm(a[None], a[None]),
    "baddbmm": lambda a: torch.baddbmm(a[None], a[None], a[None]),
    "einsum": lambda a: torch.einsum("ij,jk->ik", a, a),
    "sdpa_math": lambda a: F.scaled_dot_product_attention(a[None, None], a[None, None], a[None, None]),
}


@pytest.mark.parametrize("grad_mode", ["inference_mode", "no_grad", "grad"])
@pytest.mark.parametrize("op", list(_GEMMS))
def test_every_gemm_issuing_op_allocates_the_cublas_workspace_once(op, grad_mode):
    mode = {"inference_mode": torch.inference_mode, "no_grad": torch.no_grad, "grad": contextlib.nullcontext}
    tr = StorageTracker()
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH), FakeTensorMode(), cu.cuda_kernels():
        a = torch.randn(64, 64, requires_grad=grad_mode == "grad")
        with mode[grad_mode](), tr:
            _GEMMS[op](a)
            _GEMMS[op](a)
    assert [e.size for e in tr.events if e.kind == "workspace"] == [CUBLAS_WORKSPACE_BYTES]


def test_a_matmul_on_host_tensors_allocates_no_workspace():
    tr = StorageTracker()
    with FakeTensorMode(), cuda_script_on_cpu(tr, default_host=True), tr:
        a = torch.randn(64, 64)
        a @ a
    assert tr.events == []


# ---- host tensors ---------------------------------------------------------------------------

@pytest.mark.parametrize("default_host", [False, True], ids=["job", "script"])
def test_host_tensors_are_not_device_memory(default_host):
    """Where a tensor lives follows the code: the default device (the card in a Job, the host in a
    script), device=, .to(), .cuda(), .cpu(); an op's output lives with its inputs."""
    n = MiB // 4  # 1 MiB of fp32
    tr = StorageTracker()
    with FakeTensorMode(allow_non_fake_inputs=True), module_conversion_on_fake_tensors(), \
            cuda_script_on_cpu(tr, default_host), tr:
        default = torch.zeros(n)
        host = torch.zeros(n, device="cpu")
        card = torch.zeros(n, device="cuda")
        assert tr.allocated == (1 if default_host else 2) * MiB
        assert default.device == (torch.device("cpu") if default_host else CARD_DEVICE)
        host * 2, host.cpu(), card.cpu()  # host tensors, made and dropped
        assert tr.allocated == (1 if default_host else 2) * MiB
        assert card.to("cuda") is card and card.cuda() is card  # already there: no copy
        moved = host.to("cuda")
        assert tr.allocated == (2 if default_host else 3) * MiB
        layer = torch.nn.Linear(256, 256, bias=False, device="cpu")
        layer.cuda()
        assert tr.allocated == (2 if default_host else 3) * MiB + 256 * 256 * 4
        layer.cpu()
        del moved, card
        assert tr.allocated == (0 if default_host else 1) * MiB
        on_card = torch.zeros(n, device="cuda")
        assert on_card.device == CARD_DEVICE and host.device == torch.device("cpu")
        before = tr.allocated
        torch.zeros(n, device=on_card.device), torch.zeros(n, device=host.device)  # where x is, as on CUDA
        assert tr.allocated == before
        like = [torch.zeros(n, device=on_card.device), torch.zeros(n, device=host.device)]
        assert tr.allocated - before == MiB and [t.device for t in like] == [CARD_DEVICE, torch.device("cpu")]


def test_a_dataset_kept_on_the_host_is_not_counted_in_a_jobs_peak():
    on_host, _ = run_point(_custom("tests.jobs.host_data:build", precision="fp32"))
    on_card, _ = run_point(_custom("tests.jobs.host_data:build", args={"on_host": False}, precision="fp32"))
    batch_copy = round_plain(2 * 256 * 4)  # each step's rows copied to the card
    assert on_card["peak_allocated_bytes"] - on_host["peak_allocated_bytes"] == 4096 * 256 * 4 - batch_copy


# ---- windows --------------------------------------------------------------------------------

def test_a_peak_in_step_one_is_the_whole_runs_and_the_steady_state_is_read_from_step_two(tmp_path):
    """All three peaks over one window each: the whole run (step 1's one-off table included) and
    the steady state; a Job with no model and no optimizer runs."""
    from tests.jobs.first_step_spike import SPIKE_BYTES

    rec = run_sim(_custom("tests.jobs.first_step_spike:build"), tmp_path)
    assert rec["model"] == "attention" and rec["status"] == "ok"
    assert rec["peak_step"] == 0
    assert rec["peak_allocated_bytes"] > SPIKE_BYTES > rec["steady_peak_allocated_bytes"]
    assert rec["peak_requested_bytes"] > SPIKE_BYTES > rec["steady_peak_requested_bytes"]
    assert rec["peak_reserved_bytes"] >= rec["peak_allocated_bytes"] >= rec["peak_requested_bytes"]
    assert rec["steady_peak_reserved_bytes"] >= rec["steady_peak_allocated_bytes"] >= rec["steady_peak_requested_bytes"]
    (tmp_path / "one").mkdir()
    one = run_sim(_custom("tests.jobs.first_step_spike:build", steps=1), tmp_path / "one")
    assert one["peak_allocated_bytes"] == rec["peak_allocated_bytes"]
    assert one["steady_peak_allocated_bytes"] is None and one["steady_peak_reserved_bytes"] is None


def test_a_job_with_an_optimizer_needs_two_steps():
    with pytest.raises(UserCodeError, match="workload.steps=1"):
        run_point(_custom("tests.jobs.host_data:build", steps=1))


def test_steps_is_checked_per_workload_before_anything_runs():
    from harness.config.point import TRAINING_STEPS_WHY
    from harness.errors import ConfigError

    with pytest.raises(ConfigError, match="workload.steps") as e:
        Workload(name="train", steps=1)
    assert TRAINING_STEPS_WHY.strip(" ()") in str(e.value)
    assert Workload(name="custom", steps=1, target="m:f").steps == 1  # a job without an optimizer may
    with pytest.raises(ConfigError, match="workload.steps"):
        Workload(name="custom", steps=0, target="m:f")


# ---- fused attention's own allocations --------------------------------------------------------

# One F.scaled_dot_product_attention call and its backward on an H200 (torch 2.11, cuDNN 9.19),
# laid out as transformers lays q, k, v out (B, S, H, D transposed), each backend pinned with
# sdpa_kernel: every allocation and free in order, from the memory history (.devrun/sdpa2.py in the
# issue note). Flash's forward splits the keys where B x H x S/64 is small against the card's SMs:
# a log-sum-exp and an output accumulator per split, after its output and log-sum-exp, freed as it
# returns (config.kernels.flash_splitkv_bytes; 1 x 1000 x 8: 2 splits, 1 x 2048 x 4: 2).
H200_ATTENTION = [
    ("cudnn", (2, 1024, 16, 16, 128), "a8 a8 a8388608 a131072 a256 f256 a8388608 a8388608 a8388608 a16908544 f16908544 "
                                      "f131072 f8 f8"),
    ("flash", (2, 1024, 16, 16, 128), "a8388608 a131072 a16 a8 a8388608 a8388608 a8388608 a131072 a16777216 f16777216 "
                                      "f131072 f131072 f16 f8"),
    ("cudnn", (1, 1000, 8, 8, 64), "a8 a8 a1024000 a32000 a256 f256 a1024000 a1024000 a1024000 a2080256 f2080256 "
                                   "f32000 f8 f8"),
    ("flash", (1, 1000, 8, 8, 64), "a1024000 a32000 a64000 a4096000 a16 a8 f64000 f4096000 a1024000 a1024000 "
                                   "a1024000 a32768 a2097152 f2097152 f32768 f32000 f16 f8"),
    ("cudnn", (2, 512, 32, 8, 128), "a8 a8 a8388608 a131072 a256 f256 a8388608 a2097152 a2097152 a33685760 f33685760 "
                                    "f131072 f8 f8"),
    ("flash", (2, 512, 32, 8, 128), "a8388608 a131072 a16 a8 a8388608 a2097152 a2097152 a131072 a16777216 a8388608 "
                                    "a8388608 f8388608 f8388608 f16777216 f131072 f131072 f16 f8"),
    ("cudnn", (1, 2048, 4, 4, 80), "a8 a8 a1310720 a32768 a256 f256 a1310720 a1310720 a1310720 a2654464 f2654464 "
                                   "f32768 f8 f8"),
    ("flash", (1, 2048, 4, 4, 80), "a1310720 a32768 a65536 a6291456 a16 a8 f65536 f6291456 a1310720 a1310720 "
                                   "a1310720 a32768 a3145728 f3145728 f32768 f32768 f16 f8"),
    ("cudnn", (3, 384, 12, 4, 96), "a8 a8 a2654208 a55296 a256 f256 a2654208 a884736 a884736 a10672384 f10672384 "
                                   "f55296 f8 f8"),
    ("flash", (3, 384, 12, 4, 96), "a2654208 a55296 a16 a8 a2654208 a884736 a884736 a55296 a5308416 a2654208 "
                                   "a2654208 f2654208 f2654208 f5308416 f55296 f55296 f16 f8"),
]


@pytest.mark.parametrize("kernel,shape,measured", H200_ATTENTION,
                         ids=[f"{k}-{'x'.join(map(str, s))}" for k, s, _ in H200_ATTENTION])
def test_fused_attention_allocates_what_it_does_on_an_h200(kernel, shape, measured):
    """cuDNN (the H200's own choice for bf16) and flash (an A100's, pinned here as on the card):
    outputs, saved tensors and each kernel's scratch, in the order the card's allocator saw them."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from harness.config import cards, kernels

    b, s, h, hk, d = shape
    pinned = SDPBackend.CUDNN_ATTENTION if kernel == "cudnn" else SDPBackend.FLASH_ATTENTION
    tr = StorageTracker(emulate_cublas_workspace=False, geometry=kernels.geometry(cards.by_key()["h200"]))
    with FakeTensorMode(), cu.cuda_kernels((9, 0)), tr, sdpa_kernel([pinned]):
        xq = torch.randn(b, s, h * d, dtype=torch.bfloat16, requires_grad=True)
        xk, xv = (torch.randn(b, s, hk * d, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
        q, k, v = (x.view(b, s, -1, d).transpose(1, 2) for x in (xq, xk, xv))
        g = torch.randn(b, s, h * d, dtype=torch.bfloat16)
        start = len(tr.events)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=h != hk)
        out.transpose(1, 2).reshape(b, s, h * d).backward(g)  # out lives on, as on the card
        # (0 B: a placeholder for the split-KV accumulators of cards that split where the H200 does not)
        seen = " ".join(f"{e.action[0]}{e.size}" for e in tr.events[start:] if e.size)
    assert seen == measured


# Each layer's memory-efficient attention backward in demo-1b's fp32 history on an H200 (B 2 x H 16 x
# 1024 x 128, tests/data/snapshots/h200-demo1b-fp32.events.json.gz, 16 layers x 2 steps): q's, k's and
# v's gradients, grad_out x out and its sum (fp32: the kernel does not compute delta), delta, the
# workspace for the query gradient's accumulators (the 128-row kernel: 8 x 2 blocks of 16 + 32,768 B a
# head), then delta and the workspace go
H200_EFFICIENT_BACKWARD = ("a16777216 a16777216 a16777216 a16777216 a131072 a131072 f131072 f16777216 a16785408 "
                           "f131072 f16785408")


def test_the_memory_efficient_backward_allocates_what_demo_1bs_fp32_layers_did_on_an_h200():
    """The fp32 forward keeps its output and log-sum-exp on the card (its philox seed and offset on the
    host); the backward makes delta from three tensors and a workspace (config.kernels), as each of
    the history's 32 attention backwards did."""
    import gzip
    import json

    from harness.config import cards, kernels

    with gzip.open(REPO / "tests" / "data" / "snapshots" / "h200-demo1b-fp32.events.json.gz", "rt") as f:
        history = " ".join(f"{a[0]}{n}" for a, _, n, _ in json.load(f)["events"] if a in ("alloc", "free_requested"))
    assert history.count(H200_EFFICIENT_BACKWARD) == 32
    b, s, h, d = 2, 1024, 16, 128
    tr = StorageTracker(emulate_cublas_workspace=False, geometry=kernels.geometry(cards.by_key()["h200"]))
    with FakeTensorMode(), cu.cuda_kernels((9, 0)), tr:
        q, k, v = (torch.randn(b, s, h * d, requires_grad=True).view(b, s, h, d).transpose(1, 2) for _ in range(3))
        g = torch.randn(b, s, h * d)
        start = len(tr.events)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        forward = " ".join(f"{e.action[0]}{e.size}" for e in tr.events[start:])
        start = len(tr.events)
        out.transpose(1, 2).reshape(b, s, h * d).backward(g)
        backward = " ".join(f"{e.action[0]}{e.size}" for e in tr.events[start:])
    assert forward == "a16777216 a131072"
    assert backward == H200_EFFICIENT_BACKWARD + " f131072"  # (then the log-sum-exp it saved)


def test_the_memory_efficient_backwards_workspace_follows_the_kernel_the_card_launches():
    """The kernel's rows of queries a block: 128 where a block may take A100-class shared memory
    and the head dim is over 64, else 64 (Turing's kernels, sm86/89/12x's 99 KB, small head dims).
    16-bit calls compute delta in the kernel, and where their kernel cannot keep the key and value
    gradients in registers accumulate them in the workspace per split of the keys; ROCm's AOTriton
    allocates delta alone, and only where its fused backward does not run."""
    from harness.config import cards, kernels
    from harness.config.attention import FusedShape

    def parts(key, shape):
        return kernels.efficient_backward_bytes(shape, kernels.geometry(cards.by_key()[key]))

    fp32 = FusedShape(2, 16, 16, 1024, 1024, 128, 128, 4)
    assert parts("h200", fp32) == (16777216, 131072, 131072, 16785408)
    assert parts("a100-80gb", fp32) == parts("b200", fp32) == parts("h200", fp32)
    per_head_64 = 16 * 2 * (16 + 64 * 64 * 4)  # 16 x 2 blocks of 64 rows x 64 columns
    assert parts("rtx4090", fp32)[3] == parts("t4", fp32)[3] == parts("rtx5090", fp32)[3] == 32 * per_head_64
    small = FusedShape(2, 16, 16, 1024, 1024, 64, 64, 4)
    assert parts("h200", small)[3] == parts("t4", small)[3] == 32 * 16 * (16 + 64 * 64 * 4)
    # 16-bit: delta in the kernel. On an H200 the 128 x 128 kernel keeps dK and dV in registers: the
    # query gradient's tiles alone, 8 blocks of rows x 1 of columns a head
    half = fp32._replace(esize=2)
    assert parts("h200", half) == (0, 0, 131072, 32 * 8 * (16 + 128 * 128 * 4))
    # a T4's 64 x 64 kernel for head dim 128 keeps them in fp32 accumulators too, 64 keys x 128 each
    # for each split of the keys: 16 blocks of keys, at most 200 // (B x H) = 6 splits
    assert parts("t4", half)[3] == parts("l4", half)[3] == 32 * (per_head_64 + 6 * 64 * (128 + 128) * 4)
    # B x H = 512 fill the card and the keys (128) are at most two blocks: one split
    wide = half._replace(b=32, s_q=128, s_k=128)
    assert parts("t4", wide)[3] == 512 * (2 * 2 * (16 + 64 * 64 * 4) + 64 * 256 * 4)
    # head dim 80 in 16-bit: the 128 x 64 kernel only sm86 and sm89 dispatch (in registers, 2 columns
    # of 64); the 128 x 128 one for head dims to 128 on an A100; a T4's 64 x 64 one, 2 columns and
    # 128-wide accumulators (80 aligned to 64 rows)
    d80 = half._replace(d=80, d_v=80)
    assert parts("l4", d80)[3] == parts("a10g", d80)[3] == 32 * 8 * 2 * (16 + 128 * 64 * 4)
    assert parts("a100-80gb", d80)[3] == 32 * 8 * (16 + 128 * 128 * 4)
    assert parts("t4", d80)[3] == 32 * (16 * 2 * (16 + 64 * 64 * 4) + 6 * 64 * (128 + 128) * 4)
    assert parts("mi300x", half) == (0, 0, 131072, 0)
    assert parts("mi300x", fp32) == (0, 0, 131072, 0) and parts("mi300x", small._replace(s_q=256, s_k=256)) == (0,) * 4
    code = kernels.efficient_code(fp32, 3)
    assert kernels.scratch_bytes(code, kernels.geometry(cards.by_key()["l4"])) == 32 * per_head_64


# ---- reductions' own allocations ---------------------------------------------------------------

# x.sum(0) on an H200 (132 SMs) for a contiguous (rows, cols) x, and for bf16 x.float().sum(0) too:
# every allocation and free in order, from the memory history (.devrun/sdpa2.py in stop 38's note).
# Reduce.cuh splits a long column sum across blocks: a staging buffer and a semaphore per output block.
H200_COLUMN_SUMS = [
    ((2048, 2048), torch.bfloat16, "a4096 a33554432 a64 f64 f33554432 a16777216 a8192 a33554432 a64 f64 f33554432 "
                                   "f16777216"),
    ((2048, 2048), torch.float32, "a8192 a33554432 a64 f64 f33554432"),
    ((8192, 4096), torch.bfloat16, "a8192 a138412032 a128 f128 f138412032 a134217728 a16384 a138412032 a128 f128 "
                                   "f138412032 f134217728"),
    ((512, 2048), torch.bfloat16, "a4096 a4194304 a8192 f4194304"),
    ((2048, 512), torch.float32, "a2048 a8388608 a16 f16 f8388608"),
    ((32768, 4096), torch.bfloat16, "a8192 a138412032 a128 f128 f138412032 a536870912 a16384 a138412032 a128 f128 "
                                    "f138412032 f536870912"),
    ((1024, 64), torch.float32, "a256"),
    ((4096, 11008), torch.bfloat16, "a22016 a140902400 a344 f344 f140902400 a180355072 a44032 a140902400 a344 f344 "
                                    "f140902400 f180355072"),
]


@pytest.mark.parametrize("shape,dtype,measured", H200_COLUMN_SUMS,
                         ids=[f"{'x'.join(map(str, s))}-{str(d)[6:]}" for s, d, _ in H200_COLUMN_SUMS])
def test_a_column_sum_allocates_what_it_does_on_an_h200(shape, dtype, measured):
    from harness.config import cards, kernels

    tr = StorageTracker(emulate_cublas_workspace=False, geometry=kernels.geometry(cards.by_key()["h200"]))
    with FakeTensorMode(), tr:
        x = torch.randn(*shape, dtype=dtype)
        start = len(tr.events)
        y = x.sum(0)
        z = x.float().sum(0) if dtype != torch.float32 else None  # (both live on, as they did)
        # (a launch the H200 splits over no blocks but another card would: a 0-B placeholder, no allocation)
        seen = " ".join(f"{e.action[0]}{e.size}" for e in tr.events[start:] if e.size)
    assert seen == measured
    assert y.shape == shape[1:] and (z is None or z.dtype == torch.float32)


def test_a_launch_only_other_cards_split_is_judged_on_them_as_their_own_trace_does():
    """RMSNorm's weight gradient over 512 tokens of 4096 (x.sum(0), bf16): an A100 (108 SMs) reduces
    each output in one block, an MI300X (304 CUs) stages 256 MiB across blocks. The A100's trace
    holds the launch as a 0-B placeholder that no replay on the A100 sees, and the MI300X's rows from
    it are those of a trace taken on the MI300X."""
    from harness.config import cards, kernels
    from harness.probe.sim.per_card import Sized
    from harness.record import trace_store

    def traced(key: str):
        tr = StorageTracker(emulate_cublas_workspace=False, geometry=kernels.geometry(cards.by_key()[key]))
        with FakeTensorMode(), tr:
            x = torch.randn(512, 4096, dtype=torch.bfloat16)
            x.sum(0)
        return trace_store.to_frame(tr.events)

    a100, mi300x = (cards.by_key()[k] for k in ("a100-80gb", "mi300x"))
    on_a100, on_mi300x = traced("a100-80gb"), traced("mi300x")
    placeholders = on_a100[on_a100["size"] == 0]
    assert list(placeholders["action"]) == ["alloc", "alloc", "free", "free"]
    allocs = placeholders[placeholders["action"] == "alloc"]
    assert allocs["kernel"].str.startswith("reduce:").all() and placeholders["allocated"].sum() == 0
    assert 0 not in [r.size for r in trace_store.replay_rows(on_a100)]
    assert trace_store.storages_peak(on_a100) == 512 * 4096 * 2 + 8192  # the input and the sum only
    staged = [r.size for r in trace_store.replay_rows(on_mi300x) if r.size not in (512 * 4096 * 2, 8192)]
    assert staged[0] == 256 * 2**20
    def alike(rows):  # keys by first appearance (a storage's key is its address in this process)
        order: dict = {}
        return [(r.action, order.setdefault(r.key, len(order)), r.size, r.tag, r.stream) for r in rows]

    sized = Sized(on_a100)
    assert alike(sized.rows(mi300x)) == alike(trace_store.replay_rows(on_mi300x))
    assert alike(sized.rows(a100)) == alike(trace_store.replay_rows(on_a100))
    assert sized.shift(mi300x)[0] >= 256 * 2**20
    assert alike(trace_store.replay_rows(trace_store.sized_for(on_a100, mi300x))) == alike(
        trace_store.replay_rows(on_mi300x))


def test_a_reductions_scratch_follows_the_cards_sms_and_unknown_ones_take_the_most():
    """RMSNorm's weight gradient over 8192 tokens of 4096: as many blocks an output as the card's SMs
    fill (an A100's 108: fewer than an H200's 132), a T4 (40 SMs, 1024 threads each) fewer still."""
    from harness.config import cards, kernels

    r = kernels.Reduction(4, 4096, 8192, False, 1, 4)
    by = {k: kernels.reduce_buffers(r, kernels.geometry(cards.by_key()[k]))[0] for k in ("t4", "a100-80gb", "h200")}
    assert by["t4"] < by["a100-80gb"] < by["h200"] == 138412032
    assert kernels.reduce_buffers(r, kernels.ANY_CARD)[0] >= by["h200"]


def test_a_gemms_output_comes_before_its_handles_workspace():
    """An H200's history: the first GEMM's product (the rotary embedding's 262,144 B), then the
    cuBLAS workspace the handle makes at that call."""
    tr = StorageTracker(workspace_bytes=33554432)
    with FakeTensorMode(), tr:
        a, b = torch.randn(64, 32), torch.randn(32, 1024)
        tr.set_phase("forward")
        start = len(tr.events)
        _ = a @ b
        seen = [(e.size, e.kind) for e in tr.events[start:]]
    assert seen == [(262144, "activation"), (33554432, "workspace")]


# ---- the embedding's backward -------------------------------------------------------------------

def _embedding_backward(card: str, tokens: int, rows: int, width: int, dtype=torch.bfloat16, scale=False):
    """The allocations of one nn.Embedding's weight gradient on `card`'s virtual GPU, in order."""
    from harness.config import cards, kernels

    tr = StorageTracker(emulate_cublas_workspace=False, geometry=kernels.geometry(cards.by_key()[card]))
    with FakeTensorMode(), tr:
        weight = torch.randn(rows, width, dtype=dtype, requires_grad=True)
        ids = torch.randint(0, rows, (tokens,))
        out = F.embedding(ids, weight, scale_grad_by_freq=scale)
        ones = torch.ones_like(out)
        start = len(tr.events)
        (grad,) = torch.autograd.grad(out, weight, ones)
        seen = [(e.action, e.size, e.kernel) for e in tr.events[start:] if e.size]
    assert grad.shape == (rows, width)
    return seen


def test_an_embedding_backward_past_3072_indices_sorts_them_and_sums_each_run_as_cudas_kernel_does():
    """Embedding.cu and EmbeddingBackwardKernel.cu: up to 3,072 indices one kernel makes the gradient
    and nothing else; past that the sort before it (sorted indices, their positions, the range they
    are sorted by and CUB's storage, freed as it returns) and each run's bookkeeping and the partial
    sums after it (fp32 for bf16: 8,192 tokens of a 4,096-wide 32,000-row table take 9,011 partial
    runs, 147,636,224 B), all freed as it returns, last first."""
    from harness.config import embedding_kernels as ek

    assert _embedding_backward("h200", 3072, 32000, 4096) == [("alloc", 32000 * 4096 * 2, "")]
    seen = _embedding_backward("h200", 8192, 32000, 4096)
    n = 8192 * 8
    sort = ek.radix_sort_pairs_bytes(8192, 8, 8)
    assert sort == 16384 + 3072 + 65536 + 65536 + 256 + 255  # histograms, lookback, keys, values, counters
    e = ek.EmbeddingBackward(8192, 32000, 4096, 2, 8, False)
    partial_sums = ("alloc", 9011 * 4096 * 4, ek.code(e, 2))
    assert partial_sums[1] == 147636224
    allocs = [(a, s) for a, s, _ in seen if a == "alloc"]
    assert allocs == [("alloc", s) for s in (
        n, n, n, sort, 32000 * 4096 * 2, n, 8, n, ek.tile_states_bytes(8192), n, n, ek.tile_states_bytes(8192), 8,
        (819 + 8192) * 8, partial_sums[1])]
    assert partial_sums in seen
    frees = [s for a, s, _ in seen if a == "free"]
    assert frees[:2] == [sort, n]  # the sort's storage, then the range
    assert frees[-9:] == [partial_sums[1], (819 + 8192) * 8, 8, n, n, 8, n, n, n]
    assert len(frees) == len(allocs) - 1  # all but the gradient


def test_an_embedding_backwards_sum_is_the_cards_and_deterministic_algorithms_take_the_two_pass_one():
    """The atomic sum where the two-pass sum's grid (a block a row here) would leave the SMs idle and
    the partial runs outnumber it 4 to 1: 120 rows of 64 over 4,096 tokens are atomic on an H200 (132
    SMs: 528 blocks) and a T4 (160), two-pass on an RTX 3060 (28 SMs: 112); the atomic sum's map and
    fp32 gradient where the two-pass sum makes its partial sums. Each card's bytes from one code."""
    from harness.config import cards, kernels
    from harness.config import embedding_kernels as ek

    e = ek.EmbeddingBackward(4096, 120, 64, 2, 8, False)
    atomic, two_pass = (529 * 8, 120 * 64 * 4, 0), (0, 0, 529 * 64 * 4)
    for card, expected in (("h200", atomic), ("t4", atomic), ("rtx3060-12gb", two_pass)):
        g = kernels.geometry(cards.by_key()[card])
        assert tuple(kernels.scratch_bytes(ek.code(e, part), g) for part in range(3)) == expected, card
    seen = _embedding_backward("h200", 4096, 120, 64)
    assert [s for a, s, c in seen if c.startswith(ek.CODE_PREFIX)] == [529 * 8, 120 * 64 * 4]
    torch.use_deterministic_algorithms(True)
    try:
        seen = _embedding_backward("h200", 4096, 120, 64)
    finally:
        torch.use_deterministic_algorithms(False)
    assert [s for a, s, c in seen if c.startswith(ek.CODE_PREFIX)] == [529 * 64 * 4]


def test_an_embedding_backward_scaled_by_frequency_counts_each_index_even_under_3072():
    """scale_grad_by_freq takes the sort at any count: each index's count after it, with two scans."""
    from harness.config import embedding_kernels as ek

    seen = _embedding_backward("a100-80gb", 1000, 32000, 256, dtype=torch.float32, scale=True)
    allocs = [s for a, s, _ in seen if a == "alloc"]
    assert allocs[:8] == [8000, 8000, 8000, ek.radix_sort_pairs_bytes(1000, 8, 8), 8000, ek.tile_states_bytes(1000),
                          ek.tile_states_bytes(1000), 32000 * 256 * 4]
    assert allocs[-1] == (100 + 1000) * 256 * 4  # fp32's partial sums in fp32


def test_an_embedding_backwards_sum_judged_on_another_card_is_that_cards_own_trace():
    """An RTX 3060 (28 SMs) sums 120 rows of 64 over 4,096 tokens in two passes where an H200 sums
    them atomically: the 3060's trace holds the atomic sum's two allocations as 0-B placeholders,
    and its rows sized for the H200 are those of the H200's own trace."""
    from harness.config import cards, kernels
    from harness.record import trace_store

    def traced(key: str):
        tr = StorageTracker(emulate_cublas_workspace=False, geometry=kernels.geometry(cards.by_key()[key]))
        with FakeTensorMode(), tr:
            weight = torch.randn(120, 64, dtype=torch.bfloat16, requires_grad=True)
            out = F.embedding(torch.randint(0, 120, (4096,)), weight)
            torch.autograd.grad(out, weight, torch.ones_like(out))
        return trace_store.to_frame(tr.events)

    def alike(rows):  # keys by first appearance (a storage's key is its address in this process)
        order: dict = {}
        return [(r.action, order.setdefault(r.key, len(order)), r.size, r.tag, r.stream) for r in rows]

    on_3060, on_h200 = traced("rtx3060-12gb"), traced("h200")
    placeholders = on_3060[(on_3060["size"] == 0) & (on_3060["action"] == "alloc")]
    assert placeholders["kernel"].str.startswith("embbwd:").sum() == 2
    h200 = cards.by_key()["h200"]
    assert alike(trace_store.replay_rows(trace_store.sized_for(on_3060, h200))) == alike(
        trace_store.replay_rows(on_h200))


# ---- clip_grad_norm_ ----------------------------------------------------------------------------

def _clipped(shapes, dtype=torch.bfloat16, emulate=True):
    """The allocations of clip_grad_norm_ over gradients of `shapes` ("a<bytes>"/"f<bytes>") on the
    virtual GPU, CUDA's kernels emulated (or not)."""
    from harness.probe.sim.cuda_emulation import cuda_kernels

    def clip():
        params = [torch.nn.Parameter(torch.randn(s, dtype=dtype)) for s in shapes]
        for p in params:
            p.grad = torch.randn_like(p)
        return params, lambda: torch.nn.utils.clip_grad_norm_(params, 1.0)

    tr = StorageTracker(emulate_cublas_workspace=False)
    with FakeTensorMode(), tr, cuda_kernels() if emulate else contextlib.nullcontext():
        _params, call = clip()
        start = len(tr.events)
        _total = call()  # (held, as a caller holds it)
        return [f"{e.action[0]}{e.size}" for e in tr.events[start:] if e.size]


def test_clip_grad_norm_takes_one_foreach_norm_with_its_chunks_partial_norms_as_cuda_does():
    """A CUDA tensor takes torch's foreach path, a FakeTensor the for-loop (a vector norm and its
    reduction's scratch each): on the virtual GPU one _foreach_norm, whose kernel first makes a
    partial norm per 65,536-element chunk of the largest gradient for every gradient (fp32 for
    bf16: 3 x 2,000 x 4 B for a 32,000 x 4,096 embedding's), then the norms, and frees them as it
    returns (ForeachReduceOp.cu)."""
    from harness.config import cards, kernels
    from harness.probe.sim import kernel_scratch

    shapes = [(32000, 4096), (11008, 4096), (4096,)]
    chunks = -(-32000 * 4096 // kernel_scratch.FOREACH_CHUNK)
    assert chunks == 2000
    seen = _clipped(shapes)
    assert seen[:5] == [f"a{3 * chunks * 4}", "a2", "a2", "a2", f"f{3 * chunks * 4}"]
    assert sum(1 for s in seen if s == f"a{3 * chunks * 4}") == 1
    loop = _clipped(shapes, emulate=False)  # a vector norm each: their norms apart
    assert loop[0] == "a2" and f"a{3 * chunks * 4}" not in loop
    # fp32 gradients: fp32 partial norms and norms
    assert _clipped([(70000,), (10,)], dtype=torch.float32)[:4] == ["a16", "a4", "a4", "f16"]
    # the kernel's slow path (an order other than 1, 2 and inf; tensors of two dtypes): no chunks
    args, g = [torch.empty(70000), torch.empty(10)], kernels.geometry(cards.by_key()["h200"])
    assert kernel_scratch.of(torch.ops.aten._foreach_norm.Scalar, (args, 3), {}, g) == []
    assert kernel_scratch.of(torch.ops.aten._foreach_norm.Scalar,
                             ([args[0], torch.empty(10, dtype=torch.float64)], 2), {}, g) == []
    assert kernel_scratch.of(torch.ops.aten._foreach_norm.Scalar, (args, float("inf"), torch.float64), {}, g) == [
        kernel_scratch.Scratch(2 * 2 * 8, "", early=True)]
