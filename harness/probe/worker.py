"""The fresh process one point runs in: `python -m harness.probe.worker <run_dir>`.

Reads run_dir/point.json, writes run_dir/result.json (always, on failure too) and the trace.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from pathlib import Path

from harness.allocator.settings import AllocSettings
from harness.config import cards as catalog
from harness.config import nccl
from harness.config.point import Point, WorkloadName
from harness.probe.cuda import run as cuda
from harness.probe.jobs import UserCodeError
from harness.probe.sim import reserved, shortcut
from harness.probe.sim.fake_code import where
from harness.probe.sim.trace import collector
from harness.probe.sim.virtual_cuda import READS_CARD
from harness.record import provenance, trace_store
from harness.record.provenance import USER_CODE
from harness.record.row import POINT_FILE, base_record, write_row


def run_sim(point: Point, run_dir: Path) -> dict:
    """Trace the point (or reuse the trace of a point that differs only in allocator or card),
    then replay it through the allocator model for reserved bytes and each card's verdict. The
    collector is off but while tracing (trace.collector: the rows and replays made here)."""
    with collector(on=False):
        return _run_sim(point, run_dir)


def _run_sim(point: Point, run_dir: Path) -> dict:
    import torch
    import transformers

    t0 = time.perf_counter()
    # A trace that read the card is kept for that card and allocator setting only.
    tid, own = trace_store.trace_id(point), trace_store.trace_id(point, reads_card=True)
    cache = Path(point.trace_cache) if point.trace_cache else None
    trace_path = run_dir / trace_store.TRACE_FILE
    reused = next((key for key in (own, tid) if trace_store.cached(cache, key)), None)
    cached = trace_store.load_cached(cache, reused) if reused else None
    rec = base_record(point)
    if cached is not None:
        df, m = cached
        df.to_parquet(trace_path, index=False)
        rec["trace_reused"] = reused
    else:
        traced = shortcut.trace(point)  # a preset synthesized from a few layers where that is exact
        m = {k: v for k, v in traced.measurements.items() if k in rec}
        if point.workload.name == WorkloadName.custom:  # what the job loaded to build and step
            m[USER_CODE] = provenance.as_column(provenance.user_modules())
        df = trace_store.to_frame(traced.events)
        df.to_parquet(trace_path, index=False)
        trace_store.save_cached(cache, own if traced.findings.get(READS_CARD) else tid, trace_path, m)
    rec.update(m)
    rec["peak_tensor_bytes"] = m["peak_allocated_bytes"]  # storages rounded to 512 B (the tracker)
    gpu = point.gpu
    rec.update(status="ok", device_name=f"virtual {gpu.device_name}", trace_path=str(trace_path),
               torch_version=torch.__version__, transformers_version=transformers.__version__)
    settings = AllocSettings.from_conf(point.allocator.conf)
    snapshot = run_dir / "snapshot.pickle" if point.snapshot else None
    # Each card as one of the job's GPUs sees it: NCCL's memory beside the CUDA context's
    rec.update(reserved.analyse(trace_store.replay_rows(df), settings, nccl.on_rank(gpu, point.parallel),
                                [nccl.on_rank(c, point.parallel) for c in catalog.cards()], torch.__version__,
                                snapshot))
    rec["wall_s"] = time.perf_counter() - t0
    return rec


def run_cuda(point: Point, run_dir: Path) -> dict:
    """Measure the point on this process's GPU; each card's verdict from the measured peaks."""
    import transformers

    t0 = time.perf_counter()
    rec = base_record(point)
    rec.update(cuda.run_cuda(point, run_dir), transformers_version=transformers.__version__)
    if point.workload.name == WorkloadName.custom:
        rec[USER_CODE] = provenance.as_column(provenance.user_modules())
    if rec["status"] == "ok":
        # Measured reserved within a card's room settles it; between allocated and reserved only a
        # replay could tell, and a cuda run has no trace: counted as not fitting. The card it ran
        # on held it, flushing its cache where it retried.
        def fits_on(c):
            return bool(reserved.fits_by_numbers(c, rec["peak_reserved_bytes"], rec["peak_allocated_bytes"]))

        def edge(c):
            if c.name == point.gpu.name:
                return "after_retry" if rec.get("num_alloc_retries") else "room"
            return reserved.edge(fits_on, rec["peak_reserved_bytes"], c)

        rec.update(reserved.edge_columns({c.key: edge(c) for c in catalog.cards()}))
    else:  # how much it needed is unknown past the OOM: no card is known to hold it
        rec.update(fits_cards=[], tight_cards=[], retry_cards=[])
    rec["wall_s"] = time.perf_counter() - t0
    return rec


def main(run_dir: Path) -> int:
    point = Point.from_dict(json.loads((run_dir / POINT_FILE).read_text()))
    try:
        rec = run_cuda(point, run_dir) if point.backend == "cuda" else run_sim(point, run_dir)
    except Exception as e:
        rec = base_record(point)
        # the user's file and line first, where the error came through their code
        at = where(e) if point.workload.name == WorkloadName.custom and not isinstance(e, UserCodeError) else None
        rec.update(status="error", error=f"{at + ': ' if at else ''}{type(e).__name__}: {e}")
        (run_dir / "traceback.txt").write_text(traceback.format_exc())
    write_row(run_dir, rec)
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
