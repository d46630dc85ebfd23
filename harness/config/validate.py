"""Checks on a composed config before any work: the point's own (config/point.py, on construction)
and those that need the model's or the user's code. Each failure names its dotted key."""

from __future__ import annotations

from harness.config import cards as catalog
from harness.config.models import (
    has_causal_lm,
    hf_config,
    max_positions,
    model_key,
    on_meta,
    preset_shape,
    sequence_parallel_refusal,
    tensor_parallel_refusal,
)
from harness.config.point import Point, WorkloadName
from harness.config.target import load_target
from harness.errors import ConfigError


def validate(cfg) -> Point:
    """The point of `cfg` (a composed HarnessConf); ConfigError for the first bad value."""
    point = Point.from_config(cfg)
    if point.workload.name == WorkloadName.custom:  # the user's build function is the model
        load_target(point.workload.target)
    else:
        _check_model(point)
    _check_plan_cards(point)
    _check_results_dir(point.results_dir)
    return point


def _check_results_dir(results_dir: str) -> None:
    """Rows go under results_dir: a file there (or above it) would fail every point after it ran."""
    from pathlib import Path

    path = Path(results_dir).expanduser()
    for p in (path, *path.parents):
        if p.exists():
            if not p.is_dir():
                raise ConfigError("results_dir", f"'{p}' is a file; results_dir must be a directory")
            return


def _check_plan_cards(point: Point) -> None:
    if not point.plan.cards:
        return

    known = [c.key for c in catalog.cards()]
    for key in point.plan.cards:
        if key not in known:
            raise ConfigError("plan.cards", f"'{key}' is not one of {', '.join(known)}")


def _check_model(point: Point) -> None:
    model = point.model
    # A preset's own keys answer without transformers' config (importing it: 3 s, most of a re-run's
    # time): its architecture a causal LM whose tensor-parallel plan the harness applies, sequence
    # parallel's too (tests/test_models.py holds each preset to it), its heads and positions given
    shape = preset_shape(model)
    if shape is None:
        config = hf_config(model)
        if not has_causal_lm(config):  # (an encoder-decoder's, a classifier's: no AutoModelForCausalLM class)
            raise ConfigError("model.config_json" if model.config_json else "model.arch",
                              f"transformers has no causal language model for model_type '{config.model_type}' "
                              "(AutoModelForCausalLM): the presets train and serve causal LMs; run another model "
                              "as a job of your own (workload=custom)")
        text = config.get_text_config()
        if text is not config:  # (a vision-language model's: Gemma 3 4B+, Llama 4, Mllama)
            raise ConfigError("model.config_json", f"model_type '{config.model_type}' is a multimodal model, its "
                              f"language model in text_config (model_type '{text.model_type}'): the presets feed it "
                              "tokens alone, never its other inputs; save text_config as a config.json of its own "
                              "for the language model, or run the whole model as a job of your own (workload=custom)")
        quantized = getattr(config, "quantization_config", None)
        if quantized:  # (gpt-oss's MXFP4 experts, AWQ, GPTQ, FP8 checkpoints: their weights' bytes and kernels)
            method = quantized.get("quant_method") if isinstance(quantized, dict) else None  # (for_model keeps the dict)
            raise ConfigError("model.config_json" if model.config_json else "model.hf",
                              f"{model.config_json or model.name} holds a quantization_config "
                              f"({method or 'quantized weights'}): the harness builds the "
                              f"weights in precision={point.precision.value}, not quantized, and models no "
                              "dequantizing kernel; its peaks would be the unquantized model's. Delete "
                              "quantization_config from a copy to plan the unquantized model")
        if model.config_json:
            _check_builds(model, config)
        _check_tensor_parallel(point, config)
        shape = config
    else:
        _check_heads(point, shape)
    limit = max_positions(shape)
    if limit is not None and point.seq_len > limit:
        raise ConfigError("seq_len", f"{point.seq_len} exceeds model {model.name}'s "
                          f"max_position_embeddings ({limit})")


_BUILT: dict[str, str | None] = {}  # a model's config -> why transformers cannot build it (None: it can)


def _check_builds(model, config) -> None:
    """transformers builds the model of a user's config.json (models.on_meta), else the file is
    refused naming what transformers said: a pad token outside the vocabulary was an error row in
    each point, an AssertionError from nn.Embedding."""
    key = model_key(model)
    if key not in _BUILT:
        try:
            on_meta(config)
            _BUILT[key] = None
        except Exception as e:  # whatever the architecture's code raises
            _BUILT[key] = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
    if _BUILT[key] is not None:
        raise ConfigError("model.config_json", f"{model.config_json}: transformers cannot build model_type "
                          f"'{config.model_type}' from it ({_BUILT[key]})")


def _check_tensor_parallel(point: Point, config) -> None:
    """Tensor parallel needs a plan the harness applies (config.models.tensor_parallel_refusal; with
    sequence parallel, Llama's layers) and splits each attention layer's heads among its ranks: they
    must divide (the query heads and the key/value heads alike), as transformers' own requires."""
    tp = point.parallel.tp
    if tp == 1:
        return
    refusal = tensor_parallel_refusal(config)
    if refusal is not None:
        raise ConfigError("parallel.tp", f"model {point.model.name}: {refusal} (shard it with parallel.dp_shard)")
    refusal = sequence_parallel_refusal(config) if point.parallel.sequence_parallel else None
    if refusal is not None:
        raise ConfigError("parallel.sequence_parallel", f"model {point.model.name}: {refusal}")
    _check_heads(point, config)


def _check_heads(point: Point, config) -> None:
    """Tensor parallel's ranks split each attention layer's query and key/value heads: they divide."""
    tp = point.parallel.tp
    for key in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, key, None)
        if heads is not None and heads % tp:
            raise ConfigError("parallel.tp", f"{tp} does not divide model {point.model.name}'s {key} ({heads})")
