"""The report's pictures as matplotlib Figures (saving them is the document's business)."""

from __future__ import annotations

import textwrap

import matplotlib

matplotlib.use("Agg")  # no screen: render to files only

import matplotlib.pyplot as plt
import pandas as pd
from matplotlib.ticker import MaxNLocator, NullLocator

from harness.config import nccl
from harness.config.point import Card
from harness.report import words
from harness.report.tables import group_labels
from harness.units import GiB

# The breakdown at the peak, in the allocator's order of permanence.
PARTS = [("params_bytes", "parameters"), ("grads_bytes", "gradients"), ("optimizer_bytes", "optimizer state"),
         ("activations_bytes", "activations"), ("temporaries_bytes", "temporaries"),
         ("workspace_bytes", "cuBLAS workspace")]


def _measured(df: pd.DataFrame) -> pd.DataFrame:
    return df[df["peak_allocated_bytes"].notna()]


def _style(i: int) -> dict:
    """The i-th line's look: tab20's ten strong colours, then its ten light ones, then all twenty
    dashed: no two lines look alike, and neighbours are not a colour and its pale twin."""
    j = i % 20
    return {"color": plt.get_cmap("tab20")(2 * j if j < 10 else 2 * (j - 10) + 1), "ls": "-" if i < 20 else "--"}


def _wrap(text: str, width_in: float, fontsize: float) -> str:
    """A title that fits its width: about 1.9 characters per point of width per inch at this size."""
    return textwrap.fill(text, max(20, int(width_in * 72 / (fontsize * 0.55))))


def _card_labels(cards: list[Card], lo: float, hi: float) -> list[tuple[float, str]]:
    """(GiB, label) per card line: cards within 4% of the axis' span of each other share one line
    and one label, so the labels never sit on each other."""
    gap = 0.04 * max(hi - lo, 1e-9)
    groups: list[list[Card]] = []
    for c in sorted(cards, key=lambda c: c.room()):
        if groups and c.room() / GiB - groups[-1][-1].room() / GiB < gap:
            groups[-1].append(c)
        else:
            groups.append([c])
    return [(sum(c.room() for c in g) / len(g) / GiB, ", ".join(c.key for c in g)) for g in groups]


def peak_vs_batch(df: pd.DataFrame, cards: list[Card]) -> plt.Figure | None:
    """Peak reserved (solid) and allocated (dotted) vs batch, one panel per model/workload/sequence,
    one line per variant (every other knob that varies); each card's room drawn across."""
    d = _measured(df)
    if d.empty:
        return None
    varying = words.varying_keys(d)
    panels = list(d.groupby(["model", "workload", "seq_len"], sort=True))
    cols = min(2, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.4 * cols, 4.6 * rows), squeeze=False)
    for ax, ((model, workload, seq), g) in zip(axes.flat, panels):
        top = 0.0
        groups = sorted(g.groupby(g.apply(lambda r: words.variant_label(r, varying), axis=1)), key=lambda x: x[0])
        for i, (variant, v) in enumerate(groups):
            v = v.sort_values("batch_size")
            res = v["peak_reserved_bytes"].fillna(v["peak_allocated_bytes"]) / GiB
            ax.plot(v["batch_size"], res, marker="o", label=variant, ms=4, **_style(i))
            ax.plot(v["batch_size"], v["peak_allocated_bytes"] / GiB, ":", color=_style(i)["color"], lw=1)
            top = max(top, float(res.max()))
        # Each card's room as a GPU of the panel's jobs sees it: NCCL's memory too, over several GPUs
        seen = {nccl.of_row(r) for r in g.to_dict("records")}
        panel_cards = [nccl.on_card(c, next(iter(seen))) for c in cards] if len(seen) == 1 else cards
        if len(seen) > 1:
            most = max(n.bytes + n.spread_bytes for n in seen)
            ax.text(0.02, 0.98, f"card lines: one GPU's room; a GPU of a job over several leaves NCCL up to "
                    f"{most / GiB:.1f} GiB more", transform=ax.transAxes, fontsize=7, color="0.3", va="top")
        near = _cards_near(panel_cards, top)
        smallest = min(panel_cards, key=lambda c: c.memory_bytes)
        ax.set_ylim(0, max([top, *(c.room() / GiB for c in near)]) * 1.08)
        if smallest.room() / GiB > top * 3:  # no line drawn
            ax.text(0.98, 0.02, f"every card holds these runs (smallest: {smallest.key}, "
                    f"{smallest.room() / GiB:.1f} GiB)", transform=ax.transAxes, fontsize=7, color="0.3",
                    ha="right", va="bottom")
        for room_gib, label in _card_labels(near, *ax.get_ylim()):
            ax.axhline(room_gib, color="0.5", lw=0.8, ls="--")
            ax.annotate(label, (1.0, room_gib), xycoords=("axes fraction", "data"), fontsize=7,
                        ha="right", va="bottom", color="0.3")
        batches = sorted({int(b) for b in g["batch_size"]})
        ax.set_xscale("log", base=2)
        ax.set_xticks(batches, [str(b) for b in batches])  # plain numbers, not powers of two
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_title(_wrap(f"{model} {workload}, seq {seq}", 6.0, 10), fontsize=10)
        ax.set_xlabel("batch size (sequences)")
        ax.set_ylabel("peak GiB (solid reserved, dotted allocated)")
        # beside the plot, never over it
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.tight_layout()
    return fig


def _cards_near(cards: list[Card], top_gib: float) -> list[Card]:
    """The cards below the plot's top, and the first one above it (the card that would hold it
    all) unless it is so far above that the runs would shrink to a line at the bottom."""
    rooms = sorted(cards, key=lambda c: c.memory_bytes)
    below = [c for c in rooms if c.room() / GiB <= top_gib * 1.05]
    above = [c for c in rooms if c not in below][:1]
    above = [c for c in above if c.room() / GiB <= top_gib * 3]
    return below + above


def _representatives(df: pd.DataFrame, limit: int) -> tuple[pd.DataFrame, int]:
    """The largest point of each variant (the most memory), leaks first: the shapes worth seeing;
    and how many variants there were."""
    d = _measured(df).copy()
    if d.empty:
        return d, 0
    varying = words.varying_keys(d)
    d["_size"] = d["batch_size"] * d["seq_len"]
    d["_variant"] = d.apply(lambda r: f"{r['model']} {r['workload']} {words.variant_label(r, varying)}", axis=1)
    reps = d.sort_values("_size").groupby("_variant").tail(1)
    leak = reps["leak"].fillna("none") != "none"
    return pd.concat([reps[leak], reps[~leak]]).head(limit), len(reps)


def _cut(shown: int, total: int, what: str) -> str:
    return "" if shown >= total else f" ({shown} of {total} {what} shown: the largest of each, leaks first)"


def step_timeline(df: pd.DataFrame, limit: int = 20) -> plt.Figure | None:
    """Allocated bytes after each step: flat (static), a staircase (retained references)."""
    reps, total = _representatives(df, limit)
    reps = reps[reps["step_allocated_bytes"].apply(lambda v: v is not None and len(v) > 0)]
    if reps.empty:
        return None
    labels = words.job_labels(df)
    fig, ax = plt.subplots(figsize=(11, 4.8))
    for i, r in enumerate(reps.to_dict("records")):
        steps = list(r["step_allocated_bytes"])
        ax.plot(range(1, len(steps) + 1), [s / GiB for s in steps], marker="o", ms=4, **_style(i),
                label=labels[r["run_id"]] + (f" [{r['kind']}]" if isinstance(r.get("kind"), str) else ""))
    ax.set_xlabel("step")
    ax.set_ylabel("allocated after the step, GiB")
    ax.set_title(_wrap("Allocated after each step: flat is healthy, a staircase is memory kept by the loop"
                       + _cut(len(reps), total, "variants"), 6.5, 10), fontsize=10)
    ax.xaxis.set_major_locator(MaxNLocator(nbins="auto", steps=[1, 2, 2.5, 5, 10], integer=True))  # whole steps
    top = max(max(r["step_allocated_bytes"]) for r in reps.to_dict("records")) / GiB
    ax.set_ylim(0, top * 1.1)  # from zero: a flat line must look flat, not like a cliff in the 5th digit
    ax.ticklabel_format(axis="y", useOffset=False, style="plain")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.tight_layout()
    return fig


def breakdown(df: pd.DataFrame, limit: int = 60) -> plt.Figure | None:
    """What the peak is made of, per run: state, activations, temporaries, and fragmentation
    (reserved but not allocated)."""
    measured = _measured(df)
    d = measured.head(limit)
    if d.empty:
        return None
    names = words.job_labels(df)
    labels = [names[r] for r in d["run_id"]]
    fig, ax = plt.subplots(figsize=(11, 0.32 * len(d) + 1.8))
    left = pd.Series(0.0, index=d.index)
    for i, (col, name) in enumerate(PARTS):
        vals = d[col].fillna(0) / GiB
        ax.barh(labels, vals, left=left, color=f"C{i}", label=name)
        left += vals
    other = (d["peak_allocated_bytes"] / GiB - left).clip(lower=0)
    ax.barh(labels, other, left=left, color="0.75", label="other allocated")
    left += other
    frag = ((d["peak_reserved_bytes"] - d["peak_allocated_bytes"]).fillna(0) / GiB).clip(lower=0)
    ax.barh(labels, frag, left=left, color="white", edgecolor="C3", hatch="//", label="reserved, not allocated")
    ax.invert_yaxis()
    ax.set_xlabel("GiB at the peak")
    ax.tick_params(axis="y", labelsize=7)
    cut = "" if len(d) >= len(measured) else f" (the first {len(d)} of {len(measured)} runs)"
    ax.set_title(_wrap("The breakdown at the peak" + cut, 6.5, 10), fontsize=10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    return fig


def frontiers(fr: pd.DataFrame) -> plt.Figure | None:
    """The largest value that fits, per card, one bar per group."""
    ok = fr[(fr["status"] == "ok")] if fr is not None and not fr.empty else None
    if ok is None or ok.empty:
        return None
    ok = ok.assign(_group=group_labels(ok))
    cards = list(dict.fromkeys(ok.sort_values("card_memory_bytes")["card"]))
    groups = list(dict.fromkeys(ok["_group"]))
    fig, ax = plt.subplots(figsize=(max(7, 0.9 * len(cards) + 2), 4.5))
    width = 0.8 / len(groups)
    for i, gname in enumerate(groups):
        g = ok[ok["_group"] == gname].set_index("card")
        vals = [float(g.loc[c, "largest"]) if c in g.index and not pd.isna(g.loc[c, "largest"]) else 0 for c in cards]
        ax.bar([j + i * width for j in range(len(cards))], vals, width, label=gname, color=_style(i)["color"],
               hatch="//" if i >= 20 else None)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cards))], cards, rotation=30, ha="right", fontsize=8)
    axis = ok["axis"].iloc[0]
    ax.set_ylabel("fewest GPUs that fit" if axis == "world_size" else f"largest {axis} that fits")
    ax.set_title(f"Frontiers (margin {ok['margin'].iloc[0]:.0%} of each card kept free)", fontsize=10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)  # beside the bars
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return fig
