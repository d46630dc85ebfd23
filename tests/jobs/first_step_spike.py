"""A step over tensors alone (no model, no optimizer) whose first call builds a one-off 64 MiB
table: the whole run's peak is step 1's, the steady state's is not."""

import torch
import torch.nn.functional as F

from harness.workload import Job, Knobs

SPIKE_BYTES = 64 * 2**20


def build(k: Knobs) -> Job:
    q = torch.randn(k.batch_size, 4, k.seq_len, 64, dtype=k.dtype)
    calls = []

    def step(model, optimizer, batch):
        if not calls:
            table = torch.empty(SPIKE_BYTES, dtype=torch.uint8)  # freed when the step returns
            del table
        calls.append(1)
        return F.scaled_dot_product_attention(batch, batch, batch, is_causal=True)

    return Job(batch=q, step=step, name="attention")
