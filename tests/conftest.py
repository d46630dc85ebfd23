import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from harness.config import cards
from harness.config.point import Point

REPO = Path(__file__).resolve().parents[1]

# A user's own calibrated cards (calibrate's measured-cards.json) must not move the catalog under test.
os.environ[cards.MEASURED_ENV] = os.path.join(tempfile.mkdtemp(prefix="harness-measured-"), "measured-cards.json")


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


def run_cli(*args, cwd=None, timeout=600):
    """`python -m harness ...` as a user runs it."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, "-m", "harness", *args], capture_output=True, text=True,
                          cwd=cwd or REPO, timeout=timeout, env=env)


@pytest.fixture
def tiny_point():
    return train_point()

