"""A job with recurrent layers (nn.LSTM, nn.GRU): a GPU runs them through cuDNN's RNN, whose own
memory the virtual GPU does not model."""

import torch
import torch.nn as nn
import torch.nn.functional as F

from harness.workload import Job, Knobs


class Tagger(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.emb = nn.Embedding(100, width)
        self.encoder = nn.LSTM(width, width, batch_first=True)
        self.decoder = nn.GRU(width, width, batch_first=True)
        self.head = nn.Linear(width, 100)

    def forward(self, x):
        h, _ = self.encoder(self.emb(x))
        h, _ = self.decoder(h)
        return self.head(h)


def build(k: Knobs) -> Job:
    model = Tagger(32).to(k.dtype)
    x = torch.randint(0, 100, (k.batch_size, k.seq_len))
    return Job(model, torch.optim.AdamW(model.parameters()), (x, x),
               loss=lambda m, b: F.cross_entropy(m(b[0]).flatten(0, 1).float(), b[1].flatten()))
