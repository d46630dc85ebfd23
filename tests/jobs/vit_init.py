"""A model whose init calls torch.nn.init.trunc_normal_ (ViT-style), which reads values in torch 2.13."""

import torch
from torch import nn

from harness.workload import Job, Knobs


class Patchy(nn.Module):
    def __init__(self, d=64):
        super().__init__()
        self.pos = nn.Parameter(torch.zeros(1, 16, d))
        nn.init.trunc_normal_(self.pos, std=0.02)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        return self.mlp(x + self.pos)


def build(k: Knobs) -> Job:
    model = Patchy()
    return Job(model, torch.optim.AdamW(model.parameters()), torch.randn(k.batch_size, 16, 64),
               loss=lambda m, x: m(x).square().mean(), blocks=nn.Sequential)  # checkpointing: the MLP
