"""A plain PyTorch GPT with its own training step, measured as it is.

    python -m harness sweep workload=custom workload.target=examples.gpt:build \
        batch_size=4,8 seq_len=512,1024 precision=bf16 checkpointing=false,true

Over several GPUs it spreads itself over the mesh it is handed (`parallel.dp_shard=8`: FSDP2;
`parallel.dp_replicate=8`: DDP; both: HSDP).
"""

import torch
import torch.nn.functional as F
from torch import nn

from harness.workload import Job, Knobs


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, context: int):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(context, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def train_step(model, optimizer, batch):
    """One step as a training script writes it."""
    x, y = batch
    logits = model(x)
    loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def spread(model: GPT, mesh) -> nn.Module:
    """The model over the job's GPUs: FSDP2 on each block and then the root, as torchtitan applies
    it (over 2-D dp_replicate x dp_shard: HSDP), or DDP where it is only replicated."""
    names = mesh.mesh_dim_names
    if "tp" in names:
        raise ValueError("examples.gpt spreads itself by FSDP2 or DDP: parallel.tp needs a tensor-parallel plan")
    if "dp_shard" in names:
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        return fully_shard(model, mesh=mesh)
    return nn.parallel.DistributedDataParallel(model)


def build(k: Knobs) -> Job:
    layers, d = int(k.args.get("layers", 4)), int(k.args.get("d_model", 256))
    heads, vocab = int(k.args.get("heads", 4)), int(k.args.get("vocab", 8192))
    model = GPT(vocab, d, layers, heads, context=k.seq_len).to(k.dtype)
    if k.mesh is not None:
        model = spread(model, k.mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    x = torch.randint(0, vocab, (k.batch_size, k.seq_len))
    y = torch.randint(0, vocab, (k.batch_size, k.seq_len))
    return Job(model, optimizer, (x, y), step=train_step, blocks=Block, name=f"gpt-{layers}x{d}")
