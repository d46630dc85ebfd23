"""The report's figures read as pictures: card labels apart, batch axes in plain numbers, every run
drawn or the cut said, legends beside the data and no two lines alike, titles inside the figure."""

import itertools

import pandas as pd
import pytest

from harness.config import cards
from harness.config.point import Card
from harness.report import figures

GiB = 1024**3


def _rows(n_variants: int = 24, batches=(1, 2, 4, 8, 16)) -> pd.DataFrame:
    variants = list(itertools.product(["bf16", "fp32", "amp_bf16"], [False, True], ["", "expandable_segments:True"],
                                      ["none", "graph"]))[:n_variants]
    rows = []
    for v, (precision, ckpt, alloc, leak) in enumerate(variants):
        for b in batches:
            alloc_b = (2 + 0.5 * v + 1.5 * b) * GiB
            rows.append({"run_id": f"{v}-{b}", "model": "7b", "workload": "train", "seq_len": 1024, "batch_size": b,
                         "precision": precision, "checkpointing": ckpt, "allocator_conf": alloc, "leak": leak,
                         "optimizer": "adamw", "optimizer_impl": "auto", "gpu": "A100 80GB", "backend": "sim",
                         "kind": "fits", "peak_allocated_bytes": alloc_b, "peak_reserved_bytes": alloc_b * 1.1,
                         "params_bytes": GiB, "grads_bytes": GiB, "optimizer_bytes": 2 * GiB,
                         "activations_bytes": b * GiB, "temporaries_bytes": 0, "workspace_bytes": 8 << 20,
                         "step_allocated_bytes": [alloc_b] * 3, "overrides": ""})
    return pd.DataFrame(rows)


def _extent(artist, fig):
    fig.canvas.draw()
    return artist.get_window_extent(fig.canvas.get_renderer())


def _overlap(a, b) -> bool:
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


def _inside(inner, outer) -> bool:
    return inner.x0 >= outer.x0 - 1 and inner.x1 <= outer.x1 + 1 and inner.y0 >= outer.y0 - 1 and inner.y1 <= outer.y1 + 1


def _check_legible(fig):
    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    page = fig.bbox
    for ax in fig.axes:
        if not ax.get_visible() or not ax.has_data():
            continue
        assert _inside(ax.title.get_window_extent(r), page), ax.title.get_text()
        legend = ax.get_legend()
        if legend is not None:
            box = legend.get_window_extent(r)
            assert not _overlap(box, ax.get_window_extent(r)), "the legend covers the data"
            assert _inside(box, page), "the legend runs off the figure"
        notes = [t for t in ax.texts if t.get_visible() and t.get_text()]
        for a, b in itertools.combinations(notes, 2):
            assert not _overlap(a.get_window_extent(r), b.get_window_extent(r)), (a.get_text(), b.get_text())
        lines = [(str(ln.get_color()), ln.get_linestyle()) for ln in ax.get_lines() if ln.get_label()[:1] != "_"]
        assert len(lines) == len(set(lines)), "two lines look alike"


def test_peak_vs_batch_reads_as_a_picture():
    close = [Card(name=k, memory_bytes=m, non_pytorch_bytes=512 << 20, key=k)
             for k, m in [("a", 24 * GiB), ("b", int(24.3 * GiB)), ("c", int(24.6 * GiB)), ("d", 40 * GiB)]]
    fig = figures.peak_vs_batch(_rows(), close)
    _check_legible(fig)
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["1", "2", "4", "8", "16"]  # plain numbers
    assert len([ln for ln in ax.get_lines() if ln.get_label()[:1] != "_"]) == 24  # every variant drawn
    labels = [t.get_text() for t in ax.texts]
    assert "a, b, c" in labels  # three cards a few per cent apart share one line and one label


def test_a_panel_of_jobs_over_several_gpus_draws_each_card_less_what_nccl_takes():
    card = Card(name="d", memory_bytes=40 * GiB, non_pytorch_bytes=512 << 20, key="d")
    sharded = _rows(2).assign(nccl_communicators=1, nccl_bytes=GiB // 2, nccl_spread_bytes=GiB // 2)

    def line_at(df):
        ax = figures.peak_vs_batch(df, [card]).axes[0]
        return [ln.get_ydata()[0] for ln in ax.get_lines() if ln.get_linestyle() == "--"]
    assert line_at(sharded) == [card.room() / GiB - 0.5] and line_at(_rows(2)) == [card.room() / GiB]
    mixed = pd.concat([_rows(2), sharded.assign(precision="fp16")])
    ax = figures.peak_vs_batch(mixed, [card]).axes[0]
    assert any("NCCL" in t.get_text() for t in ax.texts)  # one GPU's room, and the note


def test_the_timeline_says_what_it_leaves_out_and_every_line_differs():
    df = _rows(n_variants=24)
    fig = figures.step_timeline(df, limit=20)
    _check_legible(fig)
    assert "20 of 24 variants shown" in fig.axes[0].get_title().replace("\n", " ")


def test_the_breakdown_draws_every_run_or_says_the_cut():
    df = _rows(n_variants=6, batches=(1, 2))
    fig = figures.breakdown(df, limit=60)
    _check_legible(fig)
    assert len(fig.axes[0].get_yticklabels()) == len(df) and "of" not in fig.axes[0].get_title()
    cut = figures.breakdown(_rows(n_variants=24), limit=60)
    assert "the first 60 of 120 runs" in cut.axes[0].get_title().replace("\n", " ")


@pytest.mark.parametrize("n", [1, 3])
def test_the_catalog_cards_labels_never_sit_on_each_other(n):
    fig = figures.peak_vs_batch(_rows(n_variants=n, batches=(1, 2, 4, 8, 16, 32)), cards.cards())
    _check_legible(fig)
