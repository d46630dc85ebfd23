"""The config schema. Hydra merges conf/ into it, so unknown keys and wrong types fail at compose."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore

PRECISIONS = ("fp32", "bf16", "fp16", "amp_bf16", "amp_fp16")
OPTIMIZERS = ("adamw", "sgd", "adafactor")
OPTIMIZER_IMPLS = ("auto", "foreach", "fused", "forloop")
BACKENDS = ("auto", "sim", "cuda")
WORKLOADS = ("train", "infer", "custom")
LEAKS = ("none", "graph", "cycle")


@dataclass
class ModelConf:
    name: str = ""
    arch: str = "llama"  # transformers config class family: llama | qwen2 | mistral | auto
    config_json: str | None = None  # a local HF config.json (or its folder)
    hf: dict[str, Any] = field(default_factory=dict)  # config-class keyword arguments


@dataclass
class WorkloadConf:
    name: str = "train"
    steps: int = 3  # train: steps run; the peak is read from step 2 on (step 1 creates optimizer state)
    new_tokens: int = 16  # infer: tokens decoded after the prefill; prompt = seq_len - new_tokens
    leak: str = "none"  # train: none | graph (a loss kept with its graph) | cycle (a reference cycle)
    target: str | None = None  # custom: the user's build function, 'module:function' (harness.workload)
    args: dict[str, Any] = field(default_factory=dict)  # custom: the user's own keys, passed to build


@dataclass
class OptimizerConf:
    name: str = "adamw"
    impl: str = "auto"  # auto = what torch.optim picks on CUDA (foreach)
    lr: float = 1e-4


@dataclass
class AllocatorConf:
    name: str = "default"
    conf: str = ""  # the exact PYTORCH_ALLOC_CONF string


@dataclass
class SlurmConf:
    gres: str | None = None
    constraint: str | None = None
    partition: str | None = None


@dataclass
class GpuConf:
    name: str = ""
    device_name: str = ""
    memory_bytes: int = 0  # torch.cuda.get_device_properties().total_memory
    non_pytorch_bytes: int = 0  # CUDA context etc., outside PyTorch's allocator
    source: str = ""
    slurm: SlurmConf = field(default_factory=SlurmConf)


PLAN_AXES = ("batch_size", "seq_len")


@dataclass
class PlanConf:
    """`python -m harness plan`: per card, the largest `axis` value that fits (searched, not swept)."""
    axis: str = "batch_size"  # batch_size | seq_len
    lo: int = 1  # the smallest value tried
    hi: int = 0  # the largest; 0: 256 for batch_size, the model's max_position_embeddings for seq_len
    step: int = 0  # granularity; 0: 1 for batch_size, 128 for seq_len
    margin: float = 0.0  # share of the card's total memory kept free, beyond non-PyTorch memory
    cards: list[str] = field(default_factory=list)  # catalog keys (conf/gpu); empty: every card
    block_size: int = 16  # serving (workload=infer): vLLM's KV block, tokens
    max_num_batched_tokens: int = 8192  # serving: vLLM's profile-run tokens


@dataclass
class HarnessConf:
    model: ModelConf = field(default_factory=ModelConf)
    workload: WorkloadConf = field(default_factory=WorkloadConf)
    optimizer: OptimizerConf = field(default_factory=OptimizerConf)
    allocator: AllocatorConf = field(default_factory=AllocatorConf)
    gpu: GpuConf = field(default_factory=GpuConf)
    batch_size: int = 1  # sequences per step (train) or concurrent sequences (infer)
    seq_len: int = 1024  # tokens per sequence (infer: the context, prompt + decoded)
    precision: str = "bf16"
    checkpointing: bool = False  # activation checkpointing per decoder layer
    backend: str = "auto"
    results_dir: str = "results"
    sweep: str = "adhoc"  # the sweep's name: results go to results_dir/<sweep>/<stamp>/
    timeout_s: int = 1800  # per point; past it the row is `timeout`
    snapshot: bool = False  # write a memory_viz snapshot next to each result.json
    plan: PlanConf = field(default_factory=PlanConf)


def register() -> None:
    """The schema behind conf/config.yaml (the Slurm launcher's registers with Hydra's plugins)."""
    ConfigStore.instance().store(name="base_config", node=HarnessConf)
