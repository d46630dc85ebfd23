"""Every documented value of every knob, and their combinations: each cell is a point that runs to
a row (ok or oom), or is refused before anything runs with one line naming the key.

The whole product is checked for refusal (cheap: a point checks itself on construction). What runs
is an all-pairs cover of it: every pair of values of any two knobs runs together at least once,
on a tiny preset and on each example job.
"""

import dataclasses
import functools
import itertools
from pathlib import Path

import pytest

from harness.config.compose import compose
from harness.config.point import Leak, OptimizerImpl, OptimizerName, Parallel, Precision, WorkloadName
from harness.errors import ConfigError
from harness.launch.point import to_point
from harness.probe.worker import run_sim
from tests.conftest import REPO, train_point

ALLOCATORS = sorted(p.stem for p in (REPO / "harness" / "conf" / "allocator").glob("*.yaml"))
PRESET_KNOBS = {
    # checkpointing "op": checkpointing=true with checkpointing_policy=op
    "precision": list(Precision), "checkpointing": [False, True, "op"], "optimizer": list(OptimizerName),
    "impl": list(OptimizerImpl), "workload": [WorkloadName.train, WorkloadName.infer],
    "allocator": ALLOCATORS, "leak": list(Leak),
}
EXAMPLES = ["examples.gpt:build", "examples.resnet:build", "examples.leaky:build"]
JOB_KNOBS = {k: PRESET_KNOBS[k] for k in ("precision", "checkpointing", "impl", "allocator")}


def _overrides(cell: dict) -> list[str]:
    out = [f"precision={cell['precision']}", f"checkpointing={str(bool(cell['checkpointing'])).lower()}",
           f"checkpointing_policy={'op' if cell['checkpointing'] == 'op' else 'full'}",
           f"optimizer.impl={cell['impl']}", f"allocator={cell['allocator']}"]
    if "target" in cell:
        return ["workload=custom", f"workload.target={cell['target']}", "batch_size=2", "seq_len=32",
                "+workload.args.width=64", "+workload.args.layers=2", "+workload.args.d_model=64",
                "+workload.args.image_size=32", "workload.steps=2",
                *out]
    # The optimizer as a user asks for one: named where it is not the default (adamw, impl auto)
    asked = [f"optimizer={cell['optimizer']}"] * (cell["optimizer"] != "adamw")
    out = [o for o in out if o != "optimizer.impl=auto"]
    return ["model=tiny", f"workload={cell['workload']}", f"workload.leak={cell['leak']}", *asked,
            "batch_size=2", "seq_len=64",
            "workload.new_tokens=2" if cell["workload"] == "infer" else "workload.steps=2", *out]


@functools.cache
def _base():
    return to_point(compose(["model=tiny"]), [])


@functools.cache
def _conf(allocator: str) -> str:
    return str(compose([f"allocator={allocator}"]).allocator.conf)


def _refusal(cell: dict) -> str | None:
    """The key a cell is refused by, from the point's own checks and the command line's (a knob
    asked for that the job ignores), before anything runs (None: it is a point)."""
    from harness.cli.common import _ignored

    base = _base()
    try:
        point = dataclasses.replace(
            base, precision=cell["precision"], checkpointing=bool(cell["checkpointing"]),
            checkpointing_policy="op" if cell["checkpointing"] == "op" else "full",
            optimizer=dataclasses.replace(base.optimizer, name=cell["optimizer"], impl=cell["impl"]),
            workload=dataclasses.replace(base.workload, name=cell["workload"], leak=cell["leak"]),
            allocator=dataclasses.replace(base.allocator, conf=_conf(cell["allocator"])))
    except ConfigError as e:
        assert "\n" not in str(e)
        return e.key
    # asked of one point (a cell), a knob its job ignores is refused
    return next(iter(_ignored("sweep", point, _overrides(cell))), None)
    return None


def _product(knobs: dict) -> list[dict]:
    return [dict(zip(knobs, values)) for values in itertools.product(*knobs.values())]


def all_pairs(cells: list[dict]) -> list[dict]:
    """A few cells covering every pair of values that the cells hold together (greedy)."""
    def pairs(cell):
        items = sorted((k, str(v)) for k, v in cell.items())
        return set(itertools.combinations(items, 2))

    uncovered = set().union(*(pairs(c) for c in cells))
    chosen = []
    while uncovered:
        best = max(cells, key=lambda c: len(pairs(c) & uncovered))
        chosen.append(best)
        uncovered -= pairs(best)
    return chosen


def test_every_cell_of_the_presets_knobs_is_a_point_or_refused_by_one_key():
    refused: dict = {}
    for cell in _product(PRESET_KNOBS):
        key = _refusal(cell)
        if key is not None:
            refused.setdefault(key, []).append(cell)
    # exactly what cannot be: Adafactor has no fused form; the leaks are training-loop mistakes;
    # inference has no backward to checkpoint and no optimizer step
    assert set(refused) == {"optimizer.impl", "workload.leak", "checkpointing", "optimizer"}
    infer = [c for c in _product(PRESET_KNOBS) if c["workload"] == "infer"]
    assert all((c["optimizer"], c["impl"]) == ("adafactor", "fused") or (c["workload"] == "infer" and c["impl"] != "auto")
               for c in refused["optimizer.impl"])
    assert all(c["workload"] == "infer" and c["leak"] != "none" for c in refused["workload.leak"])
    assert refused["checkpointing"] == [c for c in infer if c["checkpointing"] and c["leak"] == "none"
                                        and (c["optimizer"], c["impl"]) != ("adafactor", "fused")]
    assert all(c["workload"] == "infer" and c["optimizer"] != "adamw" for c in refused["optimizer"])
    assert [c for c in infer if _refusal(c) is None] == [
        c for c in infer if not c["checkpointing"] and c["leak"] == "none" and (c["optimizer"], c["impl"]) == ("adamw", "auto")]


def _runnable_preset_cells() -> list[dict]:
    return [c for c in _product(PRESET_KNOBS) if _refusal(c) is None]


PRESET_CELLS = all_pairs(_runnable_preset_cells())
JOB_CELLS = [{**c, "target": t} for t in EXAMPLES for c in all_pairs(_product(JOB_KNOBS))]


def _run(cell, tmp_path: Path) -> dict:
    overrides = _overrides(cell)
    point = to_point(compose(overrides), overrides, str(REPO))
    return run_sim(point, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("cell", PRESET_CELLS + JOB_CELLS, ids=lambda c: "-".join(str(v) for v in c.values()))
def test_every_pair_of_knob_values_runs_to_a_row_on_the_preset_and_each_example_job(cell, tmp_path):
    rec = _run(cell, tmp_path)
    assert rec["status"] in ("ok", "oom"), rec.get("error")
    assert rec["peak_allocated_bytes"] > 0


# The ways a job's parameters are spread: FSDP2's shards and TP's slices are DTensors, DDP's are not
LAYOUTS = {"fsdp2": Parallel(dp_shard=2), "ddp": Parallel(dp_replicate=2), "tp": Parallel(tp=2),
           "hsdp": Parallel(dp_shard=2, dp_replicate=2), "fsdp2+tp": Parallel(dp_shard=2, tp=2)}


def test_every_optimizer_and_implementation_over_each_layout_is_a_point_or_refused_by_one_key():
    base = train_point()
    refused = {}
    for (layout, parallel), name, impl in itertools.product(LAYOUTS.items(), OptimizerName, OptimizerImpl):
        try:
            base.replace(parallel=parallel, optimizer=dataclasses.replace(base.optimizer, name=name, impl=impl))
        except ConfigError as e:
            assert "\n" not in str(e)
            refused[(layout, name, impl)] = e.key
    dtensors = {"fsdp2", "tp", "hsdp", "fsdp2+tp"}
    # Adafactor has no fused form and does not run on DTensors; torch's fused SGD has no DTensor rule
    assert refused == {
        **{(lay, "adafactor", "fused"): "optimizer.impl" for lay in LAYOUTS},
        **{(lay, "adafactor", impl): "optimizer.name" for lay in dtensors for impl in OptimizerImpl if impl != "fused"},
        **{(lay, "sgd", "fused"): "optimizer.impl" for lay in dtensors}}


@pytest.mark.parametrize("optimizer, runs", [("sgd", False), ("adamw", True)])
def test_a_fused_optimizer_over_fsdp2_is_refused_exactly_where_torch_cannot_run_it(optimizer, runs):
    from harness.probe.sim.trace import run_point

    point = train_point(optimizer=optimizer, impl="fused", steps=2)
    object.__setattr__(point, "parallel", LAYOUTS["fsdp2"])  # past the refusal: what torch itself does
    if runs:
        assert run_point(point)[0]["peak_allocated_bytes"] > 0
    else:
        with pytest.raises(NotImplementedError, match="_fused_sgd_"):
            run_point(point)


def test_checkpointing_a_job_with_nothing_to_checkpoint_is_refused_with_the_reason(tmp_path):
    from harness.probe.jobs import UserCodeError
    from harness.probe.sim.trace import run_point

    overrides = ["workload=custom", "workload.target=tests.jobs.no_blocks:build", "checkpointing=true"]
    point = to_point(compose(overrides), overrides, str(REPO))
    with pytest.raises(UserCodeError, match="nothing would be checkpointed"):
        run_point(point)
    assert run_sim(point.replace(checkpointing=False), tmp_path)["status"] == "ok"


def test_the_per_op_policy_without_checkpointing_is_refused_by_its_key():
    with pytest.raises(ConfigError) as e:
        to_point(compose(["model=tiny", "checkpointing_policy=op"]), [])
    assert e.value.key == "checkpointing_policy"
    assert to_point(compose(["model=tiny", "checkpointing=true", "checkpointing_policy=op"]), []).checkpointing


@pytest.mark.parametrize("passes_it_on", [False, True])
def test_a_job_that_checkpoints_itself_must_pass_the_per_op_policy_on(passes_it_on, tmp_path):
    from harness.probe.jobs import UserCodeError
    from harness.probe.sim.trace import run_point

    overrides = ["workload=custom", "workload.target=tests.jobs.own_checkpointing:build", "checkpointing=true",
                 "checkpointing_policy=op", f"+workload.args.passes_policy={passes_it_on}"]
    point = to_point(compose(overrides), overrides, str(REPO))
    if passes_it_on:
        assert run_sim(point, tmp_path)["status"] == "ok"
    else:
        with pytest.raises(UserCodeError, match="Knobs.checkpointing_policy"):
            run_point(point)
