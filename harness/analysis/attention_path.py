"""Why a run's attention takes the math path on its card, where it does.

The math path holds each call's B x H x S_q x S_k scores (and their softmax), which no fused kernel
ever makes: an activation peak that is the code's or the dtype's, not the card's size. A reading
names the fewest changes that get the call a fused kernel on the same card (config.attention
decides, as sdp_utils.cpp does): its key/value heads expanded to every query head, the fused
kernels enabled, a 16-bit dtype, a head dim the kernels take. Data only; report/words.py words it.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

from harness.config import attention
from harness.config import cards as catalog


@dataclass(frozen=True)
class Lift:
    """Changes that together get an attention call a fused kernel on its card."""
    why: tuple[str, ...]  # of grouped_heads, disabled, precision, head_dim
    fused: str  # the kernel the call then takes
    dtype: str | None = None  # with `precision`: the 16-bit dtype


@dataclass(frozen=True)
class MathPath:
    """An attention call a run makes that takes the math path on its card."""
    call: attention.Call
    lifts: tuple[Lift, ...]  # the single changes that lift it, else the first pair; () where none does
    newer_torch: bool = False  # grouped heads torch 2.14's memory-efficient kernel would take as they are


def _changes(call: attention.Call) -> list[tuple[str, dict]]:
    """The single changes that may lift a call off the math path: (reason, Call fields)."""
    out: list[tuple[str, dict]] = [("grouped_heads", {"grouped": False}), ("disabled", {"enabled": (True,) * 4})]
    out += [("precision", {"dtype": d}) for d in ("bfloat16", "float16") if d != call.dtype]
    out.append(("head_dim", {"head_dim": -(-call.head_dim // 8) * 8, "value_dim": -(-call.value_dim // 8) * 8}))
    return [(why, fields) for why, fields in out if dataclasses.replace(call, **fields) != call]


def _lifted(cap, call: attention.Call) -> MathPath:
    changes = _changes(call)
    lifts: list[Lift] = []
    for n in (1, 2):
        for combo in itertools.combinations(changes, n):
            whys = tuple(why for why, _ in combo)
            if len(set(whys)) < n:  # (two dtypes at once)
                continue
            changed = dataclasses.replace(call, **{k: v for _, fields in combo for k, v in fields.items()})
            kernel = attention.kernel(cap, changed)
            if kernel not in (None, attention.MATH):
                lifts.append(Lift(whys, kernel, changed.dtype if "precision" in whys else None))
        if lifts:
            break
    if lifts and len(lifts[0].why) > 1:  # (no single change does: the first pair that does)
        lifts = lifts[:1]
    newer = (call.grouped and call.enable_gqa and not attention.efficient_takes_grouped() and not attention.rocm(cap)
             and any(lift.why == ("grouped_heads",) and lift.fused == attention.EFFICIENT for lift in lifts))
    return MathPath(call, tuple(lifts), newer)


def math_paths(row) -> list[MathPath]:
    """The calls of a row (its attention_calls) that took the math path on its card, and why; none
    for a card outside the catalog (its capability is not known here)."""
    taken = [c for c, kernel in attention.taken(row.get(attention.ATTENTION_CALLS)) if kernel == attention.MATH]
    card = next((c for c in catalog.cards() if c.name == row.get("gpu")), None)
    if not taken or card is None:
        return []
    return [_lifted(card.capability, c) for c in taken]
