"""A preset point traced at a few layers and synthesized to its depth, checked before it is trusted.

Tracing costs the same per layer (FakeTensor dispatch, ~0.1 s per layer and step), so a 7B point
takes 10 s and a 405B one minutes; the layers are the same block, though. Depths a and a+1 give the
template (probe.sim.repeat), the template synthesizes depth a+2, and only when that equals the
traced a+2 entry for entry (action, size, kind, phase, step, module, which alloc each free and
retag refers to) is the point's depth synthesized. a is 1 past the layers built otherwise than the
rest (probe.sim.layers: DeepSeek-V3's dense ones); a block of p layers that repeats (Gemma's
sliding-window and global attention) is copied as one layer, from depths a and a+p, checked at
a+2p. Otherwise, and for jobs of the user's own (whose depth the harness does not know), the point
is traced in full; the row's trace_method says which. A serving point traced in full still grows
its later decode steps from its first few, checked at one step more (_grown_at_depth).

Training steps repeat too: the shallow depths are traced for two steps and the rest are copies of
the second (probe.sim.steps), checked with the layers (the a+2 trace has every step); a decode's
steps grow from its first three, and where they cross a sliding window far past the prompt the
steps across it come from a trace decoding from just short of it (_across_window). A template
whose structure (repeat.structure: all but its sizes) was checked on another point of the sweep,
another batch or length, is not checked again: nothing in its synthesis depends on its sizes. And a
point whose depth-a journal has the skeleton (all but the sizes) of one a point of the sweep learned
from does not trace depth a+1: it makes it of its own entries as that point's was made of its own
(repeat.recipe: the new layer's sizes those of the layer beside it), kept only where `learn` places
the layer there again and the figures traced at a are that point's. DDP's setup, sized by all the
layers at once, is traced at the point's depth and spliced in (probe.sim.ddp_setup); the rest of a
DDP rank's shallow journals is the same at any replica count, and taken from another count's where
the sweep traced one (probe.sim.replicas); an FSDP2 rank's are made from two or more other shard
counts' where its shards scale with the count (probe.sim.shard_counts).
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from harness.config import attention, kernels
from harness.config.attention import ATTENTION_CALLS, FUSED_PREFIX, FusedShape
from harness.config.models import attention_shape, hf_config, model_key, on_meta
from harness.config.point import Leak, Point, Precision, WorkloadName
from harness.probe.jobs import UNMODELLED, unmodelled_layers
from harness.probe.sim import ddp_setup, layers, repeat, replicas, shard_counts
from harness.probe.sim import steps as stepwise
from harness.probe.sim.kernel_scratch import recorded
from harness.probe.sim.layers import at_depth
from harness.probe.sim.measure import measurements
from harness.probe.sim.repeat import NotRepeating
from harness.probe.sim.trace import collector, run_point
from harness.probe.sim.tracker import StorageTracker, TraceEvent
from harness.record import trace_store

SHALLOW = 1  # layers of the repeated block in the template's shallower depth a (a+1 more, checked at a+2)


@dataclass
class Traced:
    measurements: dict
    events: list[TraceEvent]  # alloc and free: the trace the allocator replays
    findings: dict


def trace(point: Point) -> Traced:
    """The point's measurements and trace, synthesized where that is exact, else traced in full
    (the collector off between the traces: trace.collector)."""
    with collector(on=False):
        return _trace(point)


_UNMODELLED: dict[str, str | None] = {}  # model_key -> its layers run through cuDNN (probe.jobs.UNMODELLED)


def unmodelled(point: Point) -> str | None:
    """A preset's layers run through cuDNN, of the model at its depth (a shallow trace's has fewer):
    built on the meta device once a process (tens of ms; a zygote's before it forks the points)."""
    key = model_key(point.model)
    if key not in _UNMODELLED:
        _UNMODELLED[key] = unmodelled_layers(on_meta(hf_config(point.model)))
    return _UNMODELLED[key]


def _trace(point: Point) -> Traced:
    a, p, reason = template_depth(point)
    if reason is None:
        try:
            return synthesized(point, a, p)
        except NotRepeating as e:
            reason = f"its layers did not repeat ({e})"
    decoded = decodes_beyond(point)
    if decoded is not None and point.workload.new_tokens > decoded + 1:  # (the check traces decoded + 1)
        try:
            return _grown_at_depth(point, decoded, reason)
        except NotRepeating as e:
            reason += f"; its decode steps did not grow ({e})"
    m, tracker = run_point(point)
    m["trace_method"] = f"full: {reason}"
    return Traced(m, tracker.events, tracker.findings)


def _grown_at_depth(point: Point, decoded: int, reason: str) -> Traced:
    """A serving point whose layers are traced in full (`reason`) traced for `decoded` steps and one
    more (its steps across a sliding window far past its prompt joined from a second trace:
    _across_window), its later steps grown from them where the `decoded` grow to the one more, as a
    synthesized point's are checked."""
    grow, crossed_from = _sized_on(point.gpu), _crossed_from(point)
    traced = _shallow_trace(decoding(point, decoded + 1), crossed_from, grow, DECODE_TRACED + 1)
    journal, findings = traced.journal(), traced.findings
    _grows_to_next(journal, decoded, grow)
    journal = stepwise.extend(journal, point.workload.new_tokens + 1, grow)
    m, events = _measured(point, journal, findings["scalars"], findings.get("retained_holder"), findings[ATTENTION_CALLS])
    checked = f"checked at {decoded + 1}" if crossed_from is None else "each checked a step further"
    m["trace_method"] = f"full: {reason}; {_decode_said(decoded, point.workload.new_tokens, crossed_from)} ({checked})"
    return Traced(m, events, findings)


def _measured(point: Point, journal: list[TraceEvent], scalars: dict, holder, calls: list[dict]
              ) -> tuple[dict, list[TraceEvent]]:
    """A made journal's measurements (its attention `calls` as the point's card takes them) and
    its trace (the allocs and frees)."""
    m = measurements(journal, holder=holder, **scalars)
    m[ATTENTION_CALLS] = attention.to_column(attention.from_dicts(calls), point.gpu.capability)
    m[UNMODELLED] = unmodelled(point)  # (of the model at its depth: the shallow traces have fewer layers)
    return m, [e for e in journal if e.action in ("alloc", "free")]


def _distinct_calls(findings: list[dict]) -> list[dict]:
    """The attention calls of several traces' findings, each once, in order."""
    calls: list[dict] = []
    for f in findings:
        calls += [c for c in f.get(ATTENTION_CALLS, []) if c not in calls]
    return calls


def _grows_to_next(journal: list[TraceEvent], decoded: int, grow: Callable[[str], int | None] | None) -> None:
    """NotRepeating unless the journal's last decode step (`decoded` + 1) is its step before grown."""
    end = next(i for i, e in enumerate(journal) if e.action == "end" and e.step == decoded)
    if repeat.canonical(stepwise.extend(journal[:end + 1], decoded + 2, grow)) != repeat.canonical(journal):
        raise NotRepeating(f"decode step {decoded + 1} is not step {decoded} grown")


def depth(point: Point) -> int:
    return int(hf_config(point.model).num_hidden_layers)


def template_depth(point: Point) -> tuple[int, int, str | None]:
    """a, the template's shallower depth, and p, the layers of the block it copies: the layers
    before the repeated blocks and SHALLOW blocks (probe.sim.layers; the old part of the journal
    holds what a first block makes, its optimizer's groups), the rest whole blocks; and why the
    point is traced in full instead (None: it may be synthesized)."""
    if point.workload.name == WorkloadName.custom:
        return SHALLOW, 1, "a job of the user's own"
    # per model: a zygote finds its preset's before it forks the points (30-250 ms a model)
    key = model_key(point.model)
    if key not in _BY_MODEL:
        _BY_MODEL[key] = _template_depth(point)
    return _BY_MODEL[key]


_BY_MODEL: dict[str, tuple[int, int, str | None]] = {}


def _template_depth(point: Point) -> tuple[int, int, str | None]:
    config = hf_config(point.model)
    n = int(config.num_hidden_layers)
    if n <= SHALLOW + 2:
        return SHALLOW, 1, f"{n} layers"
    deep = layers.signatures(point)
    if deep is None:
        return SHALLOW, 1, "no module list holds one entry per layer"
    repeats = layers.repeats(deep)
    choices = []  # (layers traced, p, a)
    for p, t in repeats.items():
        a = t + SHALLOW * p + (n - t - SHALLOW * p) % p
        # where a and a+p layers are fewer than the model's (or a one-layer block from the bottom,
        # as ever): a sweep's other points skip the check at a+2p and trace those two only (Gemma 3
        # 4B's 34 layers: 10 and 16 a point, and 22 once; its first point traces a third more
        # layer-steps than in full, each other one half as many)
        if n > a + 2 * p and ((p == 1 and t == 0) or 2 * (a + p) < n):
            choices.append((3 * (a + p), p, a))
    if not choices:
        t = repeats[1]
        return t + SHALLOW, 1, f"{n} layers" + (f", {layers.unlike(deep, t)}" if t else "")
    _, p, a = min(choices)
    # the shallow models build their layers as the deep one does (their per-layer lists cut)
    checked = layers.signatures(at_depth(point, a + 2 * p), layers.per_layer_lists(config, n))
    if checked != deep[:a + 2 * p]:
        at = next((i for i, (x, y) in enumerate(zip(checked or [], deep)) if x != y), 0)
        return a, p, f"a model of its first {a + 2 * p} layers builds layer {at} otherwise than it does"
    return a, p, None


def synthesized(point: Point, a: int = SHALLOW, p: int = 1) -> Traced:
    """The point's trace from depths a and a+p (blocks of p layers: repeat.as_blocks), checked at
    a+2p."""
    n, deeper_at, checked_at = depth(point), a + p, a + 2 * p
    decoded = decodes_beyond(point)
    if decoded is not None:
        # serving: the shallow depths decode a few tokens after the point's prompt, one more at
        # a+2p; the point's steps grow from them (probe.sim.steps), each a token longer
        few, steps = decoded + 1, point.workload.new_tokens + 1
        shallow, checked_on = decoding(point, decoded), decoding(point, decoded + 1)
        grow: Callable[[str], int | None] | None = _sized_on(point.gpu)
        crossed_from = _crossed_from(point)
        steps_said = f", {_decode_said(decoded, steps - 1, crossed_from)}"
    else:
        steps, few, grow, crossed_from = point.workload.steps, traced_steps(point), None, None
        shallow, checked_on = point.replace(workload=dataclasses.replace(point.workload, steps=few)), point
        steps_said = f", steps {few} -> {steps}" if few < steps else ""

    cache = Path(point.trace_cache) if point.trace_cache else None
    runs: dict[int, StorageTracker | Joined] = {}
    reused = placed_on = None
    # DDP: the shallow depths as another replica count of the job traced them (probe.sim.replicas);
    # FSDP2 (HSDP): made from those of two or more other shard (replica) counts, tensor parallel
    # from two others where its own first layer agrees (probe.sim.shard_counts)
    other_count = (replicas.read(cache, shallow, (a, deeper_at)) or shard_counts.read(cache, shallow, (a, deeper_at))
                   or _tensor_parallel_count(cache, shallow, a, deeper_at, runs, crossed_from, grow))
    if other_count is not None:
        (shallower, deeper), findings, counted = other_count
    else:
        if a not in runs:
            runs[a] = _shallow_trace(at_depth(shallow, a), crossed_from, grow)
        shallower = ddp_setup.cut(runs[a].journal())
        skeleton = repeat.skeleton(shallower)
        reused = _placed_as_before(cache, skeleton, shallower, runs[a].findings) if p == 1 else None
        if reused is not None:
            template, deeper_findings, placed_on = reused
        else:
            runs[deeper_at] = _shallow_trace(at_depth(shallow, deeper_at), crossed_from, grow)
            deeper, deeper_findings = ddp_setup.cut(runs[deeper_at].journal()), runs[deeper_at].findings
        findings = [runs[a].findings, deeper_findings]
    prefix = _layer_prefix(deeper, a) if reused is None else template.layer_prefix
    if reused is None:  # both depths' journals at hand, traced here or at another count
        template = repeat.learn(shallower, repeat.as_blocks(deeper, prefix, a, p), a, prefix)

    def blocks(k: int) -> list[TraceEvent]:  # the journal of a and k blocks more
        return repeat.from_blocks(repeat.synthesize(template, a + k), prefix, a, p)

    def full(journal: list[TraceEvent], to: int = steps) -> list[TraceEvent]:  # every step of the point
        return stepwise.extend(journal, to, grow) if few < to else journal

    # A template of a structure already checked (another batch or sequence length of the same job,
    # in this sweep's trace cache) synthesizes as that one did: only its sizes differ.
    structure = f"{repeat.structure(template)}:" + (f"decode {few}->{few + 1}" if grow else f"steps {few}->{steps}")
    structure += f":blocks of {p}" if p > 1 else ""
    checked = trace_store.read_note(cache, trace_store.CHECKED, structure)
    if checked is None:
        # (a decode's check traces its first steps one more: what grew from 3 is checked at 4)
        runs[checked_at] = _shallow_trace(at_depth(checked_on, checked_at), crossed_from, grow, DECODE_TRACED + 1)
        check = repeat.canonical(full(blocks(2), few + 1 if grow else steps))
        traced = repeat.canonical(ddp_setup.cut(runs[checked_at].journal()))
        if check != traced:
            at = next((i for i, (x, y) in enumerate(zip(check, traced)) if x != y), min(len(check), len(traced)))
            raise NotRepeating(f"synthesized {checked_at} layers differ from traced at entry {at} of {len(traced)}")
        findings.append(runs[checked_at].findings)
        how = f"checked at {checked_at}"
    else:
        how = f"its structure checked at {checked_at} on {checked.get('point', 'another point')}"
    findings = [_as_json(f) for f in findings]  # as a note holds them (some may come from one)
    scalars = _extrapolate([f["scalars"] for f in findings], (n - a) // p)
    holder = _extrapolate([f.get("retained_holder") for f in findings], (n - a) // p)
    # Both held at a+2p (the journal and the figures beside it), or were held on a point of this structure
    if checked is None:
        trace_store.write_note(cache, trace_store.CHECKED, structure, {"point": describe(point)})
    if other_count is None:  # traced here: for the job's other replica (DDP, HSDP) or shard (FSDP2) counts
        if reused is not None:  # a+p placed as before: as its template makes it, what tracing it gives
            deeper = blocks(1)
        replicas.write(cache, shallow, (a, deeper_at), [shallower, deeper], findings[:2])
        shard_counts.write(cache, shallow, (a, deeper_at), [shallower, deeper], findings[:2])
    recipe = repeat.recipe(template) if reused is None and other_count is None and p == 1 else None
    if recipe is not None:
        trace_store.write_note(cache, trace_store.LAYOUTS, skeleton, {
            "layout": repeat.layout(template), "recipe": recipe, "point": describe(point),
            "findings": findings[:2]})
    journal = full(blocks((n - a) // p))
    setup = ""
    if ddp_setup.section(shallower) is not None:  # DDP's own, traced at the point's depth
        journal = ddp_setup.splice(journal, run_point(at_depth(point, n), setup_only=True)[1].journal())
        setup = f", DDP's setup traced at {n}"
    calls = _distinct_calls(findings)  # each depth's attention calls (the same layers: the same calls)
    m, events = _measured(point, journal, scalars, holder, calls)
    traced_layers = (f"layer {a}, layer {a + 1} placed as on {placed_on}" if placed_on
                     else f"layers {a}, {deeper_at} {counted}" if other_count is not None
                     else f"layers {a}, {deeper_at}") + (f" (blocks of {p} layers)" if p > 1 else "")
    m["trace_method"] = f"synthesized: {traced_layers} -> {n}{steps_said}{setup} ({how})"
    return Traced(m, events, {"scalars": scalars, "retained_holder": holder, ATTENTION_CALLS: calls})


def _tensor_parallel_count(cache: Path | None, shallow: Point, a: int, deeper_at: int,
                           runs: dict[int, StorageTracker | Joined], crossed_from: int | None,
                           grow: Callable[[str], int | None] | None) -> tuple[list, list, str] | None:
    """The shallow journals and findings made from two other tensor-parallel counts of the job
    (probe.sim.shard_counts), where the point's own `a`-layer trace (into `runs`) is the made one,
    entry for entry and figure for figure: a rank's heads may take the kernels another way (Llama-3-8B's
    8 key/value heads over TP 8, one a rank: its backward's ops differ from TP 2's and 4's), which
    only its own trace shows. None where none are made or they differ."""
    made = shard_counts.read(cache, shallow, (a, deeper_at), shard_counts.TENSOR_PARALLEL)
    if made is None:
        return None
    runs[a] = _shallow_trace(at_depth(shallow, a), crossed_from, grow)
    traced = ddp_setup.cut(runs[a].journal())
    (journal, deeper), (found, deeper_found), how = made
    if repeat.canonical(traced) != repeat.canonical(journal) or _as_json(runs[a].findings) != found:
        return None
    return [traced, deeper], [runs[a].findings, deeper_found], f"{how}, layer {a} traced alike"


def _placed_as_before(cache: Path | None, skeleton: str, shallower: list[TraceEvent],
                      findings: dict) -> tuple[repeat.Template, dict, str] | None:
    """The template without tracing a+1 layers, where a point of this sweep learned one from an
    a-layer journal of the same skeleton (another batch or length of the job): its a+1 journal
    made of this one's entries as that one's was of its own (repeat.recipe: the new layer's sizes
    are its neighbour's), kept only when `learn` places the layer there again and the figures
    traced at a are that point's (its figures at a+1 are then this one's too). Returns (template,
    the figures at a+1, the point it came from)."""
    note = trace_store.read_note(cache, trace_store.LAYOUTS, skeleton)
    try:
        if note is None or note["findings"][0] != _as_json(findings):
            return None
        template = repeat.placed(repeat.deepen(shallower, note["recipe"]), note["layout"])
        again = repeat.learn(shallower, template.entries, template.depth, template.layer_prefix)
        deeper_findings, learned_on = note["findings"][1], str(note["point"])
    except (NotRepeating, KeyError, IndexError, TypeError, ValueError):  # not a layout of ours: learn anew
        return None
    return (again, deeper_findings, learned_on) if repeat.structure(again) == repeat.structure(template) else None


def _as_json(value):
    """`value` as it reads back from JSON (tuples as lists): notes compare so."""
    return json.loads(json.dumps(value, default=str))


DECODE_TRACED = 3  # decode steps the shallow depths trace (a serving point's others grow from them)


def decoding(point: Point, tokens: int) -> Point:
    """The serving point's prompt, `tokens` tokens decoded after it."""
    w = point.workload
    return point.replace(seq_len=point.seq_len - w.new_tokens + tokens, workload=dataclasses.replace(w, new_tokens=tokens))


def _sized_on(card) -> Callable[[str], int | None]:
    """A kernel's code -> its scratch's bytes on `card` where the card sizes it (config.kernels),
    else None (a fused attention kernel's rows grow as any other)."""
    g = kernels.geometry(card)
    return lambda code: kernels.scratch_bytes(code, g) if code and not code.startswith(FUSED_PREFIX) else None


def decodes_beyond(point: Point) -> int | None:
    """The decode steps a serving point's shallow depths trace where its later steps grow from them
    (None: every step is traced). They do where it decodes more than those (_decode_traced: 3, or 3
    past a sliding window it reaches) and, where its decode attends with flash on its card, flash
    splits the keys (config.kernels: accumulators a step) on its card or on a catalog card at every
    length it reaches or at none (its rows, a placeholder where only another card's launch splits:
    kernel_scratch), so that no step makes an entry the traced ones did not; a model without
    attention's too (its state a constant size: the check at a+2 decodes a step more either way)."""
    w = point.workload
    if w.name != WorkloadName.infer:
        return None
    config = hf_config(point.model)
    traced = _decode_traced(config, point.seq_len - w.new_tokens, point.seq_len)
    if traced is None or w.new_tokens <= traced:
        return None
    if getattr(config, "num_attention_heads", None) is None:  # no attention (Mamba): no keys to split
        return traced
    h, h_k, d = attention_shape(config)
    call = attention.Call(Precision(point.precision).compute_dtype, d, d, mask=False, grad=False, dropout=False,
                          causal_nonsquare=False, grouped=h_k != h, enable_gqa=h_k != h)
    if attention.kernel(point.gpu.capability, call) != attention.FLASH:  # (flash takes 16-bit calls only)
        return traced
    tp, g, prompt = point.parallel.tp, kernels.geometry(point.gpu), point.seq_len - w.new_tokens
    shapes = (FusedShape(point.batch_size, h // tp, h_k // tp, 1, s_k, d, d, 2) for s_k in range(prompt + 1, point.seq_len + 1))
    # each step's accumulators in the trace as the tracker records them (kernel_scratch.recorded)
    splits = {recorded(kernels.flash_splitkv_bytes(s, g)[1], kernels.splitkv_code(s, 1)) for s in shapes}
    return traced if len(splits) == 1 else None


def _decode_traced(config, prompt: int, end: int) -> int | None:
    """The decode steps traced before the rest grow, decoding from `prompt` tokens to `end`: 3, or 3
    past a sliding window the decode reaches (a token either side), where each layer's cache and
    mask stop growing (Mistral, 50 tokens decoded to 80 over a window of 64: self_attn's 224,280 B
    a step, where steps grown from the first 3 reached 263,664 B); None (every step traced) where
    the decode reaches a chunk's end (Llama 4's chunked attention: its mask starts a chunk there,
    76 allocations more at the 64th token). The check, a step more, would reach neither."""
    chunk = getattr(config, "attention_chunk_size", None)
    if isinstance(chunk, int) and chunk > 0 and (end + 1) // chunk * chunk >= prompt - 1:
        return None
    window = _window_reached(config, prompt, end)
    return DECODE_TRACED if window is None else window + 2 - prompt + DECODE_TRACED


def _window_reached(config, prompt: int, end: int) -> int | None:
    """The sliding window a decode from `prompt` tokens to `end` reaches (a token either side), else None."""
    window = getattr(config, "sliding_window", None)
    return window if isinstance(window, int) and window > 0 and prompt - 1 <= window <= end + 1 else None


def _crossed_from(point: Point) -> int | None:
    """The prompt, 2 + DECODE_TRACED tokens short of a sliding window (its first steps a cache's
    growing ones: the crossing lies a token either side of the window), from which a serving
    point's steps across the window are traced (_across_window), where its own prompt lies more
    than DECODE_TRACED steps before that; else None (no window reached, or one that near: its steps
    to 3 past the window are traced)."""
    prompt = point.seq_len - point.workload.new_tokens
    window = _window_reached(hf_config(point.model), prompt, point.seq_len)
    if window is None:
        return None
    crossed_from = window - 2 - DECODE_TRACED
    return crossed_from if crossed_from - prompt > DECODE_TRACED else None


def _decode_said(decoded: int, tokens: int, crossed_from: int | None) -> str:
    """How a serving point's decode steps were made, for its trace_method."""
    if crossed_from is None:
        return f"decode steps {decoded} -> {tokens}"
    return f"decode steps {DECODE_TRACED} -> {tokens}, the sliding window crossed from a {crossed_from}-token prompt"


def _shallow_trace(at: Point, crossed_from: int | None, grow: Callable[[str], int | None] | None,
                   first: int = DECODE_TRACED):
    """`at`'s journal and findings: a tracker's, or two traces joined across a sliding window
    (_across_window, its first `first` decode steps traced)."""
    return run_point(at)[1] if crossed_from is None else _across_window(at, crossed_from, grow, first)


@dataclass
class Joined:
    """A shallow decode's journal made of two traces (_across_window), as a tracker gives one."""
    entries: list[TraceEvent]
    findings: dict

    def journal(self) -> list[TraceEvent]:
        return self.entries


def _across_window(at: Point, crossed_from: int, grow: Callable[[str], int | None] | None, first: int) -> Joined:
    """`at` (a serving point at a shallow depth) as if traced whole: its prefill and `first`
    steps, grown (probe.sim.steps) to where a trace of the same job decoding from a
    `crossed_from`-token prompt is one step in, joined to that trace's later steps, which cross the
    window (steps.joined). The two traces' figures must agree (parameters and state, not lengths);
    the attention calls of both are kept (the cards' kernels are chosen by them)."""
    prompt = at.seq_len - at.workload.new_tokens
    head = run_point(decoding(at, first))[1]
    head_journal = head.journal()  # (a tracker's journal is sorted anew at each call)
    if first > DECODE_TRACED:  # (a check's: what grows from the first 3 is checked at the 4th)
        _grows_to_next(head_journal, first - 1, grow)
    tail = run_point(at.replace(workload=dataclasses.replace(at.workload, new_tokens=at.seq_len - crossed_from)))[1]
    join = crossed_from - prompt + 1  # the head's step as long as the tail's step 1
    entries = stepwise.joined(stepwise.extend(head_journal, join + 1, grow), tail.journal(), join)
    findings = {**head.findings, **tail.findings}
    if _as_json(head.findings.get("scalars")) != _as_json(tail.findings.get("scalars")):
        raise NotRepeating("the figures of decodes from two prompts differ")
    findings[ATTENTION_CALLS] = _distinct_calls([head.findings, tail.findings])
    return Joined(entries, findings)


def traced_steps(point: Point) -> int:
    """The steps each shallow depth is traced for: a training point's first two (the rest repeat
    the second: probe.sim.steps), else all. A leak workload's three: what outlives a step is found
    by looking after the third. DDP's three: it rebuilds its buckets in the second step's forward,
    and the third is the first the others repeat."""
    w, p = point.workload, point.parallel
    first_alike = 2 if p.dp_replicate > 1 and p.dp_shard == 1 else 1  # DDP without FSDP2
    return first_alike + 1 if w.name == WorkloadName.train and w.leak == Leak.none and w.steps > first_alike + 1 \
        else w.steps


def describe(point: Point) -> str:
    """The point as its trace_method names it: what shapes its trace."""
    return (f"{point.model.name} b{point.batch_size} s{point.seq_len} {point.precision.value}"
            f"{'' if not point.checkpointing else ' ckpt' if point.checkpointing_policy == 'full' else ' ckpt=op'}")


def _layer_prefix(journal: list[TraceEvent], new: int) -> str:
    """The modules' prefix before the layer index ("model.layers."): the one naming layer `new`."""
    pattern = re.compile(rf"^(.*\.){new}(?=\.|$)")
    found = {m.group(1) for e in journal if e.module and (m := pattern.match(e.module))}
    if len(found) != 1:
        raise NotRepeating(f"no single module list holds the layers ({sorted(found) or 'none'})")
    return found.pop()


def _extrapolate(values: list, steps: int):
    """A figure at depth a+`steps` from depths a, a+1 (and a+2, where traced): numbers linear in
    depth (checked where three are known), anything else the same at every depth."""
    first, *rest = values
    if isinstance(first, dict) and all(isinstance(v, dict) for v in rest):
        if any(v.keys() != first.keys() for v in rest):
            raise NotRepeating("the figures differ in what they hold across depths")
        return {k: _extrapolate([v[k] for v in values], steps) for k in first}
    if all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        per_layer = values[1] - values[0]
        if any(values[i + 1] - values[i] != per_layer for i in range(len(values) - 1)):
            raise NotRepeating(f"a figure is not linear in depth ({', '.join(map(str, values))})")
        return first + steps * per_layer
    if any(v != first for v in rest):
        raise NotRepeating(f"a figure changes with depth ({', '.join(map(repr, values))})")
    return first
