"""Make a step traced on fake CPU tensors allocate what eager CUDA would allocate.

Each difference listed in shared/reference/fidelity.md (A) is reproduced here, scoped to a
context manager so nothing leaks out of the trace:

- optimizers: CUDA defaults to the foreach path (fused=False); on fake tensors torch picks the
  for-loop path, whose temporaries are one parameter's, not all of them (13% of a 7B peak);
- scaled-dot-product attention: CUDA's kernel choice on the card (config.attention: cuDNN first
  on sm90/sm10x, flash for fp16/bf16 without a mask from sm80 on, memory-efficient otherwise,
  math where none takes the call, a bf16 one on a T4) instead of the CPU kernels; each kernel's
  own scratch is the tracker's (probe.sim.kernel_scratch);
- dropout: CUDA's fused kernel keeps a bool mask (1 B per element) for backward, where the CPU
  path keeps a noise tensor in the input's dtype (4 B in fp32);
- softmax: a Half input to fp32 in one kernel (the CPU copies it to fp32 first); layer norm: its
  saved mean and rstd in fp32 for a Half or BFloat16 input;
- autocast: CUDA's op lists (lower precision for GEMMs, fp32 for exp/pow/rsqrt/norms/losses, fp32
  output for softmax/sum, the widest type for the promoting ops), each call's casts made last
  argument first, with CUDA's cast cache for leaf weights, which lives until the autocast region
  exits (tests/test_autocast.py holds it to CUDA's own autocast kernels).
"""

from __future__ import annotations

import contextlib
import math
import os
import sys

import torch
import torch.nn.functional as F
from torch._subclasses import fake_impls
from torch._subclasses.fake_tensor import FakeTensor
from torch.overrides import TorchFunctionMode, handle_torch_function, has_torch_function_variadic

from harness.config import attention

# ---- scaled dot-product attention ----------------------------------------------------------

_original_sdpa = F.scaled_dot_product_attention


# The card's compute capability, and where each distinct attention call is noted (cuda_kernels)
_attention: dict = {"capability": None, "calls": None}


def cuda_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
              enable_gqa=False):
    """F.scaled_dot_product_attention as CUDA dispatches it on the traced card: cuDNN first where
    the card prefers it, flash, memory-efficient, the math path, each only while enabled (torch.backends.cuda.*_sdp_enabled,
    sdpa_kernel) and where the card's capability takes it (config.attention). A torch function
    as the one it stands for: the modes above it (CudaAutocast: CUDA's autocast casts SDPA's inputs
    to the lower precision) see it."""
    if has_torch_function_variadic(query, key, value, attn_mask):
        return handle_torch_function(cuda_sdpa, (query, key, value, attn_mask), query, key, value, attn_mask=attn_mask,
                                     dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
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


# ---- autocast with CUDA's op lists -----------------------------------------------------------

# aten/src/ATen/autocast_mode.cpp, CUDA policy, by the Python functions that reach its ops (the
# dispatcher's AutocastCUDA kernels: tests/test_autocast.py holds each to them on fake CUDA tensors)
_LOWER = {
    F.linear, torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.mm, torch.Tensor.mm,
    torch.bmm, torch.Tensor.bmm, torch.baddbmm, torch.Tensor.baddbmm, torch.addmm, torch.Tensor.addmm,
    torch.addbmm, torch.Tensor.addbmm, torch.addmv, torch.Tensor.addmv, torch.mv, torch.Tensor.mv,
    torch.addr, torch.Tensor.addr, torch.chain_matmul, torch.linalg.multi_dot, torch.linalg.vecdot,
    torch.einsum, F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d,
    F.prelu, F.scaled_dot_product_attention, cuda_sdpa,
}
_FP32 = {
    torch.exp, torch.Tensor.exp, torch.log, torch.Tensor.log, torch.rsqrt, torch.Tensor.rsqrt,
    torch.pow, torch.Tensor.pow, torch.Tensor.__pow__, torch.reciprocal, torch.Tensor.reciprocal,
    torch.log1p, torch.Tensor.log1p, torch.expm1, torch.Tensor.expm1, torch.log10, torch.Tensor.log10,
    torch.log2, torch.Tensor.log2, torch.acos, torch.Tensor.acos, torch.asin, torch.Tensor.asin,
    torch.cosh, torch.Tensor.cosh, torch.sinh, torch.Tensor.sinh, torch.tan, torch.Tensor.tan,
    torch.erfinv, torch.Tensor.erfinv, F.layer_norm, F.group_norm, F.rms_norm, F.softplus, torch.logsumexp,
    torch.Tensor.logsumexp, torch.renorm, torch.Tensor.renorm, torch.dist, torch.Tensor.dist, torch.cdist,
    F.pdist, F.cosine_similarity, F.nll_loss, F.mse_loss, F.l1_loss, F.smooth_l1_loss, F.huber_loss, F.kl_div,
    F.binary_cross_entropy_with_logits, F.margin_ranking_loss, F.soft_margin_loss, F.multilabel_margin_loss,
    F.multi_margin_loss, F.hinge_embedding_loss, F.cosine_embedding_loss, F.poisson_nll_loss,
}
_PROMOTE = {
    torch.addcmul, torch.Tensor.addcmul, torch.addcdiv, torch.Tensor.addcdiv, torch.atan2, torch.Tensor.atan2,
    torch.cross, torch.Tensor.cross, torch.dot, torch.Tensor.dot, torch.vdot, torch.Tensor.vdot, torch.tensordot,
    F.bilinear, F.grid_sample, torch.scatter_add, torch.Tensor.scatter_add, torch.index_put, torch.Tensor.index_put,
}
_FP32_OUT = {  # run with dtype=float32 when the input is lower precision
    torch.softmax, torch.Tensor.softmax, F.softmax, torch.log_softmax, torch.Tensor.log_softmax,
    F.log_softmax, torch.sum, torch.Tensor.sum, torch.cumsum, torch.Tensor.cumsum, torch.prod, torch.Tensor.prod,
    torch.cumprod, torch.Tensor.cumprod, torch.linalg.vector_norm, torch.linalg.matrix_norm, torch.norm,
    torch.Tensor.norm,
}
_LOW_DTYPES = (torch.float16, torch.bfloat16)


def _given_dtype(args, kwargs) -> torch.dtype | None:
    """The dtype a call asks for (a keyword, or positional: a torch.dtype is only ever that argument)."""
    return kwargs.get("dtype") or next((a for a in args[1:] if isinstance(a, torch.dtype)), None)


def _resamples(input=None, size=None, scale_factor=None, mode="nearest", *args, **kwargs) -> bool:
    """Whether F.interpolate takes an upsample kernel (CUDA's fp32 list: every mode but 'area',
    which pools)."""
    return mode != "area"


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


class CudaAutocast(TorchFunctionMode):
    """CUDA autocast's casting policy for tensors that live on a (fake) CPU device."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype
        self._cache: dict[int, torch.Tensor] = {}  # leaf weight id -> cast copy (CUDA cached_cast)
        self._disabled = 0

    def _cast(self, t, dtype):
        if isinstance(t, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in t):  # a TensorList: in order
            return type(t)(self._cast(x, dtype) for x in t)
        # (CUDA's autocast leaves float64 as it is: autocast_mode.h, is_eligible)
        if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.dtype in (dtype, torch.float64):
            return t
        # cached_cast's condition: an fp32 leaf that requires grad, cast to autocast's dtype
        cacheable = dtype == self.dtype and t.dtype == torch.float32 and t.is_leaf and t.requires_grad
        if cacheable and id(t) in self._cache:
            return self._cache[id(t)]
        with torch._C.DisableTorchFunction():
            out = t.to(dtype)
        if cacheable and not torch.is_inference_mode_enabled():
            self._cache[id(t)] = out
        return out

    def _cast_all(self, args, kwargs, dtype):
        # Last argument first, as the C++ autocast wrapper's casts run (`cached_cast(...)...`, a pack
        # expanded into a call's arguments: GCC, which builds torch's wheels, evaluates those right
        # to left): F.linear's weight is cast before its input, and takes the lower address
        kwargs = dict(reversed([(k, self._cast(v, dtype)) for k, v in reversed(kwargs.items())]))
        args = tuple(reversed([self._cast(a, dtype) for a in reversed(args)]))
        return args, kwargs

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._disabled:
            return func(*args, **kwargs)
        if func in _LOWER:
            args, kwargs = self._cast_all(args, kwargs, self.dtype)
        elif func in _FP32:
            args, kwargs = self._cast_all(args, kwargs, torch.float32)
        elif func in _PROMOTE:  # the widest floating type of the arguments, autocast's own at least
            wider = any(isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype not in (self.dtype, torch.float64)
                        for t in (*args, *kwargs.values()))
            # (fp16 and bf16 meet in fp32, as fp32 does: a dispatched promote_types would be an op)
            args, kwargs = self._cast_all(args, kwargs, torch.float32 if wider else self.dtype)
        elif func in _FP32_OUT:
            first = args[0] if args else None
            if isinstance(first, torch.Tensor) and first.dtype in _LOW_DTYPES and _given_dtype(args, kwargs) is None:
                kwargs = {**kwargs, "dtype": torch.float32}
        elif func is F.cross_entropy:
            # Composite: log_softmax in the input's dtype, then nll_loss in fp32, as the C++ autocast sees it.
            return self._cross_entropy(*args, **kwargs)
        elif func is F.normalize:  # composite: its norm (linalg_vector_norm) gives fp32, the division too
            return self._normalize(*args, **kwargs)
        elif func is F.interpolate and _resamples(*args, **kwargs):
            args = (self._cast(args[0], torch.float32), *args[1:])
        return func(*args, **kwargs)

    def _normalize(self, input, p=2.0, dim=1, eps=1e-12, out=None):
        dtype = torch.float32 if input.dtype in _LOW_DTYPES else None
        denom = input.norm(p, dim, keepdim=True, dtype=dtype).clamp_min(eps).expand_as(input)
        return torch.div(input, denom, out=out) if out is not None else input / denom

    def _cross_entropy(self, input, target, weight=None, size_average=None, ignore_index=-100,
                       reduce=None, reduction="mean", label_smoothing=0.0):
        dim = 1 if input.dim() >= 2 else 0
        # cross_entropy_loss asks log_softmax for the input's own dtype (autocast then sets none),
        # and nll_loss casts the log-probabilities to fp32
        if label_smoothing > 0 and (weight is not None or target.is_floating_point()):
            # (not emulated: CUDA's smoothing with class weights or class probabilities)
            return F.cross_entropy(input, target, weight, ignore_index=ignore_index, reduction=reduction,
                                   label_smoothing=label_smoothing)
        logp = torch.log_softmax(input, dim, dtype=input.dtype)
        (nll_in, target, weight), _ = self._cast_all((logp, target, weight), {}, torch.float32)
        nll = F.nll_loss(nll_in, target, weight, ignore_index=ignore_index, reduction=reduction)
        if label_smoothing <= 0:
            return nll
        # cross_entropy_loss_label_smoothing: the log-probabilities' sum over classes (autocast's fp32
        # sum), the ignored targets' zeroed, reduced (C++ operands evaluated right to left)
        smooth = -logp.sum(dim, dtype=torch.float32 if logp.dtype in _LOW_DTYPES else None)
        ignored = target == ignore_index
        smooth.masked_fill_(ignored, 0.0)
        if reduction == "mean":
            kept = (~ignored).sum()
            smooth = smooth.sum() / kept
        elif reduction == "sum":
            smooth = smooth.sum()
        scale = torch.ops.aten.mul.Scalar  # (as C++ scales by a double: Python's `*` wraps it a Tensor)
        smoothed = scale(smooth, label_smoothing / input.shape[dim])
        return scale(nll, 1 - label_smoothing) + smoothed

    def exit_region(self):
        self._cache.clear()


_CHECKPOINT_FILE = os.path.join("torch", "utils", "checkpoint.py")


@contextlib.contextmanager
def _respect_autocast_disabled(mode: CudaAutocast):
    """Code that turns autocast off (`torch.autocast(..., enabled=False)`, e.g. rotary
    embeddings) turns our emulation off too."""
    cls = torch.amp.autocast_mode.autocast
    orig_enter, orig_exit = cls.__enter__, cls.__exit__

    def enter(self):
        # torch.utils.checkpoint's recompute restores the CPU autocast state of the forward (off)
        # beside CUDA's: that is not code turning CUDA's autocast off.
        restoring = sys._getframe(1).f_code.co_filename.endswith(_CHECKPOINT_FILE)
        self._harness_off = not self._enabled and not restoring
        if self._harness_off:
            mode._disabled += 1
        return orig_enter(self)

    def exit(self, *exc):
        if getattr(self, "_harness_off", False):
            mode._disabled -= 1
        return orig_exit(self, *exc)

    cls.__enter__, cls.__exit__ = enter, exit  # type: ignore[method-assign]  # patched for the trace, restored below
    try:
        yield
    finally:
        cls.__enter__, cls.__exit__ = orig_enter, orig_exit  # type: ignore[method-assign]


def _active_autocast() -> CudaAutocast | None:
    """The CUDA autocast emulation in force here (None outside one, or where code turned it off)."""
    from torch.overrides import _get_current_function_mode_stack

    for mode in reversed(_get_current_function_mode_stack()):
        if isinstance(mode, CudaAutocast):
            return None if mode._disabled else mode
    return None


@contextlib.contextmanager
def checkpoint_keeps_autocast():
    """Activation checkpointing records CUDA's autocast state at the forward and re-enters it for
    the recompute inside backward (torch.utils.checkpoint, both the reentrant and non-reentrant
    forms). The emulation is not torch's own autocast state, so report it there: the recompute then
    enters `torch.autocast("cuda", ...)`, which the trace turns into the emulation again
    (cuda_script.script_autocast), and recomputes what the forward computed, in the same dtypes."""
    import torch.utils.checkpoint as cp

    original, original_device = cp._get_autocast_kwargs, cp._infer_device_type

    def device_type(*args):  # every tensor of the trace stands for a CUDA one
        found = original_device(*args)
        return "cuda" if found == "cpu" else found

    def autocast_kwargs(device_type="cuda"):
        device, cpu = original(device_type)
        mode = _active_autocast()
        if device_type == "cuda" and mode is not None:
            device = {"enabled": True, "dtype": mode.dtype, "cache_enabled": True}
        return device, cpu

    cp._get_autocast_kwargs, cp._infer_device_type = autocast_kwargs, device_type
    try:
        yield
    finally:
        cp._get_autocast_kwargs, cp._infer_device_type = original, original_device


@contextlib.contextmanager
def autocast_region(mode: CudaAutocast | None):
    """One autocast region (e.g. a forward pass); the cast cache dies with it."""
    if mode is None:
        yield
        return
    try:
        with _respect_autocast_disabled(mode), mode:
            yield
    finally:
        mode.exit_region()


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

# softmax and log_softmax of a Half input to fp32: CUDA's is one kernel (SoftMax.cpp, half_to_float),
# where the CPU's first copies the input to fp32 (an fp32 copy of the scores of eager attention)
_SOFTMAXES = {f: torch.ops.aten._softmax.default for f in (torch.softmax, torch.Tensor.softmax, F.softmax)} | {
    f: torch.ops.aten._log_softmax.default for f in (torch.log_softmax, torch.Tensor.log_softmax, F.log_softmax)}


class _HalfToFloat(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        fused = _SOFTMAXES.get(func)
        # (fake tensors only: a script's real host tensors run the CPU's kernel, which has no such path)
        if fused is not None and args and isinstance(args[0], FakeTensor) and args[0].dtype == torch.float16:
            dim = args[1] if len(args) > 1 else kwargs.get("dim")
            if _given_dtype(args, kwargs) == torch.float32 and isinstance(dim, int):
                return fused(args[0], dim, True)
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
    statistics in fp32, as CUDA's kernels make them."""
    F.scaled_dot_product_attention, F.dropout = cuda_sdpa, cuda_dropout
    saved = dict(_attention)
    _attention.update(capability=capability, calls=calls)
    _fake_impl(_layer_norm_statistics_in_fp32)
    try:
        with _HalfToFloat():
            yield
    finally:
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
