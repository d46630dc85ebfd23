"""The usual fp16 recipe in a step of its own: autocast to fp16, torch.amp.GradScaler scaling the
loss, unscaling for a clip, checking for inf or NaN gradients (a value read) before it steps."""

import torch
from torch import nn

from harness.workload import Job, Knobs


def build(k: Knobs) -> Job:
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    scaler = torch.amp.GradScaler("cuda")

    def step(model, optimizer, x):
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(x).square().mean()
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)

    return Job(model, torch.optim.AdamW(model.parameters()), torch.randn(k.batch_size, 64), step=step, autocast=False,
               blocks=nn.Linear)
