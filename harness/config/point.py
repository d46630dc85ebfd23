"""The point: one run's whole config, typed and frozen, validated once, handed to every layer.

Hydra composes the config (schema.py: what the YAML may say); `Point.from_config` makes it this
typed value, and each part checks its own values on construction, naming the dotted key of the
first bad one (ConfigError). The choices are StrEnums: they compare, print and serialise as the
strings the YAML and the record use ("bf16" == Precision.bf16).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from omegaconf import OmegaConf, open_dict

from harness.config import alloc_conf
from harness.errors import ConfigError

# A field the point gets where it runs (launch.point.to_point), not from the config: not in the schema.
RUNTIME = {"runtime": True}


class Precision(StrEnum):
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"
    amp_bf16 = "amp_bf16"  # fp32 master weights + autocast
    amp_fp16 = "amp_fp16"

    @property
    def is_amp(self) -> bool:
        return self.startswith("amp_")

    @property
    def compute_dtype(self) -> str:
        """The torch dtype (without "torch.") the layers compute in: amp_*'s autocast dtype."""
        return {"fp32": "float32"}.get(self, "float16" if self.endswith("fp16") else "bfloat16")


class CheckpointingPolicy(StrEnum):
    """What checkpointing=true keeps of each block's forward for backward (torchtitan's names)."""
    full = "full"  # only the block's input: the whole block is recomputed in backward
    # torchtitan's selective per-op policy: every matmul's output but every second one, attention's
    # outputs and tensor parallel's reduce-scatters are kept; the rest (norms, activations) recomputed
    op = "op"


class WorkloadName(StrEnum):
    train = "train"
    infer = "infer"
    custom = "custom"


class Leak(StrEnum):
    none = "none"
    graph = "graph"  # a loss kept with its graph across steps
    cycle = "cycle"  # a reference cycle holding the step's outputs


class OptimizerName(StrEnum):
    adamw = "adamw"
    sgd = "sgd"
    adafactor = "adafactor"


class OptimizerImpl(StrEnum):
    auto = "auto"  # what torch.optim picks on CUDA (foreach)
    foreach = "foreach"
    fused = "fused"
    forloop = "forloop"


class Backend(StrEnum):
    auto = "auto"  # cuda where a GPU is visible, else sim
    sim = "sim"  # the virtual GPU
    cuda = "cuda"  # the real card(s)
    # The job run for real on this machine's CPU tensors (its ranks as processes, gloo between them),
    # tracked and replayed as the virtual GPU's trace is: CPU kernels, so a check, not a card's figure
    cpu = "cpu"


class PlanAxis(StrEnum):
    batch_size = "batch_size"
    seq_len = "seq_len"
    world_size = "world_size"  # the GPUs the job is spread over (the parallel.* degree plan.over): the fewest that fit


def _choice(key: str, enum: type[StrEnum], value: Any) -> Any:
    try:
        return enum(value)
    except ValueError:
        raise ConfigError(key, f"'{value}' is not one of {', '.join(enum)}") from None


def _at_least(key: str, value: float, low: float, why: str = "") -> None:
    if value < low:
        raise ConfigError(key, f"must be >= {low}{why}, got {value}")


@dataclass(frozen=True)
class Model:
    name: str = ""
    arch: str = "llama"  # transformers config class family: llama | qwen2 | mistral | auto
    config_json: str | None = None  # a local HF config.json (or its folder)
    hf: dict[str, Any] = field(default_factory=dict)  # config-class keyword arguments
    # config_json's fingerprint, so that an edited file is traced again, not reused
    config_sha: str | None = field(default=None, metadata=RUNTIME)


# A training step's peak comes once the optimizer state exists: in step 2.
TRAINING_STEPS_WHY = " (training holds the optimizer state from step 2 on: its peak needs a second step)"


@dataclass(frozen=True)
class Workload:
    name: WorkloadName = WorkloadName.train
    steps: int = 3  # train, custom: steps run; rows hold the whole run's peak and the steady state's from step 2 on
    new_tokens: int = 16  # infer: tokens decoded after the prefill; prompt = seq_len - new_tokens
    leak: Leak = Leak.none
    target: str | None = None  # custom: the user's build function, 'module:function'
    args: dict[str, Any] = field(default_factory=dict)  # custom: the user's own keys
    source_sha: str | None = field(default=None, metadata=RUNTIME)  # custom: the user's code's fingerprint

    def __post_init__(self):
        object.__setattr__(self, "name", _choice("workload.name", WorkloadName, self.name))
        object.__setattr__(self, "leak", _choice("workload.leak", Leak, self.leak))
        if self.leak != Leak.none and self.name != WorkloadName.train:
            raise ConfigError("workload.leak", "the leaks reproduce training-loop mistakes: use workload=train")
        if self.name == WorkloadName.train:
            _at_least("workload.steps", self.steps, 2, TRAINING_STEPS_WHY)
        elif self.name == WorkloadName.custom:
            _at_least("workload.steps", self.steps, 1)
        if self.name == WorkloadName.custom and not self.target:
            raise ConfigError("workload.target", "workload=custom needs workload.target=module:function "
                              "(a build function, see harness/workload.py)")

    @property
    def trains(self) -> bool:
        return self.name == WorkloadName.train


@dataclass(frozen=True)
class Optimizer:
    name: OptimizerName = OptimizerName.adamw
    impl: OptimizerImpl = OptimizerImpl.auto
    lr: float = 1e-4

    def __post_init__(self):
        object.__setattr__(self, "name", _choice("optimizer.name", OptimizerName, self.name))
        object.__setattr__(self, "impl", _choice("optimizer.impl", OptimizerImpl, self.impl))
        if self.name == OptimizerName.adafactor and self.impl == OptimizerImpl.fused:
            raise ConfigError("optimizer.impl", "torch.optim.Adafactor has no fused implementation")
        if self.lr <= 0:
            raise ConfigError("optimizer.lr", f"must be > 0, got {self.lr}")


@dataclass(frozen=True)
class Allocator:
    name: str = "default"
    conf: str = ""  # the exact PYTORCH_ALLOC_CONF string

    def __post_init__(self):
        alloc_conf.modelled(self.conf)  # ConfigError naming allocator.conf: what torch or the model refuses


@dataclass(frozen=True)
class Slurm:
    gres: str | None = None
    constraint: str | None = None
    partition: str | None = None


@dataclass(frozen=True)
class Card:
    """A GPU as the point sees it: what torch reports as total memory, and what lives outside PyTorch,
    each with how far it is known (the edge of a card is only as sharp as these)."""
    name: str = ""
    device_name: str = ""
    memory_bytes: int = 0  # torch.cuda.get_device_properties().total_memory
    compute_capability: str = ""  # "major.minor", torch.cuda.get_device_capability(); "" where unknown
    # +- on memory_bytes: reports differ by driver and ECC, and an OOM message's 2-decimal GiB is +-5 MiB
    memory_spread_bytes: int = 0
    non_pytorch_bytes: int = 0  # CUDA context, libraries: outside PyTorch's allocator
    non_pytorch_spread_bytes: int = 0  # +- on non_pytorch_bytes
    source: str = ""
    non_pytorch_source: str = ""
    gpus_per_node: int = 8  # the most a node of these holds (a job over more spans nodes: parallel.nodes)
    # torch.cuda.get_device_properties().multi_processor_count: how some kernels size their scratch
    # (config.kernels); 0 where unknown (sized as the most any card allocates)
    multiprocessors: int = 0
    slurm: Slurm = field(default_factory=Slurm)
    key: str = field(default="", metadata=RUNTIME)  # its name in the catalog (conf/gpu/<key>.yaml), where known

    def __post_init__(self):
        for key in ("memory_spread_bytes", "non_pytorch_bytes", "non_pytorch_spread_bytes"):
            if getattr(self, key) < 0:
                raise ConfigError(f"gpu.{key}", f"must be >= 0, got {getattr(self, key)}")
        _at_least("gpu.gpus_per_node", self.gpus_per_node, 1)
        if self.multiprocessors < 0:
            raise ConfigError("gpu.multiprocessors", f"must be >= 0 (0: unknown), got {self.multiprocessors}")
        cc = str(self.compute_capability)
        if cc and not (cc.count(".") == 1 and all(p.isdigit() for p in cc.split("."))):
            raise ConfigError("gpu.compute_capability", f"'major.minor' such as 8.0, got {cc!r}")
        object.__setattr__(self, "compute_capability", cc)

    @property
    def capability(self) -> tuple[int, int] | None:
        """(major, minor) as torch.cuda.get_device_capability() reports it; None where unknown."""
        if not self.compute_capability:
            return None
        major, minor = self.compute_capability.split(".")
        return int(major), int(minor)

    def with_margin(self, margin: float) -> Card:
        """The card as a plan sees it: `margin` x its memory kept free, counted as outside PyTorch."""
        if not margin:
            return self
        return dataclasses.replace(self, non_pytorch_bytes=self.non_pytorch_bytes + int(margin * self.memory_bytes))

    def room(self, margin: float = 0.0) -> int:
        """Bytes PyTorch's allocator may reserve on the card with `margin` kept free."""
        c = self.with_margin(margin)
        return c.memory_bytes - c.non_pytorch_bytes

    @property
    def uncertainty_bytes(self) -> int:
        """How far room() is known: the capacity's spread and the non-PyTorch memory's."""
        return self.memory_spread_bytes + self.non_pytorch_spread_bytes

    def at_worst(self) -> Card:
        """The card at the low end of what it may be: the least capacity, the most non-PyTorch memory."""
        return dataclasses.replace(self, memory_bytes=self.memory_bytes - self.memory_spread_bytes,
                                   non_pytorch_bytes=self.non_pytorch_bytes + self.non_pytorch_spread_bytes,
                                   memory_spread_bytes=0, non_pytorch_spread_bytes=0)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Card:
        return _build(cls, data, "gpu.")


AUTO_NODES = "auto"  # parallel.nodes: the fewest nodes of the card that hold the job
PARALLEL_KNOBS = ("dp_shard", "dp_replicate", "tp")  # parallel.*'s degrees (a row's columns of the same names)
# The job's mesh dimensions, outermost first (torchtitan's order): replicas, shards, tensor parallel
MESH_DIMS = ("dp_replicate", "dp_shard", "tp")
# parallel.*'s switches that split something over the tensor-parallel ranks (need tp > 1): what
# each splits, and its short name in a layout ("TP+SP+LP")
TP_SWITCHES = {"sequence_parallel": ("the sequence", "SP"), "loss_parallel": ("the head's logits", "LP")}


def needs_a_degree(parallel) -> dict[str, str]:
    """The parallel knobs set away from their defaults that mean something only over more than one
    GPU of a degree: knob -> that degree (tensor parallel's switches: tp; FSDP2's mixed precision
    and its keeping of gathered layers: dp_shard; replicas of a tensor-parallel job, HSDP's only:
    dp_shard). `parallel`: a Parallel or its config node."""
    out = {}
    if parallel.dp_replicate > 1 and parallel.tp > 1:  # DDP does not take DTensor parameters (torchtitan refuses it)
        out["dp_replicate"] = "dp_shard"
    if parallel.param_dtype is not None:
        out["param_dtype"] = "dp_shard"
    if not parallel.reshard_after_forward:
        out["reshard_after_forward"] = "dp_shard"
    return {**out, **{s: "tp" for s in TP_SWITCHES if getattr(parallel, s)}}


# Why each knob of needs_a_degree needs its degree: its refusal where the degree is 1
_NEEDS_WHY = {
    "param_dtype": "is FSDP2's mixed precision: set parallel.dp_shard > 1",
    "reshard_after_forward": "false keeps FSDP2's gathered layers after their forward: set parallel.dp_shard > 1 "
                             "(or leave it true)",
    **{s: f"splits {what} over tensor-parallel ranks: set parallel.tp > 1 (or leave it false)"
       for s, (what, _short) in TP_SWITCHES.items()},
    "dp_replicate": "DDP does not take tensor-parallel (DTensor) parameters: replicate a tensor-parallel job with "
                    "HSDP (parallel.dp_shard > 1)",
}


@dataclass(frozen=True)
class Plan:
    """`python -m harness plan`: per card, the largest `axis` value that fits (searched, not swept)."""
    axis: PlanAxis = PlanAxis.batch_size
    lo: int = 1
    hi: int = 0  # 0: 256 for batch_size, the model's max_position_embeddings for seq_len, 64 GPUs
    step: int = 0  # 0: 1 for batch_size, 128 for seq_len; world_size: powers of two
    margin: float = 0.0  # share of the card's total memory kept free, beyond non-PyTorch memory
    cards: tuple[str, ...] = ()  # catalog keys; empty: every card
    over: str = "dp_shard"  # world_size: the parallel.* degree searched (dp_shard, dp_replicate, tp), the others kept
    block_size: int = 16  # serving: vLLM's KV block, tokens
    max_num_batched_tokens: int = 8192  # serving: vLLM's profile-run tokens

    def __post_init__(self):
        object.__setattr__(self, "axis", _choice("plan.axis", PlanAxis, self.axis))
        object.__setattr__(self, "cards", tuple(self.cards))
        _at_least("plan.lo", self.lo, 1)
        if self.hi and self.hi < self.lo:
            raise ConfigError("plan.hi", f"must be >= plan.lo ({self.lo}), got {self.hi}")
        if self.step < 0:
            raise ConfigError("plan.step", f"must be >= 0 (0: the axis's default), got {self.step}")
        if self.over not in PARALLEL_KNOBS:
            raise ConfigError("plan.over", f"one of {', '.join(PARALLEL_KNOBS)} (the parallel.* degree searched), "
                              f"got {self.over!r}")
        if self.axis == PlanAxis.world_size and self.step:
            raise ConfigError("plan.step", f"plan.axis=world_size searches powers of two: leave it 0, got {self.step}")
        if not 0 <= self.margin < 1:
            raise ConfigError("plan.margin", f"must be in [0, 1) (a share of the card's memory), got {self.margin}")
        _at_least("plan.block_size", self.block_size, 1)
        _at_least("plan.max_num_batched_tokens", self.max_num_batched_tokens, 2)


@dataclass(frozen=True)
class Parallel:
    """How the job is spread over GPUs (probe.parallelize); a point's figures are one GPU's (rank 0's)."""
    dp_shard: int = 1  # FSDP2 (fully_shard per decoder layer and the root): ranks each parameter is sharded over
    dp_replicate: int = 1  # data-parallel replicas: DDP, or HSDP with dp_shard (replicas of a sharded model)
    tp: int = 1  # tensor parallel (DTensor parallelize_module, the model's own plan)
    reshard_after_forward: bool = True  # FSDP2: free the gathered layer after its forward (ZeRO-3), else keep it (ZeRO-2)
    # tensor parallel with sequence parallel (torchtitan's Llama plan): the norms and the residual
    # stream between layers split over the sequence, all-gathered into attention and the MLP and
    # reduce-scattered out of them
    sequence_parallel: bool = False
    # tensor parallel's loss parallel (torchtitan's): the head's logits stay split over the vocabulary
    # on each rank and the cross-entropy is computed on the slices (torch's loss_parallel), instead
    # of each rank gathering the whole logits
    loss_parallel: bool = False
    # FSDP2's MixedPrecisionPolicy, as torchtitan trains: fp32 shards kept (precision=fp32), each layer
    # all-gathered and computed in this dtype, gradients reduce-scattered in fp32; None: no policy
    param_dtype: str | None = None
    # the nodes the job's GPUs are on, as many on each (at most gpu.gpus_per_node); "auto": the
    # fewest that hold them (the point resolves it on its card: a sweep over counts or cards)
    nodes: int | str = 1
    # NCCL's own memory on each GPU per communicator the job uses; None: estimated (config/nccl.py)
    nccl_bytes_per_communicator: int | None = None

    def __post_init__(self):
        for key in PARALLEL_KNOBS:
            _at_least(f"parallel.{key}", getattr(self, key), 1)
        if self.nodes != AUTO_NODES:  # (auto: the point's card says how many)
            if not isinstance(self.nodes, int):
                raise ConfigError("parallel.nodes", f"must be a count of nodes or {AUTO_NODES}, got {self.nodes!r}")
            _at_least("parallel.nodes", self.nodes, 1)
            if self.world_size % self.nodes:
                raise ConfigError("parallel.nodes", f"{self.nodes} nodes cannot hold the job's {self.world_size} "
                                  "GPU(s) as many on each")
        if self.nccl_bytes_per_communicator is not None and self.nccl_bytes_per_communicator < 0:
            raise ConfigError("parallel.nccl_bytes_per_communicator",
                              f"must be >= 0 (bytes), got {self.nccl_bytes_per_communicator}")
        if self.param_dtype is not None and self.param_dtype not in ("bf16", "fp16"):
            raise ConfigError("parallel.param_dtype", f"'{self.param_dtype}' is not one of bf16, fp16 (or null)")
        for knob, degree in needs_a_degree(self).items():
            if getattr(self, degree) == 1:
                raise ConfigError(f"parallel.{knob}", _NEEDS_WHY[knob])

    @property
    def world_size(self) -> int:
        return self.dp_shard * self.dp_replicate * self.tp

    @property
    def mesh_shape(self) -> tuple[tuple[str, ...], tuple[int, ...]]:
        """The names and sizes of the job's device mesh: its dimensions of more than one GPU (one
        process group each)."""
        dims = [(name, getattr(self, name)) for name in MESH_DIMS if getattr(self, name) > 1]
        return tuple(n for n, _ in dims), tuple(s for _, s in dims)

    @property
    def key(self) -> str:
        """The knob that spreads the job (the first of more than one GPU), for errors that name one."""
        return next((f"parallel.{k}" for k in PARALLEL_KNOBS if getattr(self, k) > 1), "parallel.dp_shard")

    @property
    def dtensors(self) -> bool:
        """Whether the parameters are DTensors (FSDP2's shards, tensor parallel's slices); DDP's are not."""
        return self.dp_shard > 1 or self.tp > 1


def _dtensor_has_fused(optimizer: str) -> bool:
    """Whether DTensor runs torch.optim's fused kernel for `optimizer` (a sharding rule registered for
    it: torch 2.13 has Adam's and AdamW's, not SGD's). Asked only of a fused optimizer over DTensors."""
    import torch
    from torch.distributed.tensor import DTensor

    op = getattr(torch.ops.aten, f"_fused_{optimizer}_", None)
    rules = DTensor._op_dispatcher.sharding_propagator
    return op is not None and any(getattr(op, overload) in table for overload in op.overloads()
                                  for table in (rules.op_strategy_funcs, rules.op_single_dim_strategy_funcs))


def fewest_nodes(gpus: int, gpus_per_node: int) -> int:
    """The fewest nodes that hold `gpus` as many on each, no more than `gpus_per_node` a node."""
    nodes = -(-gpus // gpus_per_node)
    while gpus % nodes:
        nodes += 1
    return nodes


@dataclass(frozen=True)
class Point:
    """One run: the knobs, the card it is judged against, and where it was asked from."""
    model: Model = field(default_factory=Model)
    workload: Workload = field(default_factory=Workload)
    optimizer: Optimizer = field(default_factory=Optimizer)
    allocator: Allocator = field(default_factory=Allocator)
    gpu: Card = field(default_factory=Card)
    batch_size: int = 1  # sequences per step (train) or concurrent sequences (infer)
    seq_len: int = 1024  # tokens per sequence (infer: the whole context)
    precision: Precision = Precision.bf16
    checkpointing: bool = False
    checkpointing_policy: CheckpointingPolicy = CheckpointingPolicy.full
    parallel: Parallel = field(default_factory=Parallel)
    backend: Backend = Backend.auto
    results_dir: str = "results"
    sweep: str = "adhoc"
    timeout_s: int = 1800
    snapshot: bool = False
    plan: Plan = field(default_factory=Plan)
    # Where the point was asked from (set by launch.point.to_point): not part of its identity.
    overrides: str = field(default="", metadata=RUNTIME)  # the command line's overrides for this point
    cwd: str = field(default="", metadata=RUNTIME)  # where the user ran us: their workload module is found here
    trace_cache: str | None = field(default=None, metadata=RUNTIME)  # one trace serves every allocator setting and card
    job_id: str | None = field(default=None, metadata=RUNTIME)  # the cluster's id for this point's job

    def __post_init__(self):
        _at_least("batch_size", self.batch_size, 1)
        _at_least("seq_len", self.seq_len, 1)
        object.__setattr__(self, "precision", _choice("precision", Precision, self.precision))
        object.__setattr__(self, "backend", _choice("backend", Backend, self.backend))
        object.__setattr__(self, "checkpointing_policy",
                           _choice("checkpointing_policy", CheckpointingPolicy, self.checkpointing_policy))
        if self.checkpointing_policy != CheckpointingPolicy.full and not self.checkpointing:
            raise ConfigError("checkpointing_policy", f"{self.checkpointing_policy} chooses what checkpointing keeps: "
                              "set checkpointing=true (or leave the policy full)")
        if self.workload.name == WorkloadName.infer and self.checkpointing:
            raise ConfigError("checkpointing", "recomputes activations for the backward pass, and workload=infer has "
                              "none: its rows would be the ones without (set checkpointing=false; over a grid that "
                              "sweeps it, on the command line)")
        if self.workload.name == WorkloadName.infer and not 1 <= self.workload.new_tokens < self.seq_len:
            raise ConfigError("workload.new_tokens", f"must be in [1, seq_len) = [1, {self.seq_len}), "
                              f"got {self.workload.new_tokens}")
        if self.timeout_s <= 0:
            raise ConfigError("timeout_s", f"must be > 0, got {self.timeout_s}")
        if self.gpu.memory_bytes <= 0:
            raise ConfigError("gpu.memory_bytes", f"must be > 0, got {self.gpu.memory_bytes}")
        need = fewest_nodes(self.parallel.world_size, self.gpu.gpus_per_node)
        if self.parallel.nodes == AUTO_NODES:
            object.__setattr__(self, "parallel", dataclasses.replace(self.parallel, nodes=need))
        per_node = self.parallel.world_size // self.parallel.nodes
        if per_node > self.gpu.gpus_per_node:
            raise ConfigError("parallel.nodes", f"the job's {self.parallel.world_size} GPUs on {self.parallel.nodes} "
                              f"node(s) are {per_node} a node, and the {self.gpu.name}'s nodes hold "
                              f"{self.gpu.gpus_per_node} (gpu.gpus_per_node): set parallel.nodes={need} "
                              f"(or parallel.nodes={AUTO_NODES}: the fewest for each point's card and GPUs)")
        if self.parallel.param_dtype is not None and self.precision != Precision.fp32:
            raise ConfigError("parallel.param_dtype", f"casts fp32 master weights for compute: precision=fp32, not "
                              f"{self.precision} (FSDP2 keeps the shards in fp32, gathers them in "
                              f"{self.parallel.param_dtype})")
        if self.backend == Backend.cpu and self.precision.is_amp:
            raise ConfigError("precision", f"backend=cpu runs the CPU's kernels and {self.precision} is CUDA's "
                              "autocast: run it on the virtual GPU (backend=sim) or the card (backend=cuda)")
        if self.parallel.world_size > 1:
            key = self.parallel.key
            if self.workload.name == WorkloadName.infer:
                if self.parallel.dp_shard > 1 or self.parallel.dp_replicate > 1:
                    raise ConfigError(key, "serving is spread by tensor parallel (parallel.tp); each replica of a served "
                                      "model is a job of its own, its memory the point's without the replicas")
                for knob in ("sequence_parallel", "loss_parallel"):
                    if getattr(self.parallel, knob):
                        raise ConfigError(f"parallel.{knob}", "is torchtitan's for training: workload=infer has no "
                                          "loss, and its decode steps are one token each")
            if self.parallel.loss_parallel and self.workload.name == WorkloadName.custom:
                raise ConfigError("parallel.loss_parallel", "splits the presets' head and loss: a job of your own "
                                  "applies its own plan (torch.distributed.tensor.parallel.loss_parallel)")
            if self.parallel.sequence_parallel and self.seq_len % self.parallel.tp:
                raise ConfigError("seq_len", f"sequence parallel splits the sequence over parallel.tp="
                                  f"{self.parallel.tp} ranks: {self.seq_len} is not a multiple of {self.parallel.tp}")
            if self.optimizer.name == OptimizerName.adafactor and self.parallel.dtensors:  # as torch 2.13's DTensor does
                raise ConfigError("optimizer.name", "torch.optim.Adafactor does not run on DTensor parameters (FSDP2, TP) "
                                  "(DTensor refuses its in-place pow_ on a partial norm): use adamw or sgd")
            if (self.optimizer.impl == OptimizerImpl.fused and self.parallel.dtensors
                    and not _dtensor_has_fused(self.optimizer.name)):
                raise ConfigError("optimizer.impl", f"torch's fused {self.optimizer.name} has no DTensor rule in this "
                                  "torch, so it does not run on FSDP2's or TP's parameters: use foreach or forloop")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Point:
        """A point from plain data (a composed config's container, point.json); missing keys take the
        schema's defaults, unknown ones are refused by name."""
        return _build(cls, data, "")

    @classmethod
    def from_config(cls, cfg) -> Point:
        """A point from a composed config (its `hydra` node, if any, is not the point's)."""
        if "hydra" in cfg:  # a sweep's config before its job ran: Hydra's runtime keys are not set yet
            cfg = cfg.copy()
            with open_dict(cfg):
                del cfg["hydra"]
        data = OmegaConf.to_container(cfg, resolve=True)
        assert isinstance(data, dict)
        return cls.from_dict({str(k): v for k, v in data.items()})

    def to_dict(self) -> dict[str, Any]:
        """Plain data (enums as their strings): point.json, and the identity that run_id hashes."""
        return dataclasses.asdict(self)

    def replace(self, **changes) -> Point:
        return dataclasses.replace(self, **changes)


def _build(cls, data: dict[str, Any], prefix: str):
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"{prefix}{unknown[0]}", "unknown key")
    kwargs = {}
    for name, value in data.items():
        hint = hints[name]
        nested = _dataclass_of(hint)
        if nested is not None and isinstance(value, dict):
            value = _build(nested, value, f"{prefix}{name}.")
        kwargs[name] = value
    return cls(**kwargs)


def _dataclass_of(hint) -> type | None:
    """The dataclass a field holds (Card, or Card in `Card | None`), else None."""
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    return next((a for a in options if isinstance(a, type) and dataclasses.is_dataclass(a)), None)
