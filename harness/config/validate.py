"""Semantic checks on a composed config, before any work. Each failure names its dotted key."""

from __future__ import annotations

from harness.config import alloc_conf, schema
from harness.config.target import load_target
from harness.errors import ConfigError


def _one_of(key: str, value, choices) -> None:
    if value not in choices:
        raise ConfigError(key, f"'{value}' is not one of {', '.join(choices)}")


def validate(cfg) -> None:
    """Raise ConfigError for the first bad value in `cfg` (a composed HarnessConf)."""
    if cfg.batch_size < 1:
        raise ConfigError("batch_size", f"must be >= 1, got {cfg.batch_size}")
    if cfg.seq_len < 1:
        raise ConfigError("seq_len", f"must be >= 1, got {cfg.seq_len}")
    _one_of("precision", cfg.precision, schema.PRECISIONS)
    _one_of("backend", cfg.backend, schema.BACKENDS)
    _one_of("workload.name", cfg.workload.name, schema.WORKLOADS)
    _one_of("workload.leak", cfg.workload.leak, schema.LEAKS)
    if cfg.workload.leak != "none" and cfg.workload.name != "train":
        raise ConfigError("workload.leak", "the leaks reproduce training-loop mistakes: use workload=train")
    _one_of("optimizer.name", cfg.optimizer.name, schema.OPTIMIZERS)
    _one_of("optimizer.impl", cfg.optimizer.impl, schema.OPTIMIZER_IMPLS)
    if cfg.optimizer.name == "adafactor" and cfg.optimizer.impl == "fused":
        raise ConfigError("optimizer.impl", "torch.optim.Adafactor has no fused implementation")
    if cfg.optimizer.lr <= 0:
        raise ConfigError("optimizer.lr", f"must be > 0, got {cfg.optimizer.lr}")
    if cfg.workload.name in ("train", "custom") and cfg.workload.steps < 2:
        raise ConfigError("workload.steps", f"must be >= 2 (the peak is read from step 2 on), got {cfg.workload.steps}")
    if cfg.workload.name == "infer" and not 1 <= cfg.workload.new_tokens < cfg.seq_len:
        raise ConfigError("workload.new_tokens",
                          f"must be in [1, seq_len) = [1, {cfg.seq_len}), got {cfg.workload.new_tokens}")
    if cfg.gpu.memory_bytes <= 0:
        raise ConfigError("gpu.memory_bytes", f"must be > 0, got {cfg.gpu.memory_bytes}")
    if cfg.timeout_s <= 0:
        raise ConfigError("timeout_s", f"must be > 0, got {cfg.timeout_s}")
    alloc_conf.parse(cfg.allocator.conf)
    if cfg.workload.name == "custom":  # the user's build function is the model
        _check_target(cfg.workload)
    else:
        _check_model(cfg)
    _check_plan(cfg.plan)


def _check_target(workload) -> None:
    if not workload.target:
        raise ConfigError("workload.target", "workload=custom needs workload.target=module:function "
                          "(a build function, see harness/workload.py)")
    load_target(workload.target)


def _check_plan(plan) -> None:
    _one_of("plan.axis", plan.axis, schema.PLAN_AXES)
    if plan.lo < 1:
        raise ConfigError("plan.lo", f"must be >= 1, got {plan.lo}")
    if plan.hi and plan.hi < plan.lo:
        raise ConfigError("plan.hi", f"must be >= plan.lo ({plan.lo}), got {plan.hi}")
    if plan.step < 0:
        raise ConfigError("plan.step", f"must be >= 0 (0: the axis's default), got {plan.step}")
    if not 0 <= plan.margin < 1:
        raise ConfigError("plan.margin", f"must be in [0, 1) (a share of the card's memory), got {plan.margin}")
    if plan.block_size < 1:
        raise ConfigError("plan.block_size", f"must be >= 1, got {plan.block_size}")
    if plan.max_num_batched_tokens < 2:
        raise ConfigError("plan.max_num_batched_tokens", f"must be >= 2, got {plan.max_num_batched_tokens}")
    if plan.cards:
        from harness.config import cards as catalog
        known = [c["key"] for c in catalog.cards()]
        for key in plan.cards:
            _one_of("plan.cards", key, known)


def _check_model(cfg) -> None:
    limit = cfg.model.hf.get("max_position_embeddings") if not cfg.model.config_json else None
    if limit is None:
        from harness.config.models import hf_config, max_positions

        limit = max_positions(hf_config(cfg.model))
    if limit is not None and cfg.seq_len > limit:
        raise ConfigError("seq_len", f"{cfg.seq_len} exceeds model {cfg.model.name}'s "
                          f"max_position_embeddings ({limit})")
