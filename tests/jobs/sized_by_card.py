"""A job that sizes its batch by the card it runs on, as auto-batching code does."""

import torch

from harness.workload import Job, Knobs


def build(k: Knobs) -> Job:
    rows = 64 if torch.cuda.get_device_properties(0).total_memory > 40 * 2**30 else 16
    model = torch.nn.Linear(1024, 1024)
    return Job(model=model, batch=torch.randn(rows, 1024), step=lambda m, o, b: m(b))
