"""Architectures built from transformers' config classes, without weights."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from harness.config.models import hf_config
from tests.conftest import model_cfg


def _n_params(name):
    from transformers import AutoModelForCausalLM

    with FakeTensorMode():
        model = AutoModelForCausalLM.from_config(hf_config(model_cfg(name)), dtype=torch.bfloat16)
        return sum(p.numel() for p in model.parameters())


def test_7b_preset_is_llama2_7b_to_the_parameter():
    assert _n_params("7b") == 6_738_415_616


@pytest.mark.parametrize("name,expected", [
    ("13b", 13_015_864_320), ("70b", 68_976_648_192), ("llama3-8b", 8_030_261_248),
    ("qwen2.5-7b", 7_615_616_512), ("mistral-7b", 7_241_732_096),
])
def test_presets_match_published_parameter_counts(name, expected):
    assert _n_params(name) == expected


def test_70b_uses_grouped_query_attention():
    cfg = hf_config(model_cfg("70b"))
    assert cfg.num_key_value_heads == 8 and cfg.num_attention_heads == 64


def test_a_model_without_sdpa_attends_as_transformers_would_unasked_eagerly(tmp_path):
    """Gemma 2's class has no SDPA (its soft-capped scores): transformers takes its eager attention
    when none is asked for, and so does the virtual GPU (before, asking for SDPA, the point was an
    error row). The eager scores are plain ops: the fake trace equals the steps on real CPU tensors."""
    import json

    from harness.config import cards
    from harness.config.models import default_attention
    from harness.config.point import Point
    from harness.probe.sim.trace import run_point

    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "gemma2", "hidden_size": 64, "intermediate_size": 128,
                                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                                "head_dim": 16, "vocab_size": 512, "sliding_window": 32,
                                "query_pre_attn_scalar": 16}))
    model = {"name": "hf", "arch": "auto", "config_json": str(path), "hf": {}}
    assert hf_config(model)._attn_implementation == "eager"
    assert default_attention(hf_config(model_cfg("tiny"))) == "sdpa"
    point = Point.from_dict(dict(model=model, precision="bf16", batch_size=2, seq_len=64,
                                 workload=dict(name="train", steps=2), optimizer=dict(name="adamw", lr=1e-4),
                                 gpu=cards.by_key()["a100-80gb"]))
    fake, _ = run_point(point, emulate_cuda=False, fake=True)
    real, _ = run_point(point, emulate_cuda=False, fake=False)
    assert fake["peak_allocated_bytes"] == real["peak_allocated_bytes"] > 0
    assert fake["step_peak_bytes"] == real["step_peak_bytes"]
    on_card, _ = run_point(point)
    assert not json.loads(on_card.get("attention_calls") or "[]")  # no SDPA call: every card alike
