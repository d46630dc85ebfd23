"""Replaying allocation traces through the allocator model: real snapshots (checked against what
the recording decided) and the virtual GPU's traces (what-if on any card and setting)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from itertools import islice
from typing import NamedTuple

from harness.allocator import snapshot as snap
from harness.allocator.model import (
    K_SMALL_BUFFER,
    Block,
    CachingAllocator,
    Device,
    ExpandableSegment,
    OutOfMemory,
)
from harness.allocator.settings import AllocSettings


@dataclass
class ReplayResult:
    peak_reserved_bytes: int = 0
    peak_allocated_bytes: int = 0
    peak_requested_bytes: int = 0
    # the same peaks from the steady state on (a virtual-GPU trace's second step); None: no such step
    steady_peak_allocated_bytes: int | None = None
    steady_peak_requested_bytes: int | None = None
    steady_peak_reserved_bytes: int | None = None
    final_reserved_bytes: int = 0
    final_allocated_bytes: int = 0
    # reserved minus allocated when reserved peaked, and the largest free split remainder total
    fragmentation_at_peak_bytes: int = 0
    peak_inactive_split_bytes: int = 0
    num_alloc_retries: int = 0
    ooms: list = field(default_factory=list)
    # Device capacities under which this replay would be the same (every cudaMalloc granted or
    # refused alike): from `alike_from_bytes` up to, not including, `alike_below_bytes` (None: no
    # limit). Only for devices of the same total and memory fraction.
    alike_from_bytes: int = 0
    alike_below_bytes: int | None = None
    # A lean replay keeps only the peak of reserved bytes, the OOMs (their allocated bytes None) and
    # the cache flushes (the other peaks, split statistics and fragmentation stay 0, the steady
    # window None).
    lean: bool = False
    requests: int = 0
    settings: str = ""
    # under the recorded settings only: the replay checked against the recording
    allocs_total: int | None = None
    allocs_address_matched: int | None = None
    segments_total: int | None = None
    segments_matched: int | None = None
    reserved_checked: int | None = None
    reserved_matched: int | None = None
    final_layout_matched: bool | None = None  # every final segment and block as the snapshot lists it

    def as_dict(self) -> dict:
        return asdict(self)

    @property
    def exact(self) -> bool:
        return (self.allocs_total is not None and self.allocs_address_matched == self.allocs_total
                and self.segments_matched == self.segments_total and self.reserved_matched == self.reserved_checked
                and bool(self.final_layout_matched))


class _Peaks:
    """Reserved minus allocated at the moment reserved peaks; and, once a window opens, the
    allocated, requested and reserved peaks inside it (what is held when it opens counts)."""

    def __init__(self, alloc: CachingAllocator):
        st = alloc.stats  # the totals over both pools, read after every request
        self.allocated, self.requested, self.reserved = st.allocated_bytes.all, st.requested_bytes.all, st.reserved_bytes.all
        self.best = -1
        self.frag = 0
        self.window: list[int] | None = None  # allocated, requested, reserved

    @staticmethod
    def window_from(rows, start: int) -> int | None:
        """The first of `rows` from `start` on in step STEADY_FROM_STEP or later (EventTag.step)."""
        return next((i for i, row in enumerate(islice(rows, start, None), start)
                     if (tag := row[3]) is not None and tag[1] >= STEADY_FROM_STEP), None)

    def open_window(self) -> None:
        self.window = [self.allocated.current, self.requested.current, self.reserved.current]

    def observe(self) -> None:
        reserved = self.reserved.current
        if reserved > self.best:
            self.best = reserved
            self.frag = reserved - self.allocated.current
        w = self.window
        if w is not None:  # (comparisons, not max(): a replay observes every request)
            if self.allocated.current > w[0]:
                w[0] = self.allocated.current
            if self.requested.current > w[1]:
                w[1] = self.requested.current
            if reserved > w[2]:
                w[2] = reserved


def seed(alloc: CachingAllocator, state: snap.StartState) -> dict[int, Block]:
    """Put the recorded start state into the allocator; returns its live blocks by address."""
    import bisect

    by_segment: dict[int, list] = {base: [] for base in state.segments}
    bases = sorted(state.segments)
    for addr, (size, requested) in state.blocks.items():
        j = bisect.bisect_right(bases, addr) - 1
        if j >= 0:
            by_segment[bases[j]].append((addr, size, requested))
    chains: dict[tuple[bool, int], list[Block]] = {}  # expandable: one address range per pool and stream
    for base in bases:
        seg_size, small, stream = state.segments[base]
        pieces, pos = [], base
        for addr, size, requested in sorted(by_segment[base]):
            if addr > pos:
                pieces.append(Block(pos, addr - pos, stream, small))
            b = Block(addr, size, stream, small)
            b.allocated, b.requested = True, requested
            pieces.append(b)
            pos = addr + size
        if pos < base + seg_size:
            pieces.append(Block(pos, base + seg_size - pos, stream, small))
        alloc.total_allocated_memory += seg_size
        alloc.stats.reserved_bytes.add(seg_size, small)
        if state.expandable:
            chains.setdefault((small, stream), []).extend(pieces)
        else:
            _link(pieces)
            alloc.segments[base] = pieces[0]
            alloc.stats.segment.add(1, small)
            for b in pieces:
                alloc.blocks[b.addr] = b
    for (small, stream), mapped in chains.items():
        _expandable_range(alloc, mapped, small, stream)
    live: dict[int, Block] = {}
    for b in alloc.blocks.values():
        pool = alloc.small if b.small else alloc.large
        if not b.mapped:
            pool.insert_unmapped(b)
        elif b.allocated:
            live[b.addr] = b
            alloc.count_allocated(b)
        else:
            pool.insert(b)
            if b.is_split() and b.es is None:
                alloc.stats.inactive_split_bytes.add(b.size, b.small)
                alloc.stats.inactive_split.add(1, b.small)
    return live


def _link(pieces: list[Block]) -> None:
    for prev, nxt in zip(pieces, pieces[1:]):
        prev.next, nxt.prev = nxt, prev


def _expandable_range(alloc: CachingAllocator, mapped: list[Block], small: bool, stream: int) -> None:
    """The recorded mapped ranges of one pool's expandable segment, with unmapped address space
    between and after them, as the model keeps an expandable segment."""
    page = K_SMALL_BUFFER if small else alloc.settings.large_segment_size
    base = mapped[0].addr
    extent = mapped[-1].addr + mapped[-1].size - base
    total = alloc.device.total
    size = max(-(-(total + total // 8) // page) * page, -(-extent // page) * page)
    es = ExpandableSegment(base, size, page, stream, small)
    alloc.expandable[(small, base)] = es
    chain, pos = [], base
    for b in mapped:
        if b.addr > pos:
            chain.append(Block(pos, b.addr - pos, stream, small, es, mapped=False))
        b.es = es
        chain.append(b)
        es.mapped.update(range((b.addr - base) // page, -(-(b.addr + b.size - base) // page)))
        pos = b.addr + b.size
    if pos < base + size:
        chain.append(Block(pos, base + size - pos, stream, small, es, mapped=False))
    _link(chain)
    for b in chain:
        alloc.blocks[b.addr] = b


def replay_snapshot(data: dict, settings: AllocSettings | None = None, device: Device | None = None,
                    on_event=None) -> ReplayResult:
    """Replay a snapshot's trace. Under the recorded settings on an unlimited device, every
    decision is checked against the recording; otherwise the replay answers what-if."""
    dev = snap.device_of(data)
    recorded = AllocSettings.from_snapshot(data.get("allocator_settings") or {})
    settings = settings or recorded
    device = device or Device()
    verify = settings == recorded and device.capacity is None and device.allowed is None
    state = snap.start_state(data, dev)
    reqs = snap.requests(data, dev)
    pending: list = []  # the recording's segment events for the request being replayed
    decided: list = []  # the model's segment events for it
    seg_stats = {"total": 0, "matched": 0}
    top = max([*state.segments, *(r[1] for r in reqs if r[0] in ("alloc", "segment"))], default=0)
    bump = [top + (1 << 32)]

    def new_segment_addr(size: int) -> int:
        # Under verification, cudaMalloc (or the expandable address range, whose first page is
        # mapped at once) lands where the recording says; a size the recording did not ask for
        # lands elsewhere and shows up as a mismatch.
        if verify and pending and (pending[0][1] == size or settings.expandable_segments):
            return pending[0][0]
        addr = bump[0]
        bump[0] += size + (1 << 21)
        return addr

    def collect(action, addr, size, stream):
        if action.startswith("segment_"):
            decided.append((addr, size))
        if on_event is not None:
            on_event(action, addr, size, stream)

    def settle(recorded_events) -> None:
        seg_stats["total"] += len(recorded_events)
        seg_stats["matched"] += len(set(decided) & set(recorded_events))
        decided.clear()

    alloc = CachingAllocator(settings, device, new_segment_addr)
    live = seed(alloc, state)  # recorded address -> model block
    alloc.on_event = collect
    result = ReplayResult(settings=settings.conf, requests=len(reqs))
    peaks = _Peaks(alloc)
    peaks.observe()
    recorded_reserved = sum(s for s, _small, _st in state.segments.values())
    allocs = matched = checked = reserved_ok = 0
    for i, r in enumerate(reqs):
        kind = r[0]
        if kind == "segment":
            pending.append((r[1], r[2]))
            recorded_reserved += r[2]
            continue
        if kind == "alloc":
            _, addr, size, stream = r
            allocs += 1
            try:
                b = alloc.malloc(size, stream)
            except OutOfMemory as oom:
                result.ooms.append(_oom_row(oom, i, size))
                break
            matched += b.addr == addr
            live[addr] = b
            settle(pending)
            pending.clear()
        elif kind == "free":
            b = live.pop(r[1], None)
            if b is not None:
                alloc.free(b)
        elif kind == "empty_cache":
            recorded_reserved -= sum(size for _a, size in r[1])
            alloc.empty_cache()
            settle(r[1])
        elif kind == "oom":
            continue
        peaks.observe()
        if verify:
            checked += 1
            reserved_ok += alloc.stats.reserved_bytes.current == recorded_reserved
    _finish(result, alloc, peaks)
    if verify:
        result.allocs_total, result.allocs_address_matched = allocs, matched
        result.segments_total, result.segments_matched = seg_stats["total"], seg_stats["matched"]
        result.reserved_checked, result.reserved_matched = checked, reserved_ok
        result.final_layout_matched = _layout(alloc) == _recorded_layout(data, dev)
    return result


def _layout(alloc: CachingAllocator) -> set:
    return {(b.addr, b.size, b.allocated) for _seg, blocks in alloc.segment_blocks() for b in blocks}


def _recorded_layout(data: dict, device: int) -> set:
    return {(b["address"], b["size"], b["state"] != "inactive") for s in data["segments"]
            if s.get("device", device) == device for b in s["blocks"]}


class EventTag(NamedTuple):
    """Where a trace event happened: the record's phase, step, module and kind of memory."""
    phase: str
    step: int
    module: str
    kind: str


class ReplayRow(NamedTuple):
    """A request of a virtual-GPU trace to the allocator model."""
    action: str  # alloc | free
    key: int  # the storage's identity while it lives
    size: int  # requested bytes
    tag: EventTag | None
    stream: int = 0  # the CUDA stream it is allocated on: free blocks are reused on their own stream only


# The steady state of a virtual-GPU trace begins with its second step (step 1 builds the optimizer
# state, the cuBLAS workspaces and whatever else a first step creates once).
STEADY_FROM_STEP = 1


@dataclass
class Checkpoint:
    """A replay's state just before request `event` asked the device for more than any capacity it
    was kept for: on a device of at least `granted` bytes (the most it had been granted) every
    request before went alike, so a lean replay there goes on from this state (a copy of it)."""
    event: int
    granted: int
    alloc: CachingAllocator  # lean (Stats.lean)
    live: dict  # key -> its block in `alloc`


@dataclass
class Kept:
    """What a replay without a limit keeps for lean replays of rows alike up to a point (another
    card's, its kernels' scratch sized otherwise): its Checkpoints, and before each request of
    `watch` the largest block its stream's pool had cached (what a request of another size found)."""
    watch: frozenset[int] = frozenset()
    checkpoints: list[Checkpoint] = field(default_factory=list)
    cached: dict[int, int] = field(default_factory=dict)


def replay_events(events, settings: AllocSettings, device: Device | None = None, on_event=None,
                  stop_at_oom: bool = True, lean: bool = False, keep_below: Sequence[int] = (),
                  kept: Kept | None = None) -> tuple[ReplayResult, CachingAllocator]:
    """Replay a virtual-GPU trace (ReplayRow: action, key, size, tag, stream): the whole run's peaks and
    the steady state's (from the first event of step STEADY_FROM_STEP on); `lean`: see
    ReplayResult.lean. `on_event(action, addr, size, stream, tag)` sees each allocator event with
    the row's tag. A replay without a limit appends to `kept.checkpoints` a Checkpoint where it
    first asks the device for more than each capacity of `keep_below` (but one under its allocated
    peak so far, which no replay of its own needs: probe.sim.reserved.fits_by_numbers); and into
    `kept.cached`, for each request of `kept.watch`, the largest block its stream's pool had cached
    before it."""
    # Without a listener only the statistics the result reports are kept (Stats.peaks)
    alloc = CachingAllocator(settings, device or Device(), lean=lean, peaks_only=on_event is None)
    result = ReplayResult(settings=settings.conf, lean=lean)
    peaks = _Peaks(alloc)
    live: dict = {}
    tag = None
    if keep_below and kept is not None and alloc.device.capacity is None and alloc.device.allowed is None \
            and not settings.expandable_segments:  # (an expandable segment's range is the device's to size)
        pending = sorted(keep_below, reverse=True)

        def ask(need: int) -> None:
            crossed = False
            while pending and need > pending[-1]:
                crossed |= pending.pop() >= alloc.stats.allocated_bytes.peak
            if crossed:  # the request being made (result.requests counts from 1; a loop without a listener names it)
                kept.checkpoints.append(Checkpoint(alloc.requesting if on_event is None else result.requests - 1,
                                                   alloc.largest_granted,
                                                   *alloc.lean_copy(Device(total=alloc.device.total), live)))
        alloc.on_device_ask = ask
    if on_event is None:
        _replay_rows(events, alloc, result, stop_at_oom, live=live, kept=kept, peaks=None if lean else peaks)
        _finish(result, alloc, peaks)
        return result, alloc
    alloc.on_event = lambda action, addr, size, stream: on_event(action, addr, size, stream, tag)
    watch, cached = (kept.watch, kept.cached) if kept is not None else (frozenset(), {})
    window_at = None if lean else peaks.window_from(events, 0)
    for i, (action, key, size, tag, stream) in enumerate(events):
        result.requests = i + 1
        if i == window_at:
            peaks.open_window()
        if action == "alloc":
            if watch and i in watch:
                cached[i] = alloc.largest_cached(int(size), stream)
            try:
                b = alloc.malloc(int(size), stream)
            except OutOfMemory as oom:
                result.ooms.append(_oom_row(oom, i, int(size), tag))
                if stop_at_oom:
                    break
                continue
            b.tag = tag
            live[key] = b
            if not lean:
                peaks.observe()
        else:
            b = live.pop(key, None)
            if b is not None:
                alloc.free(b)
    _finish(result, alloc, peaks)
    return result, alloc


def _replay_rows(events, alloc: CachingAllocator, result: ReplayResult, stop_at_oom: bool, start: int = 0,
                 live: dict | None = None, kept: Kept | None = None, peaks: _Peaks | None = None) -> None:
    """replay_events' loop for a replay that reports no events (CachingAllocator.run_rows), its
    `peaks` observed (a lean one's: none; the allocator's own statistic keeps reserved's). From
    request `start` on with `live` (key -> block) where it goes on from a Checkpoint; what `kept`
    watches into it."""
    def on_oom(i: int, oom: OutOfMemory, size: int, tag) -> bool:
        result.ooms.append(_oom_row(oom, i, size, tag))
        return stop_at_oom

    watch, cached = (kept.watch, kept.cached) if kept is not None else (frozenset(), None)
    result.requests = alloc.run_rows(events, start, {} if live is None else live, on_oom, watch, cached, peaks)


class Replays:
    """One trace's replays under one setting on devices of several capacities (the cards a run is
    checked against): a device under which an earlier replay would be the same (same fraction, a
    capacity in its alike range, and same total under expandable segments) gets that replay instead
    of a new one. Its OOM rows then name the earlier device's capacity, and its own replays are lean
    (ReplayResult.lean): for whether a run fits and how often it retries, not for its message or its
    split statistics."""

    def __init__(self, events, settings: AllocSettings, kept: Kept | None = None):
        """`events`: the trace's rows, or a function that reads them (asked for each new replay, so
        that what holds many Replays need not hold every trace). `kept`: the requests its replay
        without a limit watches, and the checkpoints lean replays go on from (filled by that replay,
        or another's of rows alike up to theirs)."""
        self.events, self.settings = events, settings
        self.done: list[tuple[Device, ReplayResult]] = []
        self.kept = kept if kept is not None else Kept()

    def add(self, device: Device, result: ReplayResult) -> ReplayResult:
        self.done.append((device, result))
        return result

    def _rows(self):
        return self.events() if callable(self.events) else self.events

    def run_unlimited(self, device: Device, capacities: Sequence[int], lean: bool = False) -> ReplayResult:
        """The replay on `device` (no capacity: what the run reserves), its state kept where it
        first asks for more than each of `capacities` (the cards to be asked about): a lean replay
        on one of them goes on from there rather than from the start (into `kept`, with what it
        watches). `lean`: its reserved peak only (ReplayResult.lean), a third of the time."""
        return self.add(device, replay_events(self._rows(), self.settings, device, keep_below=capacities,
                                              kept=self.kept, lean=lean)[0])

    def on(self, device: Device) -> ReplayResult:
        # A card's total memory sizes only expandable segments' address ranges (and OOM messages,
        # which lean replays do not make): without them, cards of other sizes but a capacity in the
        # alike range make the same decisions
        any_total = not self.settings.expandable_segments
        for d, r in self.done:
            if (any_total or d.total == device.total) and d.allowed == device.allowed and _alike(r, device.capacity):
                return r
        events = self._rows()
        capacity = device.capacity if device.allowed is None else None  # a fraction: no checkpoint is alike
        start = max((c for c in self.kept.checkpoints if capacity is not None and c.granted <= capacity),
                    key=lambda c: c.event, default=None)
        if start is None:
            return self.add(device, replay_events(events, self.settings, device, lean=True)[0])
        alloc, live = start.alloc.lean_copy(device, start.live)  # the checkpoint kept for others
        result = ReplayResult(settings=self.settings.conf, lean=True)
        _replay_rows(events, alloc, result, stop_at_oom=True, start=start.event, live=live)
        _finish(result, alloc, _Peaks(alloc))
        return self.add(device, result)


def ranges_alike(settings: AllocSettings, reserved_bytes: int, total: int, other: int) -> bool:
    """Whether a replay on a device of `total` bytes that reserved `reserved_bytes` makes the
    decisions a replay on one of `other` bytes makes: always, but under expandable segments, where
    a stream's pool maps its pages into an address range of the device's memory, only while neither
    range could overflow (a T4's replay of a run that a 24 GB card holds in one range took a second
    range and reserved 2 GB more)."""
    return not settings.expandable_segments or total == other or reserved_bytes <= min(total, other)


def _alike(r: ReplayResult, capacity: int | None) -> bool:
    if capacity is None:
        return r.alike_below_bytes is None
    return r.alike_from_bytes <= capacity and (r.alike_below_bytes is None or capacity < r.alike_below_bytes)


def _finish(result: ReplayResult, alloc: CachingAllocator, peaks: _Peaks) -> None:
    st = alloc.stats
    result.peak_reserved_bytes = st.reserved_bytes.peak
    result.peak_allocated_bytes = st.allocated_bytes.peak
    result.peak_requested_bytes = st.requested_bytes.peak
    result.final_reserved_bytes = st.reserved_bytes.current
    result.final_allocated_bytes = st.allocated_bytes.current
    result.fragmentation_at_peak_bytes = peaks.frag
    result.peak_inactive_split_bytes = st.inactive_split_bytes.peak
    result.num_alloc_retries = st.num_alloc_retries
    result.alike_from_bytes, result.alike_below_bytes = alloc.largest_granted, alloc.smallest_refused
    if peaks.window is not None:
        (result.steady_peak_allocated_bytes, result.steady_peak_requested_bytes,
         result.steady_peak_reserved_bytes) = peaks.window


def _oom_row(oom: OutOfMemory, index: int, size: int, tag=None) -> dict:
    return {"event": index, "requested_bytes": size, "tried_bytes": oom.tried_bytes,
            "allocated_bytes": oom.allocated, "reserved_bytes": oom.reserved, "free_bytes": oom.free,
            "capacity_bytes": oom.capacity, "allowed_bytes": oom.allowed, "where": tag}
