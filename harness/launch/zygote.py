"""A pre-imported parent that forks one child per point.

Starting Python and importing torch + transformers costs about 4-6 s per point; a sweep's points
fork from one process that did it once instead. Each point still runs in a process of its own
(allocator settings, crashes and the host's OOM killer stay per point). Before serving, the zygote
traces one layer of the preset asked for on fake tensors (torch's lazy imports and FakeTensor's
dispatch cache, about 1 s a point would pay) - no kernel runs, so no thread pool starts that a
fork would break - and freezes what it holds out of the cyclic GC's sight (each child's
collections then walk only what its point made). It exits after `IDLE_S` without requests, and is
keyed by the code it loaded, so an edit to harness starts a fresh one.

Protocol on a Unix socket: the client sends the run dir and its environment (a JSON line: the
point runs in the client's environment, not in the one of whichever client started the zygote);
the forked child answers "pid N", runs the point (stdout and stderr to worker.log) and answers
"rc N" when done. A rank of a job run here over CPU processes (launch.ranks) is asked for with
RANK_REQUEST in its environment: it takes no run slot (its peers wait for it in their collectives)
and as many threads as its OMP_NUM_THREADS (the host's cores shared among the job's ranks).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import select
import signal
import socket
import socketserver
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness.launch import slots
from harness.launch.exits import VANISHED

IDLE_S = 90
START_TIMEOUT_S = 60


def _code_key() -> str:
    """This interpreter and the code it would load (provenance.versions: torch, transformers and
    harness's sources), where harness lies and its configuration (conf/: the card catalog, the
    models): another install, another clone or an edit to either gets a zygote of its own (a zygote
    reads the catalog once; one of another clone's served this one's points with its cards)."""
    import harness
    from harness.record.provenance import versions

    root = Path(harness.__file__).resolve().parent
    h = hashlib.sha1(f"{sys.executable}:{root}:{sorted(versions().items())}".encode())
    for path in sorted((root / "conf").rglob("*.yaml")):
        h.update(path.relative_to(root).as_posix().encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:12]


def socket_path() -> Path:
    return Path(tempfile.gettempdir()) / f"harness-zygote-{os.getuid()}-{_code_key()}.sock"


RANK_REQUEST = "HARNESS_ZYGOTE_RANK"  # in a request's environment: one rank of a job of several


def enabled() -> bool:
    """Whether points fork from a zygote (HARNESS_ZYGOTE=0: a fresh interpreter each)."""
    return os.environ.get("HARNESS_ZYGOTE", "1") != "0"


def request(run_dir: Path, env: dict | None = None) -> bytes:
    """What a client sends for a point: its run dir, and the environment it runs in (`env`, else
    this process's)."""
    return f"{run_dir}\n{json.dumps(dict(os.environ) if env is None else env)}\n".encode()


def fork(run_dir: Path, env: dict | None = None) -> Forked | None:
    """The point in run_dir forked from the zygote (starting one if needed), in `env` (else this
    process's environment); None where no zygote can be had."""
    conn = connect()
    if conn is None:
        return None
    try:
        conn.sendall(request(run_dir, env))
    except OSError:
        conn.close()
        return None
    return Forked(conn)


class Forked:
    """A point forked from the zygote, waited on as subprocess.Popen's are: `poll`, `wait`, `kill`.
    Its exit code is the one its answer says; VANISHED where it ended without one (killed: its
    status goes to the zygote, its parent, not to us). Closing it ends the point (_die_with_client)."""

    def __init__(self, conn: socket.socket):
        self.conn = conn
        self.pid: int | None = None
        self.returncode: int | object | None = None  # (VANISHED: an object)
        self._said = b""

    def _hear(self, timeout: float | None) -> None:
        """What the child said within `timeout` seconds (None: until it says something)."""
        if self.returncode is not None or not select.select([self.conn], [], [], timeout)[0]:
            return
        try:
            data = self.conn.recv(4096)
        except OSError:
            data = b""
        self._said += data
        while b"\n" in self._said:
            line, self._said = self._said.split(b"\n", 1)
            word, _, value = line.decode().partition(" ")
            if word == "pid":
                self.pid = int(value)
            elif word == "rc":
                self.returncode = int(value)
        if not data and self.returncode is None:
            self.returncode = VANISHED
        if self.returncode is not None:  # it has ended: nothing more to hear
            self.conn.close()

    def poll(self):
        self._hear(0)
        return self.returncode

    def wait(self, timeout: float | None = None):
        """Its exit code, or None where it has not ended within `timeout` seconds (None: waits)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                break
            self._hear(left)
        return self.returncode

    def kill(self) -> None:
        while self.pid is None and self.returncode is None:  # (it says its pid first thing)
            self._hear(None)
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)

    def close(self) -> None:
        self.conn.close()

    def __enter__(self) -> Forked:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _take_slot(slots_dir: Path, n: int):
    """Wait for one of `n` run slots."""
    return slots.take([slots_dir / f"slot{i}" for i in range(n)], poll_s=0.05)[1]


class _Handler(socketserver.StreamRequestHandler):
    def handle(self):  # runs in a freshly forked child of the zygote
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a point dies at once, as before (serve's is the zygote's)
        run_dir = Path(self.rfile.readline().decode().strip())
        env = json.loads(self.rfile.readline())
        os.environ.clear()
        os.environ.update(env)
        self.wfile.write(f"pid {os.getpid()}\n".encode())
        self.wfile.flush()
        _die_with_client(self.connection)
        log = os.open(run_dir / "worker.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        import torch

        if os.environ.pop(RANK_REQUEST, None) is not None:
            # a rank: its peers wait for it in their collectives, so it takes no slot (a job of
            # more ranks than slots would wait forever); the host's cores shared as torchrun shares them
            torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS") or 1)))
        else:
            # Points beyond the cores wait here: a sweep may start more at once than there are cores
            # without oversubscribing the CPU.
            slot = _take_slot(self.server.slots_dir, self.server.slots)  # noqa: F841 (held until exit)
            # A slot is a core: torch's pool of one thread per core in each point would spin on the
            # others' cores (the default 7B grid on 2 cores: 46 s -> 39-42 s with one thread a point)
            torch.set_num_threads(1)
        from harness.probe import worker

        try:
            rc = worker.main(run_dir)
        except BaseException:  # the worker writes its own error rows; this is a last resort
            import traceback

            traceback.print_exc()
            rc = 1
        sys.stdout.flush()
        sys.stderr.flush()
        self.wfile.write(f"rc {rc}\n".encode())
        self.wfile.flush()


def _die_with_client(conn: socket.socket) -> None:
    """The point lives as long as the process that asked for it: the client sends nothing after
    its request, so a read that returns is its end (Ctrl-C, SIGTERM, a killed sweep), and the
    point stops then instead of running on and writing a row nobody waits for."""
    import threading

    def watch():
        try:
            while conn.recv(1):
                pass
        except OSError:
            pass
        os._exit(128 + signal.SIGTERM)

    threading.Thread(target=watch, daemon=True).start()


class _Server(socketserver.ForkingMixIn, socketserver.UnixStreamServer):
    timeout = 1.0
    max_children = 256
    slots: int  # points that may run at once (one per core, fewer when memory is short)
    slots_dir: Path  # the flock'd files behind them


def serve(path: Path, model: str | None = None, named_by_code: bool = False) -> None:
    """Import what a point needs (and warm up on `model`, a preset), then fork per request until
    idle. `named_by_code`: `path` is socket_path() as the client that started it read the code;
    where the code this process loaded hashes otherwise (an edit while it loaded), it serves
    nothing, else its rows would carry run_ids that client's points do not (their rows "missing")."""
    from harness.config.compose import parallelism

    ready_to_fork(model)
    if named_by_code and socket_path() != path:
        _drop_pid_file(path)  # (the client starts another, or runs its points without one)
        return
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    server = _Server(str(tmp), _Handler)
    server.slots = parallelism()
    server.slots_dir = Path(tempfile.mkdtemp(prefix="harness-zygote-slots-"))
    os.replace(tmp, path)  # clients see the socket only once it accepts
    mine = os.stat(path).st_ino  # the socket file's (a socket's fd has sockfs's inode, not this)
    last = time.monotonic()

    def stop(signum, _frame):  # a kill ends it as idling out does: its socket, pid file and slots go too
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    try:
        while True:
            server.handle_request()  # returns after one request or `timeout`
            if server.active_children:
                last = time.monotonic()
            elif time.monotonic() - last > IDLE_S:
                break
            if server.active_children is not None:
                server.collect_children()
    finally:
        try:
            if os.path.exists(path) and os.stat(path).st_ino == mine:  # not a later zygote's
                os.unlink(path)
        except OSError:
            pass
        _drop_pid_file(path)
        server.server_close()
        import shutil

        shutil.rmtree(server.slots_dir, ignore_errors=True)


def ready_to_fork(model: str | None = None) -> None:
    """This process made what a zygote is before it forks points: `preload`, its code hashed,
    warmed up on `model` (a preset) and its heap set aside from the cyclic GC (the benchmarks start
    their points from the same state)."""
    from harness.probe.sim.trace import set_aside_for_forks
    from harness.record.provenance import versions

    preload()
    # The code this process loaded, hashed now: a child reads it from here, not from the files,
    # which may have been edited since (its rows would name code it does not run).
    versions()
    _warm_up(model)
    set_aside_for_forks()


# What pandas' parquet path and pyarrow's pandas conversion import when first used (a point's
# trace and row are parquet): private modules, so each only where this version has it.
_LAZY_PARQUET_MODULES = ("pandas.core.arrays.arrow.extension_types", "pyarrow.pandas_compat",
                         "pyarrow.vendored.version")


def preload() -> None:
    """What every point imports, imported here once: torch and transformers (4-6 s), and pandas
    with pyarrow's parquet (0.7 s: the launcher does not import them for the points)."""
    import importlib

    import pandas  # noqa: F401
    import pyarrow.parquet  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401
    from transformers import AutoModelForCausalLM  # noqa: F401
    from transformers.models.llama import modeling_llama  # noqa: F401

    from harness.probe import worker  # noqa: F401
    from harness.probe.sim import autocast_kernels

    autocast_kernels.cpu_only()  # (the dispatcher's ops an amp point's autocast passes through: 16 ms, read once)

    for name in _LAZY_PARQUET_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:  # another pandas or pyarrow: a point imports what it uses itself
            pass


def _warm_up(model: str | None = None) -> list[str]:
    """One layer of `model` (the preset a sweep or plan asked for) traced on fake tensors at a small
    batch, else the tiny preset: torch's lazy imports either way, and with the preset's layer its
    parameters' ops in FakeTensor's dispatch cache for each of its points (their shapes are the
    same at every batch and length: ~0.4 s of a 7B point's tracing), which of its layers a
    synthesized trace copies (shortcut.template_depth) and which it runs through cuDNN
    (shortcut.unmodelled). Returns the presets traced."""
    from harness.config import cards
    from harness.config.compose import CONF_DIR
    from harness.config.point import Point
    from harness.probe.sim.shortcut import at_depth, template_depth, unmodelled
    from harness.probe.sim.trace import run_point

    workload = {"name": "train", "steps": 2} if _autograd_settled_on_the_host() else {"name": "infer", "new_tokens": 2}

    def point(name: str, batch_size: int, seq_len: int) -> Point:  # the card: any, nothing is replayed
        return Point.from_dict({"model": _yaml(CONF_DIR / "model" / f"{name}.yaml"), "batch_size": batch_size,
                                "seq_len": seq_len, "workload": workload, "gpu": cards.cards()[0]})

    asked = model if model and "/" not in model and (CONF_DIR / "model" / f"{model}.yaml").is_file() else None
    for name in ([asked] if asked else []) + ["tiny"]:
        try:
            if name == asked:  # each once, not in each point; the model at its depth built on the
                # meta device once for both (config.models.on_meta keeps the last it built)
                unmodelled(point(name, 2, 64))
                template_depth(point(name, 2, 64))
            run_point(at_depth(point(name, 2, 64), 1) if name == asked else point(name, 1, 16))
            return [name]
        except Exception:  # a warm-up only: a point that fails this way will say why in its own row
            continue
    return []


def _autograd_settled_on_the_host() -> bool:
    """Whether this process may run backward and still fork points whose backward works. Autograd's
    engine decides at its first backward whether to start a thread per GPU its device guards
    count, and a child forked after that raises "Unable to handle autograd's threading in
    combination with fork-based multiprocessing" at its own first backward. Under FakeTensorMode a
    CUDA build of torch counts a GPU even on a machine without one (every point then failed so): the
    first backward here is a real one on the host, outside every mode, which counts none. Where a
    GPU driver is present there are some to count: no backward runs here at all."""
    from harness.launch.gpus import driver_present

    if driver_present():
        return False
    import torch

    torch.ones(1, requires_grad=True).sum().backward()
    return True


def _connect(path: Path) -> socket.socket | None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(str(path))
        return s
    except OSError:
        s.close()
        return None


def connect() -> socket.socket | None:
    """A connection to a running zygote, starting one if needed; None if none can be had."""
    path = socket_path()
    conn = _connect(path)
    if conn is not None:
        return conn
    with _lock(path):
        spawned = 0
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            conn = _connect(path)
            if conn is not None:
                return conn
            if not _alive(path):
                if spawned == 2:  # it dies while starting: no zygote to be had
                    return None
                _spawn(path)
                spawned += 1
            time.sleep(0.05)
        return None


def start_early(argv: list[str]) -> None:
    """Start a zygote in the background for a run, sweep or plan that will fork its points from
    one: it imports and warms up (5-7 s) while this process composes the points. Not where the
    points will not fork (HARNESS_ZYGOTE=0, backend=cuda, the Slurm launcher, a GPU driver on this
    host without backend=sim): a wrong guess costs an idle process that exits after IDLE_S."""
    from harness.launch.gpus import driver_present

    if os.environ.get("HARNESS_ZYGOTE", "1") == "0" or any("slurm" in a for a in argv):
        return
    backend = next((a.split("=", 1)[1] for a in reversed(argv) if a.startswith("backend=")), "auto")
    if backend == "cuda" or (backend != "sim" and driver_present()):
        return
    path = socket_path()
    with _lock(path):
        if not _alive(path):
            _spawn(path, _model_asked(argv))


def _model_asked(argv: list[str]) -> str | None:
    """The preset a run, sweep or plan asks for: its model= override, else its grid file's, else
    config.yaml's default (a guess for the warm-up: a wrong one only warms less)."""
    given = [a.split("=", 1)[1] for a in argv if a.startswith("model=")]
    if given:
        return given[-1].split(",")[0]
    from harness.config.compose import CONF_DIR

    grids = [a.split("=", 1)[1] for a in argv if a.startswith("sweeps=")]
    files = [CONF_DIR / "sweeps" / f"{grids[-1]}.yaml"] if grids else []
    for f in [*files, CONF_DIR / "config.yaml"]:
        try:
            defaults = _yaml(f).get("defaults", [])
        except (OSError, ValueError):
            continue
        for d in defaults:
            for key, value in (d.items() if isinstance(d, dict) else ()):
                if key.split()[-1].lstrip("/") == "model":
                    return str(value)
    return None


def _yaml(path: Path) -> dict:
    from omegaconf import OmegaConf

    data = OmegaConf.to_container(OmegaConf.load(path))
    return data if isinstance(data, dict) else {}


@contextlib.contextmanager
def _lock(path: Path):
    """One process at a time decides whether a zygote must be started."""
    with open(str(path) + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _spawn(path: Path, model: str | None = None) -> None:
    if path.exists():
        path.unlink()  # a zygote that died without cleaning up
    proc = subprocess.Popen([sys.executable, "-m", "harness.launch.zygote", str(path), *([model] if model else [])],
                            start_new_session=True,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _pid_file(path).write_text(str(proc.pid))


def _pid_file(path: Path) -> Path:
    return Path(str(path) + ".pid")


def _drop_pid_file(path: Path) -> None:
    """This process's pid file for `path` removed (not a later zygote's; none: nothing to do)."""
    try:
        if _pid_file(path).read_text().strip() == str(os.getpid()):
            _pid_file(path).unlink()
    except OSError:
        pass


def _alive(path: Path) -> bool:
    """Whether the zygote last spawned for `path` is alive (importing, warming up, or serving)."""
    try:
        pid = int(_pid_file(path).read_text())
        os.kill(pid, 0)
    except (OSError, ValueError):
        return False
    try:  # a pid reused by another program is no zygote
        return b"harness.launch.zygote" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return True  # no /proc: trust the pid


if __name__ == "__main__":
    serve(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else None, named_by_code=True)
