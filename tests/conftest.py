import atexit
import fcntl
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

# One thread per test process (xdist runs one per core, and one more), and for what they start (the CLI, gloo
# ranks, Slurm jobs inherit it): torch's OpenMP pool of one thread per core in each would spin on
# the other's cores. Measured on 2 cores: 26% less wall and CPU for the real-tensor tests.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402 (after the thread count, which torch reads at import)
from omegaconf import OmegaConf  # noqa: E402

from harness.config import cards  # noqa: E402
from harness.config.point import Point  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
ARCHITECTURES = REPO / "tests" / "data" / "architectures"  # small config.json files of transformers' model types

# A user's own calibrated cards (calibrate's measured-cards.json) must not move the catalog under test:
# each test process's own file, in a folder removed when that process ends.
_MEASURED = tempfile.mkdtemp(prefix="harness-measured-")
atexit.register(shutil.rmtree, _MEASURED, ignore_errors=True)
os.environ[cards.MEASURED_ENV] = os.path.join(_MEASURED, "measured-cards.json")


def model_cfg(name: str, **hf) -> dict:
    cfg = OmegaConf.to_container(OmegaConf.load(REPO / "harness" / "conf" / "model" / f"{name}.yaml"))
    cfg["hf"].update(hf)
    return cfg


def train_point(model="tiny", precision="bf16", batch_size=2, seq_len=64, checkpointing=False,
                optimizer="adamw", impl="auto", steps=3, **hf) -> Point:
    return Point.from_dict(dict(model=model_cfg(model, **hf), precision=precision, batch_size=batch_size,
                                seq_len=seq_len, checkpointing=checkpointing,
                                workload=dict(name="train", steps=steps, new_tokens=16),
                                optimizer=dict(name=optimizer, impl=impl, lr=1e-4), gpu=cards.by_key()["a100-80gb"]))


def hf_point(tmp_path, config: dict, **point) -> Point:
    """A training point of an architecture of the user's own (model=hf, its config.json written to
    `tmp_path`); `point`: train_point's knobs."""
    import json

    (tmp_path / "config.json").write_text(json.dumps(config))
    return on_config(train_point(**point), tmp_path)


def on_config(point: Point, config_json, **hf) -> Point:
    """`point` on the model of a config.json (model=hf, model.config_json: the file or its dir),
    its keys `hf` changed."""
    import dataclasses

    return point.replace(model=dataclasses.replace(point.model, name="hf", arch="auto", config_json=str(config_json),
                                                   hf=hf))


def run_cli(*args, cwd=None, timeout=600):
    """`python -m harness ...` as a user runs it."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, "-m", "harness", *args], capture_output=True, text=True,
                          cwd=cwd or REPO, timeout=timeout, env=env)


@pytest.fixture
def tiny_point():
    return train_point()


class Shared:
    """What tests make once per session though xdist hands them to different workers (a smoke
    sweep, a batch of gloo jobs): the first worker to ask makes it under a file lock; the others
    wait on the lock and read it from disk. A make that fails is not taken for made: the next
    asker makes it again."""

    def __init__(self, root: Path):
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def dir(self, name: str, make: Callable[[Path], None]) -> Path:
        """`root/name`, filled by make(root/name) once."""
        out = self.root / name
        with open(self.root / f"{name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not (out / ".made").exists():
                shutil.rmtree(out, ignore_errors=True)
                out.mkdir()
                make(out)
                (out / ".made").touch()
        return out

    def value(self, name: str, make: Callable[[], object]):
        """make()'s value (picklable), made once."""
        return pickle.loads((self.dir(name, lambda d: (d / "value.pkl").write_bytes(pickle.dumps(make())))
                             / "value.pkl").read_bytes())

    def copy(self, name: str, make: Callable[[Path], None], to: Path) -> Path:
        """A copy of dir(name, make) at `to`, for a test to change."""
        shutil.copytree(self.dir(name, make), to, ignore=shutil.ignore_patterns(".made"))
        return to


@pytest.fixture(scope="session")
def shared(tmp_path_factory) -> Shared:
    base = tmp_path_factory.getbasetemp()
    # xdist gives each worker basetemp/popen-gwN: their parent is the session's
    return Shared((base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared")


def pytest_collection_modifyitems(items):
    """Slow tests first, Slurm's first of all: the cluster's tests wait on Slurm more than they
    compute, and a long test handed out last is the suite's tail (xdist hands tests out in this
    order as workers free up)."""
    def order(item) -> int:
        return 0 if item.path.name == "test_slurm.py" else 1 if item.get_closest_marker("slow") else 2

    items.sort(key=order)


def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto`: two workers more than the cores. One runs the Slurm tests one after another and
    waits on Slurm most of its time; the rank and CLI tests wait on processes of their own (gloo
    ranks, `python -m harness` and its zygote's points) for part of theirs. On 2 cores, the same
    hour: 824 s with 4 workers against 856-921 s with 3. maxprocesses (pyproject) caps it."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return cores + 2


def pytest_collection_finish(session):
    """Set what the collection imported (torch, transformers, harness, the tests) aside from the
    cyclic GC, as the zygote does for its points (probe.sim.trace.set_aside_for_forks): otherwise
    every automatic collection in a test walks all of it."""
    from harness.probe.sim.trace import set_aside_for_forks

    set_aside_for_forks()

