"""NCCL's own memory on each GPU of a job over several: outside PyTorch's allocator, per communicator.

NCCL allocates its channels' buffers itself (cudaMalloc / cuMem), so no allocator statistic sees
them; a rank's card has that much less room for PyTorch. PyTorch makes one NCCL communicator per
process group a rank runs collectives on, when it first runs one: a job on a device mesh uses one
per mesh dimension over more than one GPU (DeviceMesh reuses the default group for a 1-D mesh over
every GPU; DDP runs on the default group). Each holds, per channel and peer, a FIFO per protocol
(NCCL_BUFFSIZE, 4 MiB for Simple, and the LL128 and LL ones): its size follows the channels NCCL
picks for the topology, which no trace can see. So the bytes per communicator are an estimate with
a spread, or the user's figure (`parallel.nccl_bytes_per_communicator`, e.g. from a real run's
`torch.cuda.mem_get_info` less `memory_reserved` and the CUDA context).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from harness.config.point import Card, Parallel

MiB = 2**20
# Per communicator: 0.5 GiB, known to within +0.5 GiB (the low end of a card is its high end).
ESTIMATE_BYTES = 512 * MiB
SPREAD_BYTES = 512 * MiB
ESTIMATE_SOURCE = (
    "estimate: ~0.5 GB per communicator (Fujii et al.'s estimator, okoge-kaz.github.io/tools/memory-estimator, "
    "after arXiv:2411.06465); 8 x H100 in one node: 0.5-0.6 GB outside PyTorch beyond the CUDA context before "
    "any all-to-all (NVIDIA/nccl#1685), one communicator after an all-reduce ~1.1 GB beyond it (NVIDIA/nccl#864); "
    "it grows with NCCL's channels, linearly (NVIDIA/nccl#986)")
USER_SOURCE = "parallel.nccl_bytes_per_communicator"


@dataclass(frozen=True)
class NcclMemory:
    """What NCCL holds on each GPU of the job: `communicators` x bytes each, +- `spread_bytes`."""
    communicators: int = 0
    bytes: int = 0
    spread_bytes: int = 0
    source: str = ""


def communicators(parallel: Parallel) -> int:
    """The NCCL communicators each rank makes: one per dimension of the job's mesh."""
    return len(parallel.mesh_shape[0])


def per_rank(parallel: Parallel) -> NcclMemory:
    """NCCL's memory on each GPU of a job spread as `parallel` says (none on one GPU)."""
    n = communicators(parallel)
    if n == 0:
        return NcclMemory()
    mine = parallel.nccl_bytes_per_communicator
    if mine is not None:
        return NcclMemory(n, n * mine, 0, USER_SOURCE)
    return NcclMemory(n, n * ESTIMATE_BYTES, n * SPREAD_BYTES, ESTIMATE_SOURCE)


def of_row(row) -> NcclMemory:
    """The NCCL memory a row recorded (none for a row of one GPU, or from before it was recorded)."""
    def num(key: str) -> int:
        v = row.get(key)
        return 0 if v is None or v != v else int(v)  # NaN: a missing value read back
    return NcclMemory(num("nccl_communicators"), num("nccl_bytes"), num("nccl_spread_bytes"),
                      str(row.get("nccl_source") or ""))


def columns(nccl: NcclMemory) -> dict:
    """The row's columns for it."""
    return {"nccl_communicators": nccl.communicators, "nccl_bytes": nccl.bytes,
            "nccl_spread_bytes": nccl.spread_bytes, "nccl_source": nccl.source or None}


def on_rank(card: Card, parallel: Parallel) -> Card:
    """`card` as one GPU of a job spread as `parallel` says sees it."""
    return on_card(card, per_rank(parallel))


def on_rows_rank(card: Card, row) -> Card:
    """`card` as one GPU of a row's job saw it (the NCCL memory the row recorded)."""
    return on_card(card, of_row(row))


def on_card(card: Card, nccl: NcclMemory) -> Card:
    """`card` as one rank of the job sees it: NCCL's memory is outside PyTorch, like the context."""
    if not nccl.bytes and not nccl.spread_bytes:
        return card
    return dataclasses.replace(
        card, non_pytorch_bytes=card.non_pytorch_bytes + nccl.bytes,
        non_pytorch_spread_bytes=card.non_pytorch_spread_bytes + nccl.spread_bytes,
        non_pytorch_source=f"{card.non_pytorch_source}; NCCL: {nccl.communicators} communicator(s), "
                           f"{nccl.bytes} B ({nccl.source})")
