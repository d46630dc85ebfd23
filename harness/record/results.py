"""Rows from result.json files -> one DataFrame -> results.parquet (+ results.csv) per sweep dir."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from harness.record import provenance
from harness.record.provenance import USER_CODE
from harness.record.row import COLUMNS, RESULT_FILE

_REUSABLE = ("ok", "oom")  # rows a re-run takes over; errors and timeouts run again


def load_rows(path: Path) -> list[dict]:
    """Rows under a sweep dir, a run dir, or one result.json (partial sweeps welcome)."""
    path = Path(path)
    if path.is_file():
        files = [path]
    else:
        files = sorted(path.glob(f"**/{RESULT_FILE}"))
    rows = []
    for f in files:
        try:
            rows.append(json.loads(f.read_text()))
        except (OSError, json.JSONDecodeError) as e:
            rows.append({"status": "error", "error": f"unreadable {f}: {e}"})
    return rows


def to_frame(rows: list[dict]) -> pd.DataFrame:
    """Rows as one frame: every column of the record, in its order, then any extra ones."""
    df = pd.DataFrame(rows)
    for col in COLUMNS:
        if col not in df.columns:
            df[col] = None
    df = df[list(COLUMNS) + [c for c in df.columns if c not in COLUMNS]]
    sort = ["model", "workload", "precision", "checkpointing", "batch_size", "seq_len"]
    return df.sort_values(sort, na_position="last", kind="stable").reset_index(drop=True)


def write(df: pd.DataFrame, sweep_dir: Path) -> Path:
    """results.parquet (the source of truth) and results.csv (for people) in `sweep_dir`."""
    sweep_dir = Path(sweep_dir)
    out = sweep_dir / "results.parquet"
    df.to_parquet(out, index=False)
    df.to_csv(sweep_dir / "results.csv", index=False)
    return out


FRONTIER_FILE = "frontier.parquet"


def write_frontier(fr: pd.DataFrame, plan_dir: Path) -> Path:
    out = Path(plan_dir) / FRONTIER_FILE
    fr.to_parquet(out, index=False)
    fr.to_csv(out.with_suffix(".csv"), index=False)
    return out


def load_frontier(plan_dir: Path) -> pd.DataFrame | None:
    """The frontiers of a `plan` run, if `plan_dir` is one."""
    path = Path(plan_dir) / FRONTIER_FILE
    return pd.read_parquet(path) if path.exists() else None


def find_done(results_dir: Path, sweep: str, rid: str, exclude: Path) -> Path | None:
    """A finished row with the same run_id from an earlier run of this sweep, if any."""
    for path in sorted((results_dir / sweep).glob(f"*/runs/*/{RESULT_FILE}"), reverse=True):
        if path.parent == exclude:
            continue
        try:
            rec = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        # the same knobs, but the user's code it loaded has changed since: stale, run it again
        if rec.get("run_id") == rid and rec.get("status") in _REUSABLE and not provenance.changed(rec.get(USER_CODE)):
            return path
    return None
