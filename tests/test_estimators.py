"""The virtual GPU against PyTorch's own estimator (MemTracker) on 7B points (slow)."""

import pytest

from harness.probe.sim.trace import run_point
from tests.conftest import train_point
from tests.memtracker_ref import memtracker_peak

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("batch_size,seq_len", [(1, 1024), (4, 2048)])
def test_7b_peak_agrees_with_memtracker_within_2_percent(batch_size, seq_len):
    point = train_point(model="7b", precision="bf16", batch_size=batch_size, seq_len=seq_len, steps=2)
    ours = run_point(point)[0]
    theirs = memtracker_peak(point)
    assert ours["n_params"] == 6_738_415_616
    assert abs(ours["peak_allocated_bytes"] - theirs) / theirs < 0.02, (ours["peak_allocated_bytes"], theirs)
