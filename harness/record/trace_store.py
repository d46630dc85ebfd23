"""Event traces on disk: written next to each record, and shared across points that differ only in
allocator settings or card (one trace serves every setting and every card: only the replay changes)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the tracker imports torch; a trace file does not need it. Nor pandas a trace's id (the launcher)
    import pandas as pd

    from harness.probe.sim.tracker import TraceEvent

from harness.allocator.model import K_MIN_BLOCK
from harness.allocator.replay import EventTag, ReplayRow
from harness.config import attention, cublas, kernels
from harness.config.attention import FUSED_PREFIX
from harness.config.point import Card, Point
from harness.record import provenance
from harness.record.provenance import USER_CODE
from harness.record.row import point_identity

TRACE_FILE = "trace.parquet"
MEASUREMENTS_FILE = "measurements.json"
COLUMNS = ["seq", "action", "key", "size", "kind", "phase", "step", "module", "stream", "kernel"]


def trace_id(point: Point, reads_card: bool = False, attending: str | None = None) -> str:
    """Everything that shapes the trace (the versions of torch, transformers and harness included);
    allocator settings and the card do not, but for its attention kernels (config.attention's class
    `attending`: None, the point's card's; "", none, for a job that makes no attention call) -
    unless the job read them (`reads_card`: its step asked torch.cuda about the card or its memory,
    and may have done otherwise on another)."""
    ident = point_identity(point)
    # the nodes a rank is on change neither its trace nor its replay; NCCL's memory its replay only,
    # but for a job that read the card's free memory
    unshaping = ("nodes",) if reads_card else ("nodes", "nccl_bytes_per_communicator")
    if "parallel" in ident:
        ident["parallel"] = {k: v for k, v in ident["parallel"].items() if k not in unshaping}
    if not reads_card:
        for replay_only in ("allocator_conf", "gpu", "gpu_memory_bytes", "card"):
            del ident[replay_only]
        ident["cublas_workspace"] = cublas.workspace_bytes(point.gpu.capability)  # the card's (config.cublas)
        attending = attention.attention_class(point.gpu.capability) if attending is None else attending
        if attending:  # the attention kernels it takes: cards of one class share a trace
            ident["attention"] = attending
    blob = json.dumps(ident, sort_keys=True, default=str)
    return hashlib.sha1(blob.encode()).hexdigest()[:16]


def apart_path(trace_path: Path, card_key: str) -> Path:
    """Where a row's trace for catalog card `card_key` lies, beside its own, where that card takes
    other attention kernels (probe.worker judges it by a trace of its own)."""
    return trace_path.with_name(f"trace-{card_key}.parquet")


def to_frame(events: list[TraceEvent]) -> pd.DataFrame:
    import pandas as pd
    import pyarrow as pa

    # column by column through arrow: 0.57x the time of pandas reading the rows (inferring its five
    # string columns row by row: ~25 of 32 ms for a 7B point's 24k events), the same frame
    columns = list(zip(*events, strict=True)) if events else [() for _ in COLUMNS]
    try:
        df = pa.table({c: pa.array(v) for c, v in zip(COLUMNS, columns, strict=True)}).to_pandas()
    except pa.ArrowException:  # a column of mixed types: pandas makes it an object column
        df = pd.DataFrame(events, columns=COLUMNS)
    df["seq"] = range(len(df))  # dropped host-side allocations leave gaps
    # `size` is the requested bytes; `allocated` what the allocator's 512-B rounding hands out
    # (allocator.model.round_plain, on the whole column at once)
    df["allocated"] = _allocated(df["size"].astype("int64"))
    return df


def events(df: pd.DataFrame) -> list[TraceEvent]:
    """A trace's frame as the tracker's events (to_frame's inverse, but for `seq`'s gaps)."""
    from harness.probe.sim.tracker import TraceEvent

    # column lists, not itertuples: a 30k-row trace in 15 ms rather than 110
    return list(map(TraceEvent._make, zip(*(df[c].tolist() for c in COLUMNS), strict=True)))


def storages_peak(df: pd.DataFrame) -> int:
    """The most bytes the trace's storages held at once, as the allocator rounds each (the
    tracker's peak_allocated_bytes for the trace it wrote)."""
    signed = df["allocated"].where(df["action"] == "alloc", -df["allocated"])
    return int(signed.cumsum().max()) if len(df) else 0


def _allocated(size: pd.Series) -> pd.Series:
    # (probe.sim.tracker.counted, on the whole column: 0 B, a launch's placeholder, counts none)
    return ((size + (K_MIN_BLOCK - 1)) // K_MIN_BLOCK * K_MIN_BLOCK).clip(lower=K_MIN_BLOCK).where(size > 0, 0)


def kernel_codes(df: pd.DataFrame) -> dict[str, int]:
    """The trace's kernel scratch whose bytes depend on the card (config.kernels): each launch's
    code and its bytes on the card traced. Empty for a trace without (or before the column)."""
    marked = _sized_by_card(df)
    return dict(zip(marked["kernel"].tolist(), marked["size"].astype("int64").tolist()))


def _sized_by_card(df: pd.DataFrame) -> pd.DataFrame:
    """The rows of kernel scratch whose bytes follow the card's SMs (a fused attention kernel's rows
    carry codes too: config.attention.FUSED_PREFIX; and FSDP2's copy-in table, the same on every
    card: config.kernels.CHUNK_CAT_PREFIX)."""
    if "kernel" not in df:
        return df.iloc[:0]
    return df[(df["kernel"] != "") & ~df["kernel"].str.startswith((FUSED_PREFIX, kernels.CHUNK_CAT_PREFIX))]


def scratch_keys(df: pd.DataFrame) -> dict:
    """Each kernel scratch storage's key and its launch's code (kernel_codes)."""
    marked = _sized_by_card(df)
    return dict(zip(marked["key"].tolist(), marked["kernel"].tolist()))


def kernel_sizes(codes: dict[str, int], card: Card) -> dict[str, int]:
    """Each of `codes`' (kernel_codes) bytes on `card` (0: its launch makes none there)."""
    g = kernels.geometry(card)
    return {c: kernels.scratch_bytes(c, g) for c in codes}


def sized_for(df: pd.DataFrame, card: Card) -> pd.DataFrame:
    """The trace as `card` runs it: each kernel's card-dependent scratch its bytes there, and gone
    (its alloc and free) where that card's launch makes none."""
    codes = kernel_codes(df)
    sizes = kernel_sizes(codes, card)
    if sizes == codes:
        return df
    # its alloc's and free's rows by key (scratch keys are the tracker's own, never another storage's)
    by_key = {k: sizes[c] for k, c in scratch_keys(df).items()}
    rows = df["key"].isin(by_key.keys())
    out = df.copy()
    out.loc[rows, "size"] = out["key"][rows].map(by_key)
    gone = [k for k, n in by_key.items() if n == 0]
    if gone:
        out = out[~out["key"].isin(gone)]
    out["allocated"] = _allocated(out["size"].astype("int64"))
    return out


def replay_rows(df: pd.DataFrame, placeholders: bool = False) -> list[ReplayRow]:
    """The trace as the allocator model's requests, each tagged with where it happened; a launch's
    placeholder (0 B: made on other cards only, kernel_scratch) only where `placeholders`."""
    if not placeholders and "size" in df and (df["size"] == 0).any():
        df = df[df["size"] != 0]
    # Python lists, not Series: iterating a Series boxes every value (seconds for a 100k-event trace)
    cols = {c: df[c].tolist() for c in ("phase", "step", "module", "kind", "action", "key")}
    streams = df["stream"].astype("int64").tolist() if "stream" in df else [0] * len(df)  # (one stream before)
    return _rows(cols["action"], cols["key"], df["size"].astype("int64").tolist(), cols["phase"], cols["step"],
                 cols["module"], cols["kind"], streams)


def replay_rows_of(events: list[TraceEvent]) -> list[ReplayRow]:
    """replay_rows(to_frame(events), placeholders=True), without the frame (its columns read back
    cost a 70B rank's 92k rows 0.07 s)."""
    if not events:
        return []
    _seq, action, key, size, kind, phase, step, module, stream, _kernel = zip(*events, strict=True)
    return _rows(action, key, size, phase, step, module, kind, stream)


def _rows(action, key, size, phase, step, module, kind, stream) -> list[ReplayRow]:
    # One tag per distinct place (a few hundred in a trace of tens of thousands of events)
    places: dict[tuple, EventTag] = {}
    tags = (places.get(p) or places.setdefault(p, EventTag._make(p)) for p in zip(phase, step, module, kind))
    return list(map(ReplayRow._make, zip(action, key, size, tags, stream)))


def _is_workspace(r: ReplayRow) -> bool:
    return r.action == "alloc" and r.tag is not None and r.tag.kind == "workspace"


def with_workspaces(rows: list[ReplayRow], nbytes: int) -> list[ReplayRow]:
    """The trace's rows with each cuBLAS workspace `nbytes` (another card's: config.cublas)."""
    return [r._replace(size=nbytes) if _is_workspace(r) else r for r in rows]


def workspace_rows(rows: list[ReplayRow]) -> list[int]:
    """Where the trace's rows allocate a cuBLAS workspace (with_workspaces' rows)."""
    return [i for i, r in enumerate(rows) if _is_workspace(r)]


def cached(cache_dir: Path | None, tid: str) -> bool:
    """Whether the cache holds a trace under `tid` (load_cached still checks it is current)."""
    return cache_dir is not None and (Path(cache_dir) / tid / MEASUREMENTS_FILE).exists()


def load_cached(cache_dir: Path | None, tid: str) -> tuple[pd.DataFrame, dict] | None:
    if cache_dir is None:
        return None
    d = Path(cache_dir) / tid
    try:
        measurements = json.loads((d / MEASUREMENTS_FILE).read_text())
        if provenance.changed(measurements.get(USER_CODE)):
            return None  # traced from user code that has been edited since
        import pandas as pd

        return pd.read_parquet(d / TRACE_FILE), measurements
    except (OSError, ValueError):
        return None


def save_cached(cache_dir: Path | None, tid: str, trace_path: Path, measurements: dict) -> None:
    """Publish atomically: a point running in parallel sees all of it or nothing."""
    if cache_dir is None:
        return
    final = Path(cache_dir) / tid
    if final.exists():
        try:
            stale = bool(provenance.changed(json.loads((final / MEASUREMENTS_FILE).read_text()).get(USER_CODE)))
        except (OSError, ValueError):
            stale = True
        if not stale:
            return
        shutil.rmtree(final, ignore_errors=True)  # its user code was edited: this trace replaces it
    tmp = Path(cache_dir) / f".{tid}.{os.getpid()}"
    tmp.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(trace_path, tmp / TRACE_FILE)
    (tmp / MEASUREMENTS_FILE).write_text(json.dumps(measurements, default=str))
    try:
        tmp.rename(final)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)  # another point published it first


# What probe.sim.shortcut learned about a preset's repeating layers, shared by the sweep's points:
# "checked" (by the template's structure) names the point its synthesis was checked on; "layouts"
# (by the shallowest journal's skeleton) holds where the new layer sits and how the deeper journal
# is made of the shallower (repeat.recipe), for a point of the same skeleton to skip tracing the
# deeper depth; "replicas" (by a DDP job's trace identity at any count) its shallow journals and
# their findings, for its other replica counts (probe.sim.replicas); "shard_counts" (by an FSDP2
# job's) those of each count traced, for its other shard counts (probe.sim.shard_counts). One JSON
# file per key (a layout: an entry per journal entry, ~100-150 KB for 7B).
CHECKED, LAYOUTS, REPLICAS, SHARD_COUNTS = "checked", "layouts", "replicas", "shard_counts"


def _note_file(cache_dir: Path, kind: str, key: str) -> Path:
    # the code that learned and synthesized it is part of what was checked
    digest = hashlib.sha1(f"{key}:{sorted(provenance.versions().items())}".encode()).hexdigest()[:16]
    return Path(cache_dir) / kind / f"{digest}.json"


def read_note(cache_dir: Path | None, kind: str, key: str) -> dict | None:
    """The note of `kind` under `key` (None: none yet, or no cache)."""
    if cache_dir is None:
        return None
    try:
        found = json.loads(_note_file(cache_dir, kind, key).read_text())
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None


def write_note(cache_dir: Path | None, kind: str, key: str, note: dict) -> None:
    if cache_dir is None:
        return
    path = _note_file(cache_dir, kind, key)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(note))
    os.replace(tmp, path)  # atomic: a point reading it in parallel sees all of it or nothing
