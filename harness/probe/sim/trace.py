"""The virtual GPU: the real transformers model and step under FakeTensorMode, tracked per storage.

No memory is allocated and no arithmetic is done; the tracker sees every storage the step would
create on CUDA (see cuda_emulation for the differences from CPU that are reproduced).
"""

from __future__ import annotations

import contextlib
import gc

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from harness.probe import steps
from harness.probe.sim import cuda_emulation as cu
from harness.probe.sim.holders import collect_cycles, old_tensors
from harness.probe.sim.tracker import StorageTracker

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def precision_dtypes(precision: str) -> tuple[torch.dtype, torch.dtype | None]:
    """(parameter dtype, autocast dtype or None)."""
    if precision.startswith("amp_"):
        return torch.float32, DTYPES[precision[4:]]
    return DTYPES[precision], None


class _Hooks:
    def __init__(self, tracker: StorageTracker, collect: bool = True):
        self.t = tracker
        self.collect = collect

    def begin_step(self, step):
        self.t.begin_step(step)

    def set_phase(self, phase):
        self.t.set_phase(phase)

    def end_step(self):
        if self.collect:
            gc.collect()  # cycles of the libraries' own making are freed before the reading
        self.t.end_step()


def run_point(point: dict, emulate_cuda: bool = True, fake: bool = True) -> tuple[dict, StorageTracker]:
    """Trace one config point; returns (measurements, tracker with the event trace).

    `fake=False` runs the same steps on real CPU tensors under the same tracker (used to check
    the fake trace against real execution for small models).
    """
    if point["workload"]["name"] == "custom":
        from harness.probe.sim.custom import run_custom

        return run_custom(point, emulate_cuda, fake)
    from transformers import AutoModelForCausalLM

    from harness.config.models import hf_config

    config = hf_config(point["model"])
    param_dtype, amp_dtype = precision_dtypes(point["precision"])
    if amp_dtype is not None and not emulate_cuda:
        raise ValueError("amp_* precisions are traced with CUDA's autocast policy only")
    autocast_mode = cu.CudaAutocast(amp_dtype) if amp_dtype is not None else None
    region = (lambda: cu.autocast_region(autocast_mode)) if autocast_mode else contextlib.nullcontext
    tracker = StorageTracker(emulate_cublas_workspace=emulate_cuda)
    train = point["workload"]["name"] == "train"
    # infer: the prompt; the rest of the context is decoded
    n_tokens = point["seq_len"] - (0 if train else point["workload"]["new_tokens"])

    torch.manual_seed(0)
    with FakeTensorMode() if fake else contextlib.nullcontext(), cu.unpacked_sequences(), \
            cu.cuda_kernels() if emulate_cuda else contextlib.nullcontext(), tracker:
        tracker.set_phase("setup")
        model = AutoModelForCausalLM.from_config(config, dtype=param_dtype)
        for t in (*model.parameters(), *model.buffers()):
            tracker.track(t, "parameter")
        tracker.attach_modules(model)
        tracker.set_phase("input")
        input_ids = torch.randint(0, config.vocab_size, (point["batch_size"], n_tokens))
        if train:
            state_bytes = _trace_train(point, model, input_ids, tracker, region, emulate_cuda)
        else:
            steps.infer(model, input_ids, point["workload"]["new_tokens"], _Hooks(tracker), region)
            state_bytes = 0
        n_params = sum(p.numel() for p in model.parameters())
        params_bytes = sum(tracker.allocated_bytes_of(p) for p in model.parameters())
    return _measurements(tracker, point["workload"], n_params, params_bytes, state_bytes), tracker


def _trace_train(point, model, input_ids, tracker, region, emulate_cuda) -> int:
    """The training steps under the tracker; returns the optimizer state's bytes."""
    if point["checkpointing"]:
        # The recompute runs inside backward, outside the emulated autocast region: re-enter it.
        steps.enable_checkpointing(model, region if point["precision"].startswith("amp_") else None)
    opt = point["optimizer"]
    opt_kwargs = cu.optimizer_kwargs(opt["impl"]) if emulate_cuda else {}
    optimizer = steps.build_optimizer(opt["name"], model.parameters(), opt_kwargs, opt["lr"])
    host_steps = opt["impl"] != "fused" or not emulate_cuda
    watch_training(tracker, model, optimizer, host_steps)
    leak = point["workload"].get("leak", "none")
    n_steps = point["workload"]["steps"]
    if leak == "cycle":
        gc.disable()  # the cycle lives until the GC gets round to it; here, not during the steps
    try:
        kept = steps.train(model, optimizer, input_ids, n_steps, _Hooks(tracker, collect=leak != "cycle"),
                           region, leak)
        tracker.findings = {"retained_holder": find_holders(tracker, n_steps)}
        del kept
    finally:
        gc.enable()
    return optimizer_state_bytes(tracker, optimizer)


def watch_training(tracker: StorageTracker, model, optimizer, host_steps: bool) -> None:
    """Tag gradients as they land and optimizer state after each step (`host_steps`: step counts
    stay on the host, as torch.optim keeps them on CUDA unless fused)."""
    for p in model.parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(lambda p: tracker.retag(p.grad, "gradient"))
    optimizer.register_step_post_hook(lambda o, *_: _retag_state(tracker, o, host_steps))


def find_holders(tracker: StorageTracker, n_steps: int) -> str | None:
    """What keeps memory that outlived its step: Python containers holding old steps' tensors, and
    reference cycles (call while the loop's leftovers are still alive). Looking walks every Python
    object (about 1 s at 7B), so only when something outlived its step - the same test as the
    record's retained_bytes."""
    after = [s.allocated_after_bytes for s in tracker.steps]
    if not (len(after) > 2 and after[-1] > after[1]):
        return None
    holders = old_tensors(tracker, n_steps - 1) + collect_cycles(tracker)[0]
    return "; ".join(holders) or None


def optimizer_state_bytes(tracker: StorageTracker, optimizer) -> int:
    return sum(tracker.allocated_bytes_of(v) for state in optimizer.state.values()
               for v in state.values() if isinstance(v, torch.Tensor))


def _retag_state(tracker: StorageTracker, optimizer, host_steps: bool) -> None:
    for state in optimizer.state.values():
        for name, v in state.items():
            if not isinstance(v, torch.Tensor):
                continue
            if name == "step" and host_steps and v.dim() == 0:
                # torch.optim keeps step counts on the CPU unless fused or capturable:
                # a real CUDA run never allocates them on the card.
                tracker.drop(v)
            else:
                tracker.retag(v, "optimizer_state")


def _measurements(tracker: StorageTracker, workload: dict, n_params: int, params_bytes: int,
                  state_bytes: int) -> dict:
    per_step = tracker.steps
    if workload["name"] == "train":
        # Step 1 creates the optimizer state; the steady state is from step 2 on.
        window = per_step[1:] if len(per_step) > 1 else per_step
    else:
        window = per_step
    peak = max(window, key=lambda s: s.peak_allocated_bytes)
    bd = peak.peak_breakdown
    after = [s.allocated_after_bytes for s in per_step]
    findings = getattr(tracker, "findings", {})
    return {
        "retained_bytes": max(0, after[-1] - after[1]) if len(after) > 2 and workload["name"] == "train" else 0,
        "retained_holder": findings.get("retained_holder"),
        "n_params": n_params,
        "peak_allocated_bytes": peak.peak_allocated_bytes,
        "peak_requested_bytes": max(s.peak_requested_bytes for s in window),
        "peak_step": peak.step,
        "peak_phase": peak.peak_phase,
        "peak_module": peak.peak_module,
        "params_bytes": params_bytes,
        "grads_bytes": bd.get("gradient", 0),
        "optimizer_bytes": state_bytes,
        "activations_bytes": bd.get("activation", 0),
        "temporaries_bytes": bd.get("temporary", 0),
        "workspace_bytes": bd.get("workspace", 0),
        "peak_breakdown": {k: v for k, v in bd.items() if v},
        "step_allocated_bytes": [s.allocated_after_bytes for s in per_step],
        "step_peak_bytes": [s.peak_allocated_bytes for s in per_step],
    }
