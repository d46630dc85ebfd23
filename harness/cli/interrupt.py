"""Ctrl-C and SIGTERM: every process the sweep started stops, the rows already written stay, and
one line says how many there are and the command that resumes (a re-run reuses every row done).

Exit codes: 130 for SIGINT, 143 for SIGTERM (128 + the signal, as shells report it).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from pathlib import Path

from harness.errors import Interrupted
from harness.record.row import RESULT_FILE

SIGNALS = (signal.SIGINT, signal.SIGTERM)
GRACE_S = 2.0  # SIGTERM first; what still runs after this gets SIGKILL


@contextlib.contextmanager
def stoppable():
    """SIGINT and SIGTERM raise Interrupted in the main thread while inside."""
    def handler(signum, _frame):
        raise Interrupted(signum)

    previous = {s: signal.signal(s, handler) for s in SIGNALS}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def _processes() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, command line), from /proc."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            ppid = int(stat[stat.rindex(")") + 2:].split()[1])
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, ValueError):
            continue
        out[int(entry.name)] = (ppid, cmd)
    return out


def descendants(pid: int) -> list[int]:
    """Every process below `pid`, but the zygote: it is shared by every sweep and exits when idle
    (its children, the points, end with the process that asked for them)."""
    procs = _processes()
    children: dict[int, list[int]] = {}
    for p, (ppid, _cmd) in procs.items():
        children.setdefault(ppid, []).append(p)
    out, todo = [], list(children.get(pid, []))
    while todo:
        p = todo.pop()
        if "harness.launch.zygote" in procs.get(p, (0, ""))[1]:
            continue
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def _alive(pid: int) -> bool:
    try:
        done, _status = os.waitpid(pid, os.WNOHANG)  # reap our own children
        if done:
            return False
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie that is not ours to reap has stopped
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def stop_everything_started() -> list[int]:
    """SIGTERM to every descendant of this process, SIGKILL to those alive after GRACE_S; returns them."""
    pids = descendants(os.getpid())
    for p in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.05)
    for p in pids + descendants(os.getpid()):  # and any started meanwhile
        if _alive(p):
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
    return pids


def rows_written(out: Path) -> int:
    return sum(1 for _ in out.rglob(RESULT_FILE)) if out.exists() else 0


def resume_line(verb: str, args: list[str], out: Path | None, expected: int, e: Interrupted) -> str:
    """The one line an interrupted sweep leaves: what was written and how to go on (`out` None: a
    plan or calibration, whose rows lie in no one dir)."""
    command = " ".join(["python -m harness", verb, *args])
    if out is None:
        return f"harness: interrupted by {e}: the rows written so far are kept and reused; resume with `{command}`"
    again = (f"resume with `{command}` (rows done are reused)" if verb == "sweep"
             else f"run it again with `{command}`")
    return (f"harness: interrupted by {signal.Signals(e.signum).name}: {rows_written(out)} of {expected} point(s) "
            f"have a row in {out}; {again}, or report them with `python -m harness report {out}`")


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
