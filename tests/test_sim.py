"""The virtual GPU: faithful to real execution, and to what eager CUDA would allocate."""

import dataclasses
import gc

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from harness.config.point import Workload
from harness.probe.sim import autocast_kernels
from harness.probe.sim import cuda_emulation as cu
from harness.probe.sim.trace import run_point
from harness.probe.sim.tracker import CUBLAS_WORKSPACE_BYTES, StorageTracker
from tests.conftest import train_point


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("checkpointing", [False, True, "op"])
def test_tiny_fake_trace_equals_real_cpu_execution_byte_for_byte(precision, checkpointing):
    """Same steps, same tracker: fake tensors and real CPU tensors give the same trace and peak
    (op: checkpointing_policy=op, what it keeps and recomputes alike)."""
    point = train_point(precision=precision, checkpointing=bool(checkpointing))
    point = point.replace(checkpointing_policy="op" if checkpointing == "op" else "full")
    fake, tf = run_point(point, emulate_cuda=False, fake=True)
    real, tr = run_point(point, emulate_cuda=False, fake=False)
    assert fake["peak_allocated_bytes"] == real["peak_allocated_bytes"]
    assert fake["step_allocated_bytes"] == real["step_allocated_bytes"]
    assert [e[1:2] + e[3:] for e in tf.events] == [e[1:2] + e[3:] for e in tr.events]


def test_tiny_infer_fake_equals_real():
    point = train_point().replace(workload=Workload(name="infer", steps=1, new_tokens=4))
    fake, _ = run_point(point, emulate_cuda=False, fake=True)
    real, _ = run_point(point, emulate_cuda=False, fake=False)
    assert fake["peak_allocated_bytes"] == real["peak_allocated_bytes"] > 0


def _phase_peak_temporaries(tracker, phase):
    """Largest sum of live `temporary` bytes during `phase` from step 2 on (step 1 creates
    the optimizer state, tagged temporary until that step ends)."""
    live, cur, peak = {}, 0, 0
    for e in tracker.events:
        action, key, size, kind, ph, st = e.action, e.key, e.size, e.kind, e.phase, e.step
        if action == "alloc":
            live[key] = (size, kind)
            if kind == "temporary" and ph == phase and st >= 1:
                cur += size
                peak = max(peak, cur)
        else:
            size, kind = live.pop(key, (0, ""))
            if kind == "temporary":
                cur = max(0, cur - size)
    return peak


def test_foreach_adamw_sqrt_temporaries_of_every_parameter_appear():
    """CUDA's default foreach AdamW holds _foreach_sqrt(exp_avg_sq) for all parameters at once;
    the for-loop path fake tensors would pick holds one parameter's worth."""
    point = train_point(model="tiny")
    m, tr = run_point(point)
    params = m["params_bytes"]
    assert _phase_peak_temporaries(tr, "optimizer") >= 0.99 * params
    point = point.replace(optimizer=dataclasses.replace(point.optimizer, impl="forloop"))
    m2, tr2 = run_point(point)
    assert _phase_peak_temporaries(tr2, "optimizer") < 0.5 * params


def test_the_optimizers_allocations_are_charged_to_their_parameters_modules():
    """Each allocation of the optimizer's step names the module of the parameter it is for (its
    state; a foreach op's output i, its lists' parameter i): what AdamW's first step keeps of a
    module is its two moments, twice the module's parameters."""
    from harness.config.models import hf_config, on_meta

    point = train_point(model="tiny", precision="bf16")
    _, tr = run_point(point)
    owns = {name: sum(p.numel() * 2 for p in mod.parameters(recurse=False))  # (bf16: 2 B an element)
            for name, mod in on_meta(hf_config(point.model)).named_modules()}
    owns = {name: nbytes for name, nbytes in owns.items() if nbytes}
    assert {e.module for e in tr.events if e.phase == "optimizer" and e.action == "alloc"} == set(owns)
    kept: dict[int, tuple[str, int]] = {}
    for e in tr.events:
        if e.step == 0 and e.action == "alloc" and e.phase == "optimizer":
            kept[e.key] = (e.module, e.size)
        elif e.step == 0 and e.action == "free":
            kept.pop(e.key, None)
    state: dict[str, int] = {}
    for module, size in kept.values():
        state[module] = state.get(module, 0) + size
    assert state == {name: 2 * nbytes for name, nbytes in owns.items()}


@pytest.mark.parametrize("checkpointing", [False, True])
def test_backwards_allocations_are_charged_to_the_module_whose_forward_made_them(checkpointing):
    """Backward names the module whose forward made the autograd node running (a checkpoint's
    recompute: the module recomputed): each Linear's weight gradient is charged to that Linear,
    and the layers' allocations come top layer first."""
    from harness.config.models import hf_config, on_meta

    point = train_point(model="tiny", precision="bf16", checkpointing=checkpointing)
    _, tr = run_point(point)
    linears = {name: mod.weight.numel() * 2 for name, mod in on_meta(hf_config(point.model)).named_modules()
               if isinstance(mod, torch.nn.Linear)}
    backward = [e for e in tr.events if e.phase == "backward" and e.action == "alloc" and e.step == 1]
    assert backward and all(e.module for e in backward[1:])  # (the first: the loss's seed gradient, made by none)
    for name, nbytes in linears.items():
        assert any(e.module == name and e.size == nbytes for e in backward), name
    # backward runs the top layer first: each of its allocations before any of the one below
    layer = [int(e.module.split(".")[2]) for e in backward if e.module.startswith("model.layers.")]
    assert layer == sorted(layer, reverse=True) and set(layer) == {0, 1}


def test_a_reentrant_checkpoints_inner_backward_is_charged_to_no_module_and_its_recompute_to_its_own(monkeypatch):
    """A reentrant checkpoint's backward runs the nodes its recompute made (numbered on autograd's
    thread, not in the forward's spans): charged to none, even where their numbers fall in a
    forward call's span (here every span left open: each number in the root's); the recompute
    itself to the modules it runs."""
    from tests.test_exactness import _custom

    monkeypatch.setattr(StorageTracker, "_span_ends", lambda self: None)
    _, tr = run_point(_custom("tests.jobs.reentrant_checkpoint:build", batch_size=4))
    backward = [e for e in tr.events if e.phase == "backward" and e.action == "alloc" and e.step == 1]
    recomputed = [e.module for e in backward if e.module]
    assert recomputed and set(recomputed) <= {"b.0", "b.1", "b.2", "a.0", "a.1", "a.2"}
    assert recomputed.index("a.0") > max(i for i, m in enumerate(recomputed) if m.startswith("b."))  # b first
    assert any(e.module == "" and e.size == 64 * 256 * 4 for e in backward)  # a weight's gradient, charged to none


def test_optimizer_impl_auto_is_what_torch_picks_on_cuda():
    """foreach for AdamW and SGD (torch's _default_to_fused_or_foreach); Adafactor's for-loop."""
    import torch

    from harness.probe.jobs import prepare_optimizer

    params = [torch.nn.Parameter(torch.zeros(4, 4))]
    picked = {}
    for cls in (torch.optim.AdamW, torch.optim.SGD, torch.optim.Adafactor):
        opt = cls(params, lr=0.1)
        prepare_optimizer(opt, "auto", virtual=True)
        picked[cls.__name__] = opt.param_groups[0]["foreach"]
    assert picked == {"AdamW": True, "SGD": True, "Adafactor": None}
    opt = torch.optim.Adafactor(params, lr=0.1)
    prepare_optimizer(opt, "auto", virtual=False)  # a real GPU: torch picks
    assert opt.param_groups[0]["foreach"] is None


def test_adafactor_traces_and_auto_is_its_for_loop():
    """torch's Adafactor reads scalars (.item() of norms) in step(); the trace runs it, and
    impl=auto traces exactly what impl=forloop does."""
    base = train_point(model="tiny").replace(optimizer=dataclasses.replace(train_point().optimizer, name="adafactor"))
    auto, tr_auto = run_point(base)
    loop, tr_loop = run_point(base.replace(optimizer=dataclasses.replace(base.optimizer, impl="forloop")))
    _, tr_each = run_point(base.replace(optimizer=dataclasses.replace(base.optimizer, impl="foreach")))
    assert [e[3:] for e in tr_auto.events] == [e[3:] for e in tr_loop.events]
    assert [e[3:] for e in tr_auto.events] != [e[3:] for e in tr_each.events]
    assert auto["peak_allocated_bytes"] == loop["peak_allocated_bytes"]
    # factored second moments: far less state than AdamW's two full-size moments
    assert 0 < auto["optimizer_bytes"] < 0.5 * auto["params_bytes"]


class _OpNames(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype,mask,kernel", [
    (torch.bfloat16, False, "_scaled_dot_product_flash_attention"),
    (torch.float16, False, "_scaled_dot_product_flash_attention"),
    (torch.float32, False, "_scaled_dot_product_efficient_attention"),
    (torch.bfloat16, True, "_scaled_dot_product_efficient_attention"),
])
def test_attention_uses_cuda_kernel_choice(dtype, mask, kernel):
    with FakeTensorMode(), cu.cuda_kernels():
        q = torch.randn(2, 4, 128, 64, dtype=dtype, requires_grad=True)
        m = torch.ones(2, 1, 128, 128, dtype=torch.bool) if mask else None
        with _OpNames() as ops:
            out = F.scaled_dot_product_attention(q, q, q, attn_mask=m, is_causal=not mask)
            out.sum().backward()
    assert kernel in ops.names
    assert "_scaled_dot_product_flash_attention_for_cpu" not in ops.names


def test_attention_patch_is_undone():
    with cu.cuda_kernels():
        pass
    assert F.scaled_dot_product_attention is cu._original_sdpa


def test_autocast_emulation_follows_cuda_op_lists():
    """GEMMs in bf16, rsqrt/pow in fp32, softmax output fp32, leaf weight casts cached per region."""
    with FakeTensorMode():
        w = torch.nn.Parameter(torch.randn(32, 16))
        x = torch.randn(4, 16)
        with autocast_kernels.region(torch.bfloat16):
            y = F.linear(x, w)
            assert y.dtype == torch.bfloat16
            assert len(autocast_kernels._cache()) == 1
            F.linear(x, w)
            assert len(autocast_kernels._cache()) == 1  # the cast weight is reused, as CUDA's cached_cast
            assert torch.rsqrt(y).dtype == torch.float32
            assert y.pow(2).dtype == torch.float32
            assert torch.softmax(y, -1).dtype == torch.float32
            assert (y + y).dtype == torch.bfloat16  # not on any list: runs in its input dtype
            with torch.autocast("cpu", enabled=False):
                assert F.linear(x, w).dtype == torch.float32  # autocast turned off by the code
        assert autocast_kernels._cache() == {}


def test_cublas_workspace_one_per_thread():
    """Training allocates a workspace for the forward thread and one for the autograd thread."""
    _, tr = run_point(train_point())
    ws = [e for e in tr.events if e[4] == "workspace"]
    assert [e[3] for e in ws] == [CUBLAS_WORKSPACE_BYTES, CUBLAS_WORKSPACE_BYTES]
    point = train_point().replace(workload=Workload(name="infer", steps=1, new_tokens=2))
    _, tr = run_point(point)
    assert len([e for e in tr.events if e[4] == "workspace"]) == 1


def test_tracker_keeps_no_graph_alive_in_a_forward_loop_with_grad_enabled():
    """Forward passes whose outputs are dropped (no backward) must not climb."""
    from transformers import AutoModelForCausalLM

    from harness.config.models import hf_config
    from tests.conftest import model_cfg

    with FakeTensorMode():
        tracker = StorageTracker()
        with tracker:
            model = AutoModelForCausalLM.from_config(hf_config(model_cfg("tiny")))
            tracker.attach_modules(model)
            ids = torch.randint(0, 100, (2, 32))
            after = []
            for step in range(4):
                tracker.begin_step(step)
                tracker.set_phase("forward")
                out = model(input_ids=ids)
                del out
                gc.collect()
                tracker.end_step()
                after.append(tracker.allocated)
    assert after[1] == after[2] == after[3]


def test_checkpointing_lowers_the_peak_and_peak_grows_with_batch_and_sequence():
    def peak(**kw):
        return run_point(train_point(seq_len=256, **kw))[0]["peak_allocated_bytes"]

    base = peak(batch_size=4)
    assert peak(batch_size=4, checkpointing=True) < base
    assert peak(batch_size=8) > base
    assert run_point(train_point(seq_len=512, batch_size=4))[0]["peak_allocated_bytes"] > base


def test_the_per_op_policy_keeps_more_activations_than_full_checkpointing_and_fewer_than_none():
    def activations(checkpointing, policy="full"):
        m, _ = run_point(train_point(seq_len=256, batch_size=4, checkpointing=checkpointing)
                         .replace(checkpointing_policy=policy))
        return m["peak_breakdown"]["activation"]

    assert activations(True) < activations(True, "op") < activations(False)


def test_breakdown_at_the_peak_adds_up():
    m, _ = run_point(train_point())
    assert sum(m["peak_breakdown"].values()) == m["peak_allocated_bytes"]
    assert m["params_bytes"] > 0 and m["optimizer_bytes"] == 2 * m["params_bytes"]


def test_a_peak_inside_the_first_optimizer_step_counts_the_new_state_once_as_optimizer_state():
    """A job whose gradients and AdamW's state outweigh its activations peaks in its first step's
    optimizer step, as AdamW makes its state: that state counts as optimizer state (it was counted
    as temporaries, beside the row's optimizer_bytes: the report's breakdown stacked it twice), and
    the row's parts add up to its peak (with the batch, and the buffers the model holds beside its
    parameters)."""
    m, _ = run_point(train_point(batch_size=1, seq_len=8))
    assert (m["peak_step"], m["peak_phase"]) == (0, "optimizer")
    bd = m["peak_breakdown"]
    assert bd["optimizer_state"] == m["optimizer_bytes"]
    parts = ("params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes", "temporaries_bytes",
             "workspace_bytes")
    buffers = bd["parameter"] - m["params_bytes"]  # (the rotary embedding's inverse frequencies)
    assert 0 <= buffers <= 1024
    assert sum(m[k] for k in parts) + bd.get("input", 0) + buffers == m["peak_allocated_bytes"]


def test_allocated_after_each_step_is_kept_for_leak_detection():
    m, _ = run_point(train_point(steps=4))
    assert len(m["step_allocated_bytes"]) == 4
    assert len(set(m["step_allocated_bytes"])) == 1  # no leak in a correct loop
