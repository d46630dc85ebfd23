"""The virtual GPU's autocast (probe.sim.autocast_kernels: CUDA's policy in the AutocastCPU kernels)
against CUDA's own: the dispatcher's AutocastCUDA kernels, run on fake CUDA tensors
(tests/cuda_autocast.py). The same aten ops in the same dtypes and shapes, the casts and their order
included, for each op CUDA's autocast lists, for modules and composites that reach them from Python,
and for whole models' forwards with their loss; and half-precision models' forwards without
autocast, where CUDA's kernels make other outputs than the CPU's."""

import functools

import pytest
import torch
import torch.nn.functional as F

from harness.config.models import hf_config
from tests.conftest import ARCHITECTURES, model_cfg
from tests.cuda_autocast import call_ops, forward_ops, module_ops, outcome


def test_each_op_cudas_autocast_handles_has_a_kernel_of_its_policy():
    """A torch that adds or drops an AutocastCUDA op fails here: its policy is to be read again."""
    from harness.probe.sim import autocast_kernels as ak

    names = {n.removeprefix("aten::") for n in torch._C._dispatch_get_all_op_names()
             if torch._C._dispatch_has_kernel_for_dispatch_key(n, "AutocastCUDA")}
    tables = [ak.LOWER, ak.FP32, ak.FP32_OUT, ak.PROMOTE, set(ak.FP32_APPENDED), set(ak.BANNED)]
    ours = set().union(*tables)
    assert sum(map(len, tables)) == len(ours) == 119  # (torch 2.13's count: no op in two policies)
    assert names == ours, f"added: {sorted(names - ours)}, dropped: {sorted(ours - names)}"


def _long(d, *shape):
    return torch.zeros(*shape, dtype=torch.long, device=d)


def _smoothed(a, b, d, reduction):
    return F.cross_entropy(a, _long(d, 4), label_smoothing=0.1, reduction=reduction)


# Each case: a call reaching one or more of those ops from Python, on `a` (4 x 8, autocast's dtype)
# and `b` (4 x 8, fp32)
CASES = {
    # lower precision
    "linear": lambda a, b, d: F.linear(a, b, b[:, 0]), "matmul": lambda a, b, d: a @ b.t(),
    "mm": lambda a, b, d: torch.mm(a, b.t()), "addmm": lambda a, b, d: torch.addmm(b[:, :4], a, b.t()),
    "bmm": lambda a, b, d: torch.bmm(a[None], b.t()[None]),
    "baddbmm": lambda a, b, d: torch.baddbmm(b[None, :, :4], a[None], b.t()[None]),
    "addbmm": lambda a, b, d: torch.addbmm(b[:, :4], a[None], b.t()[None]), "mv": lambda a, b, d: torch.mv(a, b[0]),
    "addmv": lambda a, b, d: torch.addmv(b[:, 0], a, b[0]), "addr": lambda a, b, d: torch.addr(b, a[:, 0], b[0]),
    "einsum": lambda a, b, d: torch.einsum("ij,kj->ik", a, b), "multi_dot": lambda a, b, d: torch.linalg.multi_dot([a, b.t(), a]),
    "chain_matmul": lambda a, b, d: torch.chain_matmul(a, b.t(), a), "vecdot": lambda a, b, d: torch.linalg.vecdot(a, b),
    "prelu": lambda a, b, d: F.prelu(a, b[0, :1]), "conv1d": lambda a, b, d: F.conv1d(a[None], b[None, :, :2].expand(3, 4, 2)),
    "conv_transpose1d": lambda a, b, d: F.conv_transpose1d(a[None], b[:, :2, None].expand(4, 2, 2)),
    # fp32
    **{f: (lambda op: lambda a, b, d: op(a))(getattr(torch, f))
       for f in ("exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt", "acos", "asin", "cosh",
                 "sinh", "tan", "erfinv")},
    "pow": lambda a, b, d: a ** 2, "softplus": lambda a, b, d: F.softplus(a),
    "layer_norm": lambda a, b, d: F.layer_norm(a, (8,), b[0], b[1]), "group_norm": lambda a, b, d: F.group_norm(a, 2),
    "rms_norm": lambda a, b, d: F.rms_norm(a, (8,), b[0]), "logsumexp": lambda a, b, d: torch.logsumexp(a, -1),
    "renorm": lambda a, b, d: torch.renorm(a, 2, 0, 1.0), "dist": lambda a, b, d: torch.dist(a, a),
    "cdist": lambda a, b, d: torch.cdist(a, a), "pdist": lambda a, b, d: F.pdist(a),
    "cosine_similarity": lambda a, b, d: F.cosine_similarity(a, a),
    "nll_loss": lambda a, b, d: F.nll_loss(a, _long(d, 4)), "cross_entropy": lambda a, b, d: F.cross_entropy(a, _long(d, 4)),
    **{f"cross_entropy smoothed {r}": functools.partial(_smoothed, reduction=r) for r in ("mean", "sum", "none")},
    "mse_loss": lambda a, b, d: F.mse_loss(a, a), "l1_loss": lambda a, b, d: F.l1_loss(a, a),
    "smooth_l1_loss": lambda a, b, d: F.smooth_l1_loss(a, a), "huber_loss": lambda a, b, d: F.huber_loss(a, a),
    "kl_div": lambda a, b, d: F.kl_div(a, a, reduction="batchmean"),
    "bce_with_logits": lambda a, b, d: F.binary_cross_entropy_with_logits(a, a),
    "margin_ranking_loss": lambda a, b, d: F.margin_ranking_loss(a, a, a),
    "soft_margin_loss": lambda a, b, d: F.soft_margin_loss(a, a),
    "interpolate": lambda a, b, d: F.interpolate(a[None], scale_factor=2.0, mode="linear"),
    "interpolate area": lambda a, b, d: F.interpolate(a[None], scale_factor=2.0, mode="area"),
    # fp32 output
    "softmax": lambda a, b, d: torch.softmax(a, -1), "log_softmax": lambda a, b, d: F.log_softmax(a, -1),
    "softmax dtype given": lambda a, b, d: torch.softmax(a, -1, a.dtype),
    "sum": lambda a, b, d: a.sum(), "prod": lambda a, b, d: a.prod(-1), "cumsum": lambda a, b, d: a.cumsum(0),
    "cumprod": lambda a, b, d: a.cumprod(0), "vector_norm": lambda a, b, d: torch.linalg.vector_norm(a),
    "matrix_norm": lambda a, b, d: torch.linalg.matrix_norm(a), "norm": lambda a, b, d: a.norm(dim=-1),
    "normalize": lambda a, b, d: F.normalize(a, dim=-1), "square (a pow inside)": lambda a, b, d: a.square(),
    # promote (a's dtype and fp32 meet)
    "addcmul": lambda a, b, d: torch.addcmul(a, b, a), "addcdiv": lambda a, b, d: torch.addcdiv(b, a, a),
    "atan2": lambda a, b, d: torch.atan2(a, b), "cross": lambda a, b, d: torch.cross(a[:, :3], b[:, :3], dim=1),
    "dot": lambda a, b, d: torch.dot(a[0], b[0]), "tensordot": lambda a, b, d: torch.tensordot(a, b, dims=([1], [1])),
    "bilinear": lambda a, b, d: F.bilinear(a, b, torch.empty(3, 8, 8, device=d)),
    "scatter_add": lambda a, b, d: torch.scatter_add(a, 0, _long(d, 4, 8), b),
    "index_put": lambda a, b, d: torch.index_put(a, (_long(d, 2),), b[:2]),
    "float64 left alone": lambda a, b, d: F.linear(a.double(), b.double()),
    # what CUDA's autocast refuses
    "binary_cross_entropy": lambda a, b, d: F.binary_cross_entropy(torch.sigmoid(a), b),
    "fp16 meets bf16 promoted": lambda a, b, d: torch.addcmul(a.bfloat16(), a.half(), b),
    # the code turning autocast off, and asking about it (transformers' rotary embeddings: maybe_autocast)
    "autocast off inside": lambda a, b, d: _off(F.linear, b, b, device=d),
    "asks whether autocast is on": lambda a, b, d: F.linear(b, b).to(torch.get_autocast_dtype(d))
    if torch.is_autocast_enabled(d) else b,
    # a host tensor (a script's real CPU tensor among the card's fake ones): CUDA's autocast leaves it
    "a host tensor left alone": lambda a, b, d: (F.linear(_host(), _host()), F.linear(a, b)),
}


def _host() -> torch.Tensor:
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        return torch.ones(4, 8)


def _off(f, *args, device):
    with torch.autocast(device, enabled=False):
        return f(*args)


@pytest.mark.filterwarnings("ignore:torch.chain_matmul is deprecated")  # (still listed by CUDA's autocast)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_each_op_cuda_autocasts_is_cast_as_cuda_casts_it(case, dtype):
    emulated, cuda = outcome(call_ops, CASES[case], dtype, False), outcome(call_ops, CASES[case], dtype, True)
    assert emulated == cuda


# Modules whose Python calls the listed ops inside: each op cast as the dispatcher reaches it
MODULES = {
    "multihead attention": lambda: _Called(torch.nn.MultiheadAttention(8, 2), lambda m, x: m(x, x, x)),
    "multihead attention, separate projections": lambda: _Called(
        torch.nn.MultiheadAttention(8, 2, kdim=4, vdim=4), lambda m, x: m(x, x[..., :4], x[..., :4], need_weights=False)),
    "transformer encoder layer": lambda: torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0),
    "transformer decoder layer": lambda: _Called(torch.nn.TransformerDecoderLayer(8, 2, 16, dropout=0.0, norm_first=True),
                                                 lambda m, x: m(x, x)),
    "conv, group norm, upsample": lambda: torch.nn.Sequential(torch.nn.Conv1d(1, 4, 3, padding="same"),
                                                              torch.nn.GroupNorm(2, 4), torch.nn.Upsample(scale_factor=2)),
}


class _Called(torch.nn.Module):
    """`module` called on the input by `call`."""

    def __init__(self, module, call):
        super().__init__()
        self.module, self.call = module, call

    def forward(self, x):
        return self.call(self.module, x)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", sorted(MODULES))
def test_a_modules_inner_calls_are_cast_as_cuda_casts_them(name, dtype):
    """nn.MultiheadAttention's projections and attention in the lower precision, as CUDA's dispatcher
    casts each op its Python reaches (a function-level emulation left them in fp32)."""
    emulated, cuda = module_ops(MODULES[name], dtype, False), module_ops(MODULES[name], dtype, True)
    assert any(dt == dtype for _, outs in cuda for dt, _ in outs)
    assert emulated == cuda


def _config(name: str):
    config = hf_config(model_cfg(name, num_hidden_layers=2) if not name.endswith(".json") else
                       {"name": "hf", "arch": "auto", "config_json": str(ARCHITECTURES / name), "hf": {}})
    config._attn_implementation = "eager"  # (SDPA's kernel choice needs a CUDA device's properties)
    return config


@pytest.mark.parametrize("name,dtype", [
    ("tiny", torch.bfloat16), ("tiny", torch.float16), ("mistral-7b", torch.bfloat16), ("qwen2.5-7b", torch.float16),
    ("gpt2.json", torch.float16), ("bloom.json", torch.bfloat16), ("gemma2.json", torch.bfloat16),
    ("phi3.json", torch.bfloat16), ("olmo2.json", torch.bfloat16), ("mamba.json", torch.bfloat16),
    ("falcon.json", torch.float16), ("gemma3_text.json", torch.bfloat16), ("glm4.json", torch.bfloat16),
    ("gpt_neox.json", torch.float16), ("opt.json", torch.bfloat16), ("phi.json", torch.float16),
    ("starcoder2.json", torch.bfloat16),
])
def test_a_models_forward_and_loss_are_cast_as_cuda_casts_them(name, dtype):
    """Linear layers' weights cast before their inputs (CUDA's casts run last argument first), norms
    and rotary in fp32 where the code asks, the loss on the logits transformers upcasts: op for op."""
    config = _config(name)
    emulated, cuda = forward_ops(config, dtype, real=False), forward_ops(config, dtype, real=True)
    assert len(emulated) > 50
    assert emulated == cuda


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated")
@pytest.mark.parametrize("name", ["tiny", "mistral-7b", "gemma2.json", "gpt2.json"])
def test_a_models_prefill_and_decode_step_are_cast_as_cuda_casts_them(name):
    """Serving under autocast: the prefill into a DynamicCache (keys fp32 after the rotary embedding,
    values bf16) and a decode step attending to it."""
    config = _config(name)
    emulated = forward_ops(config, torch.bfloat16, real=False, serve=True)
    assert emulated == forward_ops(config, torch.bfloat16, real=True, serve=True)


@pytest.mark.parametrize("name,dtype", [("tiny", torch.float16), ("gemma2.json", torch.float16),
                                        ("gpt2.json", torch.bfloat16), ("phi.json", torch.float16)])
def test_a_half_precision_models_forward_and_loss_run_cudas_kernels(name, dtype):
    """Weights in fp16 or bf16, no autocast: eager attention's softmax of fp16 scores to fp32 one
    kernel (no fp32 copy of the scores first), layer norm's saved mean and rstd in fp32."""
    config = _config(name)
    emulated = forward_ops(config, dtype, real=False, autocast=False)
    assert emulated == forward_ops(config, dtype, real=True, autocast=False)


def test_layer_norms_statistics_are_cudas_inside_cuda_kernels_whatever_the_fake_cache_holds():
    """FakeTensorMode's cache is one for the process: an output made outside (the CPU's bf16
    statistics) is not taken inside, nor the other way round."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from harness.probe.sim.cuda_emulation import cuda_kernels

    def statistics_dtype() -> torch.dtype:
        x, w = torch.empty(4, 8, dtype=torch.bfloat16), torch.empty(8, dtype=torch.bfloat16)
        return torch.ops.aten.native_layer_norm.default(x, [8], w, None, 1e-5)[2].dtype

    with FakeTensorMode():
        assert statistics_dtype() == torch.bfloat16
        with cuda_kernels():
            assert statistics_dtype() == torch.float32
        assert statistics_dtype() == torch.bfloat16


@pytest.mark.parametrize("weight", ["fp32 leaf", "fp32 leaf without grad", "fp16 leaf", "fp32 non-leaf"])
def test_the_cast_cache_keeps_what_cached_cast_keeps(weight):
    """cached_cast's rule (an fp32 leaf that requires grad, cast to autocast's dtype) is one for every
    device: CPU autocast runs it here with autograd (fake CUDA tensors cannot), on real tensors. Two
    linears on one weight: its cast made once where the rule keeps it, twice where not."""
    from harness.probe.sim.autocast_kernels import region
    from tests.cuda_autocast import Ops

    def casts(emulated: bool) -> int:
        base = torch.randn(8, 8, dtype=torch.float16 if weight == "fp16 leaf" else torch.float32,
                           requires_grad=weight != "fp32 leaf without grad")
        w = base * 1 if weight == "fp32 non-leaf" else base
        x, log = torch.randn(4, 8), Ops()
        with (region(torch.bfloat16) if emulated else torch.autocast("cpu", torch.bfloat16)):
            with log:
                F.linear(x, w)
                F.linear(x, w)
        return sum(op == "aten._to_copy.default" for op, _ in log.ops)

    assert casts(emulated=True) == casts(emulated=False) == (3 if weight == "fp32 leaf" else 4)


@pytest.mark.parametrize("modes", [("no_grad", "grad"), ("grad", "no_grad"), ("inference", "grad"),
                                   ("grad", "inference"), ("no_grad", "inference", "grad")])
def test_a_cast_kept_under_no_grad_serves_a_later_forward_with_grad_as_cached_cast_does(modes):
    """torch 2.13's cached_cast makes a kept cast with grad on and keeps none in inference mode: an
    evaluation pass under no_grad, then a training pass in the same region, trains the weight (CPU
    autocast's C++ as the oracle, as above). The casts made, and whether each output needs grad."""
    from harness.probe.sim.autocast_kernels import region
    from tests.cuda_autocast import Ops

    grad_modes = {"grad": torch.enable_grad, "no_grad": torch.no_grad, "inference": torch.inference_mode}

    def run(emulated: bool) -> tuple:
        w, x, log, needs = torch.randn(8, 8, requires_grad=True), torch.randn(4, 8), Ops(), []
        with (region(torch.bfloat16) if emulated else torch.autocast("cpu", torch.bfloat16)), log:
            for mode in modes:
                with grad_modes[mode]():
                    needs.append(F.linear(x, w).requires_grad)
        return sum(op == "aten._to_copy.default" for op, _ in log.ops), needs

    assert run(emulated=True) == run(emulated=False)


def test_a_real_host_tensors_half_softmax_runs_the_cpus_kernel_inside_cuda_kernels():
    """A script's host work runs on real CPU tensors, whose softmax has no half-to-float kernel."""
    from harness.probe.sim.cuda_emulation import cuda_kernels

    with cuda_kernels():
        assert torch.softmax(torch.randn(2, 4, dtype=torch.float16), -1, dtype=torch.float32).dtype == torch.float32
