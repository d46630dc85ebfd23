"""PYTORCH_ALLOC_CONF strings: parsed and checked as torch 2.13's allocator config parses them
(c10/core/AllocatorConfig.cpp's common keys, then c10/cuda/CUDAAllocatorConfig.cpp's), and the
settings the allocator model cannot replay refused before any work (`modelled`)."""

from __future__ import annotations

from harness.errors import ConfigError

_KEY = "allocator.conf"
_BOOL = {"True": True, "False": False}  # ConfigTokenizer::toBool: exactly these, "true" is an error
_DEFAULT_LARGE_SEGMENT_MB = 20  # kLargeBuffer: the floor of max_split_size_mb and max_non_split_rounding_mb
_MIN_LARGE_SEGMENT_MB = 10  # kMinLargeAlloc: large_segment_size_mb must be above it
_MAX_REGISTER_THREADS = 128  # CUDAAllocatorConfig::pinned_max_register_threads

# Keys and how each value is read. Common: AcceleratorAllocatorConfig (every device). CUDA: what
# CUDAAllocatorConfig adds in torch 2.13; any other key is "Unrecognized key" there.
_BOOLS = {"expandable_segments", "pinned_use_background_threads", "release_lock_on_cudamalloc",
          "release_lock_on_hipmalloc", "pinned_use_cuda_host_register", "pinned_use_hip_host_register",
          "graph_capture_record_stream_reuse", "pinned_free_catch_all", "throw_on_cudamalloc_oom"}
_SIZES = {"large_segment_size_mb", "max_split_size_mb", "max_non_split_rounding_mb", "pinned_max_round_threshold_mb",
          "pinned_max_cached_size_mb", "pinned_num_register_threads", "pinned_reserve_segment_size_mb"}
_FRACTIONS = {"garbage_collection_threshold", "per_process_memory_fraction"}
_OTHERS = {"roundup_power2_divisions", "backend"}


def _power_of_two(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


def _tokens(conf: str) -> list[str]:
    """ConfigTokenizer's tokens: `,` `:` `[` `]` each one, the text between them; whitespace dropped."""
    out, word = [], ""
    for ch in conf:
        if ch in ",:[]":
            if word:
                out.append(word)
                word = ""
            out.append(ch)
        elif not ch.isspace():
            word += ch
    return out + [word] if word else out


_Item = tuple[str, "str | list[tuple[str, str]]"]


def _items(conf: str) -> list[_Item]:
    """(key, value) in order, a list value as its (key, value) pairs: `key:value,key2:[k:v,...]`."""
    toks, i = _tokens(conf), 0
    items: list[_Item] = []
    while i < len(toks):
        key = toks[i]
        if key in ",:[]" or i + 2 >= len(toks) or toks[i + 1] != ":" or toks[i + 2] in ",:]":
            raise ConfigError(_KEY, f"expected key:value at '{''.join(toks[i:i + 3])}' (in '{conf}')")
        if toks[i + 2] != "[":
            items.append((key, toks[i + 2]))
            i += 3
        else:
            try:
                close = toks.index("]", i + 3)
            except ValueError:
                raise ConfigError(_KEY, f"unbalanced brackets in '{conf}'") from None
            pairs = [p for p in "".join(toks[i + 3:close]).split(",") if p]
            items.append((key, [(k, v) for k, _, v in (p.partition(":") for p in pairs)]))
            i = close + 1
        if i < len(toks):
            if toks[i] != ",":
                raise ConfigError(_KEY, f"expected ',' before '{toks[i]}' (in '{conf}')")
            i += 1
    return items


def parse(conf: str) -> dict:
    """`key:value,key2:[k:v,...]` -> dict of typed values; raises ConfigError on what torch 2.13
    would reject (tests/test_alloc_conf.py holds it to torch's own parser)."""
    items = _items(conf)
    out: dict = {}
    # large_segment_size_mb is read first: it is the floor of the two sizes below, wherever it stands
    for key, value in items:
        if key == "large_segment_size_mb":
            out[key] = _size(key, value)
            if out[key] <= _MIN_LARGE_SEGMENT_MB:
                raise ConfigError(_KEY, f"{key} must be > {_MIN_LARGE_SEGMENT_MB} (MiB), got {out[key]}")
    floor = out.get("large_segment_size_mb", _DEFAULT_LARGE_SEGMENT_MB)
    for key, value in items:
        if key != "large_segment_size_mb":
            out[key] = _value(key, value, floor)
    return out


def _value(key: str, value, floor: int):
    if key not in _BOOLS | _SIZES | _FRACTIONS | _OTHERS:
        raise ConfigError(_KEY, f"unrecognized key '{key}' (torch 2.13's CUDA allocator config rejects it)")
    if key == "roundup_power2_divisions":
        return _divisions(key, value)
    if isinstance(value, list):
        raise ConfigError(_KEY, f"{key} takes one value, not a list")
    if key in _BOOLS:
        if value not in _BOOL:
            raise ConfigError(_KEY, f"{key} takes True or False (capitalised), not '{value}'")
        return _BOOL[value]
    if key == "backend":
        if value not in ("native", "cudaMallocAsync"):
            raise ConfigError(_KEY, f"backend must be native or cudaMallocAsync, not '{value}'")
        return value
    if key in _FRACTIONS:
        return _fraction(key, value)
    n = _size(key, value)
    if key in ("max_split_size_mb", "max_non_split_rounding_mb") and n < floor:
        raise ConfigError(_KEY, f"{key} must be >= {floor} (MiB: large_segment_size_mb), got {n}")
    if key == "pinned_num_register_threads" and not (_power_of_two(n) and n <= _MAX_REGISTER_THREADS):
        raise ConfigError(_KEY, f"{key} must be a power of two up to {_MAX_REGISTER_THREADS}, got {n}")
    if key == "pinned_reserve_segment_size_mb" and n == 0:
        raise ConfigError(_KEY, f"{key} must be > 0")
    return n


def _fraction(key: str, value: str) -> float:
    try:
        v = float(value)
    except ValueError:
        raise ConfigError(_KEY, f"{key} takes a number, not '{value}'") from None
    if key == "garbage_collection_threshold" and not 0.0 < v < 1.0:
        raise ConfigError(_KEY, f"{key} must be in (0, 1), got {v}")
    if key == "per_process_memory_fraction" and not 0.0 <= v <= 1.0:
        raise ConfigError(_KEY, f"{key} must be in [0, 1], got {v}")
    return v


def _divisions(key: str, value) -> int | dict[str, int]:
    """One power of two for every interval, or `[MiB:divisions,...,>:divisions]`: each interval a
    power of two, each count a power of two or 0 (no rounding there)."""
    if not isinstance(value, list):
        d = _size(key, value)
        if not _power_of_two(d):
            raise ConfigError(_KEY, f"{key} must be a power of two, got {d}")
        return d
    table = {}
    for interval, n in value:
        d = _size(key, n)
        if interval != ">" and not _power_of_two(_size(key, interval)):
            raise ConfigError(_KEY, f"{key}'s intervals must be powers of two (MiB), got {interval}")
        if d and not _power_of_two(d):
            raise ConfigError(_KEY, f"{key}'s divisions must be powers of two or 0, got {d}")
        table[interval] = d
    return table


def _size(key: str, value) -> int:
    if not isinstance(value, str) or not value.isdigit():
        raise ConfigError(_KEY, f"{key} takes a whole number, not '{value}'")
    return int(value)


def modelled(conf: str) -> dict:
    """`parse`, and a ConfigError for a setting the allocator model cannot replay (refused before
    any work rather than answered as the native allocator without it)."""
    return refuse_unmodelled(parse(conf))


def refuse_unmodelled(parsed: dict) -> dict:
    """`parsed` (parse's), or a ConfigError for a setting the allocator model cannot replay."""
    if parsed.get("backend") == "cudaMallocAsync":
        raise ConfigError(_KEY, "backend:cudaMallocAsync hands memory to the CUDA driver's stream-ordered pool, "
                                "which is not modelled (the harness replays backend:native): drop it")
    if parsed.get("throw_on_cudamalloc_oom"):
        raise ConfigError(_KEY, "throw_on_cudamalloc_oom:True (an OOM raised before cudaMalloc, without the "
                                "release-and-retry) is not modelled: drop it")
    if "per_process_memory_fraction" in parsed:
        raise ConfigError(_KEY, "per_process_memory_fraction is not modelled in a point (each card's room is the "
                                "whole card's): pick the card with gpu=, or replay a snapshot under a fraction "
                                "(`replay <snapshot> gpu=... fraction=...`)")
    return parsed


# The variables torch reads its settings from, in its order: the first set wins (AllocatorConfig.cpp
# and CUDAAllocatorConfig.h keep the old name first, for compatibility; checked on torch 2.13)
ENV_NAMES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def from_environment(environ) -> tuple[str, str] | None:
    """(variable, its string) that a process started with `environ` runs its allocator under, or
    None where neither is set."""
    return next(((name, environ[name]) for name in ENV_NAMES if name in environ), None)


def text(parsed: dict) -> str:
    """parse's dict as a PYTORCH_ALLOC_CONF string again."""
    def value(v) -> str:
        if isinstance(v, dict):
            return "[" + ",".join(f"{k}:{n}" for k, n in v.items()) + "]"
        return str(v)  # True/False as torch spells them, numbers as written
    return ",".join(f"{k}:{value(v)}" for k, v in parsed.items())


def persisting(before: dict, after: dict) -> dict:
    """What a runtime `_set_allocator_settings(after)` leaves in force over `before` (parsed): torch
    resets max_split_size_mb, roundup_power2_divisions and garbage_collection_threshold to their
    defaults unless given, keeps every other key as it was, and sets max_non_split_rounding_mb to
    the large segment size unless given."""
    kept = {k: v for k, v in before.items()
            if k not in ("max_split_size_mb", "roundup_power2_divisions", "garbage_collection_threshold",
                         "max_non_split_rounding_mb")}
    return {**kept, **after}


def env_name(torch_version: str | None, conf: str = "") -> str:
    """The environment variable that sets `conf` on this torch: PYTORCH_ALLOC_CONF from 2.8 on
    (AllocatorConfig.cpp), PYTORCH_CUDA_ALLOC_CONF before it. 2.9.1 ignored the new name for
    expandable_segments on CUDA (pytorch/pytorch#183387), so 2.9 gets the old name for it."""
    try:
        major, minor = (int(x) for x in (torch_version or "").split("+")[0].split(".")[:2])
    except ValueError:
        return "PYTORCH_ALLOC_CONF"  # unknown: the current name
    if (major, minor) < (2, 8) or ((major, minor) == (2, 9) and "expandable_segments" in conf):
        return "PYTORCH_CUDA_ALLOC_CONF"
    return "PYTORCH_ALLOC_CONF"


def env_name_in_message(text: str) -> str | None:
    """The name a pasted OOM message itself uses (its torch honours it), or None."""
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        if name in text:
            return name
    return None
