"""A training step with the classic leak: a logged loss kept, with its graph.

    python -m harness run workload=custom workload.target=examples.leaky:build workload.steps=4

After each step the loop computes a loss for logging, without torch.no_grad(), and keeps it:
`history.append(eval_loss)` where `eval_loss.item()` was meant keeps its autograd graph and every
activation that graph saved. Allocated memory climbs step after step; the row's kind is `retained`,
with the holder named. The fix: `with torch.no_grad():` around it, and `.item()` - after the
measured step, since the virtual GPU has no values to read.
"""

import torch
from torch import nn

from harness.workload import Job, Knobs

history: list = []


def leaky_step(model, optimizer, batch):
    x, y = batch
    loss = ((model(x) - y) ** 2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    eval_loss = ((model(x) - y) ** 2).mean()  # for logging, but with a graph
    history.append(eval_loss)  # the leak: the graph (and what it saved) lives as long as the list


def build(k: Knobs) -> Job:
    history.clear()
    d = int(k.args.get("width", 1024))
    model = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)).to(k.dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(k.batch_size, k.seq_len, d, dtype=k.dtype)
    # blocks: checkpointing=true checkpoints the MLP as one block
    return Job(model, optimizer, (x, torch.randn_like(x)), step=leaky_step, blocks=nn.Sequential,
               name=f"leaky-mlp-{d}")
