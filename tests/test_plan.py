"""Capacity planning: KV-cache arithmetic, fits with a margin, frontiers against the exhaustive sweep."""

import dataclasses
import json

import pandas as pd
import pytest
from omegaconf import OmegaConf

from harness.config import cards as catalog
from harness.config.point import Card
from harness.plan import fit, serving
from harness.record import trace_store
from tests.conftest import REPO, model_cfg, run_cli

GIB = 1024**3
MIB = 1024**2


@pytest.mark.parametrize("model,precision,expected", [
    ("7b", "bf16", 524_288),  # 2 x 32 layers x 32 heads x 128 x 2 B (no GQA)
    ("llama3-8b", "bf16", 131_072),  # 8 KV heads: a quarter of the above
    ("llama3-8b", "fp32", 262_144),
    ("llama3-8b", "amp_bf16", 131_072),  # autocast: k/v projections produce bf16
    ("13b", "bf16", 819_200),  # 40 layers x 40 heads x 128
    ("70b", "bf16", 327_680),  # 80 layers x 8 KV heads x 128
])
def test_kv_bytes_per_token_match_the_closed_form(model, precision, expected):
    assert serving.kv_bytes_per_token(model_cfg(model), precision) == expected


@pytest.mark.parametrize("model", ["qwen2.5-7b", "mistral-7b", "demo-1b", "tiny"])
def test_kv_bytes_per_token_of_every_preset_follow_its_config(model):
    hf = OmegaConf.load(REPO / "harness" / "conf" / "model" / f"{model}.yaml").hf
    kv_heads = hf.get("num_key_value_heads", hf.num_attention_heads)
    head_dim = hf.get("head_dim", hf.hidden_size // hf.num_attention_heads)
    assert serving.kv_bytes_per_token(model_cfg(model), "bf16") == 2 * hf.num_hidden_layers * kv_heads * head_dim * 2


def test_vllm_arithmetic_gives_the_rest_of_the_budget_to_kv_blocks():
    card = Card(memory_bytes=80 * GIB, non_pytorch_bytes=512 * MIB)
    v = serving.vllm_capacity(card, 0.9, weights_bytes=15 * GIB, activation_peak_bytes=2 * GIB,
                              kv_per_token=131_072, block_size=16, context=8192)
    assert v["vllm_budget_bytes"] == int(72 * GIB)
    assert v["vllm_kv_bytes"] == int(72 * GIB) - 17 * GIB - 512 * MIB  # 54.5 GiB
    assert v["vllm_blocks"] == v["vllm_kv_bytes"] // (16 * 131_072)  # 27,904 blocks of 2 MiB
    assert v["vllm_max_seqs"] == 27_904 // 512  # an 8k sequence takes 512 blocks: 54 sequences
    nothing = serving.vllm_capacity(card, 0.2, 15 * GIB, 2 * GIB, 131_072, 16, 8192)
    assert nothing["vllm_blocks"] == 0 and nothing["vllm_max_seqs"] == 0


def _card(key="c", memory=10 * GIB, non_pytorch=512 * MIB):
    return Card(key=key, memory_bytes=memory, non_pytorch_bytes=non_pytorch)


def test_margin_counts_as_memory_kept_from_pytorch():
    card = _card()
    assert card.room() == 10 * GIB - 512 * MIB
    assert card.room(0.1) == 10 * GIB - 512 * MIB - int(0.1 * 10 * GIB)
    row = {"run_id": "r", "fits_cards": ["c"], "peak_allocated_bytes": 8 * GIB, "peak_reserved_bytes": 9 * GIB}
    assert fit.fits(row, card) is True  # no margin: the allocator model's verdict as recorded
    assert fit.fits(row, card, 0.1) is False  # 8 GiB allocated > 8.5 GiB room? no: 8 < 8.5; reserved 9 > 8.5
    assert fit.headroom_bytes(row, card) == 10 * GIB - 512 * MIB - 9 * GIB


def test_a_run_that_fits_only_after_a_cache_flush_is_decided_by_replaying_its_trace(tmp_path):
    # 1 GiB allocated and freed (cached), then 1.5 GiB: 2.5 GiB reserved without limit, 1.5 GiB live.
    from harness.probe.sim.tracker import TraceEvent

    events = [TraceEvent(0, "alloc", 1, GIB, "activation", "forward", 0, "m"),
              TraceEvent(1, "free", 1, GIB, "activation", "forward", 0, "m"),
              TraceEvent(2, "alloc", 2, 3 * GIB // 2, "activation", "forward", 0, "m"),
              TraceEvent(3, "free", 2, 3 * GIB // 2, "activation", "forward", 0, "m")]
    path = tmp_path / "trace.parquet"
    trace_store.to_frame(events).to_parquet(path)
    row = {"run_id": "r", "peak_allocated_bytes": 3 * GIB // 2, "peak_reserved_bytes": 5 * GIB // 2,
           "trace_path": str(path), "allocator_conf": ""}
    card = _card(memory=4 * GIB, non_pytorch=0)
    # margin 0.5: 2 GiB of room. The numbers alone cannot tell; the replay frees the cached 1 GiB
    # segment and retries, as PyTorch does.
    assert fit.fits(row, card, 0.5) is True
    assert fit.fits(row, card, 0.7) is False  # 1.2 GiB of room < 1.5 GiB allocated
    # and it is said: a fit on the allocator's retry, never a plain fit with negative headroom
    assert fit.edge(row, card, 0.5) == "after_retry" and fit.edge(row, card, 0.0) == "room"
    from harness.report import tables

    group = {"status": "ok", "axis": "batch_size", "margin": 0.5, "card": "c", "largest": 22, "first_oom": 23,
             "monotone": True, "cache_flushes": 3, "probes": 5, "grid_points": 64, "peak_reserved_bytes": 5 * GIB // 2,
             "headroom_bytes": -GIB // 2, "edge": "after_retry", "model": "m", "workload": "train",
             "precision": "bf16", "checkpointing": False, "seq_len": 1024, "batch_size": None, "allocator_conf": ""}
    _, [cells] = tables.frontier_table(pd.DataFrame([group]))
    assert cells[4] == "22 (fits on retry)" and cells[7] == "none (fits on retry)"


def test_fit_table_has_a_row_per_run_and_card_with_headroom():
    df = pd.DataFrame([{"run_id": "a", "fits_cards": ["t4", "l4"], "peak_allocated_bytes": 10 * GIB,
                        "peak_reserved_bytes": 12 * GIB}])
    cards = catalog.cards()
    long = fit.fit_table(df)
    assert len(long) == len(cards)
    t4 = long[long["card"] == "t4"].iloc[0]
    card = next(c for c in cards if c.key == "t4")
    assert t4["fits"] and t4["headroom_bytes"] == card.memory_bytes - card.non_pytorch_bytes - 12 * GIB
    assert t4["headroom_pct"] == pytest.approx(100 * t4["headroom_bytes"] / card.memory_bytes)


@pytest.mark.parametrize("args,key", [
    (["plan.axis=layers"], "plan.axis"),
    (["plan.cards=[t4,nope]"], "plan.cards"),
    (["plan.margin=1.5"], "plan.margin"),
    (["plan.lo=8", "plan.hi=4"], "plan.hi"),
    (["plan.axis=world_size", "plan.step=2"], "plan.step"),
    (["plan.axis=world_size", "workload=infer"], "parallel.dp_shard"),
    (["model=tiny", "plan.axis=seq_len", "plan.hi=99999"], "seq_len"),
])
def test_bad_plan_settings_fail_before_any_work_naming_the_key(args, key, tmp_path):
    r = run_cli("plan", *args, f"results_dir={tmp_path}")
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith(f"harness: error: {key}")
    assert not any(tmp_path.iterdir())


def _only_dir(root):
    [d] = [p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")]
    [stamp] = list(d.iterdir())
    return stamp


@pytest.mark.slow
def test_frontier_agrees_with_the_exhaustive_sweep_at_a_fraction_of_its_points(tmp_path):
    # A tiny Llama against two cards whose room the margin shrinks so that the boundaries (batch 8
    # on the L4, 11 on the A10G) lie inside the plan's grid, batch 1..32. The exhaustive sweep that
    # checks it runs 1..12: both boundaries and the first batch past each, and the plan's probes
    # among them.
    margin, checked = 0.97475, 12
    common = ["sweeps=smoke", "seq_len=256", "sweep=frontier", "plan.hi=32", f"plan.margin={margin}",
              "plan.cards=[l4,a10g]", f"results_dir={tmp_path}"]
    r = run_cli("plan", *common)
    assert r.returncode == 0, r.stderr
    plan_dir = _only_dir(tmp_path)
    fr = pd.read_parquet(plan_dir / "frontier.parquet")
    assert set(fr["card"]) == {"l4", "a10g"} and (fr["status"] == "ok").all()
    probes = int(fr["probes"].iloc[0])
    assert probes <= 12 and int(fr["grid_points"].iloc[0]) == 32
    probed = pd.read_parquet(plan_dir / "results.parquet")["batch_size"]
    assert len(probed) == probes

    r = run_cli("sweep", "sweeps=smoke", "seq_len=256", "sweep=frontier", f"batch_size=range(1,{checked + 1})",
                f"results_dir={tmp_path}", timeout=900)
    assert r.returncode == 0, r.stderr
    [sweep_dir] = [d for d in (tmp_path / "frontier").iterdir() if d != plan_dir]
    rows = pd.read_parquet(sweep_dir / "results.parquet").to_dict("records")
    assert len(rows) == checked
    # the plan's probes in the grid were not run again
    assert sum(isinstance(r["reused_from"], str) for r in rows) == (probed <= checked).sum()
    cards = {c.key: c for c in catalog.cards()}
    for f in fr.itertuples():
        fitting = [r["batch_size"] for r in rows if fit.fits(r, cards[f.card], margin)]
        assert 1 < max(fitting) < checked, "the boundary must lie inside the grid for this test to mean anything"
        assert f.largest == max(fitting) and f.first_oom == max(fitting) + 1
        assert sorted(fitting) == list(range(1, max(fitting) + 1))  # monotone, as the search assumes


@pytest.mark.slow
@pytest.mark.parametrize("tp,margin", [(1, 0.962), (2, 0.928)])  # (NCCL's 512 MiB over 2: a larger budget)
def test_a_serving_plan_puts_the_harness_beside_vllms_arithmetic(tmp_path, tp, margin):
    """Over tensor parallel, per GPU: a rank's key/value heads a token, its weights, and NCCL's
    memory beside the context's; the group says how it is spread."""
    from harness.plan import fit
    from harness.report.tables import group_label

    r = run_cli("plan", "sweeps=smoke", "workload=infer", "seq_len=1024", "sweep=serve", "plan.hi=16",
                f"plan.margin={margin}", "plan.cards=[t4]", "plan.max_num_batched_tokens=2048", f"parallel.tp={tp}",
                "workload.new_tokens=4",  # (the arithmetic is per token: four decode steps tell it)
                f"results_dir={tmp_path}")
    assert r.returncode == 0, r.stderr
    plan_dir = _only_dir(tmp_path)
    [row] = pd.read_parquet(plan_dir / "frontier.parquet").to_dict("records")
    kv = serving.kv_bytes_per_token(model_cfg("tiny"), "bf16", tp)
    assert row["kv_bytes_per_token"] == kv == 2 * 2 * (2 // tp) * 16 * 2
    assert row["profile_tokens"] == 2047 and row["gpu_memory_utilization"] == pytest.approx(1 - margin)
    profile = json.loads(next(p for p in (plan_dir / "runs").glob("*/result.json")
                              if json.loads(p.read_text())["run_id"] == row["profile_run_id"]).read_text())
    assert profile["batch_size"] == 1 and profile["seq_len"] == 2048 and profile["tp"] == tp
    t4 = fit.on_rank(profile, next(c for c in catalog.cards() if c.key == "t4"))
    expected = serving.vllm_capacity(t4, 1 - margin, row["weights_bytes"], row["activation_peak_bytes"], kv, 16, 1024)
    assert row["vllm_max_seqs"] == row["vllm_largest"] == expected["vllm_max_seqs"]
    assert row["card_non_pytorch_bytes"] == t4.non_pytorch_bytes
    assert row["largest"] >= 1 and "DynamicCache" in row["why"] and "vLLM" in row["why"]
    assert ("TP over 2 GPUs" in group_label(pd.Series(row))) == (tp == 2)
    assert "Serving" in (plan_dir / "report.md").read_text()


@pytest.mark.slow
def test_a_grids_search_bounds_follow_the_axis_searched():
    """serve-8b searches the batch up to 256 sequences; the same grid searched over the length goes
    as far as Llama-3-8B's positions (8,192), not to 256."""
    from harness.config.compose import compose
    from harness.plan.frontier import axis_values

    assert max(axis_values(compose(["sweeps=serve-8b"]))) == 256
    assert max(axis_values(compose(["sweeps=serve-8b", "plan.axis=seq_len"]))) == 8192


def test_a_plans_groups_that_differ_only_beside_the_searched_axis_are_told_apart(tmp_path):
    """Two optimizers, each traced on two cards, searched alike: the plan ends (its frontier figure
    raised on groups of one label) and each group's label names its optimizer and card. Its rows go
    where hydra.sweep.dir says, as a sweep's do, and no probe's line names it."""
    from harness.report.tables import group_labels

    r = run_cli("plan", "sweeps=smoke", "seq_len=32", "optimizer=adamw,sgd", "gpu=t4,l4", "plan.cards=[t4]",
                "plan.hi=8", f"results_dir={tmp_path}", f"hydra.sweep.dir={tmp_path}/mine")
    assert r.returncode == 0, r.stderr
    assert [p.name for p in tmp_path.iterdir() if not p.name.startswith(".")] == ["mine"]
    assert "hydra" not in r.stderr.replace(str(tmp_path), "")
    labels = group_labels(pd.read_parquet(tmp_path / "mine" / "frontier.parquet"))
    assert len(set(labels)) == len(labels) == 4
    assert {label.split(", ", 2)[2] for label in labels} == {f"optimizer {o}, traced on {c}" for o in ("adamw", "sgd")
                                                             for c in ("T4", "L4")}


def test_a_sequence_frontier_searches_multiples_of_the_step(tmp_path):
    r = run_cli("plan", "sweeps=smoke", "batch_size=2", "plan.axis=seq_len", "plan.cards=[t4,l4]",
                "plan.margin=0.96", f"results_dir={tmp_path}")
    assert r.returncode == 0, r.stderr
    fr = pd.read_parquet(_only_dir(tmp_path) / "frontier.parquet").set_index("card")
    assert fr.loc["t4", "largest"] % 128 == 0 and fr.loc["t4", "first_oom"] == fr.loc["t4", "largest"] + 128
    assert fr.loc["l4", "largest"] > fr.loc["t4", "largest"] and fr.loc["t4", "lo"] == 128
    rows = pd.read_parquet(_only_dir(tmp_path) / "results.parquet")
    assert (rows["seq_len"] % 128 == 0).all() and (rows["batch_size"] == 2).all()


@pytest.mark.slow
def test_a_count_plan_finds_each_cards_fewest_gpus_checked_at_the_count_below(tmp_path):
    """plan.axis=world_size: per card the fewest GPUs (powers of two) FSDP2 must shard the job over
    for it to fit, the count below probed and not fitting; a card it fits on one GPU says so."""
    r = run_cli("plan", "model=7b", "model.hf.num_hidden_layers=4", "batch_size=1", "seq_len=64", "precision=bf16",
                "checkpointing=false", "plan.axis=world_size", "plan.hi=8", "plan.cards=[rtx4060,t4]",
                "sweep=counts", f"results_dir={tmp_path}")
    assert r.returncode == 0, r.stderr
    plan_dir = _only_dir(tmp_path)
    fr = pd.read_parquet(plan_dir / "frontier.parquet").set_index("card")
    rows = {int(r["world_size"]): r for r in pd.read_parquet(plan_dir / "results.parquet").to_dict("records")}
    cards = {c.key: c for c in catalog.cards()}
    assert fr.loc["t4", "largest"] == 1 and pd.isna(fr.loc["t4", "first_oom"])
    fewest, below = int(fr.loc["rtx4060", "largest"]), int(fr.loc["rtx4060", "first_oom"])
    assert fewest > 1 and below == fewest // 2
    assert fit.fits(rows[fewest], cards["rtx4060"]) and not fit.fits(rows[below], cards["rtx4060"])
    assert fr.loc["rtx4060", "hi"] == 8 and fr.loc["rtx4060", "grid_points"] == 4  # 1, 2, 4, 8


def test_a_card_of_other_sms_near_its_edge_is_decided_with_its_own_kernel_scratch(tmp_path):
    """A 7.5 GiB tensor, then RMSNorm's weight gradient over 8192 tokens of 4096 traced on an H200
    (132 SMs: a 132 MiB staging buffer); on a card of 40 SMs, 1024 threads each, 20 MiB. A card of
    that kind with 7.6 GiB of room holds the run, which the H200's peaks alone would refuse."""
    from harness.config import kernels
    from harness.probe.sim.tracker import TraceEvent

    r = kernels.Reduction(4, 4096, 8192, False, 1, 4)
    h200 = kernels.Geometry(132, 2048)
    buffer, sems = kernels.reduce_buffers(r, h200)
    events = [TraceEvent(0, "alloc", 1, 15 * GIB // 2, "parameter", "setup", -1, ""),
              TraceEvent(1, "alloc", 2, buffer, "temporary", "backward", 0, "", 0, kernels.reduce_code(r, 0)),
              TraceEvent(2, "alloc", 3, sems, "temporary", "backward", 0, "", 0, kernels.reduce_code(r, 1)),
              TraceEvent(3, "free", 3, sems, "temporary", "backward", 0, ""),
              TraceEvent(4, "free", 2, buffer, "temporary", "backward", 0, "")]
    path = tmp_path / "trace.parquet"
    trace_store.to_frame(events).to_parquet(path)
    peak = 15 * GIB // 2 + buffer + 512
    row = {"run_id": "r", "peak_allocated_bytes": peak, "peak_reserved_bytes": peak + 2 * MIB,
           "trace_path": str(path), "allocator_conf": ""}
    small = dataclasses.replace(_card(memory=15 * GIB // 2 + 100 * MIB, non_pytorch=0), compute_capability="7.5",
                                multiprocessors=40)
    assert kernels.reduce_buffers(r, kernels.geometry(small))[0] < 32 * MIB < buffer
    assert fit.fits(row, small) is True
    assert fit.fits(row, dataclasses.replace(small, multiprocessors=132, compute_capability="9.0")) is False
