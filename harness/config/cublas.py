"""The cuBLAS workspace PyTorch allocates per handle and stream through the caching allocator
(aten/src/ATen/cuda/CublasHandlePool.cpp, parseChosenWorkspaceSize): ":4096:2:16:8", 8,519,680 B,
below Hopper; 32 MiB on sm90, sm100 and sm120 (PyTorch main); on ROCm 128 MiB for gfx94x/gfx95x
(an MI300X reports capability 9.4). CUBLAS_WORKSPACE_CONFIG (":SIZE_KIB:COUNT" pairs) overrides it.
A training step holds two (the caller's thread, autograd's device thread), so a trace is the card's."""

from __future__ import annotations

import os
import re

from harness.config.attention import DEFAULT_CAPABILITY

ENV = "CUBLAS_WORKSPACE_CONFIG"
DEFAULT_BYTES = 4096 * 1024 * 2 + 16 * 1024 * 8  # 8,519,680: what real traces below Hopper show
HOPPER_ON_BYTES = 4096 * 8 * 1024
ROCM_GFX94_BYTES = 1024 * 128 * 1024


def workspace_bytes(capability: tuple[int, int] | None, config: str | None = None) -> int:
    """Bytes of one workspace on a card of `capability` (None: an A100's), under `config`
    (None: this process's CUBLAS_WORKSPACE_CONFIG, where set)."""
    config = os.environ.get(ENV) if config is None else config
    pairs = re.findall(r":([0-9]+):([0-9]+)", config or "")
    if pairs:
        return sum(int(size) * 1024 * int(count) for size, count in pairs)
    cap = capability or DEFAULT_CAPABILITY
    if cap in ((9, 4), (9, 5)):  # no NVIDIA card has these: ROCm's gfx94x / gfx95x
        return ROCM_GFX94_BYTES
    return HOPPER_ON_BYTES if cap[0] in (9, 10, 12) else DEFAULT_BYTES


def config_for(capability: tuple[int, int] | None) -> str:
    """A CUBLAS_WORKSPACE_CONFIG that makes a card of `capability`'s default workspace (torch's
    own string below Hopper; one workspace of the size otherwise): an emulated card's on another."""
    size = workspace_bytes(capability, config="")
    return ":4096:2:16:8" if size == DEFAULT_BYTES else f":{size // 1024}:1"
