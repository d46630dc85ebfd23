"""The card catalog (conf/gpu/*.yaml) as data, for fit tables across every card."""

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


def fits(peak_bytes: int, card: dict) -> bool:
    """Peak + the memory outside PyTorch within the card (until reserved bytes refine it)."""
    return peak_bytes + card["non_pytorch_bytes"] <= card["memory_bytes"]
