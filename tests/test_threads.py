"""The main thread's waits on points' threads: results in order, errors their own, and a signal
the kernel gave another thread handled within launch.threads.POLL_S."""

import subprocess
import sys
import textwrap
import threading
import time

import pytest

from harness.launch import threads
from tests.conftest import REPO


def test_map_threads_returns_in_order_and_raises_the_calls_own_timeout_error():
    assert threads.map_threads(lambda x: (time.sleep(0.01 * (3 - x)), x)[1], range(4), workers=4) == [0, 1, 2, 3]

    def late(_):
        raise TimeoutError("the job's own")
    with pytest.raises(TimeoutError, match="the job's own"):
        threads.map_threads(late, [1], workers=1)


# A point's thread gets SIGINT (pthread_kill: the kernel's choice, made here); the main thread waits.
_WAITER = """
import signal, sys, threading, time
from harness.cli import interrupt
from harness.launch import threads

def point(_):
    time.sleep(1)  # the main thread is waiting by now
    signal.pthread_kill(threading.get_ident(), signal.SIGINT)
    time.sleep(30)

started = time.monotonic()
try:
    with interrupt.stoppable():
        if sys.argv[1] == "map_threads":
            threads.map_threads(point, [0], workers=1)
        else:
            t = threading.Thread(target=point, args=(0,), daemon=True)
            t.start()
            threads.join(t)
except interrupt.Interrupted as e:
    print(e, round(time.monotonic() - started, 2))
    sys.stdout.flush()
    import os
    os._exit(e.exit_code)
"""


@pytest.mark.parametrize("wait", ["map_threads", "join"])
def test_a_signal_another_thread_received_stops_the_main_threads_wait(wait):
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(_WAITER), wait], cwd=REPO, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 130, r.stderr
    name, seconds = r.stdout.split()
    assert name == "SIGINT" and float(seconds) < 10  # not the point's 30 s


def test_join_returns_when_the_thread_ends():
    t = threading.Thread(target=time.sleep, args=(0.3,))
    t.start()
    threads.join(t)
    assert not t.is_alive()
