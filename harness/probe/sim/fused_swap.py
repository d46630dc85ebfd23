"""A trace taken with one fused attention kernel, as a card that takes the other runs it: flash for
cuDNN or back (config.attention.swaps_fused). Both keep the same tensors for backward; what differs
is per call, in the rows the tracker names (config.attention.fused_code):

- forward: flash makes its output, log-sum-exp, then its RNG state (16 B) and an unused tensor
  (8 B); cuDNN its philox seed and offset (8 B each) first, then output and log-sum-exp, then 256 B
  of scratch it frees at once;
- backward: flash's scratch (config.attention.flash_backward_scratch, 2 or 4 blocks, freed in
  reverse), cuDNN's one block (cudnn_backward_scratch).

The RNG state and unused tensor are freed where the seed and offset are (which where: _PAIRED).
Flash's split-KV accumulators (config.kernels.flash_splitkv_bytes: after its log-sum-exp, freed as
it returns) are cuDNN's nowhere: dropped for cuDNN. A trace taken with cuDNN and rewritten for flash
has none (where the card would split the keys, it lacks them: a few MiB at most, freed at once). A
trace without these codes (from before them) is not rewritten: `frame` declines it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from harness.config import attention
from harness.config.attention import CUDNN, FLASH, FUSED_PREFIX, FusedShape, fused_code, fused_parts
from harness.config.kernels import SPLITKV_PREFIX
from harness.probe.sim.tracker import TraceEvent
from harness.record import trace_store

if TYPE_CHECKING:
    import pandas as pd

# The small outputs each forward makes besides its output and log-sum-exp (name, bytes), in the
# order they are allocated. Which of flash's is freed where one of cuDNN's is: saved for backward,
# the node lets them go in the order it saved them (reversed where a checkpoint recomputed them),
# flash's RNG state where cuDNN's offset, its unused tensor where the seed; without grad they go as
# the op's output tuple does, last element first: flash's unused tensor where cuDNN's offset.
_SMALL = {FLASH: (("rng", 16), ("unused", 8)), CUDNN: (("seed", 8), ("offset", 8))}
_PAIRED = {True: {"rng": "offset", "unused": "seed"}, False: {"unused": "offset", "rng": "seed"}}
_CUDNN_FORWARD_SCRATCH = 256


def frame(df: pd.DataFrame, to: str, events: list[TraceEvent] | None = None
          ) -> tuple[pd.DataFrame, list[TraceEvent]] | None:
    """A trace's frame with each fused call's rows as kernel `to` makes them, and its events
    (`events`: the frame's own, where at hand, else read from it); None for a trace whose rows do not
    say which are its fused calls' (from before they did), or do not lie as `swapped` knows them
    (the caller traces the card instead)."""
    if "kernel" not in df or not df["kernel"].str.startswith(FUSED_PREFIX).any():
        return None
    try:
        rewritten = swapped(trace_store.events(df) if events is None else events, to)
    except ValueError:
        return None
    return trace_store.to_frame(rewritten), rewritten


def swapped(events: list[TraceEvent], to: str) -> list[TraceEvent]:
    """`events` (alloc and free, in order) with each fused call's rows as kernel `to` makes them."""
    frm = CUDNN if to == FLASH else FLASH
    keys = iter(range(min([0, *(e.key for e in events)]) - 1, -(1 << 62), -1))  # new scratch rows' keys
    resized: dict[int, int] = {}  # small output's key -> its bytes under `to`
    dropped: set[int] = set()  # keys of flash's split-KV accumulators, which cuDNN makes none of
    out: list[TraceEvent] = []
    i = 0
    while i < len(events):
        e = events[i]
        if e.action == "free":  # (a key names a storage while it lives: forgotten at its free)
            if e.key in dropped:
                dropped.discard(e.key)
            else:  # (most frees are no small output's: the row as it is)
                out.append(e._replace(size=resized.pop(e.key)) if e.key in resized else e)
            i += 1
            continue
        if not e.kernel.startswith(FUSED_PREFIX):
            out.append(e)
            i += 1
            continue
        phase, what, shape, _ = fused_parts(e.kernel)
        if phase == "fwd" and what in ("out", _SMALL[frm][0][0]):
            i = _forward(events, i, frm, to, out, resized, keys, dropped)
        elif phase == "bwd" and what == frm:
            assert shape is not None
            i = _backward(events, i, shape, frm, to, out, keys)
        else:
            raise ValueError(f"trace row {i}: fused row {e.kernel!r} out of its call's order")
    return out


def _forward(events, i, frm, to, out, resized, keys, dropped) -> int:
    """One call's forward rows from row `i` (allocs: its outputs, flash's split-KV accumulators
    among them, then cuDNN's scratch and its free); the accumulators' keys into `dropped`."""
    roles: dict[str, TraceEvent] = {}
    while i < len(events) and events[i].action == "alloc" and events[i].kernel.startswith(
            (FUSED_PREFIX + "fwd:", SPLITKV_PREFIX)):
        if events[i].kernel.startswith(SPLITKV_PREFIX):
            dropped.add(events[i].key)
            i += 1
            continue
        what = fused_parts(events[i].kernel)[1]
        if what == "scratch":  # cuDNN's, freed before the call returns
            if i + 1 == len(events) or events[i + 1].key != events[i].key:
                raise ValueError(f"trace row {i}: cuDNN's forward scratch not freed at once")
            i += 2
            break
        if what in roles:  # the next call's
            break
        roles[what] = events[i]
        i += 1
    if "out" not in roles or "lse" not in roles or any(name not in roles for name, _ in _SMALL[frm]):
        raise ValueError(f"trace row {i}: a fused forward without its outputs ({sorted(roles)})")
    # each of `to`'s small outputs takes the storage freed where it is freed; without grad they go
    # as the call returns: nothing but frees between it and them
    paired = _PAIRED[not _freed_as_it_returns(events, i, {roles[name].key for name, _ in _SMALL[frm]})]
    paired = {**paired, **{v: k for k, v in paired.items()}}
    made = []
    for name, size in _SMALL[to]:
        old = roles[paired[name]]
        resized[old.key] = size
        made.append(old._replace(size=size, kernel=fused_code("fwd", name)))
    body = [roles["out"], roles["lse"]]
    like = roles["out"]
    if to == CUDNN:
        key = next(keys)
        out += made + body + [like._replace(key=key, size=_CUDNN_FORWARD_SCRATCH, kind="temporary",
                                             kernel=fused_code("fwd", "scratch")),
                              like._replace(action="free", key=key, size=_CUDNN_FORWARD_SCRATCH, kind="temporary",
                                            module="", kernel="")]
    else:
        out += body + made
    return i


def _freed_as_it_returns(events, i, keys: set[int]) -> bool:
    """Whether each of `keys` is freed in the run of frees from row `i` (the call's return), not
    after some later allocation nor never (a graph saved them). Only that run is read: a scan to
    the saved ones' frees in backward made a 70B trace's rewrite quadratic (0.2 s of 0.3 s)."""
    left = set(keys)
    while left and i < len(events) and events[i].action == "free":
        left.discard(events[i].key)
        i += 1
    return not left


def _backward(events, i, shape: FusedShape, frm, to, out, keys) -> int:
    """One call's backward scratch from row `i` (its allocs, then their frees in reverse)."""
    first = events[i]
    blocks = []
    while i < len(events) and events[i].action == "alloc" and events[i].kernel.startswith(
            FUSED_PREFIX + f"bwd:{frm}:"):
        blocks.append(events[i].key)
        i += 1
    frees = events[i:i + len(blocks)]
    if [f.key for f in frees] != blocks[::-1] or any(f.action != "free" for f in frees):
        raise ValueError(f"trace row {i}: a fused backward's scratch not freed at once")
    i += len(blocks)
    sizes = attention.fused_backward_scratch(to, shape)
    made = [first._replace(key=first.key if n == 0 else next(keys), size=size,
                           kernel=fused_code("bwd", to, shape, n if to == FLASH else None))
            for n, size in enumerate(sizes)]
    out += made
    out += [m._replace(action="free", module="", kernel="") for m in reversed(made)]
    return i
