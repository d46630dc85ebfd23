"""The work measured on a real card: a Job (a preset's, probe/presets.py, or the user's), built on
the device and run under CudaWatch. An out-of-memory error ends the work, not the row."""

from __future__ import annotations

import contextlib
import functools
import gc

import torch

from harness.allocator.model import round_size
from harness.analysis.oom_text import oom_columns
from harness.config import attention
from harness.config.attention import ATTENTION_CALLS
from harness.config.point import Leak, Point, WorkloadName
from harness.probe.cuda import attention as cuda_attention
from harness.probe.cuda.watch import CudaWatch, measurements
from harness.probe.jobs import (
    apply_checkpointing,
    build_function,
    check_job,
    check_spread,
    job_name,
    job_step,
    knobs,
    optimizer_phases,
    parameters,
    prepare_optimizer,
    watching,
)
from harness.probe.parallelize import device_mesh


def storage_bytes(tensors) -> int:
    """Bytes the allocator gives these tensors' storages (each rounded as the allocator rounds a
    request), a storage shared by several tensors (tied weights) counted once."""
    from torch.distributed.tensor import DTensor

    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        if isinstance(t, DTensor):  # a shard or slice (FSDP2, tensor parallel): this rank's part
            t = t.to_local()
        s = t.untyped_storage()
        if s.data_ptr() in seen:
            continue
        seen.add(s.data_ptr())
        total += round_size(s.nbytes())
    return total


def _state_bytes(optimizer) -> int:
    return storage_bytes(v for state in optimizer.state.values() for v in state.values()
                         if isinstance(v, torch.Tensor) and v.device.type == "cuda")


def measure(point: Point, card: tuple[int, int] | None = None, device: tuple[int, int] | None = None) -> dict:
    """Record columns for the point on cuda:0: status ok or oom, peaks, per-step readings. Its
    attention kernels are a card of capability `card`'s, on this device of capability `device`
    (probe.cuda.attention: the same where this device is the point's card)."""
    cycle = point.workload.leak == Leak.cycle
    watch = CudaWatch(collect=not cycle)
    facts: dict = {}
    out: dict = {"status": "ok"}
    calls: list = []
    try:
        with cuda_attention.as_on(card, device, calls):
            _run(point, watch, facts)
    except torch.OutOfMemoryError as e:
        failing = watch.at_failure()
        out.update(status="oom", oom_phase=failing.phase, oom_step=failing.step, **oom_columns(str(e)))
    finally:
        gc.enable()
    trains = facts.pop("trains")
    tokens = facts.pop("tokens_per_step", 0)
    phases = watch.all_phases()
    out.update(facts, **{ATTENTION_CALLS: attention.to_column(calls, card)})
    # the whole run's peaks: after an OOM, how far it got (the failing phase included)
    out.update(measurements(watch.steps, phases, trains, tokens))
    stats = torch.cuda.memory_stats()
    out.update(num_alloc_retries=stats.get("num_alloc_retries", 0), num_ooms=stats.get("num_ooms", 0))
    return out


def _steps_on_host(optimizer) -> None:
    """optimizer.step outside the job's default device: torch.optim makes each parameter's step
    count with no device (the host, 512 B a parameter on the card otherwise) unless fused or
    capturable, which place it themselves; a training script without a default device does so."""
    step = optimizer.step

    @functools.wraps(step)
    def on_host(*args, **kwargs):
        with torch.device("cpu"):
            return step(*args, **kwargs)

    optimizer.step = on_host


def _watch_training(optimizer, params, facts: dict) -> None:
    """Gradient bytes (they match the trainable weights) and the optimizer state after each step."""
    facts["grads_bytes"] = storage_bytes(p for p in params if p.requires_grad)
    optimizer.register_step_post_hook(lambda o, *_: facts.__setitem__("optimizer_bytes", _state_bytes(o)))


def _run(point: Point, watch: CudaWatch, facts: dict) -> None:
    """The job (a preset's or the user's build function and step), as it is, on the card: tensors
    made without a device land on it, and amp_* is CUDA's own autocast."""
    custom = point.workload.name == WorkloadName.custom
    build = build_function(point)
    # Over several GPUs (this process one rank of the job, probe.rank): the model spread on the mesh
    k = knobs(point, device_mesh(point.parallel, "cuda"))
    amp = k.autocast_dtype
    region = (lambda: torch.autocast("cuda", dtype=amp)) if amp is not None else contextlib.nullcontext
    cycle = point.workload.leak == Leak.cycle
    torch.manual_seed(0)
    with torch.device("cuda"), watching(watch):
        job = build(k)
        n_steps = check_job(job, point)
        check_spread(k, point)
        apply_checkpointing(job, k, point)
        params = parameters(job)
        opt = job.optimizer
        facts.update(trains=opt is not None, n_params=sum(p.numel() for p in params), params_bytes=storage_bytes(params),
                     tokens_per_step=job.tokens_per_step or k.batch_size * k.seq_len)
        if custom:  # the job names itself; a preset's row keeps the config's names
            facts.update(model=job_name(job),
                         optimizer=type(opt).__name__ if opt is not None else None)
        if opt is not None:
            prepare_optimizer(opt, point.optimizer.impl, virtual=False)
            _steps_on_host(opt)
            _watch_training(opt, params, facts)
            optimizer_phases(opt, watch)
            # The first gradient to land marks backward (a user's step calls backward itself).
            for p in params:
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(
                        lambda _p: watch.set_phase("backward") if watch.phase == "forward" else None)
        step = job_step(job, region)
        if cycle:
            gc.disable()  # as on the virtual GPU: the cycle lives until the collector runs, after the steps
        for i in range(n_steps):
            watch.begin_step(i)
            watch.set_phase("forward")
            step()
            watch.end_step()
