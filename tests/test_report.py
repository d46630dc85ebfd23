"""The report: report.md with its pictures, a self-contained report.html that a real browser renders."""

import base64
import re
import shutil
from pathlib import Path

import pandas as pd
import pytest

from harness.cli.progress import SweepProgress, Tally, line
from harness.config import cards
from tests.conftest import REPO, run_cli

ARTIFACTS = REPO / "test-artifacts"
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def sweep_dir(shared, tmp_path_factory):
    """A smoke sweep with and without a leak (run once a session): this module's own copy."""
    def sweep(results: Path) -> None:
        r = run_cli("sweep", "sweeps=smoke", "workload.leak=none,graph", f"results_dir={results}")
        assert r.returncode == 0, r.stderr

    results = shared.copy("report-smoke", sweep, tmp_path_factory.mktemp("report") / "results")
    [d] = list((results / "smoke").iterdir())
    return d


@pytest.mark.slow  # the sweep behind the report: one smoke sweep per module
def test_report_md_links_every_picture_it_names(sweep_dir):
    md = (sweep_dir / "report.md").read_text()
    for title in ("Peak memory vs batch", "Allocated after each step", "The breakdown at the peak", "Fit table"):
        assert f"## {title}" in md
    links = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", md)
    assert len(links) == 3
    for link in links:
        assert (sweep_dir / link).read_bytes().startswith(PNG)
    assert "| h100-80gb |" in md.splitlines()[md.splitlines().index("## Fit table") + 3] or "h100-80gb" in md


@pytest.mark.slow  # the sweep behind the report: one smoke sweep per module
def test_report_html_is_self_contained(sweep_dir):
    page = (sweep_dir / "report.html").read_text()
    srcs = re.findall(r'<img[^>]* src="([^"]+)"', page)
    assert len(srcs) == 3
    for src in srcs:
        assert src.startswith("data:image/png;base64,")
        assert base64.b64decode(src.split(",", 1)[1]).startswith(PNG)
    assert not re.search(r'(src|href)="(?!data:)', page)  # nothing fetched from anywhere
    assert "fits +" in page and "retained" in page  # the leak's kind, in the tables


@pytest.mark.slow  # the sweep behind the report: one smoke sweep per module
def test_report_verb_rewrites_the_report_of_a_sweep_dir(sweep_dir):
    (sweep_dir / "report.html").unlink()
    r = run_cli("report", str(sweep_dir))
    assert r.returncode == 0, r.stderr
    assert (sweep_dir / "report.html").exists()
    fit = pd.read_csv(sweep_dir / "fit.csv")
    assert len(fit) == 8 * len(cards.cards()) and set(fit.columns) >= {"run_id", "card", "fits", "headroom_bytes", "headroom_pct"}


@pytest.mark.slow  # the sweep behind the report: one smoke sweep per module
def test_a_figure_is_drawn_again_only_when_what_it_shows_changed(sweep_dir, monkeypatch):
    """A re-run that reuses every row (a new sweep dir beside the first) lends the first report's
    PNGs; a row that changed draws the figures that show it."""
    import json

    from harness.cli.common import aggregate
    from harness.report import document, figures

    again = sweep_dir.parent / "again"
    shutil.copytree(sweep_dir / "runs", again / "runs")
    log = sweep_dir.parent / "drawn.txt"  # figures are drawn in forked processes: they say so here

    def drawn() -> list[str]:
        return sorted(log.read_text().split()) if log.exists() else []

    def noted(name, real):
        def draw(*a):
            with open(log, "a") as f:
                f.write(f"{name}\n")
            return real(*a)
        return draw
    for name in ("peak_vs_batch", "step_timeline", "breakdown"):
        monkeypatch.setattr(figures, name, noted(name, getattr(figures, name)))
    aggregate(again)
    assert drawn() == []
    for png in ("peak_vs_batch.png", "timeline.png", "breakdown.png"):
        assert (again / document.FIG_DIR / png).read_bytes() == (sweep_dir / document.FIG_DIR / png).read_bytes()
    result = next((again / "runs").glob("*/result.json"))
    row = json.loads(result.read_text())
    row["peak_reserved_bytes"] += 2 * 1024**3
    result.write_text(json.dumps(row))
    aggregate(again)
    assert drawn() == ["breakdown", "peak_vs_batch", "step_timeline"]


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.slow  # the sweep behind the report: one smoke sweep per module
def test_report_opens_in_headless_chromium_with_every_image_loaded(sweep_dir):
    playwright = pytest.importorskip("playwright.sync_api", reason="playwright is a dev dependency")
    exe = _chromium()
    if exe is None:
        pytest.skip("no Chromium on this machine (.ci/run installs Debian's chromium package)")
    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "report.png"
    flags = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
             "--disable-component-update", "--disable-sync"]
    with playwright.sync_playwright() as p:
        try:
            browser = p.chromium.launch(executable_path=exe, args=flags)
        except Exception as e:  # noqa: BLE001 - whatever stops the browser, say it and skip
            pytest.skip(f"Chromium at {exe} would not start: {str(e).splitlines()[0]}")
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto((sweep_dir / "report.html").as_uri(), wait_until="load")
        images = page.evaluate("Array.from(document.images).map(i => [i.complete, i.naturalWidth, i.naturalHeight])")
        # as pictures: drawn (not blank), inside the page, not shrunk past reading
        looks = page.evaluate("""Array.from(document.images).map(i => {
            const c = document.createElement('canvas'); c.width = i.naturalWidth; c.height = i.naturalHeight;
            const g = c.getContext('2d'); g.drawImage(i, 0, 0);
            const px = g.getImageData(0, 0, c.width, c.height).data; let ink = 0;
            for (let k = 0; k < px.length; k += 4) if (px[k] < 200 || px[k+1] < 200 || px[k+2] < 200) ink++;
            const r = i.getBoundingClientRect();
            return [ink / (px.length / 4), r.left, r.right, r.width / i.naturalWidth, window.innerWidth];
        })""")
        page.screenshot(path=str(shot), full_page=True)
        browser.close()
    assert len(images) == 3
    assert all(done and w > 100 and h > 100 for done, w, h in images), images
    for ink, left, right, scale, viewport in looks:
        assert 0.01 < ink < 0.6, looks  # something is drawn, and it is not a block of colour
        assert left >= 0 and right <= viewport and scale >= 0.6, looks
    assert shot.read_bytes().startswith(PNG)


def test_progress_counts_rows_as_they_land(tmp_path):
    import io
    import json

    tally = Tally(tmp_path)
    assert sum(tally().values()) == 0
    for i, status in enumerate(["ok", "oom", "error"]):
        (tmp_path / "runs" / str(i)).mkdir(parents=True)
        (tmp_path / "runs" / str(i) / "result.json").write_text(json.dumps({"status": status}))
    (tmp_path / "runs" / "3").mkdir()
    (tmp_path / "runs" / "3" / "result.json").write_text('{"status": "o')  # still being written
    assert line(tally(), 5) == "3/5 points done (ok 1, oom 1, failed 1)"
    out = io.StringIO()
    with SweepProgress(tmp_path, 5, stream=out, interval_s=0.01):
        pass
    assert out.getvalue().strip().splitlines()[-1] == "harness: sweep: 3/5 points done (ok 1, oom 1, failed 1)"


def test_hydras_callback_writes_the_report_once_and_the_cli_takes_its_code(tmp_path, monkeypatch):
    """SweepReport aggregates at Hydra's end of a sweep; finish() returns its code without a second
    aggregation, and aggregates itself when Hydra stopped before its end."""
    from harness.cli import callbacks

    calls = []
    monkeypatch.setattr(callbacks, "_aggregate", lambda sweep: calls.append(sweep.out) or 7)
    callbacks.arm(tmp_path, expected=3)
    callbacks.SweepReport().on_multirun_end(config=None)
    assert callbacks.finish() == 7 and calls == [tmp_path]
    callbacks.arm(tmp_path / "stopped", expected=3)  # Hydra never reached on_multirun_end
    assert callbacks.finish() == 7 and calls == [tmp_path, tmp_path / "stopped"]
    callbacks.SweepReport().on_run_end(config=None)  # not armed (e.g. --cfg): nothing happens
    assert len(calls) == 2


def test_a_plan_groups_label_says_which_checkpointing_it_keeps_from_a_frame_row_or_a_tuple():
    from harness.report.tables import group_label

    df = pd.DataFrame([{"axis": "batch_size", "seq_len": 1024, "batch_size": None, "model": "7b", "workload": "train",
                        "precision": "bf16", "checkpointing": ckpt, "checkpointing_policy": policy,
                        "allocator_conf": ""} for ckpt, policy in ((False, None), (True, "full"), (True, "op"))])
    labels = [group_label(r) for _, r in df.iterrows()]
    assert labels == [group_label(r) for r in df.itertuples(index=False)]
    assert [label.split(",")[0] for label in labels] == ["7b train bf16", "7b train bf16 ckpt", "7b train bf16 ckpt=op"]


def _wide_table(n_runs: int = 3):
    """A fits table of key columns and six cards, two pairs of them alike in every run, and its
    fit_long (run_id, card, edge)."""
    from harness.report import tables

    cards_ = ["l4", "a10g", "rtx4090", "a100-80gb", "h100-80gb", "h100-pcie"]
    edges = {"l4": ["oom", "oom", "tight"], "a10g": ["oom", "oom", "tight"], "rtx4090": ["oom", "after_retry", "room"],
             "a100-80gb": ["oom", "room", "room"], "h100-80gb": ["after_retry", "room", "room"],
             "h100-pcie": ["after_retry", "room", "room"]}
    long = pd.DataFrame([{"run_id": f"r{i}", "card": c, "edge": edges[c][i], "headroom_pct": 12.0}
                         for i in range(n_runs) for c in cards_])
    header = ["GPUs", "status", "kind", "alloc GiB", "reserved GiB", *cards_]
    rows = [[f"{8 * 2 ** i} FSDP2", "ok", "activations", "80.32", "98.08",
             *[tables._cell(edges[c][i], 12.0) for c in cards_]] for i in range(n_runs)]
    return (header, rows), long


def test_cards_a_terminal_cannot_show_whole_go_to_the_caption_alike_ones_first():
    """report.tables.fold_to_width: the shown columns fit the width, each whole; a card whose edge
    in every run is that of a card to its left goes first, then cards from the right; the runs' own
    cards stay; a table that fits is left alone."""
    from harness.report import tables

    table, long = _wide_table()
    widths = [max(len(h), *(len(r[i]) for r in table[1])) for i, h in enumerate(table[0])]
    whole = sum(w + 3 for w in widths) + 1
    assert tables.fold_to_width(table, long, set(), whole) == (table, "")
    (header, rows), caption = tables.fold_to_width(table, long, set(), whole - 1)
    assert header == table[0][:-1] and caption.endswith("h100-pcie as h100-80gb")  # the last twin first
    (header, rows), caption = tables.fold_to_width(table, long, {"a10g"}, whole - 40)
    shown = sum(max(len(h), *(len(r[i]) for r in rows)) + 3 for i, h in enumerate(header)) + 1
    assert shown <= whole - 40 and header[:5] == table[0][:5] and "a10g" in header
    assert all(len(r) == len(header) for r in rows)
    assert set(table[0]) - set(header) == {c.split(" as ")[0] for c in caption.split(": ")[1].split(", ")}


def test_the_terminals_fit_table_keeps_the_runs_figures_whole_on_a_narrow_console(monkeypatch, capsys):
    """The words a user reads: on a console too narrow for every card the runs' own columns are
    printed whole ("alloc GiB", "8 FSDP2") and the cards left out are named under the table; a sweep
    over GPU counts then prints the fewest of them each card holds."""
    import rich.console

    from harness.report import console

    table, long = _wide_table()
    df = pd.DataFrame([{"run_id": f"r{i}", "model": "70b", "workload": "train", "batch_size": 1, "seq_len": 4096,
                        "precision": "bf16", "checkpointing": True, "dp_shard": 8 * 2 ** i, "world_size": 8 * 2 ** i,
                        "optimizer": "adamw",
                        "optimizer_impl": "auto", "allocator_conf": None, "gpu": "A100 80GB", "backend": "sim",
                        "status": "ok", "kind": "activations", "peak_allocated_bytes": 80 * 2**30,
                        "peak_reserved_bytes": 98 * 2**30} for i in range(3)])
    monkeypatch.setattr(console, "_console", lambda: rich.console.Console(width=110, force_terminal=False))
    console.render(df, long, "title")
    out = capsys.readouterr().out
    assert "alloc GiB" in out and "reserved GiB" in out and "8 FSDP2" in out and "activations" in out
    assert "not shown for the terminal's width:" in out.replace("\n", " ")
    console.render_capacity(*_spread_rows())  # and the answer to "how many of which card", a card group a row
    out = capsys.readouterr().out
    assert "Cards x count" in out and "l4, a10g" in out and "16 FSDP2 tight" in out
    console.render_capacity(*_spread_rows(counts=(8,)))  # one count: the fit table says it all
    assert capsys.readouterr().out == ""



def test_rows_judged_against_another_catalog_are_named_where_the_verdicts_are_shown(monkeypatch, capsys):
    """A row's fits hold for the catalog it was judged against (catalog_sha): rows of an older
    catalog (calibrate measured a card since) are named, on the terminal with their count, those of
    today's and a row without one (an error's) are not."""
    import rich.console

    from harness.config import cards as catalog
    from harness.record import results
    from harness.report import console

    table, long = _wide_table()
    df = pd.DataFrame([{"run_id": f"r{i}", "model": "7b", "workload": "train", "batch_size": 1, "seq_len": 512,
                        "precision": "bf16", "checkpointing": False, "optimizer": "adamw", "optimizer_impl": "auto",
                        "allocator_conf": None, "gpu": "A100 80GB", "backend": "sim", "status": "ok",
                        "kind": "fits", "peak_allocated_bytes": 30 * 2**30, "peak_reserved_bytes": 31 * 2**30,
                        "catalog_sha": sha} for i, sha in enumerate([catalog.digest(), "0123abcd", None])])
    assert results.judged_elsewhere(df) == ["r1"]
    assert results.judged_elsewhere(df.drop(columns="catalog_sha")) == []
    monkeypatch.setattr(console, "_console", lambda: rich.console.Console(width=200, force_terminal=False))
    console.render(df, long, "title")
    out = capsys.readouterr().out
    assert out.count("row(s) were judged against") == 1 and "\n1 row(s) were judged against" in out
    console.render(df[df["run_id"] != "r1"], long, "title")
    assert "catalog" not in capsys.readouterr().out

def test_a_narrow_terminal_gets_each_verdict_on_lines_of_its_own_and_no_cell_cut_short(monkeypatch, capsys):
    """On a terminal narrower than the verdict table each answer is a block: its job, card, kind and
    verdict on one line, then where it runs out and each remedy on a line of its own, wrapped beside
    its name within the terminal; a pipe still gets the table. A table whose unwrapped columns alone
    are wider than the terminal is printed whole (the terminal wraps it), no cell cut short."""
    import rich.console

    from harness.report import console

    remedies = ["fits with micro-batch 1 x 4 accumulation steps (same effective batch; more, smaller steps)",
                "fits with activation checkpointing (about 20-33% more compute (one more forward per layer))"]
    judged = pd.DataFrame([{"job": "7b train b4 s2048 bf16 ckpt=no", "card": "a100-80gb", "kind": "activations",
                            "runs_out": "forward of step 2 at model.layers.28.input_layernorm",
                            "verdict": "code problem", "detail": " | ".join(remedies)}])

    def terminal(width):
        monkeypatch.setattr(console, "_console", lambda: rich.console.Console(
            width=width, force_terminal=True, color_system=None))

    terminal(80)
    console.render_verdicts(judged)
    lines = [line.rstrip() for line in capsys.readouterr().out.splitlines()]
    assert max(map(len, lines)) <= 80 and not any("┃" in line for line in lines)
    assert lines[1] == "7b train b4 s2048 bf16 ckpt=no  a100-80gb  activations  code problem"
    what = next(i for i, line in enumerate(lines) if line.lstrip().startswith("what fits:"))
    column = lines[what].index("fits with")
    said = " ".join(line[column:] for line in lines[what:])  # each remedy wrapped in its own column
    assert said.split(" fits with ") == [remedies[0], remedies[1][len("fits with "):]]
    monkeypatch.setattr(console, "_console", lambda: rich.console.Console(width=200, force_terminal=False))
    console.render_verdicts(judged)
    assert "┃ job" in capsys.readouterr().out  # a pipe: the table

    table, long = _wide_table()
    df = pd.DataFrame([{"run_id": f"r{i}", "model": "70b", "workload": "train", "batch_size": 1, "seq_len": 512 * i,
                        "precision": ("amp_bf16", "bf16")[i % 2], "checkpointing": True, "optimizer": "adamw",
                        "optimizer_impl": "auto", "allocator_conf": None, "gpu": "A100 80GB", "backend": "sim",
                        "status": "ok", "kind": "activations", "peak_allocated_bytes": 80 * 2**30,
                        "peak_reserved_bytes": 98 * 2**30} for i in range(3)])
    terminal(40)
    console.render(df, long, "title")
    out = capsys.readouterr().out
    assert "amp_bf16" in out and " 1024 " in out and "activations" in out and "alloc GiB" in out



def test_a_narrow_terminal_gets_a_frontier_a_group_at_a_time_its_search_above_its_cards(monkeypatch, capsys):
    """plan's frontier on an 80-column terminal: each group's search (axis, margin, probes) in a
    line above a table of its cards' answers within the width, every figure whole; a pipe still
    gets the one table of every group and card."""
    import rich.console

    from harness.report import console, tables

    fr = pd.DataFrame([{"status": "ok", "axis": "batch_size", "margin": 0.05, "card": card, "largest": largest,
                        "first_oom": largest + 1, "monotone": True, "cache_flushes": 0, "probes": 11,
                        "grid_points": 64, "peak_reserved_bytes": 131.37 * 2**30, "headroom_bytes": 2**29,
                        "edge": edge, "model": "7b", "workload": "train", "precision": "bf16", "checkpointing": ckpt,
                        "seq_len": 2048, "batch_size": None, "allocator_conf": "", "error": None}
                       for ckpt in (False, True) for card, largest, edge in
                       (("h100-80gb", 2, "room"), ("gh200", 4, "after_retry"), ("h200", 7, "room"))])
    assert tables.ruled_width(tables.column_widths(tables.frontier_table(fr), ("group",))) > 80
    monkeypatch.setattr(console, "_console", lambda: rich.console.Console(width=80, force_terminal=True,
                                                                          color_system=None))
    console.render_frontier(fr)
    lines = [line.rstrip() for line in capsys.readouterr().out.splitlines()]
    assert max(map(len, lines)) <= 80
    searches = [line.strip() for line in lines if "probes" in line]
    assert searches == [f"7b train bf16{c}, seq 2048: batch_size searched, margin 5%, 11 / 64 probes"
                        for c in ("", " ckpt")]
    assert sum("131.37" in line for line in lines) == 6 and sum("│ h200" in line for line in lines) == 2
    monkeypatch.setattr(console, "_console", lambda: rich.console.Console(width=200, force_terminal=False))
    console.render_frontier(fr)
    out = capsys.readouterr().out
    assert "probes" in out and "11 / 64 probes" not in out and out.count("│ 7b train bf16") == 6  # a pipe: one table

def _spread_rows(batches=(1,), counts=(8, 16)):
    """Rows of a 70B job over FSDP2 counts (one per batch and count) and their fit_long: l4 and a10g
    alike (tight over 16 only), a100-80gb and h100-80gb alike (over 8 and 16), t4 never."""
    rows, long = [], []
    for b in batches:
        for n in counts:
            rid = f"b{b}-{n}"
            rows.append({"run_id": rid, "model": "70b", "workload": "train", "batch_size": b, "seq_len": 4096,
                         "precision": "bf16", "checkpointing": True, "world_size": n, "dp_shard": n,
                         "optimizer": "adamw", "optimizer_impl": "auto", "allocator_conf": None, "gpu": "A100 80GB",
                         "backend": "sim", "status": "ok", "kind": "activations", "peak_allocated_bytes": 2**30,
                         "peak_reserved_bytes": 2**30})
            edges = {"t4": "oom", "l4": "tight" if n == 16 and b == 1 else "oom",
                     "a10g": "tight" if n == 16 and b == 1 else "oom", "a100-80gb": "room", "h100-80gb": "room"}
            long += [{"run_id": rid, "card": c, "edge": e, "headroom_pct": 10.0} for c, e in edges.items()]
    return pd.DataFrame(rows), pd.DataFrame(long)


def test_the_cards_x_count_answer_groups_the_cards_of_one_answer_and_turns_for_one_job():
    """report.tables.cards_by_count: a column per set of cards that answer alike for every job, a
    row per job (its knobs that differ, as a short label says them); tables.turned puts one job's
    answers down the page."""
    from harness.report import tables

    (header, rows), same = tables.cards_by_count(*_spread_rows(batches=(1, 2)))
    assert header == ["job", "t4", "l4, a10g", "a100-80gb, h100-80gb"] and "model 70b" in same
    assert rows == [["b1", "-", "16 FSDP2 tight", "8 FSDP2"], ["b2", "-", "-", "8 FSDP2"]]  # (its batch per GPU)
    table, _ = tables.cards_by_count(*_spread_rows())
    assert tables.turned(table) == (["job", "fewest GPUs"], [["t4", "-"], ["l4, a10g", "16 FSDP2 tight"],
                                                          ["a100-80gb, h100-80gb", "8 FSDP2"]])
