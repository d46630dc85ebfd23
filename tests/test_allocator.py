"""The caching-allocator model: PyTorch's rules, its known behaviours, and real traces replayed exactly."""

import random
import re
from pathlib import Path

import pytest

from harness.allocator import snapshot as snap
from harness.allocator.model import (
    CachingAllocator,
    Device,
    OutOfMemory,
    allocation_size,
    round_plain,
    round_size,
)
from harness.allocator.oom_message import format_size, message
from harness.allocator.replay import replay_snapshot
from harness.allocator.settings import AllocSettings
from tests.conftest import REPO, run_cli

MiB, GiB = 1024**2, 1024**3
SNAPSHOTS = sorted((Path(__file__).resolve().parent / "data" / "snapshots").glob("*.pickle"))


def allocator(conf: str = "", **device) -> CachingAllocator:
    return CachingAllocator(AllocSettings.from_conf(conf), Device(**device) if device else Device())


# ---- rounding and segment sizes --------------------------------------------------------------

@pytest.mark.parametrize("size,expected", [(0, 512), (1, 512), (511, 512), (512, 512), (513, 1024), (1200, 1536),
                                           (3 * MiB + 1, 3 * MiB + 512), (2**40 + 3, 2**40 + 512)])
def test_requests_round_to_512_bytes_alike_in_the_allocator_the_tracker_and_a_trace_file(size, expected):
    """One rule, where the allocator model rounds a request, where the tracker counts allocated
    bytes (round_plain) and where a trace file's allocated column is made (on the whole column); but
    a 0-B row of a trace, which is a launch's placeholder (probe.sim.kernel_scratch), holds none."""
    from harness.probe.sim.tracker import TraceEvent
    from harness.record.trace_store import to_frame

    assert round_size(size) == round_plain(size) == expected
    assert allocator().malloc(size).size == expected
    event = TraceEvent(0, "alloc", 1, size, "activation", "forward", 0, "", 0)
    assert to_frame([event])["allocated"].tolist() == [expected if size else 0]


def test_roundup_power2_divisions_round_to_the_next_division():
    table = AllocSettings.from_conf("roundup_power2_divisions:4").roundup_power2_divisions
    assert round_size(3 * MiB + 1, table) == 3 * MiB + MiB // 2  # step = 2 MiB / 4
    assert round_size(4 * MiB, table) == 4 * MiB  # powers of two stay
    assert round_size(1200, table) == 1536  # not above 512 * 4: plain rounding


def test_roundup_list_form_maps_mib_keys_to_intervals():
    table = AllocSettings.from_conf("roundup_power2_divisions:[256:1,512:2,1024:4,>:8]").roundup_power2_divisions
    assert table[:8] == (1,) * 8  # the first value fills the lower intervals
    assert table[8:11] == (1, 2, 4)  # 512:2 is [512 MiB, 1 GiB): the code, not the docs
    assert table[11:] == (8,) * 5


@pytest.mark.parametrize("size,segment", [(512 * 1024, 2 * MiB), (MiB, 2 * MiB), (3 * MiB, 20 * MiB),
                                          (11 * MiB, 12 * MiB), (10 * MiB, 10 * MiB)])
def test_segment_size_follows_the_request(size, segment):
    assert allocation_size(size) == segment


# ---- known behaviours --------------------------------------------------------------------------

def _reserved_after(conf, first, second):
    a = allocator(conf)
    blocks = [a.malloc(first[1]) for _ in range(first[0])]
    after_first = a.stats.reserved_bytes.current
    for b in blocks:
        a.free(b)
    for _ in range(second[0]):
        a.malloc(second[1])
    return after_first, a.stats.reserved_bytes.current


def test_eight_16mib_allocations_map_140mib_with_expandable_segments():
    assert _reserved_after("expandable_segments:True", (8, 16 * MiB), (4, 32 * MiB)) == (140 * MiB, 140 * MiB)


def test_a_request_beyond_an_expandable_segments_range_is_an_oom_on_the_card_and_mapped_without_a_limit():
    """find_expandable_block reserves 1 1/8 of the card's memory: a request for more (DDP's flat
    bucket of an 8B model's fp32 gradients, 32 GB, on a 24 GB card) fails to map there, and the
    replay without a limit (the card's size for ranges) maps it whole beside what is mapped."""
    conf = "expandable_segments:True"
    on_card = allocator(conf, capacity=22 * GiB, total=24 * GiB)
    with pytest.raises(OutOfMemory):
        on_card.malloc(30 * GiB)
    unlimited = allocator(conf, total=24 * GiB)
    unlimited.malloc(1000 * MiB)  # (pages of 20 MiB)
    unlimited.malloc(30000 * MiB)
    assert unlimited.stats.reserved_bytes.current == 31000 * MiB


def test_small_then_large_reserves_twice_large_then_small():
    assert _reserved_after("", (8, 16 * MiB), (4, 32 * MiB))[1] == 256 * MiB
    assert _reserved_after("", (4, 32 * MiB), (8, 16 * MiB))[1] == 128 * MiB


def test_pools_stay_apart_across_the_1mib_boundary():
    a = allocator()
    a.malloc(2 * MiB)
    a.malloc(MiB // 2)
    assert a.stats.reserved_bytes.current == 22 * MiB


def _cycles(conf: str, n: int) -> tuple[int, int]:
    """Short-lived oversize tensors of varying size beside a tensor that lives one cycle."""
    a, live, peak_allocated = allocator(conf, total=80 * GiB), [], 0
    for k in range(n):
        live.append((a.malloc((130 + 10 * (k % 7)) * MiB), 0))
        live.append((a.malloc(66 * MiB), 1))
        peak_allocated = max(peak_allocated, a.stats.allocated_bytes.current)
        keep = []
        for b, ttl in live:
            if ttl <= 0:
                a.free(b)
            else:
                keep.append((b, ttl - 1))
        live = keep
    return a.stats.reserved_bytes.current, peak_allocated


def test_max_split_size_with_expandable_segments_grows_reserved_without_bound():
    both = "max_split_size_mb:128,expandable_segments:True"
    r20, alloc20 = _cycles(both, 20)
    r100, alloc100 = _cycles(both, 100)
    assert alloc20 == alloc100 < 400 * MiB  # live memory is bounded
    assert r100 > 4 * r20  # reserved keeps growing with the cycles
    for alone in ("", "expandable_segments:True", "max_split_size_mb:128"):
        assert _cycles(alone, 20)[0] == _cycles(alone, 100)[0], alone


def test_best_fit_takes_the_smallest_block_then_the_lowest_address():
    a = allocator()
    x, keep1, y, keep2, z = (a.malloc(s) for s in (40 * MiB, 2 * MiB, 30 * MiB, 2 * MiB, 30 * MiB))
    a.free(x)
    a.free(y)
    a.free(z)
    # segments come top down, as the driver hands them out: z, the later, lies lowest
    assert z.addr < y.addr and a.malloc(30 * MiB).addr == z.addr


def test_large_remainder_up_to_1mib_is_not_split_and_counts_as_allocated():
    a = allocator()
    b = a.malloc(19 * MiB + MiB // 2)  # 20 MiB segment, 0.5 MiB left: handed out whole
    assert b.size == 20 * MiB and a.stats.allocated_bytes.current == 20 * MiB
    a2 = allocator()
    assert a2.malloc(18 * MiB).size == 18 * MiB  # 2 MiB left: split


def test_oversize_blocks_never_serve_normal_requests():
    a = allocator("max_split_size_mb:100")
    big = a.malloc(200 * MiB)
    a.free(big)
    small = a.malloc(50 * MiB)
    assert small.addr != big.addr and a.stats.reserved_bytes.current == 250 * MiB
    again = a.malloc(190 * MiB)  # oversize request: reuse within +20 MiB
    assert again.addr == big.addr


def test_free_blocks_are_reused_only_on_their_stream():
    a = allocator()
    b = a.malloc(30 * MiB, stream=1)
    a.free(b)
    assert a.malloc(30 * MiB, stream=2).addr != b.addr
    assert a.malloc(30 * MiB, stream=1).addr == b.addr


def test_retry_ladder_releases_cached_segments_before_giving_up():
    a = allocator(capacity=100 * MiB)
    cached = a.malloc(60 * MiB)
    a.free(cached)
    b = a.malloc(80 * MiB)  # needs the cached 60 MiB segment released first
    assert b is not None and a.stats.num_alloc_retries == 1 and a.stats.num_ooms == 0
    assert a.stats.reserved_bytes.current == 80 * MiB


def test_split_segments_are_never_released_so_the_oom_reports_them():
    a2 = allocator(capacity=64 * MiB, total=64 * MiB)
    x = a2.malloc(40 * MiB)
    y = a2.malloc(2 * MiB)  # 20 MiB segment, split: 18 MiB free inside it
    a2.free(x)
    with pytest.raises(OutOfMemory) as e:
        a2.malloc(50 * MiB)
    assert a2.stats.num_ooms == 1 and e.value.reserved == 20 * MiB  # the split segment stays
    assert e.value.reserved - e.value.allocated == 18 * MiB
    assert y.allocated


def test_per_process_fraction_caps_reserved_and_the_message_says_allowed():
    a = allocator(total=10 * GiB, fraction=0.5)
    with pytest.raises(OutOfMemory) as e:
        a.malloc(6 * GiB)
    assert e.value.allowed == 5 * GiB
    assert "5.00 GiB allowed; " in message(e.value, "2.6")


def test_garbage_collection_threshold_reclaims_old_cached_segments():
    def reserved(conf):
        a = allocator(conf, total=1 * GiB, fraction=1.0)
        for size in range(30, 60, 2):  # every size a new segment; each freed at once
            a.free(a.malloc(size * MiB))
        return a.stats.reserved_bytes.current

    assert reserved("") > 600 * MiB
    assert reserved("garbage_collection_threshold:0.5") <= 512 * MiB + 60 * MiB


def test_inactive_split_bytes_is_the_free_split_remainder_total():
    rng = random.Random(1)
    a, live = allocator(), []
    for _ in range(3000):
        if live and rng.random() < 0.45:
            a.free(live.pop(rng.randrange(len(live))))
        else:
            live.append(a.malloc(rng.choice([rng.randint(1, 4096), rng.randint(1, 64 * MiB)])))
        expected = sum(b.size for b in a.blocks.values() if b.mapped and not b.allocated and b.is_split())
        assert a.stats.inactive_split_bytes.current == expected


def test_allocated_and_reserved_return_to_the_start_after_everything_is_freed():
    rng = random.Random(2)
    a, live = allocator("expandable_segments:True"), []
    for _ in range(2000):
        if live and rng.random() < 0.5:
            a.free(live.pop(rng.randrange(len(live))))
        else:
            live.append(a.malloc(rng.randint(1, 40 * MiB)))
    for b in live:
        a.free(b)
    a.empty_cache()
    assert a.stats.allocated_bytes.current == 0 and a.stats.reserved_bytes.current == 0


# ---- OOM wording -------------------------------------------------------------------------------

def test_format_size_matches_c10():
    assert [format_size(n) for n in (0, 1024, 1025, MiB, GiB, 3 * GiB // 2)] == [
        "0 bytes", "1024 bytes", "1.00 KiB", "1024.00 KiB", "1024.00 MiB", "1.50 GiB"]


@pytest.mark.parametrize("version,pattern", [
    ("1.13", r"^CUDA out of memory\. Tried to allocate [\d.]+ \w+ \(GPU 0; [\d.]+ \w+ total capacity; "
             r"[\d.]+ \w+ already allocated; [\d.]+ \w+ free; [\d.]+ \w+ reserved in total by PyTorch\) "),
    ("2.1", r"has a total capacty of [\d.]+ \w+ of which [\d.]+ \w+ is free\. .* try setting max_split_size_mb"),
    ("2.6", r"has a total capacity of .* is reserved by PyTorch but unallocated\. .*expandable_segments:True.*"
            r"\(https://pytorch\.org/docs/stable/notes/cuda\.html#environment-variables\)$"),
    ("2.9", r"\(https://docs\.pytorch\.org/docs/stable/notes/cuda\.html#optimizing-memory-usage-with-pytorch-cuda-alloc-conf\)$"),
])
def test_oom_message_is_worded_as_each_version_words_it(version, pattern):
    a = allocator(capacity=100 * MiB, total=120 * MiB)
    a.malloc(90 * MiB)
    with pytest.raises(OutOfMemory) as e:
        a.malloc(30 * MiB)
    text = message(e.value, version)
    assert re.search(pattern, text), text
    assert "Tried to allocate 30.00 MiB" in text  # the segment size (>= 10 MiB: itself)


def test_tried_to_allocate_is_the_segment_size_not_the_tensor():
    a = allocator(capacity=10 * MiB, total=10 * MiB)
    with pytest.raises(OutOfMemory) as e:
        a.malloc(3 * MiB)
    assert e.value.tried_bytes == 20 * MiB


# ---- real snapshots ------------------------------------------------------------------------------

def test_the_real_snapshots_ship_with_the_tests():
    assert len(SNAPSHOTS) == 3

@pytest.mark.parametrize("path", SNAPSHOTS, ids=lambda p: p.stem)
def test_real_snapshot_replays_exactly_under_recorded_settings(path):
    """Every allocation at its recorded address, every segment decision, reserved after every
    event and the final layout of every segment and block: as recorded."""
    r = replay_snapshot(snap.load(path))
    assert r.allocs_total > 2000
    assert r.allocs_address_matched == r.allocs_total
    assert r.segments_matched == r.segments_total
    assert r.reserved_matched == r.reserved_checked
    assert r.final_layout_matched


def test_what_if_on_a_smaller_card_gives_the_oom_it_would_raise():
    data = snap.load(next(p for p in SNAPSHOTS if "fullstep" in p.name))
    r = replay_snapshot(data, device=Device(capacity=40 * GiB, total=40 * GiB))
    assert len(r.ooms) == 1 and r.ooms[0]["reserved_bytes"] <= 40 * GiB
    assert r.allocs_total is None  # what-if: no check against the recording


def test_expandable_segments_cut_the_recorded_fragmentation():
    data = snap.load(next(p for p in SNAPSHOTS if "fullstep" in p.name))
    default = replay_snapshot(data)
    expandable = replay_snapshot(data, settings=AllocSettings.from_conf("expandable_segments:True"))
    assert expandable.peak_reserved_bytes < default.peak_reserved_bytes


# ---- files and the command line ---------------------------------------------------------------

def test_snapshot_loader_refuses_code(tmp_path):
    import os
    import pickle

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    path = tmp_path / "evil.pickle"
    path.write_bytes(pickle.dumps(Evil()))
    with pytest.raises(snap.SnapshotError, match="refused"):
        snap.load(path)


def test_written_snapshot_loads_in_pytorch_memory_viz(tmp_path):
    from torch.cuda import _memory_viz

    data = snap.load(SNAPSHOTS[0])
    trace: list = []
    replay_snapshot(data, on_event=lambda a, addr, size, st: trace.append(
        {"action": a, "addr": addr, "size": size, "stream": st, "time_us": len(trace), "frames": []}))
    from harness.allocator.replay import seed

    alloc = CachingAllocator(AllocSettings())
    seed(alloc, snap.start_state(data, 0))
    path = snap.write(tmp_path / "s.pickle", alloc, trace)
    written = snap.load(path)
    assert "segment" in _memory_viz.segsum(written)
    html = _memory_viz.trace_plot(written)
    assert isinstance(html, str) and len(html) > 1000
    for seg in written["segments"]:
        assert sum(b["size"] for b in seg["blocks"]) == seg["total_size"]


@pytest.mark.parametrize("content", ["text", "evil", "truncated", "no_trace", "missing", "directory"])
def test_replay_bad_input_is_a_clear_error_exit_2(tmp_path, content):
    import os
    import pickle

    path = tmp_path / "s.pickle"
    if content == "text":
        path.write_text("hello")
    elif content == "evil":
        class Evil:
            def __reduce__(self):
                return (os.system, ("echo pwned",))
        path.write_bytes(pickle.dumps(Evil()))
    elif content == "truncated":
        path.write_bytes(SNAPSHOTS[0].read_bytes()[:1000])
    elif content == "no_trace":
        path.write_bytes(pickle.dumps({"segments": [], "device_traces": [[]], "allocator_settings": {}}))
    elif content == "directory":
        path.mkdir()
    r = run_cli("replay", str(path))
    assert r.returncode == 2
    assert r.stderr.startswith("harness: error: ") and str(path) in r.stderr and len(r.stderr.splitlines()) == 1
    assert "pwned" not in r.stdout


def test_replay_unknown_allocator_key_is_exit_2():
    r = run_cli("replay", str(SNAPSHOTS[0]), "allocator.conf=bogus_key:1")
    assert r.returncode == 2 and "allocator.conf" in r.stderr


def test_replay_takes_a_setting_of_several_keys_as_pytorch_writes_it():
    import json

    conf = "max_split_size_mb:128,garbage_collection_threshold:0.6"
    outs = [run_cli("replay", str(SNAPSHOTS[0]), c, "gpu=a10g", "fraction=0.8", "--json")
            for c in (f"allocator.conf={conf}", f'allocator.conf="{conf}"')]
    assert all(r.returncode == 0 for r in outs), [r.stderr for r in outs]
    assert json.loads(outs[0].stdout) == json.loads(outs[1].stdout)
    assert json.loads(outs[0].stdout)["settings"] == conf


def test_replay_json_reports_the_check_against_the_recording():
    import json

    r = run_cli("replay", str(SNAPSHOTS[0]), "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    for key in ("peak_reserved_bytes", "peak_allocated_bytes", "final_reserved_bytes", "ooms",
                "allocs_total", "allocs_address_matched"):
        assert key in out
    assert out["allocs_total"] == out["allocs_address_matched"] > 0


@pytest.mark.parametrize("conf", ["", "expandable_segments:True", "max_split_size_mb:64",
                                  "roundup_power2_divisions:4,garbage_collection_threshold:0.6",
                                  "max_split_size_mb:64,max_non_split_rounding_mb:128",
                                  "large_segment_size_mb:40,max_split_size_mb:64",
                                  "expandable_segments:True,large_segment_size_mb:32"])
def test_a_snapshot_written_from_a_replay_replays_exactly(tmp_path, conf):
    """Round trip: trace -> model -> snapshot file -> replay checked against it, for every setting
    (this is how snapshots recorded from the first allocation, as the cuda backend writes them, check)."""
    rng = random.Random(3)
    rows, live, key = [], [], 0
    for _ in range(4000):
        if live and rng.random() < 0.47:
            rows.append(("free", live.pop(rng.randrange(len(live))), 0, None, 0))
        else:
            rows.append(("alloc", key, rng.choice([rng.randint(1, 8192), rng.randint(MiB, 48 * MiB)]), None, 0))
            live.append(key)
            key += 1
    from harness.allocator.replay import replay_events

    trace = []
    settings = AllocSettings.from_conf(conf)
    result, alloc = replay_events(rows, settings, on_event=lambda a, addr, size, st, _tag: trace.append(
        {"action": a, "addr": addr, "size": size, "stream": st, "time_us": len(trace), "frames": []}))
    data = snap.load(snap.write(tmp_path / "s.pickle", alloc, trace))
    again = replay_snapshot(data)
    assert again.exact, again
    assert again.peak_reserved_bytes == result.peak_reserved_bytes


# ---- recordings that begin with memory in use ------------------------------------------------

def _recording(conf: str, program: list, start: int) -> dict:
    """The snapshot a program leaves when history recording begins at step `start` (as a ring
    buffer or a late _record_memory_history leaves it): the model stands in for the real allocator."""
    alloc = allocator(conf)
    trace: list = []
    live: dict = {}
    for i, (action, name, size) in enumerate(program):
        alloc.on_event = (lambda a, addr, s, st: trace.append({"action": a, "addr": addr, "size": s, "stream": st,
                                                                 "time_us": len(trace), "frames": []})) if i >= start else None
        if action == "alloc":
            live[name] = alloc.malloc(size)
        else:
            alloc.free(live.pop(name))
    return snap.as_dict(alloc, trace)


def test_a_block_handed_its_remainder_unsplit_before_the_recording_is_rebuilt_whole():
    """B takes a 5 MiB hole for 4.5 MiB (the 0.5 MiB remainder is never split off); the free space
    after it is larger than 1 MiB. Recorded from after that, B's block is rebuilt with its remainder:
    where the first allocation after it lands says where the free space began."""
    program = [("alloc", "x1", 3 * MiB), ("alloc", "x2", 5 * MiB), ("alloc", "x3", 5 * MiB),
               ("free", "x2", 0), ("alloc", "b", 4 * MiB + 512 * 1024), ("free", "x3", 0),
               ("alloc", "c", 2 * MiB), ("free", "b", 0), ("alloc", "d", 4 * MiB), ("free", "c", 0)]
    data = _recording("", program, start=6)
    r = replay_snapshot(data)
    assert r.exact, r


def test_expandable_segments_recorded_after_memory_was_in_use_replay_when_nothing_is_mapped():
    """Reserved is constant when the recording holds no map or unmap: the start state is the final
    one's mapped ranges."""
    program = [("alloc", f"a{i}", 16 * MiB) for i in range(6)] + [("free", f"a{i}", 0) for i in range(0, 6, 2)]
    program += [("alloc", "b", 12 * MiB), ("alloc", "c", 3 * MiB), ("free", "a1", 0), ("alloc", "d", 20 * MiB)]
    data = _recording("expandable_segments:True", program, start=9)
    assert not any(e["action"].startswith("segment_") for e in data["device_traces"][0])
    r = replay_snapshot(data)
    assert r.exact and r.allocs_total == 3
    mapping = _recording("expandable_segments:True", program + [("alloc", "e", 200 * MiB)], start=9)
    with pytest.raises(snap.SnapshotError, match="mapped or unmapped memory during a recording"):
        replay_snapshot(mapping)


@pytest.mark.parametrize("path", SNAPSHOTS, ids=lambda p: p.stem)
def test_a_real_recording_cut_anywhere_replays_exactly(path):
    """A recording that begins with memory in use (a late _record_memory_history, a full ring
    buffer): the real trace with its first events dropped, at ten places, replays exactly."""
    data = snap.load(path)
    dev = snap.device_of(data)
    trace = data["device_traces"][dev]
    for k in range(len(trace) // 11, len(trace), len(trace) // 11):
        cut = {**data, "device_traces": [trace[k:] if d == dev else [] for d in range(len(data["device_traces"]))]}
        assert replay_snapshot(cut).exact, k


# Three runs on a lent H200 (torch 2.11, driver 580): each allocator event of their memory history,
# from an empty card (tests/data/snapshots/*.events.json.gz, [action, addr, size, stream] each)
H200_RUNS = ["h200-demo1b-bf16", "h200-demo1b-fp32", "h200-demo1b-fsdp2-rank0-of-4"]


@pytest.mark.parametrize("name", H200_RUNS)
def test_the_models_own_addresses_replay_an_h200s_requests_to_its_reserved_peak(name):
    """The card's requests (alloc and free, in order, FSDP2's three streams apart) at the model's
    own cudaMalloc addresses, handed out top down as the driver did: its reserved peak (the sum of
    its segments at every moment) byte for byte. Bottom up, demo-1b bf16 replayed 58,720,256 B
    over and the FSDP2 rank 46,137,344 B under: equal-sized free blocks, the lowest address first."""
    import gzip
    import json

    from harness.allocator.replay import ReplayRow, replay_events

    with gzip.open(REPO / "tests" / "data" / "snapshots" / f"{name}.events.json.gz", "rt") as f:
        events = json.load(f)["events"]
    rows, streams = [], {}
    reserved = peak = 0
    for action, addr, size, stream in events:
        if action == "segment_alloc":
            reserved += size
            peak = max(peak, reserved)
        elif action == "segment_free":
            reserved -= size
        elif action == "alloc":
            rows.append(ReplayRow("alloc", addr, size, None, streams.setdefault(stream, len(streams))))
        elif action == "free_requested":
            rows.append(ReplayRow("free", addr, size, None))
    result, _ = replay_events(rows, AllocSettings())
    assert result.peak_reserved_bytes == peak


@pytest.mark.parametrize("conf", ["", "max_split_size_mb:64", "roundup_power2_divisions:4",
                                  "expandable_segments:True", "garbage_collection_threshold:0.5"])
def test_a_replay_without_a_listener_reports_what_the_allocators_whole_statistics_say(conf):
    """A replay that reports no events keeps only the statistics its result reads (Stats.peaks) and
    serves most requests inline (CachingAllocator.run_rows); one with a listener runs every request
    through malloc and free with every statistic. Three steps of churn on two streams, on no limit
    and on devices that retry and OOM (on and past the OOMs), with checkpoints and watched requests:
    the same result, field for field, OOM rows, checkpoints and cached blocks included."""
    from harness.allocator.model import Device
    from harness.allocator.replay import Kept, ReplayRow, replay_events

    rng = random.Random(11)
    rows, live, key = [], [], 0
    for step in range(3):
        tag = ("forward", step, "m", "activation")
        for _ in range(3000):
            if live and rng.random() < 0.47:
                rows.append(ReplayRow("free", live.pop(rng.randrange(len(live))), 0, tag, 0))
            else:
                size = rng.choice([rng.randint(1, 8192), rng.randint(MiB, 48 * MiB), rng.randint(2 * MiB, 9 * MiB)])
                rows.append(ReplayRow("alloc", key, size, tag, rng.random() < 0.1))
                live.append(key)
                key += 1
    settings = AllocSettings.from_conf(conf)
    unlimited = replay_events(rows, settings)[0]
    low, high, total = unlimited.peak_allocated_bytes, unlimited.peak_reserved_bytes, 8 * 1024**3
    # between the peaks and under allocated's; the collector runs under a memory fraction only
    limits = [int(low + (high - low) * f) for f in (0.99, 0.9, 0.5, 0.1, -0.2)]
    devices = [Device(total=total)] + [Device(total=total, fraction=c / total) if "garbage" in conf
                                       else Device(capacity=c, total=total) for c in limits]
    keep = [int(unlimited.peak_reserved_bytes * f) for f in (0.5, 0.8, 0.9)]

    def seen(device, stop_at_oom, listener):
        kept = Kept(watch=frozenset(range(0, len(rows), 7)))
        r = replay_events(rows, settings, device, on_event=listener, stop_at_oom=stop_at_oom, keep_below=keep,
                          kept=kept)[0]
        return r.as_dict(), sorted(kept.cached.items()), [(c.event, c.granted) for c in kept.checkpoints]

    outcomes = set()
    for device in devices:
        for stop_at_oom in (True, False):
            inline = seen(device, stop_at_oom, None)
            assert inline == seen(device, stop_at_oom, lambda *_: None), (device.capacity, stop_at_oom)
            outcomes.add((bool(inline[0]["ooms"]), inline[0]["num_alloc_retries"] > 0))
    assert unlimited.steady_peak_reserved_bytes is not None
    assert (unlimited.peak_inactive_split_bytes > 0) != settings.expandable_segments  # (counted on regular ones)
    assert {oom for oom, _ in outcomes} == {True, False} and (True, True) in outcomes  # an OOM past a retry
