"""A preset point synthesized from 1 and 2 layers (probe.sim.shortcut) is the full trace, entry for
entry: every preset architecture, both workloads, checkpointing, precisions, every optimizer
implementation, the leak workloads. Each case traces 1, 2 and 3 layers (the template and its
check) and the full 4 (three synthesized copies), so a wrong order of copies shows."""

import dataclasses

import pytest

from harness.config.point import Parallel, Point, Workload
from harness.probe.sim import repeat, shortcut
from harness.probe.sim.repeat import NotRepeating
from harness.probe.sim.trace import run_point
from harness.probe.sim.tracker import TraceEvent
from tests.conftest import model_cfg, train_point

DEPTH = 4


def _point(model="7b", workload="train", **kw) -> Point:
    p = train_point(model=model, batch_size=kw.pop("batch_size", 1), seq_len=kw.pop("seq_len", 128),
                    num_hidden_layers=DEPTH, **kw)
    if workload == "infer":
        p = p.replace(workload=p.workload.__class__(name="infer", steps=1, new_tokens=3))
    return p


def _assert_same_as_full(point: Point, synthesized: bool = True, traced: shortcut.Traced | None = None) -> dict:
    """The point's trace (`traced`, else as shortcut.trace makes it) is its full trace, figures and all."""
    traced = traced or shortcut.trace(point)
    assert traced.measurements["trace_method"].startswith("synthesized" if synthesized else "full"), \
        traced.measurements["trace_method"]
    m, tracker = run_point(point)
    full = [e for e in tracker.journal() if e.action in ("alloc", "free")]
    assert repeat.canonical(traced.events) == repeat.canonical(full)
    method = traced.measurements.pop("trace_method")
    assert traced.measurements == m
    return {**m, "trace_method": method}


def _one_preset_per_structure() -> list[str]:
    """A preset of each layer structure deeper than the template's three layers (tiny has two):
    its architecture, and whether its attention groups key/value heads (GQA repeats them). The
    sizes change no op of the trace, only shapes: 13b is 7b's structure, llama3-405b 70b's."""
    from harness.config.compose import CONF_DIR

    seen: dict[tuple, str] = {}
    for f in sorted((CONF_DIR / "model").glob("*.yaml"), key=lambda f: (len(f.stem), f.stem)):
        cfg = model_cfg(f.stem)
        hf = cfg.get("hf") or {}
        if not hf.get("num_hidden_layers") or hf["num_hidden_layers"] <= 3:
            continue
        grouped = hf.get("num_key_value_heads", hf["num_attention_heads"]) < hf["num_attention_heads"]
        seen.setdefault((cfg["arch"], grouped), f.stem)
    return sorted(seen.values())


ARCHS = _one_preset_per_structure()


@pytest.mark.slow
@pytest.mark.parametrize("model", ARCHS)
def test_every_preset_architecture_synthesizes_its_full_training_trace(model):
    _assert_same_as_full(_point(model))


@pytest.mark.slow
@pytest.mark.parametrize("model,tp", [("7b", 1), ("qwen2.5-7b", 1), ("7b", 2)])
def test_inference_prefill_and_decode_synthesize_their_full_trace(model, tp):
    """Over tensor parallel too: each linear decomposed at once under inference_mode
    (presets.composites_on_dtensors), not after a failed attempt whose reference cycle the
    GC frees wherever it runs (no two depths alike: traced in full, 220 s for 7B)."""
    _assert_same_as_full(_point(model, workload="infer", seq_len=64).replace(parallel=Parallel(tp=tp)))


@pytest.mark.slow
@pytest.mark.parametrize("precision,checkpointing", [("bf16", True), ("amp_bf16", True), ("amp_bf16", False),
                                                     ("amp_fp16", False)])
def test_checkpointing_and_precisions_synthesize_their_full_trace(precision, checkpointing):
    _assert_same_as_full(_point(precision=precision, checkpointing=checkpointing))


@pytest.mark.slow
# AdamW's foreach (what CUDA picks: impl=auto) is every other test's; SGD's auto is its foreach.
@pytest.mark.parametrize("optimizer,impl", [("adamw", "fused"), ("adamw", "forloop"), ("sgd", "auto"),
                                            ("adafactor", "auto")])
def test_every_optimizer_implementation_synthesizes_its_full_trace(optimizer, impl):
    _assert_same_as_full(_point(optimizer=optimizer, impl=impl))


@pytest.mark.slow
def test_a_trace_that_does_not_repeat_falls_back_to_the_full_trace():
    """Adafactor's foreach step orders its 1-D parameters' temporaries so that one layer's entries
    do not sit together: the check at 3 layers refuses the template, and the point is traced in
    full (the same trace, slower)."""
    _assert_same_as_full(_point(optimizer="adafactor", impl="foreach"), synthesized=False)


@pytest.mark.slow
@pytest.mark.parametrize("leak,checkpointing", [("graph", False), ("cycle", False), ("graph", True)])
def test_leak_workloads_synthesize_their_trace_and_holder(leak, checkpointing):
    """With checkpointing under a kept graph (bf16), each layer's checkpoint keeps the layer below's
    output for good, and the norm frees the top layer's alone: the kept chain."""
    p = _point(checkpointing=checkpointing)
    p = p.replace(workload=p.workload.__class__(name="train", steps=3, new_tokens=16, leak=leak))
    assert _assert_same_as_full(p)["retained_holder"]


def test_a_structure_checked_on_one_point_serves_another_batch_and_length(tmp_path):
    """Batch 2 and 4 (and their lengths) have journals that differ only in sizes: the second point
    traces 1 layer only (the second placed as on the first point), skips the check at 3 layers and
    is still its full trace; batch 1 (size-1 dimensions trace differently) is a structure of its own,
    learned and checked anew."""
    cache = str(tmp_path / ".traces")
    first = shortcut.trace(_point(batch_size=2, seq_len=64).replace(trace_cache=cache))
    assert first.measurements["trace_method"].startswith("synthesized: layers 1, 2 -> 4")
    assert first.measurements["trace_method"].endswith("(checked at 3)")
    p = _point(batch_size=4, seq_len=32).replace(trace_cache=cache)
    m = _assert_same_as_full(p)
    assert p.trace_cache and m["peak_allocated_bytes"] > 0
    assert m["trace_method"] == ("synthesized: layer 1, layer 2 placed as on 7b b2 s64 bf16 -> 4, steps 2 -> 3 "
                                 "(its structure checked at 3 on 7b b2 s64 bf16)")
    own = shortcut.trace(_point(batch_size=1, seq_len=64).replace(trace_cache=cache))
    assert own.measurements["trace_method"].startswith("synthesized: layers 1, 2 -> 4")
    assert own.measurements["trace_method"].endswith("(checked at 3)")


@pytest.mark.slow
@pytest.mark.parametrize("case", ["infer", "leak-graph", "amp-ckpt", "70b-fused"])
def test_a_layer_placed_as_on_another_batch_is_the_full_trace(case, tmp_path):
    """The second point of each (traced at 1 layer only, the second placed as on the first point)
    is its full trace, figures and retained holder included, or was traced at 2 layers too."""
    kw = {"infer": dict(workload="infer"), "leak-graph": {}, "amp-ckpt": dict(precision="amp_bf16", checkpointing=True),
          "70b-fused": dict(model="70b", optimizer="adamw", impl="fused")}[case]
    cache = str(tmp_path / ".traces")

    def point(b, s):
        p = _point(batch_size=b, seq_len=s, **kw).replace(trace_cache=cache)
        if case == "leak-graph":
            p = p.replace(workload=p.workload.__class__(name="train", steps=3, new_tokens=16, leak="graph"))
        return p
    shortcut.trace(point(2, 64))
    m = _assert_same_as_full(point(3, 32))
    assert "placed as on 7" in m["trace_method"]


@pytest.mark.parametrize("model,kw", [("7b", {}), ("7b", {"checkpointing": True}), ("qwen2.5-7b", {}),
                                      ("7b", {"optimizer": "sgd"})])
def test_a_recipe_taken_on_one_batch_makes_another_batchs_deeper_journal(model, kw):
    """What a point placing its layer as another did builds in place of tracing it: its 2-layer
    journal from its own 1-layer one's entries (the new layer's sizes its neighbour's), as a
    recipe taken on another batch and length says - equal to the 2-layer journal traced - and
    the layer placed there as learned."""
    def journals(batch_size, seq_len):
        p = _point(model, batch_size=batch_size, seq_len=seq_len, **kw)
        p = p.replace(workload=p.workload.__class__(name="train", steps=2, new_tokens=16))
        return [run_point(shortcut.at_depth(p, d))[1].journal() for d in (1, 2)]
    one, two = journals(2, 64)
    made_of = repeat.recipe(repeat.learn(one, two, 1, "model.layers."))
    assert made_of is not None
    other_one, other_two = journals(3, 32)
    assert repeat.skeleton(other_one) == repeat.skeleton(one)
    deeper = repeat.deepen(other_one, made_of)
    assert repeat.canonical(deeper) == repeat.canonical(other_two)
    template = repeat.learn(other_one, other_two, 1, "model.layers.")
    assert repeat.structure(repeat.placed(deeper, repeat.layout(template))) == repeat.structure(template)


@pytest.mark.slow
def test_training_steps_after_the_second_are_copies_of_it_traced_or_synthesized():
    """Five steps from two, on the journal itself: the gradients each step's zero_grad frees are the
    step before's, the optimizer state stays."""
    from harness.probe.sim import steps

    p = _point()
    five = p.replace(workload=p.workload.__class__(name="train", steps=5, new_tokens=16))
    two = p.replace(workload=p.workload.__class__(name="train", steps=2, new_tokens=16))
    traced = run_point(shortcut.at_depth(five, 2))[1].journal()
    extended = steps.extend(run_point(shortcut.at_depth(two, 2))[1].journal(), 5)
    assert repeat.canonical(extended) == repeat.canonical(traced)
    assert "steps 2 -> 5" in _assert_same_as_full(five)["trace_method"]


@pytest.mark.slow
@pytest.mark.parametrize("model,seq_len,tp", [("7b", 64, 1), ("7b", 608, 1), ("llama3-8b", 700, 2)])
def test_decode_steps_past_the_traced_three_grow_from_them_into_the_full_trace(model, seq_len, tp):
    """Serving 8 tokens: the shallow depths decode 3 (4 at the check), the rest grow from them a
    token a step (each layer's cache, flash's split-KV accumulators resized for their longer keys:
    608 tokens split on an A100, 64 do not), entry for entry the full trace's."""
    p = _point(model, workload="infer", seq_len=seq_len).replace(parallel=Parallel(tp=tp))
    p = p.replace(workload=dataclasses.replace(p.workload, new_tokens=8))
    assert shortcut.decodes_beyond(p)
    assert "decode steps 3 -> 8" in _assert_same_as_full(p)["trace_method"]


@pytest.mark.slow
def test_decode_steps_over_which_only_the_traced_card_starts_splitting_grow_through_placeholders():
    """4 sequences of a 240-token prompt decoded to 270 on an A100: its flash splits the keys from 257
    on, a card of more SMs' from 129 on, so every step has the accumulators' entries, 0-B
    placeholders on the A100 until it splits (kernel_scratch): the steps grow, entry for entry the
    full trace's."""
    from harness.config import cards, kernels
    from harness.config.attention import FusedShape

    p = _point("7b", workload="infer", seq_len=270, batch_size=4)
    p = p.replace(workload=dataclasses.replace(p.workload, new_tokens=30))
    on_a100 = [kernels.flash_splitkv_bytes(FusedShape(4, 32, 32, 1, s_k, 128, 128, 2),
                                           kernels.geometry(cards.by_key()["a100-80gb"]))[1] > 0 for s_k in (241, 270)]
    assert on_a100 == [False, True] and shortcut.decodes_beyond(p)
    assert "decode steps 3 -> 30" in _assert_same_as_full(p)["trace_method"]


@pytest.mark.slow
def test_a_model_without_attention_serves_more_decode_steps_than_are_traced():
    """Mamba decoding 8 tokens, its state of one size (no keys to split): it was an error row,
    asked for its attention heads."""
    point = _on_architecture("mamba", num_hidden_layers=5).replace(workload=Workload(name="infer", new_tokens=8))
    assert shortcut.decodes_beyond(point)
    assert any(e.phase == "decode" for e in shortcut.trace(point).events)


@pytest.mark.slow
@pytest.mark.parametrize("arch, seq_len, new_tokens, p, grown", [
    ("llama4_text", 64, 6, 4, False),  # chunks of 64: the last step's mask starts a chunk (76 allocations more)
    ("gemma2", 80, 20, 2, True),  # a window of 64 reached at the 5th step: its masks stop growing there
])
def test_decode_steps_past_a_chunks_end_or_a_sliding_window_are_the_full_trace(arch, seq_len, new_tokens, p, grown):
    """Steps grown from the traced 3 were not the full trace past the boundary (the check decodes
    4): a sliding window's point traces 3 steps past it and grows from there, a chunk's every
    step."""
    point = _on_architecture(arch, num_hidden_layers=4 * p).replace(
        seq_len=seq_len, workload=Workload(name="infer", new_tokens=new_tokens))
    assert shortcut.decodes_beyond(point) == (9 if grown else None)  # 60 tokens, 64 + 1 reached at 5: 3 past
    m = _assert_same_as_full(point, traced=shortcut.synthesized(point, p, p))
    assert ("decode steps 9 -> 20" in m["trace_method"]) == grown


@pytest.mark.slow
@pytest.mark.parametrize("model, p", [
    ("mistral-7b", 1),  # every layer's: its mask appears at the window (14 allocations a layer more)
    ("gemma2", 2),  # every other layer's: the global ones' caches keep growing
])
def test_a_decode_across_a_sliding_window_far_past_its_prompt_is_joined_from_two_short_traces(model, p):
    """A 48-token prompt decoded to 72 over a window of 64: the steps across it are traced from a
    59-token prompt and joined to the point's first 3, grown to 60 tokens; the joined trace is the
    full one."""
    point = train_point(model=model, num_hidden_layers=DEPTH, sliding_window=64) if p == 1 else \
        _on_architecture(model, num_hidden_layers=4 * p)
    point = point.replace(seq_len=72, workload=Workload(name="infer", new_tokens=24))
    assert shortcut.decodes_beyond(point) == 64 + 2 - 48 + 3
    m = _assert_same_as_full(point, traced=shortcut.synthesized(point, p, p))
    assert "the sliding window crossed from a 59-token prompt" in m["trace_method"]


@pytest.mark.parametrize("model, seq_len, new_tokens, said", [
    ("tiny", 200, 16, "decode steps 3 -> 16 (checked at 4)"),
    ("gemma2", 200, 16, "decode steps 3 -> 16 (checked at 4)"),
    # a 48-token prompt decoded to 72 over a window of 64: its steps across it joined (_across_window)
    ("gemma2", 72, 24, "decode steps 3 -> 24, the sliding window crossed from a 59-token prompt (each checked a step "
                       "further)"),
])
def test_a_serving_point_traced_at_its_depth_grows_its_decode_steps_from_the_traced_ones(model, seq_len, new_tokens,
                                                                                          said):
    """Too few layers to copy (tiny's 2), or unlike to the top (Gemma 2's 7: sliding and global
    attention alternate): the point is traced at its depth for 3 decode steps and a 4th, the 4th
    the 3rd grown, and the later steps grow from them; the full trace."""
    point = train_point() if model == "tiny" else _on_architecture(model, num_hidden_layers=7)
    point = point.replace(seq_len=seq_len, workload=Workload(name="infer", new_tokens=new_tokens))
    m = _assert_same_as_full(point, synthesized=False)
    assert m["trace_method"].endswith("; " + said)


def test_a_decode_from_a_longer_prompt_joins_where_its_storages_are_the_points_in_role_and_bytes():
    """The head's cache after step 2 is the tail's after its step 1 (1280 B): the tail's steps 2
    and 3 (a mask from step 2 on) follow as steps 3 and 4, freeing the head's cache. A cache of
    other bytes there does not join."""
    from harness.probe.sim import steps

    def ev(action, key, size, step, module="attn"):
        return TraceEvent(0, action, key, size, "activation", "decode", step, module)
    head = [ev("alloc", 9, 1024, 0), ev("end", 0, 0, 0)]
    for step in (1, 2):
        head += [ev("alloc", 10 + step, 1024 + 128 * step, step), ev("free", 9 + step, 896 + 128 * step, step),
                 ev("end", 0, 0, step)]
    head[3] = head[3]._replace(key=9)  # (step 1 frees the prefill's)
    tail = [ev("alloc", 50, 1152, 0), ev("end", 0, 0, 0), ev("alloc", 51, 1280, 1), ev("free", 50, 1152, 1),
            ev("end", 0, 0, 1)]
    for step, key in ((2, 52), (3, 53)):
        tail += [ev("alloc", key, 1280, step), ev("alloc", 90 + step, 64, step, "mask"), ev("free", key - 1, 1280, step),
                 ev("free", 90 + step, 64, step, "mask"), ev("end", 0, 0, step)]
    out = steps.joined(head, tail, 2)
    assert [(e.action, e.size, e.step, e.module) for e in out if e.step >= 3 and e.action != "end"] == [
        ("alloc", 1280, 3, "attn"), ("alloc", 64, 3, "mask"), ("free", 1280, 3, "attn"), ("free", 64, 3, "mask"),
        ("alloc", 1280, 4, "attn"), ("alloc", 64, 4, "mask"), ("free", 1280, 4, "attn"), ("free", 64, 4, "mask")]
    assert [e.key for e in out if e.step == 3 and e.action == "free"][0] == 12  # the head's step-2 cache
    assert len({e.key for e in out if e.action == "alloc"}) == sum(e.action == "alloc" for e in out)
    with pytest.raises(NotRepeating, match="1280 B, at the same length from a longer prompt 1408 B"):
        steps.joined(head, [e._replace(size=1408) if e.key == 51 else e for e in tail], 2)
    # a storage of the longer prompt's prefill, freed after the join: the head has none in its place
    prefilled = tail[:1] + [ev("alloc", 40, 32, 0, "norm")] + tail[1:-1] + [ev("free", 40, 32, 3, "norm"), tail[-1]]
    with pytest.raises(NotRepeating, match="refers to a storage of its step 0"):
        steps.joined(head, prefilled, 2)


def test_decode_steps_whose_flash_starts_splitting_the_keys_are_all_traced():
    """A 100-token prompt decoded to 140: flash's keys pass one block of 128 on the way, where its
    split-KV accumulators begin (a step the traced ones have no entry for): every step is traced."""
    p = _point("7b", workload="infer", seq_len=140)
    p = p.replace(workload=dataclasses.replace(p.workload, new_tokens=40))
    assert not shortcut.decodes_beyond(p)
    assert "decode steps" not in _assert_same_as_full(p)["trace_method"]


def test_a_growing_step_grows_each_entry_and_each_kernel_code_by_what_the_step_before_did():
    """Step 2 grows on step 1 as step 1 did on step 0: the cache a token longer, freed a step
    later; a kernel's code a key longer, its bytes what `grow` says of the new code."""
    from harness.probe.sim import steps

    def ev(action, key, size, step, kernel=""):
        return TraceEvent(0, action, key, size, "activation", "decode", step, "attn", 0, kernel)
    journal = []
    for step, (cache, keys) in enumerate([(1024, 10), (1152, 11), (1280, 12)]):
        journal += [ev("alloc", 10 + step, cache, step), *([ev("free", 9 + step, cache - 128, step)] if step else []),
                    ev("alloc", 20 + step, 4 * keys, step, f"splitkv:1:{keys}"),
                    ev("free", 20 + step, 4 * keys, step, f"splitkv:1:{keys}"), ev("end", 0, 0, step)]
    journal.insert(3, ev("free", 9, 896, 0))  # (step 0 frees the prefill's: as the later ones)
    journal.insert(0, ev("alloc", 9, 896, -1))
    grown = steps.extend(journal, 5, grow=lambda code: 4 * int(code.rsplit(":", 1)[1]))
    step4 = [(e.action, e.size, e.kernel) for e in grown if e.step == 4]
    assert step4 == [("alloc", 1536, ""), ("free", 1408, ""), ("alloc", 56, "splitkv:1:14"),
                     ("free", 56, "splitkv:1:14"), ("end", 0, "")]
    freed = {e.key for e in grown if e.action == "free"}
    assert [e.key in freed for e in grown if e.action == "alloc" and e.kernel == ""] == [True] * 5 + [False]
    unlike = [e._replace(module="mlp") if e.step == 2 and e.action == "free" and not e.kernel else e for e in journal]
    with pytest.raises(NotRepeating, match="not the step before's"):  # a step unlike the one before
        steps.extend(unlike, 5, grow=lambda code: None)


def test_a_step_that_frees_older_memory_does_not_repeat():
    """Step 1 frees a storage of the setup: a copy of step 1 would free it twice."""
    from harness.probe.sim import steps

    def ev(action, key, step):
        return TraceEvent(0, action, key, 512, "activation", "forward", step, "")
    journal = [ev("alloc", 1, -1), ev("alloc", 2, 0), ev("end", 0, 0), ev("free", 1, 1), ev("end", 0, 1)]
    with pytest.raises(NotRepeating):
        steps.extend(journal, 3)


def _on_architecture(name: str, **hf) -> Point:
    """A training point on a small config.json of tests/data/architectures, its keys `hf` changed."""
    from tests.conftest import ARCHITECTURES, on_config

    return on_config(_point("tiny"), ARCHITECTURES / f"{name}.json", **hf)


def test_layers_that_differ_up_to_the_top_are_traced_in_full_and_say_why():
    """Gemma 2 alternates sliding and full attention: no run of alike layers to copy. Qwen2 with a
    sliding window from layer 2 of 4 on: too few alike to copy."""
    a, p, why = shortcut.template_depth(_on_architecture("gemma2", num_hidden_layers=7))
    assert (a, p) == (7, 1) and "layer_types" in why
    cfg = model_cfg("qwen2.5-7b", num_hidden_layers=DEPTH, use_sliding_window=True, max_window_layers=2,
                    sliding_window=64)
    p = _point("qwen2.5-7b")
    p = p.replace(model=dataclasses.replace(p.model, hf=cfg["hf"]))
    a, _, why = shortcut.template_depth(p)
    assert a == 3 and "layer_types" in why


@pytest.mark.slow
@pytest.mark.parametrize("name, hf, a", [
    ("deepseek_v3", dict(num_hidden_layers=16, first_k_dense_replace=3), 4),
    ("qwen2_moe", dict(num_hidden_layers=10, use_sliding_window=True, max_window_layers=1, sliding_window=16), 2),
], ids=["dense-then-moe", "full-then-sliding"])
def test_layers_built_otherwise_at_the_bottom_stay_in_the_template_and_the_rest_are_synthesized(name, hf, a):
    """DeepSeek-V3's first 3 layers are dense, the rest mixtures of experts (a template from 1 and 2
    layers, checked at 3, copied a dense layer to the top: a tenth fewer parameters here, most of
    DeepSeek-V3's own 671B); a sliding window from layer 1 on. The template's shallower depth holds
    those layers and one of the rest (a = k+1), its per-layer lists cut to its depth, and the
    synthesized trace is the full one."""
    assert shortcut.template_depth(_on_architecture(name, **hf)) == (a, 1, None)
    p = _on_architecture(name, **{**hf, "num_hidden_layers": a + 3})  # (a shorter full trace)
    m = _assert_same_as_full(p, traced=shortcut.synthesized(p, a))
    assert m["trace_method"].startswith(f"synthesized: layers {a}, {a + 1} -> {a + 3}")


@pytest.mark.slow
@pytest.mark.parametrize("name, n, how, p", [
    ("gemma2", 8, "train", 2),  # sliding-window and global attention alternate
    ("gemma2", 8, "serve", 2),  # prefill and 8 decode steps, grown from the traced 3
    ("gemma2", 8, "tp", 2),  # over tensor parallel
    ("gemma2", 8, "ddp", 2),  # over DDP: its setup traced at the model's depth
    ("gemma2", 8, "fsdp", 2),  # over FSDP2: a unit per layer, two to a block
    ("gemma2", 8, "fsdp-ckpt", 2),  # each layer's recompute gathering it again
    # sliding-window layers and a global one, in blocks of 3 (Gemma 3's 6 made 3: a block of more
    # than two, whose full trace is half as deep)
    ("gemma3_text", 12, "train", 3),
])
def test_blocks_of_layers_that_repeat_synthesize_their_full_trace(name, n, how, p):
    """A block of p layers is copied as one layer is: depths a and a+p traced, checked at a+2p,
    the rest whole blocks named back as the layers they are (repeat.as_blocks). (Shallower than a
    model whose blocks template_depth copies, whose full trace would take longer.)"""
    point = _on_architecture(name, num_hidden_layers=n, **({"sliding_window_pattern": p} if name == "gemma3_text" else {}))
    if how == "serve":
        point = point.replace(workload=Workload(name="infer", new_tokens=8))
    if how in ("tp", "ddp", "fsdp", "fsdp-ckpt"):
        point = point.replace(parallel={"tp": Parallel(tp=2), "ddp": Parallel(dp_replicate=2)}.get(
            how, Parallel(dp_shard=2)), checkpointing=how == "fsdp-ckpt")
    m = _assert_same_as_full(point, traced=shortcut.synthesized(point, p, p))
    assert f"layers {p}, {2 * p} (blocks of {p} layers) -> {n}" in m["trace_method"]


@pytest.mark.slow
@pytest.mark.parametrize("name, shards", [("gpt2", 1), ("opt", 1), ("bloom", 1), ("gpt2", 2), ("bloom", 2)])
def test_layers_whose_parameters_end_the_optimizers_lists_synthesize_their_full_training_trace(name, shards):
    """AdamW's foreach ops make an output per parameter, layer by layer, and free them last first.
    A final norm's outputs after the layers' (GPT-2, BLOOM) look like a layer's first, and OPT has
    none: unnamed, the new layer's allocations and frees made one insertion, copied whole, and these
    were traced in full. Named by their parameters' modules, the frees run the other way. Under FSDP2
    the layer's last retags (its state's, ending the optimizer's step) and zero_grad's free of its
    gradients' shard met as one insertion, four entries off: one a phase (repeat._by_phase)."""
    point = _on_architecture(name, num_hidden_layers=5).replace(parallel=Parallel(dp_shard=shards))
    assert _assert_same_as_full(point)["trace_method"].startswith("synthesized: layers 1, 2 -> 5")


def test_a_block_of_layers_is_copied_only_where_that_traces_fewer_layers():
    """Gemma 3's blocks of 6: at 26 layers (Gemma 3 1B's), 8 and 14 a point would be traced (nor are
    its last 2, alike, copied from 23 and 24); at 34 (4B's), 10 and 16 (22 once, for the check); at
    42, 6 and 12. Gemma 2's of 2 at 14 layers: 2 and 4, under FSDP2 too. Llama 4's of 4 (3 chunked,
    1 global) at 28: 4 and 8, its moe_layers listing every layer's index where each has experts
    (alike, not 0..27)."""
    a, p, why = shortcut.template_depth(_on_architecture("gemma3_text", num_hidden_layers=26))
    assert p == 1 and "layer_types" in why
    assert shortcut.template_depth(_on_architecture("gemma3_text", num_hidden_layers=34)) == (10, 6, None)
    assert shortcut.template_depth(_on_architecture("gemma3_text", num_hidden_layers=42)) == (6, 6, None)
    assert shortcut.template_depth(_on_architecture("gemma2", num_hidden_layers=14)) == (2, 2, None)
    fsdp = _on_architecture("gemma2", num_hidden_layers=14).replace(parallel=Parallel(dp_shard=2))
    assert shortcut.template_depth(fsdp) == shortcut.template_depth(fsdp.replace(checkpointing=True)) == (2, 2, None)
    assert shortcut.template_depth(_on_architecture("llama4_text", num_hidden_layers=28)) == (4, 4, None)


def test_blocks_named_as_one_layer_are_named_back_as_their_layers():
    from harness.probe.sim.repeat import as_blocks, from_blocks

    journal = [_ev("alloc", k, 8, module=m) for k, m in enumerate(
        ["model.embed", "model.layers.1.mlp", "model.layers.2", "model.layers.3.self_attn.q", "model.layers.12.mlp",
         "model.norm"])]
    named = as_blocks(journal, "model.layers.", 2, 2)
    assert [e.module for e in named] == ["model.embed", "model.layers.1.mlp", "model.layers.2.~0",
                                         "model.layers.2.~1.self_attn.q", "model.layers.7.~0.mlp", "model.norm"]
    assert from_blocks(named, "model.layers.", 2, 2) == journal


def test_a_cut_model_keeps_its_per_layer_lists_for_its_layers():
    p = _on_architecture("gemma3_text", num_hidden_layers=8)
    kinds = list(shortcut.hf_config(p.model).layer_types)
    assert shortcut.at_depth(p, 3).model.hf["layer_types"] == kinds[:3] and len(set(kinds[:8])) == 2


def test_a_shallow_model_and_a_users_job_are_traced_in_full():
    assert shortcut.template_depth(train_point(model="tiny"))[2] == "2 layers"
    custom = train_point().replace(workload=Workload(name="custom", target="m:f"))
    assert shortcut.template_depth(custom)[2] == "a job of the user's own"


def _ev(action, key, size, phase="forward", module=""):
    return TraceEvent(0, action, key, size, "activation", phase, 0, module)


def test_journals_that_are_not_one_with_insertions_are_refused():
    """The deeper journal lost an entry of the shallower one: no template, so no synthesis."""
    a = [_ev("alloc", 1, 512), _ev("alloc", 2, 1024), _ev("free", 1, 512)]
    b = [_ev("alloc", 1, 512), _ev("free", 1, 512)]
    with pytest.raises(NotRepeating):
        repeat.learn(a, b, 1, "model.layers.")


def test_an_entry_that_grows_by_a_layers_bytes_with_each_layer_is_scaled():
    """One storage for all the layers' gradients (DDP's flat bucket), allocated after them and freed
    at the end: each layer more adds its bytes to it, at any depth."""
    def journal(n):
        layers = [_ev("alloc", 100 + i, 512, module=f"model.layers.{i}") for i in range(n)]
        return layers + [_ev("alloc", 999, 512 * n + 64, module="model"), _ev("free", 999, 512 * n + 64)]
    t = repeat.learn(journal(1), journal(2), 1, "model.layers.")
    assert list(t.scaled.values()) == [512, 512]  # the alloc and its free
    for n in (3, 7):
        assert repeat.canonical(repeat.synthesize(t, n)) == repeat.canonical(journal(n))


def test_outputs_made_for_every_layer_and_freed_last_first_are_copied_so():
    """A foreach op's outputs, one per layer's parameter, freed in reverse with nothing after them:
    the new layer's allocation and its free are two insertions, not one block copied whole."""
    def journal(n):
        outputs = [_ev("alloc", 100 + i, 512, "optimizer", f"model.layers.{i}.mlp") for i in range(n)]
        frees = [_ev("free", 100 + i, 512, "optimizer") for i in reversed(range(n))]  # (a free names no module)
        return [_ev("alloc", 1, 64, module="model.embed"), *outputs, *frees, _ev("free", 1, 64)]
    t = repeat.learn(journal(1), journal(2), 1, "model.layers.")
    for n in (3, 6):
        assert repeat.canonical(repeat.synthesize(t, n)) == repeat.canonical(journal(n))


def test_a_layers_own_temporaries_freed_within_it_stay_one_block():
    """Allocated and freed last first as a foreach op's outputs are, but after the old layer's have
    been freed: each layer's own, copied whole."""
    def journal(n):
        layers = [_ev(action, 100 + i, 512, module=f"model.layers.{i}.mlp" if action == "alloc" else "")
                  for i in range(n) for action in ("alloc", "free")]
        return [_ev("alloc", 1, 64, module="model.embed"), *layers, _ev("free", 1, 64)]
    t = repeat.learn(journal(1), journal(2), 1, "model.layers.")
    assert repeat.canonical(repeat.synthesize(t, 4)) == repeat.canonical(journal(4))


def test_a_chain_hands_the_residual_stream_from_layer_to_layer():
    """Embedding output -> layer 0 -> (layer 1) -> norm: each layer frees the one before's output,
    the norm frees the last layer's; synthesized 4 layers keep that chain."""
    def journal(n):
        out, key = [_ev("alloc", 100, 512, module="model.embed")], 100
        for i in range(n):
            out += [_ev("alloc", 200 + i, 512, module=f"model.layers.{i}"), _ev("free", key, 512)]
            key = 200 + i
        return out + [_ev("alloc", 999, 1024, module="model.norm"), _ev("free", key, 512)]
    t = repeat.learn(journal(1), journal(2), 1, "model.layers.")
    assert repeat.canonical(repeat.synthesize(t, 3)) == repeat.canonical(journal(3))
    assert repeat.canonical(repeat.synthesize(t, 6)) == repeat.canonical(journal(6))
