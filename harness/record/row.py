"""The record: one row per run, raw bytes, PyTorch's allocator vocabulary for names."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

STATUSES = ("ok", "oom", "error", "timeout")
RESULT_FILE = "result.json"  # one row per run dir

# Every column a row carries (DESIGN.md "The record"); absent values are None.
COLUMNS = (
    "run_id", "sweep", "status", "error", "backend", "device_name", "gpu", "gpu_memory_bytes",
    "gpu_non_pytorch_bytes", "emulated_gpu", "model", "n_params", "workload", "leak", "batch_size", "seq_len",
    "precision", "optimizer", "optimizer_impl", "checkpointing", "allocator_conf",
    "peak_allocated_bytes", "peak_reserved_bytes", "peak_requested_bytes", "peak_tensor_bytes", "params_bytes",
    "grads_bytes", "optimizer_bytes", "activations_bytes", "temporaries_bytes", "workspace_bytes",
    "peak_step", "peak_phase", "peak_module", "step_allocated_bytes", "step_peak_bytes",
    "peak_inactive_split_bytes", "fragmentation_bytes", "fits_cards", "retained_bytes", "retained_holder",
    "num_alloc_retries", "num_ooms", "oom_phase", "oom_step", "oom_module", "oom_tried_bytes", "oom_message",
    # cuda only: the OOM message's own numbers, the device, per-step reserved and times
    "oom_allocated_bytes", "oom_reserved_bytes", "oom_capacity_bytes", "oom_free_bytes", "oom_allowed_bytes",
    "oom_verdict", "device_memory_bytes", "measured_non_pytorch_bytes", "step_reserved_bytes", "step_times_s",
    "step_time_s", "tokens_per_s", "wall_s", "torch_version", "transformers_version",
    "harness_version", "workload_target", "workload_args",
    "trace_path", "trace_reused", "snapshot_path", "reused_from", "overrides", "job_id",
)


def point_identity(point: dict) -> dict:
    """What defines a run: everything that can change its numbers or its status."""
    ident = {
        "model": point["model"], "workload": point["workload"], "batch_size": point["batch_size"],
        "seq_len": point["seq_len"], "precision": point["precision"], "optimizer": point["optimizer"],
        "checkpointing": point["checkpointing"], "allocator_conf": point["allocator"]["conf"],
        "backend": point["backend"], "gpu": point["gpu"]["name"],
        "gpu_memory_bytes": point["gpu"]["memory_bytes"],
    }
    if point["workload"]["name"] == "custom":  # the user's job is its build function and its keys
        ident["target"] = point["workload"]["target"]
        ident["args"] = point["workload"].get("args") or {}
        ident["source_sha"] = point["workload"].get("source_sha")
    return ident


def run_id(point: dict) -> str:
    blob = json.dumps(point_identity(point), sort_keys=True, default=str)
    return hashlib.sha1(blob.encode()).hexdigest()[:12]


def base_record(point: dict) -> dict:
    """The row's identity columns, filled before anything runs (so a failure is still a row)."""
    import harness

    rec = dict.fromkeys(COLUMNS)
    rec.update(
        run_id=run_id(point), sweep=point.get("sweep"), backend=point["backend"],
        gpu=point["gpu"]["name"], gpu_memory_bytes=point["gpu"]["memory_bytes"],
        gpu_non_pytorch_bytes=point["gpu"]["non_pytorch_bytes"], model=point["model"]["name"],
        workload=point["workload"]["name"], leak=point["workload"].get("leak", "none"),
        batch_size=point["batch_size"], seq_len=point["seq_len"],
        precision=point["precision"], optimizer=point["optimizer"]["name"],
        optimizer_impl=point["optimizer"]["impl"], checkpointing=point["checkpointing"],
        allocator_conf=point["allocator"]["conf"], harness_version=harness.__version__,
        overrides=point.get("overrides"), job_id=point.get("job_id"),
    )
    if point["workload"]["name"] == "custom":
        rec["model"] = point["workload"]["target"]  # until the job names itself (Job.name or its class)
        rec["workload_target"] = point["workload"]["target"]
        rec["workload_args"] = json.dumps(point["workload"].get("args") or {}, sort_keys=True, default=str)
        for key, value in (point["workload"].get("args") or {}).items():
            rec.setdefault(key, value)  # the user's keys become columns (never over ours)
    return rec


def write_row(run_dir: Path, rec: dict) -> dict:
    """`rec` as run_dir/result.json; returns it."""
    run_dir.mkdir(parents=True, exist_ok=True)  # a row for a point that never started has no dir yet
    (run_dir / RESULT_FILE).write_text(json.dumps(rec, indent=1, default=str))
    return rec
