"""How a point's process ended, and the process settings every point's process starts with."""

from __future__ import annotations

import signal
from pathlib import Path

# What a wait on a point's process may end in besides its exit code.
TIMED_OUT, NO_ZYGOTE, VANISHED = object(), object(), object()


def leave_job_warning() -> None:
    """In the point's process, before exec: Slurm sends its time-limit warning (SIGUSR2, submitit's
    signal) to every process of a job. It is for submitit in the job's own process, which stops the
    job and records the timeout; the point must not die of it first (its row would say `error`)."""
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)


def describe_exit(rc, log: Path) -> str:
    if rc is VANISHED:  # a forked child's status goes to the zygote, not to us
        return (f"worker died without a result, killed by a signal (the host's OOM killer sends "
                f"SIGKILL); see {log}")
    if rc < 0:
        name = signal.Signals(-rc).name
        hint = " (the host's OOM killer sends SIGKILL)" if -rc == signal.SIGKILL else ""
        return f"worker killed by {name}{hint}; see {log}"
    tail = log.read_text(errors="replace").strip().splitlines()[-1:] if log.exists() else []
    return f"worker exited with code {rc}: {tail[0] if tail else 'no output'}; see {log}"
