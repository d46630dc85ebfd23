"""A composed config made the point a worker runs: resolved, with where it was asked from."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from harness.config import cards as catalog
from harness.config.models import config_json_sha
from harness.config.point import Point, WorkloadName
from harness.config.target import source_sha
from harness.launch.gpus import resolve_backend


def to_point(cfg, overrides: list[str], cwd: str | None = None, cluster: bool = False,
             results_dir: Path | None = None, job_id: str | None = None, built: Point | None = None) -> Point:
    """The resolved point a worker runs (ConfigError for a bad value); with `results_dir`, its
    trace cache there (one trace serves every allocator setting and card). `built`: cfg's point,
    where the caller already has it (validate's)."""
    point = built if built is not None else Point.from_config(cfg)
    point = point.replace(gpu=catalog.as_measured(point.gpu))  # calibrate's figures where it has them
    cwd = cwd or os.getcwd()
    workload = point.workload
    if workload.name == WorkloadName.custom:
        workload = dataclasses.replace(workload, source_sha=source_sha(workload.target, cwd))
    model = point.model
    if model.config_json:
        model = dataclasses.replace(model, config_sha=config_json_sha(model.config_json))
    return point.replace(
        backend=resolve_backend(point.backend, cluster), overrides=" ".join(overrides), cwd=cwd,
        trace_cache=str(Path(results_dir) / ".traces") if results_dir is not None else None,
        workload=workload, model=model, job_id=job_id)
