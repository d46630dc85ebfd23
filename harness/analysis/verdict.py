"""Code problem or card problem, per (job, card), from a sweep's rows.

A row that does not fit its card is a *code problem* when another row of the sweep - the same model,
workload and sequence length, at the same effective batch (a micro-batch that divides it, with
gradient accumulation; the batch per GPU times the data-parallel ranks) or spread over more GPUs with
as many sequences per GPU or fewer - fits that card: the differences between the two are the
remedy, with their cost (sharding over more GPUs: the bytes each GPU all-gathers and reduce-scatters
per step). It is a *card problem* when none does; the verdict then names the smallest (card, count)
that fits the job as it is, spread over that many GPUs where the sweep has it so (the least GPU
memory in all, then the fewest GPUs), with its headroom.

Everything here is data: a remedy is its changes (kind, the knob, its new value, the cost of it),
and a card problem names a card and the headroom in bytes. report/words.py puts them in words.
"""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd

from harness.config import cards as catalog
from harness.config import nccl
from harness.config.point import PARALLEL_KNOBS, TP_SWITCHES, Card
from harness.record.row import TRAFFIC, checkpointing_of, listed, recorded_edge, reserved_on

# What each kind of remedy costs (a code, worded by the report), and its rank: cheapest first.
COSTS = {
    "leak": (0, "none_once_fixed"),
    "allocator": (1, "none"),
    "accumulation": (2, "more_smaller_steps"),
    "waves": (2, "less_throughput"),
    "checkpointing": (3, "recompute"),
    "optimizer": (4, "optimizer_behaviour"),
    "precision": (5, "numerics"),
    "sharding": (6, "more_gpus"),
}
VERDICT_COLUMNS = ["run_id", "card", "kind", "verdict", "remedies", "card_needed", "card_count", "card_headroom_bytes",
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


def _change(kind: str, key: str, was, value, steps: int | None = None, holder: str | None = None, **more) -> dict:
    return {"kind": kind, "key": key, "was": str(was), "value": str(value), "steps": steps, "holder": holder,
            "cost": COSTS[kind][1], **more}


def global_batch(row) -> int:
    """The sequences one optimizer step takes over all GPUs: the batch per GPU times the
    data-parallel ranks (tensor-parallel ranks share a batch)."""
    shard, replicate = _val(row.get("dp_shard")), _val(row.get("dp_replicate"))
    return int(row["batch_size"]) * int(shard or 1) * int(replicate or 1)


def _sharding(job, other) -> dict | None:
    """The change of spread from `job` to `other` (more GPUs, another layout, or resharding after
    forward or not), with its cost: the bytes each GPU all-gathers, reduce-scatters and all-reduces
    per step."""
    (world, reshard, how), (world2, reshard2, how2) = (*spread(job), layout(job)), (*spread(other), layout(other))
    if (world, reshard, how) == (world2, reshard2, how2):
        return None
    degree = next((f"parallel.{k}" for k in PARALLEL_KNOBS if (_val(other.get(k)) or 1) != (_val(job.get(k)) or 1)),
                  None)
    knob = degree or ("parallel.reshard_after_forward" if reshard != reshard2 else next(
        f"parallel.{k}" for k in TP_SWITCHES if bool(_val(other.get(k))) != bool(_val(job.get(k)))))
    traffic: dict = {f"{what}_bytes": int(_val(other.get(f"{what}_bytes_per_step")) or 0) for what in TRAFFIC}
    return _change("sharding", knob, world, world2, gpus=world2, reshard_after_forward=reshard2, layout=how2,
                   batch_per_gpu=int(other["batch_size"]), batch_per_step=global_batch(other), **traffic)


def remedy_changes(job, other) -> list[dict]:
    """Each way `other` differs from `job`: kind, the knob (`key`), its value in the job (`was`) and
    in the fitting run (`value`), `steps` for accumulation or waves, the leak's `holder`, and the
    `cost` code."""
    out = []
    if leak_of(job) != "none" and leak_of(other) == "none":
        out.append(_change("leak", "leak", leak_of(job), "none", holder=_val(job.get("retained_holder"))))
    if (other.get("allocator_conf") or "") != (job.get("allocator_conf") or ""):
        out.append(_change("allocator", "allocator_conf", job.get("allocator_conf") or "", other.get("allocator_conf") or ""))
    if global_batch(other) < global_batch(job):
        steps = global_batch(job) // global_batch(other)
        # inference has no gradients to accumulate: it serves in waves
        out.append(_change("waves" if job.get("workload") == "infer" else "accumulation", "batch_size",
                           int(job["batch_size"]), int(other["batch_size"]), steps=steps))
    ckpt, ckpt2 = checkpointing_of(job), checkpointing_of(other)
    if ckpt2 is not None and ckpt is None:
        out.append(_change("checkpointing", "checkpointing", False, True, policy=ckpt2))
    elif ckpt2 is not None and ckpt2 != ckpt:  # what checkpointing keeps (more recompute, or less)
        out.append(_change("checkpointing", "checkpointing_policy", ckpt, ckpt2))
    if other.get("optimizer") != job.get("optimizer") or other.get("optimizer_impl") != job.get("optimizer_impl"):
        out.append(_change("optimizer", "optimizer", f"{job.get('optimizer')} ({job.get('optimizer_impl')})",
                           f"{other.get('optimizer')} ({other.get('optimizer_impl')})"))
    if other.get("precision") != job.get("precision"):
        out.append(_change("precision", "precision", job.get("precision"), other.get("precision")))
    sharding = _sharding(job, other)
    if sharding is not None:
        out.append(sharding)
    return out


def spread(row) -> tuple[int, bool]:
    """The GPUs a row's job is spread over and whether FSDP2 reshards after forward (1, True for
    rows from before parallel.*)."""
    world, reshard = _val(row.get("world_size")), _val(row.get("reshard_after_forward"))
    return (int(world) if world is not None else 1), reshard is None or bool(reshard)


def layout(row) -> str:
    """How a row's job is spread over its GPUs: "FSDP2", "DDP", "HSDP 2x4" (replicas x shards),
    "TP", "TP+SP" (sequence parallel), "TP+LP" (loss parallel), "FSDP2 4 x TP 2"; "" on one GPU."""
    shard, replicate, tp = (int(_val(row.get(k)) or 1) for k in PARALLEL_KNOBS)
    data = ("" if shard == replicate == 1 else "DDP" if shard == 1 else "FSDP2" if replicate == 1
            else f"HSDP {replicate}x{shard}")
    if tp == 1:
        return data
    tensor = "TP" + "".join(f"+{short}" for knob, (_what, short) in TP_SWITCHES.items() if _val(row.get(knob)))
    return f"{data} {replicate * shard} x {tensor} {tp}" if data else tensor


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
    # Spread over as many GPUs or more: a job on fewer GPUs than it has is not a remedy for it
    same = same and spread(other)[0] >= spread(job)[0]
    # The same sequences a step, in micro-batches (accumulation); or, spread over more GPUs, as many
    # or fewer per GPU (more a step: each GPU's memory is what its own batch makes it)
    divides = (global_batch(job) % global_batch(other) == 0 or
               spread(other)[0] > spread(job)[0] and int(job["batch_size"]) % int(other["batch_size"]) == 0)
    # A remedy only removes a mistake or changes a knob; it never introduces a leak, nor takes
    # checkpointing away (that would be a change no remedy lists)
    no_new_leak = leak_of(other) in ("none", leak_of(job))
    keeps_checkpointing = checkpointing_of(other) is not None or checkpointing_of(job) is None
    return same and divides and no_new_leak and keeps_checkpointing


def _remedy_key(changes: list[dict]) -> str:
    """What tells remedies apart: each change's kind, value and steps; a spread's layout alone (more
    GPUs of one layout cost more: the fewest that fit is the remedy, over 16 GPUs and not 32 too;
    and of those the job's own sequences a step, 1 per GPU over 8 GPUs for a batch of 8, not 8)."""
    return repr([(c["kind"], c.get("layout"), c["key"], c.get("reshard_after_forward"))
                 if c["kind"] == "sharding" else (c["kind"], c["value"], c["steps"]) for c in changes])


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
        found: dict[str, tuple[tuple[int, int, bool], dict]] = {}
        alike = [(other, remedy_changes(job, other)) for other in rows if _comparable(job, other)]
        for other, changes in alike:
            if changes and _fits(other, card.key):
                where = _edge(other, card.key)
                # fewer changes first; a remedy inside the card's uncertainty after every sure one; then
                # the fewest GPUs (over 2 before over 16); then the job's own sequences a step
                rank = (sum(COSTS[c["kind"]][0] for c in changes) + len(changes) * 10 + (100 if where == "tight" else 0),
                        spread(other)[0], global_batch(other) != global_batch(job))
                key = _remedy_key(changes)
                if key in found and found[key][0] <= rank:
                    continue
                reserved = reserved_on(other, card.key) or 0
                found[key] = (rank, {"run_id": other.get("run_id"), "changes": changes, "edge": where,
                                     "peak_reserved_bytes": reserved,
                                     "headroom_bytes": nccl.on_rows_rank(card, other).room() - reserved})
        remedies = [r for _rank, r in sorted(found.values(), key=lambda x: (x[0], repr(x[1]["changes"])))[:3]]
        entry = {"run_id": job.get("run_id"), "card": card.key.removeprefix(_OWN), "kind": job.get("kind"),
                 "remedies": remedies, "card_needed": None, "card_count": None, "card_headroom_bytes": None,
                 "card_headroom_pct": None, "card_edge": None, "missing": None}
        unrun = [m for m in missing if _comparable(job, m, ran=False) and remedy_changes(job, m)]
        if remedies:
            entry["verdict"] = "code problem"
        elif unrun:
            entry.update(verdict="undecided", missing=[" ".join(m["overrides"]) for m in unrun])
        else:
            # the job as it is over more GPUs (a run that OOMed on its own card may fit a larger one)
            spread_out = [o for o, changes in alike if [c["kind"] for c in changes] == ["sharding"]]
            entry.update(verdict="card problem", **_card_needed([job, *spread_out], cards))
        out.append(entry)
    return pd.DataFrame(out, columns=VERDICT_COLUMNS, dtype=object)  # None stays None (not NaN)


def _own_card(job) -> Card:
    """A card outside the catalog, as the job's row describes it."""
    return Card(name=str(job.get("gpu")), memory_bytes=int(job.get("gpu_memory_bytes") or 0),
                non_pytorch_bytes=int(job.get("gpu_non_pytorch_bytes") or 0), key=f"{_OWN}{job.get('gpu')}")


def _card_needed(runs: list[dict], cards: dict[str, Card]) -> dict:
    """The smallest (card, count) that surely fits the job as it is (not only inside a card's
    uncertainty: the smallest tight one where none is sure), of `runs` (the job, and the job spread
    over more GPUs): the least memory in all, then the fewest GPUs; with its headroom per GPU (none
    fits: {})."""
    fitting = [(run, c) for run in runs for c in cards.values() if _fits(run, c.key)]
    if not fitting:
        return {}
    sure = [(run, c) for run, c in fitting if _edge(run, c.key) != "tight"]
    run, smallest = min(sure or fitting, key=lambda rc: (spread(rc[0])[0] * rc[1].memory_bytes, spread(rc[0])[0]))
    headroom = nccl.on_rows_rank(smallest, run).room() - (reserved_on(run, smallest.key) or 0)
    return {"card_needed": smallest.key, "card_count": spread(run)[0], "card_headroom_bytes": headroom,
            "card_headroom_pct": 100 * headroom / smallest.memory_bytes, "card_edge": _edge(run, smallest.key)}


def unspread_static(judged: pd.DataFrame, rows: pd.DataFrame) -> int:
    """How many points OOM on their card with their weights, gradients and optimizer state alone
    (kind static) where none of the rows is spread over more GPUs: the answer the rows cannot give
    is how many GPUs each card needs (`plan plan.axis=world_size` gives it). 0 otherwise."""
    if judged.empty or ("world_size" in rows and (rows["world_size"].fillna(1) > 1).any()):
        return 0
    return int((judged["kind"] == "static").sum())
