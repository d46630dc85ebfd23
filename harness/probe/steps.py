"""The work a probe measures: training steps and prefill + decode, the same on every backend.

`hooks` is how a backend watches: begin_step(i), set_phase(name), end_step(). `region` opens an
autocast region for amp_* (CUDA's autocast on a card, its emulation on the virtual GPU). Nothing
here knows whether the tensors are real or fake.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch


def build_optimizer(name: str, params, opt_kwargs: dict, lr: float):
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, **opt_kwargs)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9, **opt_kwargs)
    if name == "adafactor":
        kw = {k: v for k, v in opt_kwargs.items() if k == "foreach"}  # Adafactor has no fused
        return torch.optim.Adafactor(params, lr=lr, **kw)
    raise ValueError(f"unknown optimizer {name}")


def enable_checkpointing(model, recompute_ctx=None) -> None:
    """Activation checkpointing per decoder layer (non-reentrant, as HF recommends)."""
    kwargs: dict[str, Any] = {"use_reentrant": False}
    if recompute_ctx is not None:
        # The recompute runs inside backward, outside our autocast emulation: re-enter it.
        kwargs["context_fn"] = lambda: (contextlib.nullcontext(), recompute_ctx())
    if hasattr(model, "activation_checkpointing_enable"):  # the newer transformers name
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


class _StepState:
    """What a training loop might keep per step, e.g. for logging."""

    self: _StepState
    outputs: Any


def train(model, optimizer, input_ids, steps: int, hooks, region=contextlib.nullcontext,
          leak: str = "none") -> list:
    """forward, backward, optimizer step, zero_grad(set_to_none=True); `steps` times.

    `leak` reproduces the classic mistakes: `graph` keeps the loss of an evaluation forward, with
    its autograd graph and saved activations, across steps (history.append(loss) where
    loss.item() was meant); `cycle` leaves a reference cycle holding the step's outputs, which
    only the cyclic garbage collector frees. Returns what the loop kept (the leak's holder)."""
    model.train()
    history: list = []
    for step in range(steps):
        hooks.begin_step(step)
        hooks.set_phase("forward")
        with region():
            out = model(input_ids=input_ids, labels=input_ids, use_cache=False)
        loss = out.loss
        if leak == "cycle":
            state = _StepState()
            state.self, state.outputs = state, out  # unreachable after this step, but a cycle
            del state
        del out
        hooks.set_phase("backward")
        loss.backward()
        del loss
        hooks.set_phase("optimizer")
        optimizer.step()
        hooks.set_phase("zero_grad")
        optimizer.zero_grad(set_to_none=True)
        if leak == "graph":
            hooks.set_phase("forward")
            with region():
                history.append(model(input_ids=input_ids, labels=input_ids, use_cache=False).loss)
        hooks.end_step()
    return history


def _cache_kwarg(model) -> str:
    """transformers renamed `past_key_values` to `cache`; use whichever this version takes."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def infer(model, input_ids, new_tokens: int, hooks, region=contextlib.nullcontext) -> None:
    """Prefill the prompt into a KV cache, then decode `new_tokens` one at a time (greedy)."""
    from transformers import DynamicCache

    model.eval()
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        ck = _cache_kwarg(model)
        ids = input_ids
        for step in range(new_tokens + 1):  # step 0 is the prefill
            hooks.begin_step(step)
            hooks.set_phase("prefill" if step == 0 else "decode")
            with region():
                out = model(input_ids=ids, **{ck: cache}, use_cache=True, logits_to_keep=1)
            ids = out.logits[:, -1:].argmax(-1)
            del out
            hooks.end_step()
        del cache
