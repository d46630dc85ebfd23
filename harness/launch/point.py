"""A composed config made the point a worker runs: resolved, with where it was asked from."""

from __future__ import annotations

import os
from pathlib import Path

from omegaconf import open_dict

from harness.config.compose import as_dict
from harness.config.target import source_sha
from harness.launch.gpus import resolve_backend


def to_point(cfg, overrides: list[str], cwd: str | None = None, cluster: bool = False,
             results_dir: Path | None = None) -> dict:
    """The resolved point a worker runs; with `results_dir`, its trace cache there (one trace
    serves every allocator setting and card)."""
    if "hydra" in cfg:  # a sweep config before its job ran: hydra's runtime keys are not set yet
        cfg = cfg.copy()
        with open_dict(cfg):
            del cfg["hydra"]
    point = as_dict(cfg)
    point["backend"] = resolve_backend(point["backend"], cluster)
    point["overrides"] = " ".join(overrides)
    point["cwd"] = cwd or os.getcwd()  # where the user ran us: their workload module is found from here
    if results_dir is not None:
        point["trace_cache"] = str(Path(results_dir) / ".traces")
    if point["workload"]["name"] == "custom":
        point["workload"]["source_sha"] = source_sha(point["workload"]["target"], point["cwd"])
    return point
