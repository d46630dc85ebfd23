"""The record's per-step figures read off a journal (the tracker's events and marks in order): the
same function for a traced run and for one synthesized from fewer layers (probe.sim.repeat)."""

from __future__ import annotations

from dataclasses import dataclass, field

from harness.probe.sim.tracker import KINDS, TraceEvent, round_request


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
    setup = StepStats(step=-1)
    steps: dict[int, StepStats] = {}
    for e in journal:
        s = setup if e.step < 0 else steps.setdefault(e.step, StepStats(step=e.step))
        if e.action == "alloc":
            n = round_request(e.size)
            live[e.key] = [e.size, n, e.kind]
            allocated += n
            requested += e.size
            kind_bytes[e.kind] += n
            if allocated > s.peak_allocated_bytes:
                s.peak_allocated_bytes = allocated
                s.peak_breakdown = dict(kind_bytes)
                s.peak_phase, s.peak_module = e.phase, e.module
            s.peak_requested_bytes = max(s.peak_requested_bytes, requested)
        elif e.action == "free":
            entry = live.pop(e.key, None)
            if entry is not None:
                allocated -= entry[1]
                requested -= entry[0]
                kind_bytes[entry[2]] -= entry[1]
        elif e.action == "retag":
            entry = live.get(e.key)
            if entry is not None:
                kind_bytes[entry[2]] -= entry[1]
                kind_bytes[e.kind] += entry[1]
                entry[2] = e.kind
        elif e.action == "end":
            s.allocated_after_bytes = allocated
    return setup, [steps[k] for k in sorted(steps)]
