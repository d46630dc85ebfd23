"""The virtual GPU: the real transformers model and step under FakeTensorMode, tracked per storage.

No memory is allocated and no arithmetic is done; the tracker sees every storage the step would
create on CUDA (see cuda_emulation for the differences from CPU that are reproduced).
"""

from __future__ import annotations

import contextlib
import gc

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from harness.config.point import Point
from harness.probe import steps
from harness.probe.jobs import optimizer_kwargs, precision_dtypes
from harness.probe.sim import cuda_emulation as cu
from harness.probe.sim.custom import run_custom
from harness.probe.sim.measure import (
    TrackerWatch,
    find_holders,
    measurements,
    optimizer_state_bytes,
    watch_training,
)
from harness.probe.sim.tracker import StorageTracker


def run_point(point: Point, emulate_cuda: bool = True, fake: bool = True) -> tuple[dict, StorageTracker]:
    """Trace one config point; returns (measurements, tracker with the event trace).

    `fake=False` runs the same steps on real CPU tensors under the same tracker (used to check
    the fake trace against real execution for small models).
    """
    if point.workload.name == "custom":
        return run_custom(point, emulate_cuda, fake)
    from transformers import AutoModelForCausalLM

    from harness.config.models import hf_config

    config = hf_config(point.model)
    param_dtype, amp_dtype = precision_dtypes(point.precision)
    if amp_dtype is not None and not emulate_cuda:
        raise ValueError("amp_* precisions are traced with CUDA's autocast policy only")
    autocast_mode = cu.CudaAutocast(amp_dtype) if amp_dtype is not None else None
    region = (lambda: cu.autocast_region(autocast_mode)) if autocast_mode else contextlib.nullcontext
    tracker = StorageTracker(emulate_cublas_workspace=emulate_cuda)
    train = point.workload.name == "train"
    # infer: the prompt; the rest of the context is decoded
    n_tokens = point.seq_len - (0 if train else point.workload.new_tokens)

    torch.manual_seed(0)
    with FakeTensorMode() if fake else contextlib.nullcontext(), cu.unpacked_sequences(), \
            cu.cuda_kernels() if emulate_cuda else contextlib.nullcontext(), tracker:
        tracker.set_phase("setup")
        model = AutoModelForCausalLM.from_config(config, dtype=param_dtype)
        for t in (*model.parameters(), *model.buffers()):
            tracker.track(t, "parameter")
        tracker.attach_modules(model)
        tracker.set_phase("input")
        input_ids = torch.randint(0, config.vocab_size, (point.batch_size, n_tokens))
        if train:
            state_bytes = _trace_train(point, model, input_ids, tracker, region, emulate_cuda)
        else:
            steps.infer(model, input_ids, point.workload.new_tokens, TrackerWatch(tracker), region)
            state_bytes = 0
        n_params = sum(p.numel() for p in model.parameters())
        params_bytes = sum(tracker.allocated_bytes_of(p) for p in model.parameters())
    return measurements(tracker, point.workload.trains, n_params, params_bytes, state_bytes), tracker


def _trace_train(point, model, input_ids, tracker, region, emulate_cuda) -> int:
    """The training steps under the tracker; returns the optimizer state's bytes."""
    if point.checkpointing:
        # The recompute runs inside backward, outside the emulated autocast region: re-enter it.
        steps.enable_checkpointing(model, region if point.precision.startswith("amp_") else None)
    opt = point.optimizer
    opt_kwargs = optimizer_kwargs(opt.impl) if emulate_cuda else {}
    optimizer = steps.build_optimizer(opt.name, model.parameters(), opt_kwargs, opt.lr)
    host_steps = opt.impl != "fused" or not emulate_cuda
    watch_training(tracker, model, optimizer, host_steps)
    leak = point.workload.leak
    n_steps = point.workload.steps
    if leak == "cycle":
        gc.disable()  # the cycle lives until the GC gets round to it; here, not during the steps
    try:
        kept = steps.train(model, optimizer, input_ids, n_steps, TrackerWatch(tracker, collect=leak != "cycle"),
                           region, leak)
        tracker.findings = {"retained_holder": find_holders(tracker, n_steps)}
        del kept
    finally:
        gc.enable()
    return optimizer_state_bytes(tracker, optimizer)


