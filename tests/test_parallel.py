"""DDP, HSDP and tensor parallel on the virtual GPU (parallel.dp_replicate, parallel.tp): one rank
traced in a fake process group, checked against the same job on real CPU tensors in gloo
processes, one per rank (FSDP2 alone: tests/test_sharded.py)."""

import re
import shutil

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from harness.allocator.model import round_plain
from harness.config import nccl
from harness.config.models import hf_config
from harness.config.point import Parallel, Workload
from harness.errors import ConfigError
from harness.probe.sim.trace import run_point
from tests.conftest import ARCHITECTURES, hf_point, on_config, run_cli, train_point
from tests.test_sharded import _lives, _real_ranks


def _over(precision="fp32", checkpointing=False, arch=None, **parallel):
    """The tiny job spread by `parallel` (`arch`: tests/data/architectures/<arch>.json's model
    instead); checkpointing "op": with checkpointing_policy=op; "infer": serving (prefill and 4
    tokens decoded), not training."""
    if checkpointing == "infer":
        return _over(precision, arch=arch, **parallel).replace(workload=Workload(name="infer", new_tokens=4))
    point = train_point(batch_size=2, seq_len=32, precision=precision, checkpointing=bool(checkpointing)).replace(
        parallel=Parallel(**parallel), checkpointing_policy="op" if checkpointing == "op" else "full")
    return point if arch is None else on_config(point, ARCHITECTURES / f"{arch}.json")


_ORACLE = [
    (dict(dp_replicate=2), "fp32", False),
    (dict(dp_replicate=2), "bf16", True),
    (dict(tp=2), "fp32", False),
    (dict(tp=2), "bf16", True),
    (dict(dp_replicate=2, dp_shard=2), "bf16", False),  # HSDP: 2 replicas of 2 shards
    (dict(dp_shard=2, tp=2), "bf16", True),  # FSDP2 over tensor parallel (2-D)
    # the precisions and plain TP: above; torchtitan's TP: sequence and loss parallel, the per-op
    # policy (which keeps sequence parallel's reduce-scatters)
    (dict(tp=2, sequence_parallel=True, loss_parallel=True), "bf16", "op"),
    (dict(tp=2), "bf16", "infer"),  # serving: prefill into a KV cache of the rank's heads, then decode
    # plans that gather a layer's projection whole and split it again at the next (colwise_gather_output,
    # rowwise_split_input): OLMo 2's q/k/v (normed over every head), Phi-3's fused qkv and gate-up
    (dict(tp=2, arch="olmo2"), "bf16", True),
    (dict(tp=2, arch="phi3", loss_parallel=True), "fp32", False),
    (dict(tp=2, arch="gemma2"), "bf16", "infer"),  # Gemma's RMSNorm casts back with type_as: presets.composites_on_dtensors
]
_ORACLE_IDS = ["ddp-fp32", "ddp-bf16-ckpt", "tp-fp32", "tp-bf16-ckpt", "hsdp-bf16", "fsdp-tp-bf16-ckpt", "sp-lp-bf16-op",
               "tp-bf16-infer", "olmo2-tp-bf16-ckpt", "phi3-tp-lp-fp32", "gemma2-tp-bf16-infer"]


@pytest.mark.slow
@pytest.mark.parametrize("parallel,precision,checkpointing", _ORACLE, ids=_ORACLE_IDS)
def test_one_fake_rank_allocates_what_each_gloo_rank_allocates(parallel, precision, checkpointing, shared):
    """Every storage each real rank allocated (size, kind, phase, step, module, stream), in order,
    and its changes of kind, are the fake rank's; so is what each step leaves allocated. A free may
    come later on a real rank, never earlier, and within its step: gloo's worker thread lets go of a
    collective's tensors when it is done (HSDP's reduce-scatter input, all-reduced across replicas
    after it, up to 4 allocs later on its stream; the receiving rank's copy of DDP's rebuilt bucket
    indices; tensor parallel's all-reduce input; a serving step's last gather, past the step's end
    and into the next step).
    FSDP2 alone, one alloc later at most: tests/test_sharded.py."""
    point = _over(precision, checkpointing, **parallel)
    m, tracker = run_point(point, emulate_cuda=False, fake=True)
    allocs, freed, retags = _lives(tracker.journal())
    batch = [_over(p, c, **par) for par, p, c in _ORACLE]
    for rank, (after_steps, (real_allocs, real_freed, real_retags)) in _real_ranks(point, batch, shared).items():
        assert (real_allocs, real_retags) == (allocs, retags), f"rank {rank}"
        # a serving step ends gathering the head's logits: gloo's thread may still hold that
        # collective's tensors as the step's leftovers are read, never more; the last step's, as the
        # rank's journal is read too (seen under 4 workers on 2 cores)
        late = [sum(round_plain(a[0]) for a in allocs if a[3] == step and a[4] == "lm_head") if checkpointing == "infer"
                else 0 for step in range(len(after_steps))]
        held = {i for i in freed.keys() - real_freed.keys()
                if checkpointing == "infer" and allocs[i][3] == len(after_steps) - 1 and allocs[i][4] == "lm_head"}
        assert real_freed.keys() | held == freed.keys(), f"rank {rank}"
        assert all(0 <= real - fake <= lag for real, fake, lag in zip(after_steps, m["step_allocated_bytes"], late,
                                                                      strict=True)), f"rank {rank}"
        for i in (i for i in freed if i not in held and freed[i] != real_freed[i]):
            fake_at, real_at = freed[i], real_freed[i]
            assert fake_at < real_at, f"rank {rank}: alloc {i} {allocs[i]} freed earlier on the real rank"
            # (held past its step's end, as `late` allows: let go once the next step has begun)
            past = 1 if checkpointing == "infer" and allocs[i][4] == "lm_head" else 0
            assert allocs[i][3] <= allocs[real_at - 1][3] <= allocs[i][3] + past, \
                f"rank {rank}: alloc {i} {allocs[i]} freed steps later"


def test_a_ddp_rank_holds_the_whole_model_and_a_bucket_copy_of_its_gradients():
    """DDP: parameters and AdamW's state whole on each rank; its gradient buckets (a flat copy of
    every gradient, gradient_as_bucket_view=False) stay allocated between steps, are what each
    step all-reduces, and are gradients (made at wrapping and rebuilt at the second forward: never
    the setup's parameters nor the forward's activations)."""
    one, _ = run_point(_over())
    m, tracker = run_point(_over(dp_replicate=2))
    assert (m["params_bytes"], m["optimizer_bytes"]) == (one["params_bytes"], one["optimizer_bytes"])
    buckets = m["all_reduce_bytes_per_step"]
    assert buckets == one["n_params"] * 4  # fp32: every gradient once
    assert [a - b for a, b in zip(m["step_allocated_bytes"], one["step_allocated_bytes"])] == [round_plain(buckets)] * 3
    assert m["all_gather_bytes_per_step"] == m["reduce_scatter_bytes_per_step"] == 0
    kinds: dict = {}
    for e in tracker.journal():
        if e.action in ("alloc", "retag"):
            kinds[e.key] = (e.kind, e.size if e.action == "alloc" else kinds[e.key][1])
        elif e.action == "free":
            kinds.pop(e.key, None)
    assert [size for kind, size in kinds.values() if kind == "gradient"] == [buckets]  # grads were set to None


def test_a_tensor_parallel_rank_holds_its_slices_and_whole_norms():
    """TP over 2: each projection, the embedding and the head split in two (the tiny model's dims
    divide), the norms whole on every rank; the activations between layers all-reduced, the head's
    logits gathered whole (colwise_gather_output)."""
    one, _ = run_point(_over())
    m, tracker = run_point(_over(tp=2))
    hidden, layers = 64, 2
    norms = (2 * layers + 1) * hidden * 4  # fp32: two per layer and the final one
    assert m["params_bytes"] == pytest.approx((one["params_bytes"] - norms) / 2 + norms, rel=0.01)
    assert m["optimizer_bytes"] == 2 * m["params_bytes"]
    vocab, batch, seq = 512, 2, 32
    assert m["all_reduce_bytes_per_step"] > 0 and m["all_gather_bytes_per_step"] == batch * seq * vocab * 4


@pytest.mark.parametrize("arch,gathered,split", [("olmo2", ("q_proj", "k_proj", "v_proj"), ("o_proj",)),
                                                 ("phi3", ("qkv_proj", "gate_up_proj"), ("o_proj", "down_proj"))])
def test_a_plan_that_gathers_a_projection_whole_splits_its_weights_and_gathers_its_output(arch, gathered, split):
    """OLMo 2 and Phi-3 (transformers' plans: colwise_gather_output into rowwise_split_input): each
    rank holds half of every projection (the dims divide) and the norms whole. Each step gathers, in
    every layer, those projections' outputs whole (forward) and the gradient of each whole input
    the next projection split (backward: Replicate -> Shard's is a gather), and the head's logits."""
    one, _ = run_point(_over(arch=arch))
    m, _ = run_point(_over(arch=arch, tp=2))
    config = hf_config(_over(arch=arch).model)
    hidden, layers, vocab, tokens = config.hidden_size, config.num_hidden_layers, config.vocab_size, 2 * 32
    norms = sum(p.numel() for n, p in _meta_model(arch).named_parameters() if "norm" in n) * 4  # fp32
    assert m["params_bytes"] == pytest.approx((one["params_bytes"] - norms) / 2 + norms, rel=0.01)
    widths = {"q_proj": hidden, "k_proj": hidden, "v_proj": hidden, "qkv_proj": 3 * hidden, "o_proj": hidden,
              "gate_up_proj": 2 * config.intermediate_size, "down_proj": config.intermediate_size}
    per_layer = sum(widths[g] for g in (*gathered, *split))
    assert m["all_gather_bytes_per_step"] == tokens * 4 * (layers * per_layer + vocab)


def _meta_model(arch: str):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf_config(_over(arch=arch).model))


def test_tensor_parallel_that_does_not_divide_the_heads_is_refused_by_name(tmp_path):
    r = run_cli("run", "model=tiny", "parallel.tp=3", f"results_dir={tmp_path}")  # tiny: 4 heads, 2 kv heads
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith("harness: error: parallel.tp:")
    assert not list(tmp_path.rglob("result.json"))


def test_the_job_over_ddp_is_a_remedy_with_its_layout_and_all_reduce_traffic():
    """A DDP run that fits the card is a remedy for the job on one GPU at the same sequences a
    step: the change says DDP and what each GPU all-reduces per step."""
    import pandas as pd

    from harness.analysis.verdict import verdicts
    from harness.report import words
    from tests.test_verdict import _row

    GiB = 1024**3
    df = pd.DataFrame([_row(run_id="one"),
                       _row(run_id="ddp", batch_size=4, world_size=2, dp_replicate=2, status="ok", fits_cards=["t4"],
                            all_reduce_bytes_per_step=13 * GiB)])
    v = verdicts(df).set_index("run_id").loc["one"]
    (remedy,) = v["remedies"]
    (change,) = [c for c in remedy["changes"] if c["kind"] == "sharding"]
    assert (change["key"], change["layout"], change["gpus"], change["all_reduce_bytes"]) == \
        ("parallel.dp_replicate", "DDP", 2, 13 * GiB)
    assert words.sharding(change).startswith("DDP over 2 GPUs, batch 4 per GPU (8 a step) (each GPU all-reduces 13.00 GiB")
    # a decode step's: in MiB, which GiB would round to nothing
    assert "all-reduces 4.06 MiB" in words.sharding({**change, "layout": "TP", "all_reduce_bytes": 4_259_840})



def test_of_one_layout_over_several_counts_the_fewest_gpus_that_fit_is_the_remedy():
    """FSDP2 over 16, 32 and 64 GPUs each fit the card: the remedy is over 16 (more GPUs of one
    layout only cost more), and the verdict's other places go to remedies that differ (HSDP)."""
    import pandas as pd

    from harness.analysis.verdict import verdicts
    from tests.test_verdict import _row

    spread = [_row(run_id=f"fsdp{n}", batch_size=1, world_size=n, dp_shard=n, status="ok", fits_cards=["t4"])
              for n in (64, 16, 32)]
    hsdp = _row(run_id="hsdp", batch_size=1, world_size=16, dp_shard=8, dp_replicate=2, status="ok", fits_cards=["t4"])
    v = verdicts(pd.DataFrame([_row(run_id="one", batch_size=1), *spread, hsdp])).set_index("run_id").loc["one"]
    assert [r["run_id"] for r in v["remedies"]] == ["fsdp16", "hsdp"]

class _Groups(TorchDispatchMode):
    """The process groups a trace's collectives run on, by name (c10d's ops carry the group,
    functional collectives its name)."""

    def __init__(self):
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "c10d":
            self.names |= {dist.ProcessGroup.unbox(a).group_name for a in (*args, *kwargs.values())
                           if isinstance(a, torch.ScriptObject) and "ProcessGroup" in str(a)}
        elif func.namespace == "_c10d_functional" and "wait" not in func.name():
            self.names.add(args[-1])  # all_reduce(t, op, group_name), all_gather_into_tensor(t, n, group_name)
        return func(*args, **kwargs)


@pytest.mark.parametrize("parallel", [dict(dp_shard=2), dict(dp_replicate=2), dict(tp=2), dict(dp_shard=2, tp=2),
                                      dict(dp_replicate=2, dp_shard=2)], ids=["fsdp2", "ddp", "tp", "fsdp2-tp", "hsdp"])
def test_nccl_is_counted_once_per_process_group_the_ranks_collectives_run_on(parallel):
    point = train_point(batch_size=2, seq_len=32).replace(parallel=Parallel(**parallel))
    with _Groups() as groups:
        run_point(point, emulate_cuda=False, fake=True)
    mem = nccl.per_rank(point.parallel)
    assert mem.communicators == len(groups.names) > 0
    assert (mem.bytes, mem.spread_bytes) == (mem.communicators * nccl.ESTIMATE_BYTES, mem.communicators * nccl.SPREAD_BYTES)
    mine = nccl.per_rank(Parallel(**parallel, nccl_bytes_per_communicator=3 * 2**20))
    assert (mine.bytes, mine.spread_bytes, mine.source) == (mem.communicators * 3 * 2**20, 0, nccl.USER_SOURCE)


def _rows(tmp_path, *overrides) -> dict:
    import pandas as pd

    r = run_cli("run", "model=tiny", "batch_size=2", "seq_len=32", f"results_dir={tmp_path}", *overrides)
    assert r.returncode == 0, r.stderr
    (path,) = tmp_path.rglob("results.parquet")
    (row,) = pd.read_parquet(path).to_dict("records")
    for p in tmp_path.iterdir():  # the next run writes a results.parquet of its own (its trace is kept)
        if p.name != ".traces":
            shutil.rmtree(p)
    return row


@pytest.mark.slow
def test_a_card_that_holds_the_rank_but_not_nccls_memory_beside_it_is_an_oom(tmp_path):
    """NCCL's memory per rank is outside PyTorch, as the CUDA context is: a card whose room holds
    the rank's reserved peak with 256 MiB to spare fits the job with NCCL at 0 B per communicator,
    and is an OOM at the estimate (512 MiB per communicator)."""
    card = ["gpu.non_pytorch_bytes=0", "gpu.non_pytorch_spread_bytes=0", "gpu.memory_spread_bytes=0"]
    free = _rows(tmp_path, "parallel.dp_shard=2", "parallel.nccl_bytes_per_communicator=0", *card)
    assert (free["nccl_communicators"], free["nccl_bytes"], free["status"]) == (1, 0, "ok")
    size = f"gpu.memory_bytes={int(free['peak_reserved_bytes']) + 256 * 2**20}"
    fits = _rows(tmp_path, "parallel.dp_shard=2", "parallel.nccl_bytes_per_communicator=0", *card, size)
    assert fits["status"] == "ok"
    estimated = _rows(tmp_path, "parallel.dp_shard=2", *card, size)
    assert (estimated["status"], estimated["nccl_bytes"], estimated["nccl_spread_bytes"]) == \
        ("oom", nccl.ESTIMATE_BYTES, nccl.SPREAD_BYTES)
    assert estimated["nccl_source"] == nccl.ESTIMATE_SOURCE
    import pandas as pd

    from harness.report import words

    assert "1 communicator(s): 0.50 GiB (up to 1.00 GiB)" in words.nccl_note(pd.DataFrame([estimated]))
    # on the catalog's cards too: each card's room is less NCCL's memory (the row's own headroom)
    from harness.config import cards as catalog
    from harness.plan import fit

    t4 = next(c for c in catalog.cards() if c.key == "t4")
    assert fit.headroom_bytes(estimated, t4) == \
        t4.room() - nccl.ESTIMATE_BYTES - int(estimated["peak_reserved_bytes"])


@pytest.mark.parametrize("overrides,ok", [
    (["parallel.dp_shard=16"], False),  # an A100 80GB node holds 8
    (["parallel.dp_shard=16", "parallel.nodes=2"], True),
    (["parallel.dp_shard=16", "gpu.gpus_per_node=16"], True),
    (["parallel.dp_shard=8", "parallel.nodes=3"], False),  # not as many on each node
    (["parallel.nodes=2"], False),  # one GPU on two nodes
    (["gpu=rtx4090", "parallel.tp=2", "parallel.dp_shard=4"], False),  # a workstation of 4
    (["parallel.dp_shard=16", "parallel.nodes=auto"], True),
    (["parallel.nodes=two"], False),
    (["parallel.nodes=0"], False),
])
def test_a_job_over_more_gpus_than_its_nodes_hold_is_refused_naming_parallel_nodes(overrides, ok):
    from harness.config.compose import compose
    from harness.config.validate import validate

    if ok:
        assert validate(compose(["model=tiny", *overrides])).parallel.nodes >= 1
    else:
        with pytest.raises(ConfigError) as e:
            validate(compose(["model=tiny", *overrides]))
        assert e.value.key == "parallel.nodes"


def test_a_grid_over_gpu_counts_and_cards_takes_the_fewest_nodes_each_point_needs_with_nodes_auto():
    """A sweep over counts (or cards of other node sizes) crosses a node's capacity somewhere: with
    one parallel.nodes for every point it is refused as a whole, with auto each point goes on the
    fewest nodes of its card that hold it (as a plan's probes do), and the Slurm launcher asks for
    those nodes and a task per rank on each."""
    from harness.cli.common import prepare
    from harness.config.compose import as_dict, compose

    grid = ["model=tiny", "parallel.dp_shard=2,8,16", "gpu=a100-80gb,rtx4090"]
    with pytest.raises(ConfigError) as e:
        prepare("sweep", grid)
    assert e.value.key == "parallel.nodes"
    built = prepare("sweep", [*grid, "parallel.nodes=auto"]).built
    nodes = {(dict(o.split("=") for o in key)["gpu"], p.parallel.dp_shard): p.parallel.nodes for key, p in built.items()}
    assert nodes == {("a100-80gb", 2): 1, ("a100-80gb", 8): 1, ("a100-80gb", 16): 2,
                     ("rtx4090", 2): 1, ("rtx4090", 8): 2, ("rtx4090", 16): 4}  # 8 a node, 4 a node
    launcher = as_dict(compose(["hydra/launcher=harness_slurm", "backend=cuda", "model=tiny", "gpu=rtx4090",
                                "parallel.dp_shard=16", "parallel.nodes=auto"], with_hydra=True).hydra.launcher)
    assert (launcher["nodes"], launcher["tasks_per_node"]) == (4, 4)


def test_the_nodes_a_refusal_suggests_hold_the_job():
    """14 GPUs, 4 a node: 4 nodes cannot hold them as many on each; the refusal says 7, which can."""
    from harness.config.compose import compose
    from harness.config.validate import validate

    with pytest.raises(ConfigError) as e:
        validate(compose(["model=tiny", "parallel.dp_shard=14", "gpu.gpus_per_node=4"]))
    suggested = re.search(r"parallel\.nodes=(\d+)", e.value.message).group(1)
    assert suggested == "7"
    assert validate(compose(["model=tiny", "parallel.dp_shard=14", "gpu.gpus_per_node=4",
                             f"parallel.nodes={suggested}"])).parallel.nodes == 7


@pytest.mark.slow
def test_a_plan_over_tensor_parallel_counts_finds_the_fewest_gpus_per_card(tmp_path):
    """plan.axis=world_size plan.over=tp searches tensor-parallel degrees (up to the model's key/value
    heads), each probe placed on the nodes it needs; the answer is GPUs."""
    import pandas as pd

    r = run_cli("plan", "sweeps=smoke", "model=tiny", "plan.axis=world_size", "plan.over=tp", "batch_size=2",
                "seq_len=32", "plan.cards=[rtx4060]", "gpu.gpus_per_node=1", f"results_dir={tmp_path}")
    assert r.returncode == 0, r.stderr
    (path,) = tmp_path.rglob("frontier.parquet")
    (row,) = pd.read_parquet(path).to_dict("records")
    assert (row["over"], row["lo"], row["hi"], row["largest"]) == ("tp", 1, 2, 1)  # tiny: 2 kv heads; fits one
    rows = pd.read_parquet(path.parent / "results.parquet")
    assert set(zip(rows["tp"], rows["nodes"])) == {(1, 1), (2, 2)}  # a node of one GPU each


@pytest.mark.parametrize("model,degrees", [("13b", [1, 2, 4, 8]), ("qwen2.5-7b", [1, 2, 4]), ("7b", [1, 2, 4, 8, 16, 32])])
def test_a_plan_over_tensor_parallel_tries_only_degrees_that_divide_every_head_count(model, degrees):
    """13B's 40 heads: up to 8 (16 and 32 would be refused); Qwen2.5-7B's 28 query, 4 key/value heads: 4."""
    from harness.config.compose import compose
    from harness.plan.frontier import axis_values

    assert axis_values(compose([f"model={model}", "plan.axis=world_size", "plan.over=tp"])) == degrees


@pytest.mark.parametrize("over, knob, degrees", [
    ("tp", "sequence_parallel=true", [2, 4, 8]), ("tp", "loss_parallel=true", [2, 4, 8]),
    ("dp_shard", "param_dtype=bf16", [2, 4, 8, 16, 32, 64]),
    ("dp_shard", "reshard_after_forward=false", [2, 4, 8, 16, 32, 64]),
    ("dp_shard", "dp_replicate=2 tp=2", [2, 4, 8, 16, 32, 64])])
def test_a_plan_over_counts_with_a_knob_that_needs_the_degree_searches_from_two(over, knob, degrees, tmp_path):
    """Sequence and loss parallel need tp > 1, FSDP2's mixed precision and ZeRO-2-like keeping need
    dp_shard > 1, and so do replicas of a tensor-parallel job (HSDP's: DDP does not take DTensor
    parameters): a plan over that degree with one searches 2 up (not refused at 1), and its group
    says it keeps the knob."""
    from harness.config.compose import compose
    from harness.launch.point import to_point
    from harness.plan.frontier import Planner, _group_columns, axis_values

    overrides = ["model=13b", "precision=fp32", "plan.axis=world_size", f"plan.over={over}",
                 *(f"parallel.{k}" for k in knob.split())]
    assert axis_values(compose(overrides)) == degrees
    (group,) = Planner(tmp_path, tmp_path, compose, to_point).groups([overrides])
    assert group.values == degrees and getattr(group.point.parallel, over) == 2
    assert _group_columns(group.cfg, group.point, "world_size")["kept"] == knob


def test_sequence_parallel_over_a_length_its_ranks_do_not_divide_is_refused_naming_seq_len():
    point = train_point(seq_len=64)
    with pytest.raises(ConfigError) as e:
        point.replace(seq_len=63, parallel=Parallel(tp=2, sequence_parallel=True))
    assert e.value.key == "seq_len"
    assert point.replace(seq_len=63, parallel=Parallel(tp=2)).seq_len == 63  # without it, any length


@pytest.mark.parametrize("parallel,key", [(dict(tp=2, dp_shard=2), "parallel.dp_shard"),
                                          (dict(dp_replicate=2), "parallel.dp_replicate"),
                                          (dict(tp=2, sequence_parallel=True), "parallel.sequence_parallel"),
                                          (dict(tp=2, loss_parallel=True), "parallel.loss_parallel")])
def test_serving_takes_tensor_parallel_alone_and_refuses_the_rest_by_name(parallel, key):
    serving = train_point(seq_len=64).replace(workload=Workload(name="infer", new_tokens=4))
    assert serving.replace(parallel=Parallel(tp=2)).parallel.world_size == 2
    with pytest.raises(ConfigError) as e:
        serving.replace(parallel=Parallel(**parallel))
    assert e.value.key == key


def test_a_tensor_parallel_server_holds_its_heads_slice_of_the_weights_and_kv_cache():
    """Serving over TP 2: each rank holds half of every projection, the embedding and the head (the
    norms whole), and half of each layer's key/value heads in its cache; the prompt's and each
    token's layer outputs all-reduced, the head's logits gathered."""
    def serving(**parallel) -> tuple[dict, dict]:  # the run, and what it holds at its end by kind
        m, tracker = run_point(_over("bf16", "infer", **parallel))
        allocs, freed, _retags = _lives(tracker.journal())
        held: dict = {}
        for i, (size, kind, *_where) in enumerate(allocs):
            if i not in freed:
                held[kind] = held.get(kind, 0) + size
        return m, held
    (_, held_one), (two, held_two) = serving(), serving(tp=2)
    hidden, layers, ids = 64, 2, 2 * 8  # the next token of each sequence: int64
    norms = (2 * layers + 1) * hidden * 2  # bf16: two per layer and the final one (and small buffers whole)
    assert held_two["parameter"] == pytest.approx((held_one["parameter"] - norms) / 2 + norms, rel=0.001)
    assert held_two["activation"] - ids == (held_one["activation"] - ids) / 2  # the cache, 16,384 B whole
    assert two["all_reduce_bytes_per_step"] > 0 and two["all_gather_bytes_per_step"] > 0


def test_zero2_like_keeping_without_fsdp2_is_refused_naming_the_knob():
    with pytest.raises(ConfigError) as e:
        Parallel(dp_replicate=2, reshard_after_forward=False)
    assert e.value.key == "parallel.reshard_after_forward"
    assert not Parallel(dp_shard=2, reshard_after_forward=False).reshard_after_forward


def test_sequence_parallel_splits_the_residual_stream_and_trades_all_reduces_for_gathers_and_scatters():
    """TP 2 with sequence parallel: the activations between layers are each rank's half of the
    sequence (less kept for backward), the layers' all-reduces become an all-gather in and a
    reduce-scatter out, and the layers still repeat (the point is synthesized from a few)."""
    tp, _ = run_point(_over(precision="bf16", tp=2))
    sp, _ = run_point(_over(precision="bf16", tp=2, sequence_parallel=True))
    assert sp["activations_bytes"] < tp["activations_bytes"]
    assert tp["all_reduce_bytes_per_step"] > 0 and sp["all_reduce_bytes_per_step"] < tp["all_reduce_bytes_per_step"] / 10
    assert sp["reduce_scatter_bytes_per_step"] > 0 and sp["all_gather_bytes_per_step"] > tp["all_gather_bytes_per_step"]
    with pytest.raises(ConfigError) as e:
        Parallel(sequence_parallel=True)
    assert e.value.key == "parallel.sequence_parallel"



def test_a_kernels_scratch_on_dtensors_is_sized_by_what_rank_0s_kernel_runs_on():
    """kernel_scratch sizes a call on DTensors by rank 0's tensors: a sequence-parallel norm's weight
    gradient sums its slice of the tokens (half its staging buffer's bytes over 2 ranks), a
    clip over FSDP2's shards counts each shard's chunks, and where DTensor redistributes first
    (attention over a sequence's slices takes its heads' slices of the whole sequence) the
    redistributed shape."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.tensor import DTensor, Shard

    from harness.config import cards, kernels
    from harness.probe.sim import kernel_scratch
    from harness.probe.sim.sharded import process_group

    aten, g = torch.ops.aten, kernels.geometry(cards.by_key()["h200"])
    with process_group(Parallel(tp=2)) as mesh, FakeTensorMode():
        def split(local, dim):
            return DTensor.from_local(local, mesh, [Shard(dim)], run_check=False)

        mine, whole = torch.empty(2, 1024, 64, dtype=torch.bfloat16), torch.empty(2, 2048, 64, dtype=torch.bfloat16)
        staged = kernel_scratch.of(aten.sum.dim_IntList, (split(mine, 1), [0, 1]), {}, g)
        assert staged == kernel_scratch.of(aten.sum.dim_IntList, (mine, [0, 1]), {}, g)
        assert staged[0].bytes * 2 == kernel_scratch.of(aten.sum.dim_IntList, (whole, [0, 1]), {}, g)[0].bytes > 0
        shards = [split(torch.empty(16000, 4096, dtype=torch.bfloat16), 0), split(torch.empty(2048, dtype=torch.bfloat16), 0)]
        [partials] = kernel_scratch.of(aten._foreach_norm.Scalar, (shards, 2), {}, g)
        assert partials.bytes == 2 * 1000 * 4  # 16,000 x 4,096 a rank: 1,000 chunks (2,000 whole)
        q = split(torch.empty(2, 8, 512, 64, dtype=torch.bfloat16), 2)  # (2, 8, 1024, 64), the sequence split
        args = kernel_scratch.on_ranks_tensors(aten._scaled_dot_product_flash_attention.default,
                                               (q, q, q, 0.0, True), {})
        assert [tuple(a.shape) for a in args[:3]] == [(2, 4, 1024, 64)] * 3

def test_sequence_parallel_that_fits_the_card_is_a_remedy_named_by_its_knob():
    import pandas as pd

    from harness.analysis.verdict import layout, verdicts
    from tests.test_verdict import _row

    def tp8(**kw):
        return _row(world_size=8, tp=8, batch_size=1, **kw)
    df = pd.DataFrame([tp8(run_id="tp"), tp8(run_id="sp", sequence_parallel=True, status="ok", fits_cards=["t4"])])
    (remedy,) = verdicts(df).set_index("run_id").loc["tp"]["remedies"]
    (change,) = remedy["changes"]
    assert (change["key"], change["layout"]) == ("parallel.sequence_parallel", "TP+SP")
    assert layout(dict(dp_shard=4, tp=2, sequence_parallel=True)) == "FSDP2 4 x TP+SP 2"
    df = pd.DataFrame([tp8(run_id="sp", sequence_parallel=True),
                       tp8(run_id="lp", sequence_parallel=True, loss_parallel=True, status="ok", fits_cards=["t4"])])
    (change,) = verdicts(df).set_index("run_id").loc["sp"]["remedies"][0]["changes"]
    assert (change["key"], change["layout"]) == ("parallel.loss_parallel", "TP+SP+LP")


def test_loss_parallel_keeps_each_ranks_slice_of_the_logits_and_their_gradient():
    """TP 2 with loss parallel: the head's logits (and the loss's fp32 copy and gradient of them)
    are half the vocabulary on each rank, so the step's peak falls; the head's all-gather is gone."""
    tp, _ = run_point(_over(precision="bf16", tp=2, sequence_parallel=True))
    lp, _ = run_point(_over(precision="bf16", tp=2, sequence_parallel=True, loss_parallel=True))
    assert lp["peak_allocated_bytes"] < tp["peak_allocated_bytes"]
    assert lp["all_gather_bytes_per_step"] < tp["all_gather_bytes_per_step"]
    with pytest.raises(ConfigError) as e:
        Parallel(loss_parallel=True)  # no tensor parallel
    assert e.value.key == "parallel.loss_parallel"
    custom = _over(tp=2).replace(workload=Workload(name="custom", target="m:b"))
    with pytest.raises(ConfigError) as e:
        custom.replace(parallel=Parallel(tp=2, loss_parallel=True))  # a job of your own: its own plan
    assert e.value.key == "parallel.loss_parallel"


def _hf_point(tmp_path, config: dict, **parallel):
    """A job of an architecture of the user's own (model=hf, a config.json), spread by `parallel`."""
    return hf_point(tmp_path, config, batch_size=2, seq_len=32, precision="bf16").replace(
        parallel=Parallel(**parallel))


_GPT2 = {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 512, "n_positions": 64}
# DeepSeek-V3 keeps its routers' weights in fp32 (_keep_in_fp32_modules) beside bf16 layers
_DEEPSEEK = {"model_type": "deepseek_v3", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 512, "max_position_embeddings": 64,
             "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "kv_lora_rank": 16,
             "q_lora_rank": 24, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,
             "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1}
# Gemma builds its embedding scale with torch.tensor: on the meta device, a plain tensor
_GEMMA2 = {"model_type": "gemma2", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512,
           "sliding_window": 32, "query_pre_attn_scalar": 16}


@pytest.mark.parametrize("config", [_GPT2, _DEEPSEEK, _GEMMA2], ids=["gpt2", "deepseek_v3", "gemma2"])
def test_fsdp2_shards_any_causal_lms_layers_and_a_router_kept_in_fp32_apart(tmp_path, config):
    """FSDP2 over 2 shards each block transformers names unsplittable (`_no_split_modules`:
    GPT2Block, not only model.layers), a module whose parameters are of another dtype than the
    rest of its layer (a router in fp32) as a group of its own, and builds a model that makes
    constants on the meta device: each rank holds half of the parameters (within padding)."""
    one, _ = run_point(_hf_point(tmp_path, config))
    two, _ = run_point(_hf_point(tmp_path, config, dp_shard=2))
    assert two["params_bytes"] == pytest.approx(one["params_bytes"] / 2, rel=0.05)
    assert two["all_gather_bytes_per_step"] > 0 and two["reduce_scatter_bytes_per_step"] > 0


@pytest.mark.parametrize("config,why", [
    (_GPT2, "no tensor-parallel plan"),
    ({**_DEEPSEEK}, "mla_kv_a_proj"),
    ({"model_type": "qwen2_moe", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
      "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512, "num_experts": 4,
      "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64},
     "mixture-of-experts"),
], ids=["no-plan", "unknown-style", "experts"])
def test_tensor_parallel_a_model_it_cannot_spread_is_refused_before_any_work(tmp_path, config, why):
    import json

    from harness.config.compose import compose
    from harness.config.validate import validate

    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError) as e:
        validate(compose(["model=hf", f"model.config_json={tmp_path}", "seq_len=32", "parallel.tp=2"]))
    assert e.value.key == "parallel.tp" and why in str(e.value)


def test_sequence_parallel_on_layers_unlike_llamas_is_refused_naming_the_knob(tmp_path):
    """Sequence parallel follows torchtitan's Llama plan: Phi's layers (attention and MLP side by
    side, one norm) are refused before any work, naming parallel.sequence_parallel."""
    import json

    from harness.config.compose import compose
    from harness.config.validate import validate

    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "phi", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "vocab_size": 512, "max_position_embeddings": 64}))
    base = ["model=hf", f"model.config_json={tmp_path}", "seq_len=32", "parallel.tp=2"]
    validate(compose(base))  # its tensor-parallel plan is one the harness applies
    with pytest.raises(ConfigError) as e:
        validate(compose([*base, "parallel.sequence_parallel=true"]))
    assert e.value.key == "parallel.sequence_parallel" and "phi" in str(e.value)


def test_the_plan_words_validation_admits_are_the_ones_tensor_parallel_applies():
    """config.models.TP_STYLES (what validation lets through) and probe.parallelize._style (what
    the trace applies) name the same words; the replicated one is left to the replication."""
    from harness.config.models import TP_REPLICATED, TP_STYLES
    from harness.probe.parallelize import _style

    for word in TP_STYLES:
        if word != TP_REPLICATED:
            assert _style(word, "model.layers.0.mlp.up_proj") is not None
    with pytest.raises(ValueError):
        _style("mla_kv_a_proj", "model.layers.0.self_attn.kv_a_proj_with_mqa")
