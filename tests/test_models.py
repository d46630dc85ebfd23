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
