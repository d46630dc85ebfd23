"""What a row's numbers depend on beyond its knobs: the library versions, harness's own code, and
the user's code a custom job loaded (every module from outside the installed libraries) and the
files it read (a model's YAML or JSON that its build function opens).

A row or a cached trace is reused only while all of it is unchanged: an edit to a module the build
function imports, or to a file it reads, must trace the job again, not serve the old model's numbers.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import site
import sys
import sysconfig
from importlib import metadata
from pathlib import Path

import harness

USER_CODE = "user_code"  # the row's column: {file: fingerprint} of the modules the user's job loaded and the files it read


# A file larger than this is known by its size and modification time, not hashed: a dataset read
# by a job would cost its size in reading at every staleness check of every row.
HASHED_AT_MOST_BYTES = 64 * 2**20


def _sha(path: Path) -> str | None:
    """The file's fingerprint: a hash of its bytes, or its size and mtime where it is large."""
    try:
        st = path.stat()
    except OSError:
        return None
    if st.st_size > HASHED_AT_MOST_BYTES:
        return f"{st.st_size}b@{st.st_mtime_ns}"
    return _hashed(str(path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=4096)
def _hashed(path: str, _size: int, _mtime_ns: int) -> str | None:
    """(keyed by size and mtime too: each row's check of the same unchanged file hashes it once)"""
    try:
        return hashlib.sha1(Path(path).read_bytes()).hexdigest()[:12]
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
    files = [getattr(m, "__file__", None) for m in list((modules if modules is not None else sys.modules).values())]
    return _fingerprinted([f for f in files if f and f.endswith(".py")], _library_dirs())


def _fingerprinted(files, skip: tuple[str, ...]) -> dict[str, str]:
    """{file: fingerprint} of `files` as resolved, but those under the folders `skip` or gone."""
    out = {}
    for file in files:
        path = Path(file).resolve()
        if str(path).startswith(skip):
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


# While a custom job runs (`reading`): the files opened for reading, as absolute paths. An audit hook
# (PEP 578) sees every open, builtins' and os's alike; it cannot be removed, so it records only inside.
_reads: set[str] | None = None
_hooked = False


def _on_audit(event: str, args: tuple) -> None:
    if event != "open" or _reads is None:
        return
    path, _mode, flags = args
    if isinstance(path, int) or (flags or 0) & (os.O_WRONLY | os.O_RDWR):
        return  # a file descriptor; a file opened for writing (the job's own output)
    try:
        _reads.add(os.path.abspath(os.fsdecode(path)))
    except (TypeError, ValueError):
        pass


@contextlib.contextmanager
def reading():
    """The set of files opened for reading inside the block (filled as they are)."""
    global _reads, _hooked
    if not _hooked:
        sys.addaudithook(_on_audit)
        _hooked = True
    outer, _reads = _reads, set()
    try:
        yield _reads
    finally:
        mine, _reads = _reads, outer
        if outer is not None:
            outer.update(mine)


# What a process reads beyond the job's data: the system's files, pseudo-files, caches of its own.
_SYSTEM_DIRS = ("/proc/", "/sys/", "/dev/", "/etc/", "/usr/", "/lib/", "/lib64/", "/bin/", "/sbin/", "/run/", "/var/")


def user_code(read=()) -> str:
    """The user_code column of a custom job: the modules it loaded and the files it `read`."""
    return as_column({**user_modules(), **user_files(read)})


def user_files(paths) -> dict[str, str]:
    """{file: fingerprint} of the regular files among `paths` that are the user's: outside the
    libraries, harness and the system; modules left to user_modules."""
    skip = _library_dirs() + tuple(str(Path(d).resolve()) + "/" for d in {sys.prefix, sys.base_prefix}) + _SYSTEM_DIRS
    return _fingerprinted([p for p in paths if Path(p).suffix not in (".py", ".pyc") and Path(p).is_file()], skip)
