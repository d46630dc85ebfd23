"""What a CUDA kernel of the traced op allocates for itself and frees before it returns, which its
meta kernel does not make: fused attention's scratch (config.attention), a reduction's staging
buffer and semaphores, FSDP2's copy kernels' launch tables (config.kernels), the embedding
backward's sort and sums (config.embedding_kernels), _foreach_norm's partial norms. From an aten call's
arguments to (bytes on the traced card, code): a code ("" for none) names a launch whose bytes
depend on the card, for record.trace_store.sized_for to size on another, or (FSDP2's launch
tables) on the shard count, for probe.sim.shard_counts to size at another.

A reduction splits across blocks on some cards and not on others only where its output grid lies
between what their SMs fill (an output wider than ~2,000 x 128 columns), and flash splits the keys
on some only. Where the traced card's launch makes none but a catalog card's would (made_elsewhere),
the trace holds a placeholder for it: an alloc and a free of 0 B with its code, which no replay on
the traced card sees and sized_for sizes on the others (an MI300X splits RMSNorm's weight gradient
over 512 tokens where an A100 does not: 256 MiB staging buffers a 7B trace of the A100 once lacked).
"""

from __future__ import annotations

import functools
import sys
from typing import NamedTuple

import torch
import torch.utils._pytree as pytree
from torch._prims_common import is_non_overlapping_and_dense_or_false

from harness.config import attention, embedding_kernels, kernels
from harness.config.kernels import Geometry, Reduction

_aten = torch.ops.aten


class Scratch(NamedTuple):
    """One allocation a kernel makes for itself: bytes on the traced card, its launch's code, and
    where it is freed: right after the op's scratch allocation of that index is made (the kernel's
    own order), else as the op returns. `early`: made before the op's outputs (those first in the
    list), else after them."""
    bytes: int
    code: str
    freed_after: int | None = None
    early: bool = False


def _fused_shape(q, k, v) -> attention.FusedShape:
    b, h, s_q, d = q.shape  # (B, H, S, D) as SDPA's fused ops take them
    return attention.FusedShape(b, h, k.shape[1], s_q, k.shape[2], d, v.shape[3], q.element_size())


def _fused_backward(kernel: str):
    """A fused backward's scratch, each block's code naming its call (for the trace as the other
    fused kernel runs it: probe.sim.fused_swap)."""
    def scratch(args, g) -> list[tuple[int, str]]:
        shape = _fused_shape(*args[1:4])  # (after the output's gradient)
        blocks = attention.fused_backward_scratch(kernel, shape)
        return [(n, attention.fused_code("bwd", kernel, shape, i if kernel == attention.FLASH else None))
                for i, n in enumerate(blocks)]
    return scratch


def _flash_forward(args, g) -> list[tuple[int, str]]:
    """Flash's split-KV accumulators (config.kernels.flash_splitkv_bytes): none with dropout; 0 B
    where the card takes one split."""
    if len(args) > 3 and args[3] > 0:
        return []
    shape = _fused_shape(*args[:3])
    return [(n, kernels.splitkv_code(shape, part)) for part, n in enumerate(kernels.flash_splitkv_bytes(shape, g))]


def _efficient_backward(args, g) -> list[Scratch]:
    """The memory-efficient backward's delta and workspace (config.kernels.efficient_backward_bytes):
    the product and its sum go once delta is made (their expression's temporaries, last first);
    delta and the workspace as it returns, in that order."""
    shape = _fused_shape(*args[1:4])  # (after the output's gradient)
    sizes = kernels.efficient_backward_bytes(shape, g)
    return [Scratch(n, kernels.efficient_code(shape, part), 2 if part < 2 else None) for part, n in enumerate(sizes)]


# ---- reductions ---------------------------------------------------------------------------------

def _dense(t: torch.Tensor) -> bool:
    return bool(is_non_overlapping_and_dense_or_false(t))


def reduction(x: torch.Tensor, dims, arg_bytes: int, input_vec: int) -> Reduction | None:
    """The launch Reduce.cuh makes to reduce `x` over `dims` (None or empty: all), as TensorIterator
    lays it out: size-1 dimensions dropped, the reduced ones first by stride, then the kept ones by
    the (contiguous) output's, neighbours merged where their strides allow. None where it is not
    modelled: an input not dense, or too large for 32-bit indexing (split into several launches)."""
    n = x.dim()
    if n == 0 or x.numel() < 2 or x.numel() >= 2**31 or not _dense(x):
        return None
    red = {d % n for d in dims} if dims else set(range(n))
    kept = [d for d in range(n) if d not in red and x.shape[d] != 1]
    out_stride, s = {}, 1
    for d in reversed(kept):
        out_stride[d], s = s, s * x.shape[d]
    # (size, input stride, output stride), fastest first
    layout = ([(x.shape[d], x.stride(d), 0) for d in sorted((d for d in red if x.shape[d] != 1), key=x.stride)]
              + [(x.shape[d], x.stride(d), out_stride[d]) for d in sorted(kept, key=out_stride.__getitem__)])
    merged: list[list[int]] = []
    for size, st_in, st_out in layout:
        if merged and (merged[-1][0] * merged[-1][1] == st_in) and (merged[-1][0] * merged[-1][2] == st_out) \
                and (merged[-1][2] == 0) == (st_out == 0):
            merged[-1][0] *= size
        else:
            merged.append([size, st_in, st_out])
    n_red = sum(1 for m in merged if m[2] == 0)
    if n_red == 0:
        return None
    num_outputs = 1
    for size, _, st_out in merged:
        num_outputs *= size if st_out else 1
    inputs = x.numel() // num_outputs
    on_fastest = n_red == len(merged) or merged[0][1] < merged[n_red][1]
    fastest = merged[0][1] if on_fastest else merged[n_red][1]
    in_vec = out_vec = 1
    if fastest == 1:
        if on_fastest and inputs >= 128 and n_red == 1:
            in_vec = input_vec
        elif not on_fastest:  # get_output_vec_size: the address, the output's fastest size, the other strides
            out_vec = 4
            for v in (x.storage_offset(), merged[n_red][0],
                      *(m[1] for i, m in enumerate(merged) if i != n_red)):
                while v % out_vec:
                    out_vec //= 2
    return Reduction(arg_bytes, num_outputs, inputs, on_fastest, in_vec, out_vec)


def _accumulated_in(x: torch.Tensor) -> int:
    """sizeof(acc_t) of a sum, mean or norm: float for floating types up to fp32, else 8."""
    return 4 if x.is_floating_point() and x.element_size() <= 4 else 8


def _reducing(dims_at: int | None, accumulator, input_vec):
    """A reduction op's scratch: its dims at argument `dims_at` (None: all), sizeof(acc_t) and the
    elements a thread loads at once along a reduced fastest dimension, each of the input."""
    def scratch(args, g):
        x = args[0]
        dims = args[dims_at] if dims_at is not None and len(args) > dims_at else None
        return _reduction_scratch(reduction(x, dims, accumulator(x), input_vec(x)), g)
    return scratch


# sum and mean load 16-bit inputs 8 at a time (ReduceSumProdKernel.cu); amax/amin/max/min accumulate
# in the element's type
_sum_like = functools.partial(_reducing, accumulator=_accumulated_in,
                              input_vec=lambda x: 8 if x.element_size() == 2 else 4)
_extremum = functools.partial(_reducing, accumulator=lambda x: x.element_size(), input_vec=lambda x: 4)


def _reduction_scratch(r: Reduction | None, g: Geometry) -> list[tuple[int, str]]:
    """A reduction's staging buffer and semaphores (0 B each where its blocks share no outputs)."""
    if r is None:
        return []
    found = kernels.reduce_buffers(r, g) or (0, 0)
    return [(found[0], kernels.reduce_code(r, 0)), (found[1], kernels.reduce_code(r, 1))]


# ---- the embedding's backward -------------------------------------------------------------------

def _embedding_backward(args, g) -> list[Scratch]:
    """embedding_dense_backward_cuda's own allocations (config.embedding_kernels), in its order: the
    contiguous copies of its indices and gradient where they are not, and past the single kernel's
    reach the sort before its output, the runs' bookkeeping and the sum after it."""
    grad, indices, rows, scale = args[0], args[1], int(args[2]), bool(args[4]) if len(args) > 4 else False
    n, k = indices.numel(), indices.element_size()
    early = [Scratch(n * k, "", early=True)] if not indices.is_contiguous() else []
    if not grad.is_contiguous():
        early.append(Scratch(grad.numel() * grad.element_size(), "", early=True))
    if n <= embedding_kernels.DIRECT_MAX_INDICES and not scale:
        return early
    e = embedding_kernels.EmbeddingBackward(n, rows, grad.shape[-1], grad.element_size(), k,
                                            torch.are_deterministic_algorithms_enabled())
    at = len(early)
    out = early + [Scratch(n * k, "", early=True), Scratch(n * k, "", early=True),  # sorted, their positions
                   Scratch(n * k, "", at + 3, True),  # the range sorted by (freed with the sort)
                   Scratch(embedding_kernels.radix_sort_pairs_bytes(n, k, k), "", at + 3, True)]
    if scale:  # each index's count: two scans by key
        scans = len(out) + 1
        out += [Scratch(n * k, "", early=True),
                Scratch(embedding_kernels.tile_states_bytes(n), "", scans, True),
                Scratch(embedding_kernels.tile_states_bytes(n), "", scans + 1, True)]
    runs, partial = embedding_kernels.max_runs(e), embedding_kernels.max_partial_runs(e)
    unique = len(out) + 3
    out += [Scratch(n * k, ""), Scratch(8, ""),  # each run's start and their count
            Scratch(n * k, "", unique), Scratch(embedding_kernels.tile_states_bytes(n), "", unique),
            Scratch(runs * k, ""), Scratch(runs * k, ""),  # partial runs per run, their offsets
            Scratch(embedding_kernels.tile_states_bytes(runs), "", len(out) + 6),
            Scratch(8, ""), Scratch(partial * k, "")]  # the partial runs' count and starts
    sums = embedding_kernels.sum_bytes(e, g.multiprocessors, g.warp)
    return out + [Scratch(b, embedding_kernels.code(e, part)) for part, b in enumerate(sums)]


# ---- clip_grad_norm_'s norms ---------------------------------------------------------------------

# multi_tensor_apply's chunk (MultiTensorApply.cuh: kChunkSize), in elements
FOREACH_CHUNK = 65536


def _foreach_norm(args, g) -> list[Scratch]:
    """foreach_tensor_norm_cuda's own allocations (ForeachReduceOp.cu, torch 2.13): before its
    outputs, each tensor's partial norms, a slot per chunk of the largest tensor, in the output's
    opmath type (fp32 for bf16 gradients: a 7B model's 291 gradients, 2,000 chunks each, 2,328,000
    B), freed as it returns; after them a zero for each empty tensor, whose norm it is (its unused
    slot freed instead, which this does not place: an empty gradient is rare). None on the slow
    path (tensors of mixed types or devices, not dense, integral, or an order other than 1, 2 and
    inf: a vector norm each)."""
    tensors = list(args[0])  # (the dispatcher hands every argument over by position: ord, dtype)
    order = args[1] if len(args) > 1 else 2
    dtype = args[2] if len(args) > 2 else None
    first = tensors[0]
    if float(order) not in (1.0, 2.0, float("inf")) or not first.is_floating_point() or any(
            t.dtype != first.dtype or t.device != first.device or not _dense(t) for t in tensors):
        return []
    out = dtype or first.dtype
    opmath = 8 if out == torch.float64 else 4
    chunks = max(-(-t.numel() // FOREACH_CHUNK) for t in tensors)
    return [Scratch(len(tensors) * chunks * opmath, "", early=True)] + [Scratch(out.itemsize, "") for t in tensors
                                                                        if t.numel() == 0]


# ---- FSDP2's copies -----------------------------------------------------------------------------

def _chunk_cat(args, g, out) -> list[tuple[int, str]]:
    tensors, dim, num_chunks = args[0], args[1], args[2]
    if out is None or not all(_dense(t) and t.is_contiguous() for t in tensors):
        return []
    if not (tensors[0].dtype == out.dtype or (tensors[0].dtype == torch.bfloat16 and out.dtype == torch.float32)):
        return []  # the composite path: no table
    dim = dim % tensors[0].dim()
    pads = []
    for t in tensors:
        trailing = 1
        for s in t.shape[dim + 1:]:
            trailing *= s
        pads.append(-(-t.shape[dim] // num_chunks) * num_chunks * trailing * out.element_size() // num_chunks)
    return [(kernels.chunk_cat_table(pads), kernels.chunk_cat_code(pads))]


def _split_copy(args, g, outs) -> list[tuple[int, str]]:
    x, split_sizes = args[0], args[1]
    dim = (args[2] if len(args) > 2 else 0) % x.dim()
    if not outs or not _dense(x) or not all(_dense(o) and o.dtype == x.dtype for o in outs):
        return []  # the composite path: no table
    stride = 1
    for s in x.shape[dim:]:
        stride *= s
    chunk_bytes = [int(s) * x.stride(dim) * x.element_size() for s in split_sizes]
    num_chunks = x.numel() // stride
    return [(kernels.split_copy_table(chunk_bytes, num_chunks, g), kernels.split_copy_code(chunk_bytes, num_chunks))]


_BY_ARGS = {
    _aten._scaled_dot_product_flash_attention.default: _flash_forward,
    _aten._scaled_dot_product_flash_attention_backward.default: _fused_backward(attention.FLASH),
    _aten._scaled_dot_product_efficient_attention_backward.default: _efficient_backward,
    _aten._scaled_dot_product_cudnn_attention.default: lambda args, g: [(256, attention.fused_code("fwd", "scratch"))],
    _aten._scaled_dot_product_cudnn_attention_backward.default: _fused_backward(attention.CUDNN),
    _aten.sum.dim_IntList: _sum_like(1),
    _aten.sum.default: _sum_like(None),
    _aten.mean.dim: _sum_like(1),
    _aten.mean.default: _sum_like(None),
    _aten.nansum.default: _sum_like(1),
    _aten.linalg_vector_norm.default: _reducing(2, _accumulated_in, lambda x: 4),
    _aten.amax.default: _extremum(1),
    _aten.amin.default: _extremum(1),
    _aten.max.default: _extremum(None),
    _aten.min.default: _extremum(None),
    _aten.embedding_dense_backward.default: _embedding_backward,
    _aten._foreach_norm.Scalar: _foreach_norm,
}


# FSDP2's own ops (torch.distributed.fsdp registers them as fsdp::chunk_cat, fsdp::split_with_sizes_copy)
_FSDP = {"chunk_cat": _chunk_cat, "split_with_sizes_copy": _split_copy}


# Ops that free what scratch is left as they return in the order made, not last first: flash's
# forward (mha_fwd; an H200's memory history) and the memory-efficient backward (delta, a local of
# the launch, then the workspace)
_FREED_IN_ORDER = {_aten._scaled_dot_product_flash_attention.default,
                   _aten._scaled_dot_product_efficient_attention_backward.default}


def of(func, args, kwargs, g: Geometry) -> list[Scratch]:
    """The scratch an op's CUDA kernel allocates on a card of geometry `g`, in the order it
    allocates it; what is left of it is freed before the op returns (freed_in_order). A call on
    DTensors is sized by what the kernel runs on: each rank's local tensors (on_ranks_tensors)."""
    fn = _BY_ARGS.get(func)
    if fn is not None:
        return [Scratch(*s) for s in fn(on_ranks_tensors(func, args, kwargs), g)]
    if getattr(func, "namespace", None) == "fsdp":
        fsdp = _FSDP.get(func.overloadpacket.__name__)
        if fsdp is not None:
            return [Scratch(*s) for s in fsdp(args, g, (kwargs or {}).get("out"))]
    return []


def on_ranks_tensors(func, args, kwargs) -> tuple:
    """`args` as rank 0's kernel gets them where some are DTensors: each its local
    tensor, or, where DTensor's sharding propagation redistributes it first (a sequence's slices
    gathered whole for attention), a meta tensor of rank 0's shape in the placements it is
    redistributed to. A sequence-parallel norm's weight gradient sums the rank's slice of the
    sequence, not the whole (before, its reduction's scratch was sized for the whole: over tensor
    parallel 2, for twice the tokens)."""
    dtensor = sys.modules.get("torch.distributed.tensor")  # (none made where it was never imported)
    # (a look at the arguments and their lists before any flattening: every traced reduction asks)
    if dtensor is None or not any(isinstance(a, dtensor.DTensor) or isinstance(a, (list, tuple)) and any(
            isinstance(t, dtensor.DTensor) for t in a) for a in args):
        return args
    kwargs = kwargs or {}
    flat, tree = pytree.tree_flatten(args)
    placed = [a.placements for a in flat if isinstance(a, dtensor.DTensor)]
    specs: list = [None] * len(flat)
    # (all replicated, as a tensor-parallel norm's inputs: whole on every rank, nothing to decide)
    if not all(isinstance(p, dtensor.Replicate) for ps in placed for p in ps):
        specs = _redistributed(dtensor.DTensor, func, args, kwargs) or specs

    def local(a, spec):
        if not isinstance(a, dtensor.DTensor):
            return a
        placements = getattr(spec, "placements", a.placements)
        if placements == a.placements or not all(isinstance(p, (dtensor.Shard, dtensor.Replicate, dtensor.Partial))
                                                  for p in placements):
            return a._local_tensor
        shape = list(a.shape)  # rank 0's: the first chunk of each split, ceil(size / ranks)
        for mesh_dim, p in enumerate(placements):
            if isinstance(p, dtensor.Shard):
                shape[p.dim] = -(-shape[p.dim] // spec.mesh.size(mesh_dim))
        return torch.empty(shape, dtype=a.dtype, device="meta")

    return pytree.tree_unflatten([local(a, s) for a, s in zip(flat, specs, strict=True)], tree)


def _redistributed(dtensor_class, func, args, kwargs) -> list | None:
    """The flattened `args`' specs DTensor's sharding propagation redistributes the call's operands
    to first; None where it keeps them as they are, or cannot tell. (Private API, torch 2.13's: its
    own propagation, cached.)"""
    try:
        dispatcher = dtensor_class._op_dispatcher
        info = dispatcher.unwrap_to_op_info(func, args, kwargs)
        dispatcher.sharding_propagator.propagate(info)
        decided = info.output_sharding
    except Exception:  # noqa: BLE001 - sized by the rank's own tensors
        return None
    if decided is None or not decided.needs_redistribute or decided.redistribute_schema is None:
        return None
    found = pytree.tree_leaves(decided.redistribute_schema.args_schema)
    return found if len(found) == len(pytree.tree_leaves(args)) else None


def recorded(nbytes: int, code: str) -> bool:
    """Whether a trace holds a launch's scratch of `nbytes` on the traced card: where it makes some,
    and as a 0-B placeholder where a catalog card's launch of `code` would (made_elsewhere)."""
    return bool(nbytes) or bool(code) and made_elsewhere(code)


@functools.cache
def _catalog_geometries() -> tuple[Geometry, ...]:
    """Each distinct geometry of the catalog's cards (the cards a row judges)."""
    from harness.config import cards

    return tuple(sorted({kernels.geometry(c) for c in cards.cards()}, key=repr))


@functools.lru_cache(maxsize=65536)
def made_elsewhere(code: str) -> bool:
    """Whether a catalog card's launch of `code` makes scratch."""
    return any(kernels.scratch_bytes(code, g) for g in _catalog_geometries())


def freed_in_order(func) -> bool:
    """Whether `func` frees its scratch left at its return in the order made (else last first)."""
    return func in _FREED_IN_ORDER
