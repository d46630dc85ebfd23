"""Attention on a real card as the point's card takes it: where that card is emulated on a bigger
one of another capability (config.cards.emulation_fraction: a T4 on an A100), each call whose
kernel differs there (config.attention) is pinned to the emulated card's (a bf16 call to the math
path, as a T4 has no other); every distinct call is noted for the row's attention_calls."""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.nn.functional as F

from harness.config import attention

# config.attention's kernels as torch.nn.attention.SDPBackend names them
BACKENDS = {attention.FLASH: "FLASH_ATTENTION", attention.EFFICIENT: "EFFICIENT_ATTENTION", attention.MATH: "MATH",
            attention.CUDNN: "CUDNN_ATTENTION"}


def pinned(card: tuple[int, int] | None, device: tuple[int, int] | None, call: attention.Call) -> str | None:
    """The kernel to pin `call` to on a device of capability `device` standing for a card of
    capability `card`; None where the device's own choice is the card's (nothing pinned)."""
    want = attention.kernel(card, call)
    return want if want is not None and want != attention.kernel(device, call) else None


def _as_cast(call: attention.Call, query) -> attention.Call:
    """The call as its kernel sees it: under CUDA's autocast (amp_*) attention runs in the
    autocast dtype (a lower-precision op), which casts this wrapper's fp32 arguments after it."""
    if torch.is_autocast_enabled("cuda") and query.dtype in (torch.float32, torch.float16, torch.bfloat16):
        return dataclasses.replace(call, dtype=str(torch.get_autocast_dtype("cuda")).removeprefix("torch."))
    return call


@contextlib.contextmanager
def as_on(card: tuple[int, int] | None, device: tuple[int, int] | None, calls: list):
    """F.scaled_dot_product_attention taking, inside, the kernels a card of capability `card`
    would (`device`: this GPU's), each distinct call appended to `calls`."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    original = F.scaled_dot_product_attention

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        call = _as_cast(attention.call_of(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa), query)
        if call not in calls:
            calls.append(call)
        kernel = pinned(card, device, call)
        with sdpa_kernel([getattr(SDPBackend, BACKENDS[kernel])]) if kernel else contextlib.nullcontext():
            return original(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)

    F.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original
