"""Does a run fit a card, with a margin; and the config x card table (fits / OOM, headroom)."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pandas as pd

from harness.allocator.model import Device
from harness.allocator.replay import ReplayRow, Replays
from harness.allocator.settings import AllocSettings
from harness.config import attention, cublas, nccl
from harness.config import cards as catalog
from harness.config.attention import ATTENTION_CALLS
from harness.config.point import Card
from harness.probe.sim import reserved
from harness.probe.sim.per_card import Sized
from harness.record import trace_store
from harness.record.row import WORKSPACE, cards_reserved, listed, recorded_edge


def _missing(v) -> bool:
    return v is None or (isinstance(v, float) and pd.isna(v))


def _peaks(row: dict) -> tuple[int, int] | None:
    """(reserved, allocated) without a limit; reserved is allocated where unknown."""
    alloc = row.get("peak_allocated_bytes")
    if _missing(alloc):
        return None
    res = row.get("peak_reserved_bytes")
    return int(alloc if _missing(res) else res), int(alloc)


def _fits_on(row: dict, c: Card) -> bool:
    """Whether the run fits `c` (the card as the job's GPU sees it, its margin off): by the peaks of
    the run as `c` runs it where they settle it, else by a replay of that run on `c`."""
    # the card's cuBLAS workspaces where the trace has any (config.cublas)
    own = None if _missing(row.get(WORKSPACE)) else cublas.workspace_bytes(c.capability)
    res, alloc = _peaks(row)
    mine = cards_reserved(row).get(c.key)  # its reserved peak, where its run differs and a replay found it
    if not attention.takes_alike(c.capability, row.get(ATTENTION_CALLS)):
        # a card of other attention kernels: its own trace, where one was taken (none: an OOM)
        apart = card_trace(row, c)
        if apart is None:
            return False
        return (mine is not None and mine <= c.room()) or _fits_by_trace({**row, "trace_path": apart}, c, own)
    if (own is not None and own != int(row[WORKSPACE])) or _sizing(row, c) is not None:
        # another workspace or kernels' scratch of other sizes: the trace replayed with theirs, unless
        # its own reserved peak fits (a bound on that peak from the traced one is not sound)
        if mine is not None and mine <= c.room():
            return True
        return not _missing(row.get("trace_path")) and _fits_by_trace(row, c, own)
    # (a card that took a replay of its own has its own peak: under expandable segments one of more
    # memory than the traced card's, whose replay its address ranges overflowed)
    known = reserved.fits_by_numbers(c, res if mine is None else mine, alloc)
    if known is not None:
        return known
    if _missing(row.get("trace_path")):
        return False  # the peaks say it does not fit without a cache flush; no trace to check that
    return _fits_by_trace(row, c)


def card_trace(row: dict, card: Card) -> str | None:
    """The trace of the row's run as `card` runs it: the row's own, or for a card of other
    attention kernels the one the worker took or rewrote for it (probe.worker); None where there is
    none (the worker found that card an OOM by the traced peaks) or the row has no trace."""
    if _missing(row.get("trace_path")):
        return None
    if attention.takes_alike(card.capability, row.get(ATTENTION_CALLS)):
        return str(row["trace_path"])
    apart = trace_store.apart_path(Path(row["trace_path"]), card.key)
    return str(apart) if apart.is_file() else None


def reserved_on(row: dict, card: Card) -> int | None:
    """The run's reserved peak without a limit as `card` runs it: its own where the row recorded one
    (record.row.CARD_RESERVED), else the row's (allocated where reserved is unknown)."""
    peaks = _peaks(row)
    return None if peaks is None else cards_reserved(row).get(card.key, peaks[0])


@functools.lru_cache(maxsize=256)
def _codes(path: str) -> dict[str, int]:
    """A trace's kernel scratch whose bytes follow the card (trace_store.kernel_codes)."""
    try:
        return trace_store.kernel_codes(pd.read_parquet(path, columns=["kernel", "size"]))
    except (OSError, ValueError, KeyError):  # no trace, or one from before the column: none
        return {}


def _sizes(row: dict, c: Card) -> tuple[dict[str, int], dict[str, int]]:
    """The trace's kernel scratch whose bytes follow the card (config.kernels): as traced, and on `c`."""
    codes = {} if _missing(row.get("trace_path")) else _codes(str(row["trace_path"]))
    return codes, trace_store.kernel_sizes(codes, c)


def _sizing(row: dict, c: Card) -> tuple[int, str] | None:
    """What sizes the trace's kernel scratch for `c` (its SM count and capability); None where the
    trace's own sizes are the card's."""
    codes, sizes = _sizes(row, c)
    return None if sizes == codes else (c.multiprocessors, c.compute_capability)


def on_rank(row: dict, card: Card, margin: float = 0.0) -> Card:
    """`card` as the row's GPU sees it with `margin` kept free: NCCL's memory, where the job spans
    several GPUs, outside PyTorch too."""
    return nccl.on_rows_rank(card, row).with_margin(margin)


def fits(row: dict, card: Card, margin: float = 0.0) -> bool | None:
    """Whether the run of `row` fits `card` with `margin` kept free: the allocator model's verdict
    (a replay of the run's trace on the card where the peaks alone do not settle it); None when
    the row has no numbers (an error)."""
    recorded = listed(row, "fits_cards")
    if not margin and recorded is not None:
        return card.key in recorded
    if _peaks(row) is None:
        return None
    return _fits_on(row, on_rank(row, card, margin))


def edge(row: dict, card: Card, margin: float = 0.0) -> str | None:
    """room | after_retry | tight | oom (probe.sim.reserved.EDGES) for the run on `card` with
    `margin` kept free; None when the row has no numbers."""
    fitting = fits(row, card, margin)
    if fitting is None:
        return None
    if not fitting:
        return "oom"
    recorded = recorded_edge(row, card.key) if not margin else None
    if recorded is not None:
        return recorded
    return reserved.edge(lambda c: _fits_on(row, c), reserved_on(row, card), on_rank(row, card, margin))


@functools.lru_cache(maxsize=4)
def _sized(path: str) -> Sized:
    """A run's trace, read once for all the cards a probe is checked against: its rows made once per
    sizing of its kernels' scratch (a plan's table asks for each row's trace card after card)."""
    return Sized(pd.read_parquet(path))


def _trace_rows(path: str, workspace: int | None = None, sizing: tuple[int, str] | None = None) -> list[ReplayRow]:
    """A run's trace as replay rows (each cuBLAS workspace `workspace` bytes, and its kernels'
    scratch sized for a card of `sizing`, where given)."""
    card = None if sizing is None else Card(multiprocessors=sizing[0], compute_capability=sizing[1])
    return _sized(path).rows(card, workspace)


def _replay(row: dict, card: Card, workspace: int | None = None):
    """The run's replay on a card (Device.for_card: its room and size): a plan asks for it when it
    searches, when it finds the edge and when it counts cache flushes (~0.3 s each for a 7B
    trace), and a card of another room often replays alike (Replays)."""
    return _replays(_one_name(str(row["trace_path"])), row.get("allocator_conf") or "", workspace,
                    _sizing(row, card)).on(Device.for_card(card))


_NAMES: dict[tuple[int, int, int], str] = {}


def _one_name(path: str) -> str:
    """One name for a trace file however many names link to it: the worker links one trace of
    another card's attention kernels for each card of its group, whose replays are then shared."""
    st = os.stat(path)
    return _NAMES.setdefault((st.st_dev, st.st_ino, st.st_mtime_ns), path)


@functools.lru_cache(maxsize=256)
def _replays(path: str, conf: str, workspace: int | None = None, sizing: tuple[int, str] | None = None) -> Replays:
    # its results kept for every run a plan probes; the rows made again where _sized let the trace go
    return Replays(lambda: _trace_rows(path, workspace, sizing), AllocSettings.from_conf(conf))


def _fits_by_trace(row: dict, card: Card, workspace: int | None = None) -> bool:
    return not _replay(row, card, workspace).ooms


def cache_flushes(row: dict, card: Card, margin: float = 0.0) -> int | None:
    """How often the run's allocator must free its cache and retry on `card` (num_alloc_retries;
    each a device synchronization): 0 when its reserved peak fits; None when unknown."""
    res = None if _missing(row.get("peak_reserved_bytes")) else reserved_on(row, card)
    if res is None:
        return None
    rank = on_rank(row, card, margin)
    if res <= rank.room():
        return 0
    if _missing(row.get("trace_path")):
        return None
    return _replay(row, rank).num_alloc_retries


def headroom_bytes(row: dict, card: Card, margin: float = 0.0) -> int | None:
    """Room left on `card` at the run's peak reserved bytes as the card runs it (reserved_on)."""
    peak = reserved_on(row, card)
    return None if peak is None else on_rank(row, card, margin).room() - peak


def fit_table(df: pd.DataFrame, margin: float = 0.0) -> pd.DataFrame:
    """One row per (run, card): fits, its edge (room, after_retry, tight, oom), headroom in bytes
    and as a share of the card's memory."""
    cards = catalog.cards()
    out = []
    for row in df.to_dict("records"):
        for card in cards:
            head = headroom_bytes(row, card, margin)
            where = edge(row, card, margin)
            out.append({
                "run_id": row["run_id"], "card": card.key, "card_memory_bytes": card.memory_bytes,
                "fits": None if where is None else where != "oom", "edge": where, "headroom_bytes": head,
                "headroom_pct": None if head is None else 100.0 * head / card.memory_bytes,
                "margin": margin,
            })
    return pd.DataFrame(out)
