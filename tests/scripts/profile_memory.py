"""A memory-profiling script as users write it for a real GPU: readings per step, a snapshot of
the steps, a summary. `python profile_memory.py snapshot.pickle [width]`."""

import sys

import torch
import torch.nn as nn

device = "cuda" if torch.cuda.is_available() else "cpu"
width = int(sys.argv[2]) if len(sys.argv) > 2 else 1024
print(f"device {device} {torch.cuda.get_device_name(0)} total {torch.cuda.get_device_properties(0).total_memory}")

model = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)).to(device)
opt = torch.optim.AdamW(model.parameters())
print(f"after model {torch.cuda.memory_allocated()}")

torch.cuda.memory._record_memory_history(max_entries=100000)
for step in range(3):
    torch.cuda.nvtx.range_push(f"step {step}")
    x = torch.randn(64, width, device=device)
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    torch.cuda.nvtx.range_pop()
    print(f"step {step} loss {loss.item():.3f} allocated {torch.cuda.memory_allocated()} "
          f"max_allocated {torch.cuda.max_memory_allocated()} reserved {torch.cuda.memory_reserved()} "
          f"max_reserved {torch.cuda.max_memory_reserved()}")
    torch.cuda.reset_peak_memory_stats()
torch.cuda.memory._dump_snapshot(sys.argv[1])
torch.cuda.memory._record_memory_history(enabled=None)
free, total = torch.cuda.mem_get_info()
print(f"mem_get_info {free} {total}")
print(torch.cuda.memory_summary())
