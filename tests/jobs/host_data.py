"""A training job whose dataset stays in host memory, each step's batch copied to the card; with
`+workload.args.on_host=false` the same job keeps the dataset on the card."""

import torch

from harness.workload import Job, Knobs

DATASET_ROWS = 4096


def build(k: Knobs) -> Job:
    width = 256
    on_host = k.args.get("on_host", True)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, 1))
    opt = torch.optim.AdamW(model.parameters())
    data = torch.randn(DATASET_ROWS, width, device="cpu" if on_host else None)  # 4 MiB
    model.lookup = torch.zeros(DATASET_ROWS, width).cpu()  # a table the code keeps on the host
    cursor = [0]

    def step(model, optimizer, batch):
        i = cursor[0] * k.batch_size
        cursor[0] += 1
        x = batch[i:i + k.batch_size].to("cuda")
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return Job(model=model, optimizer=opt, batch=data, step=step)
