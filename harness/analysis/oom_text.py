"""A pasted CUDA OOM message: every number parsed into bytes, and the verdict it supports.

Wordings: PyTorch 1.x-2.0 ("(GPU 0; X total capacity; ...)"), 2.1 ("total capacty"), 2.2-2.7 and 2.8+
(shared/data/oom-messages.txt). Sizes print with two decimals, so each is known to +-0.005 of its unit.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any

from harness.config import alloc_conf
from harness.units import MiB

_UNITS = {"bytes": 1, "KiB": 1024, "MiB": 1024**2, "GiB": 1024**3, "TiB": 1024**4}
_SIZE = r"([\d.]+ (?:bytes|KiB|MiB|GiB|TiB))"

_TRIED = re.compile(rf"Tried to allocate {_SIZE}")
_OLD = re.compile(rf"\(GPU (\d+); {_SIZE} total capacity; {_SIZE} already allocated; {_SIZE} free; "
                  rf"(?:{_SIZE} allowed; )?{_SIZE} (?:reserved in total by PyTorch|cached)\)")
_NEW = re.compile(rf"GPU (\d+) has a total capac(?:i)?ty of {_SIZE} of which {_SIZE} is free")
_THIS = re.compile(rf"this process has {_SIZE} memory in use")
_OTHER = re.compile(rf"Process (\d+) has {_SIZE} memory in use")
_ALLOWED = re.compile(rf"{_SIZE} allowed;")
_OF = re.compile(rf"Of the allocated memory {_SIZE} is allocated by PyTorch, (?:with {_SIZE} allocated in "
                 rf"private pools \(e\.g\., CUDA Graphs\), )?and {_SIZE} is reserved by PyTorch but unallocated")


def to_bytes(text: str) -> int:
    number, unit = text.split()
    return round(float(number) * _UNITS[unit])


@dataclass
class OomReading:
    verdict: str = "unknown"  # fragmentation | capacity | other_process | unknown
    tried_bytes: int | None = None  # what the allocator asked the device for (a segment), not the tensor
    capacity_bytes: int | None = None
    free_bytes: int | None = None
    allocated_bytes: int | None = None
    reserved_unallocated_bytes: int | None = None
    process_bytes: int | None = None  # this process, non-PyTorch memory included (2.1+ wordings)
    non_pytorch_bytes: int | None = None
    other_processes_bytes: int = 0
    # capacity - free - this process - the processes listed: held outside this process by something the
    # message does not name (another container's process, MIG/MPS, the driver). Not headroom.
    unlisted_bytes: int = 0
    allowed_bytes: int | None = None  # set_per_process_memory_fraction
    private_pools_bytes: int | None = None
    headroom_bytes: int | None = None  # left for PyTorch once fragmentation is cured (can be < 0)
    margin_bytes: int | None = None
    wording: str = ""
    alloc_conf_env: str = "PYTORCH_ALLOC_CONF"  # the name to advise: the message's own where it names one
    for_pytorch_bytes: int | None = None  # what the card can give PyTorch here
    limit_bytes: int | None = None  # that, less other processes, capped by a per-process fraction
    need_bytes: int | None = None  # allocated + the request
    # The rules that decided, in order (report/words.oom_reasoning words them): container_pid,
    # no_figures, request_exceeds_card, fits_defragmented, other_processes, held_outside, no_real_headroom,
    # does_not_fit, fraction_is_the_limit.
    rules: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


def parse(text: str) -> OomReading:
    """Every number the message carries, in bytes; raises ValueError if it is not an OOM message."""
    r = OomReading()
    m = _TRIED.search(text)
    if not m:
        raise ValueError("no 'Tried to allocate' in the input: not a CUDA out-of-memory message")
    r.tried_bytes = to_bytes(m.group(1))
    r.alloc_conf_env = alloc_conf.env_name_in_message(text) or "PYTORCH_ALLOC_CONF"
    old = _OLD.search(text)
    if old:
        r.wording = "1.x-2.0"
        r.capacity_bytes, r.allocated_bytes, r.free_bytes = (to_bytes(old.group(i)) for i in (2, 3, 4))
        if old.group(5):
            r.allowed_bytes = to_bytes(old.group(5))
        r.reserved_unallocated_bytes = max(0, to_bytes(old.group(6)) - r.allocated_bytes)
        return r
    new = _NEW.search(text)
    if not new:
        return r
    r.wording = "2.1" if "capacty" in text else "2.2+"
    r.capacity_bytes, r.free_bytes = to_bytes(new.group(2)), to_bytes(new.group(3))
    this = _THIS.search(text)
    others = [(pid, to_bytes(size)) for pid, size in _OTHER.findall(text)]
    of = _OF.search(text)
    if of:
        r.allocated_bytes = to_bytes(of.group(1))
        r.private_pools_bytes = to_bytes(of.group(2)) if of.group(2) else None
        r.reserved_unallocated_bytes = to_bytes(of.group(3))
    if this:
        r.process_bytes = to_bytes(this.group(1))
    elif len(others) == 1 and r.allocated_bytes is not None and others[0][1] >= r.allocated_bytes:
        # In a container PyTorch cannot name its own pid and reports itself as "Process N".
        r.process_bytes = others.pop()[1]
        r.rules.append("container_pid")
    r.other_processes_bytes = sum(size for _pid, size in others)
    allowed = _ALLOWED.search(text)
    if allowed:
        r.allowed_bytes = to_bytes(allowed.group(1))
    return r


def judge(r: OomReading) -> OomReading:
    """The verdict, with the numbers behind it and the rules that decided (`rules`)."""
    if r.capacity_bytes is None or r.allocated_bytes is None:
        r.rules.append("no_figures")
        return r
    reserved = r.allocated_bytes + (r.reserved_unallocated_bytes or 0)
    if r.process_bytes is not None:
        r.non_pytorch_bytes = max(0, r.process_bytes - reserved)
        # Sizes are rounded to 0.005 of their unit; a few MiB unaccounted is rounding, not a holder.
        unlisted = r.capacity_bytes - r.free_bytes - r.process_bytes - r.other_processes_bytes
        r.unlisted_bytes = unlisted if unlisted > 64 * MiB else 0
    else:  # older wordings: whatever the device uses beyond this reserve and the free memory
        r.non_pytorch_bytes = max(0, r.capacity_bytes - r.free_bytes - reserved - r.other_processes_bytes)
    for_pytorch = r.capacity_bytes - r.non_pytorch_bytes  # what the card can give PyTorch here
    # What this process could have: the card less everything held outside it. This is free + reserved
    # (to rounding): fragmentation needs reserved-but-unallocated memory that, with the free memory,
    # could serve the request.
    limit = for_pytorch - r.other_processes_bytes - r.unlisted_bytes
    if r.allowed_bytes is not None:
        limit = min(limit, r.allowed_bytes)
    # "Real headroom": enough for the next allocations of a job this size, not a few MiB.
    r.margin_bytes = max(512 * MiB, r.capacity_bytes // 50)
    need = r.allocated_bytes + r.tried_bytes
    r.headroom_bytes = limit - need
    r.for_pytorch_bytes, r.limit_bytes, r.need_bytes = for_pytorch, limit, need
    if r.tried_bytes > for_pytorch:
        r.verdict = "capacity"
        r.rules.append("request_exceeds_card")
    elif need + r.margin_bytes <= limit:
        r.verdict = "fragmentation"
        r.rules.append("fits_defragmented")
    elif (r.other_processes_bytes or r.unlisted_bytes) and need + r.margin_bytes <= for_pytorch:
        r.verdict = "other_process"
        r.rules.append("other_processes" if r.other_processes_bytes else "held_outside")
    else:
        r.verdict = "capacity"
        r.rules.append("no_real_headroom" if r.headroom_bytes >= 0 else "does_not_fit")
        if r.allowed_bytes is not None and r.allowed_bytes < for_pytorch - r.other_processes_bytes - r.unlisted_bytes:
            r.rules.append("fraction_is_the_limit")
    return r


def diagnose(text: str) -> OomReading:
    return judge(parse(text))


def oom_columns(message: str) -> dict:
    """The record's oom_* columns from an OutOfMemoryError's text (every wording PyTorch has used)."""
    out: dict[str, Any] = {"oom_message": message}
    try:
        r = judge(parse(message))
    except ValueError:  # not the caching allocator's wording (e.g. cuBLAS failing to get its workspace)
        return out
    out.update(oom_tried_bytes=r.tried_bytes, oom_capacity_bytes=r.capacity_bytes, oom_free_bytes=r.free_bytes,
               oom_allocated_bytes=r.allocated_bytes, oom_allowed_bytes=r.allowed_bytes,
               oom_reserved_bytes=None if r.allocated_bytes is None
               else r.allocated_bytes + (r.reserved_unallocated_bytes or 0),
               oom_verdict=r.verdict)
    return out
