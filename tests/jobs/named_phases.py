"""A step that names its phases and runs its own autocast (harness.workload.phase, Job(autocast=False))."""

import torch

from harness.workload import Job, Knobs, phase


def step(model, optimizer, x):
    phase("embed")
    h = model[0](x)
    phase("head")  # the step's largest temporaries: a wide projection and its square
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model[1](h).square().mean()
    phase("backward")
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def build(k: Knobs) -> Job:
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8192))
    return Job(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), torch.randn(k.batch_size, 64), step=step,
               autocast=False, steps=4)
