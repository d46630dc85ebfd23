"""DDP's shallow journals, shared by a sweep's points that differ only in their replica count.

A DDP rank holds the whole model, its gradients and its optimizer state at any count, and all-reduces
the same buckets: less its setup's transient entries (ddp_setup.cut; the shape check over every
rank is what the count sizes), its journal at a few layers is the same over 2, 4 or 64 GPUs, and so
are its findings. So the first point of a DDP job keeps its shallow depths' journals and findings in
the trace cache, and a point of another count takes them instead of tracing them. Its own setup is
still traced at its depth (ddp_setup.splice), and its synthesis is checked as any other's (a
structure not checked yet is traced at a+2 on the point's own count).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from harness.config.point import AUTO_NODES, Point
from harness.probe.sim.tracker import TraceEvent
from harness.probe.sim.virtual_cuda import READS_CARD
from harness.record import trace_store


def _key(point: Point) -> str | None:
    """The point as any replica count of it (its trace identity at 2); None: not DDP alone."""
    p = point.parallel
    if p.dp_replicate == 1 or p.dp_shard > 1 or p.tp > 1:
        return None
    # (nodes and NCCL's memory are not in a trace's identity; as many nodes as the card needs for
    # 2: a node of RTX 4060s holds one) the depth is the caller's to name
    return trace_store.trace_id(point.replace(parallel=dataclasses.replace(p, dp_replicate=2, nodes=AUTO_NODES)))


def read(cache: Path | None, point: Point, depths: tuple[int, ...]) -> tuple[list[list[TraceEvent]], list, str] | None:
    """The journals (cut) and findings at `depths` of `point` as another count traced them, and
    which (for trace_method); None where none did (or `point` is not DDP)."""
    key = _key(point)
    note = trace_store.read_note(cache, trace_store.REPLICAS, f"{key}:{depths}") if key else None
    try:
        if note is None:
            return None
        journals = [[TraceEvent._make(e) for e in j] for j in note["journals"]]
        return journals, list(note["findings"]), f"as traced over {int(note['replicas'])} GPUs"
    except (KeyError, TypeError, ValueError):  # not a note of ours: traced anew
        return None


def write(cache: Path | None, point: Point, depths: tuple[int, ...], journals: list[list[TraceEvent]],
          findings: list[dict]) -> None:
    """Keep the journals (cut) and findings at `depths` for the job's other counts; a trace that
    read the card (its findings say so) is kept for its own point only."""
    key = _key(point)
    if key is None or any(f.get(READS_CARD) for f in findings):
        return
    trace_store.write_note(cache, trace_store.REPLICAS, f"{key}:{depths}", {
        "journals": [[list(e) for e in j] for j in journals], "findings": findings,
        "replicas": point.parallel.dp_replicate})
