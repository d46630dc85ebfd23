"""A plain CUDA training script's habits, on the virtual GPU (workload=custom on sim).

Public training code says `device = "cuda"`, `.to(device)`, `.cuda()`, `torch.autocast("cuda",
dtype=torch.bfloat16)` and `torch.cuda.synchronize()`. Fake CUDA tensors cannot run backward on a
torch without a GPU (fidelity.md, B), so the trace stays on fake CPU tensors: CUDA device arguments
become the CPU, the script's own CUDA autocast becomes the CUDA autocast emulation, and the CUDA
calls that only synchronize or report become no-ops. Nothing here runs on the cuda backend.
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from harness.probe.sim import cuda_emulation as cu

_CPU = torch.device("cpu")


def _is_cuda(x) -> bool:
    if isinstance(x, torch.device):
        return x.type == "cuda"
    return isinstance(x, str) and x.split(":")[0] == "cuda"


def _to_cpu(x):
    return _CPU if _is_cuda(x) else x


class CudaDevicesOnCpu(TorchFunctionMode):
    """Every CUDA device argument (factory `device=`, `.to("cuda")`, `.cuda()`) goes to the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]  # already where the trace keeps it
        if "device" in kwargs:
            kwargs = {**kwargs, "device": _to_cpu(kwargs["device"])}
        if func is torch.Tensor.to:
            args = tuple(tree_map(_to_cpu, a) if not isinstance(a, torch.Tensor) else a for a in args)
        return func(*args, **kwargs)


@contextlib.contextmanager
def script_autocast():
    """`torch.autocast("cuda", ...)` in the user's code enters the CUDA autocast emulation (the real
    one would disable itself: no CUDA here). Its `enabled` flag is kept, so an `enabled=False` region
    pauses the emulation as cuda_emulation's autocast regions already arrange."""
    cls = torch.amp.autocast_mode.autocast
    orig_init, orig_enter, orig_exit = cls.__init__, cls.__enter__, cls.__exit__

    def init(self, device_type, dtype=None, enabled=True, cache_enabled=None):
        self._harness_cuda = device_type == "cuda"
        if not self._harness_cuda:
            return orig_init(self, device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)
        self._enabled, self.device, self.fast_dtype = enabled, "cuda", dtype or torch.float16
        return None

    def enter(self):
        if not getattr(self, "_harness_cuda", False):
            return orig_enter(self)
        self._harness_stack = contextlib.ExitStack()
        if self._enabled:
            self._harness_stack.enter_context(cu.autocast_region(cu.CudaAutocast(self.fast_dtype)))
        return self

    def exit(self, *exc):
        if not getattr(self, "_harness_cuda", False):
            return orig_exit(self, *exc)
        self._harness_stack.close()
        return False

    cls.__init__, cls.__enter__, cls.__exit__ = init, enter, exit
    try:
        yield
    finally:
        cls.__init__, cls.__enter__, cls.__exit__ = orig_init, orig_enter, orig_exit


@contextlib.contextmanager
def quiet_cuda_calls():
    """Calls that only synchronize or reset counters do nothing on the virtual GPU."""
    names = ("synchronize", "empty_cache", "reset_peak_memory_stats", "reset_max_memory_allocated")
    saved = {n: getattr(torch.cuda, n) for n in names}
    for n in names:
        setattr(torch.cuda, n, lambda *a, **k: None)
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(torch.cuda, n, f)


@contextlib.contextmanager
def cuda_script_on_cpu():
    with script_autocast(), quiet_cuda_calls(), CudaDevicesOnCpu():
        yield
