"""Each recorded "fits with room" of a sweep's rows against a replay of the row's trace as the card
runs it: `python scripts/edge_audit.py <results.parquet> [...]`.

A row's edge on a card of another cuBLAS workspace, of kernel scratch sized by other SMs, or of other
attention kernels (the trace taken or rewritten for it) comes from a replay of the trace as that
card runs it (probe.worker; rows from before 2026-12-05 took a band around the traced peaks, which
was not sound). This replays that trace with the card's own workspace and scratch, without a limit,
and lists each pair whose recorded `room` has a low end under that replay's reserved peak (such a
card fits only on the allocator's retry, or not at all), with the largest rise of reserved it saw.
Prints; exits 1 where it lists any.
"""

import sys

import pandas as pd

from harness.allocator.model import Device
from harness.allocator.replay import replay_events
from harness.allocator.settings import AllocSettings
from harness.config import cards, cublas, nccl
from harness.plan import fit
from harness.record.row import WORKSPACE, recorded_edge


def audit(rows: pd.DataFrame) -> tuple[int, int, int]:
    """(pairs checked, suspects, largest rise of the reserved peak in bytes)."""
    checked = suspects = rise = 0
    for row in rows.to_dict("records"):
        if pd.isna(row.get("trace_path")) or pd.isna(row.get(WORKSPACE)):
            continue
        peaks: dict = {}
        settings = AllocSettings.from_conf(row.get("allocator_conf") or "")
        for c in cards.cards():
            path = fit.card_trace(row, c)  # (a card of other attention kernels: the trace taken or rewritten for it)
            if path is None:
                continue  # none: the worker found it an OOM by the traced peaks
            rows_of = (path, cublas.workspace_bytes(c.capability), fit._sizing({**row, "trace_path": path}, c))
            if rows_of == (row["trace_path"], int(row[WORKSPACE]), None):
                continue  # the traced card's own rows: its replay decided it
            # (expandable segments: address ranges of the card's memory)
            key = (*rows_of, c.memory_bytes if settings.expandable_segments else None)
            if key not in peaks:
                device = Device(total=key[3])
                peaks[key] = replay_events(fit._trace_rows(*rows_of), settings, device, lean=True)[0].peak_reserved_bytes
            rise = max(rise, peaks[key] - int(row["peak_reserved_bytes"]))
            checked += 1
            low_end = nccl.on_rows_rank(c, row).at_worst().room()
            if recorded_edge(row, c.key) == "room" and peaks[key] > low_end:
                suspects += 1
                print(f"{row['run_id']} b{row['batch_size']} s{row['seq_len']} {row['precision']} on {c.key}: "
                      f"recorded room; reserved {peaks[key]} B with its own sizes > low end {low_end:.0f} B")
    return checked, suspects, rise


def main(paths: list[str]) -> int:
    total = 0
    for path in paths:
        checked, suspects, rise = audit(pd.read_parquet(path))
        print(f"{path}: {checked} pairs, {suspects} suspect, reserved rose by up to {rise} B")
        total += suspects
    return 1 if total else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
