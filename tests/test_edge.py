"""The edge of a card: fits with room, fits only on the allocator's retry, tight (inside what the
card's capacity and non-PyTorch memory are known to), or OOM; and the catalog's figures, measured
where calibrate has measured them."""

import dataclasses
import functools
import json

import pandas as pd
import pytest

from harness.allocator.replay import Kept, Replays
from harness.allocator.settings import AllocSettings
from harness.analysis.verdict import verdicts
from harness.config import cards
from harness.config.point import Card
from harness.probe.sim import reserved
from harness.probe.sim.per_card import Sized
from harness.probe.sim.trace import run_point
from harness.record import trace_store
from harness.report import tables
from tests.conftest import train_point

MiB, GiB = 1024**2, 1024**3


def _card(room: int, spread: int = 64 * MiB) -> Card:
    return Card(name="c", device_name="c", memory_bytes=room + 512 * MiB, non_pytorch_bytes=512 * MiB,
                non_pytorch_spread_bytes=spread, key="c")


def _tiny_trace():
    """A real trace (the tiny model, 4 x 128 tokens), its settings and its replay without a limit."""
    _, tracker = run_point(train_point(model="tiny", batch_size=4, seq_len=128))
    rows = trace_store.replay_rows(trace_store.to_frame(tracker.events))
    settings = AllocSettings.from_conf("")
    return rows, settings, reserved.replay_events(rows, settings, reserved.Device(total=80 * GiB))[0]


def test_the_edge_of_a_card_from_a_real_trace():
    rows, settings, unlimited = _tiny_trace()
    res, alloc = unlimited.peak_reserved_bytes, unlimited.peak_allocated_bytes

    replays = Replays(rows, settings)

    def edge(card):
        return reserved.edge(lambda c: reserved.fits(replays, c, unlimited), res, card)

    assert edge(_card(res + 256 * MiB)) == "room"
    assert edge(_card(res + 32 * MiB)) == "tight"  # fits as estimated, not with 64 MiB more outside PyTorch
    assert edge(_card(alloc - 2 * MiB, spread=0)) == "oom"
    # between allocated and reserved only the replay on the card can tell; a fit there is a retry
    between = _card((alloc + res) // 2, spread=0)
    on_card = reserved.replay_on(rows, settings, between)
    assert edge(between) == ("oom" if on_card.ooms else "after_retry")
    if not on_card.ooms:
        assert on_card.num_alloc_retries > 0


def test_rows_record_the_edge_on_every_card_of_the_catalog(tmp_path):
    from harness.probe.worker import run_sim

    rec = run_sim(train_point(model="tiny").replace(sweep="t"), tmp_path)
    keys = {c.key for c in cards.cards()}
    assert set(rec["fits_cards"]) == keys  # a tiny model fits every card with room
    assert rec["tight_cards"] == [] and rec["retry_cards"] == []


def _row(**kw):
    row = {"run_id": "r", "model": "m", "workload": "train", "seq_len": 2048, "batch_size": 8, "precision": "bf16",
           "optimizer": "adamw", "optimizer_impl": "auto", "checkpointing": False, "allocator_conf": "",
           "leak": "none", "gpu": "T4", "status": "oom", "kind": "activations", "fits_cards": [],
           "tight_cards": [], "retry_cards": [], "peak_reserved_bytes": 30 * GiB}
    return {**row, **kw}


def test_a_remedy_inside_the_cards_uncertainty_is_marked_tight_and_offered_last():
    df = pd.DataFrame([_row(run_id="job"),
                       _row(run_id="micro", batch_size=4, status="ok", fits_cards=["t4"], tight_cards=["t4"]),
                       _row(run_id="ckpt", checkpointing=True, status="ok", fits_cards=["t4"])])
    v = verdicts(df).set_index("run_id").loc["job"]
    assert [(r["run_id"], r["edge"]) for r in v["remedies"]] == [("ckpt", "room"), ("micro", "tight")]


def test_the_card_needed_is_one_the_job_surely_fits():
    df = pd.DataFrame([_row(run_id="job", fits_cards=["a100-40gb", "a100-80gb"], tight_cards=["a100-40gb"])])
    v = verdicts(df).set_index("run_id").loc["job"]
    assert v["card_needed"] == "a100-80gb" and v["card_edge"] == "room"


def test_a_fit_on_retry_never_reads_as_a_plain_fit_with_negative_headroom():
    assert tables._cell("after_retry", -7.0) == "fits on retry -7%"
    assert tables._cell("tight", 1.0) == "tight +1%" and tables._cell("room", 12.0) == "fits +12%"
    assert tables._cell("oom", -30.0) == "OOM"


def test_what_calibrate_measured_replaces_the_estimate(tmp_path, monkeypatch):
    monkeypatch.setenv(cards.MEASURED_ENV, str(tmp_path / "measured.json"))
    t4 = cards.by_key()["t4"]
    assert t4.non_pytorch_spread_bytes > 0 and t4.memory_spread_bytes > 0  # estimates
    rows = [{"gpu": "T4", "status": "ok", "emulated_gpu": False, "device_memory_bytes": 15_637_086_208,
             "measured_non_pytorch_bytes": n, "device_name": "Tesla T4", "torch_version": "2.13.0"}
            for n in (401 * MiB, 409 * MiB)]
    rows.append({**rows[0], "emulated_gpu": True, "measured_non_pytorch_bytes": 3 * GiB})  # another device's
    recorded = cards.record_measured(rows, {"T4": "t4"})
    assert set(recorded) == {"t4"}
    measured = cards.by_key()["t4"]
    assert measured.memory_bytes == 15_637_086_208 and measured.memory_spread_bytes == 0
    assert measured.non_pytorch_bytes == 409 * MiB and measured.non_pytorch_spread_bytes == 16 * MiB
    assert json.loads((tmp_path / "measured.json").read_text())["t4"]["non_pytorch_bytes"] == 409 * MiB
    composed = dataclasses.replace(t4, key="")
    assert cards.as_measured(composed).non_pytorch_bytes == 409 * MiB  # a point's card, composed from YAML


def test_a_card_of_fewer_sms_near_its_edge_is_judged_with_its_own_kernel_scratch(tmp_path):
    """A trace of an H200 (132 SMs): a tensor that leaves a T4 40 MiB of room, then RMSNorm's weight
    gradient over 8192 tokens of 4096, whose staging buffer is 132 MiB there and 20 MiB on a T4
    (40 SMs, 1024 threads each). The row holds the T4 (its own replay); a card of the H200's SMs
    with that room would not."""
    from harness.config import kernels
    from harness.probe import worker
    from harness.probe.sim.tracker import TraceEvent
    from harness.record.row import base_record

    t4, h200 = cards.by_key()["t4"], cards.by_key()["h200"]
    r = kernels.Reduction(4, 4096, 8192, False, 1, 4)
    buffer, sems = kernels.reduce_buffers(r, kernels.geometry(h200))
    on_t4 = kernels.reduce_buffers(r, kernels.geometry(t4))[0]
    tensor = (t4.at_worst().room() - 40 * MiB) // (2 * MiB) * 2 * MiB
    assert on_t4 + 2 * MiB < 40 * MiB < buffer
    events = [TraceEvent(0, "alloc", 1, tensor, "parameter", "setup", -1, ""),
              TraceEvent(1, "alloc", 2, buffer, "temporary", "backward", 0, "", 0, kernels.reduce_code(r, 0)),
              TraceEvent(2, "alloc", 3, sems, "temporary", "backward", 0, "", 0, kernels.reduce_code(r, 1)),
              TraceEvent(3, "free", 3, sems, "temporary", "backward", 0, ""),
              TraceEvent(4, "free", 2, buffer, "temporary", "backward", 0, "")]
    point = train_point().replace(gpu=h200)
    rec = {**base_record(point), "peak_allocated_bytes": tensor + buffer + 512, "attention_calls": None}
    row = worker._replayed(point, rec, Sized(trace_store.to_frame(events), events), tmp_path, 0.0)
    assert "t4" in row["fits_cards"] and "t4" not in row["tight_cards"]
    assert row["peak_allocated_bytes"] == tensor + buffer + 512  # the H200's own, as traced


def test_a_real_run_promises_no_card_the_room_its_larger_reduction_buffers_need():
    """demo-1b at 8 x 8192 tokens measured on an A100 80GB (108 SMs): each RMSNorm weight's
    gradient stages 113 MB there, 138 MB on an H100 (132 SMs). A run reserving 30 MiB under the
    H100's room is not said to fit it; a card of fewer SMs (the A100 40GB's 108) takes the peaks."""
    from harness.probe import worker
    from harness.record.row import WORKSPACE

    a100, h100 = cards.by_key()["a100-80gb"], cards.by_key()["h100-80gb"]
    point = train_point(model="demo-1b", batch_size=8, seq_len=8192).replace(gpu=a100)
    run = {"attention_calls": None, "peak_reserved_bytes": h100.room() - 30 * MiB,
           "peak_allocated_bytes": h100.room() - 2 * GiB, WORKSPACE: 33554432, "device_multiprocessors": 108}
    edges = worker.measured_edges(point, run)
    assert edges["h100-80gb"] == "oom"
    assert edges["a100-80gb"] == "room"  # the card it ran on
    fewer = {**run, "peak_reserved_bytes": cards.by_key()["a100-40gb"].room() - 30 * MiB,
             "peak_allocated_bytes": cards.by_key()["a100-40gb"].room() - 2 * GiB}
    assert worker.measured_edges(point, fewer)["a100-40gb"] in ("room", "tight")


def test_a_real_run_promises_no_card_the_room_its_larger_cublas_workspaces_need():
    """A run measured on an A100 80GB (8,519,680 B a cuBLAS workspace) reserving 30 MiB under an
    H20's room is not said to fit the H20 (sm90: 32 MiB a workspace, two of them in a training step,
    and fewer SMs: no larger reductions); one reserving 200 MiB under it is."""
    from harness.probe import worker
    from harness.record.row import WORKSPACE

    a100, h20 = cards.by_key()["a100-80gb"], cards.by_key()["h20"]
    point = train_point(model="demo-1b", batch_size=8, seq_len=2048).replace(gpu=a100)
    run = {"attention_calls": None, "peak_reserved_bytes": h20.room() - 30 * MiB,
           "peak_allocated_bytes": h20.room() - 2 * GiB, WORKSPACE: 8519680, "device_multiprocessors": 108}
    assert worker.measured_edges(point, run)["h20"] == "oom"
    further = {**run, "peak_reserved_bytes": h20.room() - 200 * MiB}
    assert worker.measured_edges(point, further)["h20"] != "oom"


def test_under_expandable_segments_a_cards_reserved_peak_is_its_own_whichever_card_traced_the_point(tmp_path):
    """An address range is the card's memory: tiny b128 s512 with expandable segments reserves
    950,009,856 B on a 512 MiB card, whose ranges it overflows, and 929,038,336 B on an A100 80GB.
    Traced on the small card, the row still gives the A100 the A100's own peak and edge (before,
    the small card's), and a plan's margin reads that peak."""
    from harness.plan import fit
    from harness.probe import worker
    from harness.record.row import recorded_edge, reserved_on

    base = train_point(batch_size=128, seq_len=512)
    base = base.replace(allocator=dataclasses.replace(base.allocator, conf="expandable_segments:True"))
    small = base.replace(gpu=dataclasses.replace(base.gpu, memory_bytes=512 * 2**20, name="small", key="",
                                                 device_name="small"))
    (tmp_path / "small").mkdir()
    (tmp_path / "a100").mkdir()
    on_small = worker.run_sim(small, tmp_path / "small")
    on_a100 = worker.run_sim(base, tmp_path / "a100")
    assert on_small["peak_reserved_bytes"] > on_a100["peak_reserved_bytes"] > small.gpu.memory_bytes
    for key in ("a100-80gb", "h100-80gb", "l4", "t4"):
        assert reserved_on(on_small, key) == reserved_on(on_a100, key), key
        assert recorded_edge(on_small, key) == recorded_edge(on_a100, key), key
    a100 = cards.by_key()["a100-80gb"]
    assert fit.reserved_on(on_small, a100) == on_a100["peak_reserved_bytes"]


@pytest.mark.parametrize("precision,conf,checkpointing", [
    ("bf16", "", False), ("fp16", "expandable_segments:True", False), ("fp32", "roundup_power2_divisions:4", True)])
def test_every_cards_edge_and_reserved_peak_are_the_same_whichever_card_traced_the_point(tmp_path, precision, conf,
                                                                                          checkpointing):
    """tiny at 512 x 1024 tokens traced on a T4 (math or memory-efficient attention, 40 SMs), an A100
    80GB (flash, 108 SMs) and an H100 (cuDNN, 32 MiB workspaces, 132 SMs): 7-45 GB, around the small
    cards' rooms. Each trace judges the others' cards by a replay of their own run (their kernels'
    scratch, workspaces, attention kernels, address ranges), so every card gets one verdict and one
    reserved peak, whichever card traced it."""
    from harness.probe import worker
    from harness.record.row import recorded_edge, reserved_on

    rows = {}
    for key in ("t4", "a100-80gb", "h100-80gb"):
        point = train_point(precision=precision, batch_size=512, seq_len=1024, checkpointing=checkpointing)
        point = point.replace(allocator=dataclasses.replace(point.allocator, conf=conf), gpu=cards.by_key()[key])
        (tmp_path / key).mkdir()
        rows[key] = worker.run_sim(point, tmp_path / key)
    base = rows["a100-80gb"]
    assert 0 < len(base["fits_cards"]) < len(cards.cards())
    for key, row in rows.items():
        for c in cards.cards():
            assert recorded_edge(row, c.key) == recorded_edge(base, c.key), (key, c.key)
            if recorded_edge(base, c.key) != "oom":
                assert reserved_on(row, c.key) == reserved_on(base, c.key), (key, c.key)


def test_edges_from_lean_replays_within_bounds_are_the_unlimited_replays_edges():
    """reserved.lean_edges (bounds on the peaks, lean replays from another replay's checkpoints where
    the bounds leave a card open) gives each card the edge catalog_edges does, for cards around a
    real trace's allocated and reserved peaks."""
    rows, settings, unlimited = _tiny_trace()
    res, alloc = unlimited.peak_reserved_bytes, unlimited.peak_allocated_bytes
    probe = [_card(room, spread=s) for room in (alloc - MiB, alloc + MiB, (alloc + res) // 2, res + 4 * MiB)
             for s in (0, 8 * MiB)]
    probe = [dataclasses.replace(c, key=f"c{i}") for i, c in enumerate(probe)]
    exact = reserved.catalog_edges(rows, settings, probe, alloc)
    assert {"oom", "room"} <= set(exact.values()) and len(set(exact.values())) >= 3
    kept = Kept()
    reserved.analyse(rows, settings, probe[0], probe, "2.13", None, alloc, kept)
    assert kept.checkpoints  # some card lies between the peaks
    assert reserved.lean_edges(rows, settings, probe, kept.checkpoints, res, alloc) == exact
    assert reserved.lean_edges(rows, settings, probe, [], res + 64 * MiB, alloc - 64 * MiB) == exact


def test_a_cards_rows_resize_its_kernel_scratch_and_drop_the_launches_it_makes_none_of():
    """per_card.Sized.rows (the traced rows copied, the scratch rows resized) agrees with the frame
    sized for the card (trace_store.sized_for), where a card's launch makes no staging buffer too."""
    from harness.probe.sim.tracker import TraceEvent

    code = "reduce:0:4,8192,4096,0,1,4"  # 70B's RMSNorm weight gradient: none on a card of one SM
    events = [TraceEvent(0, "alloc", 1, 4096, "activation", "backward", 0, "norm"),
              TraceEvent(1, "alloc", 2, 113246208, "temporary", "backward", 0, "norm", kernel=code),
              TraceEvent(2, "free", 2, 113246208, "temporary", "backward", 0, "norm", kernel=code),
              TraceEvent(3, "free", 1, 4096, "activation", "backward", 0, "norm")]
    df = trace_store.to_frame(events)
    sized = Sized(df)
    one_sm = Card(multiprocessors=1, compute_capability="8.0")
    for card in (*cards.cards(), one_sm):
        assert sized.rows(card) == trace_store.replay_rows(trace_store.sized_for(df, card)), card.key
    assert [r.key for r in sized.rows(one_sm)] == [1, 1]
    assert {r.size for r in sized.rows(cards.by_key()["l4"]) if r.key == 2} == {46137344}



def test_a_traces_rows_made_of_its_events_are_the_ones_read_back_from_its_frame():
    """per_card.Sized given the events its frame was made of (a fresh trace's: the frame not read
    back) has every card's rows as one of the frame alone: tags, sizes, streams, placeholders and
    all (tiny over FSDP2: its communication stream's requests too)."""
    from harness.config.point import Parallel

    _, tracker = run_point(train_point(batch_size=2, seq_len=64).replace(parallel=Parallel(dp_shard=2)))
    events = tracker.events
    df = trace_store.to_frame(events)
    made, read = Sized(df, events), Sized(df)
    assert len({r.stream for r in read.rows(None)}) > 1
    for card in (None, *cards.cards()):
        assert made.rows(card) == read.rows(card), card
    assert made.rows(None) == trace_store.replay_rows(df, placeholders=True)

def _from_checkpoints_or_start(rows, settings, checkpoints, capacities) -> tuple[list, list]:
    """Each capacity's lean replay of `rows` (its first OOM and its cache flushes) going on from
    `checkpoints`, and from the start."""
    from harness.allocator.model import Device

    def decided(r):
        return r.ooms[0]["event"] if r.ooms else None, r.num_alloc_retries

    went_on = []
    for capacity in capacities:
        on = Replays(rows, settings, Kept(checkpoints=list(checkpoints)))
        went_on.append(decided(on.on(Device(capacity=capacity, total=4 * GiB))))
    alone = [decided(reserved.replay_events(rows, settings, Device(capacity=c, total=4 * GiB), lean=True)[0])
             for c in capacities]
    return went_on, alone


def _scratch_trace(steps: list[tuple]) -> pd.DataFrame:
    """A trace of (action, key, MiB) steps, key 9 a reduction's staging buffer: 108 MiB on an A100,
    44 MiB on an L4 (the sizes 70B's RMSNorm weight gradient takes)."""
    from harness.probe.sim.tracker import TraceEvent

    code = "reduce:0:4,8192,4096,0,1,4"
    return trace_store.to_frame([
        TraceEvent(i, action, key, 113246208 if key == 9 else int(mib * MiB), "temporary", "backward", 0, "norm",
                   kernel=code if key == 9 else "")
        for i, (action, key, mib) in enumerate(steps)])


@pytest.mark.parametrize("scenario", ["alike", "pool_taken_meanwhile", "cached_too_small"])
def test_a_cards_lean_replay_goes_on_from_the_points_checkpoints_while_its_state_is_the_points(scenario):
    """An L4's and an A100's rows differ in a reduction's staging buffer (44 vs 108 MiB), cut from a
    cached 200 MiB block. A checkpoint of one card's replay taken after that buffer is freed serves
    the other where the pool is as it was (Sized.alike_until): not where another large block was
    allocated while the buffer lived (an A100 then has no room left in the block, an L4 does), nor
    where the cached block was smaller than the other card's buffer. Every capacity's replay from
    the checkpoints kept is the replay from the start; one from every checkpoint is not, but where
    the states are alike."""
    from harness.allocator.model import Device

    meanwhile = (("alloc", 3, 100),) if scenario == "pool_taken_meanwhile" else (("alloc", 3, 1 / 1024),)  # small pool
    first = 60 if scenario == "cached_too_small" else 200
    df = _scratch_trace([("alloc", 1, first), ("free", 1, 0), ("alloc", 9, 0), *meanwhile, ("free", 9, 0),
                         ("free", 3, 0), ("alloc", 4, 250), ("free", 4, 0)])
    point, card = cards.by_key()["a100-80gb"], cards.by_key()["l4"]
    if scenario == "cached_too_small":  # traced on the L4: the A100's buffer is larger than the cached block
        df = trace_store.sized_for(df, card)
        point, card = card, point
    sized, settings = Sized(df), AllocSettings.from_conf("")
    capacities = range(100 * MiB, 600 * MiB, 2 * MiB)
    kept = Kept(watch=sized.scratch_allocs(point))
    Replays(sized.rows(point), settings, kept).run_unlimited(Device(total=4 * GiB), capacities)
    until = sized.alike_until(card, point, settings, kept.cached)
    assert until == (len(df) if scenario == "alike" else 2)
    went_on, alone = _from_checkpoints_or_start(sized.rows(card), settings,
                                                [k for k in kept.checkpoints if k.event <= until], capacities)
    assert went_on == alone
    any_checkpoint, _ = _from_checkpoints_or_start(sized.rows(card), settings, kept.checkpoints, capacities)
    assert (any_checkpoint == alone) == (scenario == "alike")


@functools.cache
def _demo_1b_over_four():
    """demo-1b over 4 A100s (FSDP2, b2 s1024, one layer, two steps) traced once for this module: the
    card, the point, its trace Sized, the default settings and the replay's peaks."""
    from harness.config.point import Parallel
    from harness.probe.sim.shortcut import at_depth

    a100 = cards.by_key()["a100-80gb"]
    point = train_point(model="demo-1b", batch_size=2, seq_len=1024, steps=2).replace(
        parallel=Parallel(dp_shard=4), gpu=a100)
    sized, settings = Sized(trace_store.to_frame(run_point(at_depth(point, 1))[1].events)), AllocSettings.from_conf("")
    return a100, point, sized, settings, reserved.replay_events(sized.rows(a100), settings)[0]


def test_every_cards_lean_replays_of_a_sharded_trace_go_on_from_checkpoints_past_its_first_change():
    """demo-1b over 4 A100s (FSDP2, one layer): each catalog card whose SMs size its launch tables or
    reductions otherwise takes, at capacities from below the A100 replay's allocated peak to past
    its reserved, the lean replays it takes from the start; going on from the A100 replay's
    checkpoints, some of them past the first row that card's trace differs."""
    from harness.allocator.model import Device

    a100, point, sized, settings, peaks = _demo_1b_over_four()
    capacities = range(peaks.peak_allocated_bytes - 64 * MiB, peaks.peak_reserved_bytes + 64 * MiB, 8 * MiB)
    kept = Kept(watch=sized.scratch_allocs(a100))
    Replays(sized.rows(a100), settings, kept).run_unlimited(Device(total=4 * GiB), capacities)
    past_a_change = 0
    others = {sized.sizes(c): c for c in cards.cards() if not sized.alike(c, a100)}.values()
    assert len(others) >= 3
    for card in others:
        rows = sized.rows(card)
        until = sized.alike_until(card, a100, settings, kept.cached)
        first = next(i for i, (x, y) in enumerate(zip(rows, sized.rows(a100))) if x != y)
        checkpoints = [k for k in kept.checkpoints if k.event <= until]
        past_a_change += any(k.event > first for k in checkpoints)
        went_on, alone = _from_checkpoints_or_start(rows, settings, checkpoints, capacities)
        assert went_on == alone, card.key
    assert past_a_change


def test_a_lean_replay_without_a_limit_keeps_what_a_full_one_keeps():
    """demo-1b over 4 A100s (FSDP2, one layer): a lean replay without a limit (its reserved peak only,
    a third of the time) reaches the full replay's reserved peak, watches the same largest cached
    blocks and keeps checkpoints from which every capacity's lean replay decides as from the start."""
    from harness.allocator.model import Device

    a100, _point, sized, settings, peaks = _demo_1b_over_four()
    rows = sized.rows(a100)
    capacities = range(peaks.peak_allocated_bytes - 64 * MiB, peaks.peak_reserved_bytes + 64 * MiB, 8 * MiB)
    full, lean = (Kept(watch=sized.scratch_allocs(a100)) for _ in range(2))
    by_full = Replays(rows, settings, full).run_unlimited(Device(total=4 * GiB), capacities)
    by_lean = Replays(rows, settings, lean).run_unlimited(Device(total=4 * GiB), capacities, lean=True)
    assert by_lean.lean and by_lean.peak_reserved_bytes == by_full.peak_reserved_bytes
    assert lean.cached == full.cached and full.cached
    assert {k.event for k in full.checkpoints} <= {k.event for k in lean.checkpoints}
    went_on, alone = _from_checkpoints_or_start(rows, settings, lean.checkpoints, capacities)
    assert went_on == alone and any(a[1] for a in alone)  # (some capacities retry)


def test_cards_of_several_kernel_sizings_are_judged_by_one_replay_as_by_their_own():
    """worker._edges_by_sizes on demo-1b over 4 A100s (FSDP2, one layer): cards of 46 to 132 SMs
    (their launch tables and reductions sized by them) every 4 MiB of room around the peaks, one
    sizing replayed without a limit and the rest going on from it where their state is its, get the
    edges and the reserved peak a replay of each card's own rows gives (an OOM by the peaks, none)."""
    import dataclasses

    from harness.config import nccl
    from harness.probe import worker

    _a100, point, sized, settings, peaks = _demo_1b_over_four()
    rec = {"peak_reserved_bytes": peaks.peak_reserved_bytes, "peak_allocated_bytes": peaks.peak_allocated_bytes}
    nccl_bytes = _card(GiB).room() - nccl.on_rank(_card(GiB), point.parallel).room()  # each rank's, off its room
    probe = [dataclasses.replace(_card(room + nccl_bytes, spread=0), key=f"c{sms}-{room // MiB}",
                                 multiprocessors=sms, compute_capability="8.0")
             for sms in (46, 82, 132) for room in range(peaks.peak_allocated_bytes - 8 * MiB,  # (NCCL's spread: 512 MiB)
                                                        peaks.peak_reserved_bytes + 560 * MiB, 4 * MiB)]
    assert len({sized.sizes(c) for c in probe}) == 3
    got = worker._edges_by_sizes(sized, settings, point, probe, rec)
    own = {c.key: reserved.catalog_edges(sized.rows(c), settings, [nccl.on_rank(c, point.parallel)])[c.key]
           for c in probe}
    assert {k: e for k, (e, _) in got.items()} == own
    assert set(own.values()) == set(reserved.EDGES)
    for c in probe:
        peak = got[c.key][1]
        assert peak is None and own[c.key] == "oom" or peak == reserved.replay_events(
            sized.rows(c), settings)[0].peak_reserved_bytes, c.key


def test_cards_of_another_workspace_are_decided_as_their_own_replay_decides_them():
    """worker._edges_by_sizes judges a card of another cuBLAS workspace by a replay with its
    workspaces, but where its room lies under what the traced run surely allocates (an OOM, no
    replay): each card's edge is that replay's (the tiny model, 16 x 1024 tokens, on an A100; cards of
    Hopper's 32 MiB workspace every 8 MiB of room from below its allocated to past its reserved)."""
    import dataclasses

    from harness.config import cublas
    from harness.probe import worker

    a100 = cards.by_key()["a100-80gb"]
    point = train_point(model="tiny", batch_size=16, seq_len=1024).replace(gpu=a100)
    _, tracker = run_point(point)
    df = trace_store.to_frame(tracker.events)
    rows, settings = trace_store.replay_rows(df), AllocSettings.from_conf("")
    unlimited = reserved.replay_events(rows, settings, reserved.Device(total=80 * GiB))[0]
    rec = {"peak_reserved_bytes": unlimited.peak_reserved_bytes, "peak_allocated_bytes": unlimited.peak_allocated_bytes}
    hopper = [dataclasses.replace(_card(room), key=f"c{room // MiB}", compute_capability="9.0")
              for room in range(8 * MiB, unlimited.peak_reserved_bytes + 240 * MiB, 8 * MiB)]
    got = worker._edges_by_sizes(Sized(df), settings, point, hopper, rec)
    own = trace_store.with_workspaces(rows, cublas.workspace_bytes((9, 0)))
    assert {k: e for k, (e, _) in got.items()} == reserved.catalog_edges(own, settings, hopper)
    replayed = {peak for _, peak in got.values()} - {None}
    assert replayed == {reserved.replay_events(own, settings)[0].peak_reserved_bytes}
    assert 0 < sum(peak is None for _, peak in got.values()) < len(hopper)  # the OOMs under its allocated peak


def test_a_larger_workspace_that_costs_a_segment_is_no_fit_on_a_card_the_traced_peaks_fit(tmp_path):
    """A 60 GiB tensor freed, an A100's cuBLAS workspace (8 MiB) cut from its cached block, then a
    tensor 16 MiB short of 60 GiB: on the A100 it fits the rest of that block; with a Hopper's 32 MiB
    workspace it does not, and the allocator asks for a second 60 GiB segment. The row calls the
    H100 80GB an OOM though the traced peaks leave it 18 GiB, records each card's own reserved peak,
    and a plan's margin, headroom and verdict read it."""
    from harness.analysis.verdict import verdicts
    from harness.config import cublas
    from harness.plan import fit
    from harness.probe import worker
    from harness.probe.sim.tracker import TraceEvent
    from harness.record.row import base_record, cards_reserved

    a100, h100, h200 = (cards.by_key()[k] for k in ("a100-80gb", "h100-80gb", "h200"))
    big = 60 * GiB
    events = [TraceEvent(0, "alloc", 1, big, "parameter", "setup", -1, ""),
              TraceEvent(1, "free", 1, big, "parameter", "setup", -1, ""),
              TraceEvent(2, "alloc", 2, cublas.workspace_bytes((8, 0)), "workspace", "forward", 0, ""),
              TraceEvent(3, "alloc", 3, big - 16 * MiB, "activation", "forward", 0, ""),
              TraceEvent(4, "free", 3, big - 16 * MiB, "activation", "forward", 0, "")]
    point = train_point().replace(gpu=a100)
    rec = {**base_record(point), "peak_allocated_bytes": big, "attention_calls": None}
    df = trace_store.to_frame(events)
    df.to_parquet(tmp_path / trace_store.TRACE_FILE, index=False)
    row = worker._replayed(point, rec, Sized(df, events), tmp_path, 0.0)
    assert row["peak_reserved_bytes"] == big
    assert h100.at_worst().room() > big + 16 * GiB  # what any bound on the traced peaks would call room
    assert "h100-80gb" not in row["fits_cards"] and "a100-80gb" in row["fits_cards"]
    mine, second = cards_reserved(row), big - 16 * MiB  # the second segment: the request's size
    assert mine["h100-80gb"] == mine["h200"] == big + second
    assert "h200" in row["fits_cards"]
    assert not fit.fits(row, h100, margin=0.05)
    assert fit.headroom_bytes(row, h200) == h200.room() - (big + second)
    # the job on a T4 OOMs; a card problem, whose card needed is sized by that card's own reserved peak
    job = {**row, "run_id": "job", "status": "oom", "gpu": "T4", "kind": "params", "sweep": "s"}
    verdict = verdicts(pd.DataFrame([job])).iloc[0]
    assert verdict["verdict"] == "card problem"
    card = cards.by_key()[verdict["card_needed"]]
    assert verdict["card_headroom_bytes"] == card.room() - (mine.get(card.key) or big)
    # scripts/edge_audit.py replays each recorded room as the card runs it: it finds none wrong
    # here, and the H100's "room" a band around the traced peaks gave
    import importlib.util

    from tests.conftest import REPO

    spec = importlib.util.spec_from_file_location("edge_audit", REPO / "scripts" / "edge_audit.py")
    audit = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(audit)
    assert audit.audit(pd.DataFrame([row]))[1] == 0
    banded = {**row, "fits_cards": [*row["fits_cards"], "h100-80gb"]}
    assert audit.audit(pd.DataFrame([banded]))[1:] == (1, second)
