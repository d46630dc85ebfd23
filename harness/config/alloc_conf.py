"""PYTORCH_ALLOC_CONF strings: parsed and checked as PyTorch's AllocatorConfig would."""

from __future__ import annotations

from harness.errors import ConfigError

_KEY = "allocator.conf"
_BOOL = {"true": True, "false": False}


def _power_of_two(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


def parse(conf: str) -> dict:
    """`key:value,key2:[k:v,...]` -> dict; raises ConfigError on what PyTorch would reject."""
    out: dict = {}
    text = conf.strip()
    if not text:
        return out
    items, depth, cur = [], 0, ""
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if ch == "," and depth == 0:
            items.append(cur)
            cur = ""
        else:
            cur += ch
    items.append(cur)
    if depth != 0:
        raise ConfigError(_KEY, f"unbalanced brackets in '{conf}'")
    for item in items:
        key, sep, value = item.partition(":")
        key, value = key.strip(), value.strip()
        if not sep or not key or not value:
            raise ConfigError(_KEY, f"'{item}' is not key:value (in '{conf}')")
        out[key] = _value(key, value)
    return out


def _value(key: str, value: str):
    if key in ("expandable_segments", "release_lock_on_cudamalloc"):
        if value.lower() not in _BOOL:
            raise ConfigError(_KEY, f"{key} takes True or False, not '{value}'")
        return _BOOL[value.lower()]
    if key in ("max_split_size_mb", "max_non_split_rounding_mb"):
        mb = _int(key, value)
        if mb < 20:  # kLargeBuffer / 1 MiB
            raise ConfigError(_KEY, f"{key} must be >= 20 (MiB), got {mb}")
        return mb
    if key == "garbage_collection_threshold":
        try:
            v = float(value)
        except ValueError:
            raise ConfigError(_KEY, f"{key} takes a number in (0, 1), not '{value}'")
        if not 0.0 < v < 1.0:
            raise ConfigError(_KEY, f"{key} must be in (0, 1), got {v}")
        return v
    if key == "roundup_power2_divisions":
        if value.startswith("["):
            table = {}
            for part in value.strip("[]").split(","):
                k, _, n = part.partition(":")
                d = _int(key, n.strip())
                if not _power_of_two(d):
                    raise ConfigError(_KEY, f"{key} divisions must be powers of two, got {d}")
                table[k.strip()] = d
            return table
        d = _int(key, value)
        if not _power_of_two(d):
            raise ConfigError(_KEY, f"{key} must be a power of two, got {d}")
        return d
    if key == "backend":
        if value not in ("native", "cudaMallocAsync"):
            raise ConfigError(_KEY, f"backend must be native or cudaMallocAsync, not '{value}'")
        return value
    if key in ("pinned_use_cuda_host_register", "pinned_use_background_threads"):
        return _BOOL.get(value.lower(), value)
    if key in ("pinned_num_register_threads", "pinned_reserve_segment_size_mb"):
        return _int(key, value)
    raise ConfigError(_KEY, f"unrecognized key '{key}' (PyTorch rejects it)")


def _int(key: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ConfigError(_KEY, f"{key} takes an integer, not '{value}'")


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
