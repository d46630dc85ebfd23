"""A preset point traced at a few layers and synthesized to its depth, checked before it is trusted.

Tracing costs the same per layer (FakeTensor dispatch, ~0.1 s per layer and step), so a 7B point
takes 10 s and a 405B one minutes; the layers are the same block, though. Depths a and a+1 give the
template (probe.sim.repeat), the template synthesizes depth a+2, and only when that equals the
traced a+2 entry for entry (action, size, kind, phase, step, module, which alloc each free and
retag refers to) is the point's depth synthesized. Otherwise, and for jobs of the user's own (whose
depth the harness does not know), the point is traced in full; the row's trace_method says which.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from harness.config.models import hf_config
from harness.config.point import Point, WorkloadName
from harness.probe.sim import repeat
from harness.probe.sim.measure import measurements
from harness.probe.sim.repeat import NotRepeating
from harness.probe.sim.trace import run_point
from harness.probe.sim.tracker import TraceEvent

SHALLOW = 1  # a: the template's depths are a and a+1, checked at a+2


@dataclass
class Traced:
    measurements: dict
    events: list[TraceEvent]  # alloc and free: the trace the allocator replays
    findings: dict


def trace(point: Point) -> Traced:
    """The point's measurements and trace, synthesized where that is exact, else traced in full."""
    reason = refusal(point)
    if reason is None:
        try:
            return synthesized(point)
        except NotRepeating as e:
            reason = f"its layers did not repeat ({e})"
    m, tracker = run_point(point)
    m["trace_method"] = f"full: {reason}"
    return Traced(m, tracker.events, tracker.findings)


def depth(point: Point) -> int:
    return int(hf_config(point.model).num_hidden_layers)


def refusal(point: Point) -> str | None:
    """Why the point is traced in full (None: it may be synthesized)."""
    if point.workload.name == WorkloadName.custom:
        return "a job of the user's own"
    config = hf_config(point.model)
    n = int(config.num_hidden_layers)
    if n <= SHALLOW + 2:
        return f"{n} layers"
    kinds = getattr(config, "layer_types", None)
    if kinds and len(set(kinds)) > 1:
        return f"its layers differ (layer_types: {', '.join(sorted(set(kinds)))})"
    return None


def at_depth(point: Point, n: int) -> Point:
    hf = {**point.model.hf, "num_hidden_layers": n}
    kinds = getattr(hf_config(point.model), "layer_types", None)
    if kinds:
        hf["layer_types"] = [kinds[0]] * n
    return point.replace(model=dataclasses.replace(point.model, hf=hf))


def synthesized(point: Point) -> Traced:
    a, n = SHALLOW, depth(point)
    runs = {d: run_point(at_depth(point, d)) for d in (a, a + 1, a + 2)}
    journals = {d: tracker.journal() for d, (_m, tracker) in runs.items()}
    template = repeat.learn(journals[a], journals[a + 1], a, _layer_prefix(journals[a + 1], a))
    check = repeat.canonical(repeat.synthesize(template, a + 2))
    traced = repeat.canonical(journals[a + 2])
    if check != traced:
        at = next((i for i, (x, y) in enumerate(zip(check, traced)) if x != y), min(len(check), len(traced)))
        raise NotRepeating(f"synthesized {a + 2} layers differ from traced at entry {at} of {len(traced)}")
    findings = {d: tracker.findings for d, (_m, tracker) in runs.items()}
    scalars = _extrapolate([findings[d]["scalars"] for d in (a, a + 1, a + 2)], n - a)
    holder = _extrapolate([findings[d].get("retained_holder") for d in (a, a + 1, a + 2)], n - a)
    journal = repeat.synthesize(template, n)
    m = measurements(journal, holder=holder, **scalars)
    m["trace_method"] = f"synthesized: layers {a}, {a + 1} -> {n} (checked at {a + 2})"
    events = [e for e in journal if e.action in ("alloc", "free")]
    return Traced(m, events, {"scalars": scalars, "retained_holder": holder})


def _layer_prefix(journal: list[TraceEvent], new: int) -> str:
    """The modules' prefix before the layer index ("model.layers."): the one naming layer `new`."""
    pattern = re.compile(rf"^(.*\.){new}(?=\.|$)")
    found = {m.group(1) for e in journal if e.module and (m := pattern.match(e.module))}
    if len(found) != 1:
        raise NotRepeating(f"no single module list holds the layers ({sorted(found) or 'none'})")
    return found.pop()


def _extrapolate(values: list, steps: int):
    """A figure at depth a+`steps` from depths a, a+1, a+2: numbers linear in depth (checked on the
    three), anything else the same at all three."""
    first, second, third = values
    if isinstance(first, dict) and isinstance(second, dict) and isinstance(third, dict):
        if not first.keys() == second.keys() == third.keys():
            raise NotRepeating("the figures differ in what they hold across depths")
        return {k: _extrapolate([first[k], second[k], third[k]], steps) for k in first}
    if isinstance(first, int) and not isinstance(first, bool) and isinstance(second, int) and isinstance(third, int):
        if third - second != second - first:
            raise NotRepeating(f"a figure is not linear in depth ({first}, {second}, {third})")
        return first + steps * (second - first)
    if not first == second == third:
        raise NotRepeating(f"a figure changes with depth ({first!r}, {second!r}, {third!r})")
    return first
