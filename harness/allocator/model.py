"""A model of PyTorch's CUDA caching allocator (backend:native), rule for rule.

Follows c10/cuda/CUDACachingAllocator.cpp as summarised in shared/reference/pytorch-allocator.md
(section 1): request rounding, small and large pools, segment sizes, best fit with the oversize
rules, splitting, coalescing on free, pools per stream, the release-and-retry ladder,
garbage_collection_threshold, expandable segments, and the statistics with their peaks.
Memory comes from a `Device` with a capacity; it never touches a GPU.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import islice
from typing import Protocol

from harness.allocator.settings import K_LARGE_BUFFER, SIZE_MAX, AllocSettings
from harness.units import MiB

K_MIN_BLOCK = 512
K_SMALL_SIZE = MiB  # requests up to 1 MiB (rounded) go to the small pool
K_SMALL_BUFFER = 2 * MiB  # small-pool segment size and small expandable page
K_MIN_LARGE_ALLOC = 10 * MiB
K_ROUND_LARGE = 2 * MiB


def _power2_floor(n: int) -> int:
    return 1 << (n.bit_length() - 1)


def round_plain(size: int) -> int:
    """Bytes a request is rounded to without roundup_power2_divisions: kMinBlockSize multiples,
    at least one (what max_memory_allocated counts for it)."""
    return -(-size // K_MIN_BLOCK) * K_MIN_BLOCK if size > K_MIN_BLOCK else K_MIN_BLOCK


def round_size(size: int, divisions: tuple[int, ...] = (0,) * 16) -> int:
    """Bytes a request is rounded to (round_size, with roundup_power2_divisions)."""
    if size < K_MIN_BLOCK:
        return K_MIN_BLOCK
    index = min(max(size.bit_length() - 1 - 20, 0), len(divisions) - 1)
    d = divisions[index]
    if d > 1 and size > K_MIN_BLOCK * d:
        if size & (size - 1) == 0:
            return size
        floor = _power2_floor(size)
        step = floor >> (d.bit_length() - 1)
        if step == 0:
            return 2 * floor
        return -(-size // step) * step
    return round_plain(size)


def draws_small(size: int, divisions: tuple[int, ...] = (0,) * 16) -> bool:
    """Whether a request of `size` bytes draws from the small pool (its size as round_size rounds it)."""
    return round_size(size, divisions) <= K_SMALL_SIZE


def allocation_size(size: int, large_segment: int = K_LARGE_BUFFER) -> int:
    """Segment size cudaMalloc'd for a (rounded) request (get_allocation_size; `large_segment`:
    large_segment_size_mb's bytes)."""
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return large_segment
    return -(-size // K_ROUND_LARGE) * K_ROUND_LARGE


class Block:
    __slots__ = ("addr", "size", "requested", "stream", "small", "allocated", "mapped", "prev", "next",
                 "es", "gc_base", "tag")

    def __init__(self, addr, size, stream, small, es=None, mapped=True):
        self.addr, self.size, self.stream, self.small = addr, size, stream, small
        self.requested = 0
        self.allocated = False
        self.mapped = mapped
        self.prev: Block | None = None
        self.next: Block | None = None
        self.es: ExpandableSegment | None = es
        self.gc_base = 0
        self.tag = None  # the caller's label (e.g. the trace event) for snapshots

    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None

    def key(self):
        return (self.stream, self.size, self.addr)


class ExpandableSegment:
    """One per (pool, stream): a reserved address range mapped page by page."""

    def __init__(self, base: int, size: int, page: int, stream: int, small: bool):
        self.base, self.size, self.page, self.stream, self.small = base, size, page, stream, small
        self.mapped: set[int] = set()  # page indices


class Pool:
    def __init__(self, small: bool):
        self.small = small
        self.free: list[tuple] = []  # (stream, size, addr), mapped free blocks, best-fit order
        self.unmapped: list[tuple] = []  # (stream, addr), expandable address space not mapped
        self.get_free_blocks_calls = 0  # the garbage collector's clock

    def insert(self, b: Block) -> None:
        insort(self.free, (b.stream, b.size, b.addr))
        b.gc_base = self.get_free_blocks_calls

    def remove(self, b: Block) -> None:
        key, free = (b.stream, b.size, b.addr), self.free
        i = bisect_left(free, key)
        if i < len(free) and free[i] == key:
            del free[i]

    def insert_unmapped(self, b: Block) -> None:
        insort(self.unmapped, (b.stream, b.addr))

    def remove_unmapped(self, b: Block) -> None:
        i = bisect_left(self.unmapped, (b.stream, b.addr))
        if i < len(self.unmapped) and self.unmapped[i] == (b.stream, b.addr):
            del self.unmapped[i]


@dataclass(slots=True)
class Stat:
    current: int = 0
    peak: int = 0
    allocated: int = 0  # everything ever added (memory_stats' "allocated")
    freed: int = 0  # everything ever taken away ("freed")

    def add(self, n: int) -> None:
        self.current += n
        if n > 0:
            self.allocated += n
            if self.current > self.peak:
                self.peak = self.current
        else:
            self.freed -= n


class PoolStat:
    """A statistic over both pools and for each (memory_stats' all, large_pool, small_pool)."""

    __slots__ = ("all", "large", "small")

    def __init__(self):
        self.all, self.large, self.small = Stat(), Stat(), Stat()

    @property
    def current(self) -> int:
        return self.all.current

    @property
    def peak(self) -> int:
        return self.all.peak

    def add(self, n: int, small: bool) -> None:
        # Stat.add on both, inline: a replay makes ~25 of these calls per event
        a, p = self.all, (self.small if small else self.large)
        a.current += n
        p.current += n
        if n > 0:
            a.allocated += n
            p.allocated += n
            if a.current > a.peak:
                a.peak = a.current
            if p.current > p.peak:
                p.peak = p.current
        else:
            a.freed -= n
            p.freed -= n

    def reset_peak(self) -> None:
        for s in (self.all, self.large, self.small):
            s.peak = s.current


_POOLED = ("allocated_bytes", "requested_bytes", "reserved_bytes", "active_bytes", "inactive_split_bytes",
           "allocation", "active", "segment", "inactive_split")


@dataclass
class Stats:
    """CUDACachingAllocator's DeviceStats, by the same names."""
    allocated_bytes: PoolStat = field(default_factory=PoolStat)
    requested_bytes: PoolStat = field(default_factory=PoolStat)
    reserved_bytes: PoolStat = field(default_factory=PoolStat)
    inactive_split_bytes: PoolStat = field(default_factory=PoolStat)
    allocation: PoolStat = field(default_factory=PoolStat)
    segment: PoolStat = field(default_factory=PoolStat)
    inactive_split: PoolStat = field(default_factory=PoolStat)
    oversize_allocations: Stat = field(default_factory=Stat)  # blocks >= max_split_size
    oversize_segments: Stat = field(default_factory=Stat)
    num_alloc_retries: int = 0
    num_ooms: int = 0
    num_device_alloc: int = 0
    num_device_free: int = 0

    # Active: handed out and not yet free, a free awaiting a stream's event included. Here a free
    # completes at once (no stream waits on a block: record_stream is not modelled), so the active
    # blocks are the allocated ones: one statistic under both names, kept once.
    @property
    def active_bytes(self) -> PoolStat:
        return self.allocated_bytes

    @property
    def active(self) -> PoolStat:
        return self.allocation

    @classmethod
    def lean(cls) -> Stats:
        """Only reserved bytes kept (the rest take no time): for replays that ask whether a run fits
        and how often it retries, which no other statistic decides."""
        return cls(**{name: _UNTRACKED for name in _UNTRACKED_WHEN_LEAN})  # type: ignore[arg-type]

    @classmethod
    def peaks(cls) -> Stats:
        """Reserved bytes kept whole; allocated, requested and inactive split bytes over both pools,
        current and peak only (_Totals); the rest not at all: what a replay's result reports
        (replay.ReplayResult), at a fraction of the time."""
        return cls(allocated_bytes=_Totals(), requested_bytes=_Totals(), inactive_split_bytes=_Totals(),
                   **{name: _UNTRACKED for name in _UNTRACKED_FOR_PEAKS})  # type: ignore[arg-type]

    def reset_peaks(self) -> None:
        """reset_peak_memory_stats: every peak back to its current value."""
        for name in _POOLED:
            getattr(self, name).reset_peak()
        for s in (self.oversize_allocations, self.oversize_segments):
            s.peak = s.current

    def reset_accumulated(self) -> None:
        """reset_accumulated_memory_stats: the allocated and freed totals, the retry and OOM counts."""
        stats = [s for name in _POOLED for s in (getattr(self, name).all, getattr(self, name).large,
                                                 getattr(self, name).small)]
        for s in (*stats, self.oversize_allocations, self.oversize_segments):
            s.allocated = s.freed = 0
        self.num_alloc_retries = self.num_ooms = self.num_device_alloc = self.num_device_free = 0

    def as_dict(self) -> dict:
        """torch.cuda.memory_stats()' keys and values."""
        out = {}
        for name in _POOLED:
            ps = getattr(self, name)
            for pool, s in (("all", ps.all), ("large_pool", ps.large), ("small_pool", ps.small)):
                for what in ("current", "peak", "allocated", "freed"):
                    out[f"{name}.{pool}.{what}"] = getattr(s, what)
        for name in ("oversize_allocations", "oversize_segments"):
            s = getattr(self, name)
            for what in ("current", "peak", "allocated", "freed"):
                out[f"{name}.{what}"] = getattr(s, what)
        for name in ("num_alloc_retries", "num_ooms", "num_device_alloc", "num_device_free"):
            out[name] = getattr(self, name)
        out["num_sync_all_streams"] = 0
        return out


class _Untracked:
    """A statistic nobody reads (Stats.lean): adding to it does nothing; as a PoolStat, each of its
    pools is itself."""

    __slots__ = ()
    current = peak = allocated = freed = 0

    def add(self, *_) -> None:
        pass

    @property
    def all(self) -> _Untracked:
        return self

    large = small = all

    def reset_peak(self) -> None:
        pass


def _copied(ps: PoolStat) -> PoolStat:
    out = PoolStat()
    for pool in ("all", "large", "small"):
        s = getattr(ps, pool)
        setattr(out, pool, Stat(s.current, s.peak, s.allocated, s.freed))
    return out


class _Totals(PoolStat):
    """A statistic over both pools, its current value and peak only (Stats.peaks): neither pool's
    own nor the totals ever added and taken away are kept."""

    __slots__ = ()

    def __init__(self):
        self.all, self.large, self.small = Stat(), _UNTRACKED, _UNTRACKED

    def add(self, n: int, small: bool) -> None:
        a = self.all
        a.current += n
        if a.current > a.peak:
            a.peak = a.current


_UNTRACKED = _Untracked()
_UNTRACKED_FOR_PEAKS = ("allocation", "segment", "inactive_split", "oversize_allocations", "oversize_segments")
_UNTRACKED_WHEN_LEAN = ("allocated_bytes", "requested_bytes", "inactive_split_bytes", *_UNTRACKED_FOR_PEAKS)


class Observer(Protocol):
    """What a replay's loop reports its peaks to (CachingAllocator.run_rows)."""

    def window_from(self, rows, start: int) -> int | None:
        """The row before which the window opens (None: no row of `rows[start:]` opens it)."""

    def open_window(self) -> None: ...

    def observe(self) -> None:
        """After each request served."""


class OutOfMemory(Exception):
    """What torch.OutOfMemoryError would carry; `message(version)` words it."""

    def __init__(self, tried_bytes: int, rounded_bytes: int, capacity: int, free: int, allocated: int | None,
                 reserved: int, allowed: int | None, device: int = 0):
        super().__init__(f"CUDA out of memory. Tried to allocate {tried_bytes} bytes")
        self.tried_bytes, self.rounded_bytes = tried_bytes, rounded_bytes
        self.capacity, self.free, self.allocated, self.reserved = capacity, free, allocated, reserved
        self.allowed, self.device = allowed, device


class Device:
    """Physical memory PyTorch may use: `capacity` bytes (the card less non-PyTorch memory), and
    optionally a per-process fraction of `total` (set_per_process_memory_fraction)."""

    def __init__(self, capacity: int | None = None, total: int | None = None, fraction: float | None = None):
        self.capacity = capacity  # None: unlimited (a replay that only reproduces decisions)
        self.total = total if total is not None else (capacity if capacity is not None else 80 * 1024**3)
        self.allowed = int(fraction * self.total) if fraction is not None else None

    @classmethod
    def for_card(cls, card, fraction: float | None = None) -> Device:
        """A card (config.point.Card: its `room()` and `memory_bytes`): what PyTorch gets is its room."""
        return cls(capacity=card.room(), total=card.memory_bytes, fraction=fraction)


class CachingAllocator:
    """Per-device caching allocator. `new_segment_addr(size)` chooses cudaMalloc's addresses."""

    def __init__(self, settings: AllocSettings | None = None, device: Device | None = None,
                 new_segment_addr=None, lean: bool = False, peaks_only: bool = False):
        """`lean`: reserved bytes its only statistic (Stats.lean); `peaks_only`: the statistics a
        replay's result reports (Stats.peaks)."""
        self.settings = settings or AllocSettings()
        self.device = device or Device()
        self.small, self.large = Pool(True), Pool(False)
        self.blocks: dict[int, Block] = {}  # every block by address (free, allocated, unmapped)
        self.segments: dict[int, Block] = {}  # regular segments: base address -> first block
        self.expandable: dict[tuple[bool, int], ExpandableSegment] = {}
        self.stats = Stats.lean() if lean else Stats.peaks() if peaks_only else Stats()
        self.lean = lean
        # round_size without roundup_power2_divisions: round_plain (the common case, inlined in malloc)
        self._plain_rounding = not any(d > 1 for d in self.settings.roundup_power2_divisions)
        self.total_allocated_memory = 0  # bytes obtained from the device (== reserved)
        # What each cudaMalloc asked the device to hold in all (reserved after it): the largest
        # granted and the smallest refused. Any capacity between them decides every one alike.
        self.largest_granted = 0
        self.smallest_refused: int | None = None
        self._va = 0x7F0000000000
        self._new_segment_addr = new_segment_addr or self._bump
        self.on_event: Callable[..., None] | None = None  # callback(action, addr, size, stream[, tag]) for traces
        # callback(bytes reserved after it) before each cudaMalloc asks the device (the state then is
        # the state before the request that asks: nothing has changed yet)
        self.on_device_ask: Callable[[int], None] | None = None
        self.requesting = 0  # the request a lean replay's malloc serves (run_rows: its checkpoints')

    # ---- addresses -------------------------------------------------------------------------
    def _bump(self, size: int) -> int:
        # Top down, as the CUDA driver hands out cudaMalloc's address ranges: the order matters
        # where the best fit has equal-sized free blocks to choose from (the lowest address wins).
        # Bottom-up, three real snapshots (an H200, torch 2.11, driver 580) replayed 0.54% and 0.63%
        # off their reserved peaks; top-down, all three exactly (demo-1b bf16 and fp32 on one card,
        # and rank 0 of FSDP2 over 4). A gap below each: never adjacent.
        self._va -= -(-size // K_SMALL_BUFFER) * K_SMALL_BUFFER + K_SMALL_BUFFER
        return self._va

    def _emit(self, action, addr, size, stream=0):
        if self.on_event is not None:
            self.on_event(action, addr, size, stream)

    # ---- public API ------------------------------------------------------------------------
    def malloc(self, orig_size: int, stream: int = 0) -> Block:
        """Allocate like CUDACachingAllocator::malloc; raises OutOfMemory."""
        s = self.settings
        if self._plain_rounding:  # round_plain, inline: a replay makes this call per request
            size = -(-orig_size // K_MIN_BLOCK) * K_MIN_BLOCK if orig_size > K_MIN_BLOCK else K_MIN_BLOCK
        else:
            size = round_size(orig_size, s.roundup_power2_divisions)
        pool = self.small if size <= K_SMALL_SIZE else self.large
        block = self._get_free_block(pool, stream, size)
        if block is None:
            alloc_size = allocation_size(size, s.large_segment_size)
            if self._gc_active():
                self._garbage_collect()
            block = self._alloc_block(pool, stream, size, alloc_size)
            if block is None and self._release_available_cached_blocks(pool, stream, size):
                block = self._alloc_block(pool, stream, size, alloc_size)
            if block is None:
                self.release_cached_blocks()
                block = self._alloc_block(pool, stream, size, alloc_size)
                self.stats.num_alloc_retries += 1
            if block is None:
                self.stats.num_ooms += 1
                self._emit("oom", 0, size, stream)
                raise self._oom(alloc_size, size)
        return self._alloc_found_block(block, pool, size, orig_size, self._should_split(block, size))

    def free(self, block: Block) -> None:
        """free + free_block (a single stream: the free completes at once)."""
        addr, requested, stream = block.addr, block.requested, block.stream  # merging moves block.addr
        st = self.stats
        if not self.lean:
            st.allocated_bytes.add(-block.size, block.small)
            st.allocation.add(-1, block.small)
            if block.size >= self.settings.max_split_size:
                st.oversize_allocations.add(-1)
        if self.on_event is None:
            self._free_block(block)
            return
        self.on_event("free_requested", addr, requested, stream)
        self._free_block(block)
        self.on_event("free_completed", addr, requested, stream)

    def empty_cache(self) -> None:
        self.release_cached_blocks()

    # ---- the rules ---------------------------------------------------------------------------
    def _gc_active(self) -> bool:
        return self.device.allowed is not None and self.settings.garbage_collection_threshold > 0

    def _get_free_block(self, pool: Pool, stream: int, size: int) -> Block | None:
        s, free = self.settings, pool.free
        if self._gc_active():
            pool.get_free_blocks_calls += 1
        i = bisect_left(free, (stream, size, 0))
        if i == len(free) or free[i][0] != stream:
            return None
        b = self.blocks[free[i][2]]
        if b.es is not None:
            i, b = self._grown_fit(free, i, b, stream)
        if size < s.max_split_size and b.size >= s.max_split_size:
            return None  # never hand an oversize block to a normal request
        if size >= s.max_split_size and b.size >= size + s.max_non_split_rounding:
            return None  # oversize reuse only within max_non_split_rounding
        del free[i]  # (pool.remove, its place known)
        return b

    def _grown_fit(self, free: list[tuple], i: int, b: Block, stream: int) -> tuple[int, Block]:
        """From `free[i]` (block `b`, expandable), the best fit counting each expandable block as
        big as it can grow (its next block unmapped): its place in `free` and the block."""
        def grow(x: Block) -> int:
            return x.size + (x.next.size if x.next is not None and not x.next.mapped else 0)
        blocks, grown, j = self.blocks, grow(b), i + 1
        while b.es is not None and j < len(free) and free[j][0] == stream:
            nb = blocks[free[j][2]]
            if (nb_grown := grow(nb)) >= grown:
                break
            b, grown, i, j = nb, nb_grown, j, j + 1
        return i, b

    def _should_split(self, b: Block, size: int) -> bool:
        remaining = b.size - size
        if b.small or self.settings.expandable_segments:
            return remaining >= K_MIN_BLOCK
        return size < self.settings.max_split_size and remaining > K_SMALL_SIZE

    def _alloc_found_block(self, b: Block, pool: Pool, size: int, orig_size: int, split: bool) -> Block:
        st = self.stats
        already_split = b.prev is not None or b.next is not None
        if split:
            rest = self._split_off(b, size)
            pool.insert(rest)
            if b.es is None and not self.lean:
                if already_split:
                    st.inactive_split_bytes.add(-size, b.small)
                else:
                    st.inactive_split_bytes.add(rest.size, b.small)
                    st.inactive_split.add(1, b.small)
        elif already_split and b.es is None and not self.lean:
            st.inactive_split_bytes.add(-b.size, b.small)
            st.inactive_split.add(-1, b.small)
        b.allocated = True
        b.requested = orig_size
        if not self.lean:
            self.count_allocated(b)
        if self.on_event is not None:
            self.on_event("alloc", b.addr, orig_size, b.stream)
        return b

    def count_allocated(self, b: Block) -> None:
        """The statistics of a block handed out (or found allocated when a replay seeds the state)."""
        st = self.stats
        st.allocation.add(1, b.small)
        st.allocated_bytes.add(b.size, b.small)
        st.requested_bytes.add(b.requested, b.small)
        if b.size >= self.settings.max_split_size:
            st.oversize_allocations.add(1)

    def _split_off(self, b: Block, keep: int, mapped: bool = True) -> Block:
        """Cut `b` after `keep` bytes; the rest becomes a new block linked after it."""
        rest = Block(b.addr + keep, b.size - keep, b.stream, b.small, b.es, mapped=mapped)
        rest.prev, rest.next = b, b.next
        if b.next is not None:
            b.next.prev = rest
        b.next = rest
        b.size = keep
        self.blocks[rest.addr] = rest
        return rest

    def _try_merge(self, dst: Block, src: Block | None, pool: Pool) -> int:
        if src is None or src.allocated or dst.mapped != src.mapped:
            return 0
        if dst.prev is src:
            del self.blocks[dst.addr]
            dst.addr = src.addr
            dst.prev = src.prev
            if dst.prev is not None:
                dst.prev.next = dst
            self.blocks[dst.addr] = dst
        else:
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        if src.mapped:
            pool.remove(src)
        else:
            pool.remove_unmapped(src)
        if self.blocks.get(src.addr) is src:
            del self.blocks[src.addr]
        dst.size += src.size
        if dst.es is None and dst.prev is None:
            self.segments[dst.addr] = dst  # dst now starts its segment
        return src.size

    def _free_block(self, b: Block) -> None:
        st = self.stats
        pool = self.small if b.small else self.large
        requested = b.requested
        delta = count = 0
        for cand in (b.prev, b.next):
            if cand is not None and not cand.allocated:
                subsumed = self._try_merge(b, cand, pool)
                delta -= subsumed
                count -= subsumed > 0
        b.allocated = False
        pool.insert(b)
        if self.lean:
            return
        st.requested_bytes.add(-requested, b.small)
        if b.is_split():
            delta += b.size
            count += 1
        if b.es is None:
            st.inactive_split_bytes.add(delta, b.small)
            st.inactive_split.add(count, b.small)

    # ---- memory from the device -------------------------------------------------------------
    def _device_has(self, nbytes: int) -> bool:
        cap = self.device.capacity
        need = self.total_allocated_memory + nbytes
        if self.on_device_ask is not None:
            self.on_device_ask(need)
        if cap is None or need <= cap:
            self.largest_granted = max(self.largest_granted, need)
            return True
        self.smallest_refused = need if self.smallest_refused is None else min(self.smallest_refused, need)
        return False

    def _alloc_block(self, pool: Pool, stream: int, size: int, alloc_size: int) -> Block | None:
        allowed = self.device.allowed
        if allowed is not None and self.total_allocated_memory + alloc_size > allowed:
            return None
        if self.settings.expandable_segments:
            return self._try_allocate_expandable_block(pool, stream, size)
        if not self._device_has(alloc_size):
            return None
        addr = self._new_segment_addr(alloc_size)
        b = Block(addr, alloc_size, stream, pool.small)
        self.blocks[addr] = b
        self.segments[addr] = b
        self.total_allocated_memory += alloc_size
        self.stats.segment.add(1, pool.small)
        self.stats.reserved_bytes.add(alloc_size, pool.small)
        self.stats.num_device_alloc += 1
        if alloc_size >= self.settings.max_split_size:
            self.stats.oversize_segments.add(1)
        self._emit("segment_alloc", addr, alloc_size, stream)
        return b

    def _release_block(self, b: Block, pool: Pool) -> None:
        """cudaFree a whole free segment."""
        pool.remove(b)
        del self.blocks[b.addr]
        self.segments.pop(b.addr, None)
        self.total_allocated_memory -= b.size
        self.stats.segment.add(-1, b.small)
        self.stats.reserved_bytes.add(-b.size, b.small)
        self.stats.num_device_free += 1
        if b.size >= self.settings.max_split_size:
            self.stats.oversize_segments.add(-1)
        self._emit("segment_free", b.addr, b.size, b.stream)

    def _release_available_cached_blocks(self, pool: Pool, stream: int, size: int) -> bool:
        msz = self.settings.max_split_size
        if msz == SIZE_MAX:
            return False
        key = max(size, msz)
        i = bisect_left(pool.free, (stream, key, 0))
        if i == len(pool.free) or pool.free[i][0] != stream:
            # No single block is large enough: free oversize blocks from the largest down.
            released, j = 0, i - 1
            while j >= 0 and released < key:
                st_, sz, addr = pool.free[j]
                if st_ != stream or sz < msz:
                    break
                b = self.blocks[addr]
                if b.es is None and not b.is_split():
                    self._release_block(b, pool)
                    released += sz
                j -= 1
            return released >= key
        b = self.blocks[pool.free[i][2]]
        if b.es is not None or b.is_split():
            return False
        self._release_block(b, pool)
        return True

    def release_cached_blocks(self) -> None:
        """empty_cache(): every whole free segment back to the device; expandable pages unmapped."""
        for pool in (self.large, self.small):
            free = [self.blocks[addr] for _stream, _size, addr in pool.free]
            to_unmap = []
            for b in free:
                if b.es is not None:
                    to_unmap.append(b)
                elif not b.is_split():
                    self._release_block(b, pool)
            for b in to_unmap:
                gone = self._unmap_block(b, pool)
                if gone is not None and gone.prev is None and gone.next is None:
                    self._release_expandable_segment(gone, pool)

    def _release_expandable_segment(self, b: Block, pool: Pool) -> None:
        """A segment with nothing mapped gives its address range back."""
        pool.remove_unmapped(b)
        del self.blocks[b.addr]
        del self.expandable[(b.small, b.es.base)]

    def _garbage_collect(self) -> None:
        """garbage_collect_cached_blocks: free whole large-pool segments of above-average age
        (age: get_free_block calls since the block was cached) until reserved is under the
        threshold; a pass does not stop at the target, so GC does not run again at once."""
        pool = self.large
        threshold = int(self.settings.garbage_collection_threshold * self.device.allowed)
        if self.total_allocated_memory <= threshold:
            return
        target = self.total_allocated_memory - threshold

        def age(b):
            return pool.get_free_blocks_calls - b.gc_base

        unsplit = [self.blocks[a] for _s, _z, a in pool.free if not self.blocks[a].is_split()]
        total_age, count = sum(age(b) for b in unsplit), len(unsplit)
        reclaimed, freed_one = 0, True
        while reclaimed < target and freed_one and count > 0:
            threshold_age = total_age / count
            freed_one = False
            for b in [self.blocks[a] for _s, _z, a in pool.free]:
                if not b.is_split() and b.es is None and age(b) >= threshold_age:
                    freed_one = True
                    reclaimed += b.size
                    total_age -= age(b)
                    count -= 1
                    self._release_block(b, pool)

    # ---- expandable segments ----------------------------------------------------------------
    def _segment_for(self, pool: Pool, stream: int, size: int) -> ExpandableSegment:
        page = K_SMALL_BUFFER if pool.small else self.settings.large_segment_size
        total = self.device.total
        # 1 1/8 of the card's memory, as find_expandable_block reserves; a request for more is an
        # OOM on any card of that size, and without a limit it takes a range of its own size (a
        # larger card's), so its mapping is what it adds
        n_pages = -(-max(total + total // 8, size) // page)
        es = ExpandableSegment(self._new_segment_addr(n_pages * page), n_pages * page, page, stream, pool.small)
        self.expandable[(pool.small, es.base)] = es
        b = Block(es.base, es.size, stream, pool.small, es, mapped=False)
        self.blocks[b.addr] = b
        pool.insert_unmapped(b)
        return es

    def _find_expandable_block(self, pool: Pool, stream: int, size: int) -> Block:
        def allocatable(b):
            return b is not None and not b.allocated

        def room(b):
            total = 0
            while total < size and allocatable(b):
                total += b.size
                b = b.next
            return total >= size

        i = bisect_left(pool.unmapped, (stream, 0))
        while i < len(pool.unmapped) and pool.unmapped[i][0] == stream:
            c = self.blocks[pool.unmapped[i][1]]
            if allocatable(c.prev):
                c = c.prev
            if room(c):
                return c
            i += 1
        es = self._segment_for(pool, stream, size)
        return self.blocks[es.base]

    def _map_block(self, b: Block, size: int, pool: Pool) -> bool:
        es = b.es
        first = (b.addr - es.base) // es.page
        last = -(-(b.addr - es.base + size) // es.page)
        nbytes = (last - first) * es.page
        if not self._device_has(nbytes):
            return False  # cuMemCreate fails; the mapping is all or nothing
        es.mapped.update(range(first, last))
        pool.remove_unmapped(b)
        b.mapped = True
        if nbytes < b.size:
            pool.insert_unmapped(self._split_off(b, nbytes, mapped=False))
        addr = b.addr
        self._try_merge(b, b.prev, pool)
        self._try_merge(b, b.next, pool)
        pool.insert(b)
        self.total_allocated_memory += nbytes
        self.stats.reserved_bytes.add(nbytes, b.small)
        self.stats.num_device_alloc += 1
        self._emit("segment_map", addr, nbytes, b.stream)
        return True

    def _try_allocate_expandable_block(self, pool: Pool, stream: int, size: int) -> Block | None:
        c = self._find_expandable_block(pool, stream, size)
        if not c.mapped and not self._map_block(c, min(c.size, size), pool):
            return None
        while c.size < size:
            nxt = c.next
            if not self._map_block(nxt, min(size - c.size, nxt.size), pool):
                return None
            c = nxt
        pool.remove(c)
        return c

    def _unmap_block(self, b: Block, pool: Pool) -> Block | None:
        """Unmap the whole pages inside free block `b`; returns the unmapped block."""
        es = b.es
        first = -(-(b.addr - es.base) // es.page)
        last = (b.addr + b.size - es.base) // es.page
        if first >= last:
            return None
        start, nbytes = es.base + first * es.page, (last - first) * es.page
        pool.remove(b)
        middle = b
        if start > b.addr:  # a free head stays mapped
            middle = self._split_off(b, start - b.addr)
            pool.insert(b)
        if middle.size > nbytes:  # so does a free tail
            pool.insert(self._split_off(middle, nbytes))
        middle.mapped = False
        es.mapped.difference_update(range(first, last))
        self._try_merge(middle, middle.prev, pool)
        self._try_merge(middle, middle.next, pool)
        pool.insert_unmapped(middle)
        self.total_allocated_memory -= nbytes
        self.stats.reserved_bytes.add(-nbytes, middle.small)
        self.stats.num_device_free += 1
        self._emit("segment_unmap", start, nbytes, middle.stream)
        return middle

    def largest_cached(self, size: int, stream: int) -> int:
        """The largest free block cached on `stream` in the pool a request of `size` bytes draws from
        (0: none); regular segments' blocks (an expandable one's are counted as mapped)."""
        pool = self.small if draws_small(size, self.settings.roundup_power2_divisions) else self.large
        i = bisect_left(pool.free, (stream + 1, 0, 0)) - 1
        return pool.free[i][1] if i >= 0 and pool.free[i][0] == stream else 0

    # ---- a replay's loop ----------------------------------------------------------------------
    def run_rows(self, rows, start: int, live: dict, on_oom: Callable[[int, OutOfMemory, int, object], bool],
                 watch: frozenset[int] = frozenset(), cached: dict[int, int] | None = None,
                 peaks: Observer | None = None) -> int:
        """Requests `rows[start:]` ((action, key, size, tag, stream) each) on this allocator,
        `live` mapping each key to its block; `on_oom(index, error, size, tag)` says whether to stop.
        Returns how many requests were made. malloc and free as the calls make them, inline where a
        cached block takes the request (most do: a 70B rank's ~90k requests, ~30% faster than the
        calls; keeping the statistics of Stats.peaks, 2-3x; expandable segments' too). Before each request of `watch`, into
        `cached`, the largest block its stream's pool had cached (largest_cached); `requesting`
        names the request a device ask comes from. `peaks` (a lean allocator's: none) sees each
        request served and the first row of its window (Observer)."""
        s = self.settings
        counting = not self.lean
        inline = (self.on_event is None and not self._gc_active()
                  and (self.lean or isinstance(self.stats.allocated_bytes, _Totals)))
        plain, divisions, expandable = self._plain_rounding, s.roundup_power2_divisions, s.expandable_segments
        msz, mnsr = s.max_split_size, s.max_non_split_rounding
        malloc, free_call, pop = self.malloc, self.free, live.pop
        blocks, segments, pools = self.blocks, self.segments, (self.large, self.small)
        st = self.stats
        allocated, requested, inactive = st.allocated_bytes.all, st.requested_bytes.all, st.inactive_split_bytes.all
        observe = peaks.observe if peaks is not None else None
        window_at = peaks.window_from(rows, start) if peaks is not None else None
        i = start - 1
        for i, (action, key, orig, tag, stream) in enumerate(islice(rows, start, None), start):
            if i == window_at:
                peaks.open_window()  # type: ignore[union-attr]
            if action == "alloc":
                if i in watch:
                    cached[i] = self.largest_cached(orig, stream)  # type: ignore[index]
                b = None
                if inline:  # malloc with _get_free_block's hit, _should_split and _alloc_found_block
                    if plain:  # round_plain's
                        size = -(-orig // K_MIN_BLOCK) * K_MIN_BLOCK if orig > K_MIN_BLOCK else K_MIN_BLOCK
                    else:
                        size = round_size(orig, divisions)
                    small = size <= K_SMALL_SIZE
                    pool = pools[small]
                    free = pool.free
                    j = bisect_left(free, (stream, size, 0))
                    if j < len(free) and free[j][0] == stream:
                        fit = blocks[free[j][2]]
                        if (es := fit.es) is not None:  # (expandable segments)
                            j, fit = self._grown_fit(free, j, fit, stream)
                        found = fit.size
                        if not (found >= msz > size or size >= msz and found >= size + mnsr):  # oversize rules
                            b = fit
                            del free[j]
                            # (an expandable segment's blocks count no inactive split bytes)
                            was_split = es is None and (b.prev is not None or b.next is not None)
                            rest_size = found - size
                            if (rest_size >= K_MIN_BLOCK if small or expandable
                                    else size < msz and rest_size > K_SMALL_SIZE):
                                rest = Block(b.addr + size, rest_size, stream, small, b.es)
                                rest.prev, rest.next = b, b.next
                                if b.next is not None:
                                    b.next.prev = rest
                                b.next, b.size = rest, size
                                blocks[rest.addr] = rest
                                insort(free, (stream, rest_size, rest.addr))
                                rest.gc_base = pool.get_free_blocks_calls
                                if counting and es is None:  # the remainder is inactive split now, or still
                                    inactive.current += -size if was_split else rest_size
                                    if inactive.current > inactive.peak:
                                        inactive.peak = inactive.current
                            elif counting and was_split:
                                inactive.current -= found
                            b.allocated, b.requested = True, orig
                            if counting:  # count_allocated's
                                allocated.current += b.size
                                if allocated.current > allocated.peak:
                                    allocated.peak = allocated.current
                                requested.current += orig
                                if requested.current > requested.peak:
                                    requested.peak = requested.current
                if b is None:
                    self.requesting = i
                    try:
                        b = malloc(orig, stream)
                    except OutOfMemory as oom:
                        if on_oom(i, oom, orig, tag):
                            break
                        continue
                b.tag = tag
                live[key] = b
                if observe is not None:
                    observe()
                continue
            b = pop(key, None)
            if b is None:
                continue
            if not inline:
                free_call(b)
                continue
            # free and _free_block: coalesced with a free neighbour on either side
            small = b.small
            free = (pool := pools[small]).free
            prev, nxt = b.prev, b.next
            if counting:
                allocated.current -= b.size
                requested.current -= b.requested
                merged = 0
            if prev is not None and not prev.allocated and prev.mapped:  # (an unmapped block stays apart)
                del free[bisect_left(free, (prev.stream, prev.size, prev.addr))]
                del blocks[b.addr]
                if counting:
                    merged += prev.size
                b.addr, b.prev, b.size = prev.addr, prev.prev, b.size + prev.size
                blocks[b.addr] = b
                if b.prev is not None:
                    b.prev.next = b
                elif b.es is None:
                    segments[b.addr] = b
            if nxt is not None and not nxt.allocated and nxt.mapped:
                del free[bisect_left(free, (nxt.stream, nxt.size, nxt.addr))]
                del blocks[nxt.addr]
                if counting:
                    merged += nxt.size
                b.next, b.size = nxt.next, b.size + nxt.size
                if b.next is not None:
                    b.next.prev = b
            b.allocated = False
            insort(free, (b.stream, b.size, b.addr))
            b.gc_base = pool.get_free_blocks_calls
            if counting and b.es is None:  # the free neighbours are in it now; the block inactive split if it is one
                inactive.current += (b.size if b.prev is not None or b.next is not None else 0) - merged
                if inactive.current > inactive.peak:
                    inactive.peak = inactive.current
        return i + 1

    # ---- a copy to go on from ------------------------------------------------------------------
    def lean_copy(self, device: Device, live: dict) -> tuple[CachingAllocator, dict]:
        """A lean allocator (Stats.lean) on `device` in this one's state, and `live` (key -> block)
        on its blocks: a replay that went this far alike on both goes on there. Regular segments
        only (an expandable one's address range is sized by the device)."""
        if self.settings.expandable_segments or self._new_segment_addr != self._bump:
            raise ValueError("only an allocator of regular segments at its own addresses is copied")
        new = CachingAllocator(self.settings, device, lean=True)
        copy: dict[int, Block] = {}
        for b in self.blocks.values():
            c = copy[id(b)] = Block(b.addr, b.size, b.stream, b.small, mapped=b.mapped)
            c.requested, c.allocated, c.gc_base, c.tag = b.requested, b.allocated, b.gc_base, b.tag
        for b in self.blocks.values():
            c = copy[id(b)]
            c.prev = copy[id(b.prev)] if b.prev is not None else None
            c.next = copy[id(b.next)] if b.next is not None else None
        new.blocks = {addr: copy[id(b)] for addr, b in self.blocks.items()}
        new.segments = {addr: copy[id(b)] for addr, b in self.segments.items()}
        for mine, theirs in ((self.small, new.small), (self.large, new.large)):
            theirs.free, theirs.unmapped = list(mine.free), list(mine.unmapped)
            theirs.get_free_blocks_calls = mine.get_free_blocks_calls
        st, kept = self.stats, new.stats
        kept.reserved_bytes = _copied(st.reserved_bytes)  # what a lean one keeps
        kept.num_alloc_retries, kept.num_ooms = st.num_alloc_retries, st.num_ooms
        kept.num_device_alloc, kept.num_device_free = st.num_device_alloc, st.num_device_free
        new.total_allocated_memory, new._va = self.total_allocated_memory, self._va
        new.largest_granted, new.smallest_refused = self.largest_granted, self.smallest_refused
        return new, {k: copy[id(b)] for k, b in live.items()}

    # ---- OOM -----------------------------------------------------------------------------------
    def _oom(self, alloc_size: int, size: int) -> OutOfMemory:
        dev = self.device
        cap = dev.capacity if dev.capacity is not None else dev.total
        free = max(0, cap - self.total_allocated_memory)
        allocated = None if self.lean else self.stats.allocated_bytes.current  # (a lean replay does not count it)
        return OutOfMemory(alloc_size, size, dev.total, free, allocated, self.stats.reserved_bytes.current, dev.allowed)

    # ---- state for snapshots --------------------------------------------------------------------
    def segment_blocks(self):
        """(segment dict, [blocks in address order]) for every mapped range, as snapshots list them."""
        out = []
        for base in sorted(self.segments):
            first = self.segments[base]
            blocks, b = [], first
            while b is not None:
                blocks.append(b)
                b = b.next
            out.append(({"address": base, "stream": first.stream, "small": first.small,
                         "is_expandable": False}, blocks))
        for es in self.expandable.values():
            b = self.blocks.get(es.base)
            run: list[Block] = []
            while b is not None:
                if b.mapped:
                    run.append(b)
                elif run:
                    out.append(({"address": run[0].addr, "stream": es.stream, "small": es.small,
                                 "is_expandable": True}, run))
                    run = []
                b = b.next
            if run:
                out.append(({"address": run[0].addr, "stream": es.stream, "small": es.small,
                             "is_expandable": True}, run))
        return sorted(out, key=lambda sb: sb[0]["address"])
