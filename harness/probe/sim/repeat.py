"""A deep model's journal from a shallow one's: decoder stacks repeat one block, so the journals of
depth a and a+1 differ by one layer's entries at a few places (its parameters, its forward, its
backward, its share of each optimizer op), and depth N is depth a+1 with N-a-1 more copies there.

`learn` aligns the two journals and says, for every entry that refers to an earlier one (a free, a
retag), which entry it refers to at any depth; `synthesize` writes the journal of depth N.
probe.sim.shortcut checks the result against a traced depth before it is trusted.

Layers are counted in the order the layers run (`layer` 0 is the first new one, a): a place that
runs them in reverse (backward, a checkpoint's recompute) emits its copies top layer first. A
storage handed from layer to layer (the residual stream forward, its gradient backward) is a chain:
the first new layer takes it from the old part, each next layer from the one before, and the old
part takes the last one's.

An old entry may also grow with the depth rather than repeat: one storage for every layer's
parameters (DDP's flat gradient bucket) or one index per parameter (DDP's rebuilt bucket order).
Where the deeper journal has an entry alike but for its size in place of the shallower one's, the
entry is scaled: each layer more adds the bytes the one layer added (checked at a+2 as the rest).
"""

from __future__ import annotations

import bisect
import difflib
import hashlib
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from harness.probe.sim.tracker import TraceEvent

_REFERS = ("free", "retag")  # entries that name a storage allocated before them


class NotRepeating(ValueError):
    """The journals do not differ by repeated layers (or not in a way learn can follow)."""


@dataclass
class _Block:
    start: int  # in the deeper journal
    length: int
    reverse: bool  # copies emitted top layer first (backward)
    # (block, offset): a junction, what each layer does to the one run before it (_junctions). Each
    # copy but the last is emitted inside the next copy of that block, at that offset; the last here.
    joins: tuple[int, int] | None = None


@dataclass
class Template:
    """The deeper journal (depth+1 layers), its new layer's places, and where each reference goes."""
    depth: int  # a: the shallower journal's layers
    entries: list[TraceEvent]
    blocks: list[_Block]
    block_of: list[int]  # per entry: its block, -1 outside any
    rules: dict[int, tuple]  # referring entry -> how to find what it refers to
    layer_names: re.Pattern  # the new layer's module names (their index is rewritten per copy)
    layer_prefix: str
    scaled: dict[int, int] = field(default_factory=dict)  # old entry -> the bytes each layer adds to it


def _token(e: TraceEvent) -> tuple:
    return (e.action, e.size, e.kind, e.phase, e.step, e.module, e.stream, e.kernel)


def _sizeless(e: TraceEvent) -> tuple:
    """_token but the size: an entry that grows with the depth keeps it."""
    return (e.action, e.kind, e.phase, e.step, e.module, e.stream)


def referents(entries: list[TraceEvent]) -> dict[int, int]:
    """Referring entry -> the alloc it refers to (the latest alloc of its key)."""
    last: dict[int, int] = {}
    out = {}
    for i, e in enumerate(entries):
        if e.action == "alloc":
            last[e.key] = i
        elif e.action in _REFERS and e.key in last:
            out[i] = last[e.key]
    return out


def _run(sa: str, sb: str, i: int, j: int) -> int:
    """How many entries sa[i:] and sb[j:] have in common at their start."""
    lo, hi = 0, min(len(sa) - i, len(sb) - j)
    while lo < hi:  # binary search on slices: each compare runs in C
        mid = (lo + hi + 1) // 2
        if sa[i:i + mid] == sb[j:j + mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _insertion(sa: str, sb: str, i: int, j: int) -> int | None:
    """The length of the insertion in sb at j: of the lengths after which sb matches sa[i:] again
    (no more than sb has to spare), the one after which they match longest (the shortest of
    those)."""
    spare = (len(sb) - j) - (len(sa) - i)
    best, best_run = None, 0
    at = sb.find(sa[i], j + 1, j + spare + 1)
    while at >= 0:
        run = _run(sa, sb, i, at)
        if run > best_run:
            best, best_run = at - j, run
        at = sb.find(sa[i], at + 1, j + spare + 1)
    return best


def _align(a: list[TraceEvent], b: list[TraceEvent], refs: dict[int, int],
           layer_prefix: str, depth: int) -> tuple[list[_Block], list[int], dict[int, int]]:
    """b's insertions into a (b = a with blocks inserted), each placed where the new layer's own
    entries are (_place). Returns the blocks, per entry of a its index in b, and the scaled entries
    (b's index -> a's): where an entry of a is nowhere ahead in b but b has it there with another
    size."""
    ids: dict[tuple, int] = {}
    sa = "".join(chr(0x100 + ids.setdefault(_token(e), len(ids))) for e in a)
    sb = "".join(chr(0x100 + ids.setdefault(_token(e), len(ids))) for e in b)
    # the same less sizes, for an entry that grows
    ta = "".join(chr(0x100 + ids.setdefault(_sizeless(e), len(ids))) for e in a)
    tb = "".join(chr(0x100 + ids.setdefault(_sizeless(e), len(ids))) for e in b)
    spans: list[list[int]] = []
    scaled: dict[int, int] = {}
    i = j = 0
    while i < len(sa):
        if j < len(sb) and sa[i] == sb[j]:
            i += 1
            j += 1
            continue
        found = _insertion(sa, sb, i, j)
        if found is None:  # nowhere ahead as it is: here with another size, or after an insertion
            if j < len(sb) and ta[i] == tb[j]:
                scaled[j] = i
                i += 1
                j += 1
                continue
            found = _insertion(ta, tb, i, j)
        if found is None:
            raise NotRepeating(f"entry {i} of the shallower journal is not in the deeper one")
        spans.append([j, found])
        j += found
    if j < len(sb):
        spans.append([j, len(sb) - j])
    spans = [half for span in spans for part in _by_phase(span, b) for half in _turned(part, b, refs)]
    # the old layers' names (not the new one's, `depth`): which side of the new layer they run on
    old = re.compile(rf"^{re.escape(layer_prefix)}(?!{depth}(\.|$))\d+(\.|$)")
    blocks = _place(sb, spans, refs, b, old, referents(a))
    inside: set[int] = set()
    for blk in blocks:
        inside.update(range(blk.start, blk.start + blk.length))
    common = [k for k in range(len(sb)) if k not in inside]
    if len(common) != len(sa) or any(sa[n] != sb[k] and scaled.get(k) != n for n, k in enumerate(common)):
        raise NotRepeating("the deeper journal is not the shallower one with insertions")
    return blocks, common, scaled


def _by_phase(span: list[int], b: list[TraceEvent]) -> list[list[int]]:
    """An insertion that runs across the end of a phase (or step) as one for each: the new layer's
    entries of each are placed in that phase's run (FSDP2: the optimizer's last retags, of the
    layer's state, then zero_grad freeing its gradients' shard, which the greedy alignment met as
    one insertion, four entries off where the final norm's retags look like the layer's first)."""
    start, length = span
    cuts = [k for k in range(start + 1, start + length) if (b[k].phase, b[k].step) != (b[k - 1].phase, b[k - 1].step)]
    ends = [start, *cuts, start + length]
    return [[x, y - x] for x, y in zip(ends, ends[1:])]


def _turned(span: list[int], b: list[TraceEvent], refs: dict[int, int]) -> list[list[int]]:
    """An insertion that allocates and then frees what it allocated, last first, inside an old
    layer's alike (its last allocation before, freed right after: a foreach op's outputs for each
    parameter, where no other parameter's follow the new layer's), as two: the layers' allocations
    run one way and their frees the other. (A layer's own temporaries, freed within it, follow the
    old layer's frees: one block.)"""
    start, length = span
    half = length // 2
    if length % 2 or not half or start == 0 or b[start - 1].action != "alloc" \
            or refs.get(start + length) != start - 1 \
            or any(b[start + k].action != "alloc" or refs.get(start + length - 1 - k) != start + k for k in range(half)):
        return [span]
    return [[start, half], [start + half, half]]


_NOWHERE = np.iinfo(np.int64).min  # what no entry refers to (_referred)


def _referred(refs: dict[int, int]) -> np.ndarray:
    """`refs` (referring entry -> the alloc it refers to) as an array by referring entry, _NOWHERE
    where an entry refers to none."""
    out = np.full(max(refs, default=0) + 1, _NOWHERE, dtype=np.int64)
    out[list(refs)] = list(refs.values())
    return out


def _misfits(starts: range, length: int, touched: set[tuple[int, int]], others: _Others,
             refers: np.ndarray) -> dict[int, int]:
    """How badly an insertion of `length` placed at each of `starts` explains the references around
    it: an old entry referring to another old one that it did not refer to in the shallower journal
    (`refers`: its references, _referred), weighing most, and a reference across the new layer's
    edge (a hand-off: a few per layer)."""
    # What does not depend on the start, once: whether the other insertions hold each end, and
    # where an old entry held by none of them sits in the shallower journal before this insertion
    rows = []
    for referring, referred in touched:
        held = others.owns(referring), others.owns(referred)
        at = (0, 0) if any(held) else (referring - others.count_before(referring),
                                       referred - others.count_before(referred))
        rows.append((referring, referred, *held, *at, not any(held)))
    if not rows:
        return dict.fromkeys(starts, 0)
    f, x, of, ox, f_a, x_a, old = (np.array(column) for column in zip(*rows))
    out: dict[int, int] = {}
    at_once = max(1, 4_000_000 // len(rows))  # starts x references a pass (a block of 6 layers slides far)
    for lo in range(0, len(starts), at_once):
        s = np.array(starts[lo:lo + at_once])[:, None]
        f_in, x_in = (s <= f) & (f < s + length), (s <= x) & (x < s + length)
        # a reference across the edge, unless another insertion holds its other end
        bad = ((f_in != x_in) & np.where(f_in, ~ox, ~of)).sum(axis=1)
        # both ends old: where they sit in the shallower journal had the insertion been here
        f_at = f_a - np.minimum(length, np.maximum(0, f - s))
        x_at = x_a - np.minimum(length, np.maximum(0, x - s))
        found = np.where((f_at >= 0) & (f_at < len(refers)), refers[np.clip(f_at, 0, len(refers) - 1)], _NOWHERE)
        bad += 100 * (~f_in & ~x_in & old & (found != x_at)).sum(axis=1)
        out.update(zip(starts[lo:lo + at_once], bad.tolist()))
    return out


def _place(sb: str, spans: list[list[int]], refs: dict[int, int], b: list[TraceEvent],
           layer_name: re.Pattern, ref_a: dict[int, int]) -> list[_Block]:
    """Where in its run of look-alike layers each insertion is the new layer: an insertion may slide
    along a run of identical entries (the same tokens either way), and the new layer's place is the
    one that leaves the old entries referring as they did and refers least across its edge (a
    layer's storages are its own: allocated, retagged and freed by that layer's entries). The
    layers run top-down where the old layers' named entries (same phase and step) come right after
    the new layer's, not before; else where the new layer is nearer its run's start; a run of one
    layer's length goes by its phase (backward runs top-down)."""
    ranges = []
    for n, (start, length) in enumerate(spans):
        lo = spans[n - 1][0] + spans[n - 1][1] if n else 0
        hi = spans[n + 1][0] if n + 1 < len(spans) else len(sb)
        left = start
        while left > lo and sb[left - 1] == sb[left + length - 1]:
            left -= 1
        right = start
        while right + length < hi and sb[right] == sb[right + length]:
            right += 1
        ranges.append((left, right))
    refs_at: dict[int, list[tuple[int, int]]] = {}
    for f, x in refs.items():
        refs_at.setdefault(f, []).append((f, x))
        refs_at.setdefault(x, []).append((f, x))
    refers = _referred(ref_a)
    for _ in range(2):  # each placement given the others', twice over
        for n, (left, right) in enumerate(ranges):
            if left == right:
                continue
            length = spans[n][1]
            others = _Others([span for m, span in enumerate(spans) if m != n])
            touched = {r for k in range(left, right + length) for r in refs_at.get(k, ())}
            misfits = _misfits(range(left, right + 1), length, touched, others, refers)
            spans[n][0] = min(misfits, key=lambda s: (misfits[s], -s))
    blocks = []
    for (start, length), (left, right) in zip(spans, ranges):
        before = _names_a_layer(b, range(max(0, start - length), start), b[start], layer_name, refs)
        after = _names_a_layer(b, range(start + length, min(len(b), start + 2 * length)), b[start], layer_name, refs)
        if before != after:
            reverse = after
        elif left < right:
            reverse = start - left < right - start
        else:
            reverse = any(e.phase == "backward" for e in b[start:start + length])
        blocks.append(_Block(start, length, reverse))
    return blocks


class _Others:
    """The other insertions' spans: which entries they hold, how many lie before an entry."""

    def __init__(self, spans: list[list[int]]):
        self.spans = sorted((s0, l0) for s0, l0 in spans)
        self.starts = [s0 for s0, _l0 in self.spans]
        self.before = [0]
        for _s0, l0 in self.spans:
            self.before.append(self.before[-1] + l0)

    def owns(self, k: int) -> bool:
        i = bisect.bisect_right(self.starts, k) - 1
        return i >= 0 and k < self.spans[i][0] + self.spans[i][1]

    def count_before(self, k: int) -> int:  # (k in none of them)
        return self.before[bisect.bisect_right(self.starts, k)]


def _names_a_layer(b: list[TraceEvent], at: range, like: TraceEvent, layer_name: re.Pattern,
                   refs: dict[int, int]) -> bool:
    """Whether any of b's entries `at` in `like`'s phase and step is charged to a layer's module (a
    free or retag: its storage's alloc)."""
    return any(b[k].phase == like.phase and b[k].step == like.step
               and layer_name.match(b[refs.get(k, k)].module) for k in at)


def learn(a: list[TraceEvent], b: list[TraceEvent], depth: int, layer_prefix: str) -> Template:
    """The template from the journals of `depth` and `depth`+1 layers; `layer_prefix` names the
    layers' modules (e.g. "model.layers." for "model.layers.3.mlp")."""
    ref_a, ref_b = referents(a), referents(b)
    blocks, to_b, scaled = _align(a, b, ref_b, layer_prefix, depth)
    _junctions(b, blocks, ref_b)
    block_of = [-1] * len(b)
    for n, blk in enumerate(blocks):
        block_of[blk.start:blk.start + blk.length] = [n] * blk.length
    free_a = {x: f for f, x in ref_a.items() if a[f].action == "free"}
    free_b = {x: f for f, x in ref_b.items() if b[f].action == "free"}
    # Chains: an old storage whose free moved into the new layer; the old free takes the new
    # layer's counterpart instead (the storage that free refers to in b). Or kept: an old storage
    # the new layer holds on to (a checkpoint saving its input, under a graph that is never freed)
    # is freed nowhere, and its old free takes the new layer's counterpart, which each copy but the
    # last holds on to alike.
    handed: dict[int, int] = {}  # old alloc (in b) -> the new layer's counterpart (in b)
    takes_last: dict[int, int] = {}  # old free (in b) -> the new layer's storage it frees
    for xa in range(len(a)):
        if a[xa].action != "alloc":
            continue
        g = free_b.get(to_b[xa])
        if g is None or block_of[g] < 0:
            fa = free_a.get(xa)
            if g is None and fa is not None and block_of[ref_b.get(to_b[fa], to_b[fa])] >= 0:
                takes_last[to_b[fa]] = ref_b[to_b[fa]]
            elif g != (to_b[fa] if fa is not None else None):
                raise NotRepeating(f"old entry {to_b[xa]}'s storage is freed elsewhere with one layer more "
                                   f"({g if g is not None else 'never'}, not {to_b[fa] if fa is not None else 'never'})")
            continue
        fa = free_a.get(xa)
        if fa is None or block_of[ref_b.get(to_b[fa], to_b[fa])] < 0:
            raise NotRepeating(f"entry {g} of the new layer frees an old storage nothing hands on")
        handed[to_b[xa]] = ref_b[to_b[fa]]
        takes_last[to_b[fa]] = ref_b[to_b[fa]]
    rules: dict[int, tuple] = {}
    for f, x in ref_b.items():
        inner, outer = block_of[f] >= 0, block_of[x] >= 0
        if inner and outer:
            rules[f] = ("same", x)
        elif inner:
            if x not in handed or b[f].action != "free":
                raise NotRepeating(f"entry {f} of the new layer refers to an old storage it was not handed")
            rules[f] = ("chain", x, handed[x])
        elif outer:
            if takes_last.get(f) != x:
                raise NotRepeating(f"old entry {f} refers to the new layer's entry {x} outside a chain")
            rules[f] = ("last", x)
    grows = {k: b[k].size - a[n].size for k, n in scaled.items()}
    return Template(depth, b, blocks, block_of, rules, _layer_names(layer_prefix, depth), layer_prefix, grows)


def _junctions(b: list[TraceEvent], blocks: list[_Block], refs: dict[int, int]) -> None:
    """Mark the blocks that are a junction: entries that only free or retag what one earlier block
    (the new layer, backward) allocated, placed in the layer run after it. Each copy but the last
    goes as far into the next copy of the new layer as it is into that layer (the entries before it
    there aligned with the new layer's, alike but for sizes and modules). FSDP2's post-backward
    frees the reduce-scatter input of the layer reduced before it: with one layer more, the old
    layer frees the new one's, and each of more new layers its predecessor's."""
    def role(e: TraceEvent) -> tuple:
        return (e.action, e.kind, e.phase, e.step, e.stream)

    starts = [blk.start for blk in blocks]  # (in order)

    def block_at(k: int) -> int:
        m = bisect.bisect_right(starts, k) - 1
        return m if m >= 0 and k < blocks[m].start + blocks[m].length else -1

    for n, blk in enumerate(blocks):
        entries = range(blk.start, blk.start + blk.length)
        hosts = {block_at(refs[k]) if k in refs else -1 for k in entries}
        if len(hosts) != 1 or (m := hosts.pop()) in (-1, n):
            continue
        host = blocks[m]
        first = b[host.start]
        if host.reverse and all(b[k].action != "alloc" and (b[k].phase, b[k].step) == (first.phase, first.step)
                                for k in entries):
            # only frees and retags (naming no module) of what a block run top-down allocated, in
            # its phase and step: its copies run as the host's, whatever the entries around it name
            blk.reverse = True
        # Reversed: the layer run after the new one is an old layer (forward, it is what follows
        # the layers)
        if not (host.reverse and blk.reverse) or blk.start < host.start + host.length:
            continue
        # Where the junction falls in the layer after the host, aligned with the host's own entries
        # (the new layer may do what the one after does not: prefetch the layer below, where the
        # last has none; and the other way round)
        ids: dict[tuple, int] = {}
        after = [ids.setdefault(role(e), len(ids)) for e in b[host.start + host.length:blk.start]]
        # against the host's first entries only, as many as those and a tenth more: a block of
        # several layers repeats within itself, and the junction is in its first layer alike
        # with that, not in a later one
        mine = [ids.setdefault(role(e), len(ids))
                for e in b[host.start:host.start + min(host.length, len(after) + len(after) // 10 + 1)]]
        matched = [run for run in difflib.SequenceMatcher(None, mine, after, autojunk=False).get_matching_blocks()
                   if run.size]
        # the layer after as the host's entries, but for a few
        if not matched or matched[-1].b + matched[-1].size != len(after) \
                or 10 * sum(run.size for run in matched) < 9 * len(after):
            continue
        offset = matched[-1].a + matched[-1].size
        if offset < host.length:
            blk.joins = (m, offset)


def synthesize(t: Template, n_layers: int) -> list[TraceEvent]:
    """The journal of `n_layers` (> t.depth) layers. Keys are renumbered (each alloc its own);
    seq is the entry's index."""
    k = n_layers - t.depth
    if k < 1:
        raise ValueError(f"synthesize {n_layers} layers from a template of {t.depth}+1")
    b, blocks = t.entries, t.blocks

    def copy_of(blk: int, layer: int) -> int:  # the copy (in emission order) of `layer` at `blk`
        return k - 1 - layer if blocks[blk].reverse else layer

    layer_of = copy_of  # the same map both ways: copy c of a reversed block is layer k-1-c
    alloc_of = referents(b)
    key_of: dict[tuple[int, int], int] = {}  # (entry in b, copy or -1) -> its new key
    out: list[TraceEvent] = []
    renamed: dict[tuple[str, int], str] = {}  # (module, layer) -> its name in that layer

    def target(f: int, copy: int) -> int:
        rule = t.rules.get(f)
        if rule is None:  # an old entry referring to an old storage
            return key_of[(alloc_of[f], -1)]
        if rule[0] == "same":
            x = rule[1]
            return key_of[(x, copy_of(t.block_of[x], layer_of(t.block_of[f], copy)))]
        if rule[0] == "last":
            x = rule[1]
            blk = t.block_of[x]
            # the chain's last new layer: the top one going up, the lowest going down
            return key_of[(x, copy_of(blk, 0 if blocks[blk].reverse else k - 1))]
        _, old, new = rule
        blk = t.block_of[new]
        layer = layer_of(t.block_of[f], copy)
        if not blocks[blk].reverse:  # going up: layer l takes layer l-1's, the first the old one
            return key_of[(old, -1)] if layer == 0 else key_of[(new, copy_of(blk, layer - 1))]
        return key_of[(old, -1)] if layer == k - 1 else key_of[(new, copy_of(blk, layer + 1))]

    def emit(i: int, copy: int) -> None:
        e = b[i]
        if e.action == "alloc":
            key = len(out)
            key_of[(i, copy)] = key
        elif i in alloc_of:
            try:
                key = target(i, copy)
            except KeyError:
                raise NotRepeating(f"entry {i} refers to a storage not yet allocated at depth {n_layers}") from None
        else:
            key = e.key  # a free of something never allocated in the journal, or an end mark
        module, size = e.module, e.size + (k - 1) * t.scaled.get(i, 0)
        if copy >= 0 and module:
            layer = layer_of(t.block_of[i], copy)
            named = renamed.get((module, layer))
            if named is None:  # (a layer's few module names, each emitted thousands of times)
                named = renamed[(module, layer)] = t.layer_names.sub(f"{t.layer_prefix}{t.depth + layer}", module)
            module = named
        out.append(TraceEvent(len(out), e.action, key, size, e.kind, e.phase, e.step, module, e.stream, e.kernel))

    starts = {blk.start: n for n, blk in enumerate(blocks)}
    joined: dict[tuple[int, int], list[_Block]] = {}  # (host block, offset) -> the junctions there
    for blk in blocks:
        if blk.joins is not None:
            joined.setdefault(blk.joins, []).append(blk)
    i = 0
    while i < len(b):
        n = starts.get(i)
        if n is None:
            emit(i, -1)
            i += 1
            continue
        blk = blocks[n]
        for copy in range(k - 1 if blk.joins is not None else 0, k):  # a junction's others are in its host
            for j in range(blk.start, blk.start + blk.length):
                for junction in joined.get((n, j - blk.start), ()) if copy > 0 else ():
                    for jj in range(junction.start, junction.start + junction.length):
                        emit(jj, copy - 1)  # the junction after the copy before
                emit(j, copy)
        i = blk.start + blk.length
    return out


def canonical(entries: list[TraceEvent]) -> list[tuple]:
    """The entries with keys replaced by their alloc's position: equal for equal journals."""
    ref = referents(entries)
    return [(e.action, ref.get(i, i if e.action == "alloc" else -1), e.size, e.kind, e.phase, e.step, e.module,
             e.stream, e.kernel) for i, e in enumerate(entries)]


def skeleton(entries: list[TraceEvent]) -> str:
    """A hash of a journal less its sizes (canonical's entries without them): journals of one job
    at other batches and lengths share it."""
    return hashlib.sha1(repr(_less_sizes(entries)).encode()).hexdigest()[:16]


def _less_sizes(entries: list[TraceEvent]) -> list[tuple]:
    # (a kernel's code holds its launch's sizes: another batch's differ)
    return [c[:2] + c[3:-1] for c in canonical(entries)]


def layout(t: Template) -> dict:
    """What `learn` found, less the entries (JSON): where the new layer sits and the rules."""
    return {"depth": t.depth, "layer_prefix": t.layer_prefix,
            "blocks": [[blk.start, blk.length, blk.reverse, blk.joins] for blk in t.blocks],
            "rules": [[f, *rule] for f, rule in sorted(t.rules.items())]}


def placed(entries: list[TraceEvent], found: dict) -> Template:
    """The template of the deeper journal `entries` with the layer placed as `found` (a layout)
    says: a journal of the same skeleton as the one it was learned on."""
    blocks = [_Block(int(s), int(n), bool(r), (int(j[0]), int(j[1])) if j else None) for s, n, r, j in found["blocks"]]
    block_of = [-1] * len(entries)
    for n, blk in enumerate(blocks):
        if blk.start + blk.length > len(entries):
            raise NotRepeating("the layout does not fit the journal")
        block_of[blk.start:blk.start + blk.length] = [n] * blk.length
    depth, prefix = int(found["depth"]), str(found["layer_prefix"])
    rules = {int(f): tuple(rule) for f, *rule in found["rules"]}
    return Template(depth, entries, blocks, block_of, rules, _layer_names(prefix, depth), prefix)


_ITS_STORAGE = -1  # a recipe's source for a free or retag: the size of the storage it names


def recipe(t: Template) -> list[list] | None:
    """The deeper journal as made of the shallower one's entries (JSON): per entry its action, key,
    kind, phase, step, module and stream, and the shallower entry whose size it has - an old entry its own,
    a new layer's alloc its counterpart in the layer beside it (_counterparts), a new layer's free
    or retag its storage's (_ITS_STORAGE). None where a new layer's alloc has no counterpart, and
    where an entry is scaled (what a layer adds to it is not known for another point's sizes)."""
    if t.scaled:
        return None
    old = [k for k in range(len(t.entries)) if t.block_of[k] < 0]
    in_shallower = {k: n for n, k in enumerate(old)}
    named = referents(t.entries)
    old_allocs = [k for k in old if t.entries[k].action == "alloc"]
    src: dict[int, int] = {}
    for blk in t.blocks:
        mine = range(blk.start, blk.start + blk.length)
        if any(t.entries[j].action != "alloc" and j not in named for j in mine):
            return None  # an end mark, or a free of a storage the journal never allocated
        allocs = [j for j in mine if t.entries[j].action == "alloc"]
        found = _counterparts(t, blk, allocs, old_allocs)
        if found is None:
            return None
        src.update({j: _ITS_STORAGE for j in mine})
        src.update({j: in_shallower[k] for j, k in zip(allocs, found)})
    return [[e.action, e.key, src.get(j, in_shallower.get(j)), e.kind, e.phase, e.step, e.module, e.stream]
            for j, e in enumerate(t.entries)]


def _counterparts(t: Template, blk: _Block, allocs: list[int], old: list[int]) -> list[int] | None:
    """Each of the new layer's allocs in `blk`, matched to the old layer's beside it (`old`: the old
    allocs): in order, alike in all but their sizes with the layer index one less, among the allocs
    just before the block (read backwards) or just after it, a side taken only where each size is
    its match's; then those left, on the side before. The layer beside may allocate what the new
    one does not (the first layer's cuBLAS workspace), and the other way round (FSDP2's prefetch of
    the layer below, which the last layer has none of: its counterpart is the root's, before)."""
    below = f"{t.layer_prefix}{t.depth - 1}"

    def role(k: int) -> tuple:
        # backward's by kind and order alone: FSDP2's prefetch of the layer below is the prefetching
        # layer's, and the lowest layer's counterpart the root's
        e = t.entries[k]
        return (e.kind, e.phase, e.step, "" if e.phase == "backward" else t.layer_names.sub(below, e.module), e.stream)

    at = bisect.bisect_left(old, blk.start)
    window = 2 * len(allocs)
    before, after = old[max(0, at - window):at][::-1], old[at:at + window]
    found: dict[int, int] = {}
    for wanted, near in ((allocs[::-1], before), (allocs, after), (allocs[::-1], before)):
        matched: dict[int, int] = {}
        n = 0
        for j in (j for j in wanted if j not in found):
            m = next((m for m in range(n, len(near)) if role(near[m]) == role(j)), None)
            if m is None:
                continue  # none alike on this side
            if t.entries[near[m]].size != t.entries[j].size:
                break  # not this side's layer: the match taken apart
            matched[j] = near[m]
            n = m + 1
        else:
            found.update(matched)
    return [found[j] for j in allocs] if len(found) == len(allocs) else None


def deepen(shallower: list[TraceEvent], made_of: list[list]) -> list[TraceEvent]:
    """The deeper journal a `recipe` makes of `shallower`, a journal of the skeleton it was taken on."""
    out: list[TraceEvent] = []
    size_of: dict[int, int] = {}  # key -> its storage's size, while it lives
    for i, (action, key, src, kind, phase, step, module, stream) in enumerate(made_of):
        size = size_of[int(key)] if src == _ITS_STORAGE else shallower[int(src)].size
        kernel = "" if src == _ITS_STORAGE else shallower[int(src)].kernel  # (a free's is none)
        if action == "alloc":
            size_of[int(key)] = size
        out.append(TraceEvent(i, str(action), int(key), size, str(kind), str(phase), int(step), str(module),
                              int(stream), kernel))
    return out


def _layer_names(layer_prefix: str, depth: int) -> re.Pattern:
    """The new layer's module names in a template of `depth`+1 layers."""
    return re.compile(rf"^{re.escape(layer_prefix)}{depth}(?=\.|$)")


def structure(t: Template) -> str:
    """A hash of everything `synthesize` takes from `t` but the sizes: the entries' actions, kinds,
    phases, steps, modules and references, the layer's places, the rules and which entries scale.
    Templates with the same structure synthesize alike: one checked at a depth is checked for the
    others (sizes are copied, nothing else depends on them)."""
    blob = repr((t.depth, t.layer_prefix, [(b.start, b.length, b.reverse, b.joins) for b in t.blocks],
                 sorted(t.rules.items()), _less_sizes(t.entries), *([sorted(t.scaled)] if t.scaled else [])))
    return hashlib.sha1(blob.encode()).hexdigest()[:16]


# A block of `period` layers repeated (Gemma 3: five sliding-window layers and a global one) is one
# layer to learn and synthesize: its layers' modules are named as parts of one ("model.layers.8.~1"
# for layer 9 of blocks of 2 from layer 8), and back after synthesis. "~" is in no module's name.
_PART = "~"


def as_blocks(entries: list[TraceEvent], prefix: str, first: int, period: int) -> list[TraceEvent]:
    """`entries` with layers `first` and on named as parts of blocks of `period` layers."""
    def named(m: re.Match) -> str | None:
        if int(m.group(1)) < first:
            return None
        block, part = divmod(int(m.group(1)) - first, period)
        return f"{first + block}.{_PART}{part}"

    return _renamed(entries, period, re.compile(rf"^{re.escape(prefix)}(\d+)(?=\.|$)"), named)


def from_blocks(entries: list[TraceEvent], prefix: str, first: int, period: int) -> list[TraceEvent]:
    """as_blocks undone: each block's parts named as the layers they are."""
    def named(m: re.Match) -> str:
        return str(first + (int(m.group(1)) - first) * period + int(m.group(2)))

    pattern = re.compile(rf"^{re.escape(prefix)}(\d+)\.{re.escape(_PART)}(\d+)(?=\.|$)")
    return _renamed(entries, period, pattern, named)


def _renamed(entries: list[TraceEvent], period: int, layer: re.Pattern,
             named: Callable[[re.Match], str | None]) -> list[TraceEvent]:
    """`entries` with each module that `layer` matches (the layers' prefix, then what names the
    layer) named `named(match)` past the prefix (None: left as it is); as they are for blocks of 1."""
    if period == 1:
        return entries
    names: dict[str, str] = {}  # (a few module names, each on thousands of entries)
    out = []
    for e in entries:
        if e.module not in names:
            m = layer.match(e.module)
            new = named(m) if m is not None else None
            names[e.module] = e.module if m is None or new is None else f"{e.module[:m.start(1)]}{new}{e.module[m.end():]}"
        out.append(e._replace(module=names[e.module]))
    return out
