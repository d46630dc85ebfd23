"""The report's pictures as matplotlib Figures (saving them is the document's business)."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")  # no screen: render to files only

import matplotlib.pyplot as plt
import pandas as pd
from matplotlib.ticker import MaxNLocator

from harness.config.point import Card
from harness.report.tables import group_label
from harness.units import GiB

# The breakdown at the peak, in the allocator's order of permanence.
PARTS = [("params_bytes", "parameters"), ("grads_bytes", "gradients"), ("optimizer_bytes", "optimizer state"),
         ("activations_bytes", "activations"), ("temporaries_bytes", "temporaries"),
         ("workspace_bytes", "cuBLAS workspace")]


def _measured(df: pd.DataFrame) -> pd.DataFrame:
    return df[df["peak_allocated_bytes"].notna()]


def _variant(r) -> str:
    parts = [str(r.precision), "ckpt" if r.checkpointing else "no ckpt"]
    if r.allocator_conf:
        parts.append(str(r.allocator_conf))
    if getattr(r, "leak", None) not in (None, "none") and not pd.isna(r.leak):
        parts.append(f"leak={r.leak}")
    return ", ".join(parts)


def _label(r) -> str:
    return f"b{r.batch_size} s{r.seq_len} {_variant(r)}"


def peak_vs_batch(df: pd.DataFrame, cards: list[Card]) -> plt.Figure | None:
    """Peak reserved (solid) and allocated (dotted) vs batch, one panel per model/workload/sequence,
    one line per precision x checkpointing (x allocator, leak); each card's room drawn across."""
    d = _measured(df)
    if d.empty:
        return None
    panels = list(d.groupby(["model", "workload", "seq_len"], sort=True))
    cols = min(3, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 4.2 * rows), squeeze=False)
    for ax, ((model, workload, seq), g) in zip(axes.flat, panels):
        top = 0.0
        for i, (variant, v) in enumerate(sorted(g.groupby(g.apply(_variant, axis=1)), key=lambda x: x[0])):
            v = v.sort_values("batch_size")
            color = f"C{i % 10}"
            res = v["peak_reserved_bytes"].fillna(v["peak_allocated_bytes"]) / GiB
            ax.plot(v["batch_size"], res, "-o", color=color, label=variant, ms=4)
            ax.plot(v["batch_size"], v["peak_allocated_bytes"] / GiB, ":", color=color, lw=1)
            top = max(top, float(res.max()))
        near = _cards_near(cards, top)
        smallest = min(cards, key=lambda c: c.memory_bytes)
        if smallest.room() / GiB > top * 3:  # no line drawn
            ax.text(0.02, 0.7, f"every card holds these runs\n(smallest: {smallest.key}, "
                    f"{smallest.room() / GiB:.1f} GiB)",
                    transform=ax.transAxes, fontsize=7, color="0.3")
        for card in near:
            room_gib = card.room() / GiB
            ax.axhline(room_gib, color="0.5", lw=0.8, ls="--")
            ax.annotate(card.key, (1.0, room_gib), xycoords=("axes fraction", "data"), fontsize=7,
                        ha="right", va="bottom", color="0.3")
        ax.set_xscale("log", base=2)
        ax.set_title(f"{model} {workload}, seq {seq}", fontsize=10)
        ax.set_xlabel("batch size (sequences)")
        ax.set_ylabel("peak GiB (solid reserved, dotted allocated)")
        ax.legend(fontsize=7, loc="upper left")
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


def _representatives(df: pd.DataFrame, limit: int) -> pd.DataFrame:
    """The largest point of each variant (the most memory), leaks first: the shapes worth seeing."""
    d = _measured(df).copy()
    if d.empty:
        return d
    d["_size"] = d["batch_size"] * d["seq_len"]
    d["_variant"] = d.apply(lambda r: f"{r.model} {r.workload} {_variant(r)}", axis=1)
    reps = d.sort_values("_size").groupby("_variant").tail(1)
    leak = reps["leak"].fillna("none") != "none"
    return pd.concat([reps[leak], reps[~leak]]).head(limit)


def step_timeline(df: pd.DataFrame, limit: int = 12) -> plt.Figure | None:
    """Allocated bytes after each step: flat (static), a staircase (retained references)."""
    reps = _representatives(df, limit)
    reps = reps[reps["step_allocated_bytes"].apply(lambda v: v is not None and len(v) > 0)]
    if reps.empty:
        return None
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, r in enumerate(reps.itertuples(index=False)):
        steps = list(r.step_allocated_bytes)
        ax.plot(range(1, len(steps) + 1), [s / GiB for s in steps], "-o", color=f"C{i % 10}", ms=4,
                label=f"{r.model} {_label(r)}" + (f" [{r.kind}]" if isinstance(r.kind, str) else ""))
    ax.set_xlabel("step")
    ax.set_ylabel("allocated after the step, GiB")
    ax.set_title("Allocated after each step: flat is healthy, a staircase is memory kept by the loop", fontsize=10)
    ax.xaxis.set_major_locator(MaxNLocator(nbins="auto", steps=[1, 2, 2.5, 5, 10], integer=True))  # steps: whole numbers
    ax.set_ylim(bottom=0)  # from zero: a flat line must look flat, not like a cliff in the 5th digit
    ax.ticklabel_format(axis="y", useOffset=False, style="plain")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    return fig


def breakdown(df: pd.DataFrame, limit: int = 40) -> plt.Figure | None:
    """What the peak is made of, per run: state, activations, temporaries, and fragmentation
    (reserved but not allocated)."""
    d = _measured(df).head(limit)
    if d.empty:
        return None
    labels = [f"{r.model} {_label(r)}" for r in d.itertuples(index=False)]
    fig, ax = plt.subplots(figsize=(10, 0.32 * len(d) + 1.6))
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
    ax.set_title("The breakdown at the peak", fontsize=10)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    return fig


def frontiers(fr: pd.DataFrame) -> plt.Figure | None:
    """The largest value that fits, per card, one bar per group."""
    ok = fr[(fr["status"] == "ok")] if fr is not None and not fr.empty else None
    if ok is None or ok.empty:
        return None
    ok = ok.assign(_group=ok.apply(group_label, axis=1))
    cards = list(dict.fromkeys(ok.sort_values("card_memory_bytes")["card"]))
    groups = list(dict.fromkeys(ok["_group"]))
    fig, ax = plt.subplots(figsize=(max(7, 0.9 * len(cards) + 2), 4.5))
    width = 0.8 / len(groups)
    for i, gname in enumerate(groups):
        g = ok[ok["_group"] == gname].set_index("card")
        vals = [float(g.loc[c, "largest"]) if c in g.index and not pd.isna(g.loc[c, "largest"]) else 0 for c in cards]
        ax.bar([j + i * width for j in range(len(cards))], vals, width, label=gname, color=f"C{i % 10}")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cards))], cards, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel(f"largest {ok['axis'].iloc[0]} that fits")
    ax.set_title(f"Frontiers (margin {ok['margin'].iloc[0]:.0%} of each card kept free)", fontsize=10)
    ax.legend(fontsize=7)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return fig
