"""The record: one row per run, raw bytes, PyTorch's allocator vocabulary for names."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import harness
from harness.config import nccl
from harness.config.point import CheckpointingPolicy, Point, WorkloadName
from harness.record import provenance

STATUSES = ("ok", "oom", "error", "timeout")
RESULT_FILE = "result.json"  # one row per run dir
POINT_FILE = "point.json"  # the point the row is of (Point.to_dict)

# The collectives a row's traffic columns count (`<name>_bytes_per_step`: this GPU's bytes a step)
TRAFFIC = ("all_gather", "reduce_scatter", "all_reduce")
WORKSPACE = "cublas_workspace_bytes"
# Each catalog card's reserved peak without a limit where the run as that card makes it (its cuBLAS
# workspaces, kernel scratch or attention kernels) differs from the traced card's and a replay found
# it (JSON {card key: bytes}); a card not in it reserves peak_reserved_bytes, or OOMs by its peaks
CARD_RESERVED = "card_reserved_bytes"

# Every column a row carries (DESIGN.md "The record"); absent values are None.
COLUMNS = (
    "run_id", "sweep", "status", "error", "backend", "device_name", "gpu", "gpu_memory_bytes",
    "gpu_non_pytorch_bytes", "emulated_gpu", "model", "n_params", "workload", "leak", "batch_size", "seq_len",
    "precision", "optimizer", "optimizer_impl", "checkpointing",
    "checkpointing_policy",  # what checkpointing keeps (full | op); None without checkpointing
    "allocator_conf", "world_size", "dp_shard", "dp_replicate", "tp", "reshard_after_forward", "sequence_parallel",
    "loss_parallel", "param_dtype", "nodes", "rank",
    # a job run as its ranks (backend cuda or cpu over several GPUs): each rank's peaks, in rank order
    "rank_peak_allocated_bytes", "rank_peak_reserved_bytes",
    *(f"{what}_bytes_per_step" for what in TRAFFIC),
    # NCCL's memory on each GPU, outside PyTorch (config/nccl.py): its communicators, bytes, spread, source
    "nccl_communicators", "nccl_bytes", "nccl_spread_bytes", "nccl_source",
    "peak_allocated_bytes", "peak_reserved_bytes", "peak_requested_bytes", "steady_peak_allocated_bytes",
    "steady_peak_reserved_bytes", "steady_peak_requested_bytes", "peak_tensor_bytes", "params_bytes",
    "grads_bytes", "optimizer_bytes", "activations_bytes", "temporaries_bytes", "workspace_bytes",
    "peak_step", "peak_phase", "peak_module", "step_allocated_bytes", "step_peak_bytes",
    "peak_inactive_split_bytes", "fragmentation_bytes", "fits_cards", "tight_cards", "retry_cards",
    CARD_RESERVED,
    "catalog_sha",  # the catalog the fit verdicts were judged against (config.cards.digest)
    "retained_bytes", "retained_holder",
    "num_alloc_retries", "num_ooms", "oom_phase", "oom_step", "oom_module", "oom_tried_bytes", "oom_message",
    # cuda only: the OOM message's own numbers, the device, per-step reserved and times
    "oom_allocated_bytes", "oom_reserved_bytes", "oom_capacity_bytes", "oom_free_bytes", "oom_allowed_bytes",
    "oom_verdict", "device_memory_bytes",
    "device_multiprocessors",  # the device's SM count (a card emulated on it runs its kernels' launches)
    "measured_non_pytorch_bytes", "step_reserved_bytes", "step_times_s",
    "step_time_s", "tokens_per_s", "wall_s", "torch_version", "transformers_version",
    "harness_version", "workload_target", "workload_args", "user_code",
    "trace_path", "trace_reused", "trace_method",
    "attention_calls",  # each distinct attention call and the kernel it took on the card (config.attention; JSON)
    "cublas_workspace_bytes",  # one cuBLAS workspace in the trace (the card's: config.cublas); None: none
    "unmodelled",  # a job's layers run through cuDNN, whose own memory is not modelled (probe.jobs.UNMODELLED)
    "snapshot_path", "reused_from", "overrides", "job_id",
)


def listed(row, column: str) -> list | None:
    """A list column of a row (fits_cards, ...); None where the row has none (read back as NaN)."""
    value = row.get(column)
    return None if value is None or (isinstance(value, float) and value != value) else list(value)


def cards_reserved(row) -> dict[str, int]:
    """Each card's reserved peak without a limit that the row recorded for that card (CARD_RESERVED);
    {} where it recorded none."""
    value = row.get(CARD_RESERVED)
    return {k: int(v) for k, v in json.loads(value).items()} if isinstance(value, str) else {}


def reserved_on(row, card_key: str) -> int | None:
    """The row's reserved peak without a limit as a catalog card runs it: the card's own where the row
    recorded one (CARD_RESERVED), else the row's; None where it has none."""
    own = cards_reserved(row).get(card_key)
    if own is not None:
        return own
    value = row.get("peak_reserved_bytes")
    return None if value is None or value != value else int(value)  # (missing reads back as NaN)


def recorded_edge(row, card_key: str) -> str | None:
    """The edge a row recorded for a catalog card (probe.sim.reserved.EDGES: room, after_retry,
    tight, oom); None for a row from before the edges were recorded."""
    fits, tight, retry = (listed(row, c) for c in ("fits_cards", "tight_cards", "retry_cards"))
    if fits is None or tight is None or retry is None:
        return None
    if card_key not in fits:
        return "oom"
    return "tight" if card_key in tight else "after_retry" if card_key in retry else "room"


def checkpointing_of(row) -> str | None:
    """What a row's checkpointing keeps: None (no checkpointing), "full" or "op" (rows from before
    the policy: full)."""
    on = row.get("checkpointing")
    if on is None or on != on or not on:  # missing reads back as NaN
        return None
    policy = row.get("checkpointing_policy")
    return policy if isinstance(policy, str) and policy else "full"


def point_identity(point: Point) -> dict:
    """What defines a run: everything that can change its numbers or its status."""
    d = point.to_dict()
    custom = point.workload.name == WorkloadName.custom
    # source_sha is the user's code, so a custom job's alone (its workload has always carried it)
    workload = d["workload"] if custom else {k: v for k, v in d["workload"].items() if k != "source_sha"}
    ident = {
        "model": d["model"], "workload": workload, "batch_size": point.batch_size,
        "seq_len": point.seq_len, "precision": point.precision, "optimizer": d["optimizer"],
        "checkpointing": point.checkpointing, "allocator_conf": point.allocator.conf,
        # the default policy as before it was a knob
        **({"checkpointing_policy": point.checkpointing_policy}
           if point.checkpointing_policy != CheckpointingPolicy.full else {}),
        **({"parallel": d["parallel"]} if point.parallel.world_size > 1 else {}),  # one GPU: as before
        "backend": point.backend, "gpu": point.gpu.name, "gpu_memory_bytes": point.gpu.memory_bytes,
        # the rest of the card's figures (what lives outside PyTorch, spreads, a node's GPUs): they
        # decide its fit as much as its memory does
        "card": {k: v for k, v in d["gpu"].items() if k not in ("name", "memory_bytes", "key", "slurm")},
        # the libraries and harness's own code: another version traces another graph
        "versions": provenance.versions(),
    }
    if custom:  # the user's job is its build function, its keys and its code
        ident["target"] = point.workload.target
        ident["args"] = point.workload.args or {}
        ident["source_sha"] = point.workload.source_sha
    return ident


def run_id(point: Point) -> str:
    blob = json.dumps(point_identity(point), sort_keys=True, default=str)
    return hashlib.sha1(blob.encode()).hexdigest()[:12]


def base_record(point: Point) -> dict:
    """The row's identity columns, filled before anything runs (so a failure is still a row)."""


    w, gpu = point.workload, point.gpu
    rec = dict.fromkeys(COLUMNS)
    rec.update(
        run_id=run_id(point), sweep=point.sweep, backend=str(point.backend),
        gpu=gpu.name, gpu_memory_bytes=gpu.memory_bytes, gpu_non_pytorch_bytes=gpu.non_pytorch_bytes,
        model=point.model.name, workload=str(w.name), leak=str(w.leak),
        batch_size=point.batch_size, seq_len=point.seq_len, precision=str(point.precision),
        optimizer=str(point.optimizer.name), optimizer_impl=str(point.optimizer.impl),
        checkpointing=point.checkpointing, allocator_conf=point.allocator.conf,
        checkpointing_policy=str(point.checkpointing_policy) if point.checkpointing else None,
        **{k: v for k, v in dataclasses.asdict(point.parallel).items() if k != "nccl_bytes_per_communicator"},
        world_size=point.parallel.world_size, rank=0, **nccl.columns(nccl.per_rank(point.parallel)),
        harness_version=harness.__version__, overrides=point.overrides, job_id=point.job_id,
    )
    if w.name == WorkloadName.custom:
        rec["model"] = w.target  # until the job names itself (Job.name or its class)
        rec["workload_target"] = w.target
        rec["workload_args"] = json.dumps(w.args or {}, sort_keys=True, default=str)
        for key, value in (w.args or {}).items():
            rec.setdefault(key, value)  # the user's keys become columns (never over ours)
    return rec


def config_error_row(data: dict, error: str, job_id: str | None = None) -> dict:
    """The row of a config that is not a point (a bad value found only where the job ran): what it
    says of itself, and the error."""
    rec = dict.fromkeys(COLUMNS)
    data = {k: v for k, v in data.items() if k != "hydra"}
    rec.update({k: data.get(k) for k in ("sweep", "backend", "batch_size", "seq_len", "precision", "checkpointing",
                                           "checkpointing_policy")})
    rec.update(run_id=hashlib.sha1(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:12],
               status="error", error=error, job_id=job_id, model=(data.get("model") or {}).get("name"),
               workload=(data.get("workload") or {}).get("name"), gpu=(data.get("gpu") or {}).get("name"))
    return rec


def write_row(run_dir: Path, rec: dict, name: str = RESULT_FILE) -> dict:
    """`rec` as run_dir/result.json (or `name`); returns it. Written whole, then renamed: a reader
    polling for it (a rank's peers) never reads half of it."""
    run_dir.mkdir(parents=True, exist_ok=True)  # a row for a point that never started has no dir yet
    part = run_dir / f".{name}.part"
    part.write_text(json.dumps(rec, indent=1, default=str))
    part.replace(run_dir / name)
    return rec
