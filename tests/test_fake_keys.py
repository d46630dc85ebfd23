"""FakeTensor's cache key made here (probe.sim.fake_keys) is torch's own, value for value, and stands
in for it only on the torch code it repeats."""

import pytest
import torch
from torch._subclasses import fake_tensor
from torch._subclasses.fake_tensor import FakeTensorMode

from harness.allocator.settings import AllocSettings
from harness.config import cards
from harness.config.point import Parallel, Workload
from harness.probe.sim import fake_keys, repeat
from harness.probe.sim.script import run_script
from harness.probe.sim.trace import run_point
from tests.conftest import ARCHITECTURES, REPO, on_config, train_point

POINTS = {
    "amp-ckpt": lambda: train_point(precision="amp_bf16", checkpointing=True),
    "fp32-decode": lambda: train_point(precision="fp32").replace(workload=Workload(name="infer", new_tokens=3)),
    "fsdp2": lambda: train_point(optimizer="adamw", impl="fused").replace(parallel=Parallel(dp_shard=2)),
    "tp": lambda: train_point(checkpointing=True).replace(parallel=Parallel(tp=2)),
    "moe": lambda: on_config(train_point(batch_size=1, seq_len=32), ARCHITECTURES / "qwen2_moe.json",
                             num_hidden_layers=2),
}


@pytest.mark.skipif(not fake_keys.applies(), reason="this torch's key code is not the code fake_keys repeats")
@pytest.mark.parametrize("name", POINTS)
def test_the_fast_key_is_torchs_key_at_every_dispatch_of_a_trace(name):
    """Both keys made at every dispatch (checking() fails where they differ): amp and
    checkpointing, a decode, FSDP2's and TP's DTensors, a router's ops; the trace is the one
    torch's key makes."""
    point = POINTS[name]()
    with fake_keys.checking():
        checked, tracker = run_point(point)
    fake_tensor.FakeTensorMode.cache_clear()  # its entries were made by the other key
    ours, again = run_point(point)
    assert checked == ours and repeat.canonical(tracker.journal()) == repeat.canonical(again.journal())


@pytest.mark.skipif(not fake_keys.applies(), reason="this torch's key code is not the code fake_keys repeats")
@pytest.mark.parametrize("script", ["amp_scaler.py", "host_batches.py"])
def test_the_fast_key_is_torchs_key_at_every_dispatch_of_a_script(script, capsys):
    """A script's dispatches mix fake tensors with real host ones (GradScaler, a model built under
    a default device, batches indexed on the host)."""
    with fake_keys.checking():
        run = run_script(REPO / "tests" / "scripts" / script, [], cards.by_key()["a100-80gb"], AllocSettings())
    assert run.exit_code == 0, run.error


def test_a_key_that_differs_from_torchs_is_caught(monkeypatch):
    monkeypatch.setattr(fake_keys, "_tensor", lambda result, t: result.append("not torch's"))
    with fake_keys.checking(), FakeTensorMode(), pytest.raises(AssertionError, match="differs from torch's"):
        torch.ones(3) * 2


def test_the_fast_key_stands_in_only_for_the_torch_code_it_was_checked_on(monkeypatch):
    torchs = fake_tensor.FakeTensorMode._prep_args_for_hash
    fake_keys.applies.cache_clear()
    monkeypatch.setattr(fake_keys, "_sources", lambda: "def _prep_args_for_hash(self): ...  # a newer torch")
    try:
        assert not fake_keys.applies()
        with fake_keys.fast_keys():
            assert fake_tensor.FakeTensorMode._prep_args_for_hash is torchs
    finally:
        fake_keys.applies.cache_clear()
    monkeypatch.undo()
    if torch.__version__.split("+")[0] != "2.13.0":
        pytest.skip(f"fake_keys was checked on torch 2.13.0 (README's); this is {torch.__version__}")
    assert fake_keys.applies()  # the torch README installs: the fast key in use, and only inside
    with fake_keys.fast_keys():
        assert fake_tensor.FakeTensorMode._prep_args_for_hash is fake_keys._prep_args_for_hash
    assert fake_tensor.FakeTensorMode._prep_args_for_hash is torchs
