"""What a row's numbers depend on beyond its knobs: the library versions, harness's own code, and
the user's code a custom job loaded (every module from outside the installed libraries).

A row or a cached trace is reused only while all of it is unchanged: an edit to a module the build
function imports must trace the job again, not serve the old model's numbers.
"""

from __future__ import annotations

import functools
import hashlib
import json
import site
import sys
import sysconfig
from importlib import metadata
from pathlib import Path

import harness

USER_CODE = "user_code"  # the row's column: {file: sha} of the user's modules the job loaded


def _sha(path: Path) -> str | None:
    try:
        return hashlib.sha1(path.read_bytes()).hexdigest()[:12]
    except OSError:
        return None


def _dist_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


@functools.cache
def versions() -> dict:
    """torch, transformers and harness as installed; harness with a hash of its sources, since an
    editable install changes its code without changing its version."""
    root = Path(harness.__file__).resolve().parent
    h = hashlib.sha1()
    for path in sorted(root.rglob("*.py")):
        h.update(path.relative_to(root).as_posix().encode())
        h.update(path.read_bytes())
    return {"torch": _dist_version("torch"), "transformers": _dist_version("transformers"),
            "harness": f"{harness.__version__}+{h.hexdigest()[:12]}"}


@functools.cache
def _library_dirs() -> tuple[str, ...]:
    dirs = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    dirs.update(site.getsitepackages())
    dirs.add(site.getusersitepackages())
    dirs.add(str(Path(harness.__file__).resolve().parent))  # harness itself: versions() covers it
    return tuple(str(Path(d).resolve()) + "/" for d in dirs if d)


def user_modules(modules=None) -> dict[str, str]:
    """{file: sha} of every loaded module whose source lives outside the libraries and harness."""
    libs = _library_dirs()
    out = {}
    for module in list((modules if modules is not None else sys.modules).values()):
        file = getattr(module, "__file__", None)
        if not file or not file.endswith(".py"):
            continue
        path = Path(file).resolve()
        if str(path).startswith(libs):
            continue
        sha = _sha(path)
        if sha is not None:
            out[str(path)] = sha
    return dict(sorted(out.items()))


def as_column(files: dict[str, str]) -> str:
    """The user_code column: JSON, so parquet holds every row's files in one string column."""
    return json.dumps(files, sort_keys=True)


def changed(recorded) -> list[str]:
    """The files of a recorded user_code (JSON or dict) that are no longer what they were."""
    if isinstance(recorded, str):
        try:
            recorded = json.loads(recorded)
        except ValueError:
            return []
    if not isinstance(recorded, dict):
        return []
    return [f for f, sha in recorded.items() if _sha(Path(f)) != sha]
