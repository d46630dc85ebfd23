"""report.md (with PNGs beside it) and a self-contained report.html (PNGs inlined), plus the
tables as CSV and Parquet."""

from __future__ import annotations

import base64
import hashlib
import html
import io
import json
import multiprocessing
import threading
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from harness.config import cards as catalog
from harness.config.compose import parallelism
from harness.record import results
from harness.report import console, figures, tables, words

FIG_DIR = "report_files"
FIG_KEYS = "keys.json"  # in FIG_DIR: each figure's key (_figure_key), so a later report can reuse it


@dataclass
class Section:
    title: str
    text: str = ""
    table: tables.Table | None = None
    figure: str | None = None  # name of a PNG in FIG_DIR


def _png(fig) -> bytes:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


# Columns that say where a row's files are: a re-run that reuses every row changes them, and no
# figure draws them.
_WHERE_COLUMNS = ("reused_from", "trace_reused")


def _figure_key(name: str, *inputs) -> str:
    """What a figure shows: its name, the code and matplotlib that draw it, and its inputs."""
    import matplotlib

    from harness.record.provenance import versions

    h = hashlib.sha1(f"{name}:{versions()['harness']}:{matplotlib.__version__}".encode())
    for x in inputs:
        if isinstance(x, pd.DataFrame):
            x = x.drop(columns=[c for c in x.columns if c.endswith("_path") or c in _WHERE_COLUMNS])
            h.update(x.to_csv(index=False).encode())
        else:
            h.update(repr(x).encode())
    return h.hexdigest()[:16]


Lend = Callable[[str, str], "bytes | None"]  # (figure name, key) -> a PNG drawn before, if any


def build(df: pd.DataFrame, fit_long: pd.DataFrame, judged: pd.DataFrame, fr: pd.DataFrame | None,
          title: str, lend: Lend | None = None,
          more_gpus: str | None = None) -> tuple[list[Section], dict[str, bytes], dict[str, str]]:
    """The report's sections, its pictures (name -> PNG bytes) and their keys; a picture `lend`
    has for its key is not drawn again (drawing is most of a report's time: ~0.5 s each).
    `more_gpus`: the verdicts' note where the sweep cannot say how many GPUs (words.more_gpus)."""
    pngs: dict[str, bytes] = {}
    keys: dict[str, str] = {}
    to_draw: dict[str, tuple] = {}

    def figure(name, draw, *inputs):
        keys[name] = key = _figure_key(name, *inputs)
        png = lend(name, key) if lend is not None else None
        if png is None:
            to_draw[name] = (draw, inputs)
        else:
            pngs[name] = png
        return name

    counts = df["status"].value_counts().to_dict()
    summary = (f"{len(df)} runs: " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items()))
               + ". Bytes are measured raw; GiB = 1024^3 bytes. " + console.FITS_CAPTION + ".")
    sections = [Section(title, summary)]
    if fr is not None and not fr.empty:
        margin = float(fr["margin"].iloc[0])
        errors = list(dict.fromkeys(fr.loc[fr["status"] != "ok", "error"].astype(str)))
        sections.append(Section(
            "Frontiers", f"The largest value of the searched axis that fits each card with {margin:.0%} of its "
            "memory kept free, found by interpolation and bisection on the virtual GPU and checked at the "
            "boundary (the value and the next one up both run); probes / grid says what the search cost "
            "against sweeping every value. Peak reserved is without a limit; a negative headroom with cache "
            "flushes means that on the card the allocator frees its cache and retries (num_alloc_retries, a "
            "device synchronization each) and the run still fits." + "".join(f" Search stopped: {e}." for e in errors),
            tables.frontier_table(fr), figure("frontiers.png", figures.frontiers, fr)))
        header, rows = tables.serving_table(fr)
        if rows:
            sections.append(Section(
                "Serving: the harness beside vLLM's arithmetic",
                "KV-cache bytes per token = 2 x layers x kv_heads x head_dim x element bytes. vLLM's column is its "
                "startup arithmetic (gpu_memory_utilization x total, less weights, the profile run's activation "
                "peak and non-PyTorch memory, the rest in KV blocks); the harness's column is the largest value "
                "whose run on the virtual GPU fits under the same fraction.", (header, rows)))
    sections.append(Section("Peak memory vs batch", "Each card's line is its memory less what lives outside "
                            "PyTorch.", figure=figure("peak_vs_batch.png", figures.peak_vs_batch, df, catalog.cards())))
    sections.append(Section("Allocated after each step", "The timeline's shape: a plateau is state, a staircase "
                            "is memory the loop keeps.", figure=figure("timeline.png", figures.step_timeline, df)))
    sections.append(Section("The breakdown at the peak", "Parameters, gradients, optimizer state, activations, "
                            "temporaries, and what the allocator reserves beyond them (fragmentation).",
                            figure=figure("breakdown.png", figures.breakdown, df)))
    if not judged.empty:
        sections.append(Section("Code problem or card problem?", "Each point that does not fit its card: "
                                "a code problem when a remedy in the sweep fits it, a card problem when none does."
                                + (f" {more_gpus}." if more_gpus else ""), tables.verdict_table(judged)))
    header, rows = tables.math_path_table(df)
    if rows:
        sections.append(Section("Attention on the math path", "Runs whose attention takes PyTorch's math path on "
                                "their card rather than a fused kernel (as sdp_utils.cpp chooses): each call's "
                                "B x H x S x S scores are activations the card pays for.", (header, rows)))
    header, rows = tables.unmodelled_table(df)
    if rows:
        sections.append(Section("Not modelled", "Runs with layers a GPU runs through cuDNN, whose own memory "
                                "the virtual GPU does not model.", (header, rows)))
    stale = results.judged_elsewhere(df)
    if stale:
        sections.append(Section("Judged against another catalog", words.judged_elsewhere(len(stale)) + ": "
                                + ", ".join(stale) + "."))
    if "world_size" in df and (df["world_size"].fillna(1) > 1).any():
        table, same = tables.fold_constant(tables.capacity_table(df, fit_long), tables.CAPACITY_IDENTITY_COLUMNS)
        sections.append(Section("Cards x count", "Per job (its batch per GPU) and card, the fewest GPUs of the "
                                "sweep's counts that the job fits spread over, and how (FSDP2, DDP, HSDP, TP); "
                                "\"-\": none of them"
                                f"{'; ' + same if same else ''}. {words.nccl_note(df)}", table))
    table, same = tables.fold_constant(tables.fits_table(df, fit_long), columns=tables.FITS_IDENTITY_COLUMNS)
    sections.append(Section("Fit table", f"Every run on every card of the catalog{'; ' + same if same else ''}.",
                            table))
    pngs.update({name: png for name, png in _draw_all(to_draw).items() if png is not None})
    for section in sections:  # a figure with nothing to show (no such rows) is left out
        if section.figure is not None and section.figure not in pngs:
            keys.pop(section.figure, None)
            section.figure = None
    return sections, pngs, keys


_JOBS: dict[str, tuple] = {}  # the figures being drawn: what a forked drawer finds in its copy


def _drawn(name: str) -> bytes | None:
    draw, inputs = _JOBS[name]
    fig = draw(*inputs)
    return None if fig is None else _png(fig)


def _draw_all(jobs: dict[str, tuple]) -> dict[str, bytes | None]:
    """Each figure's PNG (None: nothing to draw), two or more at once in forked processes when
    this process has no other thread (a fork copies no lock another thread holds); a drawer is
    sent a name only, and draws from its copy of `jobs`."""
    _JOBS.clear()
    _JOBS.update(jobs)
    try:
        workers = min(len(jobs), parallelism())
        if workers < 2 or threading.active_count() > 1:
            return {name: _drawn(name) for name in jobs}
        with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("fork")) as pool:
            return dict(zip(jobs, pool.map(_drawn, jobs)))
    finally:
        _JOBS.clear()


def _md_cell(s: str) -> str:
    return s.replace("|", "\\|").replace("\n", " ")


def markdown(sections: list[Section]) -> str:
    out = []
    for i, s in enumerate(sections):
        out.append(f"{'#' if i == 0 else '##'} {s.title}\n")
        if s.text:
            out.append(s.text + "\n")
        if s.figure:
            out.append(f"![{s.title}]({FIG_DIR}/{s.figure})\n")
        if s.table and s.table[1]:
            header, rows = s.table
            out.append("| " + " | ".join(map(_md_cell, header)) + " |")
            out.append("|" + "---|" * len(header))
            out += ["| " + " | ".join(map(_md_cell, r)) + " |" for r in rows]
            out.append("")
    return "\n".join(out) + "\n"


_CSS = """body{font-family:system-ui,sans-serif;margin:2em;color:#222}table{border-collapse:collapse;
font-size:12px;margin:1em 0}th,td{border:1px solid #ccc;padding:3px 6px;text-align:left;vertical-align:top}
th{background:#f3f3f3}td.fits{color:#176c2b}td.oom{color:#b3261e;font-weight:600}td.edge{color:#8a5a00}img{max-width:100%;
border:1px solid #eee}"""


def _td(cell: str) -> str:
    cls = " class=edge" if cell.startswith(("fits on retry", "tight")) or cell == "undecided" else \
        " class=fits" if cell.startswith("fits") or cell == "code problem" else \
        " class=oom" if cell in ("OOM", "card problem", "error") else ""
    return f"<td{cls}>{html.escape(cell)}</td>"


def to_html(sections: list[Section], pngs: dict[str, bytes]) -> str:
    out = [(f"<!doctype html><html><head><meta charset=utf-8><title>{html.escape(sections[0].title)}</title>"
            f"<style>{_CSS}</style></head><body>")]
    for i, s in enumerate(sections):
        out.append(f"<h{1 if i == 0 else 2}>{html.escape(s.title)}</h{1 if i == 0 else 2}>")
        if s.text:
            out.append(f"<p>{html.escape(s.text)}</p>")
        if s.figure:
            data = base64.b64encode(pngs[s.figure]).decode()
            out.append(f'<img alt="{html.escape(s.title)}" src="data:image/png;base64,{data}">')
        if s.table and s.table[1]:
            header, rows = s.table
            out.append("<table><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in header) + "</tr>")
            out += ["<tr>" + "".join(_td(c) for c in r) + "</tr>" for r in rows]
            out.append("</table>")
    out.append("</body></html>")
    return "\n".join(out)


def write(target: Path, df: pd.DataFrame, fit_long: pd.DataFrame, judged: pd.DataFrame,
          fr: pd.DataFrame | None, title: str, more_gpus: str | None = None) -> Path:
    """report.md, report_files/*.png, report.html and fit.{csv,parquet} in `target`; returns the HTML."""
    sections, pngs, keys = build(df, fit_long, judged, fr, title, _drawn_beside(target), more_gpus)
    figs = target / FIG_DIR
    figs.mkdir(exist_ok=True)
    for name, data in pngs.items():
        (figs / name).write_bytes(data)
    (figs / FIG_KEYS).write_text(json.dumps(keys, indent=1))
    (target / "report.md").write_text(markdown(sections))
    out = target / "report.html"
    out.write_text(to_html(sections, pngs))
    fit_long.to_csv(target / "fit.csv", index=False)
    fit_long.to_parquet(target / "fit.parquet", index=False)
    return out


def _drawn_beside(target: Path, newest: int = 20) -> Lend:
    """Figures of `target`'s own last report and of the reports beside it (a sweep's earlier runs,
    newest first), by key."""
    try:
        siblings = sorted((d for d in target.parent.iterdir() if (d / FIG_DIR / FIG_KEYS).is_file()),
                          key=lambda d: (d != target, -d.stat().st_mtime))[:newest]
    except OSError:
        siblings = []

    def lend(name: str, key: str) -> bytes | None:
        for d in siblings:
            try:
                if json.loads((d / FIG_DIR / FIG_KEYS).read_text()).get(name) == key:
                    return (d / FIG_DIR / name).read_bytes()
            except (OSError, ValueError, AttributeError):
                continue
        return None
    return lend
