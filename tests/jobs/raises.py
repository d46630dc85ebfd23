"""A job whose step fails in the user's own code (a shape bug), as a real run's would."""

import torch

from harness.workload import Job, Knobs


def build(k: Knobs) -> Job:
    model = torch.nn.Linear(16, 16)

    def step(model, optimizer, batch):
        torch.cuda.nvtx.range_push("step")  # a no-op on the virtual GPU, as on a card without a profiler
        return model(batch.view(-1, 15))  # 16 * batch elements do not make rows of 15

    return Job(model=model, batch=torch.randn(k.batch_size, 16), step=step)
