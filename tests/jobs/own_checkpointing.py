"""A job that checkpoints its own block (reads Knobs.checkpointing), and passes the policy on only
when args.passes_policy says so."""

import torch

from harness.workload import Job, checkpoint_blocks


class Block(torch.nn.Sequential):
    pass


def build(k):
    m = torch.nn.Sequential(Block(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 8)))
    if k.checkpointing:
        policy = k.checkpointing_policy if k.args.get("passes_policy") else "full"
        checkpoint_blocks(m, Block, policy)
    return Job(m, torch.optim.SGD(m.parameters(), lr=0.1), torch.randn(k.batch_size, 8), loss=lambda m, x: m(x).sum())
