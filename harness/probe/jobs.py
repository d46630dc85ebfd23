"""How a Job (harness.workload) runs, the same on every backend: the knobs it is built from, the
checks of what it returned, checkpointing, the optimizer's implementation and phases, and its step.
The backends differ only in the watch they hand in and the tensors underneath."""

from __future__ import annotations

import contextlib
import sys
from typing import Protocol

import torch

from harness.config.point import TRAINING_STEPS_WHY, CheckpointingPolicy, Point, WorkloadName
from harness.config.target import load_target
from harness.probe import presets
from harness.workload import Job, Knobs, checkpoint_blocks, watched_by


class Watch(Protocol):
    """What a backend watches a run with: the tracker (virtual GPU) or CudaWatch (a card)."""

    def begin_step(self, step: int) -> None: ...

    def set_phase(self, phase: str) -> None: ...

    def end_step(self) -> None: ...


def watching(watch: Watch):
    """harness.workload.phase() names this watch's phases while a job is built and stepped."""
    return watched_by(watch)


class UserCodeError(RuntimeError):
    """The user's code did something the virtual GPU cannot measure; names their file and line."""


def build_function(point: Point):
    """The point's build function: the user's (workload.target) or its preset's."""
    if point.workload.name == WorkloadName.custom:
        return load_target(point.workload.target, point.cwd)
    return presets.builder(point)


def knobs(point: Point, mesh=None) -> Knobs:
    return Knobs(batch_size=point.batch_size, seq_len=point.seq_len, precision=point.precision,
                 checkpointing=bool(point.checkpointing), checkpointing_policy=str(point.checkpointing_policy),
                 args=dict(point.workload.args or {}), mesh=mesh)


def check_job(job, point: Point) -> int:
    """What the build returned is a Job that can run; returns how many steps it runs."""
    if not isinstance(job, Job):
        raise UserCodeError(f"{point.workload.target} returned {type(job).__name__}, not a harness.workload.Job")
    if job.model is None and (job.step is None or job.blocks is not None):
        raise UserCodeError("the Job has no model: it needs a step of its own (Job(step=...)) and no blocks")
    if job.optimizer is not None and job.model is None:
        raise UserCodeError("the Job has an optimizer but no model: give it the model the optimizer trains")
    steps = job.steps or point.workload.steps
    if steps < 1 or (job.optimizer is not None and steps < 2):
        raise UserCodeError(f"workload.steps={steps}: at least {2 if job.optimizer is not None else 1}"
                            + (TRAINING_STEPS_WHY if job.optimizer is not None else ""))
    return steps


def job_name(job: Job) -> str:
    """A custom job's row's model column: its name, else its model's class, else "step"."""
    return job.name or (type(job.model).__name__ if job.model is not None else "step")


# What a GPU runs through cuDNN, whose own memory the virtual GPU does not model: the layer is
# traced as the CPU runs it (README, "Known differences")
UNMODELLED = "unmodelled"  # the row's column: "<class> at <module>[ and N more]" a class, "; " between
# nn.LSTM, nn.GRU, nn.RNN: cuDNN's RNN (its workspace and reserve space); nn.Conv*d and their
# transposes: cuDNN's convolution (the workspace of the algorithm it picks, freed after each call)
CUDNN_LAYERS = (torch.nn.RNNBase, torch.nn.modules.conv._ConvNd)


def unmodelled_layers(model: torch.nn.Module | None) -> str | None:
    """The row's UNMODELLED: the model's layers that run through cuDNN, each class once ("<class> at
    <its first module's name>", and how many more of it there are); None where there are none."""
    if model is None:
        return None
    found: dict[str, list[str]] = {}
    for name, m in model.named_modules():
        if isinstance(m, CUDNN_LAYERS):
            found.setdefault(type(m).__name__, []).append(name or "(the model)")
    return "; ".join(f"{cls} at {names[0]}" + (f" and {len(names) - 1} more" if len(names) > 1 else "")
                     for cls, names in found.items()) or None


def parameters(job: Job) -> list:
    """The job's model's parameters (none without a model)."""
    return list(job.model.parameters()) if job.model is not None else []


def check_spread(k: Knobs, point: Point) -> None:
    """A job of your own over several GPUs spreads itself over the mesh it is handed (it read
    Knobs.mesh), or each GPU would run it whole and the row would claim a sharding that did not
    happen. (The presets are spread by probe.parallelize.)"""
    if point.parallel.world_size > 1 and point.workload.name == WorkloadName.custom and "mesh" not in k.read:
        raise UserCodeError(f"the job is spread over {point.parallel.world_size} GPUs ({point.parallel.key}) but never "
                            "reads Knobs.mesh: it would run whole on every GPU (shard it over k.mesh, e.g. "
                            "torch.distributed.fsdp.fully_shard(model, mesh=k.mesh))")


def apply_checkpointing(job: Job, k: Knobs, point: Point) -> None:
    """checkpointing=true: each of the job's blocks checkpointed; a user's job that names no blocks
    must apply it itself (it read Knobs.checkpointing), or the row would claim what did not happen.
    (The presets apply it in training; inference has nothing to checkpoint.)"""
    if not point.checkpointing:
        return
    if job.blocks is None and point.workload.name == WorkloadName.custom:
        if "checkpointing" not in k.read:
            raise UserCodeError("checkpointing=true, but the job neither names its blocks (Job(blocks=MyBlock)) "
                                "nor reads Knobs.checkpointing: nothing would be checkpointed")
        if point.checkpointing_policy != CheckpointingPolicy.full and "checkpointing_policy" not in k.read:
            raise UserCodeError(f"checkpointing_policy={point.checkpointing_policy}, but the job checkpoints itself "
                                "and never reads Knobs.checkpointing_policy: it would keep what it always keeps "
                                "(pass it on: harness.workload.checkpoint_blocks(model, MyBlock, k.checkpointing_policy))")
        return
    if job.blocks is not None and checkpoint_blocks(job.model, job.blocks, point.checkpointing_policy) == 0:
        raise UserCodeError(f"checkpointing=true but the model has no {job.blocks} module to checkpoint")


def optimizer_phases(opt, hooks: Watch) -> None:
    """The optimizer's step is a phase of its own; whatever the user's step runs after it is
    forward work again."""
    opt.register_step_pre_hook(lambda *_: hooks.set_phase("optimizer"))
    opt.register_step_post_hook(lambda *_: hooks.set_phase("forward"))


def cuda_picks_foreach(opt) -> bool:
    """Whether torch.optim runs this optimizer's foreach implementation on CUDA when it is left
    unset: those whose functional form asks _default_to_fused_or_foreach (Adam, AdamW, SGD, ...).
    Adafactor, for one, runs its for-loop unless foreach=True is given."""
    own = [c for c in type(opt).__mro__ if c not in (torch.optim.Optimizer, object)]  # the base defines it
    return any(hasattr(sys.modules.get(c.__module__), "_default_to_fused_or_foreach") for c in own)


def prepare_optimizer(opt, impl: str, virtual: bool) -> None:
    """optimizer.impl other than auto overrides the user's choice. With auto, a real GPU leaves
    torch to pick; on the virtual GPU's CPU tensors torch would pick the for-loop where CUDA picks
    foreach (other temporaries), so pick what CUDA would."""
    if impl == "auto":
        if virtual and cuda_picks_foreach(opt):
            for group in opt.param_groups:
                if group.get("foreach") is None and not group.get("fused"):
                    group["foreach"] = True
        return
    for group in opt.param_groups:
        if impl == "fused" and "fused" not in group:
            raise UserCodeError(f"optimizer.impl=fused: {type(opt).__name__} has no fused implementation")
        group["foreach"] = impl == "foreach"
        if "fused" in group:
            group["fused"] = impl == "fused"


def job_step(job: Job, region):
    """One step of the job. For amp_* precisions autocast covers the forward and the loss, as
    training code writes it (`with autocast(): loss = ...` then `loss.backward()`); around a step of
    the user's own it covers the whole step, unless the job enters autocast itself (autocast=False)."""
    if job.step is not None:
        step = job.step

        def own():
            with region() if job.autocast else contextlib.nullcontext():
                step(job.model, job.optimizer, job.batch)
        return own
    if job.loss is None:
        def forward_only():
            with torch.no_grad(), region():
                job.model(job.batch)
        return forward_only

    def train():
        with region():
            loss = job.loss(job.model, job.batch)
        loss.backward()
        del loss
        if job.optimizer is not None:
            job.optimizer.step()
            job.optimizer.zero_grad(set_to_none=True)
    return train
