"""nn.TransformerEncoder (its layer deep-copied) with an EMA teacher (the model deep-copied): code
that copies modules with copy.deepcopy, on fake tensors as on real ones."""

import copy

import torch
from torch import nn

from harness.workload import Job, Knobs


class Student(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        layer = nn.TransformerEncoderLayer(d, 4, 2 * d, dropout=0.0, batch_first=True)
        self.body = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.teacher = [copy.deepcopy(self.body).requires_grad_(False)]  # (a list: not a submodule)

    def forward(self, x):
        with torch.no_grad():
            target = self.teacher[0](x)
        return (self.body(x) - target).square().mean()


def build(k: Knobs) -> Job:
    model = Student()
    return Job(model, torch.optim.AdamW(model.parameters()), torch.randn(k.batch_size, k.seq_len, 32),
               loss=lambda m, x: m(x), blocks=nn.TransformerEncoderLayer)
