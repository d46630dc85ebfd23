"""Make a step traced on fake CPU tensors allocate what eager CUDA would allocate.

Each difference listed in shared/reference/fidelity.md (A) is reproduced here, scoped to a
context manager so nothing leaks out of the trace:

- optimizers: CUDA defaults to the foreach path (fused=False); on fake tensors torch picks the
  for-loop path, whose temporaries are one parameter's, not all of them (13% of a 7B peak);
- clip_grad_norm_ (and clip_grad_value_): CUDA's tensors take one _foreach_norm (its chunks' partial
  norms: probe.sim.kernel_scratch), a FakeTensor a vector norm each (a reduction's scratch each);
- scaled-dot-product attention: CUDA's kernel choice on the card (config.attention: cuDNN first
  on sm90/sm10x, flash for fp16/bf16 without a mask from sm80 on, memory-efficient otherwise,
  math where none takes the call, a bf16 one on a T4) instead of the CPU kernels; each kernel's
  own scratch is the tracker's (probe.sim.kernel_scratch);
- dropout: CUDA's fused kernel keeps a bool mask (1 B per element) for backward, where the CPU
  path keeps a noise tensor in the input's dtype (4 B in fp32);
- softmax: a Half input to fp32 in one kernel (the CPU copies it to fp32 first); layer norm: its
  saved mean and rstd in fp32 for a Half or BFloat16 input;
- autocast: CUDA's policy run by the dispatcher, op by op (probe.sim.autocast_kernels); SDPA's
  casts made here, where its kernel is chosen.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch._subclasses import fake_impls
from torch.overrides import TorchFunctionMode, handle_torch_function, has_torch_function_variadic

from harness.config import attention
from harness.probe.sim import autocast_kernels

# ---- scaled dot-product attention ----------------------------------------------------------

_original_sdpa = F.scaled_dot_product_attention


# The card's compute capability, and where each distinct attention call is noted (cuda_kernels)
_attention: dict = {"capability": None, "calls": None}


def cuda_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
              enable_gqa=False):
    """F.scaled_dot_product_attention as CUDA dispatches it on the traced card: cuDNN first where
    the card prefers it, flash, memory-efficient, the math path, each only while enabled (torch.backends.cuda.*_sdp_enabled,
    sdpa_kernel) and where the card's capability takes it (config.attention); under autocast, its
    inputs cast to the lower precision as CUDA's autocast kernel for it casts them. A torch function
    as the one it stands for: the modes above it see it."""
    if has_torch_function_variadic(query, key, value, attn_mask):
        return handle_torch_function(cuda_sdpa, (query, key, value, attn_mask), query, key, value, attn_mask=attn_mask,
                                     dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    low = autocast_kernels.active()
    if low is not None:  # CUDA's autocast kernel for it: its tensors to the lower precision, the rest below autocast
        with autocast_kernels.below_autocast():
            (query, key, value, attn_mask), _ = autocast_kernels.cast_all((query, key, value, attn_mask), {}, low)
            return _sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    return _sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


def _sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    call = attention.call_of(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
    calls = _attention["calls"]
    if calls is not None and call not in calls:
        calls.append(call)
    chosen = attention.kernel(_attention["capability"], call)
    if chosen == attention.FLASH:
        out = torch.ops.aten._scaled_dot_product_flash_attention(
            query, key, value, dropout_p, is_causal, False, scale=scale)
        return out[0]
    if chosen is None:
        raise RuntimeError("No available kernel for scaled_dot_product_attention: cuDNN, flash, memory-efficient "
                           "and math are all disabled or ineligible")
    if chosen == attention.MATH:
        return torch.ops.aten._scaled_dot_product_attention_math(
            query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)[0]
    attn_mask = _additive(attn_mask, query.dtype)
    if chosen == attention.CUDNN:  # grouped K and V as they are: cuDNN takes them
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
        return torch.ops.aten._scaled_dot_product_cudnn_attention(
            query, key, value, attn_mask, grad, dropout_p, is_causal and attn_mask is None, False, scale=scale)[0]
    # (grouped K and V reach here only where the installed torch's kernel takes them as they are)
    if attn_mask is not None:
        attn_mask = attn_mask.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])
    out = torch.ops.aten._scaled_dot_product_efficient_attention(
        query, key, value, attn_mask, query.requires_grad, dropout_p, is_causal, scale=scale)
    return out[0]


def _additive(attn_mask, dtype):
    """sdp::convert_boolean_attn_mask: a bool mask becomes an additive one in q's dtype, made from
    two 0-dim tensors of that dtype (as a real trace shows: 2 B, 2 B, then the S x S mask)."""
    if attn_mask is None or attn_mask.dtype != torch.bool:
        return attn_mask
    zero = torch.zeros((), dtype=dtype, device=attn_mask.device)
    minus_inf = torch.full((), -math.inf, dtype=dtype, device=attn_mask.device)
    return torch.where(attn_mask, zero, minus_inf)


# ---- dropout ----------------------------------------------------------------------------------

_original_dropout = F.dropout


def cuda_dropout(input, p=0.5, training=True, inplace=False):
    """F.dropout as CUDA runs it: out of place, training and 0 < p < 1 take the fused kernel
    (at::native_dropout: the output and a bool mask); otherwise what every device does."""
    if inplace or not training or not 0.0 < p < 1.0 or input.numel() == 0 or input.is_nested:
        return _original_dropout(input, p, training, inplace)
    return torch.ops.aten.native_dropout(input, p, True)[0]


# ---- grouped GEMM -------------------------------------------------------------------------------

def grouped_mm_output(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
    """What CUDA's torch._grouped_mm allocates: its output, its rows padded to 16 bytes as
    create_grouped_gemm_output_tensor makes it (GroupedBlas.cpp), for bf16 operands (the fast
    kernel; torch's meta function pads only on a CUDA build) and for others, where
    _grouped_mm_fallback loops mm_out over the groups and the meta function refuses them outright
    (an MoE's experts in fp32, under autocast too: torch has no autocast rule for _grouped_mm)."""
    a_2d, b_2d = mat_a.dim() == 2, mat_b.dim() == 2
    if a_2d:
        size = [offs.size(0), mat_a.size(0), mat_b.size(1)] if b_2d else [mat_a.size(0), mat_b.size(-1)]
    else:
        size = [mat_a.size(1), mat_b.size(1)] if b_2d else [mat_a.size(0), mat_a.size(1), mat_b.size(-1)]
    dtype = out_dtype or mat_a.dtype
    align = 16 // dtype.itemsize
    padded = -(-size[-1] // align) * align
    stride = [size[1] * padded, padded, 1] if a_2d == b_2d else [padded, 1]
    return mat_a.new_empty_strided(size, stride, dtype=dtype)  # (on mat_a's own device, as the virtual card's)


@contextlib.contextmanager
def checkpoint_keeps_autocast():
    """Activation checkpointing records the autocast state of the forward's device and the CPU's,
    and re-enters both for the recompute inside backward (torch.utils.checkpoint, both the
    reentrant and non-reentrant forms): every tensor of the trace stands for a CUDA one, so the
    device's is CUDA's, which the trace's `torch.autocast("cuda")` makes a region of the emulation
    again (cuda_script.script_autocast), recomputing what the forward computed in the same dtypes."""
    import torch.utils.checkpoint as cp

    original = cp._infer_device_type

    def device_type(*args):
        found = original(*args)
        return "cuda" if found == "cpu" else found

    cp._infer_device_type = device_type
    try:
        yield
    finally:
        cp._infer_device_type = original


@contextlib.contextmanager
def unpacked_sequences():
    """transformers reads position_ids' values to rule out packed sequences, and on fake tensors,
    which have no values, assumes packing: it then builds a full mask instead of SDPA's is_causal,
    which changes the attention kernel and adds tensors a real run never has. Our position ids
    are never packed, so do the real check's tensor work and give the real answer (None)."""
    from transformers import masking_utils as mu

    original = mu.find_packed_sequence_indices

    def no_packing(position_ids):
        first = position_ids[:, :1] - 1
        diff = torch.diff(position_ids, prepend=first, dim=-1)
        ((diff != 1).cumsum(-1)[:, -1] == 0).all()  # the real run's allocations; its value is True
        return None

    mu.find_packed_sequence_indices = no_packing
    try:
        yield
    finally:
        mu.find_packed_sequence_indices = original


# ---- kernels whose outputs differ from the CPU's -----------------------------------------------

_LOW_DTYPES = (torch.float16, torch.bfloat16)

# A softmax or log_softmax asking for fp32 of a Half input: CUDA's one kernel
# (autocast_kernels.softmax_half_to_float; no fp32 copy of eager attention's scores first)
_SOFTMAXES = {f: "softmax" for f in (torch.softmax, torch.Tensor.softmax, F.softmax)} | {
    f: "log_softmax" for f in (torch.log_softmax, torch.Tensor.log_softmax, F.log_softmax)}


def _given_dtype(args, kwargs) -> torch.dtype | None:
    """The dtype a call asks for (a keyword, or positional: a torch.dtype is only ever that argument)."""
    return kwargs.get("dtype") or next((a for a in args[1:] if isinstance(a, torch.dtype)), None)


class _HalfToFloat(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _SOFTMAXES.get(func)
        if name is not None and args and isinstance(args[0], torch.Tensor):
            dim = args[1] if len(args) > 1 else kwargs.get("dim")
            out = autocast_kernels.softmax_half_to_float(name, args[0], dim, _given_dtype(args, kwargs))
            if out is not None:
                return out
        return func(*args, **kwargs)


_TORCHS_LAYER_NORM = fake_impls.op_implementations_dict.get(torch.ops.aten.native_layer_norm.default)


def _layer_norm_statistics_in_fp32(fake_mode, func, input, *args, **kwargs):
    """native_layer_norm as CUDA's kernel makes it: its mean and rstd (saved for backward) in fp32 for
    a Half or BFloat16 input, where FakeTensor's CPU path casts them to the input's dtype."""
    out, mean, rstd = _TORCHS_LAYER_NORM(fake_mode, func, input, *args, **kwargs)
    if input.dtype in _LOW_DTYPES and mean.dtype != torch.float32:
        with fake_mode:
            mean, rstd = (torch.empty_strided(t.shape, t.stride(), dtype=torch.float32, device=t.device)
                          for t in (mean, rstd))
    return out, mean, rstd


@contextlib.contextmanager
def cuda_kernels(capability: tuple[int, int] | None = None, calls: list | None = None):
    """Route F.scaled_dot_product_attention and F.dropout through CUDA's kernels while tracing, the
    attention kernel chosen as on a card of `capability` (None: an A100's), each distinct attention
    call appended to `calls` (config.attention.Call); a Half softmax to fp32 fused, and layer norm's
    statistics in fp32, as CUDA's kernels make them; torch's foreach paths taken where a CUDA
    tensor takes them."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.utils import _foreach_utils

    F.scaled_dot_product_attention, F.dropout = cuda_sdpa, cuda_dropout
    saved = dict(_attention)
    _attention.update(capability=capability, calls=calls)
    _fake_impl(_layer_norm_statistics_in_fp32)
    # torch's foreach paths take a plain tensor (type(t) is Tensor): a FakeTensor stands for one
    # (the list itself, in place: torch.distributed.tensor appended DTensor to it by name)
    foreach_types = _foreach_utils._foreach_supported_types
    added = FakeTensor not in foreach_types
    if added:
        foreach_types.append(FakeTensor)
    try:
        with _HalfToFloat():
            yield
    finally:
        if added:
            foreach_types.remove(FakeTensor)
        F.scaled_dot_product_attention, F.dropout = _original_sdpa, _original_dropout
        _attention.update(saved)
        _fake_impl(_TORCHS_LAYER_NORM)


def _fake_impl(impl) -> None:
    """native_layer_norm's FakeTensor implementation made `impl`, and FakeTensorMode's cache (one
    for every mode in the process) cleared of its outputs made by the other."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    op = torch.ops.aten.native_layer_norm.default
    if _TORCHS_LAYER_NORM is None:  # (a torch that implements it otherwise: as that torch does)
        return
    fake_impls.op_implementations_dict[op] = impl
    for key in [k for k in FakeTensorMode.cache if k.key and k.key[0] is op]:
        del FakeTensorMode.cache[key]
