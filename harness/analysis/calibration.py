"""How far the virtual GPU can be trusted: its prediction of a point beside the same point measured
on a card. Errors are relative to the measurement: (predicted - measured) / measured."""

from __future__ import annotations

import pandas as pd

# The bar (DEVELOPERS.md, issue 4): allocated within 1% of a real CUDA run, reserved within 5%.
ALLOCATED_TARGET = 0.01
RESERVED_TARGET = 0.05

_POINT = ("model", "workload", "precision", "checkpointing", "checkpointing_policy", "optimizer", "batch_size", "seq_len",
          "allocator_conf", "gpu")


def _error(predicted, measured) -> float | None:
    if predicted is None or measured is None or pd.isna(predicted) or pd.isna(measured) or not measured:
        return None
    return (float(predicted) - float(measured)) / float(measured)


def compare(pairs: list[tuple[dict, dict]]) -> pd.DataFrame:
    """One row per point from (sim row, cuda row) pairs. Peaks are compared where both runs
    finished (an OOM row's peak is how far it got, not what it needed); statuses always."""
    out = []
    for sim, cuda in pairs:
        row = {k: cuda.get(k, sim.get(k)) for k in _POINT}
        row.update(sim_run_id=sim.get("run_id"), cuda_run_id=cuda.get("run_id"), device_name=cuda.get("device_name"),
                   predicted_status=sim.get("status"), measured_status=cuda.get("status"),
                   status_agrees=sim.get("status") == cuda.get("status"))
        both_ok = sim.get("status") == cuda.get("status") == "ok"
        for what in ("allocated", "reserved"):
            pred, meas = sim.get(f"peak_{what}_bytes"), cuda.get(f"peak_{what}_bytes")
            row[f"predicted_{what}_bytes"], row[f"measured_{what}_bytes"] = pred, meas
            row[f"{what}_error"] = _error(pred, meas) if both_ok else None
        row["within_target"] = (both_ok and row["allocated_error"] is not None and row["reserved_error"] is not None
                                and abs(row["allocated_error"]) <= ALLOCATED_TARGET
                                and abs(row["reserved_error"]) <= RESERVED_TARGET)
        row.update(step_time_s=cuda.get("step_time_s"), tokens_per_s=cuda.get("tokens_per_s"),
                   error=cuda.get("error") or sim.get("error"))
        out.append(row)
    return pd.DataFrame(out)


def summary(df: pd.DataFrame) -> dict:
    """The figures for a note: how many points, the worst errors, how many within the targets."""
    ok = df.dropna(subset=["allocated_error", "reserved_error"])
    return {
        "points": len(df),
        "compared": len(ok),
        "status_agrees": int(df["status_agrees"].sum()) if len(df) else 0,
        "within_target": int(df["within_target"].sum()) if len(df) else 0,
        "max_abs_allocated_error": float(ok["allocated_error"].abs().max()) if len(ok) else None,
        "max_abs_reserved_error": float(ok["reserved_error"].abs().max()) if len(ok) else None,
    }
