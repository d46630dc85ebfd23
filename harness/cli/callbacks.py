"""Hydra's callback at the edge of a sweep (or a run): the progress while its points run, and at
its end the aggregation into results.parquet and the report.

The CLI arms it (`arm`) with where the rows go and how many points there are; Hydra calls it in
the launching process. A sweep that Hydra stopped before its end never reaches
`on_multirun_end`: the CLI then aggregates what was written (`finish`), so nothing is lost.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback


@dataclass
class _Sweep:
    out: Path
    expected: int
    asked: list[str] | None = None  # the command's overrides, as typed (the report's plan hint)
    progress: Any = None  # a running SweepProgress
    code: int | None = None  # the aggregation's exit code, once done


_armed: _Sweep | None = None


def arm(out: Path, expected: int, asked: list[str] | None = None) -> None:
    global _armed
    _armed = _Sweep(out, expected, asked)


def finish() -> int:
    """The exit code of the armed sweep's aggregation, aggregating here if Hydra did not."""
    global _armed
    sweep, _armed = _armed, None
    if sweep is None:
        raise RuntimeError("no sweep armed")
    _stop_progress(sweep)
    if sweep.code is None:
        sweep.code = _aggregate(sweep)
    return sweep.code


def abandon() -> None:
    """An interrupted sweep: stop the progress display, aggregate nothing (the user asked to stop)."""
    global _armed
    sweep, _armed = _armed, None
    if sweep is not None:
        _stop_progress(sweep)


def _aggregate(sweep: _Sweep) -> int:
    from harness.cli.common import aggregate  # the report's libraries: not for every Hydra job process

    return aggregate(sweep.out, expected=sweep.expected, asked=sweep.asked)


def _stop_progress(sweep: _Sweep) -> None:
    if sweep.progress is not None:
        sweep.progress.__exit__(None, None, None)
        sweep.progress = None


class SweepReport(Callback):
    """hydra.callbacks.report in conf/config.yaml. Inert unless the CLI armed it."""

    def on_multirun_start(self, config, **kwargs) -> None:
        if _armed is not None:
            from harness.cli.progress import SweepProgress

            _armed.progress = SweepProgress(_armed.out, _armed.expected).__enter__()

    def on_multirun_end(self, config, **kwargs) -> None:
        self._end()

    def on_run_end(self, config, **kwargs) -> None:
        self._end()

    @staticmethod
    def _end() -> None:
        if _armed is not None and _armed.code is None:
            _stop_progress(_armed)
            _armed.code = _aggregate(_armed)
