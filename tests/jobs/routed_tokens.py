"""A block that routes its tokens as transformers' MoE experts do (a sort, then its inverse built on
`x.device`), checkpointed: its recompute in backward makes the same tensors on the same device."""

import torch
from torch.utils.checkpoint import checkpoint

from harness.workload import Job


class Routed(torch.nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.proj = torch.nn.Linear(d, d)

    def forward(self, x):
        h = self.proj(x).flatten(0, 1)
        perm = torch.argsort(h[:, 0])
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(perm.size(0), device=x.device)  # transformers.integrations.moe
        return h[perm].relu()[inv].view_as(x)


class Model(torch.nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Routed(d) for _ in range(2))

    def forward(self, x):
        for b in self.blocks:
            x = checkpoint(b, x, use_reentrant=False)
        return x


def build(k):
    m = Model(64)
    return Job(m, torch.optim.SGD(m.parameters(), lr=0.1), torch.randn(k.batch_size, k.seq_len, 64),
               loss=lambda m, x: m(x).sum())
