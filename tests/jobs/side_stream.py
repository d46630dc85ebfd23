"""A job whose forward runs its first projection on a side stream (as code overlapping work does):
that projection's output lives in the side stream's pool, and does not take the block the default
stream freed just before (a temporary of the same size); its GEMM there has a cuBLAS workspace
of its own (one per handle and stream)."""

import torch

from harness.workload import Job, Knobs


class SideStreamMLP(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.up, self.down = torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width, width)
        self.side = torch.cuda.Stream()

    def forward(self, x):
        wide = torch.ones(*x.shape[:-1], self.up.out_features, device=x.device, dtype=x.dtype)
        scale = wide.mean()  # a temporary of the projection's size, freed on the default stream
        del wide
        self.side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.side):
            h = self.up(x)
        torch.cuda.current_stream().wait_stream(self.side)
        return self.down(torch.relu(h)) * scale


def build(k: Knobs) -> Job:
    width = int(k.args.get("width", 1024))
    model = SideStreamMLP(width).to(device="cuda", dtype=k.dtype)
    batch = torch.randn(k.batch_size, k.seq_len, width, device="cuda", dtype=k.dtype)
    return Job(model, torch.optim.SGD(model.parameters(), lr=0.1), batch, loss=lambda m, b: m(b).square().mean())
