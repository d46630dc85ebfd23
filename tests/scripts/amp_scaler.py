"""Mixed precision as public training scripts write it: fp16 autocast, GradScaler, CUDA events for
timing, torch.compile, the profiler asked for CUDA activity."""

import torch
import torch.nn as nn
from torch.profiler import ProfilerActivity, profile

model = torch.compile(nn.Linear(1024, 1024).cuda())
opt = torch.optim.AdamW(model.parameters())
scaler = torch.amp.GradScaler("cuda")
start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
with torch.cuda.device(0), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], profile_memory=True):
    for step in range(2):
        start.record()
        x = torch.randn(32, 1024, device="cuda")
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        end.record()
        torch.cuda.current_stream().synchronize()
        print(f"step {step} states {len(opt.state)} allocated {torch.cuda.memory_allocated()} "
              f"ms {start.elapsed_time(end)}")
