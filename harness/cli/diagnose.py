"""`python -m harness diagnose <- | oom.txt | result.json | sweep dir | snapshot.pickle> [--json]`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from harness.errors import EXIT_OK, EXIT_USAGE
from harness.units import GiB


def _fail(message: str) -> int:
    print(f"harness: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def main(args: list[str]) -> int:
    as_json = "--json" in args
    paths = [a for a in args if a != "--json"]
    unknown = [a for a in paths if a.startswith("--")]
    if unknown or len(paths) != 1:
        return _fail("diagnose takes one input: - (an OOM message on stdin), a file holding one, a result.json, "
                     "a sweep dir or a snapshot.pickle; and --json")
    target = paths[0]
    if target == "-":
        return _message(sys.stdin.read(), as_json)
    path = Path(target)
    if not path.exists():
        return _fail(f"diagnose: no such file or directory: {path}")
    if path.suffix in (".pickle", ".pkl"):
        return _snapshot(path, as_json)
    if path.is_file():  # read once: a result.json goes on to _runs, anything else is a message
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as e:
            return _fail(f"diagnose: cannot read {path}: {e}")
        try:
            json.loads(text)
        except ValueError:
            if path.suffix == ".json":
                return _fail(f"diagnose: {path} is not valid JSON (a result.json is)")
            return _message(text, as_json, str(path))  # an OOM message saved to a file
    return _runs(path, as_json)


def _message(text: str, as_json: bool, source: str = "stdin") -> int:
    from harness.analysis.oom_text import diagnose
    from harness.report import words

    try:
        reading = diagnose(text)
    except ValueError as e:
        return _fail(f"{source}: {e}")
    out = {**reading.as_dict(), "reasoning": words.oom_reasoning(reading)}
    if as_json:
        print(json.dumps(out, indent=1))
        return EXIT_OK
    print(f"verdict: {out['verdict']}")
    for key in ("tried_bytes", "capacity_bytes", "free_bytes", "allocated_bytes", "reserved_unallocated_bytes",
                "process_bytes", "non_pytorch_bytes", "other_processes_bytes", "unlisted_bytes", "allowed_bytes",
                "headroom_bytes"):
        if out[key]:
            print(f"  {key:28s} {out[key] / GiB:9.2f} GiB")
    print(out["reasoning"])
    return EXIT_OK


def _snapshot(path: Path, as_json: bool) -> int:
    from harness.allocator import snapshot as snap
    from harness.analysis.timeline import diagnose_snapshot
    from harness.report import words

    try:
        out = diagnose_snapshot(snap.load(path))
    except snap.SnapshotError as e:
        return _fail(str(e))
    out["snapshot"] = str(path)
    out["shape_numbers"] = words.snapshot_shape_numbers(out)
    if as_json:
        print(json.dumps(out, indent=1))
        return EXIT_OK
    print(f"{path}: kind {out['kind']}, shape {out['shape']} ({out['shape_numbers']})")
    print(f"  at the peak ({out['peak_requested_bytes'] / GiB:.2f} GiB requested): "
          f"{out['resident_at_peak_bytes'] / GiB:.2f} GiB resident (allocated before the trace or still allocated "
          f"at its end), {out['transient_at_peak_bytes'] / GiB:.2f} GiB transient (freed within it); "
          f"{out['fragmentation_bytes'] / GiB:.2f} GiB reserved but unallocated at the reserved peak")
    print("  what the peak is made of:")
    for s in out["peak_sites"]:
        print(f"    {s['bytes'] / GiB:8.2f} GiB  {s['site']}")
    if out["growing_sites"]:
        print("  what keeps growing:")
        for s in out["growing_sites"]:
            print("    " + " -> ".join(f"{b / GiB:.2f}" for b in s["bytes"]) + f" GiB  {s['site']}")
    return EXIT_OK


def _runs(path: Path, as_json: bool) -> int:
    from harness.analysis.kinds import kind, shape
    from harness.analysis.verdict import layout, spread
    from harness.record import results
    from harness.report import words

    rows = results.load_rows(path)
    if not rows:
        return _fail(f"diagnose: no result.json under {path}")
    # the report's labels: they tell every run from the others (the allocator, a leak, what else differs)
    labels = words.job_labels([{**r, "run_id": str(i)} for i, r in enumerate(rows)])
    out = []
    for i, rec in enumerate(rows):
        k = kind(rec)
        sh = shape(rec.get("step_allocated_bytes") or [], rec.get("step_peak_bytes") or [],
                   rec.get("workload") == "train")
        world, _reshard = spread(rec)
        out.append({"run_id": rec.get("run_id"), "label": labels[str(i)], "model": rec.get("model"),
                    "batch_size": rec.get("batch_size"),
                    "seq_len": rec.get("seq_len"), "precision": rec.get("precision"),
                    "checkpointing": rec.get("checkpointing"),
                    "checkpointing_policy": rec.get("checkpointing_policy"), "allocator_conf": rec.get("allocator_conf"),
                    "leak": rec.get("leak"),
                    "gpus": world, "layout": layout(rec) or None,  # the figures are one GPU's of the job's
                    "gpu": rec.get("gpu"), "status": rec.get("status"), "kind": k.kind, "why": words.kind_reason(k),
                    "shape": sh.shape, "shape_numbers": words.shape_numbers(sh)})
    if as_json:
        print(json.dumps(out if len(out) > 1 or path.is_dir() else out[0], indent=1, default=str))
        return EXIT_OK
    for r in out:
        spread_over = f", {r['layout']} over {r['gpus']} GPUs," if r["gpus"] > 1 else ""
        print(f"{r['label']}{spread_over} on {r['gpu']}: {r['kind']} ({r['why']}); shape {r['shape']} "
              f"({r['shape_numbers']})")
    return EXIT_OK
