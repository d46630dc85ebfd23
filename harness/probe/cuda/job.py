"""The work measured on a real card: a preset (steps.py) or the user's job, built on the device and
run under CudaWatch. An out-of-memory error ends the work, not the row."""

from __future__ import annotations

import contextlib
import gc

import torch

from harness.allocator.model import round_size
from harness.analysis.oom_text import oom_columns
from harness.config.point import Point
from harness.config.target import load_target
from harness.probe import steps
from harness.probe.cuda.watch import CudaWatch, measurements
from harness.probe.jobs import (
    apply_checkpointing,
    check_job,
    job_step,
    knobs,
    optimizer_phases,
    precision_dtypes,
    prepare_optimizer,
)


def storage_bytes(tensors) -> int:
    """Bytes the allocator gives these tensors' storages (each rounded as the allocator rounds a
    request), a storage shared by several tensors (tied weights) counted once."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        s = t.untyped_storage()
        if s.data_ptr() in seen:
            continue
        seen.add(s.data_ptr())
        total += round_size(s.nbytes())
    return total


def optimizer_kwargs(impl: str) -> dict:
    """impl=auto leaves the choice to torch.optim (foreach on CUDA); the others force it."""
    return {"auto": {}, "foreach": {"foreach": True}, "fused": {"fused": True}}.get(impl, {"foreach": False})


def _state_bytes(optimizer) -> int:
    return storage_bytes(v for state in optimizer.state.values() for v in state.values()
                         if isinstance(v, torch.Tensor) and v.is_cuda)


def measure(point: Point) -> dict:
    """Record columns for the point on cuda:0: status ok or oom, peaks, per-step readings."""
    leak = point.workload.leak
    watch = CudaWatch(collect=leak != "cycle")
    facts: dict = {}
    out: dict = {"status": "ok"}
    try:
        if point.workload.name == "custom":
            _custom(point, watch, facts)
        else:
            _preset(point, watch, facts)
    except torch.OutOfMemoryError as e:
        failing = watch.at_failure()
        out.update(status="oom", oom_phase=failing.phase, oom_step=failing.step, **oom_columns(str(e)))
    finally:
        gc.enable()
    trains = facts.pop("trains", point.workload.name == "train")
    tokens = facts.pop("tokens_per_step", 0)
    phases = watch.all_phases()
    out.update(facts)
    out.update(measurements(watch.steps, phases, trains, tokens))
    if out["status"] == "oom":  # how far it got: the peak of every phase, the failing one included
        top = max(phases, key=lambda p: p.peak_allocated_bytes)
        out.update(peak_allocated_bytes=top.peak_allocated_bytes, peak_step=top.step, peak_phase=top.phase,
                   peak_requested_bytes=max(p.peak_requested_bytes for p in phases))
    stats = torch.cuda.memory_stats()
    out.update(num_alloc_retries=stats.get("num_alloc_retries", 0), num_ooms=stats.get("num_ooms", 0))
    return out


def _preset(point: Point, watch: CudaWatch, facts: dict) -> None:
    from transformers import AutoModelForCausalLM

    from harness.config.models import hf_config

    config = hf_config(point.model)
    param_dtype, amp_dtype = precision_dtypes(point.precision)
    region = (lambda: torch.autocast("cuda", dtype=amp_dtype)) if amp_dtype else contextlib.nullcontext
    train = point.workload.name == "train"
    n_tokens = point.seq_len - (0 if train else point.workload.new_tokens)
    b = point.batch_size
    facts.update(trains=train, tokens_per_step=b * point.seq_len if train else b)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=param_dtype)
    params = list(model.parameters())
    facts.update(n_params=sum(p.numel() for p in params), params_bytes=storage_bytes(params))
    watch.set_phase("input")
    input_ids = torch.randint(0, config.vocab_size, (b, n_tokens), device="cuda")
    if not train:
        steps.infer(model, input_ids, point.workload.new_tokens, watch, region)
        return
    if point.checkpointing:
        # Non-reentrant checkpointing restores the forward's autocast state on recompute by itself.
        steps.enable_checkpointing(model)
    opt = point.optimizer
    optimizer = steps.build_optimizer(opt.name, params, optimizer_kwargs(opt.impl), opt.lr)
    _watch_training(optimizer, params, facts)
    if point.workload.leak == "cycle":
        gc.disable()  # as on the virtual GPU: the cycle lives until the collector runs, after the steps
    kept = steps.train(model, optimizer, input_ids, point.workload.steps, watch, region,
                       point.workload.leak)
    del kept


def _watch_training(optimizer, params, facts: dict) -> None:
    """Gradient bytes (they match the trainable weights) and the optimizer state after each step."""
    facts["grads_bytes"] = storage_bytes(p for p in params if p.requires_grad)
    optimizer.register_step_post_hook(lambda o, *_: facts.__setitem__("optimizer_bytes", _state_bytes(o)))


def _custom(point: Point, watch: CudaWatch, facts: dict) -> None:
    """The user's build function and step, as they are, on the card: tensors made without a device
    land on it, and amp_* is CUDA's own autocast."""
    build = load_target(point.workload.target, point.cwd)
    k = knobs(point)
    amp = k.autocast_dtype
    region = (lambda: torch.autocast("cuda", dtype=amp)) if amp is not None else contextlib.nullcontext
    torch.manual_seed(0)
    with torch.device("cuda"):
        job = build(k)
        check_job(job, point)
        apply_checkpointing(job, k)
        params = list(job.model.parameters())
        opt = job.optimizer
        facts.update(trains=opt is not None, model=job.name or type(job.model).__name__,
                     optimizer=type(opt).__name__ if opt is not None else None,
                     n_params=sum(p.numel() for p in params), params_bytes=storage_bytes(params),
                     tokens_per_step=k.batch_size * k.seq_len)
        if opt is not None:
            prepare_optimizer(opt, point.optimizer.impl)
            _watch_training(opt, params, facts)
            optimizer_phases(opt, watch)
            # The first gradient to land marks backward (the user's step calls backward itself).
            for p in params:
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(
                        lambda _p: watch.set_phase("backward") if watch.phase == "forward" else None)
        step = job_step(job, region)
        for i in range(point.workload.steps):
            watch.begin_step(i)
            watch.set_phase("forward")
            step()
            watch.end_step()
