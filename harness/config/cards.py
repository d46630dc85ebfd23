"""The card catalog (conf/gpu/*.yaml) as data: one Card per file, keyed by its file name."""

from __future__ import annotations

import functools

from omegaconf import OmegaConf

from harness.config.compose import CONF_DIR, as_dict
from harness.config.point import Card


def cards() -> list[Card]:
    """Every card of the catalog, smallest first."""
    return list(_catalog())


@functools.cache
def _catalog() -> tuple[Card, ...]:
    # Read once per process: every row's fit verdicts and every report ask for the whole catalog.
    out = [Card.from_dict({**as_dict(OmegaConf.load(path)), "key": path.stem})
           for path in (CONF_DIR / "gpu").glob("*.yaml")]
    return tuple(sorted(out, key=lambda c: c.memory_bytes))


def by_key() -> dict[str, Card]:
    return {c.key: c for c in cards()}


class CardTooLarge(ValueError):
    """A card larger than the device it would be emulated on."""


def emulation_fraction(card: Card, device_name: str, device_bytes: int) -> float | None:
    """The per-process fraction that makes this device behave like `card`, or None when the device
    is that card. The cap is on reserved bytes (set_per_process_memory_fraction), so it is the
    card's room for PyTorch: its memory less what its CUDA context and libraries take. A card
    larger than the device cannot be emulated."""
    same_card = device_name == card.device_name
    # The catalog's capacity is as a device of that card reports it, to a few MiB.
    if same_card and card.memory_bytes >= device_bytes * 0.99:
        return None
    if card.memory_bytes > device_bytes:
        raise CardTooLarge(f"gpu={card.name} ({card.memory_bytes / 2**30:.2f} GiB) is larger than this "
                           f"device, {device_name} ({device_bytes / 2**30:.2f} GiB): a card can only be "
                           "emulated on a larger one")
    return card.room() / device_bytes
