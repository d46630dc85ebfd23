"""FakeTensor's cache key and its hits' outputs made here (probe.sim.fake_cache) are torch's own, value
for value, and stand in for them only on the torch code they repeat."""

import pytest
import torch
from torch._subclasses import fake_tensor
from torch._subclasses.fake_tensor import FakeTensorMode

from harness.allocator.settings import AllocSettings
from harness.config import cards
from harness.config.point import Parallel, Workload
from harness.probe.sim import fake_cache, repeat
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


REPEATS = pytest.mark.skipif(not (fake_cache.applies() and fake_cache.hit_applies()),
                             reason="this torch's cache code is not the code fake_cache repeats")


@REPEATS
@pytest.mark.parametrize("name", POINTS)
def test_the_fast_key_and_hit_are_torchs_at_every_dispatch_of_a_trace(name):
    """Both keys and both outputs of every hit made at every dispatch (checking() fails where they
    differ): amp and checkpointing, a decode, FSDP2's and TP's DTensors, a router's ops; the trace
    is the one torch's cache makes."""
    point = POINTS[name]()
    with fake_cache.checking():
        checked, tracker = run_point(point)
    fake_tensor.FakeTensorMode.cache_clear()  # its entries were made by the other key
    ours, again = run_point(point)
    assert checked == ours and repeat.canonical(tracker.journal()) == repeat.canonical(again.journal())


@REPEATS
@pytest.mark.parametrize("script", ["amp_scaler.py", "host_batches.py"])
def test_the_fast_key_and_hit_are_torchs_at_every_dispatch_of_a_script(script, capsys):
    """A script's dispatches mix fake tensors with real host ones (GradScaler, a model built under
    a default device, batches indexed on the host)."""
    with fake_cache.checking():
        run = run_script(REPO / "tests" / "scripts" / script, [], cards.by_key()["a100-80gb"], AllocSettings())
    assert run.exit_code == 0, run.error


def test_a_key_that_differs_from_torchs_is_caught(monkeypatch):
    monkeypatch.setattr(fake_cache, "_tensor", lambda result, t: result.append("not torch's"))
    with fake_cache.checking(), FakeTensorMode(), pytest.raises(AssertionError, match="key .* differs from torch's"):
        torch.ones(3) * 2


@pytest.mark.parametrize("changed", [{"constant": 0}, {"_fake_device": torch.device("meta")}])
def test_a_hit_that_differs_from_torchs_is_caught(monkeypatch, changed):
    """The second product is a hit (the first may be too: the cache is torch's, shared): one
    attribute of the fast output changed is caught."""
    fast = fake_cache._hit

    def differing(*args):
        out = fast(*args)
        out.__dict__.update(changed)
        return out
    monkeypatch.setattr(fake_cache, "_hit", differing)
    x = torch.ones(3)
    with fake_cache.checking(), FakeTensorMode() as mode:
        y = mode.from_tensor(x)
        with pytest.raises(AssertionError, match="hit of aten.mul.Tensor .* differs from torch's"):
            y * 2
            y * 2


def test_a_views_fast_hit_shares_its_inputs_storage(monkeypatch):
    """A view op's second call is a hit the fast code makes: on its input's storage, as torch's."""
    fast, made = fake_cache._hit, []

    def recording(self, state, entry, key, func, args):
        made.append(func)
        return fast(self, state, entry, key, func, args)
    monkeypatch.setattr(fake_cache, "_hit", recording)
    with fake_cache.fast_cache(), FakeTensorMode() as mode:
        x = mode.from_tensor(torch.ones(4, 6))
        first, second = x.view(6, 4), x.view(6, 4)
    assert torch.ops.aten.view.default in made
    assert second.untyped_storage()._cdata == x.untyped_storage()._cdata == first.untyped_storage()._cdata
    assert (second.shape, second.stride()) == ((6, 4), (4, 1))


def test_the_fast_cache_stands_in_only_for_the_torch_code_it_was_checked_on(monkeypatch):
    """Each part (key, hit) on torch's code alone where its torch code is not the code it repeats,
    the other part still in use."""
    mode = fake_tensor.FakeTensorMode
    torchs = mode._prep_args_for_hash, mode._get_output_tensor_from_cache_entry
    ours = fake_cache._prep_args_for_hash, fake_cache._hit
    for part, (check, sources) in enumerate(((fake_cache.applies, "_sources"), (fake_cache.hit_applies, "_hit_sources"))):
        check.cache_clear()
        monkeypatch.setattr(fake_cache, sources, lambda: "def _prep_args_for_hash(self): ...  # a newer torch")
        try:
            assert not check()
            other_applies = (fake_cache.hit_applies, fake_cache.applies)[part]()
            with fake_cache.fast_cache():
                now = mode._prep_args_for_hash, mode._get_output_tensor_from_cache_entry
                assert now[part] is torchs[part] and now[1 - part] is (ours if other_applies else torchs)[1 - part]
        finally:
            check.cache_clear()
        monkeypatch.undo()
    if torch.__version__.split("+")[0] != "2.13.0":
        pytest.skip(f"fake_cache was checked on torch 2.13.0 (README's); this is {torch.__version__}")
    assert fake_cache.applies() and fake_cache.hit_applies()  # the torch README installs: both in use, only inside
    with fake_cache.fast_cache():
        assert (mode._prep_args_for_hash, mode._get_output_tensor_from_cache_entry) == ours
    assert (mode._prep_args_for_hash, mode._get_output_tensor_from_cache_entry) == torchs
