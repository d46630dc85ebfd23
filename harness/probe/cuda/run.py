"""The real card: one point on CUDA, measured by the caching allocator's own counters.

Runs in a fresh process whose environment already carries the allocator settings and its one
device (runner + gpus.worker_env). The same Job as the virtual GPU (a preset, probe/presets.py, or the user's);
an out-of-memory error becomes the row's data, with the stats at that moment and the numbers of
its message. A card smaller than the device is emulated by capping reserved bytes.
"""

from __future__ import annotations

import gc
import os
from pathlib import Path

from harness.allocator.settings import AllocSettings
from harness.config import cublas
from harness.config.cards import emulation_changes, emulation_fraction
from harness.config.point import Point
from harness.probe.cuda.job import measure
from harness.record.row import WORKSPACE

# Memory history entries kept for a snapshot: a 7B training step makes ~10^5 allocator events.
SNAPSHOT_MAX_ENTRIES = 2_000_000


# AllocSettings field -> the key a snapshot's allocator_settings reports it under (a key a
# version does not report, e.g. max_non_split_rounding_size before 2.7, cannot be checked).
_REPORTED = {"max_split_size": "max_split_size", "max_non_split_rounding": "max_non_split_rounding_size",
             "roundup_power2_divisions": "roundup_power2_divisions",
             "garbage_collection_threshold": "garbage_collection_threshold",
             "expandable_segments": "expandable_segments"}


def settings_mismatch(conf: str, recorded: dict) -> str | None:
    """Where the allocator's effective settings (a snapshot's allocator_settings) differ from the
    PYTORCH_ALLOC_CONF string asked for; None when every reported setting agrees."""
    want, got = AllocSettings.from_conf(conf), AllocSettings.from_snapshot(recorded)
    diffs = [f"{name}: asked {getattr(want, name)!r}, got {getattr(got, name)!r}"
             for name, key in _REPORTED.items() if key in recorded and getattr(want, name) != getattr(got, name)]
    return "; ".join(diffs) or None


def run_cuda(point: Point, run_dir: Path) -> dict:
    """Measure the point on this process's one GPU; returns the record's measured columns."""
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("backend=cuda but this process sees no GPU "
                           f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
    snapshot = run_dir / "snapshot.pickle" if point.snapshot else None
    if snapshot is not None:  # before the first allocation, so the trace replays from an empty device
        torch.cuda.memory._record_memory_history(max_entries=SNAPSHOT_MAX_ENTRIES, stacks="python")
    props = torch.cuda.get_device_properties(0)
    out: dict = {"device_name": props.name, "device_memory_bytes": props.total_memory,
                 "device_multiprocessors": props.multi_processor_count, "torch_version": torch.__version__}
    fraction = emulation_fraction(point.gpu, props.name, props.total_memory)
    why = emulation_changes(point.gpu, point.allocator.conf, props.name, fraction)
    if why:  # (launch.gpus.check_cards refuses it up front where the devices are known: not on a cluster)
        raise RuntimeError(why)
    if fraction is not None:
        torch.cuda.set_per_process_memory_fraction(fraction, 0)
        # the emulated card's cuBLAS workspaces (read at the first GEMM), unless the user set them
        os.environ.setdefault(cublas.ENV, cublas.config_for(point.gpu.capability))
        out["emulated_gpu"] = True
        out["device_name"] = f"{point.gpu.device_name} (emulated on {props.name}, reserved capped at " \
                             f"{fraction * props.total_memory / 2**30:.2f} GiB)"
    else:
        out["emulated_gpu"] = False
    torch.cuda.init()
    mismatch = settings_mismatch(point.allocator.conf, torch.cuda.memory._snapshot().get("allocator_settings", {}))
    if mismatch:
        raise RuntimeError(f"the allocator did not take allocator.conf={point.allocator.conf!r}: {mismatch}")

    # the point's card's attention kernels where it is emulated here, else this card's own
    device = torch.cuda.get_device_capability(0)
    out[WORKSPACE] = cublas.workspace_bytes(point.gpu.capability if fraction is not None else device)
    try:
        out.update(measure(point, point.gpu.capability if fraction is not None else device, device))
    finally:
        if snapshot is not None:
            torch.cuda.memory._dump_snapshot(str(snapshot))
            torch.cuda.memory._record_memory_history(enabled=None)
            out["snapshot_path"] = str(snapshot)
    gc.collect()
    free, total = torch.cuda.mem_get_info()
    # Whatever the device holds beyond PyTorch's cache: the CUDA context, cuBLAS/cuDNN handles.
    out["measured_non_pytorch_bytes"] = total - free - torch.cuda.memory_reserved()
    return out

