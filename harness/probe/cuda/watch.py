"""What the real allocator's counters say about one run: read at every phase boundary, assembled
into the record's columns.

`CudaWatch` is the probe's `hooks` (begin_step / set_phase / end_step: probe/jobs.py Watch). At each phase
boundary it reads the peaks since the last boundary and resets them (`reset_peak_memory_stats`:
host-side counters, no synchronisation), so every step and phase has its own peak. The allocator
counts on the host when a kernel is enqueued, so the readings need no synchronize; step times do.
`measurements` turns the readings into columns and is plain arithmetic (tested without a GPU).
"""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass, field


@dataclass
class PhaseReading:
    step: int | None  # None: before the first step (building the model, the batch)
    phase: str
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    peak_requested_bytes: int
    peak_inactive_split_bytes: int


@dataclass
class StepReading:
    step: int
    allocated_after_bytes: int
    reserved_after_bytes: int
    time_s: float
    phases: list[PhaseReading] = field(default_factory=list)

    @property
    def peak_allocated_bytes(self) -> int:
        return max((p.peak_allocated_bytes for p in self.phases), default=self.allocated_after_bytes)


def read_peaks(stats: dict, step: int | None, phase: str) -> PhaseReading:
    """A PhaseReading from `torch.cuda.memory_stats()`."""
    return PhaseReading(step, phase, stats.get("allocated_bytes.all.peak", 0), stats.get("reserved_bytes.all.peak", 0),
                        stats.get("requested_bytes.all.peak", 0), stats.get("inactive_split_bytes.all.peak", 0))


class CudaWatch:
    """Per-phase peaks of the caching allocator on one device, and per-step times."""

    def __init__(self, collect: bool = True):
        import torch

        self.cuda = torch.cuda
        self.collect = collect  # gc.collect() before each step's reading, as the virtual GPU does
        self.step: int | None = None
        self.phase: str | None = "setup"
        self.outside: list[PhaseReading] = []  # phases outside any step (setup, input)
        self.steps: list[StepReading] = []
        self._open: list[PhaseReading] = []
        self._t0 = 0.0

    def _read(self, phase: str) -> PhaseReading:
        """The peaks since the last reset, kept with the step (or outside steps) they belong to."""
        reading = read_peaks(self.cuda.memory_stats(), self.step, phase)
        (self._open if self.step is not None else self.outside).append(reading)
        return reading

    def _close_phase(self) -> None:
        if self.phase is not None:  # None: a step begun, its first phase not yet named
            self._read(self.phase)
        self.cuda.reset_peak_memory_stats()

    def set_phase(self, phase: str) -> None:
        if phase != self.phase:
            self._close_phase()
            self.phase = phase

    def begin_step(self, step: int) -> None:
        self._close_phase()
        self.cuda.synchronize()  # the step's time starts when the card is idle
        self.step, self.phase, self._open, self._t0 = step, None, [], time.perf_counter()

    def end_step(self) -> None:
        self.cuda.synchronize()
        elapsed = time.perf_counter() - self._t0
        if self.collect:
            gc.collect()  # cycles of the libraries' own making are freed before the reading
        self._close_phase()
        self.steps.append(StepReading(self.step, self.cuda.memory_allocated(), self.cuda.memory_reserved(),
                                      elapsed, self._open))
        self.step, self.phase = None, "between steps"

    def at_failure(self) -> PhaseReading:
        """The peaks of the phase that was running when it failed (an OOM), kept with the others."""
        return self._read(self.phase or "forward")

    def all_phases(self) -> list[PhaseReading]:
        return [*self.outside, *(p for s in self.steps for p in s.phases), *self._open]


def measurements(watch_steps: list[StepReading], phases: list[PhaseReading], trains: bool,
                 tokens_per_step: int) -> dict:
    """Record columns from the readings, in the virtual GPU's windows: the whole run's peaks
    (building the job and every step: what decides an OOM) and the steady state's from step 2 on
    (None with a single step), the same window for allocated, requested and reserved."""
    window = watch_steps[1:]
    in_window = [p for s in window for p in s.phases]
    out: dict = {
        "peak_inactive_split_bytes": max((p.peak_inactive_split_bytes for p in phases), default=None),
        "step_allocated_bytes": [s.allocated_after_bytes for s in watch_steps],
        "step_reserved_bytes": [s.reserved_after_bytes for s in watch_steps],
        "step_peak_bytes": [s.peak_allocated_bytes for s in watch_steps],
        "step_times_s": [s.time_s for s in watch_steps],
        "steady_peak_allocated_bytes": None, "steady_peak_requested_bytes": None, "steady_peak_reserved_bytes": None,
    }
    if phases:
        top = max(phases, key=lambda p: p.peak_allocated_bytes)
        out.update(peak_allocated_bytes=top.peak_allocated_bytes, peak_step=top.step, peak_phase=top.phase,
                   peak_requested_bytes=max(p.peak_requested_bytes for p in phases),
                   peak_reserved_bytes=max(p.peak_reserved_bytes for p in phases))
    if in_window:
        out.update(steady_peak_allocated_bytes=max(p.peak_allocated_bytes for p in in_window),
                   steady_peak_requested_bytes=max(p.peak_requested_bytes for p in in_window),
                   steady_peak_reserved_bytes=max(p.peak_reserved_bytes for p in in_window))
    timed = window or watch_steps
    if timed:
        # The median step from step 2 on: the first pays for cuBLAS handles and autotuning (an
        # inference's first step is its prefill).
        step_time = statistics.median(s.time_s for s in timed)
        out.update(step_time_s=step_time, tokens_per_s=tokens_per_step / step_time if step_time > 0 else None)
    after = out["step_allocated_bytes"]
    out["retained_bytes"] = max(0, after[-1] - after[1]) if trains and len(after) > 2 else 0
    return out
