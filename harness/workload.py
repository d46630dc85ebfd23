"""Bring your own job: the contract between your code and the harness.

Write a build function and point the harness at it:

    python -m harness sweep workload=custom workload.target=my_pkg.memjob:build \\
        batch_size=8,16 +workload.args.image_size=224,320

    def build(knobs: harness.workload.Knobs) -> harness.workload.Job:
        model = MyModel().to(knobs.dtype)
        opt = torch.optim.AdamW(model.parameters())
        batch = (torch.randn(knobs.batch_size, 3, knobs.args["image_size"], ...), labels)
        return Job(model, opt, batch, loss=lambda m, b: F.cross_entropy(m(b[0]), b[1]),
                   blocks=MyBlock)

The harness calls `build` inside its measurement (on the virtual GPU: under FakeTensorMode, so
nothing is allocated and no arithmetic is done), then runs `workload.steps` steps: your `step`
if you give one, else forward + `loss` + backward + `optimizer.step()` + `zero_grad`. Inside the
measured step the code must not read tensor values (`.item()`, `bool(t)`, `if t > 0:`): the virtual
GPU has none; the harness names the line if it does. Code written for a GPU runs as it is: on the
virtual GPU, "cuda" devices, `.cuda()`, `torch.autocast("cuda")` and `torch.cuda.synchronize()`
are mapped onto the trace (harness/probe/sim/cuda_script.py).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


@dataclass(frozen=True)
class Knobs:
    """What the sweep varies, for your build function."""
    batch_size: int
    seq_len: int
    precision: str  # fp32 | bf16 | fp16 | amp_bf16 | amp_fp16
    checkpointing: bool  # applied per block when Job.blocks names the block class
    # what checkpointing keeps: full (the block's input) | op (torchtitan's per-op policy); a job that
    # checkpoints itself passes it to checkpoint_blocks or reads it, or checkpointing_policy=op is refused
    checkpointing_policy: str = "full"
    args: dict[str, Any] = field(default_factory=dict)  # your own keys: +workload.args.<key>=...
    # parallel.*: the device mesh of this rank's process group (a fake one on the virtual GPU), for
    # the job to shard its model over (a job over several GPUs that never reads it is refused: it
    # would run whole on each); None on one GPU.
    mesh: Any = None
    # The knobs your build function looked at: checkpointing=true on a job that neither names its
    # blocks nor reads the knob would change nothing, and is refused rather than recorded.
    read: set[str] = field(default_factory=set, repr=False, compare=False)

    def __getattribute__(self, name: str):
        if name in ("checkpointing", "checkpointing_policy", "mesh"):
            object.__getattribute__(self, "read").add(name)
        return object.__getattribute__(self, name)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype to build the model in (fp32 for the amp_* precisions: master weights)."""
        return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.precision, torch.float32)

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        """The autocast dtype for amp_* (the harness enters CUDA autocast around forward + loss, or
        around your whole step), else None."""
        return {"amp_bf16": torch.bfloat16, "amp_fp16": torch.float16}.get(self.precision)


@dataclass
class Job:
    """Your model, optimizer and batch, and how a step runs.

    `loss(model, batch) -> scalar tensor`, or `step(model, optimizer, batch)` for a whole training
    step of your own (a plain script's step function as it is). Neither: forward only, as in
    inference (`model(batch)` under torch.no_grad). With a `step`, there may be no model (a step
    over the batch's tensors alone, e.g. one attention kernel). `blocks`: the module class to checkpoint one
    by one when the sweep sets checkpointing=true. `name`: the row's `model` column.
    `autocast=False`: for amp_* precisions your step enters `torch.autocast("cuda", ...)` itself
    (the harness then enters none). `steps`: how many steps to run (default `workload.steps`);
    `tokens_per_step`: for tokens_per_s (default batch_size x seq_len). The harness's own presets
    (workload=train|infer) are Jobs too (harness/probe/presets.py)."""
    model: torch.nn.Module | None = None
    optimizer: torch.optim.Optimizer | None = None
    batch: Any = None
    loss: Callable[[torch.nn.Module, Any], torch.Tensor] | None = None
    step: Callable[[torch.nn.Module, Any, Any], Any] | None = None
    blocks: type | tuple[type, ...] | None = None
    name: str | None = None
    autocast: bool = True
    steps: int | None = None
    tokens_per_step: int | None = None


class _Phases(Protocol):
    def set_phase(self, phase: str) -> None: ...


_watch: _Phases | None = None  # the harness's watch while it builds and steps a job


@contextlib.contextmanager
def watched_by(watch: _Phases):
    """The harness's side of `phase`: while it builds and steps a job, phases go to `watch`."""
    global _watch
    previous, _watch = _watch, watch
    try:
        yield
    finally:
        _watch = previous


def phase(name: str) -> None:
    """Name the phase of your step that starts here (e.g. "forward", "backward", "optimizer", or one
    of your own): rows' peak_phase and oom_phase use it. Without it, the harness tells forward,
    backward (autograd's engine) and optimizer (its hooks) apart by itself. Outside the harness, or
    in code it does not measure, it does nothing."""
    if _watch is not None:
        _watch.set_phase(name)


def checkpoint_blocks(model: torch.nn.Module, block_cls, policy: str = "full") -> int:
    """Activation checkpointing (non-reentrant) around every submodule of class `block_cls`, keeping
    what `policy` keeps (Knobs.checkpointing_policy); returns how many were wrapped."""
    from torch.utils.checkpoint import checkpoint

    from harness.probe.checkpointing import checkpoint_kwargs

    n, kwargs = 0, checkpoint_kwargs(policy)
    for module in model.modules():
        if isinstance(module, block_cls):
            module.forward = functools.partial(checkpoint, module.forward, **kwargs)
            n += 1
    return n


def hf_model(class_name: str, dtype: torch.dtype = torch.float32, **config) -> torch.nn.Module:
    """A transformers model by class name from its config keyword arguments, without weights:
    hf_model("LlamaForCausalLM", hidden_size=512, num_hidden_layers=4, ...)."""
    import transformers

    from harness.config.models import attention_of

    cls = getattr(transformers, class_name)
    cfg = cls.config_class(**config)
    cfg._attn_implementation = attention_of(cls)
    return cls(cfg).to(dtype)
