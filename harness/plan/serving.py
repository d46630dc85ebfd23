"""Serving arithmetic: KV-cache bytes per token, and the KV capacity vLLM's startup would compute.

vLLM V1 (`gpu_worker.determine_available_memory`): the budget is `gpu_memory_utilization x total`;
weights, the profile run's activation peak and non-PyTorch memory come off it; the rest becomes KV
blocks of `block_size` tokens, each sequence taking ceil(context / block_size) of them.
"""

from __future__ import annotations

import math

from harness.config.models import attention_shape, shape_config
from harness.config.point import Card, Precision

# Bytes per element of the KV cache, in the dtype its layers compute in (Precision.compute_dtype)
_ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def kv_shape(model_cfg) -> tuple[int, int, int]:
    """(layers, kv_heads, head_dim) of a model config group (grouped-query attention included)."""
    c = shape_config(model_cfg)
    _heads, kv_heads, head_dim = attention_shape(c)
    return c.num_hidden_layers, kv_heads, head_dim


def kv_bytes_per_token(model_cfg, precision: str, tp: int = 1) -> int:
    """K and V, every layer: 2 x layers x kv_heads x head_dim x element bytes; a rank's share of the
    key/value heads over tensor parallel (`tp` divides them: config.point)."""
    layers, kv_heads, head_dim = kv_shape(model_cfg)
    return 2 * layers * (kv_heads // tp) * head_dim * _ELEMENT_BYTES[Precision(precision).compute_dtype]


def vllm_capacity(card: Card, utilization: float, weights_bytes: int, activation_peak_bytes: int,
                  kv_per_token: int, block_size: int, context: int) -> dict:
    """What vLLM's startup arithmetic gives on `card` (as a rank sees it: NCCL's memory in its
    non-PyTorch bytes): KV bytes, blocks, sequences of `context`."""
    budget = int(card.memory_bytes * utilization)
    kv_bytes = budget - weights_bytes - activation_peak_bytes - card.non_pytorch_bytes
    blocks = max(0, kv_bytes // (block_size * kv_per_token))
    return {
        "vllm_budget_bytes": budget,
        "vllm_kv_bytes": kv_bytes,
        "vllm_blocks": blocks,
        "vllm_max_seqs": blocks // math.ceil(context / block_size),
    }


def compare(card: Card, cfg, serve: dict, largest: int | None, row: dict | None) -> dict:
    """The harness's frontier for this card beside vLLM's arithmetic, and the numbers of why they
    differ (report/words.serving_why words them): the harness's cache at its frontier, where its
    peak was, and what the card keeps outside PyTorch."""
    plan, axis = cfg.plan, cfg.plan.axis
    utilization = 1.0 - plan.margin
    kv = serve["kv_bytes_per_token"]
    batch, context = cfg.batch_size, cfg.seq_len
    v = vllm_capacity(card, utilization, serve["weights_bytes"], serve["activation_peak_bytes"], kv,
                      plan.block_size, context)
    if axis == "seq_len":  # the longest context each of `batch` sequences can have
        v["vllm_largest"] = (v["vllm_blocks"] // batch) * plan.block_size
    else:
        v["vllm_largest"] = v["vllm_max_seqs"]
    out = {**v, **serve, "gpu_memory_utilization": utilization, "block_size": plan.block_size,
           "card_non_pytorch_bytes": card.non_pytorch_bytes, "harness_sequences": None, "harness_context": None,
           "harness_cache_bytes": None}
    if largest is not None and row is not None:
        n_b, n_s = (largest, context) if axis == "batch_size" else (batch, largest)
        out.update(harness_sequences=n_b, harness_context=n_s, harness_cache_bytes=n_b * n_s * kv)
    return out
