"""A job with no blocks that ignores Knobs.checkpointing: checkpointing=true would change nothing."""

import torch

from harness.workload import Job


def build(k):
    m = torch.nn.Linear(8, 8)
    return Job(m, torch.optim.SGD(m.parameters(), lr=0.1), torch.randn(k.batch_size, 8), loss=lambda m, x: m(x).sum())
