"""The record's per-step figures read off a journal (the tracker's events and marks in order): the
same function for a traced run and for one synthesized from fewer layers (probe.sim.repeat)."""

from __future__ import annotations

from dataclasses import dataclass, field

from harness.probe.sim.tracker import KINDS, TraceEvent, counted


@dataclass
class StepStats:
    step: int  # -1: setup, before the first step (building the model and the batch)
    peak_allocated_bytes: int = 0
    peak_requested_bytes: int = 0
    peak_breakdown: dict = field(default_factory=dict)  # kind -> allocated bytes at the peak
    peak_phase: str = ""
    peak_module: str = ""
    allocated_after_bytes: int = 0  # at the step's end mark


def step_stats(journal: list[TraceEvent]) -> tuple[StepStats, list[StepStats]]:
    """(setup, one per step): peaks with what they held and where, allocated at each step's end."""
    live: dict[int, list] = {}  # key -> [requested, allocated, kind]
    kind_bytes = dict.fromkeys(KINDS, 0)
    allocated = requested = 0
    setup = s = StepStats(step=-1)
    steps: dict[int, StepStats] = {}
    at = -1  # the step `s` is (a journal's entries come a step at a time: looked up where it changes)
    for _seq, action, key, size, kind, phase, step, module, _stream, _kernel in journal:
        if step != at:
            s = setup if step < 0 else steps.setdefault(step, StepStats(step=step))
            at = step
        if action == "alloc":
            n = counted(size)
            live[key] = [size, n, kind]
            allocated += n
            requested += size
            kind_bytes[kind] += n
            if allocated > s.peak_allocated_bytes:
                s.peak_allocated_bytes = allocated
                s.peak_breakdown = dict(kind_bytes)
                s.peak_phase, s.peak_module = phase, module
            if requested > s.peak_requested_bytes:
                s.peak_requested_bytes = requested
        elif action == "free":
            entry = live.pop(key, None)
            if entry is not None:
                allocated -= entry[1]
                requested -= entry[0]
                kind_bytes[entry[2]] -= entry[1]
        elif action == "retag":
            entry = live.get(key)
            if entry is not None:
                kind_bytes[entry[2]] -= entry[1]
                kind_bytes[kind] += entry[1]
                entry[2] = kind
        elif action == "end":
            s.allocated_after_bytes = allocated
    return setup, [steps[k] for k in sorted(steps)]
