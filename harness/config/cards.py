"""The card catalog (conf/gpu/*.yaml) as data, and a card's room: what PyTorch's allocator may
reserve on it (its memory less non-PyTorch memory, and less a plan's margin)."""

from __future__ import annotations

from omegaconf import OmegaConf

from harness.config.compose import CONF_DIR, as_dict


def cards() -> list[dict]:
    """Every card of the catalog, smallest first."""
    out = []
    for path in (CONF_DIR / "gpu").glob("*.yaml"):
        card = as_dict(OmegaConf.load(path))
        card["key"] = path.stem
        out.append(card)
    return sorted(out, key=lambda c: c["memory_bytes"])


def with_margin(card: dict, margin: float) -> dict:
    """The card as the plan sees it: `margin` x its memory kept free, counted as if outside PyTorch."""
    if not margin:
        return card
    return {**card, "non_pytorch_bytes": card["non_pytorch_bytes"] + int(margin * card["memory_bytes"])}


def room(card: dict, margin: float = 0.0) -> int:
    """Bytes PyTorch's allocator may reserve on `card` with `margin` kept free."""
    c = with_margin(card, margin)
    return c["memory_bytes"] - c["non_pytorch_bytes"]


def fits(peak_bytes: int, card: dict) -> bool:
    """Peak + the memory outside PyTorch within the card (until reserved bytes refine it)."""
    return peak_bytes + card["non_pytorch_bytes"] <= card["memory_bytes"]
