"""Storage-level memory tracker: the ordered birth and death of every tensor storage.

A `TorchDispatchMode` sees every op's outputs; each new storage becomes an `alloc` event and a
`weakref.finalize` on it becomes the matching `free`. The tracker holds no tensor, storage or
autograd graph (only integer keys and finalizers), so it cannot keep memory alive by itself -
the side effect that makes MemTracker over-count forward loops run with gradients enabled.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

# The CUDA caching allocator rounds every request up to kMinBlockSize (512 B); that rounding is
# what max_memory_allocated counts. Segment-level rounding is the allocator model's business.
MIN_BLOCK_BYTES = 512

# cuBLAS workspace PyTorch allocates through its own allocator on a thread's first GEMM
# (at::cuda::getNewWorkspace): 8,519,680 B per handle in real traces (fidelity.md, C.5).
CUBLAS_WORKSPACE_BYTES = 8_519_680

KINDS = ("parameter", "gradient", "optimizer_state", "activation", "temporary", "input", "workspace")

# cuBLAS-backed ops. Under inference_mode composite ops such as linear reach the tracker
# undecomposed, so they are listed too.
_GEMM_OPS = {
    "mm", "addmm", "bmm", "baddbmm", "addbmm", "addmv", "mv", "dot", "_addmm_activation",
    "linear", "matmul", "_scaled_mm",
}


def round_request(nbytes: int) -> int:
    """Bytes the CUDA allocator hands out for a request (kMinBlockSize rounding)."""
    return max(MIN_BLOCK_BYTES, -(-nbytes // MIN_BLOCK_BYTES) * MIN_BLOCK_BYTES)


class TraceEvent(NamedTuple):
    """One storage's birth or death on the virtual GPU, in order (a row of trace.parquet)."""
    seq: int
    action: str  # alloc | free
    key: int  # the storage's identity while it lives
    size: int  # requested bytes (the allocator rounds them)
    kind: str  # parameter | gradient | optimizer_state | activation | temporary | input | workspace
    phase: str
    step: int  # -1: before the first step
    module: str  # the innermost module running, "" outside any


@dataclass
class StepStats:
    step: int
    peak_allocated_bytes: int = 0
    peak_requested_bytes: int = 0
    peak_breakdown: dict = field(default_factory=dict)
    peak_phase: str = ""
    peak_module: str = ""
    allocated_after_bytes: int = 0


class StorageTracker(TorchDispatchMode):
    """Records alloc/free events per storage with kind, phase, step and module."""

    def __init__(self, emulate_cublas_workspace: bool = True):
        super().__init__()
        self.events: list[TraceEvent] = []
        self.findings: dict[str, Any] = {}  # what the probe found after the steps (e.g. retained_holder)
        self._live: dict[int, list] = {}  # key -> [requested, allocated, kind]
        self.kind_bytes = {k: 0 for k in KINDS}
        self.allocated = 0
        self.requested = 0
        self.phase = "setup"
        self.step = -1
        self.module_stack: list[str] = []
        self.steps: list[StepStats] = []
        self.emulate_cublas_workspace = emulate_cublas_workspace
        self._workspaces: set[str] = set()
        self._next_synthetic = -1
        # A user's step has no phase marks: count what runs inside autograd's engine as backward.
        self.auto_backward = False

    # ---- phases and steps ------------------------------------------------------------
    def begin_step(self, step: int) -> None:
        self.step = step
        self.steps.append(StepStats(step=step))

    def end_step(self) -> None:
        if self.steps:
            self.steps[-1].allocated_after_bytes = self.allocated

    def set_phase(self, phase: str) -> None:
        self.phase = phase

    def _phase(self) -> str:
        # Inside autograd's engine it is backward, whatever the step last named (its forward, or a
        # phase of its own such as "head").
        if self.auto_backward and torch._C._current_graph_task_id() != -1:
            return "backward"
        return self.phase

    # ---- bookkeeping -----------------------------------------------------------------
    def _record_alloc(self, key: int, nbytes: int, kind: str) -> None:
        alloc = round_request(nbytes)
        self._live[key] = [nbytes, alloc, kind]
        self.allocated += alloc
        self.requested += nbytes
        self.kind_bytes[kind] += alloc
        module = self.module_stack[-1] if self.module_stack else ""
        phase = self._phase()
        self.events.append(TraceEvent(len(self.events), "alloc", key, nbytes, kind, phase, self.step, module))
        if self.steps:
            s = self.steps[-1]
            if self.allocated > s.peak_allocated_bytes:
                s.peak_allocated_bytes = self.allocated
                s.peak_breakdown = dict(self.kind_bytes)
                s.peak_phase = phase
                s.peak_module = module
            s.peak_requested_bytes = max(s.peak_requested_bytes, self.requested)

    def _forget(self, key: int) -> list | None:
        """Stop counting a live storage; returns its [requested, allocated, kind] entry."""
        entry = self._live.pop(key, None)
        if entry is not None:
            self.allocated -= entry[1]
            self.requested -= entry[0]
            self.kind_bytes[entry[2]] -= entry[1]
        return entry

    def _record_free(self, key: int) -> None:
        entry = self._forget(key)
        if entry is not None:
            self.events.append(TraceEvent(len(self.events), "free", key, entry[0], entry[2], self._phase(), self.step, ""))

    def track(self, t: torch.Tensor, kind: str) -> None:
        """Start tracking a tensor's storage (idempotent); `kind` applies if it is new."""
        st = t.untyped_storage()
        key = st._cdata
        if key in self._live or st.nbytes() == 0:
            return
        self._record_alloc(key, st.nbytes(), kind)
        weakref.finalize(st, self._record_free, key)

    def retag(self, t: torch.Tensor | None, kind: str) -> None:
        """Move a live storage to another kind (e.g. a new tensor that became a .grad)."""
        if t is None:
            return
        entry = self._live.get(t.untyped_storage()._cdata)
        if entry is None or entry[2] == kind:
            return
        self.kind_bytes[entry[2]] -= entry[1]
        self.kind_bytes[kind] += entry[1]
        entry[2] = kind

    def drop(self, t: torch.Tensor) -> None:
        """Forget a storage that a real CUDA run keeps on the host (e.g. optimizer step counts):
        its alloc event goes, and so will its free."""
        key = t.untyped_storage()._cdata
        if self._forget(key) is None:
            return
        for i in range(len(self.events) - 1, -1, -1):
            if self.events[i].key == key and self.events[i].action == "alloc":
                del self.events[i]
                break

    def allocated_bytes_of(self, t: torch.Tensor) -> int:
        """Bytes the allocator holds for t's storage (0 if untracked or on the host)."""
        entry = self._live.get(t.untyped_storage()._cdata)
        return entry[1] if entry else 0

    def _default_kind(self) -> str:
        phase = self._phase()
        if phase == "setup":
            return "parameter"
        if phase == "input":
            return "input"
        if phase in ("backward", "optimizer", "zero_grad"):
            return "temporary"  # retagged when they become grads / optimizer state
        return "activation"  # forward, prefill, decode, or a forward phase a job named itself

    def _workspace(self, func) -> None:
        # One workspace per CPU thread that issues GEMMs: the caller's thread for forward and
        # the autograd engine's device thread for backward (including checkpoint recompute).
        thread = "backward" if self._phase() == "backward" else "forward"
        if thread in self._workspaces:
            return
        self._workspaces.add(thread)
        key = self._next_synthetic
        self._next_synthetic -= 1
        self._record_alloc(key, CUBLAS_WORKSPACE_BYTES, "workspace")

    # ---- dispatch --------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.emulate_cublas_workspace and func.overloadpacket.__name__ in _GEMM_OPS:
            self._workspace(func)
        kind = self._default_kind()
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self.track(t, kind)
        return out

    # ---- module attribution ----------------------------------------------------------
    def attach_modules(self, model: torch.nn.Module) -> list:
        """Forward hooks that keep the current module's name for each event."""
        handles = []
        for name, mod in model.named_modules():
            def pre(_m, _inp, name=name or "<root>"):
                self.module_stack.append(name)

            def post(_m, _inp, _out):
                if self.module_stack:
                    self.module_stack.pop()

            handles.append(mod.register_forward_pre_hook(pre))
            handles.append(mod.register_forward_hook(post))
        return handles
