"""A whole Python script, as it is, on the virtual GPU (`python -m harness script file.py ...`).

The script runs as `__main__` with its own argv, under the same emulation as a traced job
(cuda_emulation, cuda_script), with a plain script's defaults: a tensor made without a device is a
host tensor (small ones real, with values), and `torch.cuda` describes the card (virtual_cuda) - its
memory readings, snapshots and out-of-memory errors are the card's. Values do not exist on the
card: a value read (`loss.item()`) answers a stand-in (_ValueStandIns) and is reported once with its
line; code whose shapes depend on card values (nonzero, boolean masks) stops with its file and line.
"""

from __future__ import annotations

import contextlib
import os
import runpy
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from harness.allocator.settings import AllocSettings
from harness.config import cublas, kernels
from harness.config.point import Card
from harness.probe.jobs import CUDNN_LAYERS, prepare_optimizer
from harness.probe.sim import cuda_emulation as cu
from harness.probe.sim.cuda_script import cuda_script_on_cpu
from harness.probe.sim.fake_cache import fast_cache
from harness.probe.sim.fake_code import (
    VALUE_READS,
    explain,
    module_conversion_on_fake_tensors,
    shape_only_init,
    user_line,
)
from harness.probe.sim.tracker import StorageTracker
from harness.probe.sim.virtual_cuda import LiveAllocator, virtual_cuda


@dataclass
class ScriptRun:
    """What a script did on the virtual card: its allocator's counters at the end, the whole run's
    peaks (whatever the script reset), how it ended."""
    stats: dict
    peaks: dict = field(default_factory=dict)
    exit_code: int = 0
    error: BaseException | None = None  # what the script raised (SystemExit aside)
    value_reads: list[str] = field(default_factory=list)  # file:line of the first value read, if any
    compiled: list[str] = field(default_factory=list)  # file:line of the first torch.compile, run eagerly
    unmodelled: list[str] = field(default_factory=list)  # layers run through cuDNN: its memory is not modelled
    settings: AllocSettings = field(default_factory=AllocSettings)  # what it ended under (it may set them: LiveAllocator)


class _ValueStandIns(TorchDispatchMode):
    """`.item()` and friends (aten._local_scalar_dense) answer 0 (True for a bool): the virtual GPU
    has shapes, not values. Zero and true are what the checks of a healthy step read (GradScaler's
    found-inf count, `torch.isfinite(loss).all()`), so the step goes on as it would. Inside a
    torch.optim step the answer is 1 (a step count: bias corrections divide by 1 - beta**step).
    The first read's line outside torch.optim is kept for the report."""

    def __init__(self, reads: list[str]):
        super().__init__()
        self.reads = reads
        self.in_optimizer = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and isinstance(args[0], FakeTensor):
            value = 1 if self.in_optimizer else 0
            if not self.reads and not self.in_optimizer:
                self.reads.append(user_line())
            t = args[0]
            return True if t.dtype == torch.bool else float(value) if t.is_floating_point() or t.is_complex() else value
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _cuda_optimizers(stand_ins: _ValueStandIns):
    """torch.optim's implementation as CUDA picks it (foreach where it is left unset: on the trace's
    CPU tensors torch would run the for-loop), set before each optimizer's first step; and the
    stand-ins told when a step runs."""
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    seen: set[int] = set()

    def before(opt, *_):
        stand_ins.in_optimizer += 1
        if id(opt) not in seen:
            seen.add(id(opt))
            prepare_optimizer(opt, "auto", virtual=True)

    def after(opt, *_):
        stand_ins.in_optimizer -= 1

    hooks = [register_optimizer_step_pre_hook(before), register_optimizer_step_post_hook(after)]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()


@contextlib.contextmanager
def _eager_compile(notes: list[str]):
    """torch.compile returns the code as it is: the virtual GPU measures eager execution (a compiled
    graph fuses kernels and frees intermediates earlier, so its peak can be lower)."""
    original = torch.compile

    def compile(model=None, **kwargs):
        if not notes:
            notes.append(user_line())
        if model is None:  # @torch.compile(...) used as a decorator factory
            return lambda fn: fn
        return model

    torch.compile = compile  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.compile = original


@contextlib.contextmanager
def _unmodelled_layers(notes: list[str]):
    """Each layer class the script runs through cuDNN, whose own memory is not modelled
    (probe.jobs.UNMODELLED), with the script's line of its first call."""
    from torch.nn.modules.module import register_module_forward_pre_hook

    seen: set[str] = set()

    def called(module, _args):
        name = type(module).__name__
        if isinstance(module, CUDNN_LAYERS) and name not in seen:
            seen.add(name)
            notes.append(f"{name} (first at {user_line()})")

    hook = register_module_forward_pre_hook(called)
    try:
        yield
    finally:
        hook.remove()


@contextlib.contextmanager
def _host_profiler():
    """torch.profiler profiles the host side only: the virtual GPU runs no kernels to time (asked
    for CUDA activity, the CPU build warns with a stack trace at every op)."""
    from torch.profiler import ProfilerActivity, profile

    original = profile.__init__

    def init(self, *args, activities=None, use_cuda=None, **kwargs):
        if activities is not None:
            activities = [a for a in activities if a != ProfilerActivity.CUDA] or [ProfilerActivity.CPU]
        original(self, *args, activities=activities, **kwargs)

    profile.__init__ = init  # type: ignore[method-assign]
    try:
        yield
    finally:
        profile.__init__ = original  # type: ignore[method-assign]


@contextlib.contextmanager
def _as_main(path: Path, argv: list[str]):
    """sys.argv and sys.path as `python path argv...` would have them; torch's defaults the script
    may set (dtype, device) are put back after it."""
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    dtype, device = torch.get_default_dtype(), torch.utils._device.CURRENT_DEVICE
    sys.argv = [str(path), *argv]
    sys.path.insert(0, str(path.parent))
    try:
        yield
    finally:
        sys.argv[:], sys.path[:] = saved_argv, saved_path
        torch.set_default_dtype(dtype)
        torch.set_default_device(device)


def run_script(path: Path, argv: list[str], card: Card, settings: AllocSettings, environ=None) -> ScriptRun:
    """Run the script on the virtual `card` under `settings` (or, given `environ`, the os.environ the
    script runs in, under what torch reads there at its first allocation: LiveAllocator); never
    raises for the script's own errors."""
    tracker = StorageTracker(workspace_bytes=cublas.workspace_bytes(card.capability), geometry=kernels.geometry(card))
    tracker.auto_backward = True
    live = LiveAllocator(tracker, settings, card, eager=True, environ=environ)
    run = ScriptRun(stats={}, settings=settings)
    stand_ins = _ValueStandIns(run.value_reads)
    torch.manual_seed(0)
    with FakeTensorMode(allow_non_fake_inputs=True), fast_cache(), cu.unpacked_sequences(), cu.cuda_kernels(card.capability), \
            cuda_script_on_cpu(tracker, default_host=True), cu.checkpoint_keeps_autocast(), \
            module_conversion_on_fake_tensors(), shape_only_init(), tracker, stand_ins, _cuda_optimizers(stand_ins), \
            virtual_cuda(live), _eager_compile(run.compiled), _unmodelled_layers(run.unmodelled), _host_profiler(), \
            _as_main(path, argv):
        try:
            runpy.run_path(str(path), run_name="__main__")
        except SystemExit as e:
            run.exit_code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except KeyboardInterrupt as e:  # Ctrl-C: the script's frames and the peaks so far, as a shell reports it
            run.error, run.exit_code = e, 128 + signal.SIGINT
        except VALUE_READS as e:
            run.error, run.exit_code = explain(e, "in the script"), 1
        except Exception as e:  # the script's own error: reported with its traceback
            run.error, run.exit_code = e, 1
        run.stats, run.peaks, run.settings = live.stats(), live.peaks(), live.settings
    return run


def script_path(arg: str) -> Path:
    """The script named on the command line, as a path (it must exist and be a file)."""
    path = Path(arg).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"{arg}: no such script" if not path.exists() else f"{arg}: not a file")
    return Path(os.path.abspath(path))
