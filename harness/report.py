"""Presenting rows: peaks in GiB (labelled) and, per card of the catalog, whether each point fits."""

from __future__ import annotations

import pandas as pd

from harness import catalog

GIB = 1024**3


def gib(nbytes) -> str:
    return "-" if nbytes is None or pd.isna(nbytes) else f"{nbytes / GIB:.2f}"


def fit_table(df: pd.DataFrame) -> tuple[list[str], list[list[str]]]:
    """(header, rows): one row per point, one column per card (peak + non-PyTorch vs capacity)."""
    cards = catalog.cards()
    header = ["model", "workload", "batch", "seq", "precision", "ckpt", "status",
              "peak alloc GiB", "peak reserved GiB"] + [c["key"] for c in cards]
    rows = []
    for r in df.itertuples(index=False):
        marks = [_mark(r, c) for c in cards]
        rows.append([str(r.model), str(r.workload), str(r.batch_size), str(r.seq_len), str(r.precision),
                     "yes" if r.checkpointing else "no", str(r.status), gib(r.peak_allocated_bytes),
                     gib(r.peak_reserved_bytes), *marks])
    return header, rows


def _mark(row, card: dict) -> str:
    """fits / OOM on `card`: the allocator model's verdict where the row has one, else peak
    allocated + non-PyTorch memory against the capacity."""
    listed = getattr(row, "fits_cards", None)
    if listed is not None and not (isinstance(listed, float) and pd.isna(listed)):
        return "fits" if card["key"] in list(listed) else "OOM"
    peak = row.peak_allocated_bytes
    if peak is None or pd.isna(peak):
        return "-"
    return "fits" if catalog.fits(int(peak), card) else "OOM"


def render(df: pd.DataFrame, title: str) -> None:
    """Print the fit table and the failures with rich."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console(width=max(200, Console().width))  # 10 cards: keep every column whole
    header, rows = fit_table(df)
    table = Table(title=title, caption="fits: the allocator model replays the run on the card without an "
                  "OOM (reserved bytes + non-PyTorch memory within its capacity); GiB = 1024^3 B")
    for i, h in enumerate(header):
        table.add_column(h, justify="right" if i >= 7 or h in ("batch", "seq") else "left", no_wrap=True)
    for row in rows:
        styled = [f"[green]{c}[/]" if c == "fits" else f"[red]{c}[/]" if c == "OOM" else c for c in row]
        table.add_row(*styled)
    console.print(table)
    counts = df["status"].value_counts().to_dict()
    console.print("rows: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    for r in df[df["status"].isin(["error", "timeout"])].itertuples(index=False):
        console.print(f"[red]{r.status}[/] {r.run_id}: {escape(str(r.error))}")


def render_verdicts(judged: pd.DataFrame) -> None:
    """Code problem or card problem, for each point that does not fit its card."""
    if judged.empty:
        return
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console(width=max(200, Console().width))
    table = Table(title="Code problem or card problem? (each point that OOMs on its card)")
    for col in ("job", "card", "kind", "verdict", "what fits"):
        table.add_column(col, overflow="fold")
    for r in judged.itertuples(index=False):
        style = "green" if r.verdict == "code problem" else "red"
        table.add_row(escape(r.job), r.card, str(r.kind), f"[{style}]{r.verdict}[/]", escape(r.detail))
    console.print(table)
