"""A job that reads torch.cuda's counters in its own step, as profiling code does; READINGS keeps
what each step saw (peak allocated, allocated at the end, reserved)."""

import torch

from harness.workload import Job, Knobs

READINGS: list[tuple[int, int, int]] = []


def build(k: Knobs) -> Job:
    READINGS.clear()
    model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 512))
    x = torch.randn(k.batch_size, k.seq_len, 512)

    def step(model, optimizer, batch):
        torch.cuda.reset_peak_memory_stats()
        with torch.cuda.nvtx.range("forward"):
            model(batch).float().square().mean().backward()
        model.zero_grad(set_to_none=True)
        READINGS.append((torch.cuda.max_memory_allocated(), torch.cuda.memory_allocated(), torch.cuda.memory_reserved()))

    return Job(model=model, batch=x, step=step, steps=3)
