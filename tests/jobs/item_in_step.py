import torch

from harness.workload import Job, Knobs

losses = []


def step(model, optimizer, batch):
    loss = model(batch).square().mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    losses.append(loss.item())  # reads a value inside the measured step


def build(k: Knobs) -> Job:
    model = torch.nn.Linear(16, 16)
    return Job(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(k.batch_size, 16), step=step)
