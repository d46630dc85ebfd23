"""The user's job named by `workload.target` ('module:function'): found, loaded, and fingerprinted."""

from __future__ import annotations

import hashlib
import importlib
import os
import sys
from pathlib import Path

from harness.errors import ConfigError


def load_target(target: str, cwd: str | None = None):
    """`pkg.module:function` -> the function (ConfigError naming workload.target if it is not one).
    Modules are found on sys.path and in `cwd` (where the user ran the harness)."""
    module_name, _, attr = (target or "").partition(":")
    if not module_name or not attr:
        raise ConfigError("workload.target", f"'{target}' is not 'module:function' (e.g. my_pkg.memjob:build)")
    cwd = cwd or os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # an ImportError, or whatever the module raises while importing
        if _a_stop(e):
            raise
        raise ConfigError("workload.target", f"cannot import {module_name}: {type(e).__name__}: {e}") from e
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError("workload.target", f"{module_name} has no function '{attr}'")
    return fn


def _a_stop(e: Exception) -> bool:
    """Whether `e` is submitit stopping the job (its time-limit signal handler raises wherever the
    job is, an import included): that is the job's end, not the module's fault."""
    try:
        from submitit.core.utils import UncompletedJobError
    except ImportError:  # no submitit: nothing can be stopping us through it
        return False
    return isinstance(e, UncompletedJobError)


def source_sha(target: str, cwd: str | None = None) -> str | None:
    """A hash of the target module's file, so that an edited job is traced again, not reused."""
    fn = load_target(target, cwd)
    path = getattr(sys.modules.get(fn.__module__), "__file__", None)
    return hashlib.sha1(Path(path).read_bytes()).hexdigest()[:12] if path else None
