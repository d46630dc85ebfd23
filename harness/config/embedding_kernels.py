"""What CUDA's embedding backward allocates for itself (aten::embedding_dense_backward, the weight
gradient of nn.Embedding: every language model's token table), which its meta kernel does not make.

Up to 3,072 indices (and without scale_grad_by_freq) one kernel adds the rows into the gradient:
nothing but its output. Past that (Embedding.cu, embedding_dense_backward_cuda) it sorts the
indices with CUB and sums each run of equal ones (EmbeddingBackwardKernel.cu,
embedding_backward_cuda_kernel), sized by upper bounds so that no value is read back:

- before its output: the sorted indices and their positions (one index each), a range to sort
  them by, CUB's radix sort's temporary storage (its alternate keys and values, one index each,
  and its histograms), freed as the sort returns, and the range with it;
- after it: each run's start (one index each) and their count (8 B), CUB's unique-by-key (its own
  keys out, one index each, and its tile states), the partial runs per run and their offsets
  (min(indices, rows) each), an exclusive sum's tile states, the partial runs' count (8 B) and
  starts (indices / 10 + min(indices, rows) each), then one of two sums: each partial run's rows in
  the accumulator type (max partial runs x the row's width, fp32 for 16-bit gradients: 141 MiB for
  8,192 tokens of a 4,096-wide table) summed into the gradient; or, where that sum's grid would
  leave the card's SMs idle and the partial runs outnumber its blocks 4 to 1 (few rows: small
  vocabularies), an atomic sum with a map of partial run to run (one index each) and, for 16-bit
  gradients, an fp32 copy of the whole gradient. Neither where deterministic algorithms are on.

All is freed as it returns, last first (its locals' scopes). The sum's choice reads the SM count,
so those three allocations carry a code (`embbwd:<part>:<shape>`) that sizes them on any card (0 B
where that card takes the other sum); the rest is the same on every card. CUB's temporary storage
follows its source (cub/device/dispatch: the onesweep radix sort of sm80 and later, AliasTemporaries'
256-B alignment); its tile states' tiles are estimates (a few hundred bytes either way), and the
multi-pass sort of cards before sm80 keeps a spine of histograms per block (tens to hundreds of KiB,
freed at once) that is not modelled, nor ROCm's hipCUB. Read from PyTorch's source; not measured
(the H200 histories here have 2,048 tokens a step, under the single kernel's 3,072).
"""

from __future__ import annotations

from typing import NamedTuple

DIRECT_MAX_INDICES = 3072  # embedding_backward_feature_kernel up to this many indices
_NROWS_PER_THREAD = 10  # rows a partial run sums
_ATOMIC_ACCUM_BLOCKS_PER_SM = 4
_MAX_BLOCK_SIZE = 1024
_SCALAR_LONG = 8  # at::empty({}, kLong): a count on the card

# CUB (cub/device/dispatch/dispatch_radix_sort.cuh, InvokeOnesweep; AliasTemporaries)
_ALIGN = 256
_RADIX_DIGITS = 256  # 8 bits a pass
_ONESWEEP_THREADS = 384
_ONESWEEP_NOMINAL_ITEMS = 17  # a 64-bit offset's policy, for 4-byte items (scaled by the item's size)
_OFFSET_BYTES = 8  # PyTorch hands CUB an int64 count: 64-bit offsets
_ATOMIC_OFFSET_BYTES = 4
_TILE_STATUS_PADDING = 32  # ScanTileState: tiles kept before the first
_TILE_STATE_BYTES = 16  # a tile's status and partial and inclusive sums (64-bit)
_SCAN_TILE_ITEMS = 1536  # (an estimate: the scans' tiles are 128-256 threads of 8-15 items)


class EmbeddingBackward(NamedTuple):
    """One embedding_dense_backward call, as far as it does not depend on the card."""
    indices: int  # numel of the indices
    rows: int  # num_weights: the table's rows
    width: int  # the gradient's row: grad_weight.stride(0)
    grad_bytes: int  # the gradient's element size (2 for fp16 and bf16)
    index_bytes: int  # 8 for int64 indices, 4 for int32
    deterministic: bool  # torch.use_deterministic_algorithms(True): the two-pass sum only


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _temporaries(*sizes: int) -> int:
    """CUB's temporary storage for `sizes` (AliasTemporaries: each 256-B aligned, plus 255 B to
    align the blob)."""
    return sum(_aligned(s) for s in sizes) + _ALIGN - 1


def radix_sort_pairs_bytes(n: int, key_bytes: int, value_bytes: int) -> int:
    """DeviceRadixSort::SortPairs' temporary storage (onesweep, keys over all their bits, outputs
    not to be overwritten): the passes' histograms, a tile's lookback, a third key and value
    buffer, the passes' counters."""
    passes = -(-key_bytes * 8 // 8)
    items = max(1, _ONESWEEP_NOMINAL_ITEMS * 4 // max(4, key_bytes, value_bytes))
    blocks = -(-n // (_ONESWEEP_THREADS * items))
    return _temporaries(passes * _RADIX_DIGITS * _OFFSET_BYTES, blocks * _RADIX_DIGITS * _ATOMIC_OFFSET_BYTES,
                        n * key_bytes, n * value_bytes, passes * _ATOMIC_OFFSET_BYTES)


def tile_states_bytes(n: int) -> int:
    """A decoupled look-back scan's temporary storage (DeviceScan, DeviceSelect::UniqueByKey)."""
    return _temporaries((-(-n // _SCAN_TILE_ITEMS) + _TILE_STATUS_PADDING) * _TILE_STATE_BYTES)


def _acc_bytes(e: EmbeddingBackward) -> int:
    return 8 if e.grad_bytes > 4 else 4  # acc_type<scalar_t, true>: float up to fp32, double for double


def max_runs(e: EmbeddingBackward) -> int:
    return min(e.indices, e.rows)


def max_partial_runs(e: EmbeddingBackward) -> int:
    return e.indices // _NROWS_PER_THREAD + max_runs(e)


def atomic_sum(e: EmbeddingBackward, multiprocessors: int, warp: int) -> bool:
    """Whether the card takes the fused atomic sum (use_fused_kernel)."""
    width_warped = -(-e.width // warp) * warp
    block = min(width_warped, _MAX_BLOCK_SIZE)
    grid = -(-max_runs(e) * width_warped // block)
    return (not e.deterministic and grid < multiprocessors * _ATOMIC_ACCUM_BLOCKS_PER_SM
            and max_partial_runs(e) > grid * 4)


def sum_bytes(e: EmbeddingBackward, multiprocessors: int, warp: int) -> tuple[int, int, int]:
    """The card-dependent part, in the order made: the atomic sum's map of partial run to run and
    its fp32 gradient (16-bit gradients only), or the two-pass sum's partial sums; 0 B for the sum
    not taken."""
    if atomic_sum(e, multiprocessors, warp):
        return max_partial_runs(e) * e.index_bytes, e.rows * e.width * 4 if e.grad_bytes < 4 else 0, 0
    return 0, 0, max_partial_runs(e) * e.width * _acc_bytes(e)


CODE_PREFIX = "embbwd:"


def code(e: EmbeddingBackward, part: int) -> str:
    return f"{CODE_PREFIX}{part}:" + ",".join(str(int(v)) for v in e)


def bytes_of(args: str, part: int, multiprocessors: int, warp: int) -> int:
    """The bytes of a code's part (its arguments: `code`'s) on a card."""
    n, rows, width, grad_bytes, index_bytes, deterministic = (int(v) for v in args.split(","))
    e = EmbeddingBackward(n, rows, width, grad_bytes, index_bytes, bool(deterministic))
    return sum_bytes(e, multiprocessors, warp)[part]
