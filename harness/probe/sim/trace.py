"""The virtual GPU: a Job (a preset's or the user's) built and stepped under FakeTensorMode, every
storage tracked.

No memory is allocated and no arithmetic is done; the tracker sees every storage the step would
create on CUDA (see cuda_emulation for the differences from CPU that are reproduced). Phases come
from the job: the presets name theirs (harness.workload.phase); in a user's step, forward until
autograd's engine runs (backward) and the optimizer's step hooks (optimizer).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_leaves

from harness.allocator.settings import AllocSettings
from harness.config import attention, cublas, kernels, nccl
from harness.config.attention import ATTENTION_CALLS
from harness.config.point import Leak, Point, WorkloadName
from harness.probe.jobs import (
    UNMODELLED,
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
    unmodelled_layers,
    watching,
)
from harness.probe.sim import autocast_kernels, sharded
from harness.probe.sim import cuda_emulation as cu
from harness.probe.sim.cuda_script import cuda_script_on_cpu
from harness.probe.sim.fake_cache import fast_cache
from harness.probe.sim.fake_code import (
    VALUE_READS,
    TorchsOwnReads,
    explain,
    module_conversion_on_fake_tensors,
    plain_constants_taken,
    shape_only_init,
)
from harness.probe.sim.measure import find_holders, measurements, optimizer_state_bytes, watch_training
from harness.probe.sim.tracker import StorageTracker, storage_resizes
from harness.probe.sim.virtual_cuda import LiveAllocator, virtual_cuda


def run_point(point: Point, emulate_cuda: bool = True, fake: bool = True,
              setup_only: bool = False) -> tuple[dict, StorageTracker]:
    """Trace one point; returns (measurements, tracker with the event trace).

    `fake=False` runs the same steps on real CPU tensors under the same tracker (used to check
    the fake trace against real execution for small models). `setup_only`: the job built, no step
    run (no measurements). The cyclic GC is on while it traces, as in a real job, whatever the
    caller has it at.
    """
    with collector(on=True), sharded.process_group(point.parallel) as mesh:
        return _run_point(point, emulate_cuda, fake, mesh, setup_only)


def _run_point(point: Point, emulate_cuda: bool, fake: bool, mesh,
               setup_only: bool = False) -> tuple[dict, StorageTracker]:
    custom = point.workload.name == WorkloadName.custom
    build = build_function(point)
    k = knobs(point, mesh)
    if k.autocast_dtype is not None and not emulate_cuda:
        raise ValueError("amp_* precisions are traced with CUDA's autocast policy only")
    region = functools.partial(autocast_kernels.region, k.autocast_dtype)  # (None: no autocast)
    # CUDA's autocast policy registered once for an amp trace, not at each region (every forward and
    # recompute: 15 registrations, 3% of a 7B 4-layer trace's CPU)
    policy = autocast_kernels.cuda_policy() if k.autocast_dtype is not None else contextlib.nullcontext()
    tracker = StorageTracker(emulate_cublas_workspace=emulate_cuda,
                             workspace_bytes=cublas.workspace_bytes(point.gpu.capability),
                             geometry=kernels.geometry(point.gpu))
    tracker.auto_backward = True
    # the card as this rank sees it: NCCL's memory (config/nccl.py) outside PyTorch from the start
    card = nccl.on_rank(point.gpu, point.parallel)
    live = LiveAllocator(tracker, AllocSettings.from_conf(point.allocator.conf), card)
    cycle = point.workload.leak == Leak.cycle
    torch.manual_seed(0)
    # unpacked_sequences: transformers models read position_ids values (see cuda_emulation);
    # cuda_script_on_cpu: a script's "cuda" devices and autocast on the trace's CPU; virtual_cuda:
    # torch.cuda's readings (memory_allocated, snapshots, ...) are the virtual card's.
    fake_mode = FakeTensorMode() if fake else None
    with fake_mode or contextlib.nullcontext(), fast_cache(), cu.unpacked_sequences(), \
            cu.cuda_kernels(point.gpu.capability, tracker.attention_calls) if emulate_cuda else contextlib.nullcontext(), \
            cuda_script_on_cpu(tracker, cpu_is_card=mesh is not None), \
            cu.checkpoint_keeps_autocast(), TorchsOwnReads() as own_reads, tracker, watching(tracker), \
            storage_resizes(tracker), virtual_cuda(live), policy, \
            sharded.collectives_own_buffers(tracker) if mesh is not None else contextlib.nullcontext():
        tracker.set_phase("setup")
        try:
            with module_conversion_on_fake_tensors() if fake else contextlib.nullcontext(), shape_only_init(), \
                    plain_constants_taken(fake_mode if mesh is not None else None):
                job = build(k)
        except VALUE_READS as e:
            raise explain(e, "while building the job") from e
        n_steps = check_job(job, point)
        check_spread(k, point)
        if setup_only:
            return {}, tracker
        params = parameters(job)
        for t in (*params, *(job.model.buffers() if job.model is not None else ())):
            tracker.track(t, "parameter")
        for t in tree_leaves(job.batch):
            if isinstance(t, torch.Tensor):
                tracker.retag(t, "input")
        if job.model is not None:
            tracker.attach_modules(job.model)
        apply_checkpointing(job, k, point)
        opt = job.optimizer
        if opt is not None:
            if emulate_cuda:
                prepare_optimizer(opt, point.optimizer.impl, virtual=True)
            # torch.optim keeps step counts on the host unless fused (or capturable)
            host_steps = not any(g.get("fused") for g in opt.param_groups) or not emulate_cuda
            watch_training(tracker, job.model, opt, host_steps)
            own_reads.watch(opt)
            optimizer_phases(opt, tracker)
        step = job_step(job, region)
        # A process that set its heap aside (the zygote's children) keeps it so after this trace,
        # this trace's leftovers with it: the next trace's collections then walk only what that
        # trace makes (unfrozen, each costs a walk of all of torch and transformers, ~0.2 s).
        set_aside = _heap_set_aside()
        # Cycles left by the build (or by anything before it in this process) go first, as the
        # first step's collection would free them, and are not in the holder search's garbage.
        gc.collect()
        if cycle:
            gc.disable()  # the cycle lives until the GC gets round to it; here, not during the steps
        else:
            # What lives before the steps (torch, transformers, the model) is set aside from the
            # collector, so each step's collection walks only what the steps made (a full one costs
            # 0.1-0.5 s per step in a large process).
            gc.freeze()
        try:
            for i in range(n_steps):
                tracker.begin_step(i)
                tracker.set_phase("forward")
                try:
                    step()
                except VALUE_READS as e:
                    raise explain(e, "inside the measured step") from e
                if not cycle:
                    gc.collect()  # cycles of the libraries' own making are freed before the reading
                tracker.end_step()
            tracker.recording = False
            gc.unfreeze()  # the holder search asks the collector who refers to what: all of it
            if custom or opt is not None:  # a decode's cache grows by design: no holder to look for
                tracker.findings["retained_holder"] = find_holders(tracker, n_steps)
        finally:
            gc.unfreeze()
            if set_aside:
                gc.freeze()
            gc.enable()
        tracker.findings["scalars"] = {
            "trains": opt is not None, "n_params": sum(p.numel() for p in params),
            "params_bytes": sum(tracker.allocated_bytes_of(p) for p in params),
            "state_bytes": optimizer_state_bytes(tracker, opt) if opt is not None else 0,
            **sharded.traffic_per_step(tracker)}
        over_tp = sharded.traffic_per_step(tracker, tensor_parallel=True)
        if any(over_tp.values()):
            tracker.findings[sharded.TENSOR_PARALLEL_TRAFFIC] = over_tp
        m = measurements(tracker.journal(), holder=tracker.findings.get("retained_holder"),
                         **tracker.findings["scalars"])
        # the attention calls, for the cards whose kernels they would not take (config.attention)
        tracker.findings[ATTENTION_CALLS] = [dataclasses.asdict(c) for c in tracker.attention_calls]
        m[ATTENTION_CALLS] = attention.to_column(tracker.attention_calls, point.gpu.capability)
        m[UNMODELLED] = unmodelled_layers(job.model)
        if custom:  # the job names itself; a preset's row keeps the config's names
            m["model"] = job_name(job)
            m["optimizer"] = type(opt).__name__ if opt is not None else None
    return m, tracker


_set_aside: bool | None = None  # whether this process froze its heap before its first trace


def _heap_set_aside() -> bool:
    """Whether this process froze its heap before tracing (a zygote's child). Asked once per
    process: counting the frozen objects walks them all (~40 ms for torch and transformers); a
    fork inherits the answer (a zygote's from set_aside_for_forks). A trace leaves the count as it
    found it, so the first answer holds."""
    global _set_aside
    if _set_aside is None:
        _set_aside = gc.get_freeze_count() > 0
    return _set_aside


def set_aside_for_forks() -> None:
    """Set what this process holds aside from the cyclic GC (collected, then frozen), for the
    children it forks from now on (a zygote before serving): their collections walk only what
    they make."""
    global _set_aside
    gc.collect()
    gc.freeze()
    _set_aside = True


@contextlib.contextmanager
def collector(on: bool):
    """The cyclic GC on or off inside; as the caller had it after. Off while a trace becomes a
    journal, rows and replays: tens of thousands of new tuples and blocks, and where the heap is set
    aside (a zygote's child) the collector's thresholds are met again at once, a full collection of
    them each time (~0.3 s a 7B point). The few cycles made meanwhile (merged allocator blocks) go
    with the next collection."""
    was = gc.isenabled()
    if on:
        gc.enable()
    else:
        gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
        else:
            gc.disable()
