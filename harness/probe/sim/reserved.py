"""From a trace to reserved bytes: the allocator model replayed under the run's settings, on an
unlimited device (what the job reserves) and on each card (whether it fits, and the OOM if not)."""

from __future__ import annotations

from collections.abc import Callable, Collection
from pathlib import Path

from harness.allocator import oom_message
from harness.allocator import snapshot as snap
from harness.allocator.model import Device
from harness.allocator.replay import Checkpoint, Kept, ReplayResult, ReplayRow, Replays, replay_events
from harness.allocator.settings import AllocSettings
from harness.config.point import Card


def fits_by_numbers(card: Card, peak_reserved_bytes: int, peak_allocated_bytes: int) -> bool | None:
    """True/False where the unlimited replay's peaks settle whether the job fits `card`; None where
    only a replay on the card can tell (the release-and-retry ladder might still save it)."""
    room = card.room()
    if peak_reserved_bytes <= room:
        return True
    if peak_allocated_bytes > room:
        return False
    return None


def replay_on(rows: list[ReplayRow], settings: AllocSettings, card: Card):
    """The replay on `card`: its OOMs and the cache flushes (num_alloc_retries) it took."""
    return replay_events(rows, settings, Device.for_card(card))[0]


def fits(replays: Replays, card: Card, unlimited) -> bool:
    """Whether the job runs on `card` without an OOM (`replays`: the trace's, under the run's
    settings; `unlimited`: its replay without a limit)."""
    known = fits_by_numbers(card, unlimited.peak_reserved_bytes, unlimited.peak_allocated_bytes)
    return known if known is not None else not replays.on(Device.for_card(card)).ooms


# The edge of a card, from the safest: fits with room to spare; fits, but only because the
# allocator frees its cache and retries (num_alloc_retries: a device sync each); fits as the card
# is estimated but not at the low end of what it may be (its capacity's spread, its non-PyTorch
# memory's); does not fit.
EDGES = ("room", "after_retry", "tight", "oom")


def edge(fits_on, reserved_bytes: int, card: Card) -> str:
    """The edge of `card` for a run: `fits_on(card) -> bool` answers for a card, `reserved_bytes`
    is what the run reserves without a limit."""
    if not fits_on(card):
        return "oom"
    worst = card.at_worst()
    if not fits_on(worst):
        return "tight"
    return "after_retry" if reserved_bytes > worst.room() else "room"


def edge_columns(edges: dict[str, str]) -> dict:
    """The record's fits_cards, tight_cards and retry_cards from each card's edge."""
    return {"fits_cards": [k for k, e in edges.items() if e != "oom"],
            "tight_cards": [k for k, e in edges.items() if e == "tight"],
            "retry_cards": [k for k, e in edges.items() if e == "after_retry"]}


def unlimited_replay(rows: list[ReplayRow], settings: AllocSettings, total: int, catalog: list[Card],
                     peak_tensor_bytes: int, kept: Kept | None = None,
                     lean: bool = False) -> tuple[Replays, ReplayResult]:
    """The trace's replays and its replay without a limit on a device of `total` bytes (what
    expandable segments' address ranges are sized by). A card between the run's allocated and
    reserved peaks takes a lean replay of its own, which goes on from where this one first asked for
    more than the card holds (alike until then; into `kept`, where given); a card under the
    storages' peak needs none. `lean`: the replay without a limit keeps its reserved peak only
    (its allocated peak reads 0: each card over its reserved peak takes a replay)."""
    replays = Replays(rows, settings, kept)
    rooms = [c.room() for k in catalog for c in (k, k.at_worst())]
    return replays, replays.run_unlimited(Device(total=total), [r for r in rooms if r >= peak_tensor_bytes], lean)


def edges_by_replays(replays: Replays, unlimited: ReplayResult, catalog: list[Card]) -> dict[str, str]:
    """Each card's edge (EDGES) from the trace's replay without a limit and its lean replays."""
    return {c.key: edge(lambda card: fits(replays, card, unlimited), unlimited.peak_reserved_bytes, c)
            for c in catalog}


def catalog_edges(rows: list[ReplayRow], settings: AllocSettings, catalog: list[Card],
                  peak_tensor_bytes: int = 0) -> dict[str, str]:
    """Each card's edge (EDGES) for a trace: its replay without a limit, and a lean one on each
    card that its peaks leave undecided (`peak_tensor_bytes`: the trace's storages' peak)."""
    replays, unlimited = unlimited_replay(rows, settings, max(c.memory_bytes for c in catalog), catalog, peak_tensor_bytes)
    return edges_by_replays(replays, unlimited, catalog)


def analyse(rows: list[ReplayRow], settings: AllocSettings, card: Card, catalog: list[Card],
            torch_version: str, snapshot_path: Path | None = None, peak_tensor_bytes: int = 0,
            kept: Kept | None = None,
            elsewhere: Callable[[int, int], Collection[str]] | None = None) -> dict:
    """Record fields for the run's card and the whole catalog (`peak_tensor_bytes`: the trace's
    storages' peak, which the allocated peak is at least); into `kept`, where given, what its
    unlimited replay kept on the way to each card's room (lean_edges goes on from its checkpoints).
    `elsewhere(peak reserved, peak allocated)`: the keys of catalog cards the caller judges itself
    (left out of the edge columns)."""
    # Unlimited memory, but the card's size for what depends on it (expandable address ranges).
    replays, unlimited = unlimited_replay(rows, settings, card.memory_bytes, catalog, peak_tensor_bytes, kept)
    on_the_card = Device.for_card(card)
    trace: list[dict] = []

    def on_event(action, addr, size, stream, tag):
        frames = [{"name": f"{tag[2] or '<root>'} ({tag[0]}, step {tag[1]})", "filename": tag[3], "line": 0}] if tag else []
        trace.append({"action": action, "addr": addr, "size": size, "stream": stream,
                      "time_us": len(trace), "frames": frames})

    if snapshot_path is None and fits_by_numbers(card, unlimited.peak_reserved_bytes, unlimited.peak_allocated_bytes):
        # Reserved never reaches the card's room: a replay on the card makes the same decisions
        on_card = unlimited
    else:
        on_card, alloc = replay_events(rows, settings, on_the_card, on_event if snapshot_path else None)
        replays.add(on_the_card, on_card)
    out: dict = {
        # The whole run (what decides an OOM) and its steady state from step 2 on, one window
        # each for all three. Block sizes, as max_memory_allocated counts them (unsplit remainders
        # included); requested bytes, as the trace asked.
        "peak_allocated_bytes": unlimited.peak_allocated_bytes,
        "peak_requested_bytes": unlimited.peak_requested_bytes,
        "peak_reserved_bytes": unlimited.peak_reserved_bytes,
        "steady_peak_allocated_bytes": unlimited.steady_peak_allocated_bytes,
        "steady_peak_requested_bytes": unlimited.steady_peak_requested_bytes,
        "steady_peak_reserved_bytes": unlimited.steady_peak_reserved_bytes,
        "peak_inactive_split_bytes": unlimited.peak_inactive_split_bytes,
        "fragmentation_bytes": unlimited.fragmentation_at_peak_bytes,
        "num_alloc_retries": on_card.num_alloc_retries,
        "num_ooms": len(on_card.ooms),
    }
    if elsewhere is not None:
        leave = elsewhere(unlimited.peak_reserved_bytes, unlimited.peak_allocated_bytes)
        catalog = [c for c in catalog if c.key not in leave]
    out.update(edge_columns(edges_by_replays(replays, unlimited, catalog)))
    if on_card.ooms:
        oom = on_card.ooms[0]
        phase, step, module, _kind = oom["where"]
        out.update(status="oom", oom_phase=phase, oom_step=int(step), oom_module=module,
                   oom_tried_bytes=oom["tried_bytes"], oom_message=oom_message.for_row(oom, torch_version))
    if snapshot_path is not None:
        snap.write(snapshot_path, alloc, trace)
        out["snapshot_path"] = str(snapshot_path)
    return out


def lean_edges(rows: list[ReplayRow], settings: AllocSettings, cards: list[Card], checkpoints: list[Checkpoint],
               reserved_at_most: int, allocated_at_least: int) -> dict[str, str]:
    """Each card's edge (EDGES) for a trace whose peaks are known only within bounds (another
    card's trace, its kernels' scratch sized otherwise): settled by the bounds where they can, else
    by lean replays on the card and at its low end, going on from `checkpoints` (states of a replay
    of rows alike up to there). After a cache flush at the low end: after_retry."""
    replays = Replays(rows, settings, Kept(checkpoints=list(checkpoints)))

    def fits(card: Card) -> bool:
        known = fits_by_numbers(card, reserved_at_most, allocated_at_least)
        return known if known is not None else not replays.on(Device.for_card(card)).ooms

    out = {}
    for c in cards:
        e = edge(fits, reserved_at_most, c)
        # the bound says its reserved may pass the low end's room: whether it does, the replay there says
        if e == "after_retry" and not replays.on(Device.for_card(c.at_worst())).num_alloc_retries:
            e = "room"
        out[c.key] = e
    return out
