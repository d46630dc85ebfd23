"""A user's job (harness.workload) on the virtual GPU: their build function and step under the
same tracker and CUDA emulations as the presets.

Phases come from the job's own execution: forward until autograd's engine runs (backward), the
optimizer's step hooks (optimizer); so a user's step needs no instrumentation.
"""

from __future__ import annotations

import contextlib
import gc
import math
import sys
import traceback
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
)
from torch.utils._pytree import tree_leaves

from harness.config.point import Point
from harness.config.target import load_target
from harness.probe.jobs import (
    UserCodeError,
    apply_checkpointing,
    check_job,
    job_step,
    knobs,
    optimizer_phases,
    prepare_optimizer,
)
from harness.probe.sim import cuda_emulation as cu
from harness.probe.sim.cuda_script import cuda_script_on_cpu
from harness.probe.sim.measure import (
    find_holders,
    measurements,
    optimizer_state_bytes,
    watch_training,
)
from harness.probe.sim.tracker import StorageTracker

_VALUE_READS = (DataDependentOutputException, DynamicOutputShapeException)


def _user_frame(tb) -> traceback.FrameSummary | None:
    """The innermost frame of the user's code: not torch, not the harness, not an installed package."""
    skip = [str(Path(torch.__file__).parent), str(Path(__file__).resolve().parents[2]), sys.prefix, sys.base_prefix]
    frames = [f for f in traceback.extract_tb(tb) if not any(f.filename.startswith(s) for s in skip)]
    return frames[-1] if frames else None


def _explain(e: Exception, where: str) -> UserCodeError:
    frame = _user_frame(e.__traceback__)
    at = f"{frame.filename}:{frame.lineno}: `{(frame.line or '').strip()}`" if frame else "in the job"
    op = str(e).splitlines()[0] if str(e) else type(e).__name__
    return UserCodeError(
        f"{at} reads tensor values {where} ({op}): the virtual GPU has shapes, not values. Keep value "
        "reads (.item(), bool(t), if t > 0, .tolist(), nonzero) out of the measured step - log them outside "
        "the harness's steps, or run this job with backend=cuda")


@contextlib.contextmanager
def _module_conversion_on_fake_tensors():
    """Let `model.to(dtype)` work on fake parameters, as it does on real ones.

    nn.Module._apply converts FakeTensor parameters with torch.utils.swap_tensors, which refuses a
    tensor that has a weakref, and FakeTensorMode's own memo keeps weakrefs to the fake tensors it
    made: `.to(torch.bfloat16)` on a model built under FakeTensorMode raises "Couldn't swap". For
    fake tensors, move the converted data into the parameter instead (what _apply does for real
    tensors): the parameter object stays, its storage is the converted one."""
    from torch._subclasses.fake_tensor import FakeTensor

    original = torch.utils.swap_tensors

    def swap(t1, t2):
        if not isinstance(t1, FakeTensor):
            return original(t1, t2)
        with torch.no_grad():
            t1.data = t2.data
        return None

    torch.utils.swap_tensors = swap
    try:
        yield
    finally:
        torch.utils.swap_tensors = original


@contextlib.contextmanager
def _shape_only_init():
    """Initialisers that read values, replaced by ones that don't: an initial value never changes
    memory. torch's trunc_normal_ resamples until `mask.any()` is false (a value read: it raises
    under fake tensors); the classic in-place version (uniform_, erfinv_, clamp_) allocates nothing."""
    original = torch.nn.init.trunc_normal_

    def trunc_normal_(tensor, mean=0.0, std=1.0, a=-2.0, b=2.0, generator=None):
        def cdf(x):
            return (1.0 + math.erf(x / math.sqrt(2.0))) / 2.0

        with torch.no_grad():
            lo, hi = cdf((a - mean) / std), cdf((b - mean) / std)
            tensor.uniform_(2 * lo - 1, 2 * hi - 1, generator=generator)
            tensor.erfinv_().mul_(std * math.sqrt(2.0)).add_(mean).clamp_(min=a, max=b)
        return tensor

    torch.nn.init.trunc_normal_ = trunc_normal_
    try:
        yield
    finally:
        torch.nn.init.trunc_normal_ = original


def run_custom(point: Point, emulate_cuda: bool = True, fake: bool = True) -> tuple[dict, StorageTracker]:
    """Trace the user's job: (measurements, tracker), like sim.run_point."""
    build = load_target(point.workload.target, point.cwd)
    k = knobs(point)
    autocast_mode = cu.CudaAutocast(k.autocast_dtype) if k.autocast_dtype is not None else None
    region = (lambda: cu.autocast_region(autocast_mode)) if autocast_mode else contextlib.nullcontext
    tracker = StorageTracker(emulate_cublas_workspace=emulate_cuda)
    tracker.auto_backward = True
    n_steps = point.workload.steps
    torch.manual_seed(0)
    # unpacked_sequences: transformers models read position_ids values (see cuda_emulation);
    # cuda_script_on_cpu: a script's "cuda" devices, autocast and synchronize, on the trace's CPU.
    with FakeTensorMode() if fake else contextlib.nullcontext(), cu.unpacked_sequences(), \
            cu.cuda_kernels() if emulate_cuda else contextlib.nullcontext(), cuda_script_on_cpu(), tracker:
        tracker.set_phase("setup")
        try:
            with _module_conversion_on_fake_tensors() if fake else contextlib.nullcontext(), _shape_only_init():
                job = build(k)
        except _VALUE_READS as e:
            raise _explain(e, "while building the job") from e
        check_job(job, point)
        for t in tree_leaves(job.batch):
            if isinstance(t, torch.Tensor):
                tracker.retag(t, "input")
        tracker.attach_modules(job.model)
        apply_checkpointing(job, k)
        opt = job.optimizer
        if opt is not None:
            if emulate_cuda:
                prepare_optimizer(opt, point.optimizer.impl)
            host_steps = not any(g.get("fused") for g in opt.param_groups) or not emulate_cuda
            watch_training(tracker, job.model, opt, host_steps)
            optimizer_phases(opt, tracker)
        step = job_step(job, region)
        for i in range(n_steps):
            tracker.begin_step(i)
            tracker.set_phase("forward")
            try:
                step()
            except _VALUE_READS as e:
                raise _explain(e, "inside the measured step") from e
            gc.collect()
            tracker.end_step()
        tracker.findings = {"retained_holder": find_holders(tracker, n_steps)}
        params = list(job.model.parameters())
        m = measurements(tracker, opt is not None,
                          sum(p.numel() for p in params), sum(tracker.allocated_bytes_of(p) for p in params),
                          optimizer_state_bytes(tracker, opt) if opt is not None else 0)
        m["model"] = job.name or type(job.model).__name__
        m["optimizer"] = type(opt).__name__ if opt is not None else None
    return m, tracker


