"""The preset workloads as Jobs (harness.workload): a transformers model by its config, no weights,
and the training step (`workload=train`, with the classic leaks) or prefill + decode
(`workload=infer`). They run through the same path as a user's job on every backend; their steps
name their phases themselves and enter CUDA's autocast for amp_* around the forward only.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable

import torch

from harness.config.models import hf_config
from harness.config.point import Leak, OptimizerName, Point, WorkloadName
from harness.probe.checkpointing import checkpoint_kwargs
from harness.probe.parallelize import parallelize
from harness.workload import Job, Knobs, phase


def builder(point: Point) -> Callable[[Knobs], Job]:
    """The build function of the point's preset (workload=train or infer)."""
    def build(k: Knobs) -> Job:
        from transformers import AutoModelForCausalLM

        config = hf_config(point.model)
        # Over several GPUs, the model is built on the meta device and only what this rank holds is
        # made on the card (torchtitan's order): a sharded model is never whole on one GPU.
        with torch.device("meta") if k.mesh is not None else contextlib.nullcontext():
            model = AutoModelForCausalLM.from_config(config, dtype=k.dtype)
        train = point.workload.name == WorkloadName.train
        if train and k.checkpointing:  # torch.utils.checkpoint re-enters the forward's autocast to recompute
            enable_checkpointing(model, k.checkpointing_policy)
        if k.mesh is not None:  # parallel.*: what this rank holds (probe.parallelize)
            model = parallelize(model, k.mesh, point.parallel)
        # infer: the prompt; the rest of the context is decoded
        n_tokens = k.seq_len - (0 if train else point.workload.new_tokens)
        phase("input")
        input_ids = torch.randint(0, config.vocab_size, (k.batch_size, n_tokens))
        region = autocast(k)
        if not train:
            return Job(model, None, input_ids, step=Decode(model, region), name=point.model.name, autocast=False,
                       steps=point.workload.new_tokens + 1, tokens_per_step=k.batch_size)
        optimizer = build_optimizer(point.optimizer.name, model.parameters(), {}, point.optimizer.lr)
        return Job(model, optimizer, input_ids, step=TrainStep(region, point.workload.leak, loss_region(point)),
                   name=point.model.name, autocast=False)
    return build


def loss_region(point: Point) -> Callable[[], contextlib.AbstractContextManager]:
    """parallel.loss_parallel: torch's loss_parallel() around the forward's loss and the backward,
    where the head's logits are split over the vocabulary (probe.parallelize); else nothing."""
    if not point.parallel.loss_parallel:
        return contextlib.nullcontext
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel


def autocast(k: Knobs) -> Callable[[], contextlib.AbstractContextManager]:
    """CUDA's autocast for amp_* (on the virtual GPU, its emulation), else nothing."""
    dtype = k.autocast_dtype
    if dtype is None:
        return contextlib.nullcontext
    return lambda: torch.autocast("cuda", dtype=dtype)


def build_optimizer(name: str, params, opt_kwargs: dict, lr: float):
    if name == OptimizerName.adamw:
        return torch.optim.AdamW(params, lr=lr, **opt_kwargs)
    if name == OptimizerName.sgd:
        return torch.optim.SGD(params, lr=lr, momentum=0.9, **opt_kwargs)
    if name == OptimizerName.adafactor:
        kw = {k: v for k, v in opt_kwargs.items() if k == "foreach"}  # Adafactor has no fused
        return torch.optim.Adafactor(params, lr=lr, **kw)
    raise ValueError(f"unknown optimizer {name}")


def enable_checkpointing(model, policy: str = "full") -> None:
    """Activation checkpointing per decoder layer (non-reentrant, as HF recommends), keeping what
    `policy` keeps (probe.checkpointing)."""
    kwargs = checkpoint_kwargs(policy)
    if hasattr(model, "activation_checkpointing_enable"):  # the newer transformers name
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


class _StepState:
    """What a training loop might keep per step, e.g. for logging."""

    self: _StepState
    outputs: object


class TrainStep:
    """forward, backward, optimizer step, zero_grad(set_to_none=True).

    `leak` reproduces the classic mistakes: `graph` keeps the loss of an evaluation forward, with
    its autograd graph and saved activations, across steps (history.append(loss) where loss.item()
    was meant); `cycle` leaves a reference cycle holding the step's outputs, which only the cyclic
    garbage collector frees. `history` is what the loop keeps (the graph leak's holder)."""

    def __init__(self, region, leak: Leak, loss_region=contextlib.nullcontext):
        self.region, self.leak, self.loss_region = region, leak, loss_region
        self.history: list = []

    def __call__(self, model, optimizer, input_ids) -> None:
        model.train()
        phase("forward")
        with self.loss_region():  # the loss and its backward on vocabulary slices (loss parallel)
            with self.region():
                out = model(input_ids=input_ids, labels=input_ids, use_cache=False)
            loss = out.loss
            if self.leak == Leak.cycle:
                state = _StepState()
                state.self, state.outputs = state, out  # unreachable after this step, but a cycle
                del state
            del out
            phase("backward")
            loss.backward()
            del loss
        phase("optimizer")
        optimizer.step()
        phase("zero_grad")
        optimizer.zero_grad(set_to_none=True)
        if self.leak == Leak.graph:
            phase("forward")
            with self.loss_region(), self.region():
                self.history.append(model(input_ids=input_ids, labels=input_ids, use_cache=False).loss)


class Decode:
    """Step 0 prefills the prompt into a KV cache (HF DynamicCache); each later step decodes one
    token (greedy), as `generate` does."""

    def __init__(self, model, region):
        self.region = region
        self.cache = None
        self.ids = None
        # transformers renamed `past_key_values` to `cache`; use whichever this version takes
        self.cache_kwarg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def __call__(self, model, _optimizer, input_ids) -> None:
        from transformers import DynamicCache

        model.eval()
        with torch.inference_mode(), composites_on_dtensors():
            first = self.cache is None
            if first:
                self.cache = DynamicCache(config=model.config)
            phase("prefill" if first else "decode")
            with self.region():
                out = model(input_ids=input_ids if first else self.ids, **{self.cache_kwarg: self.cache},
                            use_cache=True, logits_to_keep=1)
            self.ids = out.logits[:, -1:].argmax(-1)
            del out


def _decomposed(op, args, kwargs):
    return op.decompose(*args, **kwargs)


def _as_type_of(op, args, kwargs):
    return args[0].to(args[1].dtype)  # type_as's own decomposition (same device): a DTensor's _to_copy


@contextlib.contextmanager
def composites_on_dtensors():
    """Under inference_mode composite ops reach DTensor whole (elsewhere autograd decomposes them
    first), and torch 2.13's DTensor first tries to shard them by their decomposition. `aten.linear`
    fails (an AssertionError on an unnormalized Shard(-1)) and is then decomposed: the failure's
    traceback keeps the call's Python stack, activations and all, in a reference cycle until the
    cyclic GC runs. Here it is decomposed at once, as it then is: a tensor-parallel decode frees what
    it would once the collector ran, when its last reference goes (which the GC's timing, another
    process's, could not say). `aten.type_as` (Gemma's RMSNorm) fails on fake tensors both ways
    ("out variant should have at least one out arg") where real ones shard it: it is the cast it
    decomposes to (the gloo oracle: tests/test_parallel.py)."""
    if not torch.distributed.is_available():  # (a build without it has no DTensor)
        yield
        return
    from torch.distributed.tensor import DTensor

    handlers = DTensor._op_dispatcher._custom_op_handlers
    ours = {op: h for op, h in ((torch.ops.aten.linear.default, _decomposed), (torch.ops.aten.type_as.default, _as_type_of))
            if op not in handlers}
    handlers.update(ours)
    try:
        yield
    finally:
        for op in ours:
            handlers.pop(op, None)
