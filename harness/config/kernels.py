"""What CUDA kernels allocate through the caching allocator for themselves, and how that depends on
the card: scratch that no tensor of the trace owns, allocated inside one op and freed before it
returns, yet counted by max_memory_allocated and placed by the allocator like any block.

- A reduction that Reduce.cuh splits across blocks (a sum over leading dimensions: RMSNorm's weight
  gradient, a bias's) allocates a staging buffer and a semaphore per output block
  (aten/src/ATen/native/cuda/Reduce.cuh, setReduceConfig and gpu_reduce_kernel). How many blocks
  share an output follows the card's SM count and threads per SM. Measured on an H200 (132 SMs):
  a bf16 (2048, 2048) column sum 33,554,432 B + 64 B, (4096, 11008) 140,902,400 B + 344 B.
- Flash attention's forward splits the keys across blocks where the batch x heads x query blocks
  would leave the SMs idle (a decode step's one query at a small batch): it allocates a log-sum-exp
  and an output accumulator per split (fp32), after its output and log-sum-exp, and frees them as it
  returns (aten/src/ATen/native/transformers/cuda/flash_attn/flash_api.cpp, mha_fwd,
  set_params_splitkv, num_splits_heuristic). How many splits follows the SM count. Measured on an
  H200: 1 x 1000 tokens x 8 heads of 64, 64,000 B + 4,096,000 B (2 splits).
- The memory-efficient attention backward (attention_backward.cu, _efficient_attention_backward;
  kernel_backward.h) works out delta, the rowwise sum of the output's gradient times the output,
  with three tensors where its kernel does not (fp32), and gives the kernel a workspace that
  accumulates the query's gradient over blocks of keys (in 16-bit types, where the kernel cannot
  keep them in registers, the key's and value's too, per split of the keys). The workspace's block
  sizes follow which kernel launches, by the dtype, the head dims and the card's architecture and
  shared memory (mem_eff_attention/kernels/generate_kernels.py). Measured on an H200: demo-1b's
  B2 x H16 x 1024 fp32 backward, 16,777,216 + 131,072 + 131,072 B, then 16,785,408 B.
- FSDP2's copy-out of an all-gather (split_with_sizes_copy) and copy-in of a reduce-scatter
  (_chunk_cat) pack their launch tables into one int64 tensor on the card
  (aten/src/ATen/native/cuda/TensorShape.cu, pack_vecs); split_with_sizes_copy's follows the SM
  count too. Measured for demo-1b's layers over 4 H200s: 33,792 B and 100,816 B.

Sizes here are requested bytes (the allocator rounds them). A trace records each such allocation
with the launch's card-free description (a "kernel" string); `scratch_bytes` sizes it for any card,
so one trace serves every card of the catalog (record.trace_store.sized_for).
"""

from __future__ import annotations

import ctypes
import functools
import math
from typing import NamedTuple

from harness.config import attention, embedding_kernels
from harness.config.attention import FusedShape
from harness.config.point import Card

# Where a card's SM count is not known (a card the user describes without gpu.multiprocessors): the
# reductions are sized as on a card with SMs to spare, the largest any card allocates for them
UNKNOWN_SMS = 0


class Geometry(NamedTuple):
    """What a launch's size reads of the card (torch.cuda.get_device_properties)."""
    multiprocessors: int  # multi_processor_count; UNKNOWN_SMS where unknown
    threads_per_multiprocessor: int  # max_threads_per_multi_processor
    warp: int = 32
    rocm: bool = False
    capability: tuple[int, int] | None = None  # which kernels are built for it (None: an A100's)


# A card nothing is known of: SM count unknown, 2048 threads each
ANY_CARD = Geometry(UNKNOWN_SMS, 2048)


def threads_per_multiprocessor(capability: tuple[int, int] | None) -> int:
    """maxThreadsPerMultiProcessor by compute capability (CUDA C Programming Guide, "Technical
    Specifications per Compute Capability"): 1024 on Turing, 1536 on sm86/sm89/sm12x, else 2048
    (an AMD CDNA compute unit too)."""
    if capability is None:
        return 2048
    if capability == (7, 5):
        return 1024
    if capability in ((8, 6), (8, 9)) or capability[0] == 12:
        return 1536
    return 2048


def geometry(card: Card) -> Geometry:
    cap = card.capability
    on_rocm = attention.rocm(cap)
    return Geometry(card.multiprocessors, threads_per_multiprocessor(cap), 64 if on_rocm else 32, on_rocm, cap)


# ---- Reduce.cuh ---------------------------------------------------------------------------------

class Reduction(NamedTuple):
    """One gpu_reduce_kernel launch, as far as it does not depend on the card."""
    arg_bytes: int  # sizeof(arg_t): the accumulator (float for a sum of bf16)
    num_outputs: int
    inputs_per_output: int
    on_fastest: bool  # reducing along the input's fastest-moving dimension
    input_vec: int  # elements a thread loads at once along a reduced fastest dimension (1: no)
    output_vec: int  # outputs a thread makes at once along a kept fastest dimension (1: no)



def _last_pow2(n: int) -> int:
    return max(1, 1 << (int(n).bit_length() - 1))


def reduce_buffers(r: Reduction, g: Geometry) -> tuple[int, int] | None:
    """(staging buffer, semaphores) bytes a launch allocates on a card of geometry `g`, or None
    where its blocks do not share outputs (setReduceConfig, ReduceConfig.global_memory_size)."""
    max_threads = 512 // r.output_vec
    dim0, dim1 = (r.inputs_per_output, r.num_outputs) if r.on_fastest else (r.num_outputs, r.inputs_per_output)
    dim0 //= r.input_vec if r.input_vec > 1 else r.output_vec
    dim0_pow2 = _last_pow2(dim0) if dim0 < max_threads else max_threads
    dim1_pow2 = _last_pow2(dim1) if dim1 < max_threads else max_threads
    width = min(dim0_pow2, g.warp)
    height = min(dim1_pow2, max_threads // width)
    width = min(dim0_pow2, max_threads // height)
    threads = width * height
    step_input, step_output = 1, 1
    if r.on_fastest:
        step_input *= width  # block_x_reduce
    else:
        step_output *= width
    min_values = 128 if g.rocm else 16
    if -(-r.inputs_per_output // step_input) < min(height * 16, 256):
        return None  # each warp its own outputs: no block_y split, so none across blocks either
    step_input *= height
    values = -(-r.inputs_per_output // step_input)
    grid = -(-(r.num_outputs // r.output_vec) // step_output)
    if g.multiprocessors == UNKNOWN_SMS:  # as on a card with SMs to spare: the most blocks an output takes
        target = None
    else:
        target = g.multiprocessors * (g.threads_per_multiprocessor // threads)
    if values < 256 or (target is not None and grid > target):
        return None
    by_target = math.inf if target is None else -(-target // grid)
    ctas = max(min(by_target, -(-values // min_values)), -(-values // 256))
    if g.rocm and ctas > 1:
        ctas = max(ctas, 64)
    if ctas <= 1:
        return None
    buffer = r.arg_bytes * r.num_outputs * ctas
    if not r.on_fastest:
        buffer *= width * r.output_vec
    return int(buffer), 4 * grid


# ---- TensorShape.cu (FSDP2's copies) ------------------------------------------------------------

_BLOCK, _BYTES_PER_THREAD = 128, 16
_BYTES_PER_BLOCK = _BLOCK * _BYTES_PER_THREAD


def chunk_cat_table(pad_chunk_bytes: list[int]) -> int:
    """Bytes of _chunk_cat's launch table for tensors of these padded chunk sizes (bytes in the
    output's dtype): sources, each block's tensor, start bytes, start blocks, sizes, chunk sizes and
    blocks per tensor, int64 each. Main's source reads 5 a tensor + 2 + the blocks; an H200 on
    torch 2.11 allocated one int64 more a tensor (demo-1b's 9 a layer: 100,816 B; its root's 3:
    256,168 B): measured wins."""
    n = len(pad_chunk_bytes)
    return 8 * (6 * n + 2 + sum(-(-c // _BYTES_PER_BLOCK) for c in pad_chunk_bytes))


def split_copy_table(chunk_bytes: list[int], num_chunks: int, g: Geometry) -> int:
    """Bytes of split_with_sizes_copy's launch table: destinations, sources, chunk sizes, each
    block's split and the blocks' running sums, int64 each; a block copies more of a chunk where the
    whole copy would take more blocks than twice the card's threads fill."""
    n = len(chunk_bytes)
    blocks = sum(-(-c // _BYTES_PER_BLOCK) for c in chunk_bytes)
    if g.multiprocessors == UNKNOWN_SMS:
        iters = 1  # the largest table
    else:
        max_blocks = int(g.multiprocessors * g.threads_per_multiprocessor / _BLOCK * 2.0)
        factor = -(-blocks * num_chunks // max_blocks)
        per_block = min(math.ceil(math.sqrt(factor)), num_chunks)
        iters = -(-factor // per_block)
    return 8 * (4 * n + 1 + sum(-(-c // (_BYTES_PER_BLOCK * iters)) for c in chunk_bytes))


# ---- flash attention's split-KV forward (flash_api.cpp) ------------------------------------------

# Where the SM count is unknown: splits as on a CUDA card with more SMs than any of the catalog's
# (an RTX 5090's 170), which splits where the catalog's cards fill their SMs without
_SPARE_SMS = 192


@functools.lru_cache(maxsize=4096)  # (every card asks it of every decode step's launch)
def num_splits_heuristic(batch_nheads_mblocks: int, num_sms: int, num_n_blocks: int, max_splits: int) -> int:
    """flash_api.cpp's: 1 where the blocks almost fill the SMs; else the fewest splits reaching 85%
    of the best efficiency (blocks over whole waves), a split count that changes the blocks per split."""
    def f32(x: float) -> float:  # its arithmetic is C++ float's (each operation rounded to it)
        return ctypes.c_float(x).value

    if f32(batch_nheads_mblocks) >= f32(f32(0.8) * num_sms):
        return 1
    max_splits = min(max_splits, num_sms, num_n_blocks)

    def eligible(n: int) -> bool:
        return n == 1 or -(-num_n_blocks // n) != -(-num_n_blocks // (n - 1))

    efficiency = {}
    for n in range(1, max_splits + 1):
        if eligible(n):
            waves = f32(f32(batch_nheads_mblocks * n) / num_sms)
            efficiency[n] = f32(waves / math.ceil(waves))
    best = max(efficiency.values(), default=0.0)
    return next((n for n, e in efficiency.items() if e >= 0.85 * best), 1)  # (0.85: a double)


def flash_splitkv_bytes(shape: FusedShape, g: Geometry) -> tuple[int, int]:
    """The log-sum-exp and output accumulators (bytes) flash's forward allocates on a card of
    geometry `g` for a call of `shape` without dropout; (0, 0) where it takes one split, and on ROCm
    (its flash is AOTriton's, which allocates none). One query over grouped keys and values is
    taken as the group's queries over the key/value heads (seqlenq_ngroups_swapped)."""
    if g.rocm:
        return 0, 0
    b, h, s_q = shape.b, shape.h, shape.s_q
    if s_q == 1 and h > shape.h_k and shape.d % 8 == 0:
        s_q, h = h // shape.h_k, shape.h_k
    head = -(-shape.d // 8) * 8
    rounded = -(-head // (32 if head <= 128 else 64)) * (32 if head <= 128 else 64)
    block_n = 256 if head <= 64 else 128 if head <= 128 else 64
    sms = g.multiprocessors or _SPARE_SMS
    # two blocks an SM: 128 threads a block
    splits = num_splits_heuristic(b * h * -(-s_q // 64), 2 * sms, -(-shape.s_k // block_n), 128)
    if splits == 1:
        return 0, 0
    return splits * b * h * s_q * 4, splits * b * h * s_q * rounded * 4


SPLITKV_PREFIX = "splitkv:"


def _shape_code(prefix: str, shape: FusedShape, part: int) -> str:
    """The code of part `part` of an attention kernel's scratch for a call of `shape`."""
    return f"{prefix}{part}:" + ",".join(str(int(v)) for v in shape)


def splitkv_code(shape: FusedShape, part: int) -> str:
    """The code of a flash forward's log-sum-exp (part 0) or output (part 1) accumulator."""
    return _shape_code(SPLITKV_PREFIX, shape, part)


# ---- the memory-efficient attention's backward --------------------------------------------------

class _BackwardKernel(NamedTuple):
    """The memory-efficient backward kernel that launches, as its workspace is sized by it."""
    rows: int  # kBlockSizeI: queries a block
    cols: int  # kBlockSizeJ: keys a block (and the query gradient's columns a tile)
    in_registers: bool  # kOutputInRF: key and value gradients kept in registers, no accumulators


def _efficient_backward_kernel(max_k: int, half: bool, g: Geometry) -> _BackwardKernel:
    """The first kernel of cutlassB.h (generate_kernels.py's BwdKernel order: smallest kMaxK that
    holds the call's head dims, then most rows) whose shared memory the card gives a block. Rows:
    128 for head dims over 64 where a block may take A100-class shared memory (163 KB or more:
    sm80, sm87, sm90, sm10x), else 64 (Turing's 64 KB and the 99 KB of sm86, sm89 and sm12x: the
    generator's "fallback to 64 for GPUs with less shmem (Sm75, Sm86 ...)"), but for the 128 x 64
    kernel of head dims to 96 in 16-bit types that only sm86 and sm89 dispatch. A 16-bit kernel keeps
    the key and value gradients in registers where its kMaxK is at most its rows; it preloads on
    sm80 and newer, with 128 keys a block for head dims over 64. An H200 ran fp32's 128-row kernel
    for head dim 128 (its workspace); the 16-bit kernels and the smaller cards' are not measured."""
    cap = g.capability or attention.DEFAULT_CAPABILITY
    narrow = cap in ((8, 6), (8, 9))
    if half and narrow and 64 < max_k <= 96:
        return _BackwardKernel(128, 64, True)
    k = next(m for m in (32, 64, 128, 2**16) if max_k <= m)
    rows = 64 if k <= 64 or cap < (8, 0) or narrow or cap[0] == 12 else 128
    in_registers = half and k <= rows
    return _BackwardKernel(rows, 128 if in_registers and cap >= (8, 0) and k > 64 else 64, in_registers)


def _key_splits(b: int, h: int, s_k: int, kernel: _BackwardKernel) -> int:
    """num_splits_key (attention_backward.cu's heuristic): a split per block of keys, one where the
    batch x heads already fill the card and the keys are few, and where the key and value gradients
    need accumulators at most 200 over batch x heads (their size grows with the splits)."""
    splits = -(-s_k // kernel.cols)
    if b * h >= 256 and s_k <= 2 * kernel.cols:
        splits = 1
    if not kernel.in_registers:
        splits = min(splits, 200 // (b * h))
    return max(splits, 1)


def efficient_backward_bytes(shape: FusedShape, g: Geometry) -> tuple[int, int, int, int]:
    """What the memory-efficient attention backward allocates after its gradients, in order (bytes;
    0: none there): the output's gradient times the output and its sum over the value dim (fp32,
    where the kernel does not compute delta itself: kKernelComputesDelta is for 16-bit types),
    delta (B x H x S_q fp32), and the kernel's workspace (kernel_backward.h, workspace_size()), per
    batch and head aligned to 4 floats: the query gradient's accumulators, a 16-byte lock and a
    rows x cols fp32 tile for each block of rows and of head-dim columns (GradQTempStorage); and for
    a 16-bit kernel that keeps them out of registers, key and value accumulators, keys a block x the
    head dims aligned to rows, for each split of the keys. On ROCm (AOTriton) delta alone, where its
    fused backward (head dim <= 192, head dim x S_q < 32768) does not run."""
    b, h, s_q, d, d_v = shape.b, shape.h, shape.s_q, shape.d, shape.d_v
    delta = b * h * s_q * 4
    if g.rocm:
        return 0, 0, (0 if d <= 192 and d * s_q < 64 * 512 else delta), 0
    half = shape.esize != 4
    kernel = _efficient_backward_kernel(max(d, d_v), half, g)
    rows, cols = kernel.rows, kernel.cols
    floats = -(-s_q // rows) * -(-d // cols) * (4 + rows * cols)
    if half and not kernel.in_registers:
        splits = _key_splits(b, h, shape.s_k, kernel)
        floats += splits * cols * (-(-d // rows) * rows + -(-d_v // rows) * rows)
    workspace = b * h * (-(-floats // 4) * 4) * 4
    if half:
        return 0, 0, delta, workspace
    return b * s_q * h * d_v * 4, b * s_q * h * 4, delta, workspace


EFFICIENT_PREFIX = "effbwd:"


def efficient_code(shape: FusedShape, part: int) -> str:
    """The code of the memory-efficient backward's part `part` (efficient_backward_bytes' order)."""
    return _shape_code(EFFICIENT_PREFIX, shape, part)


# An attention kernel's scratch by its code's kind: its parts' bytes from the call's shape and the card
_BY_SHAPE = {SPLITKV_PREFIX[:-1]: flash_splitkv_bytes, EFFICIENT_PREFIX[:-1]: efficient_backward_bytes}


# ---- a trace's record of them -------------------------------------------------------------------

def scratch_bytes(code: str, g: Geometry) -> int:
    """The bytes of the allocation a trace recorded as `code` (a kernel's, as the tracker wrote it)
    on a card of geometry `g`; 0 where that card's launch makes none."""
    kind, _, rest = code.partition(":")
    part, _, args = rest.partition(":")
    if kind in _BY_SHAPE:
        return _BY_SHAPE[kind](FusedShape(*(int(v) for v in args.split(","))), g)[int(part)]
    if kind == "reduce":
        a, outs, ins, fastest, in_vec, out_vec = (int(v) for v in args.split(","))
        found = reduce_buffers(Reduction(a, outs, ins, bool(fastest), in_vec, out_vec), g)
        return 0 if found is None else found[int(part)]
    if kind == "split_copy":
        num_chunks, _, sizes = args.partition(":")
        return split_copy_table([int(v) for v in sizes.split(",")], int(num_chunks), g)
    if kind == "chunk_cat":
        return chunk_cat_table([int(v) for v in args.split(",")])
    if kind == embedding_kernels.CODE_PREFIX[:-1]:
        return embedding_kernels.bytes_of(args, int(part), g.multiprocessors, g.warp)
    raise ValueError(f"a trace's kernel scratch {code!r} is none this harness sizes")


def reduce_code(r: Reduction, part: int) -> str:
    """The code of a reduction's staging buffer (part 0) or semaphores (part 1)."""
    return f"reduce:{part}:" + ",".join(str(int(v)) for v in r)


def split_copy_code(chunk_bytes: list[int], num_chunks: int) -> str:
    return f"split_copy:0:{num_chunks}:" + ",".join(str(int(c)) for c in chunk_bytes)


# _chunk_cat's table is the same on every card (no card sizes it: record.trace_store leaves it as
# traced); its code names its chunks, which the shard count sizes (probe.sim.shard_counts)
CHUNK_CAT_PREFIX = "chunk_cat:"


def chunk_cat_code(pad_chunk_bytes: list[int]) -> str:
    return f"{CHUNK_CAT_PREFIX}0:" + ",".join(str(int(c)) for c in pad_chunk_bytes)
