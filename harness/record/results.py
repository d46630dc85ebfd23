"""Rows from result.json files -> one DataFrame -> results.parquet (+ results.csv) per sweep dir."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from harness.config import cards as catalog
from harness.record import provenance
from harness.record.provenance import USER_CODE
from harness.record.row import COLUMNS, RESULT_FILE, base_record, run_id

if TYPE_CHECKING:  # pandas where rows become a table: the launcher, which reads rows one by one, does not import it
    import pandas as pd

_REUSABLE = ("ok", "oom")  # rows a re-run takes over; errors and timeouts run again


def is_json(path: Path) -> bool:
    """Whether the file holds JSON (a result.json does; an OOM message, a grid file do not)."""
    try:
        json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    return True


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


def has_rows(path: Path) -> bool:
    """Whether load_rows finds any under the directory `path` (the first result.json found: none read)."""
    return next(Path(path).glob(f"**/{RESULT_FILE}"), None) is not None


MANIFEST_FILE = "points.json"  # every point a sweep was asked for, written before any runs


def manifest_entry(point, overrides: list[str], run_dir: str) -> dict:
    """What a sweep's manifest keeps of a point: its run_id, the overrides that name it, its run
    dir (relative to the sweep's), and the fields a verdict compares (analysis.verdict) for a point
    that may never get a row."""
    rec = base_record(point)
    fields = {k: rec[k] for k in ("model", "workload", "seq_len", "batch_size", "precision", "checkpointing",
                                  "checkpointing_policy", "optimizer", "optimizer_impl", "allocator_conf", "leak", "gpu",
                                  "workload_target", "workload_args")}
    return {"run_id": run_id(point), "overrides": [o for o in overrides if not o.startswith("hydra")],
            "dir": run_dir, **fields}


def write_manifest(sweep_dir: Path, entries: list[dict]) -> None:
    sweep_dir.mkdir(parents=True, exist_ok=True)
    (sweep_dir / MANIFEST_FILE).write_text(json.dumps(entries, indent=1, default=str))


def missing_points(path: Path, rows: list[dict]) -> list[dict] | None:
    """The manifest's points that have no row under `path` (None: no manifest, e.g. a plan): none
    of its run_id, nor one in its run dir (a row names the code that made it: harness edited while
    the sweep ran gives the point's row another run_id than the manifest's)."""
    manifest = Path(path) / MANIFEST_FILE
    try:
        entries = json.loads(manifest.read_text())
    except (OSError, ValueError):
        return None
    have = {r.get("run_id") for r in rows}
    return [e for e in entries if e["run_id"] not in have
            and not ("dir" in e and (Path(path) / e["dir"] / RESULT_FILE).is_file())]


def to_frame(rows: list[dict]) -> pd.DataFrame:
    """Rows as one frame: every column of the record, in its order, then any extra ones."""
    import pandas as pd

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
    import pandas as pd

    path = Path(plan_dir) / FRONTIER_FILE
    return pd.read_parquet(path) if path.exists() else None


def find_done(results_dir: Path, sweep: str, rid: str, exclude: Path) -> Path | None:
    """A finished row with the same run_id from an earlier run of this sweep, if any."""
    return done_rows(results_dir, sweep, exclude, only=rid).get(rid)


def done_rows(results_dir: Path, sweep: str, exclude: Path, only: str | None = None) -> dict[str, Path]:
    """run_id -> the newest reusable row of it in earlier runs of this sweep (not under `exclude`):
    one pass over the rows for a whole sweep's points. `only`: that run_id's alone."""
    found: dict[str, Path] = {}
    judged_against = catalog.digest()
    for path in sorted((results_dir / sweep).glob(f"*/runs/*/{RESULT_FILE}"), reverse=True):
        if path.parent == exclude or path.parent.parent.parent == exclude:
            continue
        try:
            rec = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        rid = rec.get("run_id")
        if rid in found or (only is not None and rid != only):
            continue
        # the same knobs, but the user's code it loaded has changed since, or the catalog its fit
        # verdicts were judged against (calibrate measured a card): stale, run it again (its trace
        # is still in the sweep's trace cache, unless the user's code changed)
        if rec.get("status") in _REUSABLE and not provenance.changed(rec.get(USER_CODE)) \
                and rec.get("catalog_sha") == judged_against:
            found[rid] = path
            if only is not None:
                break
    return found


def judged_elsewhere(df: pd.DataFrame) -> list[str]:
    """The run_ids of rows whose fit verdicts were judged against a card catalog other than today's
    (`catalog_sha`: calibrate has measured a card since, or the catalog's figures changed): their
    fits and verdicts are that catalog's. A row without it (an error, an older harness's) is left out."""
    if "catalog_sha" not in df:
        return []
    sha = df["catalog_sha"]
    return df.loc[sha.notna() & (sha != catalog.digest()), "run_id"].tolist()
