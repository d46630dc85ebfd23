"""CUDA's own autocast, the C++ kernels a CUDA run takes (AutocastCUDA), run here on fake CUDA
tensors: the oracle for the virtual GPU's function-level emulation (probe.sim.cuda_emulation).

A CPU build of torch dispatches a fake tensor on "cuda" through AutocastCUDA like a real one, but
three things of a CUDA run need a device guard it lacks: autograd's edges (the oracle runs under
no_grad, its weights without requires_grad), and the Python bindings of `t[...]` and
`t.contiguous()`, made here of the aten ops they dispatch (a view as_strided, a clone)."""

from __future__ import annotations

import contextlib

import torch
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode

_GETITEM, _CONTIGUOUS = torch.Tensor.__getitem__, torch.Tensor.contiguous


def _getitem(t, index):
    if t.device.type != "cuda":
        return _GETITEM(t, index)
    with unset_fake_temporarily():  # the view's geometry, from a meta tensor of t's
        meta = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
        view = _GETITEM(meta, index)
        if view._base is not meta and view is not meta:
            raise NotImplementedError(f"an index that copies ({index!r}) on a fake CUDA tensor")
        size, stride, offset = tuple(view.shape), view.stride(), view.storage_offset()
    return torch.ops.aten.as_strided.default(t, size, stride, t.storage_offset() + offset)


def _contiguous(t, memory_format=torch.contiguous_format):
    if t.device.type != "cuda" or t.is_contiguous(memory_format=memory_format):
        return _CONTIGUOUS(t, memory_format=memory_format)
    return torch.ops.aten.clone.default(t, memory_format=memory_format)


@contextlib.contextmanager
def _indexable():
    """Fake CUDA tensors indexable while it lasts: `t[...]` and `t.contiguous()` made of aten ops."""
    torch.Tensor.__getitem__, torch.Tensor.contiguous = _getitem, _contiguous  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.__getitem__, torch.Tensor.contiguous = _GETITEM, _CONTIGUOUS  # type: ignore[method-assign]


@contextlib.contextmanager
def autocast_cuda(dtype: torch.dtype):
    """AutocastCUDA on (torch.autocast refuses "cuda" where no GPU is), and fake CUDA tensors indexable."""
    with _indexable():
        torch.set_autocast_enabled("cuda", True)
        torch.set_autocast_dtype("cuda", dtype)
        torch.autocast_increment_nesting()
        try:
            yield
        finally:
            torch.autocast_decrement_nesting()
            torch.set_autocast_enabled("cuda", False)
            torch.clear_autocast_cache()


class Ops(TorchDispatchMode):
    """Each aten op's name and its outputs' (dtype, shape), in order. Left out: what does not
    differ between a CUDA run and the emulation's CPU tensors in a way memory sees (prims; views,
    which the getitem above makes as_strided; host-to-device copies; empty tensors, which take
    no block)."""

    _VIEWS = {"aten.as_strided.default", "aten.slice.Tensor", "aten.unsqueeze.default", "aten.select.int",
              "aten.alias.default"}

    def __init__(self):
        super().__init__()
        self.ops: list[tuple[str, tuple]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        outs = [o for o in (out if isinstance(out, (tuple, list)) else [out]) if isinstance(o, torch.Tensor)]
        moved = func is torch.ops.aten._to_copy.default and kwargs.get("device") not in (None, args[0].device)
        if (func.namespace != "prim" and str(func) not in self._VIEWS and not moved
                and not any(o.device.type == "meta" or o.numel() == 0 for o in outs)):
            self.ops.append((str(func), tuple((o.dtype, tuple(o.shape)) for o in outs)))
        return out


def built(config, device: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """transformers' causal LM of `config` on fake tensors on `device` (inside a FakeTensorMode), its
    floating weights in `dtype`, none requiring grad."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return placed(model, device, dtype)


def placed(model: torch.nn.Module, device: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """`model` (built on the meta device) with fake tensors on `device` in its place (inside a
    FakeTensorMode), its floating weights in `dtype`, none requiring grad (a fake CUDA tensor's
    initialisation and autograd need a device guard)."""
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None:
                kind = dtype if p.is_floating_point() else p.dtype
                module._parameters[name] = torch.nn.Parameter(torch.empty(p.shape, dtype=kind, device=device),
                                                              requires_grad=False)
        for name, b in list(module._buffers.items()):
            if b is not None:
                module._buffers[name] = torch.empty(b.shape, dtype=b.dtype, device=device)
    return model


@contextlib.contextmanager
def _as_run(real: bool, dtype: torch.dtype, autocast: bool = True):
    """CUDA's own autocast to `dtype` on fake CUDA tensors (`real`), else the virtual GPU's emulation
    of CUDA (its kernels and autocast) on fake CPU tensors; autocast off where not `autocast`."""
    from harness.probe.sim.autocast_kernels import real_tensors_on_the_host, region
    from harness.probe.sim.cuda_emulation import cuda_kernels
    from harness.probe.sim.cuda_script import script_autocast

    if real:
        with autocast_cuda(dtype) if autocast else _indexable():
            yield
    else:  # (the code's torch.autocast and questions about it as in a trace where the CPU is the card;
        # a plain real tensor is the host's, as in a plain script's trace)
        with cuda_kernels(), script_autocast(cpu_is_card=True), real_tensors_on_the_host(), \
                region(dtype if autocast else None):
            yield


def forward_ops(config, dtype: torch.dtype, real: bool, autocast: bool = True, serve: bool = False) -> list:
    """The ops of one training-mode forward with its loss (`serve`: an eval-mode prefill into a
    cache and one decode step), under autocast to `dtype` (else the weights in `dtype`), run as
    _as_run runs it."""
    from harness.probe.sim.cuda_emulation import unpacked_sequences

    device, log = ("cuda" if real else "cpu"), Ops()
    with FakeTensorMode(allow_non_fake_inputs=True), unpacked_sequences():
        model = built(config, device, torch.float32 if autocast else dtype)
        ids = torch.zeros(2, 16, dtype=torch.long, device=device)
        with _as_run(real, dtype, autocast), log, torch.no_grad():
            if serve:
                cache = model.eval()(ids, use_cache=True).past_key_values
                model(ids[:, :1], past_key_values=cache, use_cache=True)
            else:
                model(ids, labels=ids)
    return log.ops


def call_ops(fn, dtype: torch.dtype, real: bool) -> list:
    """The ops of `fn(a, b, device)` under autocast to `dtype` (as forward_ops), `a` a 4 x 8 tensor in
    `dtype`, `b` one in fp32."""
    device, log = ("cuda" if real else "cpu"), Ops()
    with FakeTensorMode(allow_non_fake_inputs=True):
        a = torch.empty(4, 8, dtype=dtype, device=device)
        b = torch.empty(4, 8, dtype=torch.float32, device=device)
        with _as_run(real, dtype), log, torch.no_grad():
            fn(a, b, device)
    return log.ops


def module_ops(make, dtype: torch.dtype, real: bool) -> list:
    """The ops of a training-mode forward of the module `make()` builds on the meta device (placed:
    fp32 weights), on a 4 x 1 x 8 fp32 input, under autocast to `dtype`, run as _as_run runs it."""
    device, log = ("cuda" if real else "cpu"), Ops()
    with torch.device("meta"):
        module = make()
    with FakeTensorMode(allow_non_fake_inputs=True):
        module = placed(module, device).train()
        x = torch.empty(4, 1, 8, device=device)
        with _as_run(real, dtype), log, torch.no_grad():
            module(x)
    return log.ops


def outcome(ops, *args) -> list | str:
    """`ops(*args)` (call_ops, module_ops), or the error it raised."""
    try:
        return ops(*args)
    except RuntimeError as e:
        return f"RuntimeError: {e}"
