"""A journal's later steps from its first few: from the second step on, a training step repeats the
one before (the optimizer state exists, the gradients of the step before are the ones it frees),
and a decode step repeats the one before one token longer (`grow`: each entry's bytes, and the
numbers of its kernel's code, change by what they changed by from the step before).

`extend` copies the last step as each next one. A copy's entry that refers to a storage of its own
step refers to that storage's copy; one that refers to a storage the step before left alive (a
gradient its zero_grad frees) refers to that storage's successor: the storage the copied step
left alive in the same role (kind at the step's end, phase, module: the n-th of a role to the
n-th). Anything else (a free of older memory, which a copy would free twice) is NotRepeating.
probe.sim.shortcut checks an extension against a traced journal before it trusts its structure.

`joined` continues a decode with the steps of the same job decoding from a longer prompt, from
where both are as long (a sliding window's crossing, traced without the steps before it): what
the later steps free of the earlier ones is found by role, as a copy's is.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable

from harness.probe.sim.repeat import NotRepeating, referents
from harness.probe.sim.tracker import TraceEvent

_NUMBER = re.compile(r"\d+")


def extend(journal: list[TraceEvent], steps: int,
           grow: Callable[[str], int | None] | None = None) -> list[TraceEvent]:
    """`journal` (steps 0..k-1 with k >= 2, each closed by its end mark) continued to `steps`
    steps; seq is the entry's index. With `grow`, each step grows on the one before as the last
    traced did on its own predecessor (k >= 3), and `grow(code)` gives the bytes of a kernel's
    scratch whose code the growth changed (None: its bytes grow as the others')."""
    last = max(e.step for e in journal)
    if last < (2 if grow is not None else 1):
        raise NotRepeating(f"a journal of {last + 1} step(s) has no step that repeats")
    out = _stamped(journal, last, steps, grow) if last + 1 < steps else list(journal)
    return [TraceEvent(i, *e[1:]) for i, e in enumerate(out)]  # (_replace: 3x the time)


def _stamped(journal: list[TraceEvent], s: int, steps: int,
             grow: Callable[[str], int | None] | None) -> list[TraceEvent]:
    """`journal` and steps s+1 .. steps-1, each a copy of step `s` (grown k times what it grew by
    from step s-1, whose entries must then be step s's but for their bytes and their codes'
    numbers): one pass over the journal for the plan of a copy, then each copy made from it."""
    ref = referents(journal)
    succ = _successors(journal, s - 1, s, ref)
    rows = [i for i, e in enumerate(journal) if e.step == s]
    at = {i: n for n, i in enumerate(rows)}
    growth = _growth(journal, rows, s) if grow is not None else [(0, None)] * len(rows)
    keyed = []  # per entry of step s: how its copy's key is found
    for i in rows:
        e = journal[i]
        how: tuple = ("same",)
        if e.action == "alloc":
            how = ("new",)
        elif i in ref:
            x = ref[i]
            if journal[x].step == s:
                how = ("own", at[x])
            elif journal[x].step == s - 1 and x in succ:
                how = ("before", at[succ[x]])
            else:
                raise NotRepeating(f"entry {i} of step {s} refers to a storage of step {journal[x].step} "
                                   "that no copy of it could refer to")
        keyed.append(how)
    out = list(journal)
    keys_before = [journal[i].key for i in rows]
    next_key = _next_key(journal)
    resized_to: dict[int, int] = {}  # a copy's storage `grow` sized -> its bytes (its free's too)
    for k in range(1, steps - s):
        keys: list[int] = []
        for i, how, (more, numbers) in zip(rows, keyed, growth, strict=True):
            e = journal[i]
            if how[0] == "new":
                key, next_key = next_key, next_key + 1
            else:
                key = keys[how[1]] if how[0] == "own" else keys_before[how[1]] if how[0] == "before" else e.key
            keys.append(key)
            size, code = e.size + k * more, e.kernel
            if numbers is not None and grow is not None:
                code = _renumbered(code, [int(v) + k * d for v, d in zip(_NUMBER.findall(code), numbers)])
                resized = grow(code)
                size = size if resized is None else resized
                if resized is not None and e.action == "alloc":
                    resized_to[key] = size
            elif e.action == "free" and key in resized_to:  # (a free names no code: its block's bytes)
                size = resized_to.pop(key)
            if (size < 0 or size == 0 and not code) and e.action == "alloc":  # (0 B with a code: a placeholder)
                raise NotRepeating(f"entry {i} of step {s} would allocate {size} B {k} step(s) later")
            out.append(TraceEvent(e.seq, e.action, key, size, e.kind, e.phase, s + k, e.module, e.stream, code))
        keys_before = keys
    return out


def _next_key(journal: list[TraceEvent]) -> int:
    """A key no entry of `journal` has (synthetic keys are negative: probe.sim.tracker)."""
    return max((abs(e.key) for e in journal), default=0) + 1


def _growth(journal: list[TraceEvent], rows: list[int], s: int) -> list[tuple[int, list[int] | None]]:
    """Per entry of step `s` (`rows`): the bytes it grew by from the same entry of step s-1, and
    the numbers of its kernel's code (None where they did not change)."""
    before = [i for i, e in enumerate(journal) if e.step == s - 1]
    if len(rows) != len(before):
        raise NotRepeating(f"decode steps {s - 1} and {s} make {len(before)} and {len(rows)} entries")
    out = []
    for i, j in zip(rows, before, strict=True):
        e, p = journal[i], journal[j]
        if (e.action, e.kind, e.phase, e.module, e.stream, _NUMBER.sub("", e.kernel)) != \
                (p.action, p.kind, p.phase, p.module, p.stream, _NUMBER.sub("", p.kernel)):
            raise NotRepeating(f"entry {i} of step {s} is not the step before's")
        numbers = [int(a) - int(b) for a, b in zip(_NUMBER.findall(e.kernel), _NUMBER.findall(p.kernel))]
        out.append((e.size - p.size, numbers if any(numbers) else None))
    return out


def _renumbered(code: str, numbers: list[int]) -> str:
    """`code` with its numbers, in order, replaced by `numbers`."""
    values = iter(numbers)
    return _NUMBER.sub(lambda _: str(next(values)), code)


def _successors(journal: list[TraceEvent], before: int, last: int, ref: dict[int, int]) -> dict[int, int]:
    """Alloc entries of step `before` alive at its end -> those of step `last` alive at its end in
    the same role, in order."""
    old, new = _survivors(journal, before, ref), _survivors(journal, last, ref)
    return {x: y for role, xs in old.items() for x, y in zip(xs, new.get(role, []))}


def _survivors(journal: list[TraceEvent], step: int, ref: dict[int, int]) -> dict[tuple, list[int]]:
    """The alloc entries of `step` alive at its end, by role (kind then, phase, module), in
    allocation order."""
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


def joined(head: list[TraceEvent], tail: list[TraceEvent], at: int) -> list[TraceEvent]:
    """`head` (steps to `at`, each closed by its end mark) and, as its steps at+1, at+2, ..., the
    steps after step 1 of `tail`: the same job decoding from a longer prompt, its step 1 as long as
    head's step `at`. A tail entry that refers to a storage its step 1 left alive refers to head's
    in the same role (the n-th of a role to the n-th; both roles' storages alike in number and
    bytes); one that refers to a storage of its later steps, to that storage. Anything else (a
    storage of its prefill) is NotRepeating. seq is the entry's index."""
    ref_h, ref_t = referents(head), referents(tail)
    mine, theirs = _survivors(head, at, ref_h), _survivors(tail, 1, ref_t)
    if {r: len(v) for r, v in mine.items()} != {r: len(v) for r, v in theirs.items()}:
        raise NotRepeating(f"step {at} and the longer prompt's step 1 leave storages of other roles alive")
    alias = {}  # a tail alloc entry -> the key it has in the joined journal
    for role, xs in theirs.items():
        for x, y in zip(xs, mine[role], strict=True):
            if tail[x].size != head[y].size:
                raise NotRepeating(f"a {role[0]} of {role[2] or 'no module'} alive after step {at} has "
                                   f"{head[y].size} B, at the same length from a longer prompt {tail[x].size} B")
            alias[x] = head[y].key
    out = [e for e in head if e.step <= at]
    next_key = _next_key(head)
    shift = at - 1
    for i, e in enumerate(tail):
        if e.step < 2:
            continue
        if e.action == "alloc":
            alias[i], next_key = next_key, next_key + 1
            key = alias[i]
        elif e.action == "end":
            key = e.key
        elif ref_t.get(i) in alias:
            key = alias[ref_t[i]]
        else:
            raise NotRepeating(f"entry {i} from the longer prompt refers to a storage of its step "
                               f"{tail[ref_t[i]].step if i in ref_t else 'none'}")
        out.append(e._replace(key=key, step=e.step + shift))
    return [TraceEvent(i, *e[1:]) for i, e in enumerate(out)]
