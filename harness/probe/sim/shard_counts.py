"""FSDP2's shallow journals at one shard count (HSDP's replica count, TP's), made from those traced at others.

An FSDP2 rank's journal at a few layers is the same over N shards as over M but for its sizes: a
shard (a parameter's, its gradient's, AdamW's state, the all-gather input) is 1/N of the whole
where N divides the first dimension of every parameter (FSDP2 shards dim 0 and pads it to a
multiple of N: no padding then; of a tensor-parallel rank's slice, so N x tp), while what is
gathered, the activations and the rest are whole at any count; a device mesh's rank tensors
(HSDP's, tensor parallel's) hold one entry per GPU; and FSDP2's copy kernels' launch tables are
sized by their chunks, whose codes name them (config.kernels: split_copy, chunk_cat). So where a
job's shallow journals were traced over two or more shard counts (each kept in the trace cache),
another count takes them from those instead of tracing: each entry's bytes the same at every count
(kept), its bytes times the count the same at every count (a shard, scaled to the count) or its
bytes the count times the same (a mesh's); each copy's code rewritten field by field the same way
(its chunk count the count) and sized from it on the point's card; a free's or retag's bytes its
alloc's. The figures beside scale alike, but the parameter and state bytes, which count each
storage as the allocator holds it (512 B blocks): the made journal's shards of those kinds alive at
its end, each so, and what else each traced count's figure holds (the same at each); and tensor
parallel's traffic, the same at every count, is kept apart from the data-parallel traffic (HSDP's
all-reduce across replicas: a shard). Anything else (an entry of another form,
journals that differ otherwise, a count that some parameter's first dimension does not divide)
leaves the count to be traced. Its synthesis is then checked as any other's (a structure not
checked yet is traced at a+2 on the point's own count).

HSDP's replica count is made alike, its shard count kept: each replica group's ranks hold the same
shards, all-reduce the same gradient shards across replicas and gather the same layers over 2 or 64
replicas; only its device mesh's rank tensors grow, one entry a GPU (7B's dimensions at 2 layers
over 4 shards: 49 of 1,042 entries, each the replica count times the same). A job's shard counts
are tried first, then its replica counts (a note of its own).

Tensor parallel's degree alike, where asked (TENSOR_PARALLEL): a rank's heads and columns 1/TP of
the whole, the rest whole, the attention kernels' scratch sized from their codes' shapes (their
heads scaled). Only the caller can trust it, by tracing the point's own first layer
(probe.sim.shortcut): a rank's heads may take the kernels another way (one key/value head a rank,
flash splitting the keys of few), so the counts that agree are taken, all or the two nearest.
Under FSDP2 too, at the same shard count: a unit's gathered buffer (and its shard, its gradients'
reduce-scatter) holds its 1/TP parameters beside its whole ones (a norm's), c + d/TP bytes, as do
the figures that sum them (the bytes all-gathered a step); two counts fit any such pair, so in the
deeper journal only where the first journal (which the point's own trace checks) holds an entry of
the same bytes at every count: Llama-2-7B over 4 shards x TP 2, 4 and 8, at one layer 44 of 1,048
entries, at two 66 of 1,715.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
from pathlib import Path
from typing import Any

from harness.config import attention, kernels
from harness.config.models import hf_config, model_key, on_meta
from harness.config.point import AUTO_NODES, Point, WorkloadName
from harness.probe.sim import ledger, repeat
from harness.probe.sim.layers import at_depth
from harness.probe.sim.sharded import TENSOR_PARALLEL_TRAFFIC
from harness.probe.sim.tracker import TraceEvent, counted
from harness.probe.sim.virtual_cuda import READS_CARD
from harness.record import trace_store

# FSDP2's copies (tables of each chunk, made at any count) and the attention kernels' scratch, sized
# by the call's shape (a tensor-parallel rank's heads): a fused backward's, flash's split keys', the
# memory-efficient backward's
_SCALED_CODES = ("split_copy", "chunk_cat", attention.FUSED_PREFIX[:-1], kernels.SPLITKV_PREFIX[:-1],
                 kernels.EFFICIENT_PREFIX[:-1])
_NUMBER = re.compile(r"\d+")


# The degrees a job's journals are made across: FSDP2's shard count, HSDP's replica count beside its
# shards (each replica group's ranks hold the same shards at any count: only the mesh grows), and
# tensor parallel's (a rank's heads and columns 1/N of the whole; read only where asked: a rank's
# heads may take the kernels another way, which its own first layer must show, probe.sim.shortcut)
SHARDS, TENSOR_PARALLEL = ("dp_shard", "dp_replicate"), ("tp",)
_OVER = SHARDS + TENSOR_PARALLEL


def _key(point: Point, over: str) -> str | None:
    """The job as any count of degree `over` of it (the other degrees as they are), on cards of the
    point's kernel geometry (its launch tables are sized there); None: not training, one GPU of that
    degree, or not FSDP2 (over shards or replicas)."""
    p = point.parallel
    if point.workload.name != WorkloadName.train or getattr(p, over) == 1 or (over != "tp" and p.dp_shard == 1):
        return None
    at_two: dict[str, Any] = {over: 2}
    two = dataclasses.replace(p, nodes=AUTO_NODES, **at_two)
    # (a note of each degree's own: a job at 2 x 2 is the key of both)
    prefix = "" if over == "dp_shard" else f"{over}:"
    return f"{prefix}{trace_store.trace_id(point.replace(parallel=two))}:{tuple(kernels.geometry(point.gpu))}"


def write(cache: Path | None, point: Point, depths: tuple[int, ...], journals: list[list[TraceEvent]],
          findings: list[dict]) -> None:
    """Keep the journals and findings at `depths` traced over the point's counts beside the job's
    other counts' of each degree (a trace that read the card is kept for its own point only). Points
    written at once may keep one count of theirs: the other is traced again where needed."""
    if any(f.get(READS_CARD) for f in findings):
        return
    keys = {over: key for over in _OVER if (key := _key(point, over)) is not None}
    kept = {"journals": [[list(e) for e in j] for j in journals], "findings": findings} if keys else {}
    for over, key in keys.items():
        note = trace_store.read_note(cache, trace_store.SHARD_COUNTS, f"{key}:{depths}") or {}
        counts = note.get("counts") if isinstance(note.get("counts"), dict) else {}
        counts[str(getattr(point.parallel, over))] = kept
        trace_store.write_note(cache, trace_store.SHARD_COUNTS, f"{key}:{depths}", {"counts": counts})


def read(cache: Path | None, point: Point, depths: tuple[int, ...], degrees: tuple[str, ...] = SHARDS
         ) -> tuple[list[list[TraceEvent]], list, str] | None:
    """The journals and findings at `depths` of `point` made from two or more other counts' of the
    first of `degrees` that can (shards, then replicas; or TENSOR_PARALLEL) and how, for
    trace_method; None where they cannot be (see the module's docstring)."""
    for over in degrees:
        made = _read(cache, point, depths, over)
        if made is not None:
            return made
    return None


def _read(cache: Path | None, point: Point, depths: tuple[int, ...], over: str
          ) -> tuple[list[list[TraceEvent]], list, str] | None:
    key = _key(point, over)
    note = trace_store.read_note(cache, trace_store.SHARD_COUNTS, f"{key}:{depths}") if key else None
    if note is None:
        return None
    # over shards, the counts whose shards are whole rows (of a tensor-parallel rank's slice), as the
    # point's must be: only theirs are parsed (a note of 7B's four counts is 0.9 MB); over replicas,
    # every count's shards are the point's (over tensor parallel, none: checked by the caller)
    m, tp = getattr(point.parallel, over), point.parallel.tp
    dims = _first_dims(point, max(depths)) if over == "dp_shard" else ()
    if dims is None or any(d % (m * tp) for d in dims):
        return None
    try:
        kept = {int(n): c for n, c in note["counts"].items()}
        counts = sorted(n for n in kept if n != m and all(d % (n * tp) == 0 for d in dims))
        if len(counts) < 2:
            return None
        traced = {n: ([[TraceEvent._make(e) for e in j] for j in kept[n]["journals"]], list(kept[n]["findings"]))
                  for n in counts}
    except (KeyError, TypeError, ValueError, AttributeError):  # not a note of ours: traced anew
        return None
    # every count at once; else (tensor parallel: a count whose ranks hold one head each may take
    # the kernels another way) the two nearest the point's that make it
    tried = [counts]
    if over == "tp" and len(counts) > 2:
        tried += sorted((list(c) for c in itertools.combinations(counts, 2)),
                        key=lambda c: sum(abs(math.log(n / m)) for n in c))
    g = kernels.geometry(point.gpu)
    for using in tried:
        made = _made(traced, using, m, g, len(depths), over)
        if made is not None:
            gpus = point.parallel.world_size // m  # (each count's job: its other degrees' ranks too)
            return *made, f"scaled from those over {', '.join(str(n * gpus) for n in using)} GPUs"
    return None


def _made(traced: dict[int, tuple[list, list]], counts: list[int], m: int, g: kernels.Geometry,
          depths: int, over: str) -> tuple[list[list[TraceEvent]], list] | None:
    """The journals and findings at each of `depths` depths over `m` made from those over `counts`
    (`traced`: each count's), or None. `over`: their degree (tensor parallel's: c + d/count bytes)."""
    journals, findings = [], []
    # over tensor parallel, the bytes at each count of the first journal's entries (which the caller
    # checks): the deeper journal's made c + d/count only where they are one of those (its figures
    # so too: each sums whole and 1/TP parts, as the first's)
    checked: set[tuple[int, ...]] | None = set() if over == "tp" else None
    for i in range(depths):
        at = {n: traced[n][0][i] for n in counts}
        journal = _scaled(at, m, g, checked, checking=i == 0)
        found = None if journal is None else _scaled_findings([traced[n][1][i] for n in counts], at, journal, m,
                                                              checked is not None)
        if journal is None or found is None:
            return None
        journals.append(journal)
        findings.append(found)
    return journals, findings


# The figures that sum storages as the allocator holds them (tracker.allocated_bytes_of: 512 B
# blocks, so a shard's bytes do not scale below that) -> the kind of those storages in a journal
_HELD = {"params_bytes": "parameter", "state_bytes": "optimizer_state"}


def _scaled_findings(found: list[dict], journals: dict[int, list[TraceEvent]], journal: list[TraceEvent],
                     m: int, affine: bool = False) -> dict | None:
    """The findings over `m` GPUs (its `journal`) from those over other counts (`journals`): the
    figures of _HELD the shards of their kind alive at the journal's end, each as the allocator
    holds it, and what else every other count's figure holds (the same at each); the other figures
    _scaled_value's (or `affine`: c + d/count); the rest (what holds a leak, the attention calls)
    the same at each count. None where they are not."""
    counts = sorted(journals)
    rest = [{k: v for k, v in f.items() if k != "scalars"} for f in found]
    if any(r != rest[0] for r in rest):
        return None  # (a holder's bytes, for one, count blocks: not scaled)
    scalars = [dict(f.get("scalars") or {}) for f in found]
    # (the journals differ in their sizes only: the same storages alive at each one's end, of one kind)
    alive, held = ledger.alive_at_end(journal), {}
    for name, kind in _HELD.items():
        if all(name in s for s in scalars):
            # a shard's bytes times the count the same at every count (a device mesh's rank tensor,
            # which grows with it, or a rotary buffer, the same at each: not a shard)
            shards = [i for i, k in alive.items() if k == kind and len({journals[n][i].size * n for n in counts}) == 1]
            other = {s.pop(name) - sum(counted(journals[n][i].size) for i in shards)
                     for n, s in zip(counts, scalars, strict=True)}
            if len(other) != 1:
                return None
            held[name] = sum(counted(journal[i].size) for i in shards) + other.pop()
    # tensor parallel's traffic (the same at every count, as the rest is) apart from the data
    # parallel one's, which may be a shard (HSDP's all-reduce across replicas)
    over_tp = rest[0].get(TENSOR_PARALLEL_TRAFFIC) or {}
    made = _scaled_value([{**s, **{k: s[k] - v for k, v in over_tp.items()}} for s in scalars], counts, m, affine)
    if made is _NO:
        return None
    return {**rest[0], "scalars": {**made, **{k: made[k] + v for k, v in over_tp.items()}, **held}}


_dims: dict[str, tuple[int, ...] | None] = {}  # model_key -> _first_dims


def _first_dims(point: Point, depth: int) -> tuple[int, ...] | None:
    """The first dimensions of the model's parameters, each once (None: one has none, a scalar
    FSDP2 cannot shard), read off its first `depth` layers (the deeper of the journals' depths:
    every layer after them is built as one of them, probe.sim.layers; 70B whole on the meta device
    took 0.05-0.09 s of a point made in 1.8 s)."""
    key = model_key(point.model)
    if key not in _dims:
        shapes = [tuple(p.shape) for p in on_meta(hf_config(at_depth(point, depth).model)).parameters()]
        _dims[key] = None if any(not s for s in shapes) else tuple(sorted({int(s[0]) for s in shapes}))
    return _dims[key]


def _scaled(journals: dict[int, list[TraceEvent]], m: int, g: kernels.Geometry,
            checked: set[tuple[int, ...]] | None = None, checking: bool = True) -> list[TraceEvent] | None:
    """The journal over `m` GPUs made of the same depth's journals over other counts, or None.
    `checked` (None: no entry c + d/count): the bytes at each count of the entries of the journal
    the caller checks, into it where this is that journal (`checking`); else an entry's bytes are
    made so only where they are one of those."""
    counts = sorted(journals)
    canon = [repeat.canonical(journals[n]) for n in counts]
    first = journals[counts[0]]
    if any(len(c) != len(canon[0]) for c in canon):
        return None
    out: list[TraceEvent] = []
    for i, e in enumerate(first):
        at = [c[i] for c in canon]
        if any(c[:2] + c[3:8] != at[0][:2] + at[0][3:8] for c in at):
            return None
        sizes, codes = [c[2] for c in at], [c[8] for c in at]
        ref = at[0][1]
        if e.action != "alloc" and 0 <= ref < len(out) and all(c[2] == cn[ref][2] for c, cn in zip(at, canon, strict=True)):
            out.append(e._replace(size=out[ref].size))  # a free's or retag's bytes: its alloc's
            continue
        if len(set(sizes)) > 1 and len(set(codes)) == 1 and _sizes_it(codes[0]):
            return None  # a launch of the same code sized otherwise: not a copy's table
        if len(set(codes)) > 1:
            code = _scaled_code(codes, counts, m)
            if code is None or any(_code_bytes(c, g) != s for c, s in zip(codes, sizes, strict=True)):
                return None
            out.append(e._replace(size=_code_bytes(code, g), kernel=code))
            continue
        size = _scaled_value(sizes, counts, m, checked is not None and (checking or tuple(sizes) in checked))
        if size is _NO:
            return None
        if checked is not None and checking:
            checked.add(tuple(sizes))
        out.append(e._replace(size=size))
    return out


def _sizes_it(code: str) -> bool:
    """Whether a trace's `code` says its allocation's bytes (a fused forward's outputs and scratch
    carry one without their shape, for the swap of kernels, probe.sim.fused_swap: a value)."""
    return bool(code) and not (code.startswith(attention.FUSED_PREFIX) and attention.fused_parts(code)[2] is None)


def _code_bytes(code: str, g: kernels.Geometry) -> int:
    """A code's bytes on a card of geometry `g`: a fused backward's block by its shape (alike on
    every card), else config.kernels'."""
    if code.startswith(attention.FUSED_PREFIX):
        _phase, kernel, shape, block = attention.fused_parts(code)
        return -1 if shape is None else attention.fused_backward_scratch(kernel, shape)[block or 0]
    return kernels.scratch_bytes(code, g)


def _scaled_code(codes: list[str], counts: list[int], m: int) -> str | None:
    """A copy's code over `m` GPUs from its codes over `counts`: each number kept, the count, or
    scaled as a shard (_scaled_value); None for a kernel FSDP2 does not launch at every count."""
    kind = codes[0].partition(":")[0]
    numbers = [[int(v) for v in _NUMBER.findall(c)] for c in codes]
    if kind not in _SCALED_CODES or any(c.partition(":")[0] != kind or len(n) != len(numbers[0])
                                        for c, n in zip(codes, numbers, strict=True)):
        return None
    made = []
    for values in zip(*numbers, strict=True):
        v = m if list(values) == counts else _scaled_value(list(values), counts, m)
        if v is _NO:
            return None
        made.append(str(v))
    pieces = _NUMBER.split(codes[0])
    return "".join(p + (made[k] if k < len(made) else "") for k, p in enumerate(pieces))


class _No:
    """No value scales so (a sentinel: None is a finding's value)."""


_NO = _No()


def _scaled_value(values: list, counts: list[int], m: int, affine: bool = False):
    """The value over `m` GPUs of one taking `values` over `counts`: the same at each, kept; an int
    whose product with the count is the same at each, that product over `m` where whole (a
    shard's bytes); an int the count times the same at each, `m` times that (a device mesh's rank
    tensors, HSDP's and tensor parallel's: one entry per GPU); or where `affine`, _affine's; a dict
    (the figures), each of its values so. Else _NO."""
    first = values[0]
    if all(v == first and type(v) is type(first) for v in values):
        return first
    if all(type(v) is int for v in values):
        whole = {v * n for v, n in zip(values, counts, strict=True)}  # a shard: 1/n of a whole
        if len(whole) == 1:
            (total,) = whole
            return total // m if total % m == 0 else _NO
        if all(v % n == 0 for v, n in zip(values, counts, strict=True)):  # one per GPU: a mesh's ranks
            each = {v // n for v, n in zip(values, counts, strict=True)}
            if len(each) == 1:
                return each.pop() * m
        return _affine(values, counts, m) if affine else _NO
    if all(isinstance(v, dict) for v in values) and all(v.keys() == first.keys() for v in values):
        made = {k: _scaled_value([v[k] for v in values], counts, m, affine) for k in first}
        return _NO if any(x is _NO for x in made.values()) else made
    return _NO


def _affine(values: list[int], counts: list[int], m: int):
    """c + d/m where each of `values` is c + d/count (whole bytes: d a multiple of every count and
    of `m`; a tensor-parallel rank's 1/TP parameters beside its whole ones), else _NO. Two counts
    fit any two values: what trusts it is the caller's."""
    (n0, v0), (n1, v1) = sorted(zip(counts, values, strict=True))[:2]
    d, rest = divmod((v0 - v1) * n0 * n1, n1 - n0)
    if rest or d % n0:
        return _NO
    c = v0 - d // n0
    if any(d % n or c + d // n != v for n, v in zip(counts, values, strict=True)) or d % m:
        return _NO
    return c + d // m
