"""Code problem or card problem, and the leaks that make memory climb."""

import dataclasses

import pandas as pd
import pytest

from harness.analysis.verdict import verdicts
from harness.config import cards
from harness.probe.sim.trace import run_point
from harness.report import words
from tests.conftest import run_cli, train_point

GiB = 1024**3


def _row(**kw):
    row = {"run_id": kw.get("run_id", "r"), "model": "m", "workload": "train", "seq_len": 2048, "batch_size": 8,
           "precision": "bf16", "optimizer": "adamw", "optimizer_impl": "auto", "checkpointing": False,
           "allocator_conf": "", "leak": "none", "gpu": "T4", "status": "oom", "kind": "activations",
           "fits_cards": [], "peak_reserved_bytes": 30 * GiB}
    row.update(kw)
    return row


def _changes(v) -> list[list[tuple]]:
    return [[(c["kind"], c["value"], c["steps"]) for c in r["changes"]] for r in v["remedies"]]


def test_a_remedy_that_fits_the_card_makes_it_a_code_problem():
    df = pd.DataFrame([_row(run_id="job"),
                       _row(run_id="ckpt", checkpointing=True, status="ok", fits_cards=["t4"]),
                       _row(run_id="micro", batch_size=2, status="ok", fits_cards=["t4", "l4"]),
                       _row(run_id="odd", batch_size=3, status="ok", fits_cards=["t4"])])  # 3 does not divide 8
    v = verdicts(df).set_index("run_id").loc["job"]
    assert v["verdict"] == "code problem" and v["card_needed"] is None
    # cheapest first: accumulation (rank 2) before checkpointing (rank 3); batch 3 does not divide 8
    assert _changes(v) == [[("accumulation", "2", 4)], [("checkpointing", "True", None)]]
    assert [r["run_id"] for r in v["remedies"]] == ["micro", "ckpt"]
    assert v["remedies"][0]["changes"][0]["cost"] == "more_smaller_steps"


def test_checkpointing_with_more_recompute_is_a_remedy_for_the_per_op_policy_and_names_its_knob():
    df = pd.DataFrame([_row(run_id="op", checkpointing=True, checkpointing_policy="op"),
                       _row(run_id="full", checkpointing=True, checkpointing_policy="full", status="ok",
                            fits_cards=["t4"]),
                       _row(run_id="none", status="ok", fits_cards=["t4"])])  # takes checkpointing away
    v = verdicts(df).set_index("run_id").loc["op"]
    assert [r["run_id"] for r in v["remedies"]] == ["full"]
    change = v["remedies"][0]["changes"][0]
    assert (change["kind"], change["key"], change["was"], change["value"]) == (
        "checkpointing", "checkpointing_policy", "op", "full")
    assert words.change(change).startswith("checkpointing_policy=full")
    # a row from before the policy (read back as NaN) checkpoints each layer whole
    old = df.iloc[[0, 2]].copy()
    old.loc[:, "checkpointing"] = True
    old.loc[old["run_id"] == "none", "checkpointing_policy"] = float("nan")
    assert [c["value"] for c in verdicts(old).set_index("run_id").loc["op"]["remedies"][0]["changes"]] == ["full"]
    # a job without checkpointing: checkpointing with the per-op policy is a remedy, and says so
    df = pd.DataFrame([_row(run_id="job"), _row(run_id="op", checkpointing=True, checkpointing_policy="op",
                                                status="ok", fits_cards=["t4"])])
    change = verdicts(df).set_index("run_id").loc["job"]["remedies"][0]["changes"][0]
    assert (change["key"], change["value"], change["policy"]) == ("checkpointing", "True", "op")


def test_inference_is_served_in_waves_not_accumulated():
    df = pd.DataFrame([_row(run_id="job", workload="infer"),
                       _row(run_id="fewer", workload="infer", batch_size=4, status="ok", fits_cards=["t4"])])
    v = verdicts(df).set_index("run_id").loc["job"]
    assert v["verdict"] == "code problem" and _changes(v) == [[("waves", "4", 2)]]


def test_no_remedy_fitting_makes_it_a_card_problem_naming_the_smallest_card():
    df = pd.DataFrame([_row(run_id="job", fits_cards=["a100-80gb", "h100-80gb", "h200"]),
                       _row(run_id="ckpt", checkpointing=True, status="oom", fits_cards=["a100-40gb"])])
    v = verdicts(df).set_index("run_id").loc["job"]
    a100 = cards.by_key()["a100-80gb"]
    assert v["verdict"] == "card problem" and v["remedies"] == [] and v["card_needed"] == "a100-80gb"
    assert v["card_headroom_bytes"] == a100.room() - 30 * GiB
    assert v["card_headroom_pct"] == pytest.approx(100 * v["card_headroom_bytes"] / a100.memory_bytes)


def test_a_job_whose_remedy_never_ran_is_undecided_not_a_card_problem():
    df = pd.DataFrame([_row(run_id="job", fits_cards=["a100-80gb"]),
                       _row(run_id="ckpt", checkpointing=True, status="oom", fits_cards=["a100-40gb"])])
    unrun = [{**_row(batch_size=2), "run_id": "gone", "overrides": ["batch_size=2"]}]
    unrun[0].pop("status")
    v = verdicts(df, unrun).set_index("run_id").loc["job"]
    assert v["verdict"] == "undecided" and v["missing"] == ["batch_size=2"] and v["card_needed"] is None
    assert verdicts(df).set_index("run_id").loc["job"]["verdict"] == "card problem"  # a finished sweep
    other_seq = [{**unrun[0], "seq_len": 1024}]  # not comparable: a different sequence length
    assert verdicts(df, other_seq).set_index("run_id").loc["job"]["verdict"] == "card problem"


def test_a_verdict_in_words():
    """The one test that reads the words: report/words.py's sentences from the verdict's data."""
    df = pd.DataFrame([_row(run_id="job", leak="graph", retained_holder="a list holding Tensor()",
                            oom_phase="backward", oom_step=1, oom_module="model.layers.3.mlp"),
                       _row(run_id="fixed", status="ok", fits_cards=["t4"], batch_size=2,
                            allocator_conf="expandable_segments:True")])
    judged = words.worded_verdicts(verdicts(df), df)
    v = judged.set_index("run_id").loc["job"]
    assert v["job"] == "m train b8 s2048 bf16 ckpt=no leak=graph"
    assert v["runs_out"] == "backward of step 2 at model.layers.3.mlp"
    assert v["detail"] == ("fits with fix the graph leak (a list holding Tensor()) (no cost once the holder is fixed)"
                           " + PYTORCH_ALLOC_CONF=expandable_segments:True (no compute cost)"
                           " + micro-batch 2 x 4 accumulation steps (same effective batch; more, smaller steps)")
    card = pd.DataFrame([_row(run_id="big", fits_cards=["h200"])])
    detail = words.worded_verdicts(verdicts(card), card).set_index("run_id").loc["big", "detail"]
    assert detail.startswith("no remedy in the sweep fits; the smallest card that fits it as it is: h200 (")
    assert detail.endswith("% of the card)") and " GiB headroom, " in detail


def test_the_verdict_table_says_where_each_point_runs_out():
    """Each verdict's row says where its point runs out (words.runs_out: its first OOM's phase, step
    and module; the module left out where none is named, as a real run's; nothing for a row without
    an OOM's phase)."""
    from harness.report import tables

    df = pd.DataFrame([_row(run_id="sim", oom_phase="backward", oom_step=0, oom_module="model.layers.0.self_attn"),
                       _row(run_id="cuda", seq_len=1024, oom_phase="optimizer", oom_step=2, oom_module=None),
                       _row(run_id="none", seq_len=256)])
    judged = words.worded_verdicts(verdicts(df), df)
    header, rows = tables.verdict_table(judged)
    where = dict(zip(judged["run_id"], (r[header.index("runs out in")] for r in rows), strict=True))
    assert "model.layers.0.self_attn" in where["sim"] and "backward" in where["sim"]
    assert "optimizer" in where["cuda"] and " at " not in where["cuda"]
    assert where["none"] == ""


def test_a_remedy_never_introduces_a_leak():
    df = pd.DataFrame([_row(run_id="job"), _row(run_id="leaky", checkpointing=True, leak="graph",
                                                 status="ok", fits_cards=["t4"])])
    assert verdicts(df).set_index("run_id").loc["job", "verdict"] == "card problem"


@pytest.mark.slow  # the holder search walks every Python object
@pytest.mark.parametrize("leak", ["graph", "cycle"])
def test_leaks_make_allocated_climb_and_name_their_holder(leak):
    point = train_point(steps=4)
    point = point.replace(workload=dataclasses.replace(point.workload, leak=leak))
    m, _ = run_point(point)
    after = m["step_allocated_bytes"]
    assert after[1] < after[2] < after[3] and m["retained_bytes"] > 0
    if leak == "graph":
        assert "list holding Tensor()(grad_fn=NllLossBackward0)" in m["retained_holder"]
    else:
        assert "reference cycle through _StepState" in m["retained_holder"]


@pytest.mark.parametrize("set_aside", [False, True])
def test_a_cycles_holder_is_its_own_whatever_the_process_traced_before(set_aside):
    """Cycles an earlier trace left behind (FSDP2's parameters) are not named as the leak's holder:
    freed before the steps, or, where the process set its heap aside from the GC (a zygote's child,
    whose earlier traces' leftovers are frozen with it), passed over as holding no tensor of this
    trace's."""
    import gc

    from harness.config.point import Parallel
    from harness.probe.sim import trace

    was = (trace._set_aside, gc.get_freeze_count() > 0)
    trace._set_aside = set_aside
    try:
        if set_aside:
            gc.freeze()
        else:
            gc.unfreeze()
        run_point(train_point(batch_size=2, seq_len=32).replace(parallel=Parallel(dp_shard=2)))
        point = train_point(steps=4)
        m, _ = run_point(point.replace(workload=dataclasses.replace(point.workload, leak="cycle")))
    finally:
        trace._set_aside = was[0]
        if was[1]:
            gc.freeze()
        else:
            gc.unfreeze()
    assert m["retained_holder"].endswith("a reference cycle through _StepState; gc.collect() freed 0.4 MiB")


def test_no_leak_no_climb_no_holder():
    m, _ = run_point(train_point(steps=4))
    assert len(set(m["step_allocated_bytes"])) == 1 and m["retained_holder"] is None


@pytest.mark.slow
def test_the_four_kinds_tour_names_each_kind_with_numbers_that_agree(tmp_path):
    r = run_cli("sweep", "sweeps=four-kinds", f"results_dir={tmp_path}", timeout=900)
    assert r.returncode == 0, r.stderr
    df = pd.read_parquet(next((tmp_path / "four-kinds").iterdir()) / "results.parquet")
    room = df["gpu_memory_bytes"] - df["gpu_non_pytorch_bytes"]
    assert set(df["kind"]) >= {"static", "activations", "fragmentation", "retained"}
    static = df[df["kind"] == "static"]
    assert ((static["params_bytes"] * 2 + static["optimizer_bytes"]) > room[static.index]).all()

    def same(row, **changes):
        keys = ["precision", "checkpointing", "allocator_conf", "leak"]
        want = {k: changes.get(k, row[k]) for k in keys}
        return df[(df[keys] == pd.Series(want)).all(axis=1)].iloc[0]

    for _, row in df[df["kind"] == "activations"].iterrows():
        assert row["params_bytes"] * 2 + row["optimizer_bytes"] <= room[row.name] < row["peak_allocated_bytes"]
        fixed = same(row, checkpointing=True, allocator_conf="expandable_segments:True")
        assert fixed["status"] == "ok"
    for _, row in df[df["kind"] == "fragmentation"].iterrows():
        assert row["peak_allocated_bytes"] <= room[row.name] < row["peak_reserved_bytes"]
        assert same(row, allocator_conf="expandable_segments:True")["status"] == "ok"
    for _, row in df[df["kind"] == "retained"].iterrows():
        after = list(row["step_allocated_bytes"])
        assert all(b > a for a, b in zip(after[1:], after[2:]))
    assert "Code problem or card problem?" in r.stdout
    assert set(df.loc[df["status"] == "oom", "verdict"]) <= {"code problem", "card problem"}
    from harness.report import figures
    from tests.test_figures import _check_legible

    # the tour's own figures read as pictures too
    for fig in (figures.peak_vs_batch(df, cards.cards()), figures.step_timeline(df), figures.breakdown(df)):
        _check_legible(fig)


def test_every_key_that_varies_is_in_the_label_and_a_column():
    from harness.report import tables

    df = pd.DataFrame([_row(run_id="a", optimizer="adamw"), _row(run_id="s", optimizer="sgd"),
                       _row(run_id="w1", model="memjob:build", workload_target="memjob:build",
                            workload_args='{"width": 256}'),
                       _row(run_id="w2", model="memjob:build", workload_target="memjob:build",
                            workload_args='{"width": 512}'),
                       _row(run_id="h1", overrides="model.hf.num_hidden_layers=2"),
                       _row(run_id="h2", overrides="model.hf.num_hidden_layers=4")])
    labels = words.job_labels(df)
    assert len(set(labels.values())) == len(df)  # no two runs under one label
    assert "sgd/auto" in labels["s"] and "width=512" in labels["w2"] and "num_hidden_layers=4" in labels["h2"]
    # a job over several GPU counts (a plan's probes, whose overrides differ in a plan's own words
    # and the results dir): told apart by its GPUs
    spread = pd.DataFrame([_row(run_id=f"n{n}", world_size=n, dp_shard=n, overrides=f"x=1 results_dir=/r{n}")
                           for n in (1, 8)])
    assert words.job_labels(spread) == {"n1": "m train b8 s2048 bf16 ckpt=no GPUs 1",
                                        "n8": "m train b8 s2048 bf16 ckpt=no GPUs 8 FSDP2"}
    fit_long = pd.DataFrame([{"run_id": r, "card": "t4", "fits": True, "edge": "room", "headroom_pct": 5.0}
                             for r in df["run_id"]])
    for col in ("gpu", "backend", "kind", "peak_allocated_bytes", "peak_reserved_bytes"):
        df[col] = df.get(col, None)
    (header, rows), _ = tables.fold_constant(tables.fits_table(df, fit_long), tables.FITS_IDENTITY_COLUMNS)
    assert "optimizer" in header and "args" in header
    assert {r[header.index("optimizer")] for r in rows} == {"adamw/auto", "sgd/auto"}


def test_static_ooms_of_a_sweep_spread_over_no_more_gpus_name_the_plan_that_counts_them():
    """Points that OOM with their weights, gradients and optimizer state alone, in a sweep of one GPU
    a point, are counted, and the words give the command's own overrides to `plan
    plan.axis=world_size` (less those a plan refuses or runs otherwise: backend, the launcher, a
    plan's own search);
    nothing where the sweep spreads a point over more GPUs, or where no point is static."""
    from harness.analysis.verdict import unspread_static

    df = pd.DataFrame([_row(run_id="a", kind="static"), _row(run_id="b", kind="static", batch_size=4),
                       _row(run_id="c", kind="activations", seq_len=4096)])
    assert unspread_static(verdicts(df), df) == 2
    spread = pd.concat([df.assign(world_size=1), pd.DataFrame([_row(run_id="d", world_size=8, dp_shard=8, status="ok")])])
    assert unspread_static(verdicts(spread), spread) == 0
    assert unspread_static(verdicts(df.iloc[2:]), df.iloc[2:]) == 0
    asked = ["sweeps=./my-grid.yaml", "precision=bf16", "backend=cuda", "hydra/launcher=harness_slurm",
             "hydra.launcher.partition=gpu", "hydra.searchpath=[file:///cards]"]
    said = words.more_gpus(2, asked)
    assert "`python -m harness plan sweeps=./my-grid.yaml precision=bf16 hydra.searchpath=[file:///cards] " \
           "plan.axis=world_size`" in said
    assert said.startswith("2 point(s) OOM") and "<the same overrides>" in words.more_gpus(2)
    # a batch plan's own search gives way to the count's; its cards and margin stay
    planned = words.more_gpus(1, ["sweeps=finetune-7b", "plan.axis=seq_len", "plan.hi=64", "plan.margin=0.05"])
    assert "`python -m harness plan sweeps=finetune-7b plan.margin=0.05 plan.axis=world_size`" in planned
