"""The attention kernel a trace takes is the traced card's (config.attention, from sdp_utils.cpp),
and a catalog card that would take another is judged by a trace of its own."""

import json
from pathlib import Path

import pytest

from harness.config import attention, cards
from harness.config.attention import ATTENTION_CALLS, CUDNN, EFFICIENT, FLASH, MATH, Call
from harness.plan import fit
from harness.probe import worker
from harness.probe.sim.trace import run_point
from harness.record.row import WORKSPACE, cards_reserved, recorded_edge
from tests.conftest import train_point

A100, A10G, T4, SM130 = (8, 0), (8, 6), (7, 5), (13, 0)
H100, B200, MI300X, RTX5090 = (9, 0), (10, 0), (9, 4), (12, 0)


def _call(dtype="bfloat16", head_dim=128, mask=False, grad=True, dropout=False, enabled=(True, True, True, True),
          value_dim=None, grouped=False, enable_gqa=None):
    return Call(dtype=dtype, head_dim=head_dim, value_dim=value_dim or head_dim, mask=mask, grad=grad, dropout=dropout,
                causal_nonsquare=False, enabled=enabled, grouped=grouped,
                enable_gqa=grouped if enable_gqa is None else enable_gqa)


@pytest.mark.parametrize("capability, call, kernel", [
    (A100, _call(), FLASH),
    (T4, _call(), MATH),  # no flash below sm80, no bf16 memory-efficient kernel either
    (T4, _call("float16"), EFFICIENT),
    (T4, _call("float32"), EFFICIENT),
    (A100, _call("float32"), EFFICIENT),  # flash takes half precision only
    (A100, _call(mask=True), EFFICIENT),
    (A100, _call(head_dim=208), FLASH),
    (A10G, _call(head_dim=208), EFFICIENT),  # sm86-89: no flash backward for head dims in (192, 224]
    (A10G, _call(head_dim=208, grad=False), FLASH),
    (A10G, _call(head_dim=256), FLASH),
    (A10G, _call(head_dim=256, dropout=True), EFFICIENT),
    (A100, _call(head_dim=6), MATH),  # neither fused kernel takes a head dim off its alignment
    (A100, _call(enabled=(False, True, True, True)), EFFICIENT),  # torch.backends.cuda / sdpa_kernel
    (A100, _call(enabled=(False, False, False, False)), None),
    (A100, _call(enabled=(False, False, False, True)), CUDNN),  # last in the order on an A100
    # cuDNN first on sm90/sm10x (an H200 with torch 2.11 took it for every bf16 call measured)
    (H100, _call(), CUDNN),
    (B200, _call("float16", mask=True), CUDNN),
    (H100, _call(head_dim=256), CUDNN),
    (H100, _call(head_dim=224), FLASH),  # cuDNN's backward: <= 128, 192/128 or 256/256
    (H100, _call(head_dim=192, value_dim=128), CUDNN),
    (H100, _call(dropout=True), FLASH),  # cuDNN drops out only at multiples of 1/16
    (H100, _call("float32"), EFFICIENT),
    (H100, _call(enabled=(True, True, True, False)), FLASH),
    (MI300X, _call(), FLASH),  # ROCm: no cuDNN
    (RTX5090, _call(), FLASH),
    (SM130, _call(), MATH),  # past the architectures the fused kernels are built for
    (None, _call(), FLASH),  # a card of unknown capability: an A100's
])
def test_the_attention_kernel_is_the_one_cuda_picks_on_the_cards_capability(capability, call, kernel):
    assert attention.kernel(capability, call) == kernel


# Grouped K and V (fewer key/value heads than query heads, as transformers passes them with
# enable_gqa where there is no mask): flash and cuDNN take them; torch 2.13's memory-efficient
# kernel does not (check_batch_size_and_num_heads_dense<false>), so such a call takes the math path
@pytest.mark.parametrize("capability, call, before_2_14, from_2_14", [
    (A100, _call(grouped=True), FLASH, FLASH),
    (H100, _call(grouped=True), CUDNN, CUDNN),
    (A100, _call("float32", grouped=True), MATH, EFFICIENT),
    (H100, _call("float32", grouped=True), MATH, EFFICIENT),
    (T4, _call("float16", grouped=True), MATH, EFFICIENT),  # no flash below sm80
    (A100, _call(grouped=True, mask=True), MATH, EFFICIENT),  # flash takes no mask
    (MI300X, _call("float32", grouped=True), MATH, MATH),  # ROCm's memory-efficient kernel: never grouped
    (A100, _call(grouped=True, enable_gqa=False), MATH, MATH),  # no fused kernel without the flag
    (H100, _call(grouped=True, enable_gqa=False), MATH, MATH),
])
def test_grouped_key_value_heads_take_the_kernels_built_for_them_else_the_math_path(
        capability, call, before_2_14, from_2_14, monkeypatch):
    for takes_grouped, expected in ((False, before_2_14), (True, from_2_14)):
        monkeypatch.setattr(attention, "efficient_takes_grouped", lambda takes=takes_grouped: takes)
        assert attention.kernel(capability, call) == expected


def test_the_installed_torchs_memory_efficient_kernel_takes_grouped_heads_as_its_headers_say():
    """efficient_takes_grouped reads torch's version; the installed build's sdp_utils_cpp.h says
    whether its heads check has `supports_mqa`, which came with grouped heads in that kernel."""
    import torch

    header = Path(torch.__file__).parent / "include/ATen/native/transformers/sdp_utils_cpp.h"
    if not header.exists():
        pytest.skip(f"this torch build ships no {header.name}")
    assert attention.efficient_takes_grouped() == ("supports_mqa" in header.read_text())


def test_an_fp32_step_with_grouped_heads_attends_as_the_installed_torch_does():
    """tiny has 4 query heads over 2 key/value heads, which transformers passes with enable_gqa:
    in fp32 on an A100, before torch 2.14, the math path holds the B x H x S x S scores; from
    2.14 the memory-efficient kernel takes K and V as they are (no expanded copy, no scores)."""
    b, s, heads = 2, 1024, 4  # (scores of 32 MiB: more than the cuBLAS workspace)
    m, tracker = run_point(train_point(batch_size=b, seq_len=s, precision="fp32"))
    expected = EFFICIENT if attention.efficient_takes_grouped() else MATH
    assert {(c["grouped"], c["enable_gqa"], c["kernel"]) for c in json.loads(m["attention_calls"])} == {(True, True, expected)}
    scores = b * heads * s * s * 4
    assert (max(e.size for e in tracker.events if e.action == "alloc") >= scores) == (expected == MATH)


def test_cards_of_one_attention_class_choose_alike_and_others_apart():
    calls = [_call(), _call("float32")]
    column = attention.to_column(calls, A100)  # a row's: each call with the kernel its run took
    assert not attention.takes_alike(T4, column) and not attention.takes_alike(H100, column)  # math, cuDNN
    assert attention.attention_class(A100) == attention.attention_class(None) != attention.attention_class(T4)
    assert attention.attention_class(H100) == attention.attention_class((9, 0)) != attention.attention_class(A100)
    # fp32: memory-efficient on all three
    fp32 = attention.to_column([_call("float32")], A100)
    assert attention.takes_alike(T4, fp32) and attention.takes_alike(H100, fp32)
    assert attention.taken(column) == [(calls[0], FLASH), (calls[1], EFFICIENT)]
    assert attention.from_column(column) == calls
    assert attention.takes_alike(T4, None)  # a row without attention calls


def test_a_row_from_before_cudnn_reads_with_cudnn_on():
    old = json.dumps([{**json.loads(attention.to_column([_call()], A100))[0], "enabled": [True, False, True]}])
    assert attention.from_column(old)[0].enabled == (True, False, True, True)


def test_a_t4_emulated_on_a_bigger_card_pins_the_calls_it_would_take_otherwise():
    from harness.probe.cuda.attention import pinned

    assert pinned(T4, A100, _call()) == MATH  # the T4's bf16 math path, not the A100's flash
    assert pinned(T4, A100, _call("float32")) is None  # memory-efficient on both: the A100 decides
    assert pinned(A100, A100, _call()) is None and pinned(None, A100, _call()) is None


def test_a_bf16_step_on_a_t4_attends_with_the_math_path_and_holds_the_attention_matrix():
    b, s, heads = 2, 2048, 4
    point = train_point(batch_size=b, seq_len=s)
    on = {}
    for key in ("a100-80gb", "t4"):
        m, tracker = run_point(point.replace(gpu=cards.by_key()[key]))
        on[key] = (m, max(e.size for e in tracker.events if e.action == "alloc"))
    kernels = {k: {c["kernel"] for c in json.loads(m["attention_calls"])} for k, (m, _) in on.items()}
    assert kernels == {"a100-80gb": {FLASH}, "t4": {MATH}}
    # the scores, B x H x S x S, are the largest storage on the T4 and none on the A100
    assert on["t4"][1] >= b * heads * s * s * 2 > on["a100-80gb"][1]
    assert on["t4"][0]["peak_allocated_bytes"] > on["a100-80gb"][0]["peak_allocated_bytes"]


@pytest.mark.slow
def test_a_catalog_card_whose_attention_differs_is_judged_by_a_trace_of_its_own(tmp_path):
    """An A100's trace of a long bf16 sequence fits a T4 with flash attention; a T4 attends with the
    math path, whose scores do not fit: the A100's row says what the T4's own run says."""
    point = train_point(batch_size=1, seq_len=16384)
    t4 = cards.by_key()["t4"]
    for d in ("a100", "t4"):
        (tmp_path / d).mkdir()
    on_a100 = worker.run_sim(point, tmp_path / "a100")
    on_t4 = worker.run_sim(point.replace(gpu=t4), tmp_path / "t4")
    assert on_a100["peak_reserved_bytes"] < t4.room()  # the A100's own trace would have fit it
    assert on_t4["status"] == "oom" and recorded_edge(on_a100, "t4") == "oom"
    assert (tmp_path / "a100" / "trace-t4.parquet").is_file()
    # a plan's margin asks the T4's own trace too, not the A100's peaks (which leave it room)
    assert fit.fits(on_a100, t4, margin=0.01) is False and fit.fits(on_a100, cards.by_key()["h100-80gb"], 0.01)
    # the other cards of the catalog attend as the A100 does: judged by its trace
    assert recorded_edge(on_a100, "h100-80gb") == "room" and recorded_edge(on_t4, "h100-80gb") == "room"


@pytest.mark.parametrize("capability, config, nbytes", [
    ((8, 0), None, 8_519_680), ((7, 5), None, 8_519_680), ((8, 9), None, 8_519_680),
    ((9, 0), None, 32 * 2**20), ((10, 0), None, 32 * 2**20), ((12, 0), None, 32 * 2**20),
    ((9, 4), None, 128 * 2**20),  # an MI300X: ROCm's gfx94x
    ((9, 0), ":4096:2:16:8", 8_519_680), ((8, 0), ":4096:8", 32 * 2**20),  # CUBLAS_WORKSPACE_CONFIG
])
def test_the_cublas_workspace_is_the_one_pytorch_takes_on_the_card(capability, config, nbytes, monkeypatch):
    from harness.config import cublas

    monkeypatch.delenv(cublas.ENV, raising=False)
    assert cublas.workspace_bytes(capability, config) == nbytes


def test_an_emulated_card_is_given_its_own_cublas_workspace_on_another(monkeypatch):
    """probe.cuda.run sets CUBLAS_WORKSPACE_CONFIG to the emulated card's (an A100 on an H200:
    8,519,680 B, not 32 MiB; measured exact on an H200, tests/test_cuda.py's calibrate)."""
    from harness.config import cublas

    monkeypatch.delenv(cublas.ENV, raising=False)
    assert cublas.config_for((8, 0)) == ":4096:2:16:8"  # torch's own string below Hopper
    for card in cards.cards():
        made = cublas.workspace_bytes((0, 0), cublas.config_for(card.capability))
        assert made == cublas.workspace_bytes(card.capability), card.key


def test_a_card_of_another_cublas_workspace_is_judged_by_the_trace_with_its_own(tmp_path):
    """An H100 traces 32 MiB workspaces where an A100 traces 8,519,680 B; the A100's row judges the
    H100 with its trace's workspaces resized, a plan's margin too."""
    point = train_point()
    h100 = cards.by_key()["h100-80gb"]
    rows = {}
    for key, card in (("a100", point.gpu), ("h100", h100)):
        (tmp_path / key).mkdir()
        rows[key] = worker.run_sim(point.replace(gpu=card), tmp_path / key)
    assert (rows["a100"]["cublas_workspace_bytes"], rows["h100"]["cublas_workspace_bytes"]) == (8_519_680, 32 * 2**20)
    # both workspaces (forward, backward) live at the peak
    assert rows["h100"]["peak_allocated_bytes"] - rows["a100"]["peak_allocated_bytes"] == 2 * (32 * 2**20 - 8_519_680)
    low, high = rows["a100"]["peak_reserved_bytes"], rows["h100"]["peak_reserved_bytes"]
    assert low < high
    # a margin that leaves the H100 room between the two: the A100's own peaks would say it fits
    margin = (h100.room() - (low + high) // 2) / h100.memory_bytes
    assert fit.fits(rows["a100"], h100, margin) is False and fit.fits(rows["h100"], h100, margin) is False
    roomy = (h100.room() - high - 64 * 2**20) / h100.memory_bytes  # the H100's reserved peak and more
    assert fit.fits(rows["a100"], h100, roomy) is True and fit.fits(rows["h100"], h100, roomy) is True


def test_under_amp_attention_takes_its_inputs_in_the_lower_precision_as_cuda_autocast_casts_them():
    """CUDA's autocast lists scaled_dot_product_attention as lower-precision: the fp32 q and k that
    the rotary embedding makes are cast to bf16 and attend with flash, not fp32 memory-efficient."""
    m, _ = run_point(train_point(precision="amp_bf16", seq_len=256))
    assert {(c["dtype"], c["kernel"]) for c in json.loads(m["attention_calls"])} == {("bfloat16", FLASH)}


def test_a_card_whose_kernels_hold_more_is_an_oom_without_a_trace_where_the_traced_peak_passes_it(tmp_path):
    """Math attention holds at every moment what flash holds and more: where an A100's flash trace
    already allocates more than a T4's room, the T4 is an OOM without being traced."""
    row = worker.run_sim(train_point(batch_size=512, seq_len=4096), tmp_path)
    assert row["peak_allocated_bytes"] > cards.by_key()["t4"].room()
    assert recorded_edge(row, "t4") == "oom" and not (tmp_path / "trace-t4.parquet").exists()
    assert attention.holds_more([MATH, EFFICIENT], [FLASH, FLASH]) and not attention.holds_more([FLASH], [MATH])


def test_a_card_whose_kernels_hold_more_than_flash_is_an_oom_without_a_trace_past_a_cudnn_traces_peak(tmp_path):
    """An H100's trace (cuDNN) rewritten for flash (fused_swap) allocates at least what the T4's
    math attention holds less, at every moment: where it passes the T4's room, the T4 is an OOM
    without a trace of its own, as after an A100's flash trace."""
    row = worker.run_sim(train_point(batch_size=512, seq_len=4096).replace(gpu=cards.by_key()["h100-80gb"]), tmp_path)
    assert json.loads(row[ATTENTION_CALLS])[0]["kernel"] == CUDNN
    assert row["peak_allocated_bytes"] > cards.by_key()["t4"].room()
    assert recorded_edge(row, "t4") == "oom" and not (tmp_path / "trace-t4.parquet").exists()


@pytest.mark.slow
def test_cudnn_cards_that_may_fit_are_judged_by_a_trace_as_they_run_it(tmp_path):
    """A bf16 row traced on an A100 (flash) judges the cuDNN cards (sm90/sm10x) that may hold it by
    a trace as they run it (its flash rows rewritten: trace-<card>.parquet), near their edge or far
    from it (no bound on the traced reserved peak is sound): tiny b1536 s4096 allocates 72.4 GiB and
    reserves 83.4 GiB, around the H100 80GB's room, far under the H200's. A plan's margin reads it."""
    row = worker.run_sim(train_point(batch_size=1536, seq_len=4096), tmp_path)
    assert row["peak_allocated_bytes"] < cards.by_key()["h100-80gb"].room() < row["peak_reserved_bytes"]
    assert (tmp_path / "trace-h100-80gb.parquet").is_file() and (tmp_path / "trace-h200.parquet").is_file()
    assert "h200" in list(row["fits_cards"]) and "h200" in cards_reserved(row)
    h200 = cards.by_key()["h200"]
    assert fit.fits(row, h200, margin=0.05) and not fit.fits(row, h200, margin=0.5)


def test_a_real_run_on_a_cudnn_card_tells_the_flash_cards_far_from_their_edge():
    """A cuda row measured on an H200 (cuDNN) says an A100 80GB fits a 10 GiB run (flash's scratch
    differs by less than a band), not a T4 (math attention: what it holds the run does not tell),
    and not an A100 40GB for a run whose reserved peak lies within the band of its room."""
    point = train_point(batch_size=2, seq_len=1024).replace(gpu=cards.by_key()["h200"])
    column = attention.to_column([_call()], H100)
    gib = 2**30
    small = worker.measured_edges(point, {ATTENTION_CALLS: column, "peak_reserved_bytes": 10 * gib,
                                          "peak_allocated_bytes": 9 * gib, WORKSPACE: 32 * 2**20})
    assert small["a100-80gb"] == "room" and small["h100-80gb"] == "room" and small["t4"] == "oom"
    a100_40 = cards.by_key()["a100-40gb"]
    edge_run = {ATTENTION_CALLS: column, "peak_reserved_bytes": a100_40.room() - 2**20,
                "peak_allocated_bytes": a100_40.room() - 2 * gib, WORKSPACE: 32 * 2**20}
    assert worker.measured_edges(point, edge_run)["a100-40gb"] == "oom"


def _swap_variants():
    import dataclasses

    from harness.config.point import Parallel, Workload

    base = train_point(batch_size=2, seq_len=128)  # tiny: 4 heads, 2 key/value heads
    return {"train": base, "recomputed": base.replace(checkpointing=True),
            "no grad": base.replace(workload=Workload(name="infer", new_tokens=4)),
            "leaked graph": base.replace(workload=dataclasses.replace(base.workload, leak="graph")),
            "fsdp2 recomputed": base.replace(parallel=Parallel(dp_shard=2), checkpointing=True),
            "tp sequence parallel": base.replace(parallel=Parallel(tp=2, sequence_parallel=True)),
            "heads alike": train_point(batch_size=2, seq_len=128, num_key_value_heads=4)}


@pytest.mark.parametrize("variant", list(_swap_variants()))
def test_a_trace_with_its_flash_rows_rewritten_for_cudnn_is_the_cudnn_trace_and_back(variant):
    """probe.sim.fused_swap: the tiny model traced on an A100 (flash) with its fused calls' rows
    rewritten is, row for row (which alloc each free ends), its trace on an H100 (cuDNN), and back;
    but for the cuBLAS workspaces' bytes, which each card's own are."""
    from harness.probe.sim import fused_swap, repeat

    point = _swap_variants()[variant]

    def trace(card):
        _, tracker = run_point(point.replace(gpu=cards.by_key()[card]))
        return [e._replace(size=0) if e.kind == "workspace" else e for e in tracker.events]

    flash, cudnn = trace("a100-80gb"), trace("h100-80gb")
    assert any(e.kernel == attention.fused_code("fwd", "rng") for e in flash)
    assert repeat.canonical(fused_swap.swapped(flash, CUDNN)) == repeat.canonical(cudnn)
    assert repeat.canonical(fused_swap.swapped(cudnn, FLASH)) == repeat.canonical(flash)


@pytest.mark.parametrize("traced_on, like, source, way", [
    ("h100-80gb", "a100-80gb", [], "this trace"),  # cuDNN's rows as flash makes them
    ("t4", "h100-80gb", ["a100-80gb"], "a100-80gb's trace"),  # (math on the T4) the flash card's, as cuDNN makes them
], ids=["own trace", "another card's trace"])
def test_cards_judged_by_a_rewritten_trace_are_judged_as_by_a_trace_of_their_own(tmp_path, monkeypatch, traced_on, like,
                                                                                source, way):
    """A row judges cards whose attention differs from its card's only by flash for cuDNN (or back)
    by its own trace with the fused calls' rows rewritten, and where its own calls took neither (a
    T4's math) by a card's trace of flash so rewritten: each card's edge is the one a trace on it
    gives, and its reserved peak too where that trace's replays found one (cards every 10 MiB of
    room around the tiny model's 16 x 1024 tokens)."""
    import dataclasses

    import pandas as pd

    from harness.allocator.settings import AllocSettings
    from harness.probe.sim import fused_swap
    from harness.probe.sim.per_card import Sized

    mib = 2**20
    point = train_point(batch_size=16, seq_len=1024).replace(gpu=cards.by_key()[traced_on])
    for d in ("point", "rewritten", "traced"):
        (tmp_path / d).mkdir()
    row = worker.run_sim(point, tmp_path / "point")
    sized = Sized(pd.read_parquet(row["trace_path"]))
    peaks = [row["peak_allocated_bytes"], row["peak_reserved_bytes"]]
    if source:  # (around the peaks of a trace of their kernels: the T4's math holds far more)
        judged_by = worker.run_sim(point.replace(gpu=cards.by_key()[source[0]]), tmp_path / "traced")
        peaks = [judged_by["peak_allocated_bytes"], judged_by["peak_reserved_bytes"]]
    around = [dataclasses.replace(cards.by_key()[like], key=f"c{room}", memory_bytes=(room + 512) * mib,
                                  non_pytorch_bytes=512 * mib, non_pytorch_spread_bytes=32 * mib, memory_spread_bytes=0)
              for room in range(peaks[0] // mib - 60, peaks[1] // mib + 90, 10)]
    apart = [cards.by_key()[k] for k in source] + around
    n = sized.workspaces()[1]
    rewritten: dict[str, tuple] = {}
    ways = worker._edges_apart(point, row, AllocSettings(), apart, tmp_path / "rewritten", n, rewritten, sized)
    assert [(how.split(" with ")[0], keys) for how, keys in ways.items()] == \
        [("a trace of their attention kernels", source)] * bool(source) + [(way, [c.key for c in around])]
    monkeypatch.setattr(fused_swap, "frame", lambda df, to, events=None: None)  # as for a trace from before the codes
    traced: dict[str, tuple] = {}
    ways = worker._edges_apart(point, row, AllocSettings(), apart, tmp_path / "traced", n, traced, sized)
    assert ways == {"a trace of their attention kernels": [c.key for c in apart]}
    assert rewritten == traced or source  # (its own trace: each peak too)
    assert {k: e for k, (e, _) in rewritten.items()} == {k: e for k, (e, _) in traced.items()}
    assert {"room", "oom"} <= {e for e, _peak in traced.values()}
    # each reserved peak a replay found on the card's trace, found so on the rewritten one (a trace of
    # smaller cuBLAS workspaces than the card's rules fewer OOMs out by bounds: replays tell those)
    assert all(rewritten[k][1] == peak or peak is None and e == "oom" for k, (e, peak) in traced.items())


def test_a_trace_whose_fused_rows_lie_out_of_order_is_not_rewritten():
    """fused_swap.frame declines (None: the card is traced instead) where a fused call's rows are
    not as its kernel makes them: a log-sum-exp without its call's output before it."""
    from harness.probe.sim import fused_swap
    from harness.probe.sim.tracker import TraceEvent
    from harness.record import trace_store

    lone = [TraceEvent(0, "alloc", 1, 4096, "activation", "forward", 0, "attn", 0, attention.fused_code("fwd", "lse")),
            TraceEvent(1, "free", 1, 4096, "activation", "forward", 0, "", 0)]
    assert fused_swap.frame(trace_store.to_frame(lone), CUDNN) is None
    assert fused_swap.frame(trace_store.to_frame([e._replace(kernel="") for e in lone]), CUDNN) is None


def test_flash_splits_a_decode_steps_keys_by_the_cards_sms_and_not_on_rocm():
    """flash_api.cpp's heuristic (its own example: 48 blocks on 108 SMs take 2 splits) and the
    accumulators it sizes: Llama-3-8B decoding one sequence over 1,021 keys (32 heads over 8: taken
    as 4 queries a key/value head) on an A100 takes 8 splits (as many as key blocks), 1,024 B of
    log-sum-exp and 131,072 B of output; a batch of 32 fills the A100 (one split, none); an MI300X's
    flash (AOTriton) allocates none."""
    from harness.config import kernels
    from harness.config.attention import FusedShape

    assert kernels.num_splits_heuristic(48, 108, 64, 128) == 2

    def on(card, b):
        return kernels.flash_splitkv_bytes(FusedShape(b, 32, 8, 1, 1021, 128, 128, 2),
                                           kernels.geometry(cards.by_key()[card]))

    assert on("a100-80gb", 1) == (8 * 8 * 4 * 4, 8 * 8 * 4 * 128 * 4)
    assert on("a100-80gb", 32) == (0, 0) and on("mi300x", 1) == (0, 0)
    assert on("l4", 1) != on("a100-80gb", 1) or on("l4", 4) != on("a100-80gb", 4)


def test_a_flash_decode_traces_its_split_kv_accumulators_sized_again_for_each_card_and_dropped_for_cudnn():
    """The tiny model serving 2 x 512 tokens on an A100: each flash call (prefill and decode) makes
    its two accumulators between its log-sum-exp and RNG state, freed in that order before the next
    allocation; the trace sized for an MI300X has none, for an L4 its own; rewritten for cuDNN it is
    the H100's trace, and an H100's trace rewritten for flash is the A100's without them (the
    cuDNN rows do not say the call's shape)."""
    from harness.config.point import Workload
    from harness.probe.sim import fused_swap, repeat
    from harness.record import trace_store

    point = train_point(batch_size=2, seq_len=512).replace(workload=Workload(name="infer", new_tokens=3))

    def trace(card):
        return run_point(point.replace(gpu=cards.by_key()[card]))[1].events

    flash, cudnn = trace("a100-80gb"), trace("h100-80gb")
    split = [i for i, e in enumerate(flash) if e.kernel.startswith("splitkv:")]
    assert len(split) == 2 * 2 * (1 + 3)  # two a call: two layers, the prefill and three decode steps
    for i in split[::2]:
        lse, acc_lse, acc_out, rng, unused, *frees = flash[i - 1:i + 6]
        assert (lse.kernel, rng.kernel, unused.kernel) == tuple(attention.fused_code("fwd", w)
                                                               for w in ("lse", "rng", "unused"))
        assert acc_out.kernel.startswith("splitkv:1:")
        assert [(f.action, f.key) for f in frees] == [("free", acc_lse.key), ("free", acc_out.key)]
    df = trace_store.to_frame(flash)
    assert not trace_store.sized_for(df, cards.by_key()["mi300x"])["kernel"].str.startswith("splitkv:").any()
    l4 = trace_store.sized_for(df, cards.by_key()["l4"])
    assert len(l4) <= len(df) and l4["kernel"].str.startswith("splitkv:").any()

    def without_workspaces(events):
        return [e._replace(size=0) if e.kind == "workspace" else e for e in events]

    assert repeat.canonical(without_workspaces(fused_swap.swapped(flash, CUDNN))) == \
        repeat.canonical(without_workspaces(cudnn))
    accumulators = {flash[i].key for i in split}
    assert repeat.canonical(without_workspaces(fused_swap.swapped(cudnn, FLASH))) == \
        repeat.canonical(without_workspaces([e for e in flash if e.key not in accumulators]))


# ---- why a run attends with the math path (analysis.attention_path) ---------------------------

def _math_row(card_key, *calls):
    return {"gpu": cards.by_key()[card_key].name,
            ATTENTION_CALLS: attention.to_column(list(calls), cards.by_key()[card_key].capability)}


def test_a_call_on_the_math_path_is_read_with_each_single_change_that_gets_it_a_fused_kernel(monkeypatch):
    from harness.analysis.attention_path import Lift, math_paths

    monkeypatch.setattr(attention, "efficient_takes_grouped", lambda: False)
    # fp32 over grouped heads on an H200: expanded K and V take memory-efficient, 16-bit cuDNN
    [p] = math_paths(_math_row("h200", _call("float32", grouped=True)))
    assert p.lifts == (Lift(("grouped_heads",), EFFICIENT), Lift(("precision",), CUDNN, "bfloat16"),
                       Lift(("precision",), CUDNN, "float16"))
    assert p.newer_torch  # (torch 2.14's memory-efficient kernel takes them)
    # bf16 over grouped heads on a T4: no single change does; fp16 with K and V expanded does
    [p] = math_paths(_math_row("t4", _call(grouped=True)))
    assert p.lifts == (Lift(("grouped_heads", "precision"), EFFICIENT, "float16"),) and not p.newer_torch
    [p] = math_paths(_math_row("t4", _call()))
    assert p.lifts == (Lift(("precision",), EFFICIENT, "float16"),)
    [p] = math_paths(_math_row("a100-80gb", _call(enabled=(False, False, True, False))))
    assert p.lifts == (Lift(("disabled",), FLASH),)
    [p] = math_paths(_math_row("a100-80gb", _call(head_dim=6)))
    assert p.lifts[0] == Lift(("head_dim",), FLASH)
    assert math_paths(_math_row("a100-80gb", _call())) == []  # flash: not the math path
    assert math_paths({"gpu": "my card", ATTENTION_CALLS: attention.to_column([_call()], T4)}) == []


@pytest.mark.slow  # one CLI run
def test_the_report_says_why_a_runs_attention_takes_the_math_path(tmp_path):
    """tiny's 4 query heads over 2 key/value heads in fp32 on an A100 (torch 2.13): the math path;
    the report's section names the changes that lift it."""
    from tests.conftest import run_cli

    r = run_cli("run", "model=tiny", "precision=fp32", f"results_dir={tmp_path}")
    assert r.returncode == 0, r.stderr
    md = next(tmp_path.glob("**/report.md")).read_text()
    if attention.efficient_takes_grouped():
        assert "## Attention on the math path" not in md
        return
    section = md.split("## Attention on the math path", 1)[1].split("\n## ", 1)[0]
    assert "grouped key/value heads" in section and "it would take efficient" in section
    assert "math path" in r.stdout
