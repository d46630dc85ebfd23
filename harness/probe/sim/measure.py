"""What the virtual GPU reads off a traced run: gradients and optimizer state tagged as they appear,
the holders of memory that outlived its step, and the record's columns from the tracker's steps."""

from __future__ import annotations

import torch

from harness.probe.sim.holders import collect_cycles, cycle_text, old_tensors
from harness.probe.sim.ledger import step_stats
from harness.probe.sim.tracker import StorageTracker, TraceEvent


def watch_training(tracker: StorageTracker, model, optimizer, host_steps: bool) -> None:
    """Tag gradients as they land and optimizer state after each step (`host_steps`: step counts
    stay on the host, as torch.optim keeps them on CUDA unless fused)."""
    for p in model.parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(lambda p: tracker.retag(p.grad, "gradient"))
    optimizer.register_step_post_hook(lambda o, *_: _retag_state(tracker, o, host_steps))


def find_holders(tracker: StorageTracker, n_steps: int) -> dict | None:
    """What keeps memory that outlived its step: Python containers holding old steps' tensors, and
    reference cycles (call while the loop's leftovers are still alive). Looking walks every Python
    object (about 1 s at 7B), so only when something outlived its step - the same test as the
    record's retained_bytes. The parts of the row's retained_holder (holder_text)."""
    after = [s.allocated_after_bytes for s in step_stats(tracker.journal())[1]]
    if not (len(after) > 2 and after[-1] > after[1]):
        return None
    old = old_tensors(tracker, n_steps - 1)
    cycles, freed = collect_cycles(tracker)
    return {"old": old, "cycles": cycles, "cycle_freed_bytes": freed if cycles else 0}


def holder_text(found: dict | None) -> str | None:
    if not found:
        return None
    texts = [*found["old"], *([cycle_text(found["cycles"], found["cycle_freed_bytes"])] if found["cycles"] else [])]
    return "; ".join(texts) or None


def optimizer_state_bytes(tracker: StorageTracker, optimizer) -> int:
    return sum(tracker.allocated_bytes_of(v) for state in optimizer.state.values()
               for v in state.values() if isinstance(v, torch.Tensor))


def _retag_state(tracker: StorageTracker, optimizer, host_steps: bool) -> None:
    for state in optimizer.state.values():
        for name, v in state.items():
            if not isinstance(v, torch.Tensor):
                continue
            if name == "step" and host_steps and v.dim() == 0:
                # torch.optim keeps step counts on the CPU unless fused or capturable:
                # a real CUDA run never allocates them on the card.
                tracker.drop(v)
            else:
                tracker.retag(v, "optimizer_state")


def measurements(journal: list[TraceEvent], trains: bool, n_params: int, params_bytes: int,
                 state_bytes: int, holder: dict | None, all_gather_bytes: int = 0, reduce_scatter_bytes: int = 0,
                 all_reduce_bytes: int = 0) -> dict:
    """The record's columns from a journal (tracker.journal(), or one synthesized): the whole run's
    peak (building the job and every step: what decides an OOM) with where it happened and what it
    held. Its byte peaks are the storages' (the row's peak_tensor_bytes); the row's allocated,
    requested and reserved peaks, whole and steady, are the allocator replay's
    (probe.sim.reserved.analyse)."""
    setup, per_step = step_stats(journal)
    whole = [setup, *per_step]
    peak = max(whole, key=lambda s: s.peak_allocated_bytes)
    bd = peak.peak_breakdown
    after = [s.allocated_after_bytes for s in per_step]
    return {
        "retained_bytes": max(0, after[-1] - after[1]) if len(after) > 2 and trains else 0,
        "retained_holder": holder_text(holder),
        "n_params": n_params,
        "peak_allocated_bytes": peak.peak_allocated_bytes,
        "peak_requested_bytes": max(s.peak_requested_bytes for s in whole),
        "peak_step": peak.step if peak.step >= 0 else None,
        "peak_phase": peak.peak_phase,
        "peak_module": peak.peak_module,
        "params_bytes": params_bytes,
        "grads_bytes": bd.get("gradient", 0),
        "optimizer_bytes": state_bytes,
        "activations_bytes": bd.get("activation", 0),
        "temporaries_bytes": bd.get("temporary", 0),
        "workspace_bytes": bd.get("workspace", 0),
        "peak_breakdown": {k: v for k, v in bd.items() if v},
        "step_allocated_bytes": [s.allocated_after_bytes for s in per_step],
        "step_peak_bytes": [s.peak_allocated_bytes for s in per_step],
        # a job's traffic on this rank over several GPUs, per step (the cost of spreading it)
        "all_gather_bytes_per_step": all_gather_bytes,
        "reduce_scatter_bytes_per_step": reduce_scatter_bytes,
        "all_reduce_bytes_per_step": all_reduce_bytes,
    }
