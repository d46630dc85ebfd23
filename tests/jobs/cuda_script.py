"""A training script written for a GPU, as people write them: device strings, .to(device),
torch.autocast("cuda"), torch.cuda.synchronize(). The build function is the only glue."""

import torch
import torch.nn.functional as F

from examples import gpt
from examples.gpt import GPT, Block
from harness.workload import Job, Knobs

device = "cuda"


def train_step(model, optimizer, batch):
    x, y = batch
    x, y = x.to(device), y.to(device)
    with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
        logits = model(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()


def build(k: Knobs) -> Job:
    model = GPT(512, 64, 2, 4, context=k.seq_len).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    x = torch.randint(0, 512, (k.batch_size, k.seq_len), device="cuda")
    return Job(model, optimizer, (x, torch.randint(0, 512, (k.batch_size, k.seq_len))), step=train_step,
               blocks=Block)


def build_portable(k: Knobs) -> Job:
    """The same job without CUDA habits: fp32 weights, the harness's amp_bf16 around the step."""
    model = GPT(512, 64, 2, 4, context=k.seq_len)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    x = torch.randint(0, 512, (k.batch_size, k.seq_len))
    return Job(model, optimizer, (x, torch.randint(0, 512, (k.batch_size, k.seq_len))), step=gpt.train_step,
               blocks=Block)


def build_reference(k: Knobs) -> Job:
    """The same script with its CUDA habits removed by hand: CPU device, the harness's CUDA
    autocast emulation entered explicitly where the script enters torch.autocast("cuda")."""
    from harness.probe.sim.autocast_kernels import region

    def step(model, optimizer, batch):
        x, y = batch
        with region(torch.bfloat16):
            logits = model(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    job = build_portable(k)
    job.step = step
    return job
