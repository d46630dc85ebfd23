"""The virtual GPU with the allocator model: reserved bytes, per-card verdicts, one trace reused."""

import json

import pandas as pd
import pytest

from harness.allocator.replay import Replays, replay_events
from harness.allocator.settings import AllocSettings
from harness.config.point import Card
from harness.probe.sim import reserved
from tests.conftest import run_cli

MiB = 1024**2


def _small_then_large():
    """8 x 16 MiB freed, then 4 x 32 MiB: 128 MiB live at most, 256 MiB reserved by default."""
    rows = [("alloc", i, 16 * MiB, ("forward", 0, "m", "activation"), 0) for i in range(8)]
    rows += [("free", i, 16 * MiB, None, 0) for i in range(8)]
    rows += [("alloc", 10 + i, 32 * MiB, ("backward", 0, "m", "temporary"), 0) for i in range(4)]
    return rows


def _card(mib):
    return Card(key=f"c{mib}", name=f"{mib} MiB card", memory_bytes=mib * MiB, non_pytorch_bytes=0)


def test_a_card_between_allocated_and_reserved_fits_by_the_retry_ladder():
    rows, settings = _small_then_large(), AllocSettings()
    unlimited, _ = replay_events(rows, settings)
    assert (unlimited.peak_allocated_bytes, unlimited.peak_reserved_bytes) == (128 * MiB, 256 * MiB)
    replays = Replays(rows, settings)
    assert reserved.fits(replays, _card(200), unlimited)  # cached segments released, retried
    assert not reserved.fits(replays, _card(100), unlimited)
    out = reserved.analyse(rows, settings, _card(200), [_card(100), _card(200)], "2.6")
    assert out["num_alloc_retries"] >= 1 and "status" not in out and out["fits_cards"] == ["c200"]


def test_cards_the_caller_judges_itself_are_left_out_of_the_edge_columns_given_the_peaks():
    """analyse asks `elsewhere` with the unlimited replay's peaks which cards it should not judge
    (probe.worker judges those with their own kernel scratch): they are absent from every edge
    column, the others' edges as without it."""
    rows, settings = _small_then_large(), AllocSettings()
    cards = [_card(100), _card(200), _card(300)]
    asked = []

    def elsewhere(res, alloc):
        asked.append((res, alloc))
        return {"c200"}

    out = reserved.analyse(rows, settings, _card(300), cards, "2.6", elsewhere=elsewhere)
    assert asked == [(256 * MiB, 128 * MiB)]
    assert out["fits_cards"] == ["c300"] and out["retry_cards"] == [] and out["tight_cards"] == []
    assert reserved.analyse(rows, settings, _card(300), cards, "2.6")["fits_cards"] == ["c200", "c300"]


def test_a_capacity_that_decides_every_cudamalloc_alike_reuses_a_replay_and_its_verdict():
    """Cards every 8 MiB from 96 to 320 MiB, each of its own total size: each answer (OOM or not,
    cache flushes, reserved peak) is what a replay of its own gives, from fewer replays than cards. Under
    expandable segments (whose address ranges a card's total sizes) cards of other totals do not
    share one."""
    from harness.allocator.model import Device

    rows, settings = _small_then_large(), AllocSettings()
    replays = Replays(rows, settings)
    for mib in range(96, 321, 8):
        device = Device(capacity=mib * MiB, total=(320 + mib) * MiB)
        got, own = replays.on(device), replay_events(rows, settings, device)[0]
        assert (bool(got.ooms), got.num_alloc_retries, got.peak_reserved_bytes) == \
            (bool(own.ooms), own.num_alloc_retries, own.peak_reserved_bytes), mib
    assert len(replays.done) < len(range(96, 321, 8)) // 2
    read = []  # rows read through a function: once for each replay made, never for one reused
    lazy = Replays(lambda: read.append(1) or rows, settings)
    for mib in range(96, 321, 8):
        lazy.on(Device(capacity=mib * MiB, total=320 * MiB))
    assert len(read) == len(lazy.done) == len(replays.done)
    expandable = Replays(rows, AllocSettings.from_conf("expandable_segments:True"))
    for total in (320, 640, 320):
        expandable.on(Device(capacity=200 * MiB, total=total * MiB))
    assert [d.total for d, _r in expandable.done] == [320 * MiB, 640 * MiB]


@pytest.mark.parametrize("conf", ["", "roundup_power2_divisions:4", "max_split_size_mb:20", "expandable_segments:True"])
def test_a_lean_replay_decides_every_capacity_as_the_full_replay_does(conf):
    """An FSDP2 rank's trace (its own streams) on capacities from its allocated to past its reserved
    peak: the lean replay's OOM, cache flushes and peaks are the full replay's; and so are those of
    a lean replay that goes on from where the replay without a limit first asked for more than the
    capacity (Replays.run_unlimited; every setting but expandable segments, whose address ranges
    the device sizes). A lean replay counts no allocated or requested bytes."""
    from harness.allocator.model import Device
    from harness.config.point import Parallel
    from harness.probe.sim.trace import run_point
    from harness.record import trace_store
    from tests.conftest import train_point

    point = train_point(batch_size=4, seq_len=128).replace(parallel=Parallel(dp_shard=2))
    rows = trace_store.replay_rows(trace_store.to_frame(run_point(point)[1].events))
    settings = AllocSettings.from_conf(conf)
    unlimited = replay_events(rows, settings)[0]
    low, high = unlimited.peak_allocated_bytes, unlimited.peak_reserved_bytes + 4 * MiB
    capacities = range(low, high, max(1, (high - low) // 24))
    checkpointed = Replays(rows, settings)
    assert checkpointed.run_unlimited(Device(total=1024 * MiB), capacities).as_dict() == unlimited.as_dict()
    assert bool(checkpointed.kept.checkpoints) != settings.expandable_segments
    decided = set()
    for capacity in capacities:
        device = Device(capacity=capacity, total=1024 * MiB)
        lean, full = (replay_events(rows, settings, device, lean=lean)[0] for lean in (True, False))
        on_its_own = Replays(rows, settings)  # no replay of another capacity to reuse: its checkpoint's
        on_its_own.kept = checkpointed.kept
        assert on_its_own.on(device).as_dict() == lean.as_dict(), capacity

        def decisions(r):
            return [r.ooms[0]["event"] if r.ooms else None, r.num_alloc_retries, r.peak_reserved_bytes,
                    r.alike_from_bytes, r.alike_below_bytes, r.requests]

        assert decisions(lean) == decisions(full), capacity
        assert lean.peak_allocated_bytes == lean.peak_requested_bytes == 0
        decided.add((bool(lean.ooms), lean.num_alloc_retries > 0))
    assert len(decided) > 1
    if not conf:
        assert decided == {(True, True), (False, True), (False, False)}  # OOM, fits on retry, fits


def test_an_oom_row_says_where_and_words_the_message():
    out = reserved.analyse(_small_then_large(), AllocSettings(), _card(120), [_card(120)], "2.6")
    assert out["status"] == "oom" and (out["oom_phase"], out["oom_step"]) == ("forward", 0)  # the 8th 16 MiB
    assert out["oom_tried_bytes"] == 16 * MiB
    assert out["oom_message"].startswith("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 16.00 MiB.")


def test_expandable_segments_reserve_less_for_the_same_trace():
    rows = _small_then_large()
    default, _ = replay_events(rows, AllocSettings())
    expandable, _ = replay_events(rows, AllocSettings.from_conf("expandable_segments:True"))
    assert expandable.peak_reserved_bytes < default.peak_reserved_bytes


@pytest.mark.slow
def test_allocator_sweep_traces_once_and_replays_the_rest(tmp_path):
    r = run_cli("sweep", "model=tiny", "batch_size=1", "seq_len=32", "precision=bf16", "checkpointing=false",
                "allocator=default,expandable,max_split_512", "hydra.sweeper.max_batch_size=1",
                f"results_dir={tmp_path}")
    assert r.returncode == 0, r.stderr
    df = pd.read_parquet(next((tmp_path / "default").iterdir()) / "results.parquet")
    assert len(df) == 3 and df["trace_reused"].notna().sum() == 2
    assert df["peak_tensor_bytes"].nunique() == 1  # one trace
    assert (df["peak_reserved_bytes"] >= df["peak_allocated_bytes"]).all()
    assert (df["peak_allocated_bytes"] >= df["peak_tensor_bytes"]).all()


@pytest.mark.slow
def test_snapshot_true_writes_a_memory_viz_snapshot_next_to_the_result(tmp_path):
    from torch.cuda import _memory_viz

    from harness.allocator import snapshot as snap

    r = run_cli("run", "model=tiny", "seq_len=32", "snapshot=true", f"results_dir={tmp_path}")
    assert r.returncode == 0, r.stderr
    rec = json.loads(next(tmp_path.glob("runs/*/result.json")).read_text())
    data = snap.load(rec["snapshot_path"])
    _memory_viz.segsum(data)
    assert len(_memory_viz.trace_plot(data)) > 1000
    for seg in data["segments"]:
        assert sum(b["size"] for b in seg["blocks"]) == seg["total_size"]
    allocs = [e for e in data["device_traces"][0] if e["action"] == "alloc"]
    assert allocs and all(e["frames"] for e in allocs)  # each allocation names its module and phase


def test_a_traces_frame_is_the_frame_pandas_makes_of_its_events_and_gives_them_back():
    """trace_store.to_frame builds the frame column by column through arrow: the same columns,
    dtypes and values as pandas reading the events row by row (a real trace, none, and one whose
    column mixes types, which arrow refuses and pandas keeps as objects); events() inverts it."""
    from harness.probe.sim.trace import run_point
    from harness.record import trace_store
    from tests.conftest import train_point

    def by_rows(events):
        df = pd.DataFrame(events, columns=trace_store.COLUMNS)
        df["seq"] = range(len(df))
        df["allocated"] = trace_store._allocated(df["size"].astype("int64"))
        return df

    traced = run_point(train_point(batch_size=1, seq_len=32))[1].events
    mixed = [traced[0], traced[1]._replace(module=3)]
    for events in (traced, [], mixed):
        df = trace_store.to_frame(events)
        pd.testing.assert_frame_equal(df, by_rows(events))
        assert trace_store.events(df) == [e._replace(seq=i) for i, e in enumerate(events)]
    assert len(traced) > 100 and df["module"].dtype == object  # (the mixed one: pandas' objects)
