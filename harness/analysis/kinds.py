"""Which kind of memory decides a run's peak, and the shape of its timeline, from its record.

Kinds (DESIGN.md): `static` (weights + gradients + optimizer state exceed the card), `activations`
(those fit, the peak does not), `fragmentation` (allocated fits, reserved does not), `retained`
(allocated after each step climbs), or `fits`.
"""

from __future__ import annotations

import math

from harness.units import MiB

# A climb smaller than this per step is noise (e.g. a lazily created buffer), not a leak.
CLIMB_BYTES = 1 * MiB


def _num(x) -> int:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return 0
    return int(x)


def climbing(after_step: list[int], first: int = 1) -> bool:
    """Allocated after each step rises step after step (from `first` on: step 1 builds optimizer state)."""
    seq = [int(x) for x in list(after_step)[first:]]
    return len(seq) >= 2 and all(b - a > CLIMB_BYTES for a, b in zip(seq, seq[1:]))


def shape(after_step: list[int], step_peaks: list[int], train: bool) -> tuple[str, str]:
    """(staircase | spike | plateau, the numbers behind it)."""
    after, peaks = [int(x) for x in after_step], [int(x) for x in step_peaks]
    if not after or not peaks:
        return "unknown", "no per-step readings"
    if train and climbing(after):
        steps = ", ".join(f"{a / 2**30:.2f}" for a in after)
        return "staircase", f"allocated after each step climbs: {steps} GiB"
    window = range(1, len(peaks)) if train and len(peaks) > 1 else range(len(peaks))
    rise = max(peaks[i] - after[i] for i in window)
    top = max(peaks[i] for i in window)
    if top and rise / top > 0.2:
        return "spike", f"each step rises {rise / 2**30:.2f} GiB above its resting {min(after) / 2**30:.2f} GiB"
    return "plateau", f"the peak is within {rise / 2**30:.2f} GiB of the resting {min(after) / 2**30:.2f} GiB"


def trains(rec: dict) -> bool:
    """A training step: the train preset, or a user's job with an optimizer."""
    return rec.get("workload") == "train" or (rec.get("workload") == "custom" and bool(rec.get("optimizer")))


def static_bytes(rec: dict) -> int:
    """Weights, their gradients and the optimizer state: what a training step holds at rest."""
    params = _num(rec.get("params_bytes"))
    if trains(rec):
        return params + params + _num(rec.get("optimizer_bytes"))  # gradients match the weights
    return params


def kind(rec: dict) -> tuple[str, str]:
    """(kind, the numbers behind it) for one record against its card."""
    room = _num(rec.get("gpu_memory_bytes")) - _num(rec.get("gpu_non_pytorch_bytes"))
    g = lambda n: f"{n / 2**30:.2f} GiB"  # noqa: E731
    after = list(rec.get("step_allocated_bytes") or [])
    train = trains(rec)
    if rec.get("status") not in ("ok", "oom"):
        return "unknown", f"status {rec.get('status')}"
    if train and climbing(after):
        return "retained", f"allocated after each step climbs ({', '.join(g(a) for a in after)})"
    if rec.get("status") == "ok":
        return "fits", f"peak reserved {g(_num(rec.get('peak_reserved_bytes')))} within {g(room)}"
    static = static_bytes(rec)
    allocated, reserved = _num(rec.get("peak_allocated_bytes")), _num(rec.get("peak_reserved_bytes"))
    if static > room:
        return "static", f"weights + gradients + optimizer state = {g(static)} > {g(room)} for PyTorch"
    if rec.get("oom_verdict") is not None:
        # A real OOM (backend=cuda): the peaks stop where it failed, so the message's numbers decide.
        held, asked = _num(rec.get("oom_allocated_bytes")), _num(rec.get("oom_tried_bytes"))
        if rec["oom_verdict"] == "fragmentation":
            return "fragmentation", (f"at the OOM {g(held)} allocated + {g(asked)} asked fits {g(room)}; "
                                     f"{g(_num(rec.get('oom_reserved_bytes')) - held)} was cached but unallocated")
        return "activations", (f"static {g(static)} fits {g(room)}; at the OOM {g(held)} allocated + "
                               f"{g(asked)} asked does not")
    if allocated > room:
        return "activations", (f"static {g(static)} fits {g(room)}; the peak, {g(allocated)} allocated "
                               f"({g(allocated - static)} above it), does not")
    return "fragmentation", (f"allocated {g(allocated)} fits {g(room)}; reserved {g(reserved)} "
                             f"({g(reserved - allocated)} cached but unallocated) does not")


def with_kinds(rows: list[dict]) -> list[dict]:
    """The rows with a `kind` column: the kind of memory behind each one's peak."""
    return [{**r, "kind": kind(r)[0]} for r in rows]
