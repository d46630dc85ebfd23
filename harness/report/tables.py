"""The report's tables as (header, rows) of strings, shared by the terminal, Markdown and HTML."""

from __future__ import annotations

import pandas as pd

from harness.analysis.attention_path import math_paths
from harness.analysis.verdict import spread
from harness.config.point import WorkloadName
from harness.report.words import ckpt_word, gpus, job_args, job_label, math_path, unmodelled
from harness.units import GiB

Table = tuple[list[str], list[list[str]]]


def gib(nbytes) -> str:
    return "-" if nbytes is None or pd.isna(nbytes) else f"{nbytes / GiB:.2f}"


# A run on a card, by its edge (probe.sim.reserved.EDGES), with the headroom's share of the card.
EDGE_WORDS = {"room": "fits", "after_retry": "fits on retry", "tight": "tight", "oom": "OOM"}


def _cell(where, pct) -> str:
    if where is None or (isinstance(where, float) and pd.isna(where)):
        return "-"
    if where == "oom":
        return "OOM"
    head = "" if pct is None or pd.isna(pct) else f" {pct:+.0f}%"
    return f"{EDGE_WORDS[where]}{head}"


def fits_table(df: pd.DataFrame, fit_long: pd.DataFrame) -> Table:
    """Config x card: fits with the headroom left (% of the card's memory) or OOM. Every key that
    tells runs apart is a column (fold_constant moves those that hold one value to the title)."""
    cards = list(dict.fromkeys(fit_long["card"])) if not fit_long.empty else []
    cell = {(r.run_id, r.card): _cell(r.edge, r.headroom_pct) for r in fit_long.itertuples(index=False)}
    header = ["model", "workload", "batch", "seq", "precision", "ckpt", "GPUs", "optimizer", "args", "allocator",
              "leak", "gpu", "backend", "status", "kind", "alloc GiB", "reserved GiB", *cards]
    rows = [[*_shape_cells(r), gpus(r), *_knob_cells(r), str(r["gpu"]),
             str(r["backend"]), str(r["status"]), str(r.get("kind")),
             gib(r["peak_allocated_bytes"]), gib(r["peak_reserved_bytes"]),
             *[cell.get((r["run_id"], c), "-") for c in cards]]
            for r in df.to_dict("records")]
    return header, rows


FITS_IDENTITY_COLUMNS = 13  # model .. backend: folded into the title where one value holds for all rows


def _shape_cells(r) -> list[str]:
    """model, workload, batch (per GPU), seq, precision, ckpt."""
    return [str(r["model"]), str(r["workload"]), str(r["batch_size"]), str(r["seq_len"]), str(r["precision"]),
            ckpt_word(r)]


def _knob_cells(r) -> list[str]:
    """optimizer ("-" when serving: none runs), args, allocator, leak."""
    optimizer = "-" if r["workload"] == WorkloadName.infer else f"{r['optimizer']}/{r['optimizer_impl']}"
    return [optimizer, job_args(r) or "-", str(r["allocator_conf"] or "default"), str(r.get("leak") or "none")]


def capacity_table(df: pd.DataFrame, fit_long: pd.DataFrame) -> Table:
    """Job x card: the fewest GPUs of the sweep's counts the job fits that card spread over ("8
    FSDP2": 8 GPUs; "1": one), "-" where none does. A job here is its model, workload, batch per
    GPU, length and the rest of its knobs; the sweep's runs of it differ only by how many GPUs
    they are spread over (and so by the sequences a step takes over all of them)."""
    cards = list(dict.fromkeys(fit_long["card"])) if not fit_long.empty else []
    fits = {(r.run_id, r.card): r.edge for r in fit_long.itertuples(index=False)}
    header = ["model", "workload", "batch per GPU", "seq", "precision", "ckpt", "optimizer", "args", "allocator",
              "leak", *cards]
    jobs: dict[tuple, list[dict]] = {}
    for r in df.to_dict("records"):
        if r["status"] in ("ok", "oom"):
            jobs.setdefault((*_shape_cells(r), *_knob_cells(r)), []).append(r)
    rows = []
    for key, runs in jobs.items():
        cells = []
        for card in cards:
            sure = [r for r in runs if fits.get((r["run_id"], card)) in ("room", "after_retry")]
            tight = [r for r in runs if fits.get((r["run_id"], card)) == "tight"]
            fewest = min(sure or tight, key=lambda r: spread(r)[0], default=None)
            cells.append("-" if fewest is None else gpus(fewest) + ("" if sure else " tight"))
        rows.append([*key, *cells])
    return header, rows


def cards_by_count(df: pd.DataFrame, fit_long: pd.DataFrame) -> tuple[Table, str]:
    """capacity_table for a terminal: its cards of the same answer for every job in one column (in
    the catalog's order: "l4, a10g"), a row per job named by its knobs that differ ("fewest GPUs"
    for a sweep of one job); and the knobs every job shares (fold_constant's)."""
    (header, rows), same = fold_constant(capacity_table(df, fit_long), CAPACITY_IDENTITY_COLUMNS)
    n_cards = len(dict.fromkeys(fit_long["card"])) if not fit_long.empty else 0
    keys = len(header) - n_cards
    by_answer: dict[tuple, list[str]] = {}
    for i, card in enumerate(header[keys:], keys):
        by_answer.setdefault(tuple(r[i] for r in rows), []).append(card)
    jobs = [" ".join(_short(h, v) for h, v in zip(header[:keys], r[:keys], strict=True)) or "fewest GPUs" for r in rows]
    answers = list(by_answer)
    return (["job", *(", ".join(cards) for cards in by_answer.values())],
            [[job, *(a[j] for a in answers)] for j, job in enumerate(jobs)]), same


# A job's knob in a short label's form, as words.job_label writes them ("b1 s512 amp_bf16 ckpt=no")
_SHORT = {"batch per GPU": "b{}", "seq": "s{}", "ckpt": "ckpt={}", "allocator": "allocator {}", "leak": "leak {}",
          "args": "args {}"}


def _short(header: str, value: str) -> str:
    return _SHORT.get(header, "{}").format(value)


def turned(table: Table, corner: str | None = None) -> Table:
    """The table's columns as rows (its first column's cells the header, headed `corner`, else as
    that column was): one job's answers down the page rather than across it."""
    header, rows = table
    return ([header[0] if corner is None else corner, *(r[0] for r in rows)],
            [[h, *(r[i] for r in rows)] for i, h in enumerate(header) if i])


CAPACITY_IDENTITY_COLUMNS = 10  # model .. leak


def fold_constant(table: Table, columns: int) -> tuple[Table, str]:
    """Move the first `columns` columns that hold one value in every row into a caption."""
    header, rows = table
    if not rows:
        return table, ""
    same = [i for i in range(columns) if len({r[i] for r in rows}) == 1 and header[i] != "status"]
    caption = ", ".join(f"{header[i]} {rows[0][i]}" for i in same)
    return _columns(table, [i for i in range(len(header)) if i not in same]), caption


def _columns(table: Table, kept: list[int]) -> Table:
    """The table's columns `kept` (their places), in that order."""
    header, rows = table
    return [header[i] for i in kept], [[r[i] for i in kept] for r in rows]


def fold_uniform_cards(table: Table, fit_long: pd.DataFrame, keep: set[str]) -> tuple[Table, str]:
    """Card columns whose edge is the same for every run (all fit with room, or none fits) moved
    into a caption, so the cards that tell runs apart stay readable; the `keep` cards (the runs'
    own) stay as columns."""
    header, rows = table
    if not rows or fit_long.empty:
        return table, ""
    edges = fit_long.groupby("card", sort=False)["edge"].agg(lambda e: frozenset(e.dropna()))
    uniform = {"every run fits": frozenset({"room"}), "no run fits": frozenset({"oom"})}
    folded = {what: [c for c, e in edges.items() if e == kinds and c not in keep and c in header]
              for what, kinds in uniform.items()}
    drop = {header.index(c) for cards in folded.values() for c in cards}
    caption = "; ".join(f"{what}: {', '.join(cards)}" for what, cards in folded.items() if cards)
    return _columns(table, [i for i in range(len(header)) if i not in drop]), caption


def column_widths(table: Table, wrap: tuple[str, ...] = ()) -> list[int]:
    """Each column's width as printed whole: its longest cell or header, or for a column in `wrap`
    (its text wrapped) its longest word."""
    header, rows = table
    return [max(len(w) for c in (h, *(r[i] for r in rows)) for w in (c.split() if h in wrap else [c]) or [""])
            for i, h in enumerate(header)]


def ruled_width(widths: list[int]) -> int:
    """A table's width on the terminal, its columns `widths` wide: each column's padding and rule
    beside its text, and the last rule (rich's box)."""
    return sum(w + 3 for w in widths) + 1


def fold_to_width(table: Table, fit_long: pd.DataFrame, keep: set[str], width: int) -> tuple[Table, str]:
    """Card columns that a terminal of `width` characters cannot show beside the rest, each column
    whole, moved into a caption (rich squeezes every column to fit, the runs' own figures too:
    "allo" for "alloc GiB", "o" for "oom"): first those whose edge in every run is that of a card
    shown to their left ("h100-pcie as h100-80gb"), then from the right (the cards of most memory);
    the `keep` cards (the runs' own) stay."""
    header, rows = table
    if not rows or fit_long.empty:
        return table, ""
    widths = column_widths(table)
    shown = list(range(len(header)))

    def over() -> bool:
        return ruled_width([widths[i] for i in shown]) > width

    if not over():
        return table, ""
    edges = {card: dict(zip(g["run_id"], g["edge"], strict=True)) for card, g in fit_long.groupby("card", sort=False)}
    cards = [i for i, h in enumerate(header) if h in edges and h not in keep]
    alike: dict[int, str] = {}  # a card's column -> the card to its left whose edges it has
    for n, i in enumerate(cards):
        twin = next((header[j] for j in cards[:n] if edges[header[j]] == edges[header[i]]), None)
        if twin is not None:
            alike[i] = twin
    dropped = []
    for i in [*reversed(list(alike)), *reversed([i for i in cards if i not in alike])]:
        if not over():
            break
        shown.remove(i)
        dropped.append(i)
    told = [f"{header[i]} as {alike[i]}" if i in alike and alike[i] in {header[j] for j in shown} else header[i]
            for i in sorted(dropped)]
    caption = f"not shown for the terminal's width: {', '.join(told)}" if told else ""
    return _columns(table, shown), caption


def math_path_table(df: pd.DataFrame) -> Table:
    """Each run whose attention takes the math path on its card, and why (analysis.attention_path)."""
    rows = [[job_label(r), str(r["gpu"]), math_path(p, str(r["gpu"]))]
            for r in df.to_dict("records") for p in math_paths(r)]
    return ["job", "card", "why"], rows


def unmodelled_table(df: pd.DataFrame) -> Table:
    """Each run with layers a GPU runs through cuDNN, whose own memory is not modelled, and what
    that means (a row's `unmodelled`)."""
    rows = [[job_label(r), unmodelled(str(r["unmodelled"]))] for r in df.to_dict("records")
            if isinstance(r.get("unmodelled"), str) and r["unmodelled"]]
    return ["job", "not modelled"], rows


def verdict_table(judged: pd.DataFrame) -> Table:
    header = ["job", "card", "kind", "runs out in", "verdict", "what fits"]
    return header, [[str(r.job), str(r.card), str(r.kind), str(r.runs_out), str(r.verdict), str(r.detail)]
                    for r in judged.itertuples(index=False)]


def group_label(r) -> str:
    """A plan group in words: what is fixed while its axis is searched."""
    if r.axis == "batch_size":
        fixed = f"seq {int(r.seq_len)}"
    elif r.axis == "seq_len":
        fixed = f"batch {int(r.batch_size)}"
    else:  # world_size: the degree searched (rows from before plan.over: FSDP2's), the others kept
        over, kept = getattr(r, "over", None), getattr(r, "kept", None)
        spread = f"parallel.{over if isinstance(over, str) else 'dp_shard'}"
        spread += f" x {kept}" if isinstance(kept, str) and kept else ""
        fixed = f"batch {int(r.batch_size)} per GPU, seq {int(r.seq_len)}, over {spread}"
    how = getattr(r, "layout", None)
    if isinstance(how, str) and how:  # a batch or length searched over several GPUs
        fixed += f", {how} over {int(r.world_size)} GPUs"
    alloc = f", {r.allocator_conf}" if r.allocator_conf else ""
    return f"{r.model} {r.workload} {r.precision}{_ckpt_suffix(r)}, {fixed}{alloc}"


# What else tells a plan's groups apart (plan.frontier's group columns), named where groups whose
# labels are otherwise one differ by it
_GROUP_EXTRAS = (("optimizer", "optimizer"), ("optimizer_impl", "optimizer.impl"), ("leak", "leak"),
                 ("workload_args", "args"), ("traced_on", "traced on"), ("margin", "margin"))


def group_labels(fr: pd.DataFrame) -> list[str]:
    """Each row's group_label, and where rows of other groups share it, what else their groups
    differ by (an optimizer swept beside the searched axis, ...): one label a group."""
    base = [group_label(r) for r in fr.itertuples(index=False)]
    extras = [(c, name) for c, name in _GROUP_EXTRAS if c in fr.columns]
    values = {c: fr[c].astype(str).tolist() for c, _ in extras}
    by_label: dict[str, list[int]] = {}
    for i, label in enumerate(base):
        by_label.setdefault(label, []).append(i)
    out = []
    for i, label in enumerate(base):
        rows = by_label[label]
        differ = [f"{name} {values[c][i]}" for c, name in extras if len({values[c][j] for j in rows}) > 1]
        out.append(", ".join([label, *differ]))
    return out


def _ckpt_suffix(r) -> str:
    """"", " ckpt" or " ckpt=op" for a row (a frame's row, or a namedtuple of itertuples)."""
    ckpt = ckpt_word(r._asdict() if hasattr(r, "_asdict") else r)
    return {"no": "", "yes": " ckpt"}.get(ckpt, f" ckpt={ckpt}")


def frontier_table(fr: pd.DataFrame) -> Table:
    """Group x card: the largest value that fits (world_size: the fewest GPUs), and what it cost to
    find."""
    fewest = not fr.empty and (fr["axis"] == "world_size").all()
    header = ["group", "axis", "margin", "card", "fewest GPUs that fit" if fewest else "largest that fits",
              "first OOM", "peak reserved GiB", "headroom GiB", "cache flushes", "probes / grid"]
    rows, failed = [], set()
    for label, r in zip(group_labels(fr), fr.itertuples(index=False), strict=True):
        if r.status != "ok":  # one line per group: the search stopped at a probe that failed
            if label not in failed:
                failed.add(label)
                rows.append([label, r.axis, f"{r.margin:.0%}", "all", "error", "-", "-", "-", "-", "-"])
            continue
        largest = "none" if pd.isna(r.largest) else f"{int(r.largest)}"
        if not pd.isna(r.largest) and pd.isna(r.first_oom):
            edge_of_range = "<= {} (bottom of range)" if r.axis == "world_size" else ">= {} (top of range)"
            largest = edge_of_range.format(int(r.largest))
        first = "-" if pd.isna(r.first_oom) else str(int(r.first_oom))
        if not r.monotone:
            first += " (not monotone above)"
        flushes = "-" if pd.isna(r.cache_flushes) else str(int(r.cache_flushes))
        where = getattr(r, "edge", None)
        headroom = gib(r.headroom_bytes)
        if where in ("after_retry", "tight"):
            largest += f" ({EDGE_WORDS[where]})"
        if where == "after_retry":  # reserved without a limit exceeds the room: no headroom to speak of
            headroom = "none (fits on retry)"
        rows.append([label, r.axis, f"{r.margin:.0%}", r.card, largest, first, gib(r.peak_reserved_bytes),
                     headroom, flushes, f"{int(r.probes)} / {int(r.grid_points)}"])
    return header, rows


# a frontier's columns that hold one value for all of a group's cards (the search's)
_FRONTIER_SEARCH = ("group", "axis", "margin", "probes / grid")


def frontier_by_group(table: Table) -> list[tuple[str, Table]]:
    """frontier_table's rows a group at a time: the search's columns (the group, its axis, margin
    and probes) in a title, its cards' in a table of their own."""
    header, rows = table
    search = [header.index(h) for h in _FRONTIER_SEARCH]
    own = [i for i in range(len(header)) if i not in search]
    groups: dict[tuple, list[list[str]]] = {}
    for r in rows:
        groups.setdefault(tuple(r[i] for i in search), []).append(r)
    return [(f"{label}: {axis} searched, margin {margin}" + (f", {probes} probes" if probes != "-" else ""),
             ([header[i] for i in own], [[r[i] for i in own] for r in same]))
            for (label, axis, margin, probes), same in groups.items()]  # (a failed search: no probes said)


def serving_table(fr: pd.DataFrame) -> Table:
    """Serving groups: the harness's frontier beside vLLM's startup arithmetic."""
    if "vllm_largest" not in fr.columns:
        return [], []
    sv = fr[fr["vllm_largest"].notna()]
    header = ["group", "card", "KV B/token", "gpu_memory_utilization", "harness (HF generate)",
              "vLLM arithmetic", "vLLM KV GiB", "why they differ"]
    rows = []
    for label, r in zip(group_labels(sv), sv.itertuples(index=False), strict=True):
        ours = "none" if pd.isna(r.largest) else str(int(r.largest))
        rows.append([label, r.card, f"{int(r.kv_bytes_per_token):,}", f"{r.gpu_memory_utilization:.2f}",
                     ours, str(int(r.vllm_largest)), gib(max(0, r.vllm_kv_bytes)), str(r.why)])
    return header, rows


def _pct(x) -> str:
    return "-" if x is None or pd.isna(x) else f"{100 * x:+.2f}%"


def calibration_table(df: pd.DataFrame) -> Table:
    """Per point: status and peaks, predicted (sim) beside measured (cuda)."""
    header = ["point", "device", "status sim/cuda", "alloc GiB sim", "alloc GiB cuda", "alloc err",
              "reserved GiB sim", "reserved GiB cuda", "reserved err", "step s"]
    rows = [[f"{job_label(r)} on {r['gpu']}", str(r["device_name"]), f"{r['predicted_status']}/{r['measured_status']}",
             gib(r["predicted_allocated_bytes"]), gib(r["measured_allocated_bytes"]), _pct(r["allocated_error"]),
             gib(r["predicted_reserved_bytes"]), gib(r["measured_reserved_bytes"]), _pct(r["reserved_error"]),
             "-" if r["step_time_s"] is None or pd.isna(r["step_time_s"]) else f"{r['step_time_s']:.3f}"]
            for r in df.to_dict("records")]
    return header, rows
