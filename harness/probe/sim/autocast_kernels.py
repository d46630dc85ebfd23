"""CUDA's autocast on the trace's fake CPU tensors, run by the dispatcher as on a GPU: a Python
kernel for the AutocastCPU key of each aten op CUDA's autocast handles, with CUDA's policy for it
(aten/src/ATen/autocast_mode.cpp, AutocastCUDA), and CPU's own autocast kernels passed through
elsewhere. The CPU's autocast state stands for CUDA's while they are registered (`cuda_policy`).

Op by op, as the dispatcher sees them: the ops that composites and Python functions call inside
(nn.MultiheadAttention's linears, cross_entropy's log_softmax and nll_loss) are cast as CUDA casts
them, each op's inner calls not (its autocast key excluded while it runs), and a call's casts made
last argument first, as the C++ wrapper's pack expansion makes them (GCC, right to left).
tests/test_autocast.py holds it to CUDA's own kernels on fake CUDA tensors."""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import warnings
import weakref

import torch
from torch._subclasses.fake_tensor import FakeTensor

# autocast_mode.cpp's CUDA lists, by aten overload; each op CUDA's autocast has a kernel for is in
# one of them (tests/test_autocast.py checks the set against the installed torch's dispatcher)
LOWER = frozenset("""
_convolution _convolution.deprecated _scaled_dot_product_flash_attention _thnn_fused_gru_cell
_thnn_fused_lstm_cell addbmm addmm addmv addr baddbmm bmm chain_matmul conv1d conv2d conv3d conv_tbc
conv_transpose1d conv_transpose2d.input conv_transpose3d.input convolution cudnn_convolution
cudnn_convolution_transpose einsum gru_cell linalg_multi_dot linalg_vecdot linear lstm_cell matmul mm mv
prelu rnn_relu_cell rnn_tanh_cell scaled_dot_product_attention
""".split())
FP32 = frozenset("""
_upsample_bicubic2d_aa _upsample_bilinear2d_aa _upsample_nearest_exact1d _upsample_nearest_exact2d
_upsample_nearest_exact3d acos asin binary_cross_entropy_with_logits cdist cosh cosine_embedding_loss
cosine_similarity dist erfinv exp expm1 frobenius_norm.dim group_norm hinge_embedding_loss huber_loss kl_div
l1_loss layer_norm log log10 log1p log2 logsumexp margin_ranking_loss mse_loss multi_margin_loss
multilabel_margin_loss native_layer_norm nll_loss nll_loss2d nuclear_norm nuclear_norm.dim pdist
poisson_nll_loss pow.Scalar pow.Tensor_Scalar pow.Tensor_Tensor reciprocal renorm rms_norm rsqrt sinh
smooth_l1_loss soft_margin_loss softplus tan triplet_margin_loss upsample_bicubic2d upsample_bilinear2d
upsample_linear1d upsample_nearest1d upsample_nearest2d upsample_nearest3d upsample_trilinear3d
""".split())
# fp32_set_opt_dtype: run with dtype float32 unless the call gave one (first argument eligible)
FP32_OUT = frozenset("""
cumprod cumsum linalg_matrix_norm linalg_matrix_norm.str_ord linalg_vector_norm log_softmax.int prod
prod.dim_int softmax.int sum sum.dim_IntList
""".split())
# fp32_append_dtype: the overload that takes a dtype, with float32
FP32_APPENDED = {"norm.Scalar": "norm.ScalarOpt_dtype", "norm.ScalarOpt_dim": "norm.ScalarOpt_dim_dtype"}
# promote: the widest floating type among the arguments, autocast's own at least
PROMOTE = frozenset("addcdiv addcmul atan2 bilinear cross dot grid_sampler index_put scatter_add tensordot vdot".split())
BANNED = {"binary_cross_entropy": (
    "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast.\n"
    "Many models use a sigmoid layer right before the binary cross entropy layer.\n"
    "In this case, combine the two layers using torch.nn.functional.binary_cross_entropy_with_logits\n"
    "or torch.nn.BCEWithLogitsLoss.  binary_cross_entropy_with_logits and BCEWithLogits are\n"
    "safe to autocast.")}

_AUTOCAST_KEY = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)
# the state as torch keeps it (the trace answers user code's questions about it otherwise: cuda_script)
_is_enabled, _dtype_of, _cache_enabled = torch.is_autocast_enabled, torch.get_autocast_dtype, torch.is_autocast_cache_enabled


def _op(name: str) -> torch._ops.OpOverload:
    packet, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, packet), overload or "default")


def below_autocast():
    """Autocast's key excluded, as the C++ wrapper excludes it for its op and everything the op calls."""
    return torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_KEY)


@contextlib.contextmanager
def _in_kernel():
    """As the C++ wrapper runs its casts and op: below autocast, and no Python torch function in
    between (they are the dispatcher's calls, not the model's)."""
    with below_autocast(), torch._C.DisableTorchFunction():
        yield


def active() -> torch.dtype | None:
    """The lower precision of CUDA's autocast in force here (None where off)."""
    return _dtype_of("cpu") if _is_enabled("cpu") else None


@contextlib.contextmanager
def region(dtype: torch.dtype | None, enabled: bool = True, cache_enabled: bool | None = None):
    """One region of CUDA's autocast to `dtype` (a forward pass, a user's `torch.autocast("cuda")`;
    None: no autocast), as torch.autocast enters and leaves one, on the CPU's autocast state with
    CUDA's policy registered; the cast cache dies with the outermost region."""
    if dtype is None:
        yield
        return
    with cuda_policy():
        before = _is_enabled("cpu"), _dtype_of("cpu"), _cache_enabled()
        torch.set_autocast_enabled("cpu", enabled)
        torch.set_autocast_dtype("cpu", dtype)
        torch.autocast_increment_nesting()
        if cache_enabled is not None:
            torch.set_autocast_cache_enabled(cache_enabled)
        try:
            yield
        finally:
            if torch.autocast_decrement_nesting() == 0:
                clear_cache()
                torch.clear_autocast_cache()
            torch.set_autocast_enabled("cpu", before[0])
            torch.set_autocast_dtype("cpu", before[1])
            torch.set_autocast_cache_enabled(before[2])


# ---- cached_cast --------------------------------------------------------------------------------

# .cache: the leaf weights' casts (id -> (weakref to the weight, cast)); .real_host: whether a plain
# real tensor is the host's (real_tensors_on_the_host)
_local = threading.local()


@contextlib.contextmanager
def real_tensors_on_the_host():
    """While it lasts, a plain real tensor is the host's (a plain script's trace keeps its small host
    tensors real beside the card's fake ones): autocast leaves it alone, as CUDA's leaves CPU tensors."""
    before = getattr(_local, "real_host", False)
    _local.real_host = True
    try:
        yield
    finally:
        _local.real_host = before


def _cache() -> dict:
    cache = getattr(_local, "cache", None)
    if cache is None:
        cache = _local.cache = {}
    return cache


def clear_cache() -> None:
    """What torch.clear_autocast_cache clears (the outermost autocast region's exit)."""
    _cache().clear()


def _eligible(t) -> bool:
    """is_eligible: a floating tensor on the card (a trace's host tensors are real ones beside fake
    ones: CUDA's autocast leaves CPU tensors alone), float64 left as it is."""
    return (isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64
            and not (getattr(_local, "real_host", False) and type(t) in (torch.Tensor, torch.nn.Parameter)))


def cast(t, dtype: torch.dtype):
    """cached_cast: a floating tensor (float64 left as it is) to `dtype`, a list's in order; the cast
    of an fp32 leaf that requires grad to autocast's dtype kept while the region lasts, made with grad
    on as torch 2.13 makes it (one kept under no_grad serves a later pass with grad, pytorch#165068),
    none kept in inference mode."""
    if isinstance(t, (list, tuple)):
        return type(t)(cast(x, dtype) for x in t) if any(isinstance(x, torch.Tensor) for x in t) else t
    if not _eligible(t) or t.dtype == dtype:
        return t
    cacheable = (dtype == _dtype_of("cpu") and t.dtype == torch.float32 and t.requires_grad and t.is_leaf
                 and not t._is_view() and _cache_enabled())
    if cacheable:
        held = _cache().get(id(t))
        if held is not None and held[0]() is t:
            return held[1]
    keep = cacheable and not torch.is_inference_mode_enabled()
    # (the dispatcher's cast: no Python torch function sees it)
    with torch.enable_grad() if keep else contextlib.nullcontext(), torch._C.DisableTorchFunction():
        out = torch.ops.aten.to.dtype(t, dtype)
    if keep:
        _cache()[id(t)] = (weakref.ref(t), out)
    return out


def cast_all(args: tuple, kwargs: dict, dtype: torch.dtype) -> tuple[tuple, dict]:
    """Each argument cast, the last first (keyword-only arguments come last in a schema)."""
    kwargs = dict(reversed([(k, cast(v, dtype)) for k, v in reversed(kwargs.items())]))
    return tuple(reversed([cast(a, dtype) for a in reversed(args)])), kwargs


# ---- the policies -------------------------------------------------------------------------------

def _kernels() -> dict[str, object]:
    """Each op's kernel, by overload name."""
    out: dict[str, object] = {}

    def casting(op, to):  # every argument cast to `to(the arguments)`
        def kernel(*args, **kwargs):
            with _in_kernel():
                args, kwargs = cast_all(args, kwargs, to((*args, *kwargs.values())))
                return op(*args, **kwargs)
        return kernel

    def fp32_out(op):
        at = next(i for i, a in enumerate(op._schema.arguments) if a.name == "dtype")
        positional = not op._schema.arguments[at].kwarg_only
        name = op._schema.name.removeprefix("aten::")
        softmax = name in _HALF_TO_FLOAT

        def kernel(*args, **kwargs):
            with _in_kernel():
                if not _eligible(args[0]):
                    return op(*args, **kwargs)
                if positional and len(args) > at:
                    if args[at] is None:
                        args = (*args[:at], torch.float32, *args[at + 1:])
                elif kwargs.get("dtype") is None:
                    kwargs = {**kwargs, "dtype": torch.float32}
                dtype = args[at] if positional and len(args) > at else kwargs["dtype"]
                out = softmax_half_to_float(name, args[0], args[1], dtype) if softmax else None
                return op(*args, **kwargs) if out is None else out
        return kernel

    def fp32_appended(op, to):
        def kernel(*args, **kwargs):
            with _in_kernel():
                if not _eligible(args[0]):
                    return op(*args, **kwargs)
                return to(*_completed(op, args, kwargs), dtype=torch.float32)
        return kernel

    def banned(message):
        def kernel(*args, **kwargs):
            raise RuntimeError(message)
        return kernel

    out.update((n, casting(_op(n), lambda _: _dtype_of("cpu"))) for n in LOWER)
    out.update((n, casting(_op(n), lambda _: torch.float32)) for n in FP32)
    out.update((n, fp32_out(_op(n))) for n in FP32_OUT)
    out.update((n, fp32_appended(_op(n), _op(to))) for n, to in FP32_APPENDED.items())
    out.update((n, casting(_op(n), lambda args: _promoted(_dtype_of("cpu"), args))) for n in PROMOTE)
    out.update((n, banned(m)) for n, m in BANNED.items())
    return out


# softmax's composite as CUDA runs it (SoftMax.cpp): a Half input to fp32 is one kernel (half_to_float),
# where the CPU's first copies the input to fp32. Autocast's fp32 output reaches it, and so does a
# call asking for fp32 itself (cuda_emulation.cuda_kernels).
_HALF_TO_FLOAT = {"softmax": torch.ops.aten._softmax.default, "log_softmax": torch.ops.aten._log_softmax.default}


def softmax_half_to_float(name: str, input, dim, dtype) -> torch.Tensor | None:
    """`name` (softmax or log_softmax) of `input` over `dim` to `dtype` as CUDA's one kernel makes
    it where it does (a Half fake tensor to fp32; a script's real host tensors run the CPU's, which
    has none), else None."""
    if dtype != torch.float32 or input.dtype != torch.float16 or not isinstance(input, FakeTensor) \
            or not isinstance(dim, int):
        return None
    return _HALF_TO_FLOAT[name](input, dim, True)


def _completed(op, args: tuple, kwargs: dict) -> tuple:
    """`args` with the schema's defaults of the positional arguments not given."""
    schema = [a for a in op._schema.arguments if not a.kwarg_only]
    return (*args, *(kwargs.get(a.name, a.default_value) for a in schema[len(args):]))


def _promoted(low: torch.dtype, args) -> torch.dtype:
    """promote_type: from autocast's dtype, fp32 where any floating argument is (float64 ignored);
    the other lower precision is an error, as CUDA's prioritize raises."""
    to = low
    for t in args:
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64:
            if t.dtype == torch.float32 or to == torch.float32:
                to = torch.float32
            elif t.dtype != low:
                raise RuntimeError("Unexpected floating ScalarType in at::autocast::prioritize")
    return to


# ---- registration -------------------------------------------------------------------------------

_registered: dict = {"count": 0, "library": None}
_lock = threading.Lock()
os.register_at_fork(after_in_child=lambda: globals().update(_lock=threading.Lock()))


@functools.cache
def cpu_only() -> tuple[str, ...]:
    """The ops CPU's autocast has a kernel for and CUDA's has not (passed through while CUDA's
    policy is registered: cat, stack, cross_entropy_loss, the linalg and fft ops, ...). Read before
    the first registration, which would count ours."""
    cuda = LOWER | FP32 | FP32_OUT | PROMOTE | set(FP32_APPENDED) | set(BANNED)
    names = (n.removeprefix("aten::") for n in torch._C._dispatch_get_all_op_names() if n.startswith("aten::")
             and torch._C._dispatch_has_kernel_for_dispatch_key(n, "AutocastCPU"))
    return tuple(sorted(n for n in names if n not in cuda))


@contextlib.contextmanager
def cuda_policy():
    """CUDA's autocast policy in the AutocastCPU kernels while it lasts: registered by the first of
    nested or concurrent traces, removed by the last (CPU's own kernels back)."""
    with _lock:
        if _registered["count"] == 0:
            _registered["library"] = _register()
        _registered["count"] += 1
    try:
        yield
    finally:
        with _lock:
            _registered["count"] -= 1
            if _registered["count"] == 0:
                _registered["library"]._destroy()
                _registered["library"] = None


def _register() -> torch.library.Library:
    passed = cpu_only()
    library = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # ("Overriding a previously registered kernel": CPU's, on purpose)
        for name in passed:
            library.impl(name, torch.library.fallthrough_kernel, "AutocastCPU")
        for name, kernel in _KERNELS.items():
            library.impl(name, kernel, "AutocastCPU")
    return library


_KERNELS = _kernels()
