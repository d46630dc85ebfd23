"""Which kind of memory decides a run's peak, and the shape of its timeline, from its record.

Kinds (DESIGN.md): `static` (weights + gradients + optimizer state exceed the card), `activations`
(those fit, the peak does not), `fragmentation` (allocated fits, reserved does not), `retained`
(allocated after each step climbs), or `fits`. Readings are data; report/words.py words them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from harness.units import MiB

# A climb smaller than this per step is noise (e.g. a lazily created buffer), not a leak.
CLIMB_BYTES = 1 * MiB
# A step whose peak rises more than this share above where it rests is a spike.
SPIKE_SHARE = 0.2


def _num(x) -> int:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return 0
    return int(x)


def climbing(after_step: list[int], first: int = 1) -> bool:
    """Allocated after each step rises step after step (from `first` on: step 1 builds optimizer state)."""
    seq = [int(x) for x in list(after_step)[first:]]
    return len(seq) >= 2 and all(b - a > CLIMB_BYTES for a, b in zip(seq, seq[1:]))


@dataclass(frozen=True)
class ShapeReading:
    """The timeline's shape and the numbers behind it (bytes)."""
    shape: str  # staircase | spike | plateau | unknown
    after_step_bytes: tuple[int, ...] = ()  # allocated after each step
    rise_bytes: int = 0  # the largest rise of a step's peak above where it started
    rest_bytes: int = 0  # the lowest allocated after a step


def shape(after_step: list[int], step_peaks: list[int], train: bool) -> ShapeReading:
    """staircase (allocated after each step climbs), spike (each step rises well above its rest) or
    plateau, from a run's per-step readings."""
    after, peaks = [int(x) for x in after_step], [int(x) for x in step_peaks]
    if not after or not peaks:
        return ShapeReading("unknown")
    if train and climbing(after):
        return ShapeReading("staircase", tuple(after))
    window = range(1, len(peaks)) if train and len(peaks) > 1 else range(len(peaks))
    rise = max(peaks[i] - after[i] for i in window)
    top = max(peaks[i] for i in window)
    kind = "spike" if top and rise / top > SPIKE_SHARE else "plateau"
    return ShapeReading(kind, tuple(after), rise, min(after))


def trains(rec: dict) -> bool:
    """A training step: the train preset, or a user's job with an optimizer."""
    return rec.get("workload") == "train" or (rec.get("workload") == "custom" and bool(rec.get("optimizer")))


def static_bytes(rec: dict) -> int:
    """Weights, their gradients and the optimizer state: what a training step holds at rest."""
    params = _num(rec.get("params_bytes"))
    if trains(rec):
        return params + params + _num(rec.get("optimizer_bytes"))  # gradients match the weights
    return params


@dataclass(frozen=True)
class KindReading:
    """The kind of memory behind a run's peak, the rule that decided it, and its numbers (bytes)."""
    kind: str  # static | activations | fragmentation | retained | fits | unknown
    rule: str  # what decided: status | climb | fits | static | peak | reserved | oom_message
    room_bytes: int = 0  # what the card gives PyTorch
    static_bytes: int = 0  # weights + gradients + optimizer state
    allocated_bytes: int = 0
    reserved_bytes: int = 0
    after_step_bytes: tuple[int, ...] = ()
    status: str | None = None
    oom_held_bytes: int = 0  # a real OOM's message: allocated, asked for, cached but unallocated
    oom_asked_bytes: int = 0
    oom_cached_bytes: int = 0


def kind(rec: dict) -> KindReading:
    """The kind for one record against its card."""
    # NCCL's memory (a job over several GPUs) is outside PyTorch too
    room = _num(rec.get("gpu_memory_bytes")) - _num(rec.get("gpu_non_pytorch_bytes")) - _num(rec.get("nccl_bytes"))
    after = tuple(int(x) for x in list(rec.get("step_allocated_bytes") or []))
    allocated, reserved = _num(rec.get("peak_allocated_bytes")), _num(rec.get("peak_reserved_bytes"))
    base: dict[str, Any] = {"room_bytes": room, "allocated_bytes": allocated, "reserved_bytes": reserved,
                            "after_step_bytes": after, "status": rec.get("status"), "static_bytes": static_bytes(rec)}
    if rec.get("status") not in ("ok", "oom"):
        return KindReading("unknown", "status", **base)
    if trains(rec) and climbing(list(after)):
        return KindReading("retained", "climb", **base)
    if rec.get("status") == "ok":
        return KindReading("fits", "fits", **base)
    if base["static_bytes"] > room:
        return KindReading("static", "static", **base)
    if rec.get("oom_verdict") is not None:
        # A real OOM (backend=cuda): the peaks stop where it failed, so the message's numbers decide.
        held = _num(rec.get("oom_allocated_bytes"))
        kind_ = "fragmentation" if rec["oom_verdict"] == "fragmentation" else "activations"
        return KindReading(kind_, "oom_message", **base, oom_held_bytes=held,
                           oom_asked_bytes=_num(rec.get("oom_tried_bytes")),
                           oom_cached_bytes=_num(rec.get("oom_reserved_bytes")) - held)
    if allocated > room:
        return KindReading("activations", "peak", **base)
    return KindReading("fragmentation", "reserved", **base)


def with_kinds(rows: list[dict]) -> list[dict]:
    """The rows with a `kind` column: the kind of memory behind each one's peak."""
    return [{**r, "kind": kind(r).kind} for r in rows]
