"""A job over several GPUs on the virtual GPU: one rank traced in one process.

The process joins a fake process group of the job's world size (torch's `fake` backend: every
collective returns at once, nothing is sent) as rank 0, and the model is spread as the job would
spread it (probe.parallelize: tensor parallel, FSDP2 or HSDP, DDP). What the tracker then sees is
rank 0's memory: its shards of the parameters, gradients and optimizer state, the all-gather and
reduce-scatter buffers FSDP2 allocates on its own streams (virtual_cuda numbers them, the
allocator model keeps their blocks in those streams' pools), the next layer gathered while this
one computes, DDP's gradient buckets, a tensor-parallel rank's slices of each projection and of
its activations. FSDP2 pads each shard to the same size and tensor parallel gives rank 0 the
largest slice, so no rank holds more than rank 0 does. Torch places what it allocates on the
mesh's device, the fake group's "cpu": in such a trace that device is the card (cuda_script's
`cpu_is_card`), not the host.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import torch
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from harness.config.point import Parallel
from harness.probe.parallelize import device_mesh
from harness.probe.sim.patches import patched
from harness.record.row import TRAFFIC


@contextlib.contextmanager
def process_group(parallel: Parallel) -> Iterator[object | None]:
    """This rank's device mesh inside (Parallel.mesh_shape): of the process group the
    process is in, where it is one of the job's world size (real ranks: gloo on CPU tensors, NCCL),
    else of rank 0 of a fake group joined for the trace. None, and nothing joined, on one GPU.
    Made before the trace's FakeTensorMode: the mesh's setup reads values."""
    if parallel.world_size == 1:
        yield None
        return
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    joined = not dist.is_initialized()
    if joined:
        _forget_other_meshes(parallel.mesh_shape)
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=parallel.world_size)
    elif dist.get_world_size() != parallel.world_size:
        raise ValueError(f"this process's group has {dist.get_world_size()} ranks, the job {parallel.world_size}")
    try:
        with fake_group_workarounds() if joined else contextlib.nullcontext(), \
                pointwise_lists_on_shards() if joined else contextlib.nullcontext():
            yield device_mesh(parallel, "cpu")
    finally:
        if joined:
            dist.destroy_process_group()


_joined_shape: tuple | None = None  # the mesh shape of the last fake group this process joined


def _forget_other_meshes(shape: tuple) -> None:
    """Before a fake group of mesh `shape` is joined, clear what DTensor keeps by device mesh where
    the last group's mesh was another: its sharding propagation's answers (by op and operand specs)
    and its redistribution planners (by a weak reference to the mesh, which the planner holds
    itself). A mesh equals any other of the same ranks and dimensions whatever its process groups,
    so a trace was handed an earlier one's, its groups gone (in one process, one over 8 shards x TP
    2, then one over 4 replicas x 2 shards x TP 2: "Could not resolve the process group registered
    under the name 3"). The same shape makes the same groups under the same names: its answers are
    kept (a tensor-parallel point's shallow depths: 15-20% of its time)."""
    global _joined_shape
    if _joined_shape == shape:
        return
    _joined_shape = shape
    if "torch.distributed.tensor" not in sys.modules:
        return
    from torch.distributed.tensor._redistribute import clear_redistribute_planner_cache
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()  # (its C++ fast path's and Python's)
    clear_redistribute_planner_cache()


@contextlib.contextmanager
def fake_group_workarounds() -> Iterator[None]:
    """What torch's parallel code needs of a fake group under FakeTensorMode, given without
    changing what it allocates:
    - DDP checks that every rank's parameters have the same shapes by sending rank 0's as a tensor
      of int64 it fills and reads back (`_verify_param_shape_across_processes`): those small tensors
      are real.
    - DDP's default communication hook reads the all-reduce's result from the collective's future,
      which the fake group leaves empty: the hook is torch's own default (divide the bucket by the
      world size in place, all-reduce it) returning the bucket it reduced in place, as the real one
      does.
    - DDP rebuilds its buckets in the order the first step's gradients came (at the second
      forward), rank 0 sending the new assignment as a tensor of int32 indices: real too (the
      buckets stay fake).
    - A functional collective (tensor parallel's all-reduces) returns, in eager, a wrapper that
      waits for its result where it is first used, so its input lives until then; under
      FakeTensorMode torch takes itself to be compiling and waits at once: not here.
    - FSDP2 over a tensor-parallel mesh joins two meshes into one (DeviceMesh._concatenate), which
      builds its rank map from real tensors: outside FakeTensorMode, as before the trace.
    - FSDP2 cuts each parameter into one view per rank to keep its own (and read the first's size):
      here each view is made when read (_Chunks), not 64 fake views a parameter over 64 ranks.
      Views own no storage: what is allocated is the same."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    import torch.distributed.fsdp._fully_shard._fsdp_param as fsdp_param
    import torch.nn.parallel.distributed as ddp
    from torch.distributed.device_mesh import DeviceMesh

    def fill_bucket(_state, bucket):
        buffer = bucket.buffer()
        buffer.div_(dist.get_world_size())
        dist.all_reduce(buffer)
        done: torch.futures.Future = torch.futures.Future()
        done.set_result(buffer)
        return done

    DDP = ddp.DistributedDataParallel
    ddp_init, pre_forward, verify = DDP.__init__, DDP._pre_forward, ddp._verify_param_shape_across_processes
    concatenate = DeviceMesh._concatenate

    def init(self, *args, **kwargs):
        ddp_init(self, *args, **kwargs)
        self.register_comm_hook(None, fill_bucket)

    def pre_forward_with_real_indices(self, *args, **kwargs):
        with _RealIndices(torch.int32):
            return pre_forward(self, *args, **kwargs)

    def verify_with_real_shapes(*args, **kwargs):
        with _RealIndices(torch.int64):
            return verify(*args, **kwargs)

    def concatenate_on_values(*args, **kwargs):
        with unset_fake_temporarily():
            return concatenate(*args, **kwargs)

    with patched([(DDP, "__init__", init), (DDP, "_pre_forward", pre_forward_with_real_indices),
                   (ddp, "_verify_param_shape_across_processes", verify_with_real_shapes),
                   (funcol, "_are_we_tracing", lambda: False),
                   (DeviceMesh, "_concatenate", staticmethod(concatenate_on_values)),
                   (fsdp_param, "_chunk_with_empty", _Chunks)]):
        yield


# The optimizers' elementwise foreach ops (AdamW's, SGD's with momentum, their amsgrad and
# maximize variants): each element of the result is made from the same element of each operand
_POINTWISE_LISTS = ("_foreach_add", "_foreach_add_", "_foreach_sub", "_foreach_sub_", "_foreach_mul", "_foreach_mul_",
                    "_foreach_div", "_foreach_div_", "_foreach_lerp", "_foreach_lerp_", "_foreach_addcmul",
                    "_foreach_addcmul_", "_foreach_addcdiv", "_foreach_addcdiv_", "_foreach_sqrt", "_foreach_sqrt_",
                    "_foreach_neg", "_foreach_neg_", "_foreach_reciprocal", "_foreach_reciprocal_",
                    "_foreach_maximum", "_foreach_maximum_", "_foreach_zero_", "_foreach_copy_")


@contextlib.contextmanager
def pointwise_lists_on_shards() -> Iterator[None]:
    """An elementwise foreach op on DTensors laid out alike (at each position of its lists one mesh,
    one placement of Shard and Replicate, one global shape and contiguous) runs on their local
    tensors and its results keep that layout: what DTensor's sharding propagation decides for it,
    without deciding it per tensor of its lists (that took 0.27 s of a 70B rank's trace: each of
    AdamW's seven ops in the first step of each depth traced). Any other call goes through DTensor."""
    from torch._prims_common import make_contiguous_strides_for
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    handlers = DTensor._op_dispatcher._custom_op_handlers
    ops = [getattr(packet, overload) for name in _POINTWISE_LISTS if (packet := getattr(torch.ops.aten, name, None))
           for overload in packet.overloads()]
    ops = [op for op in ops if op not in handlers]

    def plain(s: DTensorSpec) -> bool:  # sharded or replicated (not partial), contiguous
        return all(isinstance(p, (Shard, Replicate)) for p in s.placements) and s.tensor_meta is not None \
            and s.tensor_meta.stride == make_contiguous_strides_for(s.shape)

    def layout(args, kwargs) -> list[DTensorSpec] | None:
        """Each list position's spec where every operand is laid out alike there, else None."""
        specs: list[DTensorSpec] | None = None
        for a in (*args, *kwargs.values()):
            if isinstance(a, torch.Tensor):
                return None  # a lone tensor (a scalar's): DTensor's rules for it
            if not isinstance(a, (list, tuple)) or not a or not isinstance(a[0], torch.Tensor):
                continue
            if not all(isinstance(t, DTensor) for t in a):
                return None
            if specs is None:
                specs = [t._spec for t in a]
                if not all(plain(s) for s in specs):
                    return None
            elif len(a) != len(specs) or any(t._spec.mesh != s.mesh or t._spec.placements != s.placements or
                                              t._spec.shape != s.shape for t, s in zip(a, specs, strict=False)):
                return None
        return specs

    def local(a):  # a list of DTensors as their local tensors
        return [t._local_tensor for t in a] if isinstance(a, (list, tuple)) and a and isinstance(a[0], DTensor) else a

    def on_shards(op, args, kwargs):
        specs = layout(args, kwargs)
        if specs is None:
            del handlers[op]
            try:
                return op(*args, **kwargs)
            finally:
                handlers[op] = on_shards
        out = op(*map(local, args), **{k: local(v) for k, v in kwargs.items()})
        if out is None:
            return None
        return [DTensor(t, s if t.dtype == s.tensor_meta.dtype else
                        DTensorSpec(s.mesh, s.placements, TensorMeta(s.shape, s.tensor_meta.stride, t.dtype)),
                        requires_grad=t.requires_grad) for t, s in zip(out, specs, strict=True)]

    handlers.update(dict.fromkeys(ops, on_shards))
    try:
        yield
    finally:
        for op in ops:
            handlers.pop(op, None)


class _Chunks:
    """FSDP2's `_chunk_with_empty(tensor, n, dim)`: torch.chunk's pieces along `dim` (each
    ceil(size / n) long, the last shorter, none past the end), padded to `n` with empty tensors;
    each made when indexed."""

    def __init__(self, tensor: torch.Tensor, n: int, dim: int):
        self.tensor, self.n, self.dim = tensor, n, dim
        self.size = tensor.size(dim)
        self.step = -(-self.size // n)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if not -self.n <= i < self.n:
            raise IndexError(i)
        start = (i % self.n) * self.step
        if start < self.size:
            return self.tensor.narrow(self.dim, start, min(self.step, self.size - start))
        return self.tensor.narrow(self.dim, 0, 0) if i % self.n == 0 else self[0].new_empty(0)


class _RealIndices(TorchDispatchMode):
    """Empty tensors of `dtype` made real (outside FakeTensorMode, still tracked), and what is done
    to real tensors alone done for real: DDP's shapes and bucket indices, filled, sent, read back."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        indices = func is torch.ops.aten.empty.memory_format and kwargs.get("dtype") == self.dtype
        if indices or (tensors and not any(isinstance(t, FakeTensor) for t in tensors)):
            with unset_fake_temporarily():
                return func(*args, **kwargs)
        return func(*args, **kwargs)


# The collectives FSDP2 calls (and DDP's, HSDP's all-reduce), by their torch.distributed names;
# tensor parallel's are functional collectives, whose outputs are the caching allocator's
_COLLECTIVES = ("all_gather_into_tensor", "all_gather_single", "reduce_scatter_tensor", "reduce_scatter_single",
                "all_reduce", "all_gather", "broadcast")
# What a rank's traffic is counted by: an all-gather's whole output (what each rank assembles), a
# reduce-scatter's whole input (what each rank contributes), an all-reduce's tensor (DDP's buckets,
# HSDP's shards across replicas); (collective, keyword, position)
_TRAFFIC = {"all_gather_into_tensor": ("all_gather", "output_tensor", 0),
            "all_gather_single": ("all_gather", "output_tensor", 0),
            "reduce_scatter_tensor": ("reduce_scatter", "input", 1),
            "reduce_scatter_single": ("reduce_scatter", "input", 1),
            "all_reduce": ("all_reduce", "tensor", 0)}

# The tracker's finding (a trace's): what of its traffic figures is over tensor parallel's mesh (its
# activations' collectives, the same over any count of data-parallel GPUs), where it has any
TENSOR_PARALLEL_TRAFFIC = "tensor_parallel_traffic"

# DTensor's collectives (tensor parallel: a partial sum made whole, a shard gathered or scattered)
_FUNCTIONAL = {"all_reduce": "all_reduce", "all_gather_single": "all_gather", "reduce_scatter_single": "reduce_scatter"}


@contextlib.contextmanager
def collectives_own_buffers(tracker):
    """What a collective allocates inside itself is the communication backend's: NCCL's buffers are
    not the caching allocator's (gloo's copies, on real CPU ranks, are counted nowhere either). The
    tracker counts them as it counts host memory: not at all. The bytes each collective moves are
    added up per step in `tracker.traffic` ({(all_gather | reduce_scatter | all_reduce, step, over
    tensor parallel's mesh): bytes}): tensor parallel's are DTensor's functional collectives, the data
    parallel ones' (FSDP2's, DDP's, HSDP's) torch.distributed's."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    def count(what: str, t: torch.Tensor, tensor_parallel: bool = False) -> None:
        if tracker.recording:
            key = (what, tracker.step, tensor_parallel)
            tracker.traffic[key] = tracker.traffic.get(key, 0) + t.numel() * t.element_size()

    def inside(name, fn):
        what, keyword, position = _TRAFFIC.get(name, (None, None, None))

        def call(*args, **kwargs):
            if what is not None:
                count(what, kwargs[keyword] if keyword in kwargs else args[position])
            tracker.inside_collective += 1
            try:
                return fn(*args, **kwargs)
            finally:
                tracker.inside_collective -= 1
        return call

    def functional(what, fn):  # its output is a tensor of the caching allocator's, tracked as any
        def call(tensor, *args, **kwargs):
            out = fn(tensor, *args, **kwargs)
            count(what, out if what == "all_gather" else tensor, tensor_parallel=True)  # as _TRAFFIC counts
            return out
        return call

    # (a name this torch lacks is one its FSDP2 and DTensor do not call: all_gather_single on 2.11)
    with patched([*((dist, name, inside(name, getattr(dist, name))) for name in _COLLECTIVES if hasattr(dist, name)),
                   *((funcol, name, functional(what, getattr(funcol, name))) for name, what in _FUNCTIONAL.items()
                     if hasattr(funcol, name))]), \
            ddp_buckets_are_gradients(tracker):
        yield


@contextlib.contextmanager
def ddp_buckets_are_gradients(tracker):
    """DDP's gradient buckets (a flat copy of every gradient, made when DDP wraps the model and
    again when its first step's order rebuilds them, at the second forward) are gradients, not the
    setup's parameters or the forward's activations: what DDP makes there is tagged so (with the
    small tensors it broadcasts meanwhile, freed at once)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    def as_gradients(fn):
        def call(*args, **kwargs):
            before, tracker.kind_override = tracker.kind_override, "gradient"
            try:
                return fn(*args, **kwargs)
            finally:
                tracker.kind_override = before
        return call

    with patched([(DDP, "__init__", as_gradients(DDP.__init__)),
                   (DDP, "_pre_forward", as_gradients(DDP._pre_forward))]):
        yield


def traffic_per_step(tracker, tensor_parallel: bool | None = None) -> dict[str, int]:
    """The bytes one step all-gathers, reduce-scatters and all-reduces on this rank: its last step's
    (the steps after the first are alike); over tensor parallel's mesh only, or over the others
    only, where `tensor_parallel` says which."""
    last = max((step for _what, step, _tp in tracker.traffic), default=None)
    return {f"{what}_bytes": sum(tracker.traffic.get((what, last, tp), 0) for tp in (False, True)
                                 if tensor_parallel in (None, tp)) for what in TRAFFIC}
