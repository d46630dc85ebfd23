import torch

from harness.workload import Job, Knobs


def loss(model, x):
    out = model(x)
    if out.mean() > 0:  # a data-dependent branch
        out = out * 2
    return out.square().mean()


def build(k: Knobs) -> Job:
    model = torch.nn.Linear(16, 16)
    return Job(model, torch.optim.AdamW(model.parameters()), torch.randn(k.batch_size, 16), loss=loss)
