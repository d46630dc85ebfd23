"""Architectures built from transformers' config classes, without weights."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from harness.config.models import hf_config
from tests.conftest import REPO, hf_point, model_cfg


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


def _presets() -> list[str]:
    from harness.config.compose import CONF_DIR

    return sorted(f.stem for f in (CONF_DIR / "model").glob("*.yaml") if f.stem != "hf")


@pytest.mark.parametrize("name", _presets())
def test_a_presets_own_keys_give_the_shape_transformers_config_gives(name):
    """shape_config answers a plan's parent from the preset's YAML, without transformers: its layers,
    heads, head_dim and positions are the config class's, defaults included."""
    from harness.config.models import attention_shape, max_positions, shape_config

    mine, theirs = shape_config(model_cfg(name)), hf_config(model_cfg(name))
    assert not isinstance(mine, type(theirs)), "a preset's keys are read without transformers' config"
    assert (mine.num_hidden_layers, attention_shape(mine), max_positions(mine)) == \
        (theirs.num_hidden_layers, attention_shape(theirs), max_positions(theirs))


@pytest.mark.parametrize("name", _presets())
def test_a_preset_is_a_causal_lm_whose_tensor_and_sequence_parallel_plans_the_harness_applies(name):
    """What validation takes for granted of a preset, so as not to import transformers for it."""
    from harness.config.models import has_causal_lm, sequence_parallel_refusal, tensor_parallel_refusal

    config = hf_config(model_cfg(name))
    assert has_causal_lm(config) and config.get_text_config() is config
    assert tensor_parallel_refusal(config) is None and sequence_parallel_refusal(config) is None


def test_a_preset_missing_a_shape_key_takes_transformers_config():
    """Mistral's class defaults 8 key/value heads, not the query heads: without the key in the
    preset, the config class answers."""
    from harness.config.models import attention_shape, shape_config

    cfg = model_cfg("mistral-7b")
    del cfg["hf"]["num_key_value_heads"]
    cfg["hf"]["num_attention_heads"] = 16
    assert attention_shape(shape_config(cfg)) == (16, 8, 256)


def test_a_preset_over_tensor_parallel_is_validated_and_its_shape_read_without_transformers():
    """A CLI parent runs no model: validating a preset point (over TP) and a plan's reading of its
    shape import neither torch nor transformers (3 s of every run's, sweep's and plan's parent)."""
    import subprocess
    import sys

    code = ("import sys; from harness.config.compose import compose; from harness.config.validate import validate; "
            "from harness.config.models import shape_config; "
            "cfg = compose(['model=mistral-7b', 'parallel.tp=4', 'parallel.sequence_parallel=true']); "
            "validate(cfg); shape_config(cfg.model); "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_a_model_without_sdpa_attends_as_transformers_would_unasked_eagerly(tmp_path):
    """Gemma 2's class has no SDPA (its soft-capped scores): transformers takes its eager attention
    when none is asked for, and so does the virtual GPU (before, asking for SDPA, the point was an
    error row). The eager scores are plain ops: the fake trace equals the steps on real CPU tensors."""
    import json

    from harness.config.models import default_attention
    from harness.probe.sim.trace import run_point

    point = hf_point(tmp_path, {"model_type": "gemma2", "hidden_size": 64, "intermediate_size": 128,
                                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                                "head_dim": 16, "vocab_size": 512, "sliding_window": 32,
                                "query_pre_attn_scalar": 16}, precision="bf16", batch_size=2, seq_len=64, steps=2)
    assert hf_config(point.model)._attn_implementation == "eager"
    assert default_attention(hf_config(model_cfg("tiny"))) == "sdpa"
    fake, _ = run_point(point, emulate_cuda=False, fake=True)
    real, _ = run_point(point, emulate_cuda=False, fake=False)
    assert fake["peak_allocated_bytes"] == real["peak_allocated_bytes"] > 0
    assert fake["step_peak_bytes"] == real["step_peak_bytes"]
    on_card, _ = run_point(point)
    assert not json.loads(on_card.get("attention_calls") or "[]")  # no SDPA call: every card alike


@pytest.mark.parametrize("arch", ["gemma2", "gpt2"])
def test_serving_a_model_that_drops_out_nothing_allocates_on_fake_tensors_what_real_ones_do(arch):
    """Under inference_mode dropout reaches the tracker whole; eager hands its input back where it
    drops nothing (eval, p=0), where fake's decomposition cloned it: Gemma 2's eager attention
    scores and GPT-2's dropout modules, each layer and decode step."""
    from harness.config.point import Workload
    from harness.probe.sim.trace import run_point
    from tests.conftest import ARCHITECTURES, on_config, train_point
    from tests.test_sharded import _lives

    point = on_config(train_point(batch_size=2, seq_len=32), ARCHITECTURES / f"{arch}.json")
    point = point.replace(workload=Workload(name="infer", new_tokens=4))
    fake = _lives(run_point(point, emulate_cuda=False, fake=True)[1].journal())
    real = _lives(run_point(point, emulate_cuda=False, fake=False)[1].journal())
    assert fake == real and len(fake[0]) > 0


def test_a_bf16_grouped_mm_output_is_padded_as_on_cuda_whatever_torch_build_traces_it():
    """CUDA pads each row of torch._grouped_mm's output to 16 B; torch's meta function does so only
    on a CUDA build of torch, and the virtual GPU runs on either (this one: +cpu)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from harness.probe.sim.tracker import StorageTracker

    tr = StorageTracker(emulate_cublas_workspace=False)
    with FakeTensorMode(allow_non_fake_inputs=True):
        # experts' weights stored (E, N, K) and passed transposed, as transformers' MoE does: K aligned
        a, b = torch.empty(64, 16, dtype=torch.bfloat16), torch.empty(2, 20, 16, dtype=torch.bfloat16).mT
        offs = torch.tensor([24, 64], dtype=torch.int32)
        with tr:
            out = torch._grouped_mm(a, b, offs)
    assert out.shape == (64, 20) and out.stride() == (24, 1)  # 20 bf16 columns padded to 24 (48 B)
    assert [e.size for e in tr.events if e.action == "alloc"] == [(63 * 24 + 20) * 2]


def test_a_mixture_of_experts_in_fp32_takes_cudas_grouped_mm_fallback(tmp_path):
    """CUDA's torch._grouped_mm loops mm_out over the groups where its operands are not both bf16
    (an MoE's experts in fp32, or under autocast, which has no rule for it); torch's meta function
    refuses them. The virtual GPU allocates what the fallback does, the output, shaped as the bf16
    kernel's for every layout, and an fp32 Qwen2-MoE point traces."""

    from torch._subclasses.fake_tensor import FakeTensorMode

    from harness.probe.sim.cuda_emulation import grouped_mm_output
    from harness.probe.sim.trace import run_point

    offs = torch.tensor([3, 8], dtype=torch.int32)
    layouts = [((8, 16), (2, 16, 24), offs), ((2, 8, 16), (2, 16, 24), None), ((16, 8), (8, 24), offs),
               ((2, 8, 16), (16, 24), offs)]
    with FakeTensorMode(allow_non_fake_inputs=True):
        for a, b, o in layouts:
            ref = torch._grouped_mm(torch.empty(a, dtype=torch.bfloat16), torch.empty(b, dtype=torch.bfloat16), o)
            out = grouped_mm_output(torch.empty(a), torch.empty(b), o)
            assert out.shape == ref.shape and out.dtype == torch.float32, (a, b)

    point = hf_point(tmp_path, {"model_type": "qwen2_moe", "hidden_size": 64, "intermediate_size": 128,
                                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                                "vocab_size": 512, "num_experts": 4, "num_experts_per_tok": 2,
                                "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64},
                     precision="fp32", batch_size=2, seq_len=64, steps=2)
    m, _ = run_point(point)
    assert m["peak_allocated_bytes"] > m["params_bytes"] > 0
    # checkpointed, its routing runs again in backward (on the card, as in the forward)
    ckpt, _ = run_point(point.replace(checkpointing=True))
    assert ckpt["params_bytes"] == m["params_bytes"] and ckpt["activations_bytes"] < m["activations_bytes"]


def test_the_model_built_on_meta_is_kept_for_its_config_and_built_anew_for_another():
    """models.on_meta hands the last model it built to the next asker of an equal config (a
    zygote's warm-up builds what its points ask about again); another config gets its own."""
    from harness.config.models import on_meta

    cfg = model_cfg("7b")
    first = on_meta(hf_config(cfg))
    assert on_meta(hf_config(cfg)) is first  # an equal config, made anew
    shallow = on_meta(hf_config({**cfg, "hf": {**cfg["hf"], "num_hidden_layers": 2}}))
    assert shallow is not first and len(shallow.model.layers) == 2
    assert len(on_meta(hf_config(cfg)).model.layers) == 32
