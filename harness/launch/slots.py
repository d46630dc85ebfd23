"""Waiting for one of a few flock'd files: a run slot of the zygote, the card of a cuda point.

A process that dies, however it dies, gives its slot back: the kernel drops its locks.
"""

from __future__ import annotations

import fcntl
import time
from pathlib import Path
from typing import IO


def take(paths: list[Path], poll_s: float, timeout_s: float | None = None) -> tuple[int, IO]:
    """The index of the first free slot and its open, locked file (closing it frees the slot);
    waits while all are taken, TimeoutError after `timeout_s`."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        for i, path in enumerate(paths):
            f = open(path, "w")  # noqa: SIM115 (held open by the caller: the lock lives with it)
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                f.close()
                continue
            return i, f
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"no free slot among {len(paths)} within {timeout_s} s")
        time.sleep(poll_s)
