"""A VAE-like step drawing from torch.distributions with their default validation (each parameter
and each scored sample checked against its constraint: a read of whether all hold)."""

import torch
from torch import nn

from harness.workload import Job, Knobs


class Sampler(nn.Module):
    def __init__(self, d=64, z=16):
        super().__init__()
        self.encode, self.decode = nn.Linear(d, 2 * z), nn.Linear(z, d)

    def forward(self, x):
        mu, s = self.encode(x).chunk(2, dim=-1)
        q = torch.distributions.Normal(mu, nn.functional.softplus(s) + 1e-4)
        z = q.rsample()
        prior = torch.distributions.Normal(torch.zeros_like(mu), torch.ones_like(mu))
        return (self.decode(z) - x).square().mean() + (q.log_prob(z) - prior.log_prob(z)).mean()


def build(k: Knobs) -> Job:
    model = Sampler()
    return Job(model, torch.optim.AdamW(model.parameters()), torch.randn(k.batch_size, 64), loss=lambda m, x: m(x),
               blocks=nn.Linear)
