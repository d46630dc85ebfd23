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
    """(setup, one per step): peaks with what they held and where, allocated at each step's end.
    A storage counts as the kind it was last retagged to from its birth on (optimizer state made
    inside the first step, a gradient autograd made, the batch): what it was all along (a first
    step's peak held AdamW's new state as temporaries, and the record's optimizer_bytes with them)."""
    final = _final_kinds(journal)
    live: dict[int, list] = {}  # key -> [requested, allocated, kind]
    kind_bytes = dict.fromkeys(KINDS, 0)
    allocated = requested = 0
    setup = s = StepStats(step=-1)
    steps: dict[int, StepStats] = {}
    at = -1  # the step `s` is (a journal's entries come a step at a time: looked up where it changes)
    for i, (_seq, action, key, size, kind, phase, step, module, _stream, _kernel) in enumerate(journal):
        if step != at:
            s = setup if step < 0 else steps.setdefault(step, StepStats(step=step))
            at = step
        if action == "alloc":
            kind = final.get(i, kind)
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
        elif action == "end":
            s.allocated_after_bytes = allocated
    return setup, [steps[k] for k in sorted(steps)]


def alive_at_end(journal: list[TraceEvent]) -> dict[int, str]:
    """The storages alive at the journal's end: each one's alloc's place in it -> its kind (the
    one it was last retagged to)."""
    final = _final_kinds(journal)
    live: dict[int, int] = {}  # key -> its alloc's place
    for i, (_seq, action, key, *_rest) in enumerate(journal):
        if action == "alloc":
            live[key] = i
        elif action == "free":
            live.pop(key, None)
    return {i: final.get(i, journal[i].kind) for i in sorted(live.values())}


def _final_kinds(journal: list[TraceEvent]) -> dict[int, str]:
    """The kind each retagged storage was last retagged to, by its alloc's place in the journal (a
    key names a storage only while it lives)."""
    born: dict[int, int] = {}  # live key -> its alloc's place
    out: dict[int, str] = {}
    for i, (_seq, action, key, _size, kind, *_rest) in enumerate(journal):
        if action == "alloc":
            born[key] = i
        elif action == "free":
            born.pop(key, None)
        elif action == "retag" and key in born:
            out[born[key]] = kind
    return out
