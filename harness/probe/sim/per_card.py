"""One trace as each card of the catalog runs it: the kernels' scratch whose bytes follow the card's
SM count sized for it (config.kernels, record.trace_store.sized_for), the rows made once per
distinct sizing (cards of one SM count and kind share them)."""

from __future__ import annotations

from harness.allocator.replay import ReplayRow
from harness.allocator.settings import K_LARGE_BUFFER
from harness.config.point import Card
from harness.record import trace_store


class Sized:
    """A trace (its frame) and its replay rows per card."""

    def __init__(self, df) -> None:
        self.df = df
        self.codes = trace_store.kernel_codes(df)  # code -> bytes on the card traced
        self._sizes: dict[tuple, tuple[int, ...]] = {}
        self._rows: dict[tuple[int, ...], list[ReplayRow]] = {}
        self._marked: list[tuple[int, str]] | None = None  # (row, its launch's code) as traced
        self._workspaces: dict[tuple[int, ...], tuple[int | None, int]] = {}

    def sizes(self, card: Card) -> tuple[int, ...]:
        """The trace's card-dependent scratch on `card`, in the order of `codes`."""
        key = (card.multiprocessors, card.compute_capability)
        if key not in self._sizes:
            self._sizes[key] = tuple(trace_store.kernel_sizes(self.codes, card).values())
        return self._sizes[key]

    def alike(self, a: Card, b: Card) -> bool:
        return self.sizes(a) == self.sizes(b)

    def rows(self, card: Card) -> list[ReplayRow]:
        """The trace's rows as `card` runs it (trace_store.sized_for's, made from the traced rows:
        a copy with the scratch rows resized, not the frame sized again)."""
        sizes = self.sizes(card)
        if sizes not in self._rows:
            self._rows[sizes] = self._resized(sizes)
        return self._rows[sizes]

    def _resized(self, sizes: tuple[int, ...]) -> list[ReplayRow]:
        traced = tuple(self.codes.values())
        if traced not in self._rows:
            self._rows[traced] = trace_store.replay_rows(self.df)
        base = self._rows[traced]
        if sizes == traced:
            return base
        if self._marked is None:  # every row of a scratch key: its alloc and its free
            codes = trace_store.scratch_keys(self.df)
            self._marked = [(i, codes[r.key]) for i, r in enumerate(base) if r.key in codes]
        nbytes = dict(zip(self.codes, sizes, strict=True))
        rows = list(base)
        gone = set()
        for i, code in self._marked:
            n = nbytes[code]
            if n == 0:  # this card's launch makes none
                gone.add(rows[i].key)
            else:
                rows[i] = rows[i]._replace(size=n)
        return [r for r in rows if r.key not in gone] if gone else rows

    def workspaces(self, card: Card) -> tuple[int | None, int]:
        """The trace's cuBLAS workspaces on `card` (trace_store.workspaces: the bytes of one, how many)."""
        sizes = self.sizes(card)
        if sizes not in self._workspaces:
            self._workspaces[sizes] = trace_store.workspaces(self.rows(card))
        return self._workspaces[sizes]

    def first_change(self, card: Card, than: Card) -> int:
        """The first row at which the trace on `card` differs from it on `than` (their row count
        where none does): a replay of either is the other's up to there."""
        a, b = self.rows(card), self.rows(than)
        return next((i for i, (x, y) in enumerate(zip(a, b)) if x[:3] != y[:3]), min(len(a), len(b)))

    def shift(self, card: Card, than: Card | None = None) -> tuple[int, int]:
        """How much more and how much less one moment's bytes may be on `card` than on `than` (None:
        the card traced): per_card.shift."""
        base = tuple(self.codes.values()) if than is None else self.sizes(than)
        return shift(list(self.codes), self.sizes(card), base)

    def band(self, card: Card, than: Card, workspaces: int = 0) -> tuple[int, int]:
        return band(self.shift(card, than), workspaces)


def _launch(code: str) -> str:
    """A launch's codes (its staging buffer's and its semaphores') alike but for the part."""
    kind, _, rest = code.partition(":")
    return f"{kind}:{rest.partition(':')[2]}"


def shift(codes: list[str], theirs: tuple[int, ...], ours: tuple[int, ...]) -> tuple[int, int]:
    """(more, less): how much more and how much less any moment's bytes may be with a trace's kernel
    scratch sized `theirs` than `ours` (in the order of `codes`): one launch's scratch lives at a
    time, so no moment differs by more than one launch's."""
    by_launch: dict[str, int] = {}
    for code, a, b in zip(codes, theirs, ours, strict=True):
        by_launch[_launch(code)] = by_launch.get(_launch(code), 0) + a - b
    return max([0, *by_launch.values()]), max([0, *(-d for d in by_launch.values())])


def band(shifted: tuple[int, int], workspaces: int = 0) -> tuple[int, int]:
    """(above, below): how far a run's peaks may move where its kernels' scratch is sized otherwise
    (`shifted`: shift's (more, less)) and its cuBLAS workspaces differ by `workspaces` bytes: its
    reserved up by the more and two large segments those may place otherwise, its allocated down by
    the less."""
    more, less = shifted
    return more + workspaces + 2 * K_LARGE_BUFFER, less + workspaces
