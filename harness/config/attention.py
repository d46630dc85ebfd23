"""Which kernel CUDA's scaled-dot-product attention takes on a card: its compute capability decides
(aten/src/ATen/native/transformers/cuda/sdp_utils.cpp, select_sdp_backend: flash, else
memory-efficient, else math; cuDNN first on Hopper and Blackwell datacenter cards, sm90/sm10x,
where torch's cuDNN is newer than 9.15, as every CUDA 13 wheel's is: an H200 with torch 2.11 took it
for every bf16 call measured), and the kernels differ in memory: the math path materializes the
B x H x S x S attention matrix that the fused kernels never hold, and each fused backward has
its own scratch (probe.sim.kernel_scratch). A T4 (sm75) has no flash attention and no
bf16 memory-efficient one, so a bf16 model attends there with the math path.

A trace is taken under one card's choices; it holds for another card only where every attention
call it made would take the same kernel there (`takes_alike`).
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import asdict, dataclass
from importlib import metadata
from typing import NamedTuple

FLASH, EFFICIENT, MATH, CUDNN = "flash", "efficient", "math", "cudnn"
ATTENTION_CALLS = "attention_calls"  # the row's column, and a trace's finding (a list of Call as dicts)
# A card of unknown capability answers as the commonest training card does (virtual_cuda: an A100's)
DEFAULT_CAPABILITY = (8, 0)
_HALF = ("float16", "bfloat16")


@dataclass(frozen=True)
class Call:
    """An attention call as the kernel choice sees it."""
    dtype: str  # q's torch dtype without "torch." ("bfloat16")
    head_dim: int  # q's (and k's) last dimension
    value_dim: int
    mask: bool  # an explicit attn_mask
    grad: bool  # an input requires grad (training)
    dropout: bool  # dropout_p > 0
    causal_nonsquare: bool  # is_causal with fewer queries than keys (flash refuses it)
    # torch.backends.cuda.{flash,mem_efficient,math,cudnn}_sdp_enabled() at the call
    enabled: tuple[bool, bool, bool, bool] = (True, True, True, True)
    grouped: bool = False  # K and V have fewer heads than q (grouped-query attention)
    enable_gqa: bool = False  # the call's flag: without it no fused kernel takes grouped K and V


def _in(cap: tuple[int, int], low: tuple[int, int], high: tuple[int, int]) -> bool:
    return low <= cap <= high


def _flash(cap: tuple[int, int], c: Call) -> bool:
    if c.mask or c.causal_nonsquare or c.dtype not in _HALF or not _in(cap, (8, 0), (12, 1)) or not _heads(c, True):
        return False
    if c.head_dim != c.value_dim or c.head_dim > 256 or c.head_dim % 8:
        return False
    # sm86-89 and sm120-121: flash's backward refuses head dims in (192, 224], and (224, 256] with dropout
    if c.grad and (_in(cap, (8, 6), (8, 9)) or _in(cap, (12, 0), (12, 1))):
        return c.head_dim <= 192 or (not c.dropout and c.head_dim > 224)
    return True


@functools.cache
def efficient_takes_grouped() -> bool:
    """Whether the installed torch's memory-efficient kernel takes grouped K and V (enable_gqa) on
    CUDA: from 2.14 (pytorch#191085; its sdp_utils_cpp.h has `supports_mqa`, 2.13's has not).
    Before, its dense constraints refuse them and such a call falls to the math path, which
    expands K and V and materializes the B x H x S x S scores."""
    found = re.match(r"(\d+)\.(\d+)", metadata.version("torch"))
    return found is not None and (int(found[1]), int(found[2])) >= (2, 14)


def rocm(cap: tuple[int, int]) -> bool:
    return cap in ((9, 4), (9, 5))  # MI300/MI350 as torch reports them


def _heads(c: Call, takes_grouped: bool) -> bool:
    # check_batch_size_and_num_heads_dense: grouped K and V only with enable_gqa, to a kernel built for them
    return not c.grouped or (c.enable_gqa and takes_grouped)


def _efficient(cap: tuple[int, int], c: Call) -> bool:
    if not _in(cap, (5, 0), (12, 1)) or not _heads(c, efficient_takes_grouped() and not rocm(cap)):
        return False
    if c.dtype not in (("float16", "float32", "bfloat16") if cap[0] >= 8 else ("float16", "float32")):
        return False
    # minimum_gemm_alignment: the head dims in elements, by tensor-core use
    half = c.dtype in _HALF
    tensor_cores = cap[0] >= 8 or (cap[0] >= 7 and half)
    align = 4 if cap[0] >= 8 else 1
    if tensor_cores:
        align = max(align, 128 // (16 if half else 32))
    return c.head_dim > 0 and c.value_dim > 0 and not c.head_dim % align and not c.value_dim % align


def _prefers_cudnn(cap: tuple[int, int]) -> bool:
    # check_prefer_cudnn_attention: majors 9 and 10 (an MI300X's "9.4" is ROCm's: no cuDNN)
    return cap[0] in (9, 10) and not rocm(cap)


def _cudnn_wide(cap: tuple[int, int]) -> bool:
    # sm90 and sm10x: head dims to 256 (the bprop limits below)
    return cap == (9, 0) or cap[0] == 10


def _cudnn(cap: tuple[int, int], c: Call) -> bool:
    # can_use_cudnn_attention: fp16/bf16 from sm80, head dims %8 and <= 128 (256 on sm90/sm10x,
    # backward then only for <= 128, 192/128 or 256/256); dropout only at multiples of 1/16, which
    # a Call does not record: a call with dropout is left to flash.
    if c.dtype not in _HALF or not _in(cap, (8, 0), (12, 1)) or c.dropout or not _heads(c, True):
        return False
    if c.head_dim % 8 or c.value_dim % 8:
        return False
    if max(c.head_dim, c.value_dim) > (256 if _cudnn_wide(cap) else 128):
        return False
    dims = (c.head_dim, c.value_dim)
    return not c.grad or max(dims) <= 128 or dims in ((192, 128), (256, 256))


def kernel(capability: tuple[int, int] | None, call: Call) -> str | None:
    """The kernel `call` takes on a card of `capability` (None: unknown, an A100's); None where
    every kernel is disabled or refuses it (CUDA raises "No available kernel")."""
    cap = capability or DEFAULT_CAPABILITY
    flash, efficient, math, cudnn = call.enabled
    if cudnn and _prefers_cudnn(cap) and _cudnn(cap, call):
        return CUDNN
    if flash and _flash(cap, call):
        return FLASH
    if efficient and _efficient(cap, call):
        return EFFICIENT
    if math:
        return MATH
    # last in the default order: taken only where the others are off (sdpa_kernel(CUDNN_ATTENTION))
    return CUDNN if cudnn and _cudnn(cap, call) else None


# What each kernel holds, least first: flash keeps the output and a B x H x S log-sum-exp;
# memory-efficient the same with the log-sum-exp padded to 32 (grouped K and V take math before
# torch 2.14: efficient_takes_grouped); math the B x H x S x S scores and their softmax. At every
# moment of a step, a heavier kernel's allocations hold at least a lighter one's. cuDNN's are
# ordered against its own only: its scratch is unrounded where flash's rounds S to 128, and its
# seed and offset are two blocks.
_WEIGHT = {FLASH: 0, EFFICIENT: 1, MATH: 2}


def holds_more(kernels, than) -> bool:
    """Whether each call's kernel in `kernels` holds at least what it does in `than` (same calls)."""
    return all(k is not None and t is not None and (k == t or (k in _WEIGHT and t in _WEIGHT and _WEIGHT[k] >= _WEIGHT[t]))
               for k, t in zip(kernels, than, strict=True))


def swaps_fused(kernels, than) -> bool:
    """Whether `kernels` differ from `than` (same calls) only by cuDNN for flash or back: the same
    outputs and saved tensors, backward scratch of like size (below)."""
    return all(k == t or {k, t} == {FLASH, CUDNN} for k, t in zip(kernels, than, strict=True))


def swapped_to(kernels, than) -> str | None:
    """The fused kernel every fused call of `than` takes in `kernels` where each swaps flash for
    cuDNN (or back), one way for all, and every other call keeps its kernel: a trace of `than`
    rewritten for it (probe.sim.fused_swap) is one of `kernels`. None otherwise."""
    fused = {t for t in than if t in (FLASH, CUDNN)}
    if len(fused) != 1:
        return None
    to = CUDNN if fused == {FLASH} else FLASH
    ok = all((t in fused and k == to) or (t not in fused and k == t) for k, t in zip(kernels, than, strict=True))
    return to if ok else None


def swaps_fused_on(capability: tuple[int, int] | None, column) -> bool:
    """Whether a card of `capability` takes a row's attention_calls as its run did but for cuDNN
    in flash's place or back (swaps_fused)."""
    pairs = taken(column)
    return swaps_fused([kernel(capability, call) for call, _ in pairs], [took for _, took in pairs])


# A fused kernel's rows in a trace (TraceEvent.kernel), for the trace as the other fused kernel runs
# it (probe.sim.fused_swap): "attn:fwd:<output>" for its forward's outputs and scratch,
# "attn:bwd:<kernel>:<shape>[:<block>]" for its backward's scratch. Not sized by the card's SMs.
FUSED_PREFIX = "attn:"


class FusedShape(NamedTuple):
    """A fused call's shapes, as its backward's scratch is sized: batch, heads, key/value heads,
    query and key lengths, head and value dims, bytes an element."""
    b: int
    h: int
    h_k: int
    s_q: int
    s_k: int
    d: int
    d_v: int
    esize: int


def fused_code(phase: str, what: str, shape: FusedShape | None = None, block: int | None = None) -> str:
    parts = [phase, what, *([",".join(map(str, shape))] if shape is not None else []),
             *([str(block)] if block is not None else [])]
    return FUSED_PREFIX + ":".join(parts)


def fused_parts(code: str) -> tuple[str, str, FusedShape | None, int | None]:
    """fused_code's (phase, what, shape, block) from its code."""
    phase, what, *rest = code[len(FUSED_PREFIX):].split(":")
    shape = FusedShape(*(int(v) for v in rest[0].split(","))) if rest else None
    return phase, what, shape, int(rest[1]) if len(rest) > 1 else None


def _r(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def flash_backward_scratch(b: int, h: int, h_k: int, s_q: int, s_k: int, d: int, esize: int) -> list[int]:
    """mha_bwd (flash_api.cpp) after dq, dk, dv: softmax_d (B x H x S_q fp32, S_q rounded to 128),
    dq_accum (B x S_q x H x D fp32, D rounded to 32, above 128 to 64), and with grouped K and V
    dk and dv for every query head in q's dtype. Measured exact on an H200 (torch 2.11), 5 shapes."""
    d = _r(d, 8)
    sizes = [b * h * _r(s_q, 128) * 4, b * _r(s_q, 128) * h * _r(d, 32 if d <= 128 else 64) * 4]
    return sizes + ([b * s_k * h * d * esize] * 2 if h_k != h else [])


def cudnn_backward_scratch(b: int, h: int, h_k: int, s_q: int, s_k: int, d: int, d_v: int, esize: int) -> int:
    """cuDNN's backward workspace, one block after dq, dk, dv: dq accumulated in fp32, dk and dv
    for every query head where K and V are grouped (q's dtype), the softmax sums (fp32), and 256 B.
    Measured exact on an H200 (torch 2.11, cuDNN 9.19), 5 shapes."""
    expanded = b * h * s_k * (d + d_v) * esize if h_k != h else 0
    return b * h * s_q * d * 4 + expanded + b * h * s_q * 4 + 256


def fused_backward_scratch(kernel: str, shape: FusedShape) -> list[int]:
    """The blocks a fused kernel's backward allocates for itself, in order (freed in reverse)."""
    if kernel == FLASH:
        return flash_backward_scratch(*shape[:6], shape.esize)
    return [cudnn_backward_scratch(*shape)]


def attention_class(capability: tuple[int, int] | None) -> str:
    """What of a capability the choice reads: cards of one class choose alike for every call."""
    cap = capability or DEFAULT_CAPABILITY
    bits = (cap[0] >= 8, cap[0] >= 7, _in(cap, (8, 0), (12, 1)), _in(cap, (5, 0), (12, 1)),
            _in(cap, (8, 6), (8, 9)) or _in(cap, (12, 0), (12, 1)), _prefers_cudnn(cap), _cudnn_wide(cap),
            rocm(cap) and efficient_takes_grouped())  # (ROCm's memory-efficient kernel takes no grouped K and V)
    return "".join("1" if b else "0" for b in bits)


def takes_alike(capability: tuple[int, int] | None, column) -> bool:
    """Whether a card of `capability` takes each call of a row's attention_calls with the kernel
    the row's run took (a row without calls: yes)."""
    return all(kernel(capability, call) == took for call, took in taken(column))


def call_of(query, key, value, attn_mask=None, dropout_p: float = 0.0, is_causal: bool = False,
            enable_gqa: bool = False) -> Call:
    """The call F.scaled_dot_product_attention is making, under torch's current settings."""
    import torch

    backends = torch.backends.cuda
    return Call(dtype=str(query.dtype).removeprefix("torch."), head_dim=int(query.shape[-1]),
                value_dim=int(value.shape[-1]), mask=attn_mask is not None,
                grad=torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)),
                dropout=dropout_p > 0, causal_nonsquare=bool(is_causal) and query.shape[-2] != key.shape[-2],
                enabled=(backends.flash_sdp_enabled(), backends.mem_efficient_sdp_enabled(),
                         backends.math_sdp_enabled(), backends.cudnn_sdp_enabled()),
                grouped=key.dim() >= 3 and int(key.shape[-3]) != int(query.shape[-3]), enable_gqa=bool(enable_gqa))


def to_column(calls: list[Call], capability: tuple[int, int] | None) -> str | None:
    """The row's attention_calls: each distinct call with the kernel it took (JSON); None: none."""
    if not calls:
        return None
    return json.dumps([{**asdict(c), "kernel": kernel(capability, c)} for c in calls])


def taken(text) -> list[tuple[Call, str | None]]:
    """Each call of a row's attention_calls with the kernel its run took (none where the row has none)."""
    if not isinstance(text, str) or not text:
        return []
    dicts = json.loads(text)
    calls = from_dicts([{k: v for k, v in d.items() if k != "kernel"} for d in dicts])
    return [(c, d.get("kernel")) for c, d in zip(calls, dicts, strict=True)]


def from_column(text) -> list[Call]:
    """The calls of a row's attention_calls (none where the row has none)."""
    return [c for c, _ in taken(text)]


def from_dicts(dicts: list[dict]) -> list[Call]:
    """Calls from their dicts (a trace's finding, as JSON holds it)."""
    # rows from before cuDNN was modelled record three flags: its own was on by default
    return [Call(**{**d, "enabled": (*d.get("enabled", ()), True, True, True, True)[:4]}) for d in dicts]
