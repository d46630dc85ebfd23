"""Points run from threads; the main thread waits for them in steps of POLL_S, never without end.

Ctrl-C and SIGTERM raise in the main thread (cli.interrupt), but the kernel may hand the signal to
any thread of the process: Python's C handler then only marks it, and a main thread blocked in a
lock or select without a timeout runs the handler when that wait ends - for a sweep, when its
running point does, minutes later (CI saw a sweep ignore SIGINT for 60 s so). Waking every POLL_S,
the main thread handles such a signal within POLL_S.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TypeVar

POLL_S = 0.2  # seconds a signal may wait for the main thread to wake

T = TypeVar("T")
R = TypeVar("R")


def result(future: Future[R]) -> R:
    """future.result(), waking every POLL_S (a TimeoutError the call raised is its own)."""
    while not wait([future], timeout=POLL_S).done:
        pass
    return future.result()


def join(thread: threading.Thread) -> None:
    while thread.is_alive():
        thread.join(POLL_S)


def map_threads(fn: Callable[[T], R], items: Iterable[T], workers: int, name: str = "harness-point") -> list[R]:
    """[fn(x) for x in items], `workers` threads at once, in order. An exception (Ctrl-C's
    included) ends the wait at once: nothing more starts and nothing running is waited for (the
    process is stopping; ThreadPoolExecutor's `with` would wait for every running point)."""
    pool = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix=name)
    try:
        futures = [pool.submit(fn, x) for x in items]
        out = [result(f) for f in futures]
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown()
    return out
