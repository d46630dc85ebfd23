"""Model architectures from transformers' config classes: presets or a local config.json, no weights."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import threading
from pathlib import Path
from types import SimpleNamespace

from harness.errors import ConfigError

_ARCH_TO_MODEL_TYPE = {"llama": "llama", "qwen2": "qwen2", "mistral": "mistral"}
PRESET_ARCHS = frozenset(_ARCH_TO_MODEL_TYPE)  # model.arch's choices: causal LMs all
# transformers' modules load lazily, and two threads loading at once can see one half-initialised
# ("cannot import name 'AutoConfig'"): a plan's probe threads validate side by side
_LOADING = threading.RLock()


def _unlocked_in_child() -> None:  # a fork while a thread held it would leave the child waiting forever
    global _LOADING
    _LOADING = threading.RLock()


os.register_at_fork(after_in_child=_unlocked_in_child)


def _config_file(path: str) -> Path:
    p = Path(path).expanduser()
    return p / "config.json" if p.is_dir() else p


def config_json_sha(path: str) -> str:
    """A hash of the config.json's bytes (ConfigError naming model.config_json where it is unreadable)."""
    _read_config_json(path)
    return hashlib.sha1(_config_file(path).read_bytes()).hexdigest()[:12]


def _read_config_json(path: str) -> dict:
    p = _config_file(path)
    if not p.is_file():
        raise ConfigError("model.config_json", f"no such file: {p}")
    try:
        data = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError("model.config_json", f"{p} is not valid JSON ({e.msg} at line {e.lineno})")
    if not isinstance(data, dict) or "model_type" not in data:
        raise ConfigError("model.config_json", f"{p} has no 'model_type'")
    return data


def hf_config(model_cfg):
    """A transformers PretrainedConfig for the `model` config group."""
    with _LOADING:
        return _hf_config(_as_config(model_cfg))


def _hf_config(model_cfg):
    from transformers import AutoConfig

    if model_cfg.config_json:
        data = _read_config_json(model_cfg.config_json)
        model_type = data.pop("model_type")
        data.update(dict(model_cfg.hf or {}))
    else:
        model_type = _ARCH_TO_MODEL_TYPE.get(model_cfg.arch)
        if model_type is None:
            raise ConfigError("model.arch", f"unknown architecture '{model_cfg.arch}' "
                              f"(choices: {', '.join(_ARCH_TO_MODEL_TYPE)})")
        data = dict(model_cfg.hf)
    # YAML 1.1 reads 1e-05 as a string; the config classes want numbers.
    for k in ("rms_norm_eps", "rope_theta", "layer_norm_eps"):
        if isinstance(data.get(k), str):
            data[k] = float(data[k])
    try:
        config = AutoConfig.for_model(model_type, **data)
    except ValueError as e:
        raise ConfigError("model", f"transformers cannot build model_type '{model_type}': {e}")
    config._attn_implementation = default_attention(config)
    return config


def _as_config(model_cfg):
    """The `model` group with attribute access (a plain dict made a DictConfig)."""
    from omegaconf import OmegaConf

    return OmegaConf.create(model_cfg) if isinstance(model_cfg, dict) else model_cfg


# The keys a preset's YAML gives that answer shape_config's readers; its architectures' config
# classes derive head_dim alone from them (hidden_size // num_attention_heads, as attention_shape)
_SHAPE_KEYS = ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "hidden_size",
               "max_position_embeddings")


def shape_config(model_cfg):
    """What the launcher reads of transformers' config (layers, heads, head_dim, positions): a
    preset's own keys where it gives them all (hf_config imports transformers, 2-3 s of a parent
    process, which runs no model itself), else hf_config."""
    return preset_shape(model_cfg) or hf_config(model_cfg)


def preset_shape(model_cfg) -> SimpleNamespace | None:
    """A preset's keys (model.hf) where they hold every one of _SHAPE_KEYS, else None."""
    model_cfg = _as_config(model_cfg)
    hf = dict(model_cfg.hf or {}) if not model_cfg.config_json and model_cfg.arch in PRESET_ARCHS else {}
    return SimpleNamespace(**hf) if all(hf.get(k) is not None for k in _SHAPE_KEYS) else None


def _causal_lm_class(config):
    """transformers' causal language model class for `config` (AutoModelForCausalLM's), or None."""
    with _LOADING:
        from transformers import AutoModelForCausalLM

        mapping = AutoModelForCausalLM._model_mapping
        return mapping[type(config)] if type(config) in mapping else None


def has_causal_lm(config) -> bool:
    return _causal_lm_class(config) is not None


def model_key(model) -> str:
    """The `model` config group (a Point's ModelCfg) as a key: what is found once per model keys on
    it (a config.json by its path, as the process reads it once)."""
    return json.dumps(dataclasses.asdict(model), sort_keys=True, default=str)


def on_meta(config):
    """transformers' causal LM of `config`, built on the meta device: its modules and tensors' shapes,
    no memory (0.03 s for 7B once imported, 0.07 s for 70B, 0.09 s for DeepSeek-V3's 61 layers of 256
    experts). The last one built is kept and handed to the next asker of the same config (read it,
    do not change it): a zygote's warm-up builds the model its forked points ask about again."""
    import torch

    try:
        key = config.to_json_string(use_diff=False)
    except (TypeError, ValueError):  # a value JSON cannot hold: built each time
        key = None
    with _LOADING:  # (from_config loads the architecture's module)
        if key is not None and _ON_META[0] == key:
            return _ON_META[1]
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        _ON_META[:] = [key, model]
        return model


_ON_META: list = [None, None]  # the last config on_meta built (its JSON) and the model


# transformers' tensor-parallel plan words the harness applies (probe.parallelize._style); a module
# of TP_REPLICATED is left to the harness's replication of every module the plan does not split
TP_REPLICATED = "replicated_with_grad_allreduce"
TP_STYLES = ("colwise", "rowwise", "rowwise_split_input", "embedding_rowwise", "colwise_rep", "colwise_gather_output",
             TP_REPLICATED)
_EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts")


def sequence_parallel_refusal(config) -> str | None:
    """Why the harness cannot split `config`'s model's residual stream over the sequence (None: it
    can). Its plan is torchtitan's for Llama (probe.parallelize.sequence_parallel_plan): layers of
    two norms around attention and the MLP, as the presets' architectures have them; others
    (Phi's parallel attention and MLP, Gemma's norms after each) differ."""
    if config.model_type in _ARCH_TO_MODEL_TYPE.values():
        return None
    return (f"sequence parallel follows torchtitan's Llama plan ({', '.join(_ARCH_TO_MODEL_TYPE.values())} "
            f"layers), and model_type '{config.model_type}' lays its layers out otherwise")


def tensor_parallel_refusal(config) -> str | None:
    """Why the harness cannot spread `config`'s model over tensor parallel (None: it can): no plan
    in transformers (its config's base_model_tp_plan and its class's _tp_plan), a plan word it does
    not apply, or mixture-of-experts layers (their routing mixes DTensors and plain tensors)."""
    cls = _causal_lm_class(config)
    plan = {**(getattr(config, "base_model_tp_plan", None) or {}), **(getattr(cls, "_tp_plan", None) or {})}
    if not plan:
        return f"transformers has no tensor-parallel plan for model_type '{config.model_type}'"
    unknown = sorted(set(plan.values()) - set(TP_STYLES))
    if unknown:
        return f"its tensor-parallel plan uses {', '.join(unknown)}, which the harness does not apply"
    if any(getattr(config, a, None) for a in _EXPERTS):
        return "its mixture-of-experts layers are not spread by the harness's tensor parallel"
    return None


def default_attention(config) -> str:
    """The attention transformers takes for `config`'s causal LM when none is asked for."""
    return attention_of(_causal_lm_class(config))


def attention_of(model_class) -> str:
    """The attention transformers takes for `model_class` when none is asked for
    (get_correct_attn_implementation): SDPA where the class supports it (or is unknown), else its
    eager attention (Gemma 2's soft-capped scores), which materializes the B x H x S x S scores on
    every card."""
    return "sdpa" if model_class is None or getattr(model_class, "_supports_sdpa", True) else "eager"


def attention_shape(config) -> tuple[int, int, int]:
    """(heads, key/value heads, head dim) of a transformers config (grouped-query attention included)."""
    heads = config.num_attention_heads
    return (heads, getattr(config, "num_key_value_heads", None) or heads,
            getattr(config, "head_dim", None) or config.hidden_size // heads)


def max_positions(config) -> int | None:
    return getattr(config, "max_position_embeddings", None)
