"""The card catalog (conf/gpu/*.yaml) as data: one Card per file, keyed by its file name."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
from pathlib import Path

from omegaconf import OmegaConf

from harness.config import alloc_conf
from harness.config.compose import CONF_DIR, as_dict
from harness.config.point import Card


def cards() -> list[Card]:
    """Every card of the catalog, smallest first."""
    return list(_catalog())


# What `python -m harness calibrate` measured on this user's cards: {card key: {memory_bytes,
# non_pytorch_bytes, non_pytorch_spread_bytes, non_pytorch_source}}. Measured beats estimated.
MEASURED_ENV = "HARNESS_MEASURED_CARDS"


def measured_path() -> Path:
    default = Path(os.environ.get("XDG_CONFIG_HOME", Path.home() / ".config")) / "harness" / "measured-cards.json"
    return Path(os.environ.get(MEASURED_ENV, default))


def _measured_key() -> tuple:
    """Which measurements a process would read now: the file, and its version on disk (a process
    that outlives a calibrate, such as the node's zygote, reads the new figures)."""
    path = measured_path()
    try:
        st = path.stat()
    except OSError:
        return (str(path), None)
    return (str(path), st.st_mtime_ns, st.st_size)


def _measured() -> dict[str, dict]:
    return _measured_as(_measured_key())


@functools.lru_cache(maxsize=4)
def _measured_as(key: tuple) -> dict[str, dict]:
    try:
        return json.loads(Path(key[0]).read_text())
    except (OSError, ValueError):
        return {}


def _catalog() -> tuple[Card, ...]:
    return _catalog_as(_measured_key())


@functools.lru_cache(maxsize=4)
def _catalog_as(key: tuple) -> tuple[Card, ...]:
    # Read once per version of the measurements: every row's fit verdicts and every report ask for
    # the whole catalog.
    measured = _measured_as(key)
    out = []
    for path in (CONF_DIR / "gpu").glob("*.yaml"):
        card = Card.from_dict({**as_dict(OmegaConf.load(path)), "key": path.stem})
        if path.stem in measured:
            card = with_measured(card, measured[path.stem])
        out.append(card)
    return tuple(sorted(out, key=lambda c: c.memory_bytes))


def digest() -> str:
    """A fingerprint of the catalog's figures as this process reads them (calibrate's measurements
    included): a row's fit verdicts hold for the catalog they were judged against."""
    figures = [{k: v for k, v in dataclasses.asdict(c).items() if k != "slurm"} for c in _catalog()]
    return hashlib.sha1(json.dumps(figures, sort_keys=True, default=str).encode()).hexdigest()[:12]


def with_measured(card: Card, m: dict) -> Card:
    """The card with what calibrate measured on it: the capacity exactly, non-PyTorch memory as seen."""
    return dataclasses.replace(card, memory_bytes=int(m["memory_bytes"]), memory_spread_bytes=0,
                               non_pytorch_bytes=int(m["non_pytorch_bytes"]),
                               non_pytorch_spread_bytes=int(m["non_pytorch_spread_bytes"]),
                               non_pytorch_source=str(m["non_pytorch_source"]))


def as_measured(card: Card) -> Card:
    """A point's card (composed from its YAML) with the measured figures where calibrate has them."""
    key = next((c.key for c in _catalog() if c.name == card.name and c.device_name == card.device_name), None)
    measured = _measured().get(key) if key else None
    return with_measured(card, measured) if measured else card


MEASURED_PREFIX = "measured by calibrate"


def record_measured(rows: list[dict], keys: dict[str, str]) -> dict[str, dict]:
    """From calibrate's cuda rows on cards that are the device itself (not emulated), each card's
    measured capacity and non-PyTorch memory (the largest seen; spread: the range seen, at least
    16 MiB), merged into measured_path(); returns what was recorded."""
    seen: dict[str, list[dict]] = {}
    for r in rows:
        key = keys.get(str(r.get("gpu")))
        if key and r.get("status") == "ok" and r.get("emulated_gpu") is False \
                and r.get("measured_non_pytorch_bytes") is not None and r.get("device_memory_bytes"):
            seen.setdefault(key, []).append(r)
    if not seen:
        return {}
    out = dict(_measured())
    for key, rs in seen.items():
        np_bytes = [int(r["measured_non_pytorch_bytes"]) for r in rs]
        out[key] = {"memory_bytes": int(rs[0]["device_memory_bytes"]), "non_pytorch_bytes": max(np_bytes),
                    "non_pytorch_spread_bytes": max(16 * 2**20, max(np_bytes) - min(np_bytes)),
                    "non_pytorch_source": f"{MEASURED_PREFIX} on {rs[0].get('device_name')}, {len(rs)} run(s), "
                                          f"torch {rs[0].get('torch_version')}"}
    path = measured_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1, sort_keys=True))
    return {k: out[k] for k in seen}


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


def emulation_changes(card: Card, conf: str, device_name: str, fraction: float | None) -> str | None:
    """Why emulating `card` under the per-process `fraction` (emulation_fraction's; None: the device
    is the card) would run the allocator of `conf` otherwise than the card itself (None: it would
    not). garbage_collection_threshold acts only where a fraction is set (CUDACachingAllocator's
    malloc: set_fraction), so on the emulated card it would reclaim cached blocks a real one keeps."""
    if fraction is None or not alloc_conf.parse(conf).get("garbage_collection_threshold"):
        return None
    return (f"garbage_collection_threshold acts only under a per-process memory fraction, and emulating the "
            f"{card.name} on this {device_name} sets one: the run would reclaim cached blocks where a real "
            f"{card.name} keeps them (run it on a {card.name}, or without the threshold)")
