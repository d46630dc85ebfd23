"""A job over several GPUs on the virtual GPU: one rank traced in one process.

The process joins a fake process group of the job's world size (torch's `fake` backend: every
collective returns at once, nothing is sent) as rank 0, and the model is sharded as the job would
shard it, FSDP2's `fully_shard` on each decoder layer and on the root. What the tracker then sees
is rank 0's memory: its shards of the parameters, gradients and optimizer state, the all-gather
and reduce-scatter buffers FSDP2 allocates on its own streams (virtual_cuda numbers them, the
allocator model keeps their blocks in those streams' pools), the next layer gathered while this
one computes. FSDP2 pads each shard to the same size, so every rank holds what rank 0 does.
FSDP2 places what it allocates on its mesh's device, the fake group's "cpu": in a sharded trace
that device is the card (cuda_script's `cpu_is_card`), not the host.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from harness.config.point import Parallel


@contextlib.contextmanager
def process_group(parallel: Parallel) -> Iterator[object | None]:
    """This rank's device mesh inside: of the process group the process is in, where it is one of
    the job's world size (real ranks: gloo on CPU tensors, NCCL), else of rank 0 of a fake group
    joined for the trace. None, and nothing joined, on one GPU. Made before the trace's
    FakeTensorMode: the mesh's setup reads values."""
    if parallel.world_size == 1:
        yield None
        return
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    joined = not dist.is_initialized()
    if joined:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=parallel.world_size)
    elif dist.get_world_size() != parallel.world_size:
        raise ValueError(f"this process's group has {dist.get_world_size()} ranks, the job {parallel.world_size}")
    try:
        yield init_device_mesh("cpu", (parallel.dp_shard,), mesh_dim_names=("dp_shard",))
    finally:
        if joined:
            dist.destroy_process_group()


def shard(model: torch.nn.Module, mesh, parallel: Parallel) -> None:
    """FSDP2 as torchtitan applies it: each decoder layer its own group, then the root (embedding,
    final norm and head)."""
    from torch.distributed.fsdp import fully_shard

    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, reshard_after_forward=parallel.reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=parallel.reshard_after_forward)


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """A transformers causal LM's decoder layers (model.model.layers)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ValueError(f"{type(model).__name__} has no model.layers to shard")
    return list(layers)


# The collectives FSDP2 calls (and DDP's, HSDP's all-reduce), by their torch.distributed names
_COLLECTIVES = ("all_gather_into_tensor", "all_gather_single", "reduce_scatter_tensor", "reduce_scatter_single",
                "all_reduce", "all_gather", "broadcast")
# What a rank's traffic is counted by: an all-gather's whole output (what each rank assembles), a
# reduce-scatter's whole input (what each rank contributes); (collective, keyword, position)
_TRAFFIC = {"all_gather_into_tensor": ("all_gather", "output_tensor", 0),
            "all_gather_single": ("all_gather", "output_tensor", 0),
            "reduce_scatter_tensor": ("reduce_scatter", "input", 1),
            "reduce_scatter_single": ("reduce_scatter", "input", 1)}


@contextlib.contextmanager
def collectives_own_buffers(tracker):
    """What a collective allocates inside itself is the communication backend's: NCCL's buffers are
    not the caching allocator's (gloo's copies, on real CPU ranks, are counted nowhere either). The
    tracker counts them as it counts host memory: not at all. The bytes each collective moves are
    added up per step in `tracker.traffic` ({(all_gather | reduce_scatter, step): bytes})."""
    import torch.distributed as dist

    def inside(name, fn):
        what, keyword, position = _TRAFFIC.get(name, (None, None, None))

        def call(*args, **kwargs):
            if what is not None and tracker.recording:
                t = kwargs[keyword] if keyword in kwargs else args[position]
                key = (what, tracker.step)
                tracker.traffic[key] = tracker.traffic.get(key, 0) + t.numel() * t.element_size()
            tracker.inside_collective += 1
            try:
                return fn(*args, **kwargs)
            finally:
                tracker.inside_collective -= 1
        return call

    saved = {name: getattr(dist, name) for name in _COLLECTIVES}
    for name, fn in saved.items():
        setattr(dist, name, inside(name, fn))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def traffic_per_step(tracker) -> dict[str, int]:
    """The bytes one step all-gathers and reduce-scatters on this rank: its last step's (the steps
    after the first are alike)."""
    last = max((step for _what, step in tracker.traffic), default=None)
    return {f"{what}_bytes": tracker.traffic.get((what, last), 0) for what in ("all_gather", "reduce_scatter")}
