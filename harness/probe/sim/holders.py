"""Who holds memory that should have been freed: Python containers keeping old steps' tensors (and
their autograd graphs), and reference cycles only the cyclic GC frees.

The cycle search is the mechanism of torch.utils.viz._cycles (gc.DEBUG_SAVEALL, then look at what
the collector found) without its CUDA-only filters, so it works on the virtual GPU too.
"""

from __future__ import annotations

import gc
import types
import warnings
from collections import Counter

import torch


def _describe(obj) -> str:
    if isinstance(obj, torch.Tensor):
        fn = type(obj.grad_fn).__name__ if obj.grad_fn is not None else None
        return f"Tensor{tuple(obj.shape)}" + (f"(grad_fn={fn})" if fn else "")
    return type(obj).__name__


def old_tensors(tracker, step: int) -> list[str]:
    """Python-reachable tensors with an autograd graph, born before `step` and still alive: the
    roots a loop keeps by mistake (with everything their graphs saved), and what holds them."""
    born = {e.key: e.step for e in tracker.events if e.action == "alloc"}
    found: Counter[str] = Counter()
    with warnings.catch_warnings():  # some library objects warn when their type is probed
        warnings.simplefilter("ignore")
        tensors = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    old = []
    for obj in tensors:
        if obj.grad_fn is None:
            continue
        key = _storage_key(obj)
        live = tracker._live.get(key) if key is not None else None
        if live is not None and born.get(key, step) < step and live[2] == "activation":
            old.append(obj)
    # One walk of the heap for all of them (gc.get_referrers walks every object per call).
    ids = {id(t): t for t in old}
    holders: dict[int, list] = {}
    for r in gc.get_referrers(*old) if old else ():
        if r is tensors or r is old or r is ids or isinstance(r, types.FrameType):
            continue
        for x in gc.get_referents(r):
            if id(x) in ids:
                holders.setdefault(id(x), []).append(r)
    for obj in old:
        if holders.get(id(obj)):  # else reachable only through autograd's saved tensors: not a root
            found[f"a {type(holders[id(obj)][0]).__name__} holding {_describe(obj)}"] += 1
    return [text + (f" (x{n})" if n > 1 else "") for text, n in found.most_common(3)]


def _storage_key(t: torch.Tensor) -> int | None:
    """The tensor's storage as the tracker keys it (None: a tensor without one)."""
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        return None


def collect_cycles(tracker) -> tuple[list[str], int]:
    """Run the cyclic GC: (the kinds of objects in the cycles that held this trace's tensors, most
    first; the bytes freed). Cycles of other tensors (an earlier trace's in this process, frozen
    with its leftovers where the heap is set aside) are freed, not named."""
    before = tracker.allocated
    was = gc.get_debug()
    gc.set_debug(gc.DEBUG_SAVEALL)  # unreachable objects go to gc.garbage instead of being freed
    try:
        gc.collect()
        garbage = list(gc.garbage)
        gc.garbage.clear()
    finally:
        gc.set_debug(was)
    # Who refers to whom inside the garbage, from one pass over it: gc.get_referrers would walk the
    # whole heap once per object (50 ms each in a large process)
    in_garbage = {id(o) for o in garbage}
    referrers: dict[int, list] = {}
    for g in garbage:
        for x in gc.get_referents(g):
            if id(x) in in_garbage:
                referrers.setdefault(id(x), []).append(g)
    holders: Counter[str] = Counter()
    frontier: list = []
    for t in (o for o in garbage if isinstance(o, torch.Tensor) and _storage_key(o) in tracker._live):
        frontier, seen = [t], {id(t)}
        for _depth in range(4):  # up the referrer chain, inside the garbage only
            nxt = []
            for o in frontier:
                for r in referrers.get(id(o), ()):
                    if id(r) not in seen:
                        seen.add(id(r))
                        nxt.append(r)
                        if not isinstance(r, (dict, list, tuple, set, torch.Tensor)) and type(r).__name__ != "cell":
                            holders[type(r).__name__] += 1
            frontier = nxt
    del garbage, frontier, referrers
    gc.collect()
    return [name for name, _n in holders.most_common(3)], before - tracker.allocated


def cycle_text(names: list[str], freed_bytes: int) -> str:
    return f"a reference cycle through {', '.join(names)}; gc.collect() freed {freed_bytes / 1024**2:.1f} MiB"
