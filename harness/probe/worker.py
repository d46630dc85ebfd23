"""The fresh process one point runs in: `python -m harness.probe.worker <run_dir>`.

Reads run_dir/point.json, writes run_dir/result.json (always, on failure too) and the trace.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import time
import traceback
from pathlib import Path

from harness.allocator.replay import Kept, ranges_alike
from harness.allocator.settings import AllocSettings
from harness.config import attention, cublas, kernels, nccl
from harness.config import cards as catalog
from harness.config.attention import ATTENTION_CALLS, CUDNN, FLASH
from harness.config.models import attention_shape, hf_config
from harness.config.point import Backend, Card, Point, WorkloadName, fewest_nodes
from harness.probe import rank
from harness.probe.cuda import run as cuda
from harness.probe.jobs import UserCodeError
from harness.probe.sim import fused_swap, reserved, shortcut, trace
from harness.probe.sim.fake_code import where
from harness.probe.sim.per_card import Sized
from harness.probe.sim.trace import collector
from harness.probe.sim.virtual_cuda import READS_CARD
from harness.record import provenance, trace_store
from harness.record.provenance import USER_CODE
from harness.record.ranks import RANK_RESULT_FILE
from harness.record.row import CARD_RESERVED, COLUMNS, POINT_FILE, RESULT_FILE, WORKSPACE, base_record, recorded_edge, write_row

_COLUMNS = frozenset(COLUMNS)  # what of a trace's measurements a row holds
# How a card is judged: its edge (reserved.EDGES), and its reserved peak without a limit where a
# replay of the run as that card makes it found one (None: the traced card's, or an OOM by bounds)
Judged = tuple[str, int | None]


def run_sim(point: Point, run_dir: Path) -> dict:
    """Trace the point (or reuse the trace of a point that differs only in allocator or card),
    then replay it through the allocator model for reserved bytes and each card's verdict. The
    collector is off but while tracing (trace.collector: the rows and replays made here)."""
    with collector(on=False):
        return _run_sim(point, run_dir)


def _run_sim(point: Point, run_dir: Path) -> dict:
    t0 = time.perf_counter()
    rec = base_record(point)
    df, m, reused, events = _traced(point, run_dir / trace_store.TRACE_FILE)
    rec.update(m, trace_reused=reused, device_name=f"virtual {point.gpu.device_name}")
    return _replayed(point, rec, Sized(df, events), run_dir, t0)


def _traced(point: Point, trace_path: Path):
    """The point's trace, written to `trace_path`; its measurements (row columns); the cache id of
    the trace it reused (a point's that differs only in allocator or card), else None for a new one
    (a preset's synthesized from a few layers where that is exact, then cached); and the events a
    new one's frame was made of (None for a reused one)."""
    # A trace that read the card is kept for that card and allocator setting only; one without
    # attention calls for every card; one of another card's attention class where this card takes
    # its calls alike (config.attention).
    tid, own = trace_store.trace_id(point), trace_store.trace_id(point, reads_card=True)
    anywhere = trace_store.trace_id(point, attending="")
    cache = Path(point.trace_cache) if point.trace_cache else None
    mine = attention.attention_class(point.gpu.capability)
    others = [trace_store.trace_id(point, attending=k)
              for k in sorted({attention.attention_class(c.capability) for c in catalog.cards()} - {mine})]
    for key in (own, tid, anywhere, *others):
        cached = trace_store.load_cached(cache, key) if trace_store.cached(cache, key) else None
        if cached is None or (key in others and not attention.takes_alike(point.gpu.capability,
                                                                         cached[1].get(ATTENTION_CALLS))):
            continue
        df, m = cached
        df.to_parquet(trace_path, index=False)
        return df, m, key, None
    with _reading(point) as read:
        traced = shortcut.trace(point)
    m = _measured(point, traced.measurements, read)
    df = trace_store.to_frame(traced.events)
    df.to_parquet(trace_path, index=False)
    key = own if traced.findings.get(READS_CARD) else tid if m.get(ATTENTION_CALLS) else anywhere
    trace_store.save_cached(cache, key, trace_path, m)
    return df, m, None, traced.events


def run_cpu(point: Point, run_dir: Path) -> dict:
    """The job run for real on this machine's CPU tensors (this rank's, gloo between ranks), every
    storage tracked as the virtual GPU tracks it, then replayed as a trace is: what the code
    allocates with the CPU's kernels, a check of the virtual GPU's trace and of a launch over ranks.
    Never cached: each rank's trace is its own."""
    with collector(on=False):
        return _run_cpu(point, run_dir)


def _run_cpu(point: Point, run_dir: Path) -> dict:
    t0 = time.perf_counter()
    with _reading(point) as read:
        m, tracker = trace.run_point(point, emulate_cuda=False, fake=False)
    rec = base_record(point)
    rec.update(_measured(point, m, read), device_name=f"CPU tensors, replayed on {point.gpu.device_name}")
    df = trace_store.to_frame(tracker.events)
    df.to_parquet(run_dir / trace_store.TRACE_FILE, index=False)
    return _replayed(point, rec, Sized(df, tracker.events), run_dir, t0)


def _reading(point: Point):
    """A user's job: the files it opens for reading, recorded (provenance.reading); else nothing."""
    return provenance.reading() if point.workload.name == WorkloadName.custom else contextlib.nullcontext(set())


def _measured(point: Point, m: dict, read: set[str]) -> dict:
    """A trace's measurements that are row columns (and, for a user's job, what it loaded and read)."""
    out = {k: v for k, v in m.items() if k in _COLUMNS}
    if point.workload.name == WorkloadName.custom:
        out[USER_CODE] = provenance.user_code(read)
    return out


def _replayed(point: Point, rec: dict, sized: Sized, run_dir: Path, t0: float) -> dict:
    """The row of a traced point: the trace (`sized`) replayed through the allocator model on its
    card and every catalog card."""
    import torch
    import transformers

    rec.update(status="ok", trace_path=str(run_dir / trace_store.TRACE_FILE), torch_version=torch.__version__,
               transformers_version=transformers.__version__)
    settings = AllocSettings.from_conf(point.allocator.conf)
    snapshot = run_dir / "snapshot.pickle" if point.snapshot else None
    # The trace as the point's card runs it: its kernels' scratch sized there (config.kernels; a
    # trace is shared by cards of other SM counts). The storages' peak is the traced one, less
    # what that scratch is smaller by here.
    cards = catalog.cards()
    rows = sized.rows(point.gpu)
    rec["peak_tensor_bytes"] = rec["peak_allocated_bytes"] - sized.shift(point.gpu)[1]
    # The catalog's cards whose attention kernels this trace's calls would not take are judged
    # apart, and those of another cuBLAS workspace or kernel scratch by the trace with theirs
    workspace, n_workspaces = sized.workspaces()
    rec[WORKSPACE] = workspace
    apart = [c for c in cards if not attention.takes_alike(c.capability, rec.get(ATTENTION_CALLS))]
    here = [c for c in cards if c not in apart and workspace in (None, cublas.workspace_bytes(c.capability))]
    def own_sized(allocated_bytes: int) -> list:  # SMs that size its scratch otherwise, unless surely an OOM
        return [c for c in here if not sized.alike(c, point.gpu)
                and not _surely_oom(point, allocated_bytes - sized.shift(c, point.gpu)[1], c)]

    def overflowed(reserved_bytes: int) -> list:  # (expandable segments) replayed apart: _edges_by_sizes
        return [c for c in here if not ranges_alike(settings, reserved_bytes, point.gpu.memory_bytes, c.memory_bytes)]

    # Each card as one of the job's GPUs sees it: NCCL's memory beside the CUDA context's; those
    # judged by the trace with their own scratch sizes are left to _own_sized_edges
    kept = Kept(watch=sized.scratch_allocs(point.gpu))
    rec.update(reserved.analyse(
        rows, settings, nccl.on_rank(point.gpu, point.parallel), [nccl.on_rank(c, point.parallel) for c in here],
        torch.__version__, snapshot, rec["peak_tensor_bytes"], kept,
        elsewhere=lambda res, alloc: {c.key for c in own_sized(alloc) + overflowed(res)}), catalog_sha=catalog.digest())
    spilled = overflowed(rec["peak_reserved_bytes"])
    here = [c for c in here if c not in spilled]
    own = own_sized(rec["peak_allocated_bytes"])
    if len(here) < len(cards) or own:
        judged: dict[str, Judged] = {c.key: (recorded_edge(rec, c.key), None) for c in here}
        judged.update(_own_sized_edges(sized, settings, point, own, (rec["peak_reserved_bytes"],
                                       rec["peak_allocated_bytes"]), kept, point.gpu, point.gpu.memory_bytes))
        # cards that only swap flash for cuDNN (or back), their room under what the traced run surely allocates
        ooms = _swapped_and_oom(point, rec, apart, n_workspaces, sized, settings.large_segment_size)
        judged.update(ooms)
        apart = [c for c in apart if c.key not in ooms]
        judged.update(_edges_by_sizes(sized, settings, point, [c for c in cards if c not in apart and c not in here],
                                      rec))
        if apart:
            for how, keys in _edges_apart(point, rec, settings, apart, run_dir, n_workspaces, judged, sized).items():
                rec["trace_method"] = f"{rec.get('trace_method') or ''}; {', '.join(keys)} judged by {how}"
        rec.update(reserved.edge_columns({c.key: judged[c.key][0] for c in cards}))
        replayed = {c.key: judged[c.key][1] for c in cards if judged[c.key][1] is not None}
        rec[CARD_RESERVED] = json.dumps(replayed) if replayed else None
    rec["wall_s"] = time.perf_counter() - t0
    return rec


def _edges_apart(point: Point, rec: dict, settings: AllocSettings, apart: list, run_dir: Path,
                 n_workspaces: int, edges: dict[str, Judged], sized: Sized) -> dict[str, list[str]]:
    """Into `edges`, how each card in `apart` is judged (Judged), whose attention kernels
    differ from the traced card's: cards whose kernels agree judged by a trace on the first of them,
    or, where they only take cuDNN for flash or back, by the point's trace (`sized`) with those
    calls' rows rewritten (probe.sim.fused_swap), else by another such group's trace so rewritten (a
    T4's point: the flash cards' trace judges the cuDNN cards); returns how (words) each card was
    judged, the keys in order. Not traced where none of them holds the job's
    parameters and optimizer state (taken whatever the kernels), nor where their kernels hold all
    the traced ones do (config.attention.holds_more; cuDNN's calls counted as the flash they
    rewrite to) and none of them holds the traced allocated peak (their workspaces' and kernel
    scratch's difference off): each is an OOM then."""
    floor = (rec.get("params_bytes") or 0) + (rec.get("optimizer_bytes") or 0)
    calls, taken = zip(*attention.taken(rec[ATTENTION_CALLS]), strict=True)
    alike: dict[tuple, list] = {}
    for c in apart:
        alike.setdefault(tuple(attention.kernel(c.capability, call) for call in calls), []).append(c)
    ways: dict[str, list[str]] = {}
    # the traces at hand, by the kernels their calls took: whose, it and its measurements
    at_hand: dict[tuple, tuple[str, Sized, dict]] = {taken: ("this trace", sized, rec)}
    # cuDNN's calls as flash makes them: what a kernel that holds more than flash holds at least
    as_flash = tuple(FLASH if t == CUDNN else t for t in taken)
    rewrites: dict[tuple, tuple] = {}  # (a trace's kernels, kernel) -> it rewritten for that and its storages' peak

    def rewrite(took: tuple, to: str) -> tuple[Sized | None, int | None]:
        if (took, to) not in rewrites:
            traced = at_hand[took][1]
            made = fused_swap.frame(traced.df, to, traced.events)
            rewrites[took, to] = (None, None) if made is None else (Sized(*made), trace_store.storages_peak(made[0]))
        return rewrites[took, to]

    def rewritten_for(attending: tuple) -> tuple[str, Sized, dict] | None:
        """(whose trace, it rewritten for the kernels `attending`, its measurements) where only flash
        and cuDNN differ: the point's own, else a traced group's."""
        for took, (whose, _trace, measured) in at_hand.items():
            to = attention.swapped_to(attending, took)
            made, peak = (None, None) if to is None else rewrite(took, to)
            if made is not None:
                return whose, made, {**measured, "peak_allocated_bytes": peak}
        return None

    # (groups of cuDNN calls last: a flash group's trace, traced first, may judge them rewritten)
    for attending, group in sorted(alike.items(), key=lambda kv: CUDNN in kv[0]):
        ranked = [nccl.on_rank(c, point.parallel) for c in group]
        # their allocations at every moment at least the traced ones', but for smaller workspaces
        # and kernel scratch
        less = n_workspaces * max(0, (rec.get(WORKSPACE) or 0) - min(cublas.workspace_bytes(c.capability)
                                                                    for c in group))
        less += max(sized.shift(c, point.gpu)[1] for c in group)
        heavier = attention.holds_more(attending, taken) and all(r.room() < rec["peak_allocated_bytes"] - less
                                                                  for r in ranked)
        if not heavier and attention.swapped_to(as_flash, taken) == FLASH and attention.holds_more(attending, as_flash):
            flash_peak = rewrite(taken, FLASH)[1]
            heavier = flash_peak is not None and all(r.room() < flash_peak - less for r in ranked)
        if heavier or all(r.room() < floor for r in ranked):
            edges.update((c.key, ("oom", None)) for c in group)
            continue
        path = trace_store.apart_path(run_dir / trace_store.TRACE_FILE, group[0].key)
        found = rewritten_for(attending)
        if found is not None:
            whose, theirs, m = found
            theirs.df.to_parquet(path, index=False)
            how = f"{whose} with its fused attention's rows as their kernel makes them"
        else:
            df, m, _, events = _traced(_on_card(point, group[0]), path)
            theirs = Sized(df, events)
            at_hand[attending] = (f"{group[0].key}'s trace", theirs, m)
            how = "a trace of their attention kernels"
        ways.setdefault(how, []).extend(c.key for c in group)
        for c in group[1:]:  # each card's trace where a plan with a margin looks for it (plan.fit)
            trace_store.apart_path(path, c.key).unlink(missing_ok=True)
            os.link(path, trace_store.apart_path(path, c.key))
        edges.update(_edges_by_sizes(theirs, settings, _on_card(point, group[0]), group, m))
    return ways


def _on_card(point: Point, card: Card) -> Point:
    """The point on `card`, its job on as many of `card`'s nodes as it needs (a node of RTX 4060s
    holds one): one rank's trace is the same on any count of nodes."""
    nodes = max(point.parallel.nodes, fewest_nodes(point.parallel.world_size, card.gpus_per_node))
    return point.replace(gpu=card, parallel=dataclasses.replace(point.parallel, nodes=nodes))


def _swapped_and_oom(point: Point, rec: dict, cards: list, n_workspaces: int, sized: Sized,
                     segment: int) -> dict[str, Judged]:
    """Those of `cards` whose attention kernels only swap flash for cuDNN (or back) and whose room
    lies under what the traced run surely allocates there (its allocated peak less `_swap_band` and
    their kernels' scratch's difference, per_card.Sized.shift; `segment`: the point's large segment
    size): each an OOM. Where a card may fit
    only a replay can tell: a bound on reserved is not sound (another block size may place a large
    block in a new segment), and the band once said "room" 2.4 GiB under a card's reserved peak."""
    scratch = _attention_scratch(point) if cards else None
    if scratch is None:
        return {}
    return {c.key: ("oom", None) for c in cards
            if attention.swaps_fused_on(c.capability, rec.get(ATTENTION_CALLS))
            and _surely_oom(point, rec["peak_allocated_bytes"] - _swap_band(scratch, rec, c, n_workspaces, segment)
                            - sized.shift(c, point.gpu)[1], c)}


def _surely_oom(point: Point, allocated_at_least: int, card: Card) -> bool:
    """Whether `card`, as one of the job's GPUs, has less room than a run surely allocates."""
    return nccl.on_rank(card, point.parallel).room() < allocated_at_least


def _attention_scratch(point: Point) -> int | None:
    """The larger backward scratch of one attention call of the point, flash's or cuDNN's (one
    lives at a time); None for a user's job (its attention shapes are its own)."""
    if point.workload.name == WorkloadName.custom:
        return None
    h, h_k, d = attention_shape(hf_config(point.model))
    b, s = point.batch_size, point.seq_len
    return max(sum(attention.flash_backward_scratch(b, h, h_k, s, s, d, 2)),
               attention.cudnn_backward_scratch(b, h, h_k, s, s, d, d, 2))


def _weight_gradient_sum(point: Point) -> kernels.Reduction | None:
    """A preset's largest reduction split across blocks: each RMSNorm weight's gradient, a column
    sum over the step's tokens (None for a user's job, whose reductions are its own, and without
    training)."""
    if point.workload.name != WorkloadName.train:
        return None
    import torch

    from harness.probe.sim.kernel_scratch import reduction

    grad = torch.empty(point.batch_size * point.seq_len, int(hf_config(point.model).hidden_size), device="meta")
    return reduction(grad, [0], 4, 4)


def _reductions_more(r: kernels.Reduction | None, card: Card, than: Card, segment: int) -> int:
    """How much more the reduction `r` stages on `card` than on `than`, with two large segments
    (`segment` bytes each: large_segment_size_mb's) where it does (0 without one)."""
    if r is None:
        return 0
    sizes = [sum(kernels.reduce_buffers(r, kernels.geometry(c)) or (0, 0)) for c in (card, than)]
    more = sizes[0] - sizes[1]
    return more + 2 * segment if more > 0 else 0


def _workspaces_more(rec: dict, card: Card, n_workspaces: int, segment: int) -> int:
    """How much more a run's `n_workspaces` cuBLAS workspaces take on `card` than they did in `rec`
    (a training step's forward and backward handles: two), with two large segments (`segment` bytes
    each) where they do (0 where not more, or where the run recorded none)."""
    if rec.get(WORKSPACE) is None:
        return 0
    more = n_workspaces * (cublas.workspace_bytes(card.capability) - rec[WORKSPACE])
    return more + 2 * segment if more > 0 else 0


def _swap_band(scratch: int, rec: dict, card: Card, n_workspaces: int, segment: int) -> int:
    """How far a run's peaks may move where `card` attends with cuDNN and the run with flash (or
    back): one call's `scratch`, two large segments (`segment` bytes each) that other block sizes may place
    otherwise, and the cuBLAS workspaces' difference. Sound for allocated bytes (what an OOM is
    decided by, _swapped_and_oom); for reserved an estimate, which only a real row, having no trace
    to replay, takes (measured_edges)."""
    workspaces = n_workspaces * abs(cublas.workspace_bytes(card.capability) - (rec.get(WORKSPACE) or 0))
    return scratch + 2 * segment + workspaces


def _own_sized_edges(sized: Sized, settings: AllocSettings, point: Point, cards: list, peaks: tuple[int, int],
                     kept: Kept, ref: Card, total: int, workspace: int | None = None) -> dict[str, Judged]:
    """Each of `cards` (of `ref`'s workspaces, its kernels' scratch sized otherwise) judged by the
    trace as it runs it (each cuBLAS workspace `workspace` bytes, where given). Where a replay of
    its rows makes every decision `ref`'s replay without a limit (on a device of `total` bytes)
    made (Sized.alike_until, ranges_alike; `peaks`: that replay's reserved peak and what it surely
    allocated; `kept`: what it kept), its reserved peak is that replay's and lean replays go on from
    its checkpoints; else a lean replay of its own without a limit decides."""
    groups: dict[tuple, list] = {}
    for c in cards:
        groups.setdefault(sized.sizes(c), []).append(c)
    out: dict[str, Judged] = {}
    for group in groups.values():
        rows, ranked = sized.rows(group[0], workspace), [nccl.on_rank(c, point.parallel) for c in group]
        # allocated at least `ref`'s peak less the scratch smaller here
        allocated = peaks[1] - sized.shift(group[0], ref)[1]
        if len(rows) == len(sized.rows(ref)) == sized.alike_until(group[0], ref, settings, kept.cached):
            shared = [c for c in ranked if ranges_alike(settings, peaks[0], total, c.memory_bytes)]
            edges = reserved.lean_edges(rows, settings, shared, kept.checkpoints, peaks[0], allocated)
            out.update((k, (e, peaks[0])) for k, e in edges.items())
            ranked = [c for c in ranked if c not in shared]
        if ranked:
            out.update(_by_own_replay(rows, settings, ranked, allocated)[0])
    return out


def _by_own_replay(rows: list, settings: AllocSettings, cards: list, allocated: int, rooms: list | None = None,
                   kept: Kept | None = None) -> tuple[dict[str, Judged], int, int]:
    """`cards` (as the job's GPUs) judged by a lean replay of `rows` without a limit on a device of
    the most memory among them (`allocated`: what it surely allocates) and lean replays on each card
    going on from its checkpoints, kept for `rooms`' cards too (default: `cards`; into `kept`, where
    given); and that replay's reserved peak and device's bytes. Cards whose address ranges it may
    have overflowed (ranges_alike) take one of their own."""
    total = max(c.memory_bytes for c in cards)
    replays, unlimited = reserved.unlimited_replay(rows, settings, total, rooms or cards, allocated, kept, lean=True)
    peak = unlimited.peak_reserved_bytes
    shared = [c for c in cards if ranges_alike(settings, peak, total, c.memory_bytes)]
    out = {k: (e, peak) for k, e in reserved.edges_by_replays(replays, unlimited, shared).items()}
    rest = [c for c in cards if c not in shared]  # (of less memory: the largest card shares)
    if rest:
        out.update(_by_own_replay(rows, settings, rest, allocated)[0])
    return out, peak, total


def _edges_by_sizes(sized: Sized, settings: AllocSettings, point: Point, cards: list, rec: dict) -> dict[str, Judged]:
    """Each of `cards` judged by the trace `sized` (of `point`'s job: taken on its card, or another
    card's trace rewritten for theirs) with each card's cuBLAS workspaces (config.cublas; one
    allocation each, made where they were) and its kernels' scratch (config.kernels); an OOM without
    a replay where its room lies under what the traced run surely allocates there. Of the cards of
    one workspace, one kernel sizing takes a replay without a limit, the others go on from it where
    they can (_own_sized_edges)."""
    traced_with, n = sized.workspaces()
    by_workspace: dict[int | None, list] = {}
    out: dict[str, Judged] = {}
    for c in cards:  # a trace without workspaces (real CPU tensors): theirs ignored
        ws = None if traced_with is None else cublas.workspace_bytes(c.capability)
        # the storages' peak at least: the traced one less smaller workspaces and scratch (than the
        # trace's own: a rewritten trace's are the card's it was taken on, not `point`'s)
        less = n * max(0, (traced_with or 0) - (ws or 0)) + sized.shift(c)[1]
        if _surely_oom(point, rec["peak_allocated_bytes"] - less, c):
            out[c.key] = ("oom", None)
        else:
            by_workspace.setdefault(ws, []).append(c)
    for nbytes, group in by_workspace.items():
        first = [c for c in group if sized.alike(c, group[0])]
        workspace = None if nbytes in (None, traced_with) else nbytes
        less = 0 if nbytes is None or traced_with is None else min(0, n * (nbytes - traced_with))
        ranked = [nccl.on_rank(c, point.parallel) for c in group]
        alike = [r for r, c in zip(ranked, group, strict=True) if c in first]
        kept = Kept(watch=sized.scratch_allocs(first[0]))
        allocated = rec["peak_allocated_bytes"] + less - sized.shift(first[0])[1]  # at least
        # (its checkpoints for the rest's rooms too)
        judged, peak, total = _by_own_replay(sized.rows(first[0], workspace), settings, alike, allocated, ranked,
                                             kept)
        out.update(judged)
        out.update(_own_sized_edges(sized, settings, point, [c for c in group if c not in first], (peak, allocated),
                                    kept, first[0], total, workspace))
    return out


def run_cuda(point: Point, run_dir: Path) -> dict:
    """Measure the point on this process's GPU; each card's verdict from the measured peaks."""
    import transformers

    t0 = time.perf_counter()
    rec = base_record(point)
    with _reading(point) as read:
        rec.update(cuda.run_cuda(point, run_dir), transformers_version=transformers.__version__)
    if point.workload.name == WorkloadName.custom:
        rec[USER_CODE] = provenance.user_code(read)
    if rec["status"] == "ok":
        rec.update(reserved.edge_columns(measured_edges(point, rec)), catalog_sha=catalog.digest())
    else:  # how much it needed is unknown past the OOM: no card is known to hold it
        rec.update(fits_cards=[], tight_cards=[], retry_cards=[])
    rec["wall_s"] = time.perf_counter() - t0
    return rec


def measured_edges(point: Point, rec: dict) -> dict[str, str]:
    """Each catalog card's edge (reserved.EDGES) from a real run's peaks. Measured reserved within a
    card's room settles it; between allocated and reserved only a replay could tell, and a cuda run
    has no trace: counted as not fitting. The card it ran on held it, flushing its cache where it
    retried. A card of other attention kernels holds what the run does not tell, but for cuDNN in
    flash's place or back: its peaks a `_swap_band` (two workspaces: training's) higher must fit; a
    card of larger cuBLAS workspaces, their difference more (`_workspaces_more`); a card of more SMs
    than the device, its larger reduction buffers more (`_reductions_more`)."""
    calls, scratch, summed = rec.get(ATTENTION_CALLS), _attention_scratch(point), _weight_gradient_sum(point)
    segment = AllocSettings.from_conf(point.allocator.conf).large_segment_size  # (two of them: a band's)
    # the device's launches: its own SMs, whatever card it stood for
    ran_on = dataclasses.replace(point.gpu, multiprocessors=rec.get("device_multiprocessors") or point.gpu.multiprocessors)

    def fits_on(c):  # as one of the job's GPUs (NCCL's memory: in the measured figure on its own card)
        band: int | None = _reductions_more(summed, c, ran_on, segment)
        if attention.takes_alike(c.capability, calls):
            band = band + _workspaces_more(rec, c, 2, segment)
        else:
            swaps = scratch is not None and attention.swaps_fused_on(c.capability, calls)
            band = band + _swap_band(scratch, rec, c, 2, segment) if swaps else None
        return band is not None and bool(reserved.fits_by_numbers(
            nccl.on_rank(c, point.parallel), rec["peak_reserved_bytes"] + band, rec["peak_allocated_bytes"] + band))

    def edge(c):
        if c.name == point.gpu.name:
            return "after_retry" if rec.get("num_alloc_retries") else "room"
        return reserved.edge(fits_on, rec["peak_reserved_bytes"], c)

    return {c.key: edge(c) for c in catalog.cards()}


_RUN = {Backend.cuda: run_cuda, Backend.cpu: run_cpu, Backend.sim: run_sim}


def main(run_dir: Path) -> int:
    """The point's row in run_dir; a rank's (launch.ranks) in its rank's file, written before the
    process group is left (leaving may wait on peers that will never come)."""
    run_dir = run_dir.resolve()
    point = Point.from_dict(json.loads((run_dir / POINT_FILE).read_text()))
    if point.cwd:  # where it was asked from (a zygote another sweep started, a Slurm node): relative paths
        with contextlib.suppress(OSError):  # (gone since: a relative path is refused naming its key)
            os.chdir(point.cwd)
    as_rank = rank.runs_as_ranks(point)
    with contextlib.ExitStack() as group:
        try:
            if as_rank:
                group.enter_context(rank.joined(point))
            rec = _RUN.get(point.backend, run_sim)(point, run_dir)  # auto, resolved by the launcher: sim
        except Exception as e:
            rec = base_record(point)
            # the user's file and line first, where the error came through their code
            at = where(e) if point.workload.name == WorkloadName.custom and not isinstance(e, UserCodeError) else None
            rec.update(status="error", error=f"{at + ': ' if at else ''}{type(e).__name__}: {e}")
            (run_dir / "traceback.txt").write_text(traceback.format_exc())
        if as_rank:
            rec["rank"] = rank.this_rank()
        write_row(run_dir, rec, RANK_RESULT_FILE if as_rank else RESULT_FILE)
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
