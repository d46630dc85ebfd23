"""The analysis's records in words: a run's label, a remedy, a verdict. Every sentence the report,
the console and results.csv show of a verdict is made here, from the data."""

from __future__ import annotations

import pandas as pd

from harness.analysis.attention_path import MathPath
from harness.analysis.kinds import KindReading, ShapeReading
from harness.analysis.oom_text import OomReading
from harness.analysis.verdict import layout, leak_of, spread
from harness.config import alloc_conf
from harness.record.row import TRAFFIC, checkpointing_of
from harness.units import gib, gib_or_mib

# The cost codes of analysis.verdict.COSTS, as people read them.
COST_WORDS = {
    "none_once_fixed": "no cost once the holder is fixed",
    "none": "no compute cost",
    "more_smaller_steps": "same effective batch; more, smaller steps",
    "less_throughput": "the same sequences, fewer at a time; less throughput",
    "recompute": "about 20-33% more compute (one more forward per layer)",
    "optimizer_behaviour": "changes the optimizer's behaviour",
    "numerics": "changes numerics",
    "more_gpus": "more GPUs",
}


# The keys that tell two runs apart beyond the label's core (model, workload, batch, sequence,
# precision, checkpointing): each joins the label wherever it varies among the runs shown.
# checkpointing_policy's values (config.point.CheckpointingPolicy)
CHECKPOINTING_WORDS = {"full": "each layer recomputed whole", "op": "torchtitan's per-op policy: matmuls and attention kept"}
VARYING_KEYS = ("optimizer", "optimizer_impl", "workload_args", "allocator_conf", "leak", "gpu", "backend")
GPUS = "gpus"  # (words.gpus: how many GPUs a job is spread over, and how)


def _missing(v) -> bool:
    return v is None or (isinstance(v, float) and pd.isna(v))


def job_args(row) -> str:
    """A custom job's own arguments (+workload.args.*), as k=v words."""
    import json

    raw = row.get("workload_args")
    args = json.loads(raw) if isinstance(raw, str) and raw else {}
    return " ".join(f"{k}={v}" for k, v in sorted(args.items()))


def job_label(row, varying=frozenset()) -> str:
    """A run in words: model, workload, batch, sequence, precision, checkpointing; the allocator
    and leak where set; and each key of `varying` (VARYING_KEYS that differ among the runs shown)."""
    return f"{row['model']} {row['workload']} b{row['batch_size']} s{row['seq_len']} {variant_label(row, varying)}"


def gpus(row) -> str:
    """How many GPUs the run is spread over, and how ("8 FSDP2", "2 DDP", "8 FSDP2 4 x TP 2"; "1"):
    its figures are one GPU's."""
    world, reshard = spread(row)
    return "1" if world == 1 else f"{world} {layout(row)}{'' if reshard else ' (no reshard)'}"


def ckpt_word(row) -> str:
    """A row's checkpointing in a word: no | yes (each layer recomputed whole) | op (the per-op policy)."""
    ckpt = checkpointing_of(row)
    return "no" if ckpt is None else "yes" if ckpt == "full" else ckpt


def variant_label(row, varying=frozenset()) -> str:
    """A run's label without its model, workload, batch and sequence (a figure's panel and axis)."""
    parts = [f"{row['precision']} ckpt={ckpt_word(row)}"]
    if {"optimizer", "optimizer_impl"} & set(varying):
        parts.append(f"{row.get('optimizer')}/{row.get('optimizer_impl')}")
    if "workload_args" in varying and job_args(row):
        parts.append(job_args(row))
    if row.get("allocator_conf"):
        parts.append(f"alloc={row['allocator_conf']}")
    if leak_of(row) != "none":
        parts.append(f"leak={leak_of(row)}")
    for key in ("gpu", "backend"):
        if key in varying and not _missing(row.get(key)):
            parts.append(f"{key}={row[key]}")
    if GPUS in varying:
        parts.append(f"GPUs {gpus(row)}")
    return " ".join(parts)


def varying_keys(rows) -> frozenset[str]:
    """The VARYING_KEYS whose value differs among `rows` (dicts or a DataFrame), and GPUS where
    the GPUs their jobs are spread over do."""
    records = rows.to_dict("records") if isinstance(rows, pd.DataFrame) else list(rows)
    keys = {k for k in VARYING_KEYS if len({None if _missing(r.get(k)) else str(r.get(k)) for r in records}) > 1}
    return frozenset(keys | ({GPUS} if len({gpus(r) for r in records}) > 1 else set()))


def job_labels(rows) -> dict[str, str]:
    """run_id -> a label that tells it from every other run among `rows`: the varying keys join
    it, and where two runs still read alike (a key outside the record's columns, e.g. a
    model.hf override), the overrides that differ between them."""
    records = rows.to_dict("records") if isinstance(rows, pd.DataFrame) else list(rows)
    varying = varying_keys(records)
    labels = {r["run_id"]: job_label(r, varying) for r in records}
    by_label: dict[str, list[dict]] = {}
    for r in records:
        by_label.setdefault(labels[r["run_id"]], []).append(r)
    for label, same in by_label.items():
        if len({r["run_id"] for r in same}) < 2:
            continue
        tokens = [set(str(r.get("overrides") or "").split()) for r in same]
        shared = set.intersection(*tokens)
        for r, own in zip(same, tokens):
            extra = " ".join(sorted(own - shared))
            labels[r["run_id"]] = f"{label} {extra}".strip() if extra else label
    return labels


def change(c: dict, torch_version: str | None = None) -> str:
    """One change of a remedy (analysis.verdict.remedy_changes), without its cost; an allocator
    setting under the environment variable `torch_version` reads."""
    kind, value = c["kind"], c["value"]
    if kind == "leak":
        return f"fix the {c['was']} leak ({c.get('holder') or 'see diagnose'})"
    if kind == "allocator":
        return f"{alloc_conf.env_name(torch_version, value)}={value or '(default)'}"
    if kind == "accumulation":
        return f"micro-batch {value} x {c['steps']} accumulation steps"
    if kind == "waves":
        return f"{value} concurrent sequences x {c['steps']} waves"
    if kind == "checkpointing":
        if c["key"] == "checkpointing_policy":
            return f"checkpointing_policy={value} ({CHECKPOINTING_WORDS[value]})"
        return "activation checkpointing" + (" (its per-op policy)" if c.get("policy") == "op" else "")
    if kind == "sharding":
        return sharding(c)
    return f"{kind} {value}"  # optimizer, precision


def sharding(c: dict) -> str:
    """A job spread over GPUs (a remedy's sharding change), with what each GPU moves per step."""
    how = "" if c.get("reshard_after_forward", True) else ", not resharded after forward"
    moved = [f"{_MOVES[what]} {gib_or_mib(c[f'{what}_bytes'])}" for what in TRAFFIC if c.get(f"{what}_bytes")]
    traffic = f" (each GPU {_and(moved)} per step)" if moved else ""
    return (f"{c.get('layout') or 'FSDP2'} over {c['gpus']} GPUs, batch {c['batch_per_gpu']} per GPU "
            f"({c['batch_per_step']} a step){how}{traffic}")


def nccl_note(df) -> str:
    """What each spread job's GPUs leave to NCCL, per communicator count, and on whose word."""
    if "nccl_bytes" not in df:
        return ""
    seen = df[df["nccl_communicators"].fillna(0) > 0].drop_duplicates(["nccl_communicators", "nccl_bytes"])
    said = [f"{int(r.nccl_communicators)} communicator(s): {gib(r.nccl_bytes)}"
            + (f" (up to {gib(r.nccl_bytes + r.nccl_spread_bytes)})" if r.nccl_spread_bytes else "")
            for r in seen.sort_values("nccl_communicators").itertuples(index=False)]
    if not said:
        return ""
    sources = "; ".join(sorted({str(s) for s in seen["nccl_source"].dropna()}))
    return f"Each GPU's room leaves NCCL its own memory, outside PyTorch: {_and(said)} ({sources})."


_MOVES = {"all_gather": "all-gathers", "reduce_scatter": "reduce-scatters", "all_reduce": "all-reduces"}  # TRAFFIC


def _and(items: list[str]) -> str:
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"


# How a remedy's run fits the card (probe.sim.reserved.EDGES).
EDGE_FITS = {"room": "fits", "after_retry": "fits only on the allocator's retry (cache flushes)",
             "tight": "tight (fits as the card is estimated, not at the low end of its capacity and non-PyTorch memory)"}


def remedy(r: dict, torch_version: str | None = None) -> str:
    return " + ".join(f"{change(c, torch_version)} ({COST_WORDS[c['cost']]})" for c in r["changes"])


def verdict_detail(v, torch_version: str | None = None) -> str:
    """What fits (a code problem), or which card is needed (a card problem)."""
    remedies = list(v["remedies"]) if v["remedies"] is not None else []
    if v.get("verdict") == "undecided":
        unrun = list(v["missing"])
        return (f"undecided: no remedy with a row fits, and {len(unrun)} comparable point(s) have no row "
                f"(e.g. {unrun[0]}); run the sweep to its end")
    if remedies:
        return " | ".join(f"{EDGE_FITS[r.get('edge') or 'room']} with {remedy(r, torch_version)}{_per_gpu(r)}"
                          for r in remedies)
    if v["card_needed"] is None or (isinstance(v["card_needed"], float) and pd.isna(v["card_needed"])):
        return "no remedy in the sweep fits, and no card of the catalog fits the job as it is"
    where = v.get("card_edge")
    note = "" if where in (None, "room") or (isinstance(where, float) and pd.isna(where)) else f"; {EDGE_FITS[where]}"
    count = v.get("card_count")
    count = 1 if count is None or pd.isna(count) else int(count)
    needed = f"{count} x {v['card_needed']}" if count > 1 else v["card_needed"]
    return (f"no remedy in the sweep fits; the smallest card that fits it as it is: {needed} "
            f"({gib(v['card_headroom_bytes'])} headroom{' per GPU' if count > 1 else ''}, "
            f"{v['card_headroom_pct']:.0f}% of the card{note})")


def _per_gpu(r: dict) -> str:
    """A remedy over several GPUs: what each reserves and has to spare on the card."""
    if not any(c["kind"] == "sharding" for c in r["changes"]) or r.get("peak_reserved_bytes") is None:
        return ""
    return f": per-GPU reserved {gib(r['peak_reserved_bytes'])}, headroom {gib(r['headroom_bytes'])}"


def runs_out(r: dict) -> str:
    """Where a run runs out of memory on its card: the phase and step of its first OOM, and the
    module running where the trace names one (backward's too: the module whose forward made the
    op); "" where the row has none."""
    phase, step, module = r.get("oom_phase"), r.get("oom_step"), r.get("oom_module")
    if not isinstance(phase, str) or not phase:
        return ""
    at = phase if step is None or pd.isna(step) or int(step) < 0 else f"{phase} of step {int(step) + 1}"
    return f"{at} at {module}" if isinstance(module, str) and module else at


def worded_verdicts(judged: pd.DataFrame, rows: pd.DataFrame) -> pd.DataFrame:
    """The verdicts with their words: `job` (the run's label), where it runs out (`runs_out`) and
    `detail`."""
    by_id = {r["run_id"]: r for r in rows.to_dict("records")}
    labels = job_labels(rows)
    out = judged.copy()
    out["job"] = [labels[i] for i in judged["run_id"]]
    out["runs_out"] = [runs_out(by_id[i]) for i in judged["run_id"]]
    out["detail"] = [verdict_detail(v, by_id[v["run_id"]].get("torch_version"))
                     for v in judged.to_dict("records")]
    return out


# a command's overrides that `plan` refuses or runs otherwise (it runs here, on the virtual GPU), and
# another plan's search (its axis and grid)
_NOT_PLANS = ("backend", "hydra/launcher", "hydra.launcher", "plan.axis", "plan.over", "plan.lo", "plan.hi",
              "plan.step")


def more_gpus(points: int, asked: list[str] | None = None) -> str:
    """analysis.verdict.unspread_static in words: the command that answers "how many GPUs" (the
    overrides `asked` of the command that made the rows, where known)."""
    kept = [o for o in asked or [] if not o.lstrip("+~").startswith(_NOT_PLANS)]
    command = f"python -m harness plan {' '.join([*kept, 'plan.axis=world_size'])}" if asked is not None \
        else "python -m harness plan <the same overrides> plan.axis=world_size"
    return (f"{points} point(s) OOM with their weights, gradients and optimizer state alone (kind static), and none "
            f"of these points is spread over more GPUs: `{command}` finds the fewest GPUs each card needs "
            "(FSDP2; plan.over=tp or dp_replicate for the others)")


def _gib_list(values) -> str:
    return ", ".join(f"{a / 2**30:.2f}" for a in values)


def kind_reason(r: KindReading) -> str:
    """The numbers behind a run's kind, in words."""
    g = gib
    if r.rule == "status":
        return f"status {r.status}"
    if r.rule == "climb":
        return f"allocated after each step climbs ({', '.join(g(a) for a in r.after_step_bytes)})"
    if r.rule == "fits":
        return f"peak reserved {g(r.reserved_bytes)} within {g(r.room_bytes)}"
    if r.rule == "static":
        return f"weights + gradients + optimizer state = {g(r.static_bytes)} > {g(r.room_bytes)} for PyTorch"
    if r.rule == "oom_message" and r.kind == "fragmentation":
        return (f"at the OOM {g(r.oom_held_bytes)} allocated + {g(r.oom_asked_bytes)} asked fits {g(r.room_bytes)}; "
                f"{g(r.oom_cached_bytes)} was cached but unallocated")
    if r.rule == "oom_message":
        return (f"static {g(r.static_bytes)} fits {g(r.room_bytes)}; at the OOM {g(r.oom_held_bytes)} allocated + "
                f"{g(r.oom_asked_bytes)} asked does not")
    if r.rule == "peak":
        return (f"static {g(r.static_bytes)} fits {g(r.room_bytes)}; the peak, {g(r.allocated_bytes)} allocated "
                f"({g(r.allocated_bytes - r.static_bytes)} above it), does not")
    return (f"allocated {g(r.allocated_bytes)} fits {g(r.room_bytes)}; reserved {g(r.reserved_bytes)} "
            f"({g(r.reserved_bytes - r.allocated_bytes)} cached but unallocated) does not")


# A change that lifts an attention call off the math path (analysis.attention_path), in words
_LIFTS = {"grouped_heads": "K and V expanded to every query head (transformers does so where it passes a mask)",
          "disabled": "the fused kernels enabled (torch.backends.cuda.*_sdp_enabled, sdpa_kernel)",
          "head_dim": "a head dim that is a multiple of 8"}
_PRECISIONS = {"bfloat16": "bf16 (precision=bf16 or amp_bf16)", "float16": "fp16 (precision=fp16 or amp_fp16)"}


def judged_elsewhere(n: int) -> str:
    """Why `n` rows' fits may not be today's: the catalog they were judged against has changed."""
    return (f"{n} row(s) were judged against another card catalog than today's (a card's figures have changed "
            "since: calibrate measured it, or harness's catalog was updated): their fits and verdicts are that "
            "catalog's; the same command run again judges them anew from their cached traces")


def unmodelled(layers: str) -> str:
    """Why a job's figures may be off on a GPU: its layers (a row's `unmodelled`) run through cuDNN,
    whose own memory the virtual GPU does not model."""
    return (f"{layers}: a GPU runs these through cuDNN, whose own memory the virtual GPU does not model "
            "(an RNN's workspace and reserve space, a convolution's workspace; the layers are traced as "
            "the CPU runs them): the figures may be off by it")


def math_path(p: MathPath, card: str) -> str:
    """Why an attention call takes the math path on `card`, and what would give it a fused kernel."""
    c = p.call
    call = (f"{c.dtype} queries, head dim {c.head_dim}" + (", grouped key/value heads" if c.grouped else "")
            + (", a mask" if c.mask else ""))
    head = (f"attention takes the math path on {card} ({call}): each call holds its B x H x S x S scores "
            "and their softmax, which a fused kernel never makes")
    if not p.lifts:
        return head + "; no fused kernel takes such a call on this card."
    ways = [f"with {_and([_PRECISIONS[lift.dtype] if why == 'precision' and lift.dtype else _LIFTS[why] for why in lift.why])}"
            f" it would take {lift.fused}" for lift in p.lifts]
    newer = "; torch 2.14's memory-efficient kernel takes grouped heads as they are" if p.newer_torch else ""
    return head + "; " + "; ".join(ways) + newer + "."


def shape_numbers(r: ShapeReading) -> str:
    """The numbers behind a timeline's shape, in words."""
    if r.shape == "unknown":
        return "no per-step readings"
    if r.shape == "staircase":
        return f"allocated after each step climbs: {_gib_list(r.after_step_bytes)} GiB"
    if r.shape == "spike":
        return f"each step rises {r.rise_bytes / 2**30:.2f} GiB above its resting {r.rest_bytes / 2**30:.2f} GiB"
    return f"the peak is within {r.rise_bytes / 2**30:.2f} GiB of the resting {r.rest_bytes / 2**30:.2f} GiB"


def serving_why(r: dict) -> str:
    """Why the harness's frontier and vLLM's arithmetic differ, from a serving frontier row."""
    head = (f"vLLM: {r['gpu_memory_utilization']:.2f} x {r['card_memory_bytes'] / 2**30:.1f} GiB less weights "
            f"{r['weights_bytes'] / 2**30:.2f}, profiled activations {r['activation_peak_bytes'] / 2**30:.2f} "
            f"({r['profile_tokens']} tokens) and non-PyTorch {r['card_non_pytorch_bytes'] / 2**30:.2f} GiB leaves "
            f"{max(0, r['vllm_kv_bytes']) / 2**30:.2f} GiB = {r['vllm_blocks']} blocks of {r['block_size']} "
            f"tokens for the KV cache")
    if r.get("harness_cache_bytes") is None or pd.isna(r.get("harness_cache_bytes")):
        return head + "; the harness's run (HF generate) does not fit even at the smallest value."
    return (head + f". The harness runs HF generate: all {r['harness_sequences']} x {r['harness_context']} tokens "
            f"prefilled at once into a DynamicCache ({r['harness_cache_bytes'] / 2**30:.2f} GiB at full context, grown "
            f"by concatenation); its peak is in {r.get('peak_phase')} at {r.get('peak_module')} with "
            f"{(r.get('activations_bytes') or 0) / 2**30:.2f} GiB of activations and cache, where vLLM chunks prefill "
            f"to {r['profile_tokens'] + 1} tokens and preallocates its paged cache.")


def with_serving_why(rows: list[dict]) -> list[dict]:
    """Frontier rows with the `why` column (serving rows only), derived from their numbers."""
    return [{**r, "why": serving_why(r)} if r.get("kv_bytes_per_token") is not None and r.get("status") == "ok"
            else r for r in rows]


def oom_reasoning(r: OomReading) -> str:
    """The numbers behind a pasted OOM message's verdict, in words."""
    g = gib
    out = []
    if "container_pid" in r.rules:
        out.append("The one 'Process N' line is taken as this process (a container hides its pid).")
    if "no_figures" in r.rules:
        return " ".join([*out, "The message lacks the capacity or allocated figures; no verdict."])
    out.append(f"PyTorch holds {g(r.allocated_bytes)} allocated and {g(r.reserved_unallocated_bytes or 0)} "
               f"reserved but unallocated; it asked for {g(r.tried_bytes)} more. The card has "
               f"{g(r.capacity_bytes)}, of which {g(r.non_pytorch_bytes)} is outside PyTorch (CUDA context and the like)"
               + (f" and {g(r.other_processes_bytes)} is held by other processes" if r.other_processes_bytes else "")
               + (f"; {g(r.unlisted_bytes)} is held outside this process by something the message does not list "
                  "(another container's process, the driver)" if r.unlisted_bytes else "")
               + (f"; a per-process cap allows {g(r.allowed_bytes)}" if r.allowed_bytes is not None else "") + ".")
    if "request_exceeds_card" in r.rules:
        out.append(f"The request alone exceeds the {g(r.for_pytorch_bytes)} the card can give PyTorch: a card "
                   "problem, or a change that makes this allocation smaller.")
    elif "fits_defragmented" in r.rules:
        out.append(f"Allocated + the request = {g(r.need_bytes)}, which leaves {g(r.headroom_bytes)} of the "
                   f"{g(r.limit_bytes)} PyTorch can have (margin {g(r.margin_bytes)}): the memory is there but cut "
                   f"into cached pieces. Try {r.alloc_conf_env}=expandable_segments:True.")
    elif "other_processes" in r.rules or "held_outside" in r.rules:
        who = "the other processes" if "other_processes" in r.rules else "the memory held outside this process"
        out.append(f"Without {who} it would fit ({g(r.for_pytorch_bytes - r.need_bytes)} to spare): "
                   "free the card or run alone.")
    else:
        reason = f"Allocated + the request = {g(r.need_bytes)} against {g(r.limit_bytes)} PyTorch can have: "
        reason += ("even curing fragmentation leaves no real headroom" if "no_real_headroom" in r.rules
                   else "it does not fit even with no fragmentation")
        if "fraction_is_the_limit" in r.rules:
            reason += "; the per-process fraction is the limit here, not the card"
        out.append(reason + ". Reduce what the job holds (checkpointing, a smaller micro-batch, a "
                   "leaner optimizer or precision) or use a larger card.")
    return " ".join(out)


def snapshot_shape_numbers(d: dict) -> str:
    """The numbers behind a snapshot's timeline shape (analysis.timeline), in words."""
    rests = d["rest_levels_bytes"]
    if not rests:
        return "too few events"
    return (f"{len(rests) - 1} cycle(s); rest levels " + ", ".join(f"{r / 2**30:.2f}" for r in rests)
            + f" GiB; peak {d['peak_requested_bytes'] / 2**30:.2f} GiB")
