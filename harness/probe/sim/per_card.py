"""One trace as each card of the catalog runs it: the kernels' scratch whose bytes follow the card's
SM count sized for it (config.kernels, record.trace_store.sized_for), the rows made once per
distinct sizing (cards of one SM count and kind share them)."""

from __future__ import annotations

from harness.allocator.model import K_SMALL_SIZE, round_size
from harness.allocator.replay import ReplayRow
from harness.allocator.settings import SIZE_MAX, AllocSettings
from harness.config.point import Card
from harness.record import trace_store


class Sized:
    """A trace (its frame) and its replay rows per card."""

    def __init__(self, df, events: list | None = None) -> None:
        """`events`: the trace's events the frame was made of (trace_store.to_frame), where at hand:
        its rows are made of them rather than read back from the frame."""
        self.df, self.events = df, events
        self.codes = trace_store.kernel_codes(df)  # code -> bytes on the card traced
        self._sizes: dict[tuple, tuple[int, ...]] = {}
        self._rows: dict[tuple, list[ReplayRow]] = {}  # (sizes, each workspace's bytes or None) -> rows
        self._workspace_at: list[int] | None = None  # the frame's rows of cuBLAS workspaces
        self._framed: list[ReplayRow] | None = None  # the frame's rows, placeholders too
        self._marked: list[tuple[int, str]] | None = None  # (row of the frame's, its launch's code)
        # (code, bytes) -> (row of the frame's, it so sized) where its bytes differ: each card's
        # rows copy these (a 70B rank's ~3k scratch rows, for each of ~18 sizings, rebuilt 0.1 s)
        self._sized_as: dict[tuple[str, int], list[tuple[int, ReplayRow]]] = {}
        self._by_code: dict[str, list[int]] | None = None  # code -> its rows of the frame's
        self._windows: dict[int, tuple[int | None, tuple[int, ...]]] = {}  # row -> _window_of the frame's
        self._scratch: dict | None = None  # each scratch key's launch code (trace_store.scratch_keys)
        self._workspaces: tuple[int | None, int] | None = None

    def sizes(self, card: Card) -> tuple[int, ...]:
        """The trace's card-dependent scratch on `card`, in the order of `codes`."""
        key = (card.multiprocessors, card.compute_capability)
        if key not in self._sizes:
            self._sizes[key] = tuple(trace_store.kernel_sizes(self.codes, card).values())
        return self._sizes[key]

    def alike(self, a: Card, b: Card) -> bool:
        return self.sizes(a) == self.sizes(b)

    def rows(self, card: Card | None, workspace: int | None = None) -> list[ReplayRow]:
        """The trace's rows as `card` runs it (None: the card traced; trace_store.sized_for's, made
        from the frame's rows: a copy with the scratch rows resized and those of launches it makes
        none of dropped, not the frame sized again); each cuBLAS workspace `workspace` bytes where
        given (as trace_store.with_workspaces sets them). Kept for the next card of that sizing."""
        key = (tuple(self.codes.values()) if card is None else self.sizes(card), workspace)
        if key not in self._rows:
            self._rows[key] = self._resized(*key)
        return self._rows[key]

    def _resized(self, sizes: tuple[int, ...], workspace: int | None) -> list[ReplayRow]:
        rows = list(self._framed_rows())
        if workspace is not None:
            for i in self._workspace_rows():
                rows[i] = rows[i]._replace(size=workspace)
        gone: list[int] = []  # the rows of launches this card makes none of (a scratch key's alloc and free)
        for code, n in zip(self.codes, sizes, strict=True):
            if n == 0:
                gone += self._rows_of(code)
                continue
            for i, row in self._sized(code, n):
                rows[i] = row
        if not gone:
            return rows
        gone.sort()
        kept: list[ReplayRow] = []  # the rows between, slice by slice (a few ms where a scan took 20)
        for start, end in zip([0] + [i + 1 for i in gone], [*gone, len(rows)], strict=True):
            kept += rows[start:end]
        return kept

    def _sized(self, code: str, n: int) -> list[tuple[int, ReplayRow]]:
        """The rows of `code`'s launches whose bytes are not `n` (row of the frame's, it sized `n`)."""
        if (code, n) not in self._sized_as:
            framed = self._framed_rows()
            self._sized_as[code, n] = [(i, framed[i]._replace(size=n)) for i in self._rows_of(code)
                                       if framed[i].size != n]
        return self._sized_as[code, n]

    def _rows_of(self, code: str) -> list[int]:
        """The frame's rows of `code`'s launches (their allocs and frees)."""
        if self._by_code is None:
            self._by_code = {}
            for i, c in self._marks():
                self._by_code.setdefault(c, []).append(i)
        return self._by_code.get(code, [])

    def _framed_rows(self) -> list[ReplayRow]:
        """Every row of the frame, a launch's placeholders (0 B as traced: kernel_scratch) too."""
        if self._framed is None:
            self._framed = (trace_store.replay_rows(self.df, placeholders=True) if self.events is None
                            else trace_store.replay_rows_of(self.events))
        return self._framed

    def _workspace_rows(self) -> list[int]:
        """The frame's rows that allocate a cuBLAS workspace."""
        if self._workspace_at is None:
            self._workspace_at = trace_store.workspace_rows(self._framed_rows())
        return self._workspace_at

    def _marks(self) -> list[tuple[int, str]]:
        """Every row of a scratch key (its alloc and its free) in the frame's rows, with its code."""
        if self._marked is None:
            codes = self._scratch_keys()
            self._marked = [(i, codes[r.key]) for i, r in enumerate(self._framed_rows()) if r.key in codes]
        return self._marked

    def _scratch_keys(self) -> dict:
        if self._scratch is None:
            self._scratch = trace_store.scratch_keys(self.df)
        return self._scratch

    def workspaces(self) -> tuple[int | None, int]:
        """The trace's cuBLAS workspaces (config.cublas: the traced card's): the bytes of one (None:
        it has none) and how many it allocates (one per handle and stream). The same in every card's
        rows, which resize and drop kernel scratch only."""
        if self._workspaces is None:
            framed = self._framed_rows()
            sizes = [framed[i].size for i in self._workspace_rows()]
            self._workspaces = (sizes[0] if sizes else None), len(sizes)
        return self._workspaces

    def scratch_allocs(self, card: Card) -> frozenset[int]:
        """The rows of `rows(card)` that allocate a kernel's scratch (what Kept.watch watches)."""
        rows = self.rows(card)
        if len(rows) == len(self._framed_rows()):  # the frame's rows or a copy of them, none dropped
            return frozenset(i for i, _code in self._marks() if rows[i].action == "alloc")
        keys = self._scratch_keys()
        return frozenset(i for i, r in enumerate(rows) if r.action == "alloc" and r.key in keys)

    def alike_until(self, card: Card, than: Card, settings: AllocSettings, cached: dict[int, int]) -> int:
        """The first request before which a replay of the trace on `card` may not be in the state a
        replay of it on `than` is (`cached`: Kept.cached of that replay, its scratch allocs watched).
        Past the first row they differ where each scratch block that differs was cut from a block
        `than`'s replay had cached (big enough for both sizes) and freed before any other block of
        its pool was allocated: until then only where that block was cut differs, no decision reads
        it, and its free makes the pool as it was (a free coalesces)."""
        a, b = self.rows(card), self.rows(than)
        divisions = settings.roundup_power2_divisions
        rounded: dict[int, int] = {}  # bytes -> as rounded (a few distinct sizes, each ~1k times)

        def rnd(nbytes: int) -> int:
            if nbytes not in rounded:
                rounded[nbytes] = round_size(nbytes, divisions)
            return rounded[nbytes]

        def small(nbytes: int) -> bool:  # (draws_small's)
            return rnd(nbytes) <= K_SMALL_SIZE
        # rows alike in number differ only where the scratch is (each a copy of the traced rows)
        n = min(len(a), len(b))
        aligned = len(a) == len(b) == len(self._framed_rows())
        for i in (i for i, _code in self._marks()) if aligned else range(n):
            x, y = a[i], b[i]
            if x is y or x == y or x.action == y.action == "free" and x.key == y.key:
                continue  # (a free's bytes are not read: it frees its key's block)
            if x[:2] != y[:2] or settings.max_split_size != SIZE_MAX:
                return i  # another request (a launch dropped); or oversize rules may refuse a block
            end, allocs = self._window(i) if aligned else self._window_of(a, i)
            pool = small(x.size)
            if (end is None or small(y.size) != pool
                    or cached.get(i, 0) < max(rnd(x.size), rnd(y.size))
                    or any(pool in (small(a[j].size), small(b[j].size)) for j in allocs)):
                return i
        return n

    def _window(self, i: int) -> tuple[int | None, tuple[int, ...]]:
        """_window_of the frame's rows, kept: every card's rows of as many requests are the frame's
        but for their bytes (8 cards' checks of a 70B rank's ~1.5k scratch blocks each: 0.05 s anew)."""
        if i not in self._windows:
            self._windows[i] = self._window_of(self._framed_rows(), i)
        return self._windows[i]

    @staticmethod
    def _window_of(rows: list[ReplayRow], i: int, within: int = 64) -> tuple[int | None, tuple[int, ...]]:
        """The row that frees the block row `i` allocates, if within `within` rows (a kernel's
        scratch lives for its launch), and the allocations between."""
        key = rows[i].key
        end = next((j for j in range(i + 1, min(i + 1 + within, len(rows)))
                    if rows[j].key == key and rows[j].action == "free"), None)
        return end, tuple(j for j in range(i + 1, end or i + 1) if rows[j].action == "alloc")

    def shift(self, card: Card, than: Card | None = None) -> tuple[int, int]:
        """How much more and how much less one moment's bytes may be on `card` than on `than` (None:
        the card traced): per_card.shift."""
        base = tuple(self.codes.values()) if than is None else self.sizes(than)
        return shift(list(self.codes), self.sizes(card), base)


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

