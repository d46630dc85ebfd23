"""Storage-level memory tracker: the ordered birth and death of every tensor storage.

A `TorchDispatchMode` sees every op's outputs; each new storage becomes an `alloc` event and a
`weakref.finalize` on it becomes the matching `free`. The tracker holds no tensor, storage or
autograd graph (only integer keys and finalizers), so it cannot keep memory alive by itself -
the side effect that makes MemTracker over-count forward loops run with gradients enabled.
"""

from __future__ import annotations

import bisect
import contextlib
import os
import sys
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch._prims_common import is_non_overlapping_and_dense_or_false
from torch._subclasses.fake_tensor import FakeTensor, _device_handler
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

# The CUDA caching allocator rounds every request up to kMinBlockSize (512 B): round_plain, what
# max_memory_allocated counts. Segment-level rounding is the allocator model's business.
from harness.allocator.model import round_plain
from harness.config import attention, cublas, kernels
from harness.probe.sim import kernel_scratch
from harness.probe.sim.cuda_emulation import grouped_mm_output

# cuBLAS workspace PyTorch allocates through its own allocator on a thread's first GEMM
# (at::cuda::getNewWorkspace): 8,519,680 B per handle in real traces (fidelity.md, C.5).
CUBLAS_WORKSPACE_BYTES = cublas.DEFAULT_BYTES  # below Hopper; a card's own: config.cublas
_OPEN = 1 << 64  # the end of a module call's span while it runs (past any sequence number)

KINDS = ("parameter", "gradient", "optimizer_state", "activation", "temporary", "input", "workspace")

# cuBLAS-backed ops. Under no_grad and inference_mode composite ops (linear, matmul, einsum,
# SDPA's math path) reach the tracker undecomposed, so they are listed too.
_GEMM_OPS = {
    "mm", "addmm", "bmm", "baddbmm", "addbmm", "addmv", "mv", "dot", "vdot", "_addmm_activation",
    "linear", "matmul", "_scaled_mm", "einsum", "tensordot", "bilinear", "chain_matmul",
    "linalg_multi_dot", "_scaled_dot_product_attention_math",
}

_aten = torch.ops.aten
# Backward formulas that fill a fresh zeros tensor (gather, index, index_select, take, max/topk/
# sort's value selection) do it in place in eager mode, and out of place when any tensor is
# "subclass-like" - which every tensor is while a dispatch mode (this one, FakeTensorMode) is
# active: one input-sized temporary that eager CUDA never allocates (fidelity.md, C.2).
_ZEROS_OPS = {_aten.zeros.default, _aten.new_zeros.default, _aten.zeros_like.default}
# `t.device` of a fake tensor, asked of the modes (two in three of a training step's dispatches,
# mostly autograd's engine): it makes no storage, so nothing here applies to it.
_DEVICE_QUERY = torch.ops.prim.device.default
# A functional collective's result (tensor parallel's all-reduces) is wrapped, in eager, in a
# tensor that waits for it where it is first used, and the wait returns the tensor it waited for;
# both ops' fake (meta) kernels make a new tensor instead. On fake tensors they do what eager does.
# (The wrap is registered by torch.distributed._functional_collectives, once imported.)
_WAIT = torch.ops._c10d_functional.wait_tensor.default if torch.distributed.is_available() else None


def _wrap_op():
    wrap = getattr(torch.ops._c10d_functional, "_wrap_tensor_autograd", None) if _WAIT is not None else None
    return wrap.default if wrap is not None else None
_IN_PLACE_IN_EAGER = {
    _aten.scatter_add.default: _aten.scatter_add_.default,
    _aten.scatter.src: _aten.scatter_.src,
    _aten.scatter.value: _aten.scatter_.value,
    _aten.index_add.default: _aten.index_add_.default,
    _aten.index_put.default: _aten.index_put_.default,
    _aten.put.default: _aten.put_.default,
    _aten.index_fill.int_Tensor: _aten.index_fill_.int_Tensor,
    _aten.index_fill.int_Scalar: _aten.index_fill_.int_Scalar,
}
# The engine sums the gradients a tensor gets from its several consumers (InputBuffer::accumulate,
# torch/csrc/autograd/input_buffer.cpp) in place, old.add_(new), where the one in the buffer is a
# dense tensor it holds the last reference to; out of place where a tensor is subclass-like, as
# every tensor is under a dispatch mode: a gradient-sized temporary per extra consumer (q/k/v's
# shared input, the residual stream) that eager CUDA never allocates (measured on an H200: 7 of
# 8 MiB a layer of demo-1b in bf16).
_ADD = _aten.add.Tensor
_ADD_IN_PLACE = _aten.add_.Tensor
# A tensor alone on its storage reads 2 uses, fake or real: it and the storage object the reading makes
_SOLE_STORAGE_USES = 2

# cuDNN's forward makes its philox seed and offset (8 B each) before its output and log-sum-exp
_CUDNN_FORWARD = _aten._scaled_dot_product_cudnn_attention.default
_FLASH_FORWARD = _aten._scaled_dot_product_flash_attention.default
_EFFICIENT_FORWARD = _aten._scaled_dot_product_efficient_attention.default
_GROUPED_MM = _aten._grouped_mm.default
# Dropout ops reach dispatch whole under inference_mode (composite: elsewhere autograd decomposes
# them). Eager's kernel hands its input back where it drops nothing (_dropout_impl: p == 0, not
# training, or empty); fake's decomposition clones it, an activation the size of every attention
# score of Gemma's eager attention, of every GPT-2 residual, per layer and decode step.
_DROPOUTS = frozenset({_aten.dropout.default, _aten.feature_dropout.default, _aten.alpha_dropout.default,
                       _aten.feature_alpha_dropout.default})
_function_modes = torch._C._len_torch_function_stack
_pop_function_mode, _push_function_mode = torch._C._pop_torch_function_stack, torch._C._push_on_torch_function_stack
# The fused forwards' outputs their rows name (config.attention.fused_code), by position: cuDNN's in
# the order it makes them, flash's in its outputs' order (its others are empty: none tracked)
_CUDNN_OUTPUTS = ((6, "seed"), (7, "offset"), (0, "out"), (1, "lse"))
_FLASH_OUTPUTS = {0: "out", 1: "lse", 6: "rng", 7: "unused"}
_ENGINE_FILE = os.path.join("torch", "autograd", "graph.py")
_WRAPPER_FILES = (os.path.join("torch", "_compile.py"), os.path.join("torch", "_dynamo", "eval_frame.py"))


def _in_autograd_formula() -> bool:
    """Whether an op comes from autograd's C++ formulas (the engine running, no Python between it
    and this mode but torch's dynamo-disable wrappers) rather than from a custom Function's
    backward or a checkpoint's recompute."""
    if torch._C._current_graph_task_id() == -1:
        return False
    caller = sys._getframe(3)  # _dispatch <- __torch_dispatch__ <- its caller
    while caller is not None and caller.f_code.co_filename.endswith(_WRAPPER_FILES):
        caller = caller.f_back
    return caller is not None and caller.f_code.co_filename.endswith(_ENGINE_FILE)


def _drops_nothing(input, p, train) -> bool:
    return p == 0 or not train or input.numel() == 0


def _accumulates_in_place(args, kwargs) -> bool:
    """Whether eager autograd would sum `args` (old, new) into old: grad mode off, same shapes and
    dtypes, old dense and alone on its storage (the engine's buffer holds the last reference)."""
    if kwargs or len(args) != 2 or torch.is_grad_enabled():
        return False
    old, new = args
    return (isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor) and old.shape == new.shape
            and old.dtype == new.dtype and is_non_overlapping_and_dense_or_false(old)
            and torch._C._storage_Use_Count(old.untyped_storage()._cdata) <= _SOLE_STORAGE_USES)


def _tensors(values) -> list[torch.Tensor]:
    """The tensors among an aten op's arguments or outputs: tensors and lists of them, one level
    deep as aten's schemas have them (pytree for anything else: it costs ~10 us an op)."""
    out = []
    for v in values:
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            if all(isinstance(x, torch.Tensor) or not isinstance(x, (list, tuple, dict)) for x in v):
                out.extend(x for x in v if isinstance(x, torch.Tensor))
            else:
                out.extend(x for x in tree_leaves(v) if isinstance(x, torch.Tensor))
        elif isinstance(v, dict):
            out.extend(x for x in tree_leaves(v) if isinstance(x, torch.Tensor))
    return out


def counted(nbytes: int) -> int:
    """The bytes max_memory_allocated counts for a storage of `nbytes` (round_plain); none for a
    launch's 0-B placeholder (kernel_scratch), which allocates nothing."""
    return round_plain(nbytes) if nbytes else 0


class TraceEvent(NamedTuple):
    """One storage's birth or death on the virtual GPU, in order (a row of trace.parquet); in the
    tracker's journal also a storage's change of kind (retag) and a step's end (end)."""
    seq: int
    action: str  # alloc | free (the trace); retag | end (the journal only)
    key: int  # the storage's identity while it lives
    size: int  # requested bytes (the allocator rounds them)
    kind: str  # parameter | gradient | optimizer_state | activation | temporary | input | workspace
    phase: str
    step: int  # -1: before the first step
    module: str  # the innermost module running, "" outside any; in the optimizer's step an alloc's parameter's
    stream: int = 0  # the CUDA stream the storage was allocated on (0: the default stream)
    # A kernel's own scratch whose bytes depend on the card: its launch (config.kernels' code), for
    # another card's size (record.trace_store.sized_for); a fused attention kernel's outputs and
    # scratch (config.attention.fused_code), for the other's (probe.sim.fused_swap); "" for any other
    kernel: str = ""


class _NoWrapper:  # what no tensor is, before torch.distributed._functional_collectives is imported
    pass


def _collective_wrapper() -> type[Any]:
    """AsyncCollectiveTensor, the wrapper a functional collective's result waits in (once imported)."""
    funcol = sys.modules.get("torch.distributed._functional_collectives")
    return funcol.AsyncCollectiveTensor if funcol is not None else _NoWrapper


def _own(t: torch.Tensor) -> torch.Tensor:
    """The tensor holding `t`'s storage: a DTensor's local shard (a sharded job's parameters,
    gradients and optimizer state), a functional collective's result behind the wrapper that waits
    for it (AsyncCollectiveTensor, on real ranks; a DTensor's local shard may be one: a layer's
    input all-reduced by the embedding before it, made a DTensor unwaited), else `t`."""
    local = getattr(t, "_local_tensor", None)
    if isinstance(local, torch.Tensor):
        return _own(local)
    return _own(t.elem) if isinstance(t, _collective_wrapper()) else t


class StorageTracker(TorchDispatchMode):
    """Records alloc/free events per storage with kind, phase, step and module."""

    def __init__(self, emulate_cublas_workspace: bool = True, workspace_bytes: int = CUBLAS_WORKSPACE_BYTES,
                 geometry: kernels.Geometry = kernels.ANY_CARD):
        super().__init__()
        self._wrap = _wrap_op()  # a functional collective's eager wrap (see _WAIT)
        self.events: list[TraceEvent] = []
        # What the record's columns need beside the events (kinds changing, steps ending), in the
        # same sequence: the journal (probe.sim.ledger) is both, merged.
        self.marks: list[TraceEvent] = []
        self._seq = 0  # the next entry's seq (monotone: a dropped alloc leaves a gap)
        # Off once the steps are done: what the probe does after them (the holder search's
        # collection, the job's teardown) is counted but not journaled (no step's figure depends
        # on it, and the cyclic GC frees in no fixed order).
        self.recording = True
        self.findings: dict[str, Any] = {}  # what the probe found after the steps (e.g. retained_holder)
        self.attention_calls: list = []  # each distinct attention call (config.attention.Call): cuda_kernels
        self._live: dict[int, list] = {}  # key -> [requested, allocated, kind, stream]
        self.kind_bytes = {k: 0 for k in KINDS}
        self.allocated = 0
        self.requested = 0
        self.phase = "setup"
        self.step = -1
        self.module_stack: list[str] = []
        # Backward names the module whose forward made the autograd node running (_backward_module):
        # each module call's span of autograd sequence numbers, [start, end, name, enclosing span],
        # in the order the calls began (the starts sorted), and the spans still open
        self._spans: list[list] = []
        self._open_spans: list[int] = []
        self.nested_backward = 0  # > 0 inside a backward a node of the running one started (reentrant checkpoints)
        # The optimizer's step charges each allocation to the module of the parameter it is for
        # (_owner): storage key -> module, for the parameters and what the step made of them
        self._parameters: list[tuple[str, torch.Tensor]] = []
        self._owners: dict[int, str] = {}
        self.stream = 0  # the current stream's id (virtual_cuda's streams set it); 0: the default
        self.emulate_cublas_workspace = emulate_cublas_workspace
        self.workspace_bytes = workspace_bytes  # one cuBLAS workspace on the card (config.cublas)
        self.geometry = geometry  # what sizes kernels' scratch on the card (config.kernels)
        self._workspaces: set[tuple[str, int]] = set()
        self._next_synthetic = -1
        self._fresh_zeros = 0  # storage key of the last zeros a backward formula made
        self._host: set[int] = set()  # keys of storages a real run keeps in host memory (not counted)
        self._resized_away: set[int] = set()  # keys of tracked storages resized to nothing (resized)
        self.inside_collective = 0  # > 0 while a torch.distributed collective runs
        self.kind_override: str | None = None  # the kind of what is made meanwhile, whatever the phase
        # (collective, step, over tensor parallel's mesh) -> bytes (sharded.collectives_own_buffers)
        self.traffic: dict[tuple[str, int, bool], int] = {}
        self.real_is_host = False  # a plain script on fake tensors: its real tensors are host tensors
        self.placement: str | None = None  # where the running call's outputs live (cuda_script)
        # A user's step has no phase marks: count what runs inside autograd's engine as backward.
        self.auto_backward = False
        # Followers of the events (virtual_cuda.LiveAllocator): called after each alloc event, and
        # with (key, index) when an alloc event is taken back.
        self.after_alloc: Callable[[], None] | None = None
        self.on_drop: Callable[[int, int], None] | None = None

    # ---- phases and steps ------------------------------------------------------------
    def begin_step(self, step: int) -> None:
        self.step = step

    def end_step(self) -> None:
        self._mark("end", 0, 0, "")

    def _mark(self, action: str, key: int, size: int, kind: str, stream: int = 0) -> None:
        if not self.recording:
            return
        self.marks.append(TraceEvent(self._seq, action, key, size, kind, self._phase(), self.step, "", stream))
        self._seq += 1

    def journal(self) -> list[TraceEvent]:
        """The events and the marks in the order they happened."""
        return sorted([*self.events, *self.marks], key=lambda e: e.seq)

    def set_phase(self, phase: str) -> None:
        self.phase = phase
        if phase == "optimizer":  # (a sharded parameter's storage is its local shard's, now)
            self._owners.update((_own(p).untyped_storage()._cdata, name) for name, p in self._parameters)

    def _phase(self) -> str:
        # Inside autograd's engine it is backward, whatever the step last named (its forward, or a
        # phase of its own such as "head").
        if self.auto_backward and torch._C._current_graph_task_id() != -1:
            return "backward"
        return self.phase

    # ---- bookkeeping -----------------------------------------------------------------
    def _record_alloc(self, key: int, nbytes: int, kind: str, kernel: str = "", module: str | None = None) -> None:
        alloc = counted(nbytes)
        self._live[key] = [nbytes, alloc, kind, self.stream]
        self.allocated += alloc
        self.requested += nbytes
        self.kind_bytes[kind] += alloc
        if not self.recording:
            return
        if module is None:
            module = self.module_stack[-1] if self.module_stack else self._backward_module()
        self.events.append(TraceEvent(self._seq, "alloc", key, nbytes, kind, self._phase(), self.step, module,
                                      self.stream, kernel))
        self._seq += 1
        if self.after_alloc is not None:
            self.after_alloc()

    def _forget(self, key: int) -> list | None:
        """Stop counting a live storage; returns its [requested, allocated, kind, stream] entry."""
        entry = self._live.pop(key, None)
        if entry is not None:
            self.allocated -= entry[1]
            self.requested -= entry[0]
            self.kind_bytes[entry[2]] -= entry[1]
        return entry

    def _record_free(self, key: int) -> None:
        self._owners.pop(key, None)
        entry = self._forget(key)
        if entry is not None and self.recording:
            self.events.append(TraceEvent(self._seq, "free", key, entry[0], entry[2], self._phase(), self.step, "",
                                          entry[3]))
            self._seq += 1

    def track(self, t: torch.Tensor, kind: str, host: bool = False, kernel: str = "",
              module: str | None = None) -> None:
        """Start tracking a tensor's storage (idempotent); `kind` (and the kernel's code, see
        TraceEvent.kernel) applies if it is new. A host storage is remembered as such and not counted."""
        st = _own(t).untyped_storage()
        key = st._cdata
        if key in self._live or key in self._host or st.nbytes() == 0:
            return
        if host or self.inside_collective:  # (a communication backend's own: sharded.collectives_own_buffers)
            self._host.add(key)
            weakref.finalize(st, self._host.discard, key)
            return
        self._record_alloc(key, st.nbytes(), kind, kernel, module)
        if module:
            self._owners[key] = module
        weakref.finalize(st, self._record_free, key)

    def resized(self, st, nbytes: int) -> None:
        """A tracked storage's resize_ (FSDP2 frees a gathered layer by resizing its storage to 0
        and gathers it again into the same storage): on CUDA its block is freed and a new one
        allocated, so a free, then an alloc of the new size (its kind: the phase's)."""
        key = st._cdata
        if key in self._live and nbytes != self._live[key][0]:
            self._record_free(key)
            self._resized_away.add(key)
        if key in self._resized_away and nbytes > 0:
            self._resized_away.discard(key)
            self._record_alloc(key, nbytes, self._default_kind())

    # ---- host and device -------------------------------------------------------------
    def _on_host(self, t: torch.Tensor) -> bool:
        return t.untyped_storage()._cdata in self._host or (self.real_is_host and not isinstance(t, FakeTensor))

    def placement_of(self, t: torch.Tensor) -> str:
        return "host" if self._on_host(t) else "device"

    @contextlib.contextmanager
    def placed(self, placement: str | None):
        """Outputs made inside live on `placement` ("host" or "device"; None: where inputs are)."""
        previous, self.placement = self.placement, placement if placement is not None else self.placement
        try:
            yield
        finally:
            self.placement = previous

    def _outputs_on_host(self, args, kwargs) -> bool:
        if self.placement is not None:
            return self.placement == "host"
        if not self._host and not self.real_is_host:
            return False
        inputs = [*_tensors(args), *_tensors(kwargs.values() if kwargs else ())]
        return bool(inputs) and all(self._on_host(a) for a in inputs)

    def retag(self, t: torch.Tensor | None, kind: str) -> None:
        """Move a live storage to another kind (e.g. a new tensor that became a .grad)."""
        if t is None:
            return
        t = _own(t)
        entry = self._live.get(t.untyped_storage()._cdata)
        if entry is None or entry[2] == kind:
            return
        self.kind_bytes[entry[2]] -= entry[1]
        self.kind_bytes[kind] += entry[1]
        entry[2] = kind
        self._mark("retag", t.untyped_storage()._cdata, entry[0], kind, entry[3])

    def drop(self, t: torch.Tensor) -> None:
        """Forget a storage that a real CUDA run keeps on the host (e.g. optimizer step counts):
        its alloc event goes, and so will its free."""
        key = _own(t).untyped_storage()._cdata
        if self._forget(key) is None:
            return
        for i in range(len(self.events) - 1, -1, -1):
            if self.events[i].key == key and self.events[i].action == "alloc":
                del self.events[i]
                if self.on_drop is not None:
                    self.on_drop(key, i)
                break

    def allocated_bytes_of(self, t: torch.Tensor) -> int:
        """Bytes the allocator holds for t's storage (0 if untracked or on the host)."""
        entry = self._live.get(_own(t).untyped_storage()._cdata)
        return entry[1] if entry else 0

    def _default_kind(self) -> str:
        if self.kind_override is not None:
            return self.kind_override
        phase = self._phase()
        if phase == "setup":
            return "parameter"
        if phase == "input":
            return "input"
        if phase in ("backward", "optimizer", "zero_grad"):
            return "temporary"  # retagged when they become grads / optimizer state
        return "activation"  # forward, prefill, decode, or a forward phase a job named itself

    def _workspace(self, func) -> None:
        # One workspace per cuBLAS handle and stream (at::cuda's cublas_handle_stream_to_workspace):
        # a handle per CPU thread that issues GEMMs, the caller's for forward and the autograd
        # engine's device thread's for backward (including checkpoint recompute).
        handle = ("backward" if self._phase() == "backward" else "forward", self.stream)
        if handle in self._workspaces:
            return
        self._workspaces.add(handle)
        self._record_alloc(self._synthetic_key(), self.workspace_bytes, "workspace")

    def _synthetic_key(self) -> int:
        # an allocation no storage owns (a workspace, a kernel's scratch): keys below 0, never reused
        self._next_synthetic -= 1
        return self._next_synthetic + 1

    # ---- dispatch --------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _DEVICE_QUERY and isinstance(args[0], FakeTensor):
            # fake's own answer, from its handler, without passing down the mode stack (nor popping
            # the function modes around it): two in three of a step's dispatches
            return _device_handler(args)
        if not _function_modes():
            return self._dispatch(func, types, args, kwargs)
        # an op the autograd engine runs inside a torch-function mode (cuda_script.backward_inside):
        # dispatched without it, as a forward op is (each mode popped while its handler runs), else
        # every call of this code and fake's (untyped_storage, device) passes through it: 4-6% more calls
        modes = []
        while _function_modes():
            modes.append(_pop_function_mode())
        try:
            return self._dispatch(func, types, args, kwargs)
        finally:
            for m in reversed(modes):
                _push_function_mode(m)

    def _dispatch(self, func, types, args=(), kwargs=None):
        if func is _DEVICE_QUERY:
            return func(*args, **(kwargs or {}))
        if func in _DROPOUTS and _drops_nothing(*args, **(kwargs or {})):
            return args[0]
        if (func is _WAIT or func is self._wrap) and isinstance(args[0], FakeTensor):
            if func is _WAIT:
                return args[0]
            from torch.distributed._functional_collectives import AsyncCollectiveTensor
            return AsyncCollectiveTensor(args[0])
        wrapper = _collective_wrapper()
        if any(isinstance(a, wrapper) for a in args):
            # its wait, from inside the wrapper, would be fake's (a new tensor, unseen here): the
            # waited tensor itself, as in eager. Under inference_mode a composite op (view_as, which
            # DTensor.from_local calls) reaches the wrapper whole, and waits.
            args = tuple(a.elem if isinstance(a, wrapper) and isinstance(a.elem, FakeTensor) else a for a in args)
        in_place = _IN_PLACE_IN_EAGER.get(func)
        if in_place is not None and self._fresh_zeros and isinstance(args[0], torch.Tensor) \
                and args[0].untyped_storage()._cdata == self._fresh_zeros and _in_autograd_formula():
            self._fresh_zeros = 0
            return in_place(*args, **(kwargs or {}))
        if func is _ADD and _accumulates_in_place(args, kwargs) and _in_autograd_formula():
            return _ADD_IN_PLACE(*args)
        if func is _GROUPED_MM and isinstance(args[0], FakeTensor):
            # CUDA's output, its rows padded to 16 B, for bf16 too (the meta function pads only on a
            # CUDA build of torch); operands not both bf16 take CUDA's loop, which fake's meta refuses
            out = grouped_mm_output(*args, **(kwargs or {}))
        else:
            out = func(*args, **(kwargs or {}))
        if func in _ZEROS_OPS and _in_autograd_formula():
            self._fresh_zeros = out.untyped_storage()._cdata
        host = self._outputs_on_host(args, kwargs)
        kind = self._default_kind()
        if func is _CUDNN_FORWARD:
            made = [(out[i], attention.fused_code("fwd", role)) for i, role in _CUDNN_OUTPUTS]
        elif func is _FLASH_FORWARD:
            made = [(t, attention.fused_code("fwd", _FLASH_OUTPUTS[i]) if i in _FLASH_OUTPUTS else "")
                    for i, t in enumerate(out) if isinstance(t, torch.Tensor)]
        elif func is _EFFICIENT_FORWARD and not self.geometry.rocm:
            # its philox seed and offset are host tensors outside CUDA graphs (attention.cu,
            # _efficient_attention_forward; an H200's history has no 8-B blocks per layer)
            for t in out[2:]:
                self.track(t, kind, host=True)
            made = [(t, "") for t in out[:2]]
        else:
            made = [(t, "") for t in _tensors((out,))]
        scratch = [] if host else kernel_scratch.of(func, args, kwargs, self.geometry)
        # the op's scratch comes after its outputs, but for what it makes before them (the
        # embedding's backward: its sort); flash's forward makes its split-KV accumulators after its
        # output and log-sum-exp, before its RNG state and unused tensor (mha_fwd; an H200's memory
        # history)
        first = sum(1 for s in scratch if s.early)
        keys: dict[int, int] = {}
        self._scratch_made(scratch, keys, 0, first)
        before = 2 if func is _FLASH_FORWARD and scratch else len(made)
        owners = self._owner(args, len(made)) if self._owners and self._phase() == "optimizer" else None
        for i, (t, code) in enumerate(made):
            if i == before:
                self._scratch_made(scratch, keys, first, len(scratch))
            if t.device.type != "meta":
                self.track(t, kind, host or (self.real_is_host and not isinstance(t, FakeTensor)), code,
                           owners[i] if owners else None)
        # the GEMM's output is allocated first, then the handle's workspace (at its first call; an
        # H200's snapshot: the rotary embedding's 262,144 B product, then 33,554,432 B)
        if self.emulate_cublas_workspace and not host and func.overloadpacket.__name__ in _GEMM_OPS:
            self._workspace(func)
        if scratch:
            if before >= len(made):
                self._scratch_made(scratch, keys, first, len(scratch))
            left = list(keys.values())
            for key in left if kernel_scratch.freed_in_order(func) else reversed(left):  # before the op returns
                self._record_free(key)
        return out

    def _owner(self, args, n: int) -> list[str | None]:
        """For each of an optimizer's op's `n` outputs, the module of the parameter it is for: that
        of its first input a parameter's, or made of one (a foreach op's output i: of its lists'
        entries i)."""
        def of(t) -> str | None:
            return self._owners.get(_own(t).untyped_storage()._cdata) if isinstance(t, torch.Tensor) else None

        first = next((m for m in map(of, _tensors(args)) if m), None)
        lists = [a for a in args if isinstance(a, (list, tuple)) and len(a) == n]
        return [next((m for m in (of(x[i]) for x in lists) if m), first) for i in range(n)]

    def _scratch_made(self, made: list[kernel_scratch.Scratch], keys: dict[int, int], start: int, end: int) -> None:
        """A kernel's own allocations `start` to `end`, recorded in order, each freed where the
        kernel frees it (Scratch.freed_after: those of one index last first); `keys`: those not
        freed yet (by index: their order)."""
        for i in range(start, end):
            s = made[i]
            if kernel_scratch.recorded(s.bytes, s.code):  # (0 B: a placeholder)
                keys[i] = self._synthetic_key()
                self._record_alloc(keys[i], s.bytes, "temporary", s.code)
            for j in sorted((j for j in keys if made[j].freed_after == i), reverse=True):
                self._record_free(keys.pop(j))

    # ---- module attribution ----------------------------------------------------------
    def _backward_module(self) -> str:
        """In backward, the innermost module whose forward call made the autograd node running
        (its sequence number within that call's span); "" outside backward, for a node made
        outside every module (or by none: a leaf's AccumulateGrad), and inside a nested backward
        (a reentrant checkpoint's: its nodes were numbered on another thread)."""
        if not self._spans or self.nested_backward or torch._C._current_graph_task_id() == -1:
            return ""
        node = torch._C._current_autograd_node()
        if node is None:
            return ""
        seq = node._sequence_nr()
        i = bisect.bisect_right(self._spans, seq, key=lambda span: span[0]) - 1
        while i >= 0:
            _start, end, name, enclosing = self._spans[i]
            if seq < end:
                return name
            i = enclosing
        return ""

    def _span_begins(self, name: str) -> None:
        # none where the call makes no node that backward runs: without grad, or a checkpoint's
        # recompute (-1 kept open, as the hooks pair)
        if not torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1:
            self._open_spans.append(-1)
            return
        enclosing = next((i for i in reversed(self._open_spans) if i >= 0), -1)
        start = torch._C._autograd._get_sequence_nr()
        self._open_spans.append(len(self._spans))
        self._spans.append([start, _OPEN, name, enclosing])

    def _span_ends(self) -> None:
        if self._open_spans and (i := self._open_spans.pop()) >= 0:
            self._spans[i][1] = torch._C._autograd._get_sequence_nr()

    def attach_modules(self, model: torch.nn.Module) -> list:
        """Forward hooks that keep the current module's name for each event (and the modules of
        the parameters, which the optimizer's step charges its allocations to), and each call's
        span of autograd nodes, which backward's events are charged by."""
        handles = []
        self._parameters = [(name or "<root>", p) for name, mod in model.named_modules()
                            for p in mod.parameters(recurse=False)]
        for name, mod in model.named_modules():
            def pre(_m, _inp, name=name or "<root>"):
                self.module_stack.append(name)
                self._span_begins(name)

            def post(_m, _inp, _out):
                if self.module_stack:
                    self.module_stack.pop()
                self._span_ends()

            handles.append(mod.register_forward_pre_hook(pre))
            # always_call: a checkpoint's recompute stops part-way through a forward (by raising);
            # the module is left all the same, so later events are not charged to it
            handles.append(mod.register_forward_hook(post, always_call=True))
        return handles


@contextlib.contextmanager
def storage_resizes(tracker: StorageTracker):
    """`UntypedStorage.resize_` reported to `tracker` inside (it is no op the dispatcher shows)."""
    original = torch.UntypedStorage.resize_

    def resize_(st, nbytes):
        out = original(st, nbytes)
        tracker.resized(st, int(nbytes))
        return out

    torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.UntypedStorage.resize_ = original  # type: ignore[method-assign]
