"""Which of a model's layers are one block repeated: the depth its journal may be synthesized from.

probe.sim.shortcut traces depths a and a+1 and copies the new layer (index a) to the model's depth;
the check at a+2 sees layers 0..a+1 only. So every layer from a-1 on must be built alike (depth a
holds one of them), and the shallow models must build their layers as the deep one does. Or a block
of p layers repeats (Gemma 2 alternates sliding-window and global attention): depths a and a+p, the
check at a+2p, the layers from a-p on each built as the one p after it. A layer is
compared by what it is built of, on the meta device (config.models.on_meta): each submodule's class,
its parameters' and buffers' shapes and dtypes, its plain attributes (a sliding window, a layer's
kind; not its index), and the config's per-layer lists at its index (layer_types). DeepSeek-V3's
first three layers are dense and the rest mixtures of experts: a = 4, where a = 1 (checked at 3)
copied a dense layer 58 times.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection

from harness.config.models import hf_config, on_meta
from harness.config.point import Point

# Attributes naming a layer's own index (a cache slot): alike layers differ in them. Another name
# for an index makes the layers look unlike: traced in full, slower but exact.
_INDEX = frozenset({"layer_idx", "layer_id", "layer_index", "layer_number"})
_PLAIN = (bool, int, float, str, type(None))
MAX_PERIOD = 8  # layers in a repeated block (Gemma 3's: five sliding-window layers and a global one)


def at_depth(point: Point, n: int) -> Point:
    """The point's model cut to its first `n` layers (its config's per-layer lists with them)."""
    config = hf_config(point.model)
    cut = per_layer_lists(config, int(config.num_hidden_layers))
    hf = {**point.model.hf, **{k: v[:n] for k, v in cut.items()}, "num_hidden_layers": n}
    return point.replace(model=dataclasses.replace(point.model, hf=hf))


def per_layer_lists(config, n: int) -> dict[str, list]:
    """The config's lists of one entry per layer (layer_types, no_rope_layers, ...); not a list of
    every layer's index (Llama 4's moe_layers where each layer has experts: alike, not 0..n-1)."""
    return {k: list(v) for k, v in vars(config).items() if isinstance(v, list | tuple) and len(v) == n
            and not k.startswith("_") and list(v) != list(range(n))}


def signatures(point: Point, lists: Collection[str] | None = None) -> list[tuple] | None:
    """Per layer of the point's model, what it is built of (None where no module list of one entry
    per layer is found); `lists`: the config's per-layer lists to read (default: those of one entry
    per layer here; a shallow model's are the deep one's, cut: GLM-4's three end-of-text tokens
    are no list of layers at depth 3)."""
    import torch

    config = hf_config(point.model)
    n = int(config.num_hidden_layers)
    model = on_meta(config)
    stacks: dict[str, torch.nn.ModuleList] = {}
    for name, m in model.named_modules():  # the outermost lists of one entry per layer (not experts inside one)
        if isinstance(m, torch.nn.ModuleList) and len(m) == n and not any(name.startswith(f"{s}.") for s in stacks):
            stacks[name] = m
    if not stacks:
        return None
    keys = sorted(per_layer_lists(config, n) if lists is None else lists)
    return [(tuple(_built(stack[i]) for stack in stacks.values()),
             tuple((k, repr(getattr(config, k)[i])) for k in keys)) for i in range(n)]


def _built(layer) -> tuple:
    out = []
    for name, m in layer.named_modules():
        tensors = [(k, tuple(t.shape), str(t.dtype)) for k, t in (*m.named_parameters(recurse=False),
                                                                    *m.named_buffers(recurse=False))]
        plain = sorted((k, repr(v)) for k, v in vars(m).items()
                       if isinstance(v, _PLAIN) and not k.startswith("_") and k != "training" and k not in _INDEX)
        out.append((name or "the layer", type(m).__qualname__, tuple(tensors), tuple(plain)))
    return tuple(out)


def repeats(sigs: list[tuple]) -> dict[int, int]:
    """Per period p (up to MAX_PERIOD layers, a third of them): the first layer t from which each
    layer is built as the one p layers after it (`sigs`: signatures')."""
    n = len(sigs)
    out = {}
    for p in range(1, min(MAX_PERIOD, n // 3) + 1):
        t = n - p
        while t > 0 and sigs[t - 1] == sigs[t - 1 + p]:
            t -= 1
        out[p] = t
    return out


def unlike(sigs: list[tuple], t: int, p: int = 1) -> str:
    """What layer t-1 differs in from the layer p after it, in a few words."""
    return f"layers {t - 1} and {t - 1 + p} differ in {difference(sigs[t - 1], sigs[t - 1 + p])}"


def difference(a: tuple, b: tuple) -> str:
    """What two layers' signatures differ in, in a few words."""
    (built_a, lists_a), (built_b, lists_b) = a, b
    for (k, va), (_, vb) in zip(lists_a, lists_b):
        if va != vb:
            return f"{k} ({va}, {vb})"
    for stack_a, stack_b in zip(built_a, built_b):
        for (name, cls, tensors, plain), (name_b, cls_b, tensors_b, plain_b) in zip(stack_a, stack_b):
            if name != name_b:
                return f"their submodules ({name}, {name_b})"
            if cls != cls_b:
                return f"{name} ({cls}, {cls_b})"
            if tensors != tensors_b:
                return f"{name}'s tensors"
            if plain != plain_b:
                return f"{name}.{sorted(set(plain) ^ set(plain_b))[0][0]}"
        if len(stack_a) != len(stack_b):
            return "their submodules"
    return "what they are built of" if (built_a, lists_a) != (built_b, lists_b) else "nothing"
