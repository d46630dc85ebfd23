"""A training journal's later steps from its first two: from the second step on, a step repeats the
one before (the optimizer state exists, the gradients of the step before are the ones it frees).

`extend` copies the last step as the next one. A copy's entry that refers to a storage of its own
step refers to that storage's copy; one that refers to a storage the step before left alive (a
gradient its zero_grad frees) refers to that storage's successor: the storage the copied step
left alive in the same role (kind at the step's end, phase, module: the n-th of a role to the
n-th). Anything else (a free of older memory, which a copy would free twice) is NotRepeating.
probe.sim.shortcut checks an extension against a traced journal before it trusts its structure.
"""

from __future__ import annotations

from collections import defaultdict

from harness.probe.sim.repeat import NotRepeating, referents
from harness.probe.sim.tracker import TraceEvent


def extend(journal: list[TraceEvent], steps: int) -> list[TraceEvent]:
    """`journal` (steps 0..k-1 with k >= 2, each closed by its end mark) continued to `steps`
    steps; seq is the entry's index."""
    out = list(journal)
    last = max(e.step for e in out)
    if last < 1:
        raise NotRepeating("a journal of one step has no step that repeats")
    while last + 1 < steps:
        out = _copy_last(out, last)
        last += 1
    return [TraceEvent(i, *e[1:]) for i, e in enumerate(out)]  # (_replace: 3x the time)


def _copy_last(journal: list[TraceEvent], s: int) -> list[TraceEvent]:
    """`journal` and a copy of its step `s` as step s+1."""
    ref = referents(journal)
    succ = _successors(journal, s - 1, s, ref)
    key_of: dict[int, int] = {}  # alloc entry of step s -> its copy's key
    next_key = max((abs(e.key) for e in journal), default=0) + 1
    copy = []
    for i, e in enumerate(journal):
        if e.step != s:
            continue
        key = e.key
        if e.action == "alloc":
            key = key_of[i] = next_key
            next_key += 1
        elif i in ref:
            x = ref[i]
            if journal[x].step == s:
                key = key_of[x]
            elif journal[x].step == s - 1 and x in succ:
                key = journal[succ[x]].key
            else:
                raise NotRepeating(f"entry {i} of step {s} refers to a storage of step {journal[x].step} "
                                   "that no copy of it could refer to")
        copy.append(TraceEvent(e.seq, e.action, key, e.size, e.kind, e.phase, s + 1, e.module, e.stream, e.kernel))
    return journal + copy


def _successors(journal: list[TraceEvent], before: int, last: int, ref: dict[int, int]) -> dict[int, int]:
    """Alloc entries of step `before` alive at its end -> those of step `last` alive at its end in
    the same role, in order."""
    def survivors(step: int) -> dict[tuple, list[int]]:
        alive: dict[int, str] = {}  # alloc entry -> its kind now
        end = None
        for i, e in enumerate(journal):
            if e.action == "alloc" and e.step == step:
                alive[i] = e.kind
            elif e.action == "free" and i in ref:
                alive.pop(ref[i], None)
            elif e.action == "retag" and ref.get(i) in alive:
                alive[ref[i]] = e.kind
            elif e.action == "end" and e.step == step:
                end = i
                break
        if end is None:
            raise NotRepeating(f"step {step} has no end mark")
        roles: dict[tuple, list[int]] = defaultdict(list)
        for i, kind in alive.items():  # in allocation order (dicts keep insertion order)
            roles[(kind, journal[i].phase, journal[i].module)].append(i)
        return roles

    old, new = survivors(before), survivors(last)
    return {x: y for role, xs in old.items() for x, y in zip(xs, new.get(role, []))}
