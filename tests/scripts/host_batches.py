"""Batches sampled on the host as nanoGPT's get_batch samples them (indices with values, slices of a
numpy array), pinned and moved; a model built under torch.set_default_device("cuda")."""

import numpy as np
import torch

block, batch = 64, 8
data = np.arange(100_000, dtype=np.uint16)


def get_batch():
    ix = torch.randint(len(data) - block, (batch,))
    x = torch.stack([torch.from_numpy(data[i:i + block].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + block].astype(np.int64)) for i in ix])
    return x.pin_memory().to("cuda", non_blocking=True), y.pin_memory().to("cuda", non_blocking=True)


x, y = get_batch()
print(f"batch {tuple(x.shape)} {torch.cuda.memory_allocated()}")
torch.set_default_device("cuda")
emb = torch.nn.Embedding(1000, 64)
torch.set_default_device("cpu")
host_table = torch.zeros(1 << 22)  # 16 MiB on the host: shapes only, not counted
out = emb(x % 1000)
print(f"embedded {tuple(out.shape)} {torch.cuda.memory_allocated()} on the host {host_table.numel()}")
