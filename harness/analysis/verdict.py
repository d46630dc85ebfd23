"""Code problem or card problem, per (job, card), from a sweep's rows.

A row that does not fit its card is a *code problem* when another row of the sweep - the same model,
workload and sequence length, at the same effective batch (a micro-batch that divides it, with
gradient accumulation) - fits that card: the differences between the two are the remedy, with their
cost. It is a *card problem* when none does; the verdict then names the smallest card of the catalog
that the job fits as it is, with its headroom.
"""

from __future__ import annotations

import pandas as pd

from harness.config import cards as catalog
from harness.config.point import Card
from harness.units import GiB

# The cost of each remedy, shown with it (and used to order them: cheapest first).
_COST = {
    "leak": (0, "no cost once the holder is fixed"),
    "allocator": (1, "no compute cost"),
    "accumulation": (2, "same effective batch; more, smaller steps"),
    "waves": (2, "the same sequences, fewer at a time; less throughput"),
    "checkpointing": (3, "about 20-33% more compute (one more forward per layer)"),
    "optimizer": (4, "changes the optimizer's behaviour"),
    "precision": (5, "changes numerics"),
}


def _leak(row) -> str:
    value = row.get("leak")
    return value if isinstance(value, str) else "none"  # rows from before leaks were recorded


def _fits(row, card_key: str) -> bool:
    listed = row.get("fits_cards")
    return listed is not None and not (isinstance(listed, float) and pd.isna(listed)) and card_key in list(listed)


def _remedy(job, other) -> list[tuple[str, str]]:
    """(kind, description) of each way `other` differs from `job`."""
    out = []
    if _leak(job) != "none" and _leak(other) == "none":
        out.append(("leak", f"fix the {_leak(job)} leak ({job.get('retained_holder') or 'see diagnose'})"))
    if (other.get("allocator_conf") or "") != (job.get("allocator_conf") or ""):
        out.append(("allocator", f"PYTORCH_ALLOC_CONF={other.get('allocator_conf') or '(default)'}"))
    if other["batch_size"] != job["batch_size"]:
        steps = job["batch_size"] // other["batch_size"]
        if job.get("workload") == "infer":  # no gradients to accumulate: serve in waves
            out.append(("waves", f"{other['batch_size']} concurrent sequences x {steps} waves"))
        else:
            out.append(("accumulation", f"micro-batch {other['batch_size']} x {steps} accumulation steps"))
    if bool(other.get("checkpointing")) and not bool(job.get("checkpointing")):
        out.append(("checkpointing", "activation checkpointing"))
    if other.get("optimizer") != job.get("optimizer") or other.get("optimizer_impl") != job.get("optimizer_impl"):
        out.append(("optimizer", f"optimizer {other.get('optimizer')} ({other.get('optimizer_impl')})"))
    if other.get("precision") != job.get("precision"):
        out.append(("precision", f"precision {other.get('precision')}"))
    return out


def _val(v):
    return None if isinstance(v, float) and pd.isna(v) else v  # a missing value reads back as NaN


def _comparable(job, other) -> bool:
    if other is job or other.get("status") not in ("ok", "oom"):
        return False
    same = all(_val(other.get(k)) == _val(job.get(k)) for k in ("model", "workload", "seq_len", "workload_args"))
    divides = other["batch_size"] <= job["batch_size"] and job["batch_size"] % other["batch_size"] == 0
    # A remedy only removes a mistake or changes a knob; it never introduces a leak.
    no_new_leak = _leak(other) in ("none", _leak(job))
    return same and divides and no_new_leak


def verdicts(df: pd.DataFrame) -> pd.DataFrame:
    """One row per (job, card) that does not fit: verdict, remedies that fit, or the card needed."""
    cards = {c.key: c for c in catalog.cards()}
    by_name = {c.name: c for c in cards.values()}
    rows = df.to_dict("records")
    out = []
    for job in rows:
        card = by_name.get(job.get("gpu"))
        if card is None or job.get("status") != "oom":
            continue
        fixes = []
        for other in rows:
            if _comparable(job, other) and _fits(other, card.key):
                diff = _remedy(job, other)
                if diff:
                    rank = sum(_COST[k][0] for k, _d in diff) + len(diff) * 10  # fewer changes first
                    fixes.append((rank, " + ".join(f"{d} ({_COST[k][1]})" for k, d in diff)))
        fixes = sorted(set(fixes))[:3]
        entry = {"run_id": job.get("run_id"), "job": job_label(job), "card": card.key, "kind": job.get("kind")}
        if fixes:
            entry.update(verdict="code problem", detail=" | ".join(f"fits with {desc}" for _r, desc in fixes))
        else:
            entry.update(verdict="card problem", detail=_card_needed(job, cards))
        out.append(entry)
    return pd.DataFrame(out, columns=["run_id", "job", "card", "kind", "verdict", "detail"])


def job_label(row) -> str:
    """A run in words: model, workload, batch, sequence, precision, checkpointing, allocator, leak."""
    leak = f" leak={_leak(row)}" if _leak(row) != "none" else ""
    alloc = f" alloc={row['allocator_conf']}" if row.get("allocator_conf") else ""
    return (f"{row['model']} {row['workload']} b{row['batch_size']} s{row['seq_len']} {row['precision']} "
            f"ckpt={'yes' if row.get('checkpointing') else 'no'}{alloc}{leak}")


def _card_needed(job, cards: dict[str, Card]) -> str:
    fitting = [c for c in cards.values() if _fits(job, c.key)]
    if not fitting:
        return "no remedy in the sweep fits, and no card of the catalog fits the job as it is"
    smallest = min(fitting, key=lambda c: c.memory_bytes)
    room = smallest.room()
    headroom = room - int(job.get("peak_reserved_bytes") or 0)
    return (f"no remedy in the sweep fits; the smallest card that fits it as it is: {smallest.key} "
            f"({headroom / GiB:.2f} GiB headroom, {100 * headroom / smallest.memory_bytes:.0f}% of the card)")
