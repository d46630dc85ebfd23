"""A preset's model spread over the job's GPUs (parallel.*), in torchtitan's order: tensor parallel
inside each layer first, then FSDP2 per decoder layer and the root (HSDP when replicated too), the
shards made on this rank's device; or DDP around the whole model.

What each rank holds then is what the job's memory is per GPU: with FSDP2 a shard of every
parameter, gradient and optimizer state (padded alike on every rank); with DDP all of them plus its
gradient buckets (a flat copy of every gradient, `gradient_as_bucket_view=False` as torch defaults);
with tensor parallel the rank's columns or rows of each projection, torch.chunk's split (rank 0's
the largest where a dimension does not divide).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from harness.config.models import TP_REPLICATED
from harness.config.point import Parallel


def device_mesh(parallel: Parallel, device_type: str):
    """The job's device mesh (Parallel.mesh_shape) over the process group this process is in; None on
    one GPU."""
    if parallel.world_size == 1:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    names, sizes = parallel.mesh_shape
    return init_device_mesh(device_type, sizes, mesh_dim_names=names)


def parallelize(model: torch.nn.Module, mesh, parallel: Parallel) -> torch.nn.Module:
    """`model` (built on the meta device) as this rank holds it, on the mesh's device; the module
    to step (DDP's wrapper, or the model)."""
    if parallel.tp > 1:
        tensor_parallel(model, mesh["tp"], parallel.sequence_parallel, parallel.loss_parallel)
    if parallel.dp_shard > 1:
        dims = ("dp_replicate", "dp_shard") if parallel.dp_replicate > 1 else ("dp_shard",)
        shard(model, mesh[dims], parallel.reshard_after_forward, parallel.param_dtype)
    materialize(model, mesh.device_type, keep_identity=parallel.dp_shard > 1)
    if parallel.dp_replicate > 1 and parallel.dp_shard == 1:
        return torch.nn.parallel.DistributedDataParallel(model, process_group=mesh["dp_replicate"].get_group())
    return model


def materialize(model: torch.nn.Module, device: str, keep_identity: bool) -> None:
    """Every parameter and buffer of the meta-built model made, empty, on `device`: `to_empty`.
    FSDP2 keeps its own references to its shards (`keep_identity`): `to_empty` swaps their data in
    place. Elsewhere each is a new tensor in the module, as `to_empty` gives a plain meta tensor (the
    swap it uses for tensor subclasses, fake tensors among them, cannot move one off meta)."""
    if keep_identity:
        model.to_empty(device=device)
        return
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            module._parameters[name] = torch.nn.Parameter(torch.empty_like(p, device=device), p.requires_grad)
        for name, b in module.named_buffers(recurse=False):
            module._buffers[name] = torch.empty_like(b, device=device)


def shard(model: torch.nn.Module, mesh, reshard_after_forward: bool, param_dtype: str | None = None) -> None:
    """FSDP2 as torchtitan applies it: each decoder layer its own group, then the root (embedding,
    final norm and head). On a 2-D mesh (replicas, shards): HSDP. With `param_dtype`, torchtitan's
    MixedPrecisionPolicy: gathered and computed in that dtype, gradients reduced in fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16}
    policy = MixedPrecisionPolicy(param_dtype=dtypes[param_dtype], reduce_dtype=torch.float32) if param_dtype \
        else MixedPrecisionPolicy()
    for layer in [*decoder_layers(model), model]:
        # FSDP2 flattens a group's parameters into one dtype: those a model keeps in another (a
        # router's in fp32: _keep_in_fp32_modules) are their own group, inside the layer's
        for module in _other_dtype(layer):
            fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)


def _other_dtype(group: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules inside `group` (not yet sharded) whose own parameters are of a dtype other than
    most of the group's parameters."""
    from torch.distributed.fsdp import FSDPModule

    def free(module: torch.nn.Module):  # the modules whose parameters fall to `group` (not already sharded)
        for child in module.children():
            if not isinstance(child, FSDPModule):
                yield child
                yield from free(child)

    owned = [group, *free(group)]
    counts: dict[torch.dtype, int] = {}
    for m in owned:
        for p in m.parameters(recurse=False):
            counts[p.dtype] = counts.get(p.dtype, 0) + p.numel()
    if len(counts) < 2:
        return []
    most = max(counts, key=lambda d: counts[d])
    return [m for m in owned[1:] if any(p.dtype != most for p in m.parameters(recurse=False))]


def tensor_parallel(model: torch.nn.Module, mesh, sequence_parallel: bool = False, loss_parallel: bool = False) -> None:
    """The model's own tensor-parallel plan, as transformers applies it (the model's `_tp_plan`; for
    Llama, Qwen2 and Mistral: q/k/v, gate and up split by columns, o and down by rows, the embedding
    by vocabulary rows, the head by columns and gathered); norms replicated. With
    `sequence_parallel`, torchtitan's plan for Llama: the norms and the residual stream split over
    the sequence (sequence_parallel_plan). With `loss_parallel`, the head's output stays split over
    the vocabulary (a DTensor), for the loss to be computed under torch's loss_parallel()."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    plan = getattr(model, "_tp_plan", None)
    if not plan:
        raise ValueError(f"{type(model).__name__} has no tensor-parallel plan (transformers' _tp_plan)")
    # (a replicated module, Gemma 3's query and key norms, is left to the replication below)
    styles = {name: _style(style, name, sequence_parallel, loss_parallel) for name, style in plan.items()
              if style != TP_REPLICATED}
    if sequence_parallel:
        styles.update(sequence_parallel_plan(model))
    parallelize_module(model, mesh, styles)
    # The rest (the norms) replicated as DTensors on the mesh: plain tensors beside DTensors fail
    # torch.optim's foreach step ("mixed torch.Tensor and DTensor"), on any device.
    for module in [m for m in model.modules() if any(not isinstance(p, DTensor) for p in m.parameters(recurse=False))]:
        replicate(module, mesh)


def sequence_parallel_plan(model: torch.nn.Module) -> dict:
    """What sequence parallel adds to the plan, by module name, as torchtitan's Llama plan has it:
    the embedding split by vocabulary rows and reduce-scattered to the rank's slice of the sequence;
    the residual stream between layers, and the norms on it (SequenceParallel), slices; attention and
    the MLP all-gather their input (their row-split outputs reduce-scatter back: _style); the final
    norm on slices, all-gathered into the head. The stream stays a DTensor: the model-level code
    (rotary embedding, mask) reads its whole sequence length from it."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput, RowwiseParallel, SequenceParallel

    layers = decoder_layers(model)
    prefix = next(name for name, m in model.named_modules() if m is layers[0]).rsplit(".", 1)[0]
    base = prefix.rsplit(".", 1)[0]
    for owner, part in [(layers[0], p) for p in ("input_layernorm", "post_attention_layernorm", "self_attn", "mlp")] \
            + [(model.get_submodule(base), p) for p in ("embed_tokens", "norm")]:
        if not hasattr(owner, part):
            raise ValueError(f"sequence parallel knows Llama-style models; {type(owner).__name__} has no {part}")
    styles: dict = {f"{base}.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1),
                                                            use_local_output=False),
                    f"{base}.norm": SequenceParallel(use_local_output=True)}
    for i in range(len(layers)):
        at = f"{prefix}.{i}"
        styles[f"{at}.input_layernorm"] = SequenceParallel()
        styles[f"{at}.post_attention_layernorm"] = SequenceParallel()
        styles[f"{at}.self_attn"] = PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                                       desired_input_kwarg_layouts={"hidden_states": Replicate()})
        styles[f"{at}.mlp"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    return styles


def replicate(module: torch.nn.Module, mesh) -> None:
    """`module`'s parameters held whole by every rank, as DTensors (Replicate); its inputs and
    outputs stay local tensors, as the plan's other styles leave them."""
    from torch.distributed.tensor import DTensor, Replicate, distribute_module

    def to_dtensor(_module, inputs, mesh):
        return tuple(DTensor.from_local(x, mesh, (Replicate(),), run_check=False)
                     if isinstance(x, torch.Tensor) else x for x in inputs)

    def to_local(_module, outputs, _mesh):
        return outputs.to_local() if isinstance(outputs, DTensor) else outputs

    distribute_module(module, mesh, input_fn=to_dtensor, output_fn=to_local)


def _style(name: str, module: str, sequence_parallel: bool = False, loss_parallel: bool = False):
    """torch's parallel style for one of transformers' plan words (as transformers registers them:
    distributed/tensor_parallel.py); with sequence parallel, a layer's row-split output is
    reduce-scattered to sequence slices and the head takes slices in; with loss parallel, the head's
    output stays split over the vocabulary (Shard(-1), as torchtitan's plan). Inside a layer a
    gathered output is whole (OLMo 2's q/k/v for its norms over all heads, Phi-3's fused qkv), and
    the row split that takes it (rowwise_split_input) slices it locally."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    in_layers = ".layers." in f".{module}"
    into_layers = sequence_parallel and in_layers
    head_in = Shard(1) if sequence_parallel and not in_layers else Replicate()
    head_out: dict[str, Any] = {"output_layouts": Shard(-1), "use_local_output": False} \
        if loss_parallel and not in_layers else {"output_layouts": Replicate()}
    row_out: dict[str, Any] = {"output_layouts": Shard(1), "use_local_output": False} if into_layers else {}
    styles: dict[str, Callable[[], object]] = {
        "colwise": ColwiseParallel,
        "rowwise": lambda: RowwiseParallel(**row_out),
        "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate(), **row_out),
        "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
        "colwise_rep": lambda: ColwiseParallel(input_layouts=head_in, **head_out),
        "colwise_gather_output": lambda: ColwiseParallel(input_layouts=head_in, **head_out)}
    if name not in styles:  # (config.models.tensor_parallel_refusal refuses such a model before any work)
        raise ValueError(f"tensor-parallel style '{name}' ({module}) is not one the harness applies "
                         f"({', '.join(styles)})")
    return styles[name]()


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """A transformers causal LM's decoder layers: the outermost modules of the classes it names
    unsplittable (`_no_split_modules`, what accelerate's FSDP wraps: LlamaDecoderLayer, GPT2Block,
    ...), else model.model.layers."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    found: list[torch.nn.Module] = []

    def outermost(module: torch.nn.Module) -> None:
        for child in module.children():
            if type(child).__name__ in names:
                found.append(child)
            else:
                outermost(child)

    outermost(model)
    if found:
        return found
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ValueError(f"{type(model).__name__} has no decoder layers to shard (_no_split_modules, model.layers)")
    return list(layers)
