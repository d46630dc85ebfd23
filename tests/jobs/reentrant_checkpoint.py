"""A job that checkpoints its two blocks with reentrant checkpoints: each block's backward runs as
a backward of its own, inside the step's (its nodes made by the recompute, not the forward)."""

import torch
from torch.utils.checkpoint import checkpoint

from harness.workload import Job


def _block() -> torch.nn.Sequential:
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = _block(), _block()

    def forward(self, x):
        return checkpoint(self.b, checkpoint(self.a, x, use_reentrant=True), use_reentrant=True)


def build(k):
    m = Net()
    # (a reentrant checkpoint runs backward only where its input requires grad)
    x = torch.randn(k.batch_size, 64, requires_grad=True)
    return Job(m, torch.optim.SGD(m.parameters(), lr=0.1), x, loss=lambda m, x: m(x).sum())
