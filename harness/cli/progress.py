"""Points done / total while a sweep runs: a thread that watches result.json files appear.

Rows travel through files, so the launching process can count them without talking to the
launcher: the same count works for local processes and (later) cluster jobs.
"""

from __future__ import annotations

import json
import sys
import threading
from collections import Counter
from pathlib import Path

from harness.record.row import RESULT_FILE

FAILED = ("error", "timeout")


class Tally:
    """Statuses of the rows under a sweep dir; each finished file is read once."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self._seen: dict[Path, str] = {}

    def __call__(self) -> Counter:
        for path in self.root.glob(f"runs/*/{RESULT_FILE}"):
            if path in self._seen:
                continue
            try:
                self._seen[path] = json.loads(path.read_text()).get("status", "error")
            except (OSError, ValueError):
                continue  # being written: next time
        return Counter(self._seen.values())


def line(counts: Counter, total: int) -> str:
    done = sum(counts.values())
    failed = sum(counts[s] for s in FAILED)
    return (f"{done}/{total} points done (ok {counts['ok']}, oom {counts['oom']}, failed {failed})")


class SweepProgress:
    """`with SweepProgress(out, total):` prints progress to stderr until the block ends: a live bar
    on a terminal, a line per change otherwise (logs, CI)."""

    def __init__(self, root: Path, total: int, stream=None, interval_s: float = 1.0):
        self.tally, self.total = Tally(root), total
        self.stream = stream or sys.stderr
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._last: str | None = None

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        return False

    def _watch(self) -> None:
        live = self.stream.isatty()
        while True:
            stopping = self._stop.wait(self.interval_s)
            text = "harness: sweep: " + line(self.tally(), self.total)
            if text != self._last:
                self.stream.write(("\r\033[K" + text) if live else text + "\n")
                self.stream.flush()
                self._last = text
            if stopping:
                if live:
                    self.stream.write("\n")
                return
