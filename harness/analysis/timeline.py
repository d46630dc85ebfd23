"""A user's own snapshot: the peak's kind, the timeline's shape, and where the memory comes from."""

from __future__ import annotations

from collections import defaultdict

from harness.allocator import snapshot as snap
from harness.allocator.replay import replay_snapshot
from harness.analysis.kinds import SPIKE_SHARE, climbing


def _site(frames: list) -> str:
    """The allocation site people recognise: the first frame outside torch's own code."""
    for f in frames or []:
        name, filename = f.get("name", ""), f.get("filename", "")
        if filename.endswith(".py") and "/torch/" not in filename and "site-packages/torch" not in filename:
            return f"{name} ({filename.rsplit('/', 1)[-1]}:{f.get('line', 0)})"
    for f in frames or []:
        if f.get("filename", "").endswith(".py"):
            return f"{f.get('name', '')} ({f['filename'].rsplit('/', 1)[-1]}:{f.get('line', 0)})"
    return "<no stack recorded>"


def diagnose_snapshot(data: dict, top: int = 5) -> dict:
    """Kind and shape of a snapshot's trace, with the sites behind the peak and behind any growth."""
    dev = snap.device_of(data)
    trace = data["device_traces"][dev]
    state = snap.start_state(data, dev)
    replay = replay_snapshot(data)
    live: dict[int, tuple[int, str, int]] = {a: (size, "<allocated before recording>", -1)
                                             for a, (size, _req) in state.blocks.items()}
    allocated = sum(size for size, _s, _i in live.values())
    timeline: list[int] = []
    peak, peak_live = allocated, dict(live)
    for i, e in enumerate(trace):
        a = e.get("action")
        if a == "alloc":
            size = e["size"]
            live[e["addr"]] = (size, _site(e.get("frames")), i)
            allocated += size
            if allocated > peak:
                peak, peak_live = allocated, dict(live)
        elif a == "free_completed" and e["addr"] in live:
            allocated -= live.pop(e["addr"])[0]
        if a in ("alloc", "free_completed"):
            timeline.append(allocated)
    # Resident: what is alive at the peak and still alive when the trace ends (weights, optimizer
    # state); transient: what the step frees again (activations, temporaries).
    resident = sum(size for addr, (size, _s, born) in peak_live.items()
                   if addr in live and live[addr][2] == born)
    by_site: dict[str, int] = defaultdict(int)
    for size, site, _born in peak_live.values():
        by_site[site] += size
    sites = sorted(by_site.items(), key=lambda kv: -kv[1])[:top]
    shape, rests, growing = _shape(timeline, trace, state)
    frag = replay.fragmentation_at_peak_bytes
    if shape == "staircase":
        kind = "retained"
    elif frag > 0.1 * max(replay.peak_reserved_bytes, 1) and frag > peak - resident:
        kind = "fragmentation"
    elif resident >= peak / 2:
        kind = "static"
    else:
        kind = "activations"
    return {
        "kind": kind, "shape": shape, "rest_levels_bytes": rests,  # allocated at rest after each cycle
        "peak_requested_bytes": peak, "resident_at_peak_bytes": resident,
        "transient_at_peak_bytes": peak - resident,
        "peak_reserved_bytes": replay.peak_reserved_bytes, "fragmentation_bytes": frag,
        "peak_sites": [{"site": s, "bytes": b} for s, b in sites],
        "growing_sites": growing,
    }


def _shape(timeline: list[int], trace: list[dict], state) -> tuple[str, list[int], list]:
    """Cycles are rises and falls of at least half the timeline's amplitude (a step's activations
    built and freed). staircase: the rest level after each cycle climbs (two cycles at least);
    spike: memory rises well above its rest; plateau: it barely moves."""
    if len(timeline) < 8:
        return "unknown", [], []
    peak, floor = max(timeline), min(timeline)
    amplitude = peak - floor
    rests, hi, lo, falling = [timeline[0]], timeline[0], timeline[0], False
    for v in timeline:
        if not falling:
            hi = max(hi, v)
            if hi - v > amplitude / 2:
                falling, lo = True, v
        else:
            lo = min(lo, v)
            if v - lo > amplitude / 2:
                rests.append(lo)
                falling, hi = False, v
    if falling:
        rests.append(lo)
    # The same rules as a run's per-step readings (kinds.climbing, kinds.SPIKE_SHARE): the rest
    # levels after each cycle are allocated bytes at rest, exact in a snapshot as in a trace.
    if len(rests) >= 3 and climbing(rests, first=0):
        quarter = max(1, len(timeline) // 4)
        return "staircase", rests, _growing_sites(trace, quarter)
    if amplitude > SPIKE_SHARE * peak:
        return "spike", rests, []
    return "plateau", rests, []


def _growing_sites(trace: list[dict], quarter: int) -> list:
    """Sites whose live bytes rise from each quarter of the trace to the next."""
    live: dict[int, tuple[int, str]] = {}
    per_quarter: list[dict] = []
    events = 0
    for e in trace:
        a = e.get("action")
        if a == "alloc":
            live[e["addr"]] = (e["size"], _site(e.get("frames")))
        elif a == "free_completed":
            live.pop(e["addr"], None)
        if a in ("alloc", "free_completed"):
            events += 1
            if events % quarter == 0:
                totals: dict[str, int] = defaultdict(int)
                for size, site in live.values():
                    totals[site] += size
                per_quarter.append(totals)
    sites = set().union(*per_quarter) if per_quarter else set()
    out = []
    for s in sites:
        series = [q.get(s, 0) for q in per_quarter]
        if all(b > a for a, b in zip(series, series[1:])):
            out.append({"site": s, "bytes": series})
    return sorted(out, key=lambda d: -d["bytes"][-1])[:5]
