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

    def less(self, card: Card) -> int:
        """How much less one moment's bytes may be on `card` than in the trace as traced: one
        launch's staging buffer and semaphores less (one launch's scratch lives at a time)."""
        return spread(tuple(min(a, b) for a, b in zip(self.sizes(card), self.codes.values(), strict=True)),
                      tuple(self.codes.values()))

    def spread(self, a: Card, b: Card) -> int:
        return spread(self.sizes(a), self.sizes(b))

def spread(theirs: tuple[int, ...], ours: tuple[int, ...]) -> int:
    """How far any moment's bytes may differ between two sizings of a trace's kernel scratch (one
    launch's buffer and semaphores live at a time): twice the largest difference of one."""
    return 2 * max([0, *(abs(a - b) for a, b in zip(theirs, ours, strict=True))])
