"""Frontiers on the virtual GPU: per group (the grid less the searched axis) and card, the largest
value that fits, each probe a real point of the sweep (a row under runs/, like any other)."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig

from harness.analysis.verdict import layout
from harness.config import cards as catalog
from harness.config import nccl
from harness.config.models import max_positions, shape_config
from harness.config.point import PARALLEL_KNOBS, Card, Point, fewest_nodes, needs_a_degree
from harness.config.validate import validate
from harness.errors import ConfigError
from harness.launch.runner import run_point
from harness.launch.threads import map_threads
from harness.plan import fit, search, serving
from harness.units import GiB

DEFAULT_HI = {"batch_size": 256, "world_size": 64}
DEFAULT_STEP = {"batch_size": 1, "seq_len": 128}


class ProbeFailed(RuntimeError):
    def __init__(self, row: dict):
        super().__init__(f"probe {row.get('run_id')} ({row.get('status')}): {row.get('error')}")


@dataclass
class Group:
    overrides: list[str]  # the grid point without the searched axis
    cfg: DictConfig  # its composed config
    point: Point  # the same, validated
    values: list[int]  # the axis values searched


def axis_values(cfg) -> list[int]:
    """lo..hi by step for the plan's axis, defaults filled from the axis and the model."""
    plan = cfg.plan
    if plan.axis == "world_size":  # powers of two, the counts jobs are sharded over
        hi = plan.hi or DEFAULT_HI["world_size"]
        if plan.over == "tp" and not plan.hi and cfg.workload.name != "custom":
            # tensor parallel splits the heads, query and key/value alike: the largest power of two
            # dividing both (13B's 40 heads: 8, not 32)
            hf = shape_config(cfg.model)
            heads = math.gcd(*(int(getattr(hf, k, None) or 0) for k in ("num_attention_heads", "num_key_value_heads")))
            if heads:
                hi = min(hi, heads & -heads)
        # a knob that needs the degree searched (sequence parallel: tp; FSDP2's param_dtype: dp_shard)
        # makes its search start at 2
        lo = max(plan.lo, 2) if _needs_the_degree(cfg) else plan.lo
        values = [2**k for k in range(hi.bit_length()) if lo <= 2**k <= hi]
        if not values:
            raise ConfigError("plan.hi", f"no power of two between plan.lo={plan.lo} and plan.hi={hi}")
        return values
    step = plan.step or DEFAULT_STEP[plan.axis]
    hi = plan.hi or DEFAULT_HI.get(plan.axis)
    if hi is None:  # seq_len: as far as the model's positions go
        hi = max_positions(shape_config(cfg.model)) or 32768
    first = -(-plan.lo // step) * step if step > 1 else plan.lo  # multiples of the step: 128, 256, ...
    values = search.grid(first, hi, step)
    if not values:
        raise ConfigError("plan.hi", f"no value between plan.lo={plan.lo} and plan.hi={hi}")
    return values


def _needs_the_degree(cfg) -> bool:
    """Whether a world-size plan's job sets a knob that needs the degree it searches (plan.over) over
    one GPU (config.point.needs_a_degree)."""
    return cfg.plan.axis == "world_size" and cfg.plan.over in needs_a_degree(cfg.parallel).values()


class Planner:
    """Runs the probes (through the same runner as a sweep) and the searches, groups in parallel."""

    def __init__(self, out: Path, results_dir: Path, compose, to_point):
        self.out, self.results_dir = out, results_dir
        self._compose, self._to_point = compose, to_point
        self._lock = threading.Lock()  # one progress line at a time
        self._n = itertools.count()
        self.width = 1  # values of one group probed at once (set by plan())

    def say(self, line: str) -> None:
        """Progress on stderr, a line per probe (searches run for minutes at 7B)."""
        with self._lock:
            print(f"harness: plan: {line}", file=sys.stderr, flush=True)

    def groups(self, points: list[list[str]]) -> list[Group]:
        """The grid's points without the plan axis, each validated at both ends of its range."""
        seen, groups = set(), []
        for p in points:
            cfg = self._compose(p)
            if _needs_the_degree(cfg):
                cfg = self._compose([*p, f"parallel.{cfg.plan.over}=2"])  # the group as its search starts it
            point = validate(cfg)
            axis = searched_key(cfg)
            # a search over GPU counts places them on nodes itself
            mine = (axis, "parallel.nodes") if cfg.plan.axis == "world_size" else (axis,)
            rest = [o for o in p if o.split("=", 1)[0].lstrip("+~") not in mine]
            if tuple(rest) in seen:
                continue
            seen.add(tuple(rest))
            values = axis_values(cfg)
            for v in (values[0], values[-1]):
                at = [f"{axis}={v}", *(_nodes(point, v) if cfg.plan.axis == "world_size" else [])]
                try:
                    validate(self._compose([*rest, *at]))
                except ConfigError as e:
                    raise ConfigError(e.key, f"{e.message} (plan point: {' '.join([*rest, *at])})")
            groups.append(Group(rest, cfg, point, values))
        return groups

    def run(self, overrides: list[str]) -> dict:
        """One probe: a point run (or reused) like any sweep point; its row."""
        cfg = self._compose(overrides)
        point = self._to_point(cfg, overrides, results_dir=self.results_dir)
        row = run_point(point, self.out / "runs" / str(next(self._n)), self.results_dir)
        if row.get("status") not in ("ok", "oom"):
            raise ProbeFailed(row)
        return row

    def plan(self, groups: list[Group], workers: int) -> list[dict]:
        workers = max(1, workers)
        # Groups run side by side; cores left over go to probing several values of a group at once.
        self.width = max(1, workers // min(len(groups), workers))
        # Points forked from the zygote wait for one of its run slots (one per core): every group
        # may search at once, and the cores stay busy to the last group's end.
        threads = max(workers, len(groups)) if os.environ.get("HARNESS_ZYGOTE", "1") != "0" else workers
        return [r for rows in map_threads(self.plan_group, groups, threads) for r in rows]

    @staticmethod
    def cards(g: Group) -> list[Card]:
        return [c for c in catalog.cards() if not g.cfg.plan.cards or c.key in g.cfg.plan.cards]

    def plan_group(self, g: Group) -> list[dict]:
        cfg = g.cfg
        plan, axis = cfg.plan, cfg.plan.axis
        by_key = {c.key: c for c in self.cards(g)}
        rows_by_value: dict[int, dict] = {}
        # The search finds the largest value that fits, memory growing with it; per GPU it shrinks
        # with the count, so counts are searched by the share of the most GPUs each one holds
        # (most // count: 1, 2, ..., 64): the largest share that fits is the fewest GPUs, and
        # sharded state, ~1/count per GPU, grows linearly in it as the interpolation assumes.
        fewer = axis == "world_size"
        most = max(g.values)
        searched = sorted(most // c for c in g.values) if fewer else g.values
        override = searched_key(cfg)
        others = _kept_gpus(g.point) if fewer else 1

        def value(x: int | None) -> int | None:  # the axis's value at what the search holds
            return most // x if fewer and x is not None else x

        def probe(x: int) -> search.Probe:
            v = value(x)
            row = self.run([*g.overrides, f"{override}={v}", *(_nodes(g.point, v) if fewer else [])])
            rows_by_value[v] = row
            peak = row.get("peak_reserved_bytes") or row["peak_allocated_bytes"]
            gpus = f" ({v * others} GPUs)" if fewer else ""
            self.say(f"{' '.join(g.overrides)} {override}={v}{gpus}: {peak / GiB:.2f} GiB reserved "
                     f"(probe {len(rows_by_value)})")
            return search.Probe(x, int(peak), {k: bool(fit.fits(row, c, plan.margin)) for k, c in by_key.items()})

        ident = _group_columns(cfg, g.point, axis)
        try:
            s = search.search(probe, {k: c.room(plan.margin) for k, c in by_key.items()}, searched, self.width,
                              lambda vs: _together(probe, vs), ends=fewer)
            # (beside vLLM's arithmetic for a batch or length; a count's search spreads the job otherwise at each)
            serve = self._serving(g) if cfg.workload.name == "infer" and not fewer else None
        except ProbeFailed as e:
            return [{**ident, "card": k, "status": "error", "error": str(e)} for k in by_key]
        out = []
        for key, f in s.frontiers.items():
            card = by_key[key]
            # world_size: `largest` is the fewest GPUs that fit, `first_oom` the count below it
            largest, first_oom = value(f.largest), value(f.first_oom)
            row = rows_by_value.get(largest) if largest is not None else None
            if fewer:  # GPUs, not the searched degree
                largest, first_oom = (None if v is None else v * others for v in (largest, first_oom))
            rec = {**ident, "card": key, "card_memory_bytes": card.memory_bytes, "status": "ok",
                   "error": None, "largest": largest, "first_oom": first_oom,
                   "monotone": f.monotone, "probes": len(s.probes), "grid_points": len(g.values),
                   "lo": g.values[0] * others, "hi": g.values[-1] * others, "step": 0 if fewer else _step(g.values),
                   "peak_reserved_bytes": fit.reserved_on(row, card) if row else None,  # as the card runs it
                   "peak_allocated_bytes": row.get("peak_allocated_bytes") if row else None,
                   "headroom_bytes": fit.headroom_bytes(row, card, plan.margin) if row else None,
                   "edge": fit.edge(row, card, plan.margin) if row else None,
                   "cache_flushes": fit.cache_flushes(row, card, plan.margin) if row else None,
                   "peak_phase": row.get("peak_phase") if row else None,
                   "peak_module": row.get("peak_module") if row else None,
                   "activations_bytes": row.get("activations_bytes") if row else None,
                   "run_id": row.get("run_id") if row else None}
            if serve is not None:
                rec.update(serving.compare(nccl.on_rank(card, g.point.parallel), cfg, serve, largest, row))
            out.append(rec)
        return sorted(out, key=lambda r: r["card_memory_bytes"])

    def _serving(self, g: Group) -> dict:
        """What vLLM's profile run would measure: one prefill of max_num_batched_tokens (capped by
        the model's positions), run on the virtual GPU; weights and KV bytes per token."""
        cfg = g.cfg
        limit = max_positions(shape_config(cfg.model)) or cfg.plan.max_num_batched_tokens
        tokens = min(cfg.plan.max_num_batched_tokens, limit)
        keep = [o for o in g.overrides if o.split("=", 1)[0].lstrip("+~") not in
                ("batch_size", "seq_len", "workload.new_tokens")]
        row = self.run([*keep, "batch_size=1", f"seq_len={tokens}", "workload.new_tokens=1"])
        kv = serving.kv_bytes_per_token(cfg.model, cfg.precision, cfg.parallel.tp)
        prompt = tokens - 1
        # The prefill's peak less the weights and the prompt's own KV (vLLM profiles without a cache).
        act = int(row["step_peak_bytes"][0]) - int(row["params_bytes"]) - kv * prompt
        return {"profile_tokens": prompt, "weights_bytes": int(row["params_bytes"]),
                "activation_peak_bytes": max(0, act), "kv_bytes_per_token": kv,
                "profile_run_id": row["run_id"]}


def searched_key(cfg) -> str:
    """The override a plan's search sets (plan.axis, or the parallel.* degree plan.over)."""
    return f"parallel.{cfg.plan.over}" if cfg.plan.axis == "world_size" else str(cfg.plan.axis)


def _kept_gpus(point: Point) -> int:
    """A world-size plan's GPUs per unit of the degree it searches (plan.over): the others' product."""
    return point.parallel.world_size // getattr(point.parallel, point.plan.over)


def _nodes(point: Point, degree: int) -> list[str]:
    """The nodes a world-size probe's GPUs go on (plan.over at `degree`), on the point's card."""
    return [f"parallel.nodes={fewest_nodes(_kept_gpus(point) * degree, point.gpu.gpus_per_node)}"]


def _together(probe, values: list[int]) -> list:
    if len(values) == 1:
        return [probe(values[0])]
    return map_threads(probe, values, len(values))


def _step(values: list[int]) -> int:
    return values[1] - values[0] if len(values) > 1 else 1


def _group_columns(cfg, point: Point, axis: str) -> dict:
    custom = cfg.workload.name == "custom"  # a user's job: named by its build function
    cols = {"model": cfg.workload.target if custom else cfg.model.name, "workload": cfg.workload.name,
            "precision": cfg.precision,
            "checkpointing": bool(cfg.checkpointing),
            "checkpointing_policy": str(cfg.checkpointing_policy) if cfg.checkpointing else None,
            "optimizer": cfg.optimizer.name, "optimizer_impl": cfg.optimizer.impl,
            "allocator_conf": cfg.allocator.conf, "leak": cfg.workload.leak, "axis": axis,
            "traced_on": point.gpu.name,  # the card its probes are traced on (plan.cards: judged)
            "batch_size": cfg.batch_size if axis != "batch_size" else None,
            "world_size": None if axis == "world_size" else point.parallel.world_size,
            # world_size: the degree searched, and the others the group keeps ("tp=2")
            "over": point.plan.over if axis == "world_size" else None,
            "kept": " ".join([*(f"{k}={getattr(point.parallel, k)}" for k in PARALLEL_KNOBS
                                if k != point.plan.over and getattr(point.parallel, k) > 1),
                              *(f"{k}={str(getattr(point.parallel, k)).lower()}" for k in needs_a_degree(point.parallel)
                                if k not in PARALLEL_KNOBS)])
            if axis == "world_size" else None,
            "seq_len": cfg.seq_len if axis != "seq_len" else None, "margin": float(cfg.plan.margin),
            # a batch or length searched over several GPUs: how (the groups of one job apart)
            "layout": None if axis == "world_size" else layout(dataclasses.asdict(point.parallel)) or None}
    if custom:
        cols["workload_args"] = json.dumps(dict(cfg.workload.args or {}), sort_keys=True, default=str)
    return cols
