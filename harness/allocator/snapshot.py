"""Memory snapshots (`torch.cuda.memory._dump_snapshot` pickles): read safely, rebuild the state at
the start of the trace, and write memory_viz-compatible snapshots from any replay."""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from pathlib import Path

from harness.allocator.model import K_SMALL_BUFFER, K_SMALL_SIZE, round_size

_PLAIN = (dict, list, tuple, str, int, float, bool, type(None), bytes)


class SnapshotError(ValueError):
    """A file that is not a usable snapshot; the message names the file."""


class _PlainUnpickler(pickle.Unpickler):
    """Builtins only: a snapshot is dicts, lists, strings and numbers. Anything that asks for a
    class or a function (which could run code) is refused."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"refused to load {module}.{name}: a snapshot holds plain data only")


def load(path: str | Path) -> dict:
    path = Path(path)
    try:
        with open(path, "rb") as f:
            data = _PlainUnpickler(f).load()
    except FileNotFoundError:
        raise SnapshotError(f"{path}: no such file")
    except OSError as e:  # a directory, a file it may not read
        raise SnapshotError(f"{path}: cannot read it ({e.strerror or type(e).__name__})")
    except pickle.UnpicklingError as e:
        raise SnapshotError(f"{path}: {e}" if "refused" in str(e) else f"{path}: not a snapshot pickle ({e})")
    except (EOFError, ValueError, TypeError, IndexError, KeyError, AttributeError, OverflowError) as e:
        raise SnapshotError(f"{path}: not a snapshot pickle (truncated or corrupt: {type(e).__name__})")
    if not isinstance(data, dict) or "segments" not in data:
        raise SnapshotError(f"{path}: not a memory snapshot (no 'segments'); write one with "
                            "torch.cuda.memory._dump_snapshot")
    traces = data.get("device_traces") or []
    if not any(traces):
        raise SnapshotError(f"{path}: the snapshot has no trace; record it with "
                            "torch.cuda.memory._record_memory_history(max_entries=...) before the work")
    return data


def device_of(data: dict) -> int:
    """The device whose trace to replay (the one with events)."""
    return max(range(len(data["device_traces"])), key=lambda d: len(data["device_traces"][d]))


@dataclass
class StartState:
    """The allocator's state when recording began: segments and the blocks alive in them."""

    segments: dict[int, tuple[int, bool, int]] = field(default_factory=dict)  # addr -> (size, small, stream)
    blocks: dict[int, tuple[int, int]] = field(default_factory=dict)  # addr -> (block size, requested)
    expandable: bool = False  # the segments are mapped ranges of expandable segments


def start_state(data: dict, device: int) -> StartState:
    """Walk the trace backwards from the final segments: what was allocated and reserved at its start."""
    trace = data["device_traces"][device]
    segs, small_of = {}, {}
    blocks: dict[int, tuple[int | None, int]] = {}
    freed_at: dict[int, int] = {}  # a block alive at the start -> the event that frees it
    for s in data["segments"]:
        if s.get("device", device) != device:
            continue
        segs[s["address"]] = (s["total_size"], s["stream"])
        small_of[s["address"]] = s.get("segment_type") == "small"
        for b in s["blocks"]:
            if b["state"] in ("active_allocated", "active_pending_free"):
                blocks[b["address"]] = (b["size"], b["requested_size"])
    for i in range(len(trace) - 1, -1, -1):
        e = trace[i]
        a = e.get("action")
        if a in ("segment_alloc", "segment_map"):
            segs.pop(e["addr"], None)
        elif a in ("segment_free", "segment_unmap"):
            segs[e["addr"]] = (e["size"], e["stream"])
        elif a == "alloc":
            blocks.pop(e["addr"], None)
            freed_at.pop(e["addr"], None)
        elif a == "free_completed":
            blocks[e["addr"]] = (None, e["size"])  # block size inferred below
            freed_at[e["addr"]] = i
    expandable = any(s.get("is_expandable") for s in data["segments"] if s.get("device", device) == device)
    remapped = any(e.get("action") in ("segment_map", "segment_unmap") for e in trace)
    if (expandable or remapped) and segs and remapped:
        raise SnapshotError("expandable segments mapped or unmapped memory during a recording that began with "
                            "memory in use: the state at its start cannot be rebuilt; record from before the "
                            "first CUDA allocation")
    state = StartState(expandable=expandable)
    for addr, (size, stream) in segs.items():
        small = small_of.get(addr, size == K_SMALL_BUFFER)
        state.segments[addr] = (size, small, stream)
    _block_sizes(state, blocks, _first_alloc_after(trace, freed_at))
    return state


def _first_alloc_after(trace: list, freed_at: dict[int, int]):
    """For a block alive at the start and freed during the trace: the address of the first
    allocation in (its address, limit) made before it is freed, or None."""
    import bisect

    allocs = sorted((e["addr"], i) for i, e in enumerate(trace) if e.get("action") == "alloc")
    addrs = [a for a, _ in allocs]

    def first(addr: int, limit: int) -> int | None:
        end = freed_at.get(addr)
        if end is None:
            return None
        lo, hi = bisect.bisect_right(addrs, addr), bisect.bisect_left(addrs, limit)
        found = [(i, a) for a, i in allocs[lo:hi] if i < end]
        return min(found)[1] if found else None
    return first


def _block_sizes(state: StartState, blocks: dict, first_alloc_after) -> None:
    """A block freed during the trace but allocated before it has only its requested size. Its
    block is the rounded request plus, in the large pool, the remainder it was handed unsplit
    (<= 1 MiB: such a remainder is never split off). That remainder ends where the free space
    after it began: where the first allocation into that space lands while the block still lives
    (best fit carves from a free block's start), else at the next block when it is that close."""
    bases = sorted(state.segments)
    addrs = sorted(blocks)
    import bisect

    for i, addr in enumerate(addrs):
        size, requested = blocks[addr]
        j = bisect.bisect_right(bases, addr) - 1
        if j < 0:
            continue
        base = bases[j]
        seg_size, small, _stream = state.segments[base]
        if addr >= base + seg_size:
            continue
        if size is None:
            size = round_size(requested)
            if not small:
                limit = base + seg_size
                if i + 1 < len(addrs) and addrs[i + 1] < limit:
                    limit = addrs[i + 1]
                landed = first_alloc_after(addr, limit)
                end = landed if landed is not None and landed - (addr + size) <= K_SMALL_SIZE else limit
                tail = end - (addr + size)
                if 0 < tail <= K_SMALL_SIZE:
                    size += tail
        state.blocks[addr] = (size, requested)


def requests(data: dict, device: int) -> list[tuple]:
    """The program's requests in order: ("alloc", addr, size, stream), ("free", addr), and
    ("empty_cache", [segment addrs freed]) for a run of segment_free events; plus what the
    recording decided, for checking: ("segment", addr, size) before the alloc it served."""
    out: list[tuple] = []
    freed: list[tuple] = []
    for e in data["device_traces"][device]:
        a = e.get("action")
        if a in ("segment_free", "segment_unmap"):
            freed.append((e["addr"], e["size"]))
            continue
        if freed:
            out.append(("empty_cache", freed))
            freed = []
        if a == "alloc":
            out.append(("alloc", e["addr"], e["size"], e.get("stream", 0)))
        elif a == "free_completed":
            out.append(("free", e["addr"]))
        elif a in ("segment_alloc", "segment_map"):
            out.append(("segment", e["addr"], e["size"]))
        elif a == "oom":
            out.append(("oom", e.get("size", 0)))
    if freed:
        out.append(("empty_cache", freed))
    return out


def write(path: Path, allocator, trace: list[dict], device: int = 0) -> Path:
    """A snapshot memory_viz reads: the allocator's segments now, and `trace` as device_traces."""
    with open(path, "wb") as f:
        pickle.dump(as_dict(allocator, trace, device), f)
    return path


def as_dict(allocator, trace: list[dict], device: int = 0) -> dict:
    """What torch.cuda.memory._snapshot() returns, for the model's allocator and `trace`."""
    segments = []
    for seg, blocks in allocator.segment_blocks():
        total = sum(b.size for b in blocks)
        out_blocks = []
        for b in blocks:
            frames = [{"name": str(b.tag or ""), "filename": "harness", "line": 0}] if b.tag else []
            out_blocks.append({
                "address": b.addr, "size": b.size, "requested_size": b.requested if b.allocated else 0,
                "state": "active_allocated" if b.allocated else "inactive", "frames": frames,
            })
        allocated = sum(b.size for b in blocks if b.allocated)
        segments.append({
            "device": device, "address": seg["address"], "total_size": total,
            "allocated_size": allocated, "active_size": allocated,
            "requested_size": sum(b.requested for b in blocks if b.allocated), "stream": seg["stream"],
            "segment_type": "small" if seg["small"] else "large", "segment_pool_id": (0, 0),
            "is_expandable": seg["is_expandable"], "frames": [], "blocks": out_blocks,
        })
    return {"segments": segments, "device_traces": [trace], "allocator_settings": allocator.settings.snapshot_dict()}
