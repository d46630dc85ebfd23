"""The card catalog (conf/gpu/*.yaml) as data: one Card per file, keyed by its file name."""

from __future__ import annotations

from omegaconf import OmegaConf

from harness.config.compose import CONF_DIR, as_dict
from harness.config.point import Card


def cards() -> list[Card]:
    """Every card of the catalog, smallest first."""
    out = [Card.from_dict({**as_dict(OmegaConf.load(path)), "key": path.stem})
           for path in (CONF_DIR / "gpu").glob("*.yaml")]
    return sorted(out, key=lambda c: c.memory_bytes)


def by_key() -> dict[str, Card]:
    return {c.key: c for c in cards()}
