"""A job that takes `sleep_s` seconds to build: a point that is still running when Slurm cancels
it or its time limit ends it."""

import time

import torch

from harness.workload import Job, Knobs


def build(k: Knobs) -> Job:
    time.sleep(float(k.args.get("sleep_s", 0)))
    model = torch.nn.Linear(16, 16)
    return Job(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(k.batch_size, 16),
               loss=lambda m, b: m(b).square().mean())
