"""A point run as a job of N ranks: each rank's row in run_dir/rank<r>/, and the point's row made of
them. The worst rank decides: the rank that failed first, else the rank that reserved the most; a
card holds the job only where it holds every rank.

Which rank failed first is told by what each failure is: an OOM is the rank's own; a process that
died without a row (killed, crashed) comes next, since its peers then fail too ("connection reset by
peer" in their collectives); then an error, a timeout, a rank stopped for another's failure, and a
rank that left no row at all; among equals, the lowest rank."""

from __future__ import annotations

import json
from pathlib import Path

from harness.probe.sim.reserved import EDGES, edge_columns
from harness.record.row import CARD_RESERVED, cards_reserved, recorded_edge

RANK_RESULT_FILE = "rank_result.json"  # a rank's row: not result.json, for a sweep's rows are its points'
STOPPED = "stopped_for_rank"  # a rank row's key: the rank whose failure stopped this one
DIED = "worker_died"  # a rank row's key: its process ended without writing it (the supervisor did)


def rank_dir(run_dir: Path, rank: int) -> Path:
    return run_dir / f"rank{rank}"


def merge(base: dict, rows: dict[int, dict | None], missing: dict[int, str]) -> dict:
    """The point's row from its ranks' rows (`base`: the point's base_record; `rows`: rank -> its
    row, None where it wrote none; `missing`: why such a rank left none). Per-rank peaks ride along
    as lists, in rank order."""
    world_size = int(base["world_size"])
    failed = [(r, row) for r, row in rows.items() if row is not None and row.get("status") != "ok"]
    failed.sort(key=lambda rr: (_cause_order(rr[1]), rr[0]))
    if failed:
        rank, row = failed[0]
        out = {k: v for k, v in row.items() if k not in (STOPPED, DIED)}
        out["error"] = _on_rank(rank, world_size, row.get("error"))
    elif any(rows.get(r) is None for r in range(world_size)):
        rank = min(r for r in range(world_size) if rows.get(r) is None)
        out = dict(next((row for row in rows.values() if row is not None), base))
        out.update(status="error", error=_on_rank(rank, world_size, missing.get(rank, "left no row")),
                   fits_cards=[], tight_cards=[], retry_cards=[])
    else:
        done: dict[int, dict] = {r: row for r, row in rows.items() if row is not None}
        rank = max(done, key=lambda r: (int(done[r].get("peak_reserved_bytes") or 0), -r))
        out = dict(done[rank])
        out.update(_worst_edges(list(done.values())))
    out["rank"] = rank
    for col in ("peak_allocated_bytes", "peak_reserved_bytes"):
        out[f"rank_{col}"] = [None if rows.get(r) is None else rows[r].get(col) for r in range(world_size)]
    return out


def _cause_order(row: dict) -> int:
    """How likely a failed rank's row is the cause of the others' (0: surely its own)."""
    if row.get(STOPPED) is not None:
        return 4
    if row.get(DIED):
        return 1
    return {"oom": 0, "error": 2, "timeout": 3}.get(row["status"], 2)


def _on_rank(rank: int, world_size: int, error: str | None) -> str:
    return f"rank {rank} of {world_size}: {error}" if error else f"rank {rank} of {world_size}"


def _worst_edges(rows: list[dict]) -> dict:
    """Each card's edge as the rank that is worst off on it sees it."""
    edges = {key: max((recorded_edge(row, key) or "oom" for row in rows), key=EDGES.index)
             for key in rows[0].get("fits_cards") or []}  # a card rank 0 does not fit holds no rank's job
    # each card's reserved peak: the largest of any rank's, where a rank recorded its own for it
    own = [cards_reserved(row) for row in rows]
    peaks = {key: max(o.get(key, int(row["peak_reserved_bytes"])) for o, row in zip(own, rows, strict=True))
             for key in sorted(set().union(*own))}
    return {**edge_columns(edges), CARD_RESERVED: json.dumps(peaks) if peaks else None}
