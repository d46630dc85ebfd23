"""The tables on the terminal, with rich."""

from __future__ import annotations

import collections
import functools

import pandas as pd

from harness.config import cards as catalog
from harness.record import results
from harness.report import tables, words


def _console():
    """A terminal's own width (each table folds its cards or wraps its text to it); 200 columns
    for a pipe or a log, where nothing wraps a line, so that a table of many cards stays whole."""
    console = _console_class()
    plain = console()
    return plain if plain.is_terminal else console(width=max(200, plain.width))


@functools.cache
def _console_class():
    """rich's Console, but for a closed pipe: rich's own exits 1, as a failed row would; the CLI's
    edge ends with SIGPIPE's 141 (rich imported where a table is first printed)."""
    from rich.console import Console

    class _Console(Console):
        def on_broken_pipe(self) -> None:
            raise BrokenPipeError

    return _Console


def _wider(table: tables.Table, console, wrap: tuple[str, ...] = ()) -> bool:
    """Whether `table`, its `wrap` columns wrapped and the rest whole, is wider than `console`."""
    return tables.ruled_width(tables.column_widths(table, wrap)) > console.width


def _print(table: tables.Table, title: str, caption: str | None = None, right_from: int = 99,
           wrap: tuple[str, ...] = ()) -> None:
    """`wrap`: the columns whose text wraps where the console is narrower than the table."""
    from rich.markup import escape
    from rich.table import Table

    header, rows = table
    t = Table()
    for i, h in enumerate(header):
        t.add_column(h, justify="right" if i >= right_from else "left", no_wrap=h not in wrap,
                     overflow="fold")
    for row in rows:
        t.add_row(*[_style(escape(c)) for c in row])
    console = _console()
    if _wider(table, console, wrap):
        # its unwrapped columns alone are wider than the terminal: printed whole at 200 columns (the
        # terminal wraps its lines), not with cells cut short (a sequence length of 512 read as 51)
        console = _console_class()(width=max(200, console.width))
    # a title or caption wider than the table goes above or below it as lines of its own, not
    # folded to the table's width (a results path broken in two, a caption of twelve short lines)
    width = console.measure(t).maximum
    above = max(map(len, title.splitlines()), default=0) > width
    below = caption is not None and max(map(len, caption.splitlines()), default=0) > width
    t.title, t.caption = (None if above or not title else title), (None if below else caption)
    if above:
        console.print(title, markup=False, highlight=False)
    console.print(t)
    if below:
        console.print(caption, markup=False, highlight=False)


def _print_records(table: tables.Table, title: str, lead: tuple[str, ...]) -> None:
    """Each row as lines: its `lead` cells on one, then each other cell beside its column's name,
    a cell's alternatives (" | ") one a line, wrapped beside the name."""
    from rich.markup import escape
    from rich.table import Table

    console = _console()
    header, rows = table
    console.print(title, markup=False, highlight=False)
    for row in rows:
        cells = dict(zip(header, row, strict=True))
        console.print("  ".join(_style(escape(cells[h])) for h in lead), highlight=False)
        grid = Table.grid(padding=(0, 1))
        grid.add_column(no_wrap=True)
        grid.add_column()
        for h in (h for h in header if h not in lead):
            for i, part in enumerate(cells[h].split(" | ")):
                grid.add_row(f"    {escape(h)}:" if i == 0 else "", _style(escape(part)))
        console.print(grid, highlight=False)


def _style(cell: str) -> str:
    if cell.startswith(("fits on retry", "tight")):
        return f"[yellow]{cell}[/]"
    if cell.startswith("fits"):
        return f"[green]{cell}[/]"
    if cell in ("OOM", "card problem", "error", "none"):
        return f"[red]{cell}[/]"
    if cell == "code problem":
        return f"[green]{cell}[/]"
    return cell


FITS_CAPTION = ("fits +N%: the allocator model replays the run on the card without an OOM; N = headroom "
                "left at the peak reserved bytes (after non-PyTorch memory), % of the card. fits on retry: only "
                "because the allocator frees its cache and retries (a device sync each). tight: fits the card as "
                "estimated, not at the low end of its capacity and non-PyTorch memory (gpu.*_spread_bytes)")


FRONTIER_CAPTION = ("peak reserved: without a limit; negative headroom with cache flushes > 0: on the card the "
                    "allocator frees its cache and retries (num_alloc_retries, a device synchronization each) "
                    "and the run still fits")


def render(df: pd.DataFrame, fit_long: pd.DataFrame, title: str) -> None:
    """The fit table, the row counts and the failures."""
    from rich.markup import escape

    table, same = tables.fold_constant(tables.fits_table(df, fit_long), columns=tables.FITS_IDENTITY_COLUMNS)
    own = {c.key for c in catalog.cards() if c.name in set(df["gpu"].astype(str))}
    table, uniform = tables.fold_uniform_cards(table, fit_long, own)  # 20 cards do not fit a terminal
    table, narrow = tables.fold_to_width(table, fit_long, own, _console().width)  # nor do 14 that differ
    first_number = table[0].index("alloc GiB")
    folded = "; ".join(c for c in (uniform, narrow) if c)
    caption = FITS_CAPTION + "; GiB = 1024^3 B" + (f"\n{folded} (report.html has every card)" if folded else "")
    _print(table, f"{title}\n{same}" if same else title, caption, right_from=first_number)
    console = _console()
    counts = df["status"].value_counts().to_dict()
    console.print("rows: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    for r in df[df["status"].isin(["error", "timeout"])].itertuples(index=False):
        console.print(f"[red]{r.status}[/] {r.run_id}: {escape(str(r.error))}")
    # each reason a run's attention takes the math path on its card, once, with how many runs it holds for
    for sentence, n in collections.Counter(r[2] for r in tables.math_path_table(df)[1]).items():
        console.print(f"[yellow]{n} run(s):[/] {escape(str(sentence))}")
    for sentence, n in collections.Counter(r[1] for r in tables.unmodelled_table(df)[1]).items():
        console.print(f"[yellow]{n} run(s):[/] {escape(sentence)}")
    stale = results.judged_elsewhere(df)
    if stale:
        console.print(f"[yellow]{escape(words.judged_elsewhere(len(stale)))}[/]")


def render_capacity(df: pd.DataFrame, fit_long: pd.DataFrame) -> None:
    """Where the sweep spreads its jobs over several GPU counts: the fewest of them each card holds
    each job on (the report's "Cards x count", the cards of one answer together), the answer to "how
    many of which card" (over one count the fit table says it all)."""
    if "world_size" not in df or df["world_size"].fillna(1).nunique() < 2:
        return
    table, same = tables.cards_by_count(df, fit_long)
    if len(table[1]) == 1:  # one job: its cards down the page
        table = tables.turned(table, "cards")
    _print(table, "Cards x count: the fewest of the sweep's GPU counts that hold each job, per card",
           (f"{same}; " if same else "") + '"-": none of the counts; tight: only as the card is estimated',
           wrap=tuple(table[0][1:]))  # (the cards' lists wrap; each job or card group on one line)


def render_verdicts(judged: pd.DataFrame, more_gpus: str | None = None) -> None:
    """Code problem or card problem, for each point that does not fit its card; `more_gpus`: where
    the sweep cannot say how many GPUs (words.more_gpus)."""
    if not judged.empty:
        table, title = tables.verdict_table(judged), "Code problem or card problem? (each point that OOMs on its card)"
        wrap, console = ("job", "runs out in", "what fits"), _console()
        if console.is_terminal and _wider(table, console):
            # a terminal narrower than the table: each answer on lines of its own, not in a column
            # of a few words a line
            _print_records(table, title, lead=("job", "card", "kind", "verdict"))
        else:
            _print(table, title, wrap=wrap)
    if more_gpus:
        from rich.markup import escape

        _console().print(f"[yellow]{escape(more_gpus)}[/]")


def render_frontier(fr: pd.DataFrame) -> None:
    if fr is None or fr.empty:
        return
    table, title = tables.frontier_table(fr), "Frontiers: the largest value that fits each card (searched, " \
        "each checked at its boundary)"
    console = _console()
    if console.is_terminal and _wider(table, console, ("group",)):
        # a terminal narrower than the table: a group at a time, its search in a line above its
        # cards (a row of 200 columns, wrapped by the terminal, reads as two)
        console.print(title, markup=False, highlight=False)
        for search, cards in tables.frontier_by_group(table):
            _print(cards, search, right_from=1, wrap=tuple(cards[0][1:]))  # (headers and words wrap, numbers whole)
        console.print(FRONTIER_CAPTION, markup=False, highlight=False)
    else:
        _print(table, title, FRONTIER_CAPTION, right_from=4,
               wrap=("group",))  # (a long label: wrapped, not every figure beside it cut short)
    from rich.markup import escape

    for err in dict.fromkeys(fr.loc[fr["status"] != "ok", "error"]):
        _console().print(f"[red]plan error[/] {escape(str(err))}")
    header, rows = tables.serving_table(fr)
    if rows:
        _print((header, rows), "Serving: concurrency x context per card, the harness beside vLLM's arithmetic",
               wrap=("why they differ",))


CALIBRATION_CAPTION = ("error = (predicted - measured) / measured; peaks compared where both runs finished (an OOM "
                       "row's peak is how far it got); targets: allocated within 1%, reserved within 5%; GiB = 1024^3 B")


def render_calibration(df: pd.DataFrame, summary: dict) -> None:
    """Predicted (virtual GPU) beside measured (the card), per point."""
    _print(tables.calibration_table(df), "Calibration: the virtual GPU against this machine's GPU",
           CALIBRATION_CAPTION, right_from=2)
    _console().print(f"{summary['compared']} of {summary['points']} point(s) compared, "
                     f"{summary['within_target']} within target, statuses agree on {summary['status_agrees']}")
