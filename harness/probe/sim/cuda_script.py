"""A plain CUDA training script's habits, on the virtual GPU (workload=custom on sim).

Public training code says `device = "cuda"`, `.to(device)`, `.cuda()`, `torch.autocast("cuda",
dtype=torch.bfloat16)` and `torch.cuda.synchronize()`. Fake CUDA tensors cannot run backward on a
torch without a GPU (fidelity.md, B), so the trace stays on fake CPU tensors: CUDA device arguments
become the CPU and the script's own CUDA autocast becomes the CUDA autocast emulation (torch.cuda's
own calls are virtual_cuda's). Nothing here runs on the cuda backend.

Where each tensor would live is kept beside it: the tracker counts device tensors only. A factory
call without a device makes a tensor where the code's default device is (the card inside a Job,
which the cuda backend builds and steps under `torch.device("cuda")`; the host in a plain script,
as in Python); `device=`, `.to(...)`, `.cuda()` and `.cpu()` say where; every other op's output
lives where its inputs do.
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves, tree_map

from harness.probe.sim import autocast_kernels

_CPU = torch.device("cpu")
# How a tensor on the card reports its device inside a trace: the CPU, where the trace keeps it, with
# an index, so that code passing it on (`torch.zeros(n, device=x.device)`) makes a tensor on the card
# as on CUDA, and a host tensor's plain "cpu" keeps meaning the host.
CARD_DEVICE = torch.device("cpu", 0)
# A plain script's host tensors up to this many elements are real (2^20: 8 MiB at most).
REAL_HOST_NUMEL = 1 << 20


def _is_cuda(x) -> bool:
    """A device on the card: CUDA's, or a card tensor's CARD_DEVICE."""
    if isinstance(x, torch.device):
        return x.type == "cuda" or x == CARD_DEVICE
    return isinstance(x, str) and (x.split(":")[0] == "cuda" or x == str(CARD_DEVICE))


def _to_cpu(x):
    return _CPU if _is_cuda(x) else x


def _placement(device, cpu_is_card: bool = False) -> str | None:
    """"device" (the card), "host", or None for an argument that names no device. `cpu_is_card`:
    a plain "cpu" is the card too (a sharded job's: FSDP2 allocates on its CPU mesh's device)."""
    if isinstance(device, bool):
        return None
    if isinstance(device, int) or _is_cuda(device):
        return "device"  # an int device is a CUDA ordinal
    if isinstance(device, torch.device) or (isinstance(device, str) and device.split(":")[0] == "cpu"):
        return "device" if cpu_is_card else "host"
    return None


def _has_tensor(values) -> bool:
    """A tensor among the arguments, or in a list of them (torch.cat's)."""
    for a in values:
        if isinstance(a, torch.Tensor):
            return True
        if isinstance(a, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in a):
            return True
    return False


_MOVES = (torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.cpu)


class CudaDevicesOnCpu(TorchFunctionMode):
    """Every CUDA device argument (factory `device=`, `.to("cuda")`, `.cuda()`) goes to the CPU,
    and the tracker is told where the call's outputs would live (its `placement`)."""

    def __init__(self, tracker, default_host: bool, real_host: bool = False, cpu_is_card: bool = False):
        super().__init__()
        self.tracker = tracker
        self.default_host = default_host
        self.real_host = real_host
        self.cpu_is_card = cpu_is_card
        from torch.utils._device import _device_constructors

        self.constructors = _device_constructors()

    def _target(self, func, args, kwargs) -> str | None:
        if func is torch.Tensor.cuda:
            return "device"
        if func is torch.Tensor.cpu or kwargs.get("pin_memory"):
            return "host"
        if "device" in kwargs and kwargs["device"] is not None:
            return _placement(kwargs["device"], self.cpu_is_card)
        if func is torch.Tensor.to:
            for a in args[1:]:
                where = self.tracker.placement_of(a) if isinstance(a, torch.Tensor) else _placement(a, self.cpu_is_card)
                if where is not None:
                    return where
            return None
        if not _has_tensor(args) and not _has_tensor(kwargs.values()):
            # a factory: the default device (`torch.set_default_device`, `with torch.device(...)`)
            current = torch.utils._device.CURRENT_DEVICE
            if current is not None:
                return _placement(current, self.cpu_is_card) or "device"
            return "host" if self.default_host else "device"
        return None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.pin_memory:
            return args[0]  # page-locked host memory is host memory; the trace has none to lock
        target = self._target(func, args, kwargs)
        if target is None and not self.real_host and func not in _MOVES and kwargs.get("device") is None \
                and func not in self.constructors:
            return func(*args, **kwargs)  # most calls: nothing to move or place (placed(None) keeps it)
        if kwargs.get("pin_memory"):
            kwargs = {**kwargs, "pin_memory": False}
        if func in _MOVES:
            source = args[0]
            if target is None or target == self.tracker.placement_of(source):
                if func is not torch.Tensor.to:
                    return source  # already there
            else:  # a copy on the other side (the trace keeps both on the CPU: force it)
                func, args, kwargs = torch.Tensor.to, (source, _CPU), {"copy": True, **_dtype_only(func, args, kwargs)}
        if kwargs.get("device") is not None:
            kwargs = {**kwargs, "device": _to_cpu(kwargs["device"])}
        elif func in self.constructors:
            kwargs = {**kwargs, "device": _CPU}  # torch's default-device mode, below this one, adds none
        if func is torch.Tensor.to:
            args = tuple(tree_map(_to_cpu, a) if not isinstance(a, torch.Tensor) else a for a in args)
        with self.tracker.placed(target):
            if self.real_host and target != "device" and func not in _MOVES:
                return self._on_the_host(func, args, kwargs, target)
            return func(*args, **kwargs)

    def _on_the_host(self, func, args, kwargs, target):
        """A plain script's host work on real tensors, which carry values (indices, a batch sampled
        on the host): an op on real tensors only, and a factory of at most REAL_HOST_NUMEL elements
        (a larger one stays shapes only: a model built on the host before it moves)."""
        from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

        tensors = [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        if tensors:
            if any(isinstance(t, FakeTensor) for t in tensors):
                return func(*args, **kwargs)
            with unset_fake_temporarily():
                return func(*args, **kwargs)
        if target != "host":
            return func(*args, **kwargs)
        out = func(*args, **kwargs)  # shapes first: is it small enough to make for real?
        if all(t.numel() <= REAL_HOST_NUMEL for t in tree_leaves(out) if isinstance(t, torch.Tensor)):
            with unset_fake_temporarily():
                return func(*args, **kwargs)
        return out


def _dtype_only(func, args, kwargs) -> dict:
    """What a move keeps beside its device: the dtype and memory format asked for."""
    if func is not torch.Tensor.to:
        return {}
    keep = {k: v for k, v in kwargs.items() if k in ("dtype", "memory_format")}
    for a in args[1:]:
        if isinstance(a, torch.dtype):
            keep["dtype"] = a
        elif isinstance(a, torch.Tensor):
            keep["dtype"] = a.dtype
    return keep


@contextlib.contextmanager
def script_autocast(cpu_is_card: bool = False):
    """`torch.autocast("cuda", ...)` in the code (the job's, torch's, transformers') is a region of the
    CUDA autocast emulation (the real one would disable itself: no CUDA here), its `enabled` flag
    kept (an `enabled=False` region pauses it); so is `torch.autocast("cpu", ...)` where the CPU
    stands for the card (`cpu_is_card`), else it is the host's, which a CUDA run's device tensors
    never see: nothing here. The code's questions about the state (`torch.is_autocast_enabled("cuda")`,
    `torch.get_autocast_dtype`) are answered as on the GPU."""
    cls = torch.amp.autocast_mode.autocast
    orig_init, orig_enter, orig_exit = cls.__init__, cls.__enter__, cls.__exit__
    queries = torch.is_autocast_enabled, torch.get_autocast_dtype, torch.get_autocast_gpu_dtype
    card = ("cuda", "cpu") if cpu_is_card else ("cuda",)

    def init(self, device_type, dtype=None, enabled=True, cache_enabled=None):
        self._harness = "card" if device_type in card else "host" if device_type == "cpu" else None
        if self._harness is None:
            return orig_init(self, device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)
        self.device, self._enabled, self._cache_enabled = device_type, enabled, cache_enabled
        self.fast_dtype = dtype or queries[1]("cuda")  # (the card's default: fp16)
        return None

    def enter(self):
        if getattr(self, "_harness", None) is None:
            return orig_enter(self)
        self._harness_stack = contextlib.ExitStack()
        if self._harness == "card":
            self._harness_stack.enter_context(autocast_kernels.region(self.fast_dtype, self._enabled, self._cache_enabled))
        return self

    def exit(self, *exc):
        if getattr(self, "_harness", None) is None:
            return orig_exit(self, *exc)
        self._harness_stack.close()
        return False

    def is_enabled(device_type="cuda"):  # (without an argument torch asks about CUDA)
        if device_type in card:
            return autocast_kernels.active() is not None
        return False if device_type == "cpu" else queries[0](device_type)

    def dtype_of(device_type):
        low = autocast_kernels.active()
        return low if device_type in card and low is not None else queries[1](device_type)

    cls.__init__, cls.__enter__, cls.__exit__ = init, enter, exit  # type: ignore[method-assign]  # restored below
    torch.is_autocast_enabled, torch.get_autocast_dtype = is_enabled, dtype_of
    torch.get_autocast_gpu_dtype = lambda: dtype_of("cuda")
    try:
        yield
    finally:
        cls.__init__, cls.__enter__, cls.__exit__ = orig_init, orig_enter, orig_exit  # type: ignore[method-assign]
        torch.is_autocast_enabled, torch.get_autocast_dtype, torch.get_autocast_gpu_dtype = queries


@contextlib.contextmanager
def card_devices(tracker):
    """`t.device` of a tensor on the card answers CARD_DEVICE to the code (FakeTensorMode's own
    device propagation, inside its dispatch, still sees the CPU)."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    inside = [0]
    base_device = torch._C.TensorBase.device.__get__  # type: ignore[attr-defined]
    fake_property = FakeTensor.device
    original_dispatch = FakeTensorMode.__torch_dispatch__

    def dispatch(self, *args, **kwargs):
        inside[0] += 1
        try:
            return original_dispatch(self, *args, **kwargs)
        finally:
            inside[0] -= 1

    def reported(t, device):
        if device.type != "cpu" or device.index is not None or inside[0]:
            return device
        try:
            on_card = tracker.placement_of(t) == "device"
        except (RuntimeError, NotImplementedError):  # no storage (sparse, nested): as it is
            return device
        return CARD_DEVICE if on_card else device

    torch.Tensor.device = property(lambda t: reported(t, base_device(t)))  # type: ignore[assignment,method-assign]
    FakeTensor.device = property(lambda t: reported(t, fake_property.fget(t)))  # type: ignore[assignment,method-assign,attr-defined]
    FakeTensorMode.__torch_dispatch__ = dispatch  # type: ignore[method-assign]
    try:
        yield
    finally:
        del torch.Tensor.device
        FakeTensor.device = fake_property  # type: ignore[method-assign]
        FakeTensorMode.__torch_dispatch__ = original_dispatch  # type: ignore[method-assign]


@contextlib.contextmanager
def backward_inside(mode: TorchFunctionMode):
    """The autograd engine runs inside `mode`: Python of the model's own runs in backward (a
    checkpointed layer's recompute, FSDP2's hooks) but a mode is popped while its handler runs, and
    `Tensor.backward` reaches the engine through it, so that code saw CUDA devices as they are
    (transformers' MoE recompute: `torch.arange(n, device=x.device)` on the card, its operand on
    the host). PyTorch patches the same entry for make_fx (torch.compiler._patch_engine_backward)."""
    import torch.autograd.graph
    from torch.overrides import _get_current_function_mode_stack

    original = torch.autograd.graph._engine_run_backward

    def run_backward(*args, **kwargs):
        # one run from inside another's node (a reentrant checkpoint's) is nested (tracker._backward_module)
        nested = torch._C._current_graph_task_id() != -1
        mode.tracker.nested_backward += nested
        try:
            if mode in _get_current_function_mode_stack():
                return original(*args, **kwargs)
            with mode:
                return original(*args, **kwargs)
        finally:
            mode.tracker.nested_backward -= nested

    torch.autograd.graph._engine_run_backward = run_backward
    torch.autograd._engine_run_backward = run_backward  # type: ignore[attr-defined]
    try:
        yield
    finally:
        torch.autograd.graph._engine_run_backward = original
        torch.autograd._engine_run_backward = original  # type: ignore[attr-defined]


@contextlib.contextmanager
def cuda_script_on_cpu(tracker, default_host: bool = False, cpu_is_card: bool = False):
    """`default_host`: a plain script's defaults - a factory call without a device makes a host
    tensor, and small host tensors are real (see CudaDevicesOnCpu._on_the_host); inside a Job the
    default device is the card and every tensor is shapes only. `cpu_is_card`: see _placement."""
    tracker.real_is_host = default_host
    # With the CPU the card, a card tensor reports the CPU as it is (FSDP2 checks its parameters
    # are on its mesh's device)
    reporting = contextlib.nullcontext() if cpu_is_card else card_devices(tracker)
    mode = CudaDevicesOnCpu(tracker, default_host, real_host=default_host, cpu_is_card=cpu_is_card)
    host = autocast_kernels.real_tensors_on_the_host() if default_host else contextlib.nullcontext()
    with script_autocast(cpu_is_card), host, reporting, backward_inside(mode), mode:
        yield
