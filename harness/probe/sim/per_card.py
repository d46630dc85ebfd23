"""One trace as each card of the catalog runs it: the kernels' scratch whose bytes follow the card's
SM count sized for it (config.kernels, record.trace_store.sized_for), the rows made once per
distinct sizing (cards of one SM count and kind share them)."""

from __future__ import annotations

from harness.allocator.replay import ReplayRow
from harness.config.point import Card
from harness.record import trace_store


class Sized:
    """A trace (its frame) and its replay rows per card."""

    def __init__(self, df) -> None:
        self.df = df
        self.codes = trace_store.kernel_codes(df)  # code -> bytes on the card traced
        self._sizes: dict[tuple, tuple[int, ...]] = {}
        self._rows: dict[tuple[int, ...], list[ReplayRow]] = {}

    def sizes(self, card: Card) -> tuple[int, ...]:
        """The trace's card-dependent scratch on `card`, in the order of `codes`."""
        key = (card.multiprocessors, card.compute_capability)
        if key not in self._sizes:
            self._sizes[key] = tuple(trace_store.kernel_sizes(self.codes, card).values())
        return self._sizes[key]

    def alike(self, a: Card, b: Card) -> bool:
        return self.sizes(a) == self.sizes(b)

    def rows(self, card: Card) -> list[ReplayRow]:
        sizes = self.sizes(card)
        if sizes not in self._rows:
            self._rows[sizes] = trace_store.replay_rows(trace_store.sized_for(self.df, card))
        return self._rows[sizes]

    def band(self, card: Card, than: Card | None = None, larger: bool = True) -> int:
        """How much more (`larger`) or less the scratch of one launch takes on `card` than on `than`
        (None: the card traced): its staging buffer's difference and its semaphores' (one launch's
        scratch lives at a time, so no moment's bytes differ by more)."""
        base = tuple(self.codes.values()) if than is None else self.sizes(than)
        diffs = [(a - b) if larger else (b - a) for a, b in zip(self.sizes(card), base, strict=True)]
        return 2 * max([0, *diffs])
