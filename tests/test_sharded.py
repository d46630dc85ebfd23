"""A job over several GPUs on the virtual GPU (parallel.*): FSDP2 traced as rank 0 of a fake
process group, checked against the same job on real CPU tensors in gloo processes, one per rank."""

import contextlib
import dataclasses
import hashlib
import json
import os
import socket

import pytest
import torch.multiprocessing as mp

from harness.config.point import Parallel, Point
from harness.errors import ConfigError
from harness.probe.sim.trace import run_point
from tests.conftest import run_cli, train_point


def _sharded(world: int = 2, param_dtype: str | None = None, checkpointing=False, **kw) -> Point:
    """FSDP2 over `world`; checkpointing "op": with checkpointing_policy=op."""
    return train_point(batch_size=2, seq_len=32, checkpointing=bool(checkpointing), **kw).replace(
        parallel=Parallel(dp_shard=world, param_dtype=param_dtype),
        checkpointing_policy="op" if checkpointing == "op" else "full")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _real_rank(rank: int, world: int, port: int, points: list[dict], out) -> None:  # (tests.test_parallel's too)
    """One rank of each job in turn on real CPU tensors (gloo, one process group), tracked as the
    virtual GPU tracks."""
    import traceback

    import torch.distributed as dist

    from harness.probe.sim.tracker import StorageTracker

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    end_step = StorageTracker.end_step

    def end_after_barrier(self):  # gloo's worker thread lets go of the last collective once it takes the next
        self.inside_collective += 1  # (the barrier's own byte is gloo's; a free meanwhile is the step's)
        dist.barrier()
        self.inside_collective -= 1
        end_step(self)
    try:
        for i, point in enumerate(points):
            try:
                # A decode step ends with a collective (the head's logits gathered): what it leaves
                # is read once gloo's thread has let go of it
                serving = point["workload"]["name"] == "infer"
                StorageTracker.end_step = end_after_barrier if serving else end_step  # type: ignore[method-assign]
                m, tracker = run_point(Point.from_dict(point), emulate_cuda=False, fake=False)
                out.put((i, rank, m["step_allocated_bytes"], _lives(tracker.journal())))
            except Exception:
                out.put((i, rank, None, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


def _lives(journal: list) -> tuple[list, dict, list]:
    """Each storage in allocation order (size, kind, phase, step, module, stream), when it was
    freed (how many allocs came before its free) and its changes of kind: the journal, less the
    order of frees among themselves."""
    allocs: list[tuple] = []
    number: dict[int, int] = {}  # live key -> its alloc's number
    freed: dict[int, int] = {}
    retags: list[tuple] = []
    for e in journal:
        if e.action == "alloc":
            number[e.key] = len(allocs)
            allocs.append((e.size, e.kind, e.phase, e.step, e.module, e.stream))
        elif e.action == "free" and e.key in number:
            freed[number.pop(e.key)] = len(allocs)
        elif e.action == "retag" and e.key in number:
            retags.append((number[e.key], e.kind))
    return allocs, freed, retags


def _key(p: Point) -> str:
    return json.dumps(p.to_dict(), sort_keys=True, default=str)


def _run_real(world: int, points: list[Point]) -> dict[str, dict[int, tuple]]:
    """Each point's real ranks (rank -> (steps, lives)), the points one after another in one set of
    `world` gloo processes."""
    # Ranks forked from a server that imported torch, transformers and the tracer once (5-6 s of
    # CPU a rank when each imports them itself); it has run no kernel, so no thread pool is forked.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["tests.test_sharded", "harness.probe.sim.trace", "harness.probe.presets",
                                "transformers.models.llama.modeling_llama"])
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_real_rank, args=(r, world, port, [p.to_dict() for p in points], out))
             for r in range(world)]
    for p in procs:
        p.start()
    got: dict[int, dict[int, tuple]] = {}
    for _ in range(len(points) * world):
        i, rank, steps, lives = out.get(timeout=300)
        got.setdefault(i, {})[rank] = (steps, lives)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    return {_key(p): got[i] for i, p in enumerate(points)}


def _real_ranks(point: Point, batch: list[Point], shared) -> dict[int, tuple]:
    """Each real rank's (what each step left allocated, _lives) for `point`, one of `batch`. The
    batch's points of its world size run together once a session (tests.conftest.Shared): a
    process's start (imports, 5 s) is paid once for them all, whichever worker asks first."""
    world = point.parallel.world_size
    todo = {_key(p): p for p in batch if p.parallel.world_size == world}
    assert _key(point) in todo, "the point is one of its batch"
    name = f"gloo-{world}-{hashlib.sha1(''.join(sorted(todo)).encode()).hexdigest()[:12]}"
    ranks = shared.value(name, lambda: _run_real(world, list(todo.values())))[_key(point)]
    failed = [lives for steps, lives in ranks.values() if steps is None]
    assert not failed, failed[0]
    return ranks


_ORACLE = [
    ("fp32", False, None), ("bf16", True, None),  # each precision, each way
    # torchtitan's: fp32 shards, gathered and computed in bf16 (FSDP2's MixedPrecisionPolicy), its per-op
    # selective checkpointing
    ("fp32", "op", "bf16"),
]


# Users' jobs that spread themselves over Knobs.mesh: a Llama made whole, then FSDP2 per layer and
# the root; examples/gpt.py's GPT by FSDP2, and by DDP
_USERS_JOBS = [("tests.jobs.fsdp_job:build", Parallel(dp_shard=2)), ("examples.gpt:build", Parallel(dp_shard=2)),
               ("examples.gpt:build", Parallel(dp_replicate=2))]


def _users_job(target: str, parallel: Parallel) -> Point:
    from tests.test_workload import SMALL, custom_point

    return custom_point(target, SMALL.get(target), batch_size=2, seq_len=32).replace(parallel=parallel)


def _oracle_points() -> list[Point]:
    """Every job this module checks against gloo ranks (run in one set of processes)."""
    return [*(_sharded(precision=p, checkpointing=c, param_dtype=d) for p, c, d in _ORACLE),
            *(_users_job(*job) for job in _USERS_JOBS)]


@pytest.mark.slow
@pytest.mark.parametrize("precision,checkpointing,param_dtype", _ORACLE)
def test_one_fake_rank_traces_what_each_gloo_rank_allocates(precision, checkpointing, param_dtype, shared):
    """FSDP2 over 2 ranks: the fake trace of rank 0 equals, entry for entry, what each rank of the
    same job on real CPU tensors in two gloo processes allocated (shards padded alike: rank 1 too;
    what gloo allocates inside a collective is its own, as NCCL's is), but for the timing of gloo's
    worker thread (one alloc later when each job had processes of its own; up to a few when they
    run one after another in warm processes)."""
    point = _sharded(precision=precision, checkpointing=checkpointing, param_dtype=param_dtype)
    m, tracker = run_point(point, emulate_cuda=False, fake=True)
    allocs, freed, retags = _lives(tracker.journal())
    for rank, (after_steps, (real_allocs, real_freed, real_retags)) in _real_ranks(point, _oracle_points(), shared).items():
        assert (real_allocs, real_retags) == (allocs, retags), f"rank {rank}"
        assert real_freed.keys() == freed.keys(), f"rank {rank}"
        # gloo's worker thread may drop a collective's buffer (on FSDP2's streams) a few allocs later
        # than the step did, never earlier and within its step; how many later is the thread's timing
        late = {i: (freed[i], real_freed[i]) for i in freed if freed[i] != real_freed[i]}
        assert all(allocs[i][5] != 0 and a < b and allocs[b - 1][3] == allocs[i][3] for i, (a, b) in late.items()), \
            f"rank {rank}: {late}"
        assert after_steps == m["step_allocated_bytes"]


@pytest.mark.slow
@pytest.mark.parametrize("target,parallel", _USERS_JOBS)
def test_a_users_job_sharding_itself_over_the_mesh_it_is_handed_traces_as_each_gloo_rank_allocates(
        target, parallel, shared):
    """A job of your own given Knobs.mesh spreads itself (FSDP2 on a model made whole first, as such
    a job does; DDP): the fake rank 0 allocates what each real rank does, and holds less than the
    job on one GPU where it shards."""
    point = _users_job(target, parallel)
    m, tracker = run_point(point, emulate_cuda=False, fake=True)
    allocs, freed, retags = _lives(tracker.journal())
    whole = run_point(point.replace(parallel=Parallel()), emulate_cuda=False)[0]["params_bytes"]
    assert m["params_bytes"] < whole if parallel.dp_shard > 1 else m["params_bytes"] == whole
    for rank, (after_steps, (real_allocs, real_freed, real_retags)) in _real_ranks(point, _oracle_points(), shared).items():
        assert (real_allocs, real_retags) == (allocs, retags), f"rank {rank}"
        assert real_freed.keys() == freed.keys() and after_steps == m["step_allocated_bytes"], f"rank {rank}"


def test_a_users_job_over_several_gpus_that_never_reads_the_mesh_is_refused():
    from harness.probe.jobs import UserCodeError
    from tests.test_workload import custom_point

    point = custom_point("tests.jobs.hf_llama:build", batch_size=2, seq_len=32).replace(parallel=Parallel(dp_shard=2))
    with pytest.raises(UserCodeError, match="Knobs.mesh"):
        run_point(point)


def test_fsdp2_mixed_precision_gathers_in_its_dtype_reduces_in_fp32_and_needs_fp32_shards():
    """parallel.param_dtype=bf16 (torchtitan's MixedPrecisionPolicy): the fp32 shards and AdamW's
    state as before, half the bytes all-gathered, the gradients reduce-scattered in fp32."""
    plain, _ = run_point(_sharded(precision="fp32"))
    mixed, _ = run_point(_sharded(precision="fp32", param_dtype="bf16"))
    assert (mixed["params_bytes"], mixed["optimizer_bytes"]) == (plain["params_bytes"], plain["optimizer_bytes"])
    assert mixed["all_gather_bytes_per_step"] * 2 == plain["all_gather_bytes_per_step"]
    assert mixed["reduce_scatter_bytes_per_step"] == plain["reduce_scatter_bytes_per_step"]
    assert mixed["activations_bytes"] < plain["activations_bytes"]
    for bad in (lambda: Parallel(param_dtype="bf16"), lambda: Parallel(dp_shard=2, param_dtype="fp8"),
                lambda: _sharded(precision="bf16", param_dtype="bf16")):
        with pytest.raises(ConfigError) as e:
            bad()
        assert e.value.key == "parallel.param_dtype"


def test_a_sharded_rank_holds_its_share_of_the_parameters_and_optimizer_state():
    """8 ranks: each holds an eighth (padded) of the parameters and of AdamW's two moments; the
    layers gathered for compute come and go on FSDP2's own streams."""
    one, _ = run_point(train_point(batch_size=2, seq_len=32))
    m, tracker = run_point(_sharded(8))
    assert one["params_bytes"] / 8 <= m["params_bytes"] < one["params_bytes"] / 8 * 1.2
    assert m["optimizer_bytes"] == 2 * m["params_bytes"]
    streams = {e.stream for e in tracker.journal() if e.action == "alloc" and e.phase == "forward"}
    assert len(streams) > 1


@pytest.mark.parametrize("values,key", [
    (dict(dp_replicate=2, tp=2), "parallel.dp_replicate"),  # DDP over DTensors: HSDP instead
    (dict(dp_shard=0), "parallel.dp_shard"),
    (dict(tp=0), "parallel.tp"),
])
def test_parallel_knobs_out_of_range_or_combined_as_torch_cannot_are_refused_by_name(values, key):
    with pytest.raises(ConfigError) as e:
        Parallel(**values)
    assert e.value.key == key


def test_a_sharded_job_not_training_or_with_adafactor_is_refused_up_front(tmp_path):
    for extra, key in ((["workload=infer"], "parallel.dp_shard"),
                       (["optimizer=adafactor"], "optimizer.name")):
        r = run_cli("run", "model=tiny", "parallel.dp_shard=2", *extra, f"results_dir={tmp_path}")
        assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith(f"harness: error: {key}:")
        assert not list(tmp_path.rglob("result.json"))


def _spread_rows():
    from tests.test_verdict import _row

    def over(n, **kw):
        return _row(world_size=n, dp_shard=n, all_gather_bytes_per_step=26 * GiB, reduce_scatter_bytes_per_step=13 * GiB,
                    **kw)
    return _row, over


GiB = 1024**3


def test_the_job_sharded_over_more_gpus_that_fit_the_card_is_a_code_problem_with_its_traffic():
    """Batch 8 on one T4 OOMs; the same 8 sequences a step as 1 per GPU over 8 GPUs fit a T4: the
    remedy is sharding (the batch per GPU follows from it, no accumulation), with what each GPU
    all-gathers and reduce-scatters per step and its reserved bytes on the card. Batch 8 per GPU
    over 8 GPUs, which also fits, is not named beside it: of one layout the job's own sequences a
    step (8, not 64)."""
    import pandas as pd

    from harness.analysis.verdict import verdicts
    from harness.config import cards
    from harness.report import words
    _row, over = _spread_rows()
    df = pd.DataFrame([_row(run_id="one"), over(8, run_id="eight-b8", status="ok", fits_cards=["t4"]),
                       over(8, run_id="eight", batch_size=1, status="ok", fits_cards=["t4"])])  # (in either order)
    v = verdicts(df).set_index("run_id").loc["one"]
    assert v["verdict"] == "code problem"
    (remedy,) = v["remedies"]
    assert remedy["run_id"] == "eight"
    (change,) = remedy["changes"]
    assert (change["kind"], change["was"], change["value"], change["batch_per_gpu"]) == ("sharding", "1", "8", 1)
    assert (change["all_gather_bytes"], change["reduce_scatter_bytes"]) == (26 * GiB, 13 * GiB)
    assert remedy["headroom_bytes"] == cards.by_key()["t4"].room() - 30 * GiB
    # the words (the one check of them here)
    assert "FSDP2 over 8 GPUs, batch 1 per GPU" in words.verdict_detail(v) and "26.00 GiB" in words.verdict_detail(v)


def test_a_card_problem_names_the_smallest_card_and_count_that_fit():
    """Nothing fits a T4: the verdict weighs the job as it is on one card against it spread over
    more (least memory in all first): one H200 (141 GB) before 8 x A100 40GB, and 8 x A100 40GB
    where one card of none fits."""
    import pandas as pd

    from harness.analysis.verdict import verdicts
    _row, over = _spread_rows()

    def needed(one_fits):
        df = pd.DataFrame([_row(run_id="one", fits_cards=one_fits),
                           over(8, run_id="eight", batch_size=1, status="ok", fits_cards=["a100-40gb", "h200"])])
        v = verdicts(df).set_index("run_id").loc["one"]
        assert v["verdict"] == "card problem"
        return v["card_needed"], v["card_count"]
    assert needed(["h200"]) == ("h200", 1)
    assert needed([]) == ("a100-40gb", 8)


def test_a_job_on_fewer_gpus_is_no_remedy_for_a_sharded_one():
    """Over 8 GPUs the job OOMs; the same job over 4 GPUs is not a remedy (4 hold more each), over
    16 it is."""
    import pandas as pd

    from harness.analysis.verdict import verdicts
    _row, over = _spread_rows()
    df = pd.DataFrame([over(8, run_id="eight", batch_size=2), over(4, run_id="four", batch_size=4, status="ok",
                                                                     fits_cards=["t4"]),
                       over(16, run_id="sixteen", batch_size=1, status="ok", fits_cards=["t4"])])
    v = verdicts(df).set_index("run_id").loc["eight"]
    assert [r["run_id"] for r in v["remedies"]] == ["sixteen"]


@pytest.mark.slow
@pytest.mark.parametrize("precision,checkpointing,reshard", [("fp32", False, True), ("bf16", True, True),
                                                             ("bf16", False, False)])
def test_a_sharded_point_synthesized_from_two_layers_is_its_full_trace(precision, checkpointing, reshard, tmp_path):
    """FSDP2's hand-offs between layers (the all-gather prefetched for the layer below, each
    reduce-scatter freeing the input of the one before) placed by the template: the synthesized
    rank is the full trace, entry for entry, and so is another batch's with its layer placed as on
    the first point's."""
    from tests.test_repeat import _assert_same_as_full, _point

    def point(b, s):
        return _point(batch_size=b, seq_len=s, precision=precision, checkpointing=checkpointing).replace(
            parallel=Parallel(dp_shard=4, reshard_after_forward=reshard), trace_cache=str(tmp_path))
    first = _assert_same_as_full(point(2, 32))
    assert first["trace_method"].startswith("synthesized: layers 1, 2 -> 4")
    assert "placed as on 7b b2 s32" in _assert_same_as_full(point(3, 16))["trace_method"]


@pytest.mark.slow
def test_a_ddp_point_is_synthesized_with_its_setup_traced_at_its_depth_and_is_its_full_trace(tmp_path):
    """DDP's setup is sized by all the layers at once (the flat bucket of every gradient, the state
    broadcast in 250 MiB pieces): traced at the point's depth and spliced in. Its rebuilt buckets'
    index tensors grow with each layer (scaled entries), and its third step is the first the others
    repeat (the second rebuilds the buckets). fp32 7B layers: several broadcast pieces per layer.
    Another batch's point, its structure checked on the first, is its full trace too; and so is
    another count's, from the first one's shallow journals (a DDP rank's are the same at any count)."""
    from tests.test_repeat import _assert_same_as_full, _point

    def point(b, s, replicas=4):
        p = _point(precision="fp32", checkpointing=True, batch_size=b, seq_len=s).replace(
            parallel=Parallel(dp_replicate=replicas), trace_cache=str(tmp_path))
        return p.replace(workload=dataclasses.replace(p.workload, steps=4))
    m = _assert_same_as_full(point(2, 32))
    assert m["trace_method"].startswith("synthesized: layers 1, 2 -> 4, steps 3 -> 4, DDP's setup traced at 4")
    assert "structure checked at 3 on 7b b2 s32" in _assert_same_as_full(point(3, 16))["trace_method"]
    assert _assert_same_as_full(point(2, 32, replicas=2))["trace_method"].startswith(
        "synthesized: layers 1, 2 as traced over 4 GPUs -> 4")


def _shallow_sharded(cache=None, model="7b", **parallel) -> Point:
    """`model`'s dimensions at the template's depth, b2 s32 bf16, over `parallel`'s degrees, as many
    steps as its shallow traces take (in trace cache `cache`, where given)."""
    from harness.probe.sim import shortcut
    from tests.test_repeat import _point

    p = _point(model=model, batch_size=2, seq_len=32, precision="bf16").replace(
        parallel=Parallel(nodes="auto", **parallel), trace_cache=None if cache is None else str(cache))
    return p.replace(workload=dataclasses.replace(p.workload, steps=shortcut.traced_steps(p)))


@pytest.mark.slow
@pytest.mark.parametrize("replicas,tp,said,padded", [(1, 1, "2, 8", 512), (1, 2, "4, 16", 256), (2, 2, "8, 32", 256)],
                         ids=["fsdp2", "fsdp2-tp", "hsdp-tp"])
def test_an_fsdp2_count_made_from_two_traced_counts_is_its_full_trace(tmp_path, replicas, tp, said, padded):
    """Sharded 2 and 8 ways traced, 64 ways the shallow journals are made from theirs (each shard
    1/64 of the whole, FSDP2's copy tables from their rewritten codes, the parameter and state
    figures as the allocator holds them: a norm's 128 B shard takes a 512 B block; under tensor
    parallel the mesh's rank tensors, one entry a GPU; beside HSDP's replicas too, its all-reduce
    across them a shard, tensor parallel's the same at any count) and the point is its full trace,
    entry for entry and figure for figure; where 7B's 32,000-row embedding would be padded (62.5
    rows a GPU over 512, of a tensor-parallel rank's 16,000 over 256), traced."""
    from harness.probe.sim import shard_counts, shortcut
    from tests.test_repeat import _assert_same_as_full

    def point(n):
        return _shallow_sharded(tmp_path, dp_shard=n, dp_replicate=replicas, tp=tp)
    for n in (2, 8):
        assert "scaled" not in shortcut.trace(point(n)).measurements["trace_method"]
    assert _assert_same_as_full(point(64))["trace_method"].startswith(
        f"synthesized: layers 1, 2 scaled from those over {said} GPUs -> 4")
    assert shard_counts.read(tmp_path, point(32), (1, 2)) is not None
    assert shard_counts.read(tmp_path, point(padded), (1, 2)) is None


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2], ids=["hsdp", "hsdp-tp"])
def test_an_hsdp_replica_count_made_from_two_traced_replica_counts_is_its_full_trace(tmp_path, tp):
    """Over 2 and 4 replicas of 2 shards traced (beside tensor parallel too), 8 replicas' shallow
    journals are made from theirs (the same shards, gathers and all-reduces at any replica count;
    the device mesh's rank tensors one entry a GPU) and the point is its full trace, entry for entry
    and figure for figure. A job without replicas takes none of them."""
    from harness.probe.sim import shard_counts, shortcut
    from tests.test_repeat import _assert_same_as_full

    def point(replicas, shards=2):
        return _shallow_sharded(tmp_path, dp_shard=shards, dp_replicate=replicas, tp=tp)
    for n in (2, 4):
        assert "scaled" not in shortcut.trace(point(n)).measurements["trace_method"]
    assert _assert_same_as_full(point(8))["trace_method"].startswith(
        f"synthesized: layers 1, 2 scaled from those over {4 * tp}, {8 * tp} GPUs -> 4")
    assert shard_counts.read(tmp_path, point(1), (1, 2)) is None
    assert shard_counts.read(tmp_path, point(8, shards=4), (1, 2)) is None  # another shard count: not traced


@pytest.mark.slow
@pytest.mark.parametrize("model,sequence_parallel,shards,made", [("7b", False, 1, True), ("7b", True, 1, True),
                                                                 ("7b", False, 4, True), ("llama3-8b", False, 1, False)],
                         ids=["7b", "7b-sp", "7b-fsdp2", "llama3-8b"])
def test_a_tensor_parallel_count_is_made_from_two_others_only_where_its_own_first_layer_agrees(
        tmp_path, model, sequence_parallel, shards, made):
    """Over TP 2 and 4 traced, TP 8's second layer is made from theirs (a rank's heads and columns
    1/TP of the whole, flash's backward sized by its heads; under FSDP2 its units' gathered buffers
    c + d/TP bytes, their 1/TP parameters beside the whole norms) where the point's own first layer
    traces as made, and the point is its full trace; Llama-3-8B's 8 key/value heads over TP 8 (one a
    rank) take the backward otherwise: traced, and its full trace too."""
    from harness.probe.sim import shortcut
    from tests.test_repeat import _assert_same_as_full

    def point(tp):
        return _shallow_sharded(tmp_path, model, tp=tp, sequence_parallel=sequence_parallel, dp_shard=shards)
    for n in (2, 4):
        assert "scaled" not in shortcut.trace(point(n)).measurements["trace_method"]
    method = _assert_same_as_full(point(8))["trace_method"]
    said = f"synthesized: layers 1, 2 scaled from those over {2 * shards}, {4 * shards} GPUs, layer 1 traced alike -> 4"
    assert method.startswith(said) == made, method
    assert method.startswith("synthesized: layers 1, 2 -> 4") != made


def test_traces_over_other_meshes_in_one_process_each_run_on_their_own_process_groups():
    """DTensor keeps its sharding answers by op and specs, and a device mesh equals any other of the
    same ranks whatever its groups: a trace over 8 shards x TP 2, then one over 4 replicas x 2
    shards x TP 2 (16 GPUs each, the same tensor-parallel ranks), was handed the first one's mesh,
    whose groups were gone ("Could not resolve the process group registered under the name 3")."""
    from harness.probe.sim.shortcut import at_depth

    run_point(at_depth(_shallow_sharded(dp_shard=8, tp=2), 1))
    m, _ = run_point(at_depth(_shallow_sharded(dp_shard=2, dp_replicate=4, tp=2), 1))
    assert m["params_bytes"] > 0


def test_a_buffer_of_split_and_whole_parameters_scales_as_c_plus_d_over_the_count():
    """Under FSDP2 x TP a gathered buffer holds 1/TP parameters beside whole ones: 4,145,152 B whole
    and 1,858,076,672 B split (7B's first layer over 4 shards), made at TP 8 and 16 from TP 2 and 4;
    values no whole c + d/count fits, or three counts that disagree, are not made."""
    from harness.probe.sim.shard_counts import _NO, _affine
    assert _affine([933183488, 468664320], [2, 4], 8) == 236404736
    assert _affine([933183488, 468664320, 236404736], [2, 4, 8], 16) == 4145152 + 1858076672 // 16
    assert _affine([10, 7], [2, 4], 8) is _NO  # d = 12 is no multiple of 8
    assert _affine([100, 60, 41], [2, 4, 8], 16) is _NO  # 8's would be 40


def test_an_fsdp2_copys_code_names_its_chunks_at_another_count():
    """Its chunk count is the count; each chunk's bytes a shard's, whole at the new count or none."""
    from harness.probe.sim.shard_counts import _scaled_code
    codes = ["split_copy:0:2:4096,512,4096", "split_copy:0:4:2048,256,2048"]
    assert _scaled_code(codes, [2, 4], 16) == "split_copy:0:16:512,64,512"
    assert _scaled_code(codes, [2, 4], 3) is None  # 8192 B over 3: no whole shard
    assert _scaled_code(["reduce:0:4,2", "reduce:0:4,1"], [2, 4], 8) is None  # not one of FSDP2's copies


def test_a_ranks_trace_is_one_on_any_count_of_nodes_and_a_ddp_jobs_journals_pass_between_counts(tmp_path):
    """Nodes change neither a rank's trace nor its replay, NCCL's memory its replay only (but where
    the job read the card): one trace identity. A DDP job on a card of one GPU a node (RTX 4060)
    keeps its shallow journals for its other counts, as on any card: its key was once a point over
    2 GPUs on 1 node, refused there (an error row for every DDP point on that card)."""
    from harness.config.cards import by_key
    from harness.probe.sim import replicas
    from harness.record.trace_store import trace_id

    def over(gpus, nodes, card="rtx4060", nccl=None):
        return train_point().replace(gpu=by_key()[card], trace_cache=str(tmp_path), parallel=Parallel(
            dp_replicate=gpus, nodes=nodes, nccl_bytes_per_communicator=nccl))
    assert trace_id(over(8, 8, "a100-80gb")) == trace_id(over(8, 1, "a100-80gb")) == trace_id(over(8, 2, "a100-80gb", 2**30))
    assert trace_id(over(8, 1, "a100-80gb"), reads_card=True) != trace_id(over(8, 1, "a100-80gb", 2**30), reads_card=True)
    assert replicas.read(tmp_path, over(4, 4), (1, 2)) is None
    replicas.write(tmp_path, over(4, 4), (1, 2), [[], []], [{}])
    assert replicas.read(tmp_path, over(2, 2), (1, 2)) == ([[], []], [{}], "as traced over 4 GPUs")


def test_the_capacity_table_gives_each_job_and_card_the_fewest_gpus_that_fit():
    """Batch 1 per GPU: on one GPU it fits only the H200, over 8 the A100 40GB too; the T4 fits it
    over none of the sweep's counts."""
    import pandas as pd

    from harness.report import tables
    _row, over = _spread_rows()
    df = pd.DataFrame([_row(run_id="one", batch_size=1, gpu="H200", status="ok", peak_reserved_bytes=100 * GiB),
                       over(8, run_id="eight", batch_size=1, gpu="A100 40GB", status="ok",
                            peak_reserved_bytes=30 * GiB)])
    fit_long = pd.DataFrame([{"run_id": r, "card": c, "edge": e} for r, c, e in [
        ("one", "t4", "oom"), ("one", "a100-40gb", "oom"), ("one", "h200", "room"),
        ("eight", "t4", "oom"), ("eight", "a100-40gb", "room"), ("eight", "h200", "room")]])
    header, rows = tables.capacity_table(df, fit_long)
    (row,) = rows
    cell = dict(zip(header, row))
    assert (cell["h200"], cell["a100-40gb"], cell["t4"]) == ("1", "8 FSDP2", "-")


@pytest.mark.slow
@pytest.mark.parametrize("gpus,published_gib", [(8, 82.4), (128, 67.0)])
def test_torchtitans_published_llama3_8b_fsdp_figures_are_reproduced_within_1_percent(tmp_path, gpus, published_gib):
    """torchtitan's docs/performance.md, Tables 1 and 3 ("FSDP", no torch.compile): Llama 3.1 8B over
    8 and over 128 H100 (95 GiB), local batch 2 x 8192, selective per-op activation checkpointing,
    fp32 shards computed in bf16: 82.4 and 67.0 GiB a GPU (its memory monitor: max_memory_reserved)."""
    from harness.config.cards import by_key
    from harness.probe.worker import run_sim

    point = train_point(model="llama3-8b", precision="fp32", batch_size=2, seq_len=8192, checkpointing=True).replace(
        checkpointing_policy="op", parallel=Parallel(dp_shard=gpus, param_dtype="bf16", nodes=gpus // 8),
        gpu=by_key()["h100-nvl"])
    rec = run_sim(point, tmp_path)
    assert rec["status"] == "ok" and rec["trace_method"].startswith("synthesized")
    assert rec["peak_reserved_bytes"] / 1024**3 == pytest.approx(published_gib, rel=0.01)


@pytest.mark.slow
def test_torchtitans_published_llama2_70b_oom_at_batch_2_with_selective_op_checkpointing_is_reproduced(tmp_path):
    """torchtitan's docs/performance.md (its 2024 figures, "Llama 2 performance numbers"): Llama 2
    70B, FSDP2 over 64 A100 80GB, 4,096-token sequences, fp32 shards computed in bf16, selective
    per-op checkpointing, ran at local batch 1 and "will cause an OOM error" at local batch 2 (its
    footnote). Both sides of that edge, as one rank of the 64."""
    from harness.probe.worker import run_sim

    def rec(batch_size: int) -> dict:
        point = train_point(model="70b", precision="fp32", batch_size=batch_size, seq_len=4096,
                            checkpointing=True).replace(
            checkpointing_policy="op", parallel=Parallel(dp_shard=64, param_dtype="bf16", nodes=8))
        (tmp_path / str(batch_size)).mkdir()
        return run_sim(point, tmp_path / str(batch_size))

    ran, oom = rec(1), rec(2)
    assert (ran["status"], oom["status"]) == ("ok", "oom")
    assert "a100-80gb" in ran["fits_cards"] and "a100-80gb" not in ran["tight_cards"] + ran["retry_cards"]


def test_a_sharded_point_judged_on_a_card_of_fewer_gpus_a_node_spans_as_many_nodes_as_it_needs():
    """A job over 4 H200s (cuDNN attention) judges an RTX 4060 (flash; one a node) near its edge by a
    trace of its kernels: the same rank on 4 of its nodes, not a point refused for 4 GPUs on one
    node (every such row failed: demo-1b b2 s1024 over 4 H200s)."""
    from harness.config.cards import by_key
    from harness.probe.worker import _on_card

    point = _sharded(world=4).replace(gpu=by_key()["h200"])
    moved = _on_card(point, by_key()["rtx4060"])
    assert (moved.gpu.key, moved.parallel.nodes) == ("rtx4060", 4)
    assert dataclasses.replace(moved.parallel, nodes=1) == point.parallel
    assert _on_card(point, by_key()["a100-80gb"]).parallel == point.parallel  # 8 a node: as it was


def test_fsdp2s_copies_allocate_their_launch_tables_as_on_four_h200s():
    """demo-1b over 4 H200s, bf16 (tests/scripts/fake_peers.py's run, torch 2.11): each layer's
    all-gather copy-out (split_with_sizes_copy) allocated a 33,792 B table and its reduce-scatter
    copy-in (_chunk_cat) 100,816 B; the root's 32,112 B and 256,168 B. The trace of one layer has
    them, each freed at once; another card's SMs size the copy-out's otherwise."""
    import collections

    from harness.config.cards import by_key
    from harness.probe.sim.per_card import Sized
    from harness.probe.sim.shortcut import at_depth
    from harness.record import trace_store

    point = train_point(model="demo-1b", batch_size=2, seq_len=1024, steps=2).replace(
        parallel=Parallel(dp_shard=4), gpu=by_key()["h200"])
    _m, tracker = run_point(at_depth(point, 1))
    sizes = collections.Counter(e.size for e in tracker.events if e.action == "alloc")
    # two steps: gathered for forward and again for backward, reduced once
    assert {n: sizes[n] for n in (33792, 32112, 100816, 256168)} == {33792: 4, 32112: 4, 100816: 2, 256168: 2}
    df = trace_store.to_frame(tracker.events)
    # the copy-out's table and the RMSNorm weights' gradient sums follow the card's SMs
    assert {c.split(":")[0] for c in trace_store.kernel_codes(df)} == {"split_copy", "reduce"}
    on_t4 = trace_store.sized_for(df, by_key()["t4"])
    assert 33792 not in set(on_t4["size"]) and len(on_t4) <= len(df)
    assert trace_store.sized_for(df, by_key()["h100-80gb"]) is df  # 132 SMs, 2048 threads: the H200's sizes
    # the rows each card's replay takes, made from the traced ones: the frame's sized for it
    sized = Sized(df)
    for card in by_key().values():
        assert sized.rows(card) == trace_store.replay_rows(trace_store.sized_for(df, card)), card.key


def test_elementwise_foreach_ops_on_shards_laid_out_alike_run_locally_as_dtensor_runs_them(monkeypatch):
    """An AdamW step on DTensors (rank 0 of 2, real CPU tensors): with the shortcut its parameters,
    moments and their layouts are what DTensor's own dispatch makes, and none of its foreach ops is
    propagated by DTensor; a call that mixes layouts (a Partial operand) still is, and the shortcut
    is gone after."""
    import torch
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
    from torch.distributed.tensor._dispatch import OpDispatcher

    from harness.probe.sim import sharded

    propagated: list = []
    slow = OpDispatcher._propagate_op_sharding_dispatch_slow_path

    def counted(self, op, *args, **kwargs):
        propagated.append(op)
        return slow(self, op, *args, **kwargs)
    monkeypatch.setattr(OpDispatcher, "_propagate_op_sharding_dispatch_slow_path", counted)

    def step(shortcut: bool) -> list:
        torch.manual_seed(0)
        with sharded.process_group(Parallel(dp_shard=2)) as mesh:
            params = [torch.nn.Parameter(DTensor.from_local(torch.randn(4, 3), mesh, [Shard(0)], run_check=False)),
                      torch.nn.Parameter(DTensor.from_local(torch.randn(5), mesh, [Replicate()], run_check=False))]
            for p in params:
                p.grad = DTensor.from_local(torch.randn_like(p.to_local()), mesh, p.placements, run_check=False)
            opt = torch.optim.AdamW(params, lr=0.1, foreach=True)
            with sharded.pointwise_lists_on_shards() if shortcut else contextlib.nullcontext():
                opt.step()
                opt.step()
                partial = DTensor.from_local(torch.ones(5), mesh, [Partial()], run_check=False)
                mixed = torch._foreach_add([params[1].detach()], [partial])[0]
            moments = [s for p in params for s in (opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"])]
            return [(t.to_local().clone(), t.placements) for t in [*params, *moments, mixed]]

    with_it = step(True)
    assert [op for op in propagated if "_foreach" in str(op)] == [torch.ops.aten._foreach_add.List]
    without = step(False)
    # (DTensor's sum of a Replicate and a Partial is Partial: the shortcut would have made it Replicate)
    assert [p for _, p in with_it] == [p for _, p in without]
    assert with_it[-1][1] == (Partial(),)
    assert all(torch.equal(a, b) for (a, _), (b, _) in zip(with_it, without, strict=True))
    assert not set(DTensor._op_dispatcher._custom_op_handlers) & {torch.ops.aten._foreach_add.List}
