"""Code written for real tensors, run on fake ones: a build function's value-reading initialisers
and dtype conversions made to work, and a value read inside the measured step named by the user's
file and line (the virtual GPU has shapes, not values)."""

from __future__ import annotations

import contextlib
import copy
import math
import sys
import traceback
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
)

from harness.probe.jobs import (
    UserCodeError,
)

VALUE_READS = (DataDependentOutputException, DynamicOutputShapeException)


def _users(frames) -> list[traceback.FrameSummary]:
    """The frames of the user's code: not torch, not the harness, not an installed package."""
    skip = (str(Path(torch.__file__).parent), str(Path(__file__).resolve().parents[2]), sys.prefix, sys.base_prefix)
    return [f for f in frames if not f.filename.startswith(skip)]


def _user_frame(tb) -> traceback.FrameSummary | None:
    """The innermost frame of the user's code in a traceback."""
    frames = _users(traceback.extract_tb(tb))
    return frames[-1] if frames else None


def where(e: BaseException) -> str | None:
    """file:line of the user's code an exception came through (innermost), if any."""
    frame = _user_frame(e.__traceback__)
    return f"{frame.filename}:{frame.lineno}" if frame else None


def user_line() -> str:
    """file:line of the user's code running now (innermost)."""
    frames = _users(traceback.extract_stack())
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "the script"


def explain(e: Exception, where: str) -> UserCodeError:
    frame = _user_frame(e.__traceback__)
    at = f"{frame.filename}:{frame.lineno}: `{(frame.line or '').strip()}`" if frame else "in the job"
    op = str(e).splitlines()[0] if str(e) else type(e).__name__
    return UserCodeError(
        f"{at} reads tensor values {where} ({op}): the virtual GPU has shapes, not values. Keep value "
        "reads (.item(), bool(t), if t > 0, .tolist(), nonzero) out of the measured step - log them outside "
        "the harness's steps, or run this job with backend=cuda")


@contextlib.contextmanager
def module_conversion_on_fake_tensors():
    """Let `model.to(dtype)` and `copy.deepcopy(model)` work on fake parameters, as they do on real
    ones.

    nn.Module._apply converts FakeTensor parameters with torch.utils.swap_tensors, which refuses a
    tensor that has a weakref, and FakeTensorMode's own memo keeps weakrefs to the fake tensors it
    made: `.to(torch.bfloat16)` on a model built under FakeTensorMode raises "Couldn't swap". For
    fake tensors, move the converted data into the parameter instead (what _apply does for real
    tensors): the parameter object stays, its storage is the converted one.

    Tensor.__deepcopy__ copies a fake tensor's storage through another fake mode, and the first op
    that meets the copy and the trace's tensors raises "Mixing fake modes" (nn.TransformerEncoder
    deep-copies its layer, an EMA model its network): a fake tensor is copied in its own mode, a
    new leaf of the same bytes, as a real copy is."""
    from torch._subclasses.fake_tensor import FakeTensor

    original, own_deepcopy = torch.utils.swap_tensors, FakeTensor.__dict__.get("__deepcopy__")

    def swap(t1, t2):
        if not isinstance(t1, FakeTensor):
            return original(t1, t2)
        with torch.no_grad():
            t1.data = t2.data
        return None

    def deepcopy(t, memo):
        if id(t) in memo:
            return memo[id(t)]
        if not t.is_leaf:  # (as Tensor.__deepcopy__ refuses one)
            return torch.Tensor.__deepcopy__(t, memo)
        with torch.no_grad():
            out = t.clone(memory_format=torch.preserve_format)
        out.requires_grad_(t.requires_grad)
        if getattr(t, "_is_param", False):  # (a fake parameter: nn.Parameter's isinstance reads it)
            out._is_param = True
        memo[id(t)] = out
        if t.grad is not None:
            out.grad = copy.deepcopy(t.grad, memo)
        return out

    torch.utils.swap_tensors, FakeTensor.__deepcopy__ = swap, deepcopy  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.utils.swap_tensors = original
        if own_deepcopy is None:
            del FakeTensor.__deepcopy__
        else:
            FakeTensor.__deepcopy__ = own_deepcopy  # type: ignore[method-assign]


@contextlib.contextmanager
def plain_constants_taken(mode):
    """While a job builds, let FakeTensorMode `mode` take a plain tensor an op meets as a fake one.
    A model built on the meta device (over several GPUs, each rank makes only its shards) may make
    a constant in its __init__ that the meta device makes plain (Gemma's embedding scale:
    torch.tensor(x) then nn.Buffer, whose detach the fake mode otherwise refuses)."""
    if mode is None:
        yield
        return
    before = mode.allow_non_fake_inputs
    mode.allow_non_fake_inputs = True
    try:
        yield
    finally:
        mode.allow_non_fake_inputs = before


@contextlib.contextmanager
def shape_only_init():
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


class TorchsOwnReads:
    """torch's own code may read tensor values where the value does not change memory; on CUDA each
    is a sync with no allocation of its own, and on fake tensors a value read, answered here as a
    healthy run answers it. Inside a torch.optim step a fake tensor's `.item()` answers a stand-in
    (1: Adafactor sizes its update from norms and its step count); torch.amp.GradScaler's check for
    inf or NaN gradients before it steps the optimizer (`found_inf.item()`) answers none found (0),
    so the step is taken and its optimizer state made; torch.distributions' validation of parameters
    and scored samples against their constraints (`torch._is_all_true`, on by default) runs its ops
    and answers that they hold. The user's own value reads still fail, with their file and line."""

    def __init__(self):
        self.inside = 0
        self.scaler_checks = 0

    def watch(self, opt) -> None:
        if not type(opt).__module__.startswith("torch.optim"):
            return

        def enter(*_):
            self.inside += 1

        def leave(*_):
            self.inside -= 1

        opt.register_step_pre_hook(enter)
        opt.register_step_post_hook(leave)

    def __enter__(self):
        from torch._subclasses.fake_tensor import FakeTensor

        self._saved = (torch.Tensor.item, torch.amp.GradScaler._maybe_opt_step, torch._is_all_true)
        item_of, scaler_step, all_true = self._saved
        reads = self

        def item(t):
            if isinstance(t, FakeTensor) and (reads.inside or reads.scaler_checks):
                value = 1 if reads.inside else 0  # (the optimizer's step, inside the scaler's, first)
                return bool(value) if t.dtype == torch.bool else float(value) if t.is_floating_point() else value
            return item_of(t)

        def maybe_step(scaler, *args, **kwargs):
            reads.scaler_checks += 1
            try:
                return scaler_step(scaler, *args, **kwargs)
            finally:
                reads.scaler_checks -= 1

        def is_all_true(t):
            out = all_true(t)  # (its 0-dim bool on the card, as the check makes it)
            return True if isinstance(out, FakeTensor) else out

        # for the trace, restored on exit
        torch.Tensor.item, torch._is_all_true = item, is_all_true  # type: ignore[method-assign]
        torch.amp.GradScaler._maybe_opt_step = maybe_step  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc):
        torch.Tensor.item, torch.amp.GradScaler._maybe_opt_step, torch._is_all_true = self._saved  # type: ignore[method-assign]
        return False
