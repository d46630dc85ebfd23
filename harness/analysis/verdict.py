"""Code problem or card problem, per (job, card), from a sweep's rows.

A row that does not fit its card is a *code problem* when another row of the sweep - the same model,
workload and sequence length, at the same effective batch (a micro-batch that divides it, with
gradient accumulation) - fits that card: the differences between the two are the remedy, with their
cost. It is a *card problem* when none does; the verdict then names the smallest card of the catalog
that the job fits as it is, with its headroom.

Everything here is data: a remedy is its changes (kind, the knob, its new value, the cost of it),
and a card problem names a card and the headroom in bytes. report/words.py puts them in words.
"""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd

from harness.config import cards as catalog
from harness.config.point import Card
from harness.record.row import listed, recorded_edge

# What each kind of remedy costs (a code, worded by the report), and its rank: cheapest first.
COSTS = {
    "leak": (0, "none_once_fixed"),
    "allocator": (1, "none"),
    "accumulation": (2, "more_smaller_steps"),
    "waves": (2, "less_throughput"),
    "checkpointing": (3, "recompute"),
    "optimizer": (4, "optimizer_behaviour"),
    "precision": (5, "numerics"),
}
VERDICT_COLUMNS = ["run_id", "card", "kind", "verdict", "remedies", "card_needed", "card_headroom_bytes",
                   "card_headroom_pct", "card_edge", "missing"]


def leak_of(row) -> str:
    value = row.get("leak")
    return value if isinstance(value, str) else "none"  # rows from before leaks were recorded


def _fits(row, card_key: str) -> bool:
    if card_key.startswith(_OWN):  # a card outside the catalog: only its own runs say
        return row.get("gpu") == card_key[len(_OWN):] and row.get("status") == "ok"
    return card_key in (listed(row, "fits_cards") or [])


def _edge(row, card_key: str) -> str:
    """room | after_retry | tight for a run that fits the card (rows from before the edges: room)."""
    return recorded_edge(row, card_key) or "room"


_OWN = "own:"  # the key of a card outside the catalog (gpu.memory_bytes=...), by its name


def _change(kind: str, key: str, was, value, steps: int | None = None, holder: str | None = None) -> dict:
    return {"kind": kind, "key": key, "was": str(was), "value": str(value), "steps": steps, "holder": holder,
            "cost": COSTS[kind][1]}


def remedy_changes(job, other) -> list[dict]:
    """Each way `other` differs from `job`: kind, the knob (`key`), its value in the job (`was`) and
    in the fitting run (`value`), `steps` for accumulation or waves, the leak's `holder`, and the
    `cost` code."""
    out = []
    if leak_of(job) != "none" and leak_of(other) == "none":
        out.append(_change("leak", "leak", leak_of(job), "none", holder=_val(job.get("retained_holder"))))
    if (other.get("allocator_conf") or "") != (job.get("allocator_conf") or ""):
        out.append(_change("allocator", "allocator_conf", job.get("allocator_conf") or "", other.get("allocator_conf") or ""))
    if other["batch_size"] != job["batch_size"]:
        steps = int(job["batch_size"] // other["batch_size"])
        # inference has no gradients to accumulate: it serves in waves
        out.append(_change("waves" if job.get("workload") == "infer" else "accumulation", "batch_size",
                           int(job["batch_size"]), int(other["batch_size"]), steps=steps))
    if bool(other.get("checkpointing")) and not bool(job.get("checkpointing")):
        out.append(_change("checkpointing", "checkpointing", False, True))
    if other.get("optimizer") != job.get("optimizer") or other.get("optimizer_impl") != job.get("optimizer_impl"):
        out.append(_change("optimizer", "optimizer", f"{job.get('optimizer')} ({job.get('optimizer_impl')})",
                           f"{other.get('optimizer')} ({other.get('optimizer_impl')})"))
    if other.get("precision") != job.get("precision"):
        out.append(_change("precision", "precision", job.get("precision"), other.get("precision")))
    return out


def spread(row) -> tuple[int, bool]:
    """The GPUs a row's job is spread over and whether FSDP2 reshards after forward (1, True for
    rows from before parallel.*)."""
    world, reshard = _val(row.get("world_size")), _val(row.get("reshard_after_forward"))
    return (int(world) if world is not None else 1), reshard is None or bool(reshard)


def _val(v):
    return None if isinstance(v, float) and pd.isna(v) else v  # a missing value reads back as NaN


def _same_job(job, other) -> bool:
    """The same model (a custom job: the same build function; its row's name is known only once built)."""
    target = _val(job.get("workload_target"))
    key = "workload_target" if target is not None else "model"
    return _val(other.get(key)) == _val(job.get(key))


def _comparable(job, other, ran: bool = True) -> bool:
    """Whether `other` is `job` with some knobs changed (ran: it has a row to judge by)."""
    if other is job or (ran and other.get("status") not in ("ok", "oom")):
        return False
    same = _same_job(job, other) and all(_val(other.get(k)) == _val(job.get(k))
                                          for k in ("workload", "seq_len", "workload_args"))
    # Per-GPU figures of a job spread over another number of GPUs are no remedy on this many cards
    # (more cards as an answer is not weighed yet)
    same = same and spread(other) == spread(job)
    divides = other["batch_size"] <= job["batch_size"] and job["batch_size"] % other["batch_size"] == 0
    # A remedy only removes a mistake or changes a knob; it never introduces a leak.
    no_new_leak = leak_of(other) in ("none", leak_of(job))
    return same and divides and no_new_leak


def verdicts(df: pd.DataFrame, missing: Sequence[dict] = ()) -> pd.DataFrame:
    """One row per (job, card) that does not fit: the verdict, the remedies in the sweep that fit
    (up to three, cheapest and fewest changes first: the fitting run and its changes), or the
    smallest card of the catalog that fits the job as it is, with its headroom. Where no remedy
    fits but a comparable point of the sweep has no row (`missing`, from the sweep's manifest),
    the verdict is *undecided*: that point might have been the remedy."""
    cards = {c.key: c for c in catalog.cards()}
    by_name = {c.name: c for c in cards.values()}
    rows = df.to_dict("records")
    out = []
    for job in rows:
        if job.get("status") != "oom":
            continue
        card = by_name.get(job.get("gpu")) or _own_card(job)
        found: dict[str, tuple[int, dict]] = {}
        for other in rows:
            if _comparable(job, other) and _fits(other, card.key):
                changes = remedy_changes(job, other)
                if changes:
                    where = _edge(other, card.key)
                    # fewer changes first; a remedy inside the card's uncertainty after every sure one
                    rank = sum(COSTS[c["kind"]][0] for c in changes) + len(changes) * 10 + (100 if where == "tight" else 0)
                    key = repr([(c["kind"], c["value"], c["steps"]) for c in changes])  # one per distinct remedy
                    found.setdefault(key, (rank, {"run_id": other.get("run_id"), "changes": changes, "edge": where}))
        remedies = [r for _rank, r in sorted(found.values(), key=lambda x: (x[0], repr(x[1]["changes"])))[:3]]
        entry = {"run_id": job.get("run_id"), "card": card.key.removeprefix(_OWN), "kind": job.get("kind"),
                 "remedies": remedies, "card_needed": None, "card_headroom_bytes": None, "card_headroom_pct": None,
                 "card_edge": None, "missing": None}
        unrun = [m for m in missing if _comparable(job, m, ran=False) and remedy_changes(job, m)]
        if remedies:
            entry["verdict"] = "code problem"
        elif unrun:
            entry.update(verdict="undecided", missing=[" ".join(m["overrides"]) for m in unrun])
        else:
            entry.update(verdict="card problem", **_card_needed(job, cards))
        out.append(entry)
    return pd.DataFrame(out, columns=VERDICT_COLUMNS)


def _own_card(job) -> Card:
    """A card outside the catalog, as the job's row describes it."""
    return Card(name=str(job.get("gpu")), memory_bytes=int(job.get("gpu_memory_bytes") or 0),
                non_pytorch_bytes=int(job.get("gpu_non_pytorch_bytes") or 0), key=f"{_OWN}{job.get('gpu')}")


def _card_needed(job, cards: dict[str, Card]) -> dict:
    """The smallest card that surely fits the job as it is (not only inside a card's uncertainty:
    the smallest tight one where no card is sure), and its headroom (none fits: all None)."""
    fitting = [c for c in cards.values() if _fits(job, c.key)]
    if not fitting:
        return {}
    sure = [c for c in fitting if _edge(job, c.key) != "tight"]
    smallest = min(sure or fitting, key=lambda c: c.memory_bytes)
    headroom = smallest.room() - int(job.get("peak_reserved_bytes") or 0)
    return {"card_needed": smallest.key, "card_headroom_bytes": headroom,
            "card_headroom_pct": 100 * headroom / smallest.memory_bytes, "card_edge": _edge(job, smallest.key)}
