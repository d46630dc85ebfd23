"""The fresh process one point runs in: `python -m harness.probe.worker <run_dir>`.

Reads run_dir/point.json, writes run_dir/result.json (always, on failure too) and the trace.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from pathlib import Path

from harness.record import base_record

TRACE_FILE = "trace.parquet"


def oom_point(events: list[tuple], capacity: int, non_pytorch: int) -> dict | None:
    """The first allocation after which allocated + non-PyTorch memory exceeds the card."""
    from harness.probe.tracker import round_request

    live, allocated = {}, 0
    for _seq, action, key, size, _kind, phase, step, module in events:
        if action == "alloc":
            b = round_request(size)
            live[key] = b
            allocated += b
            if allocated + non_pytorch > capacity:
                return {"oom_phase": phase, "oom_step": step, "oom_tried_bytes": b, "oom_module": module}
        else:
            allocated -= live.pop(key, 0)
    return None


def write_trace(events: list[tuple], path: Path) -> None:
    import pandas as pd

    cols = ["seq", "action", "key", "size", "kind", "phase", "step", "module"]
    from harness.probe.tracker import round_request

    df = pd.DataFrame(events, columns=cols)
    df["seq"] = range(len(df))  # dropped host-side allocations leave gaps
    # `size` is the requested bytes; `allocated` what the allocator's 512-B rounding hands out.
    df["allocated"] = [round_request(int(n)) for n in df["size"]]
    df.to_parquet(path, index=False)


def run_sim(point: dict, run_dir: Path) -> dict:
    import torch
    import transformers

    from harness.probe.sim import run_point

    t0 = time.perf_counter()
    m, tracker = run_point(point)
    rec = base_record(point)
    rec.update({k: v for k, v in m.items() if k in rec})
    gpu = point["gpu"]
    rec.update(
        status="ok", device_name=f"virtual {gpu['device_name']}", wall_s=time.perf_counter() - t0,
        torch_version=torch.__version__, transformers_version=transformers.__version__,
    )
    oom = oom_point(tracker.events, gpu["memory_bytes"], gpu["non_pytorch_bytes"])
    if oom is not None:
        rec.update(status="oom", oom_phase=oom["oom_phase"], oom_step=oom["oom_step"],
                   oom_tried_bytes=oom["oom_tried_bytes"])
    write_trace(tracker.events, run_dir / TRACE_FILE)
    rec["trace_path"] = str(run_dir / TRACE_FILE)
    return rec


def main(run_dir: Path) -> int:
    point = json.loads((run_dir / "point.json").read_text())
    try:
        if point["backend"] != "sim":
            raise NotImplementedError(f"backend '{point['backend']}' is not available yet; use backend=sim")
        rec = run_sim(point, run_dir)
    except Exception as e:
        rec = base_record(point)
        rec.update(status="error", error=f"{type(e).__name__}: {e}")
        (run_dir / "traceback.txt").write_text(traceback.format_exc())
    (run_dir / "result.json").write_text(json.dumps(rec, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
