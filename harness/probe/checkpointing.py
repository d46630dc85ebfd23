"""What activation checkpointing keeps of a block (checkpointing_policy): the arguments to
torch.utils.checkpoint.checkpoint for each policy, the same on the virtual GPU, the CPU and the card."""

from __future__ import annotations

import functools
from collections import defaultdict

import torch

from harness.config.point import CheckpointingPolicy


@functools.cache  # asked at every checkpointed layer's forward and recompute; the ops never change
def _op_save_list() -> frozenset:
    """torchtitan's _op_sac_save_list (its Llama parallelize module, 2025-26), as far as torch
    has the ops: matmuls, attention's kernels, tensor parallel's reduce-scatter, max (float8's scales);
    and the CPU's flash attention, which backend=cpu runs where CUDA runs flash."""
    aten = torch.ops.aten
    names = ("_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_fused_attention_overrideable",
             "_scaled_dot_product_flash_attention_for_cpu")
    ops = {aten.mm.default, aten.max.default, *(getattr(aten, n).default for n in names if hasattr(aten, n))}
    if hasattr(torch.ops, "_c10d_functional"):
        ops.add(torch.ops._c10d_functional.reduce_scatter_tensor.default)
    return frozenset(ops)


def _op_context():
    """A fresh policy per checkpointed call (a block's forward, then its recompute): every op of the
    save list is kept but every second matmul, counted apart in forward and in recompute as torchtitan
    counts, so that the recompute makes again exactly what the forward dropped."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    save, mm = _op_save_list(), torch.ops.aten.mm.default
    counts: dict[bool, int] = defaultdict(int)

    def policy(ctx, func, *args, **kwargs):
        if func == mm:
            counts[ctx.is_recompute] += 1
        keep = func in save and not (func == mm and counts[ctx.is_recompute] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def checkpoint_kwargs(policy: CheckpointingPolicy | str = CheckpointingPolicy.full) -> dict:
    """Keyword arguments for torch.utils.checkpoint.checkpoint (non-reentrant, as HF and torchtitan
    use it) under `policy`."""
    kwargs: dict = {"use_reentrant": False}
    if CheckpointingPolicy(policy) == CheckpointingPolicy.op:
        kwargs["context_fn"] = _op_context
    return kwargs
