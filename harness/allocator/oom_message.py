"""The OOM message as each PyTorch version words it (CUDACachingAllocator.cpp, malloc)."""

from __future__ import annotations

from harness.allocator.model import OutOfMemory

_OLD_DOCS = "See documentation for Memory Management and PYTORCH_CUDA_ALLOC_CONF"
_URL_22 = "https://pytorch.org/docs/stable/notes/cuda.html#environment-variables"
_URL_28 = "https://docs.pytorch.org/docs/stable/notes/cuda.html#optimizing-memory-usage-with-pytorch-cuda-alloc-conf"


def format_size(n: int) -> str:
    """c10's format_size: bytes up to 1 KiB, then KiB / MiB / GiB with two decimals."""
    if n <= 1024:
        return f"{n} bytes"
    if n <= 1024**2:
        return f"{n / 1024:.2f} KiB"
    if n <= 1024**3:
        return f"{n / 1024**2:.2f} MiB"
    return f"{n / 1024**3:.2f} GiB"


def era(torch_version: str) -> str:
    """'2.0' (and older), '2.1', '2.2' (2.2-2.7) or '2.8' (2.8 and newer)."""
    try:
        major, minor = (int(x) for x in torch_version.split("+")[0].split(".")[:2])
    except ValueError:
        raise ValueError(f"torch_version: '{torch_version}' is not like 2.6")
    if (major, minor) <= (2, 0):
        return "2.0"
    if (major, minor) == (2, 1):
        return "2.1"
    return "2.2" if (major, minor) <= (2, 7) else "2.8"


def exception_name(torch_version: str) -> str:
    e = era(torch_version)
    return "torch.cuda.OutOfMemoryError" if e in ("2.0", "2.1") else "torch.OutOfMemoryError"


def message(oom: OutOfMemory, torch_version: str = "2.8") -> str:
    e = era(torch_version)
    tried, total, free = format_size(oom.tried_bytes), format_size(oom.capacity), format_size(oom.free)
    allocated, reserved = oom.allocated, oom.reserved
    allowed = f"{format_size(oom.allowed)} allowed; " if oom.allowed is not None else ""
    if e == "2.0":
        return (f"CUDA out of memory. Tried to allocate {tried} (GPU {oom.device}; {total} total capacity; "
                f"{format_size(allocated)} already allocated; {free} free; {allowed}"
                f"{format_size(reserved)} reserved in total by PyTorch) If reserved memory is >> allocated "
                f"memory try setting max_split_size_mb to avoid fragmentation.  {_OLD_DOCS}")
    in_use = format_size(max(0, oom.capacity - oom.free))
    capacity_word = "capacty" if e == "2.1" else "capacity"
    head = (f"CUDA out of memory. Tried to allocate {tried}. GPU {oom.device} has a total {capacity_word} of "
            f"{total} of which {free} is free. Including non-PyTorch memory, this process has {in_use} "
            f"memory in use. {allowed}Of the allocated memory {format_size(allocated)} is allocated by "
            f"PyTorch, and {format_size(reserved - allocated)} is reserved by PyTorch but unallocated. ")
    if e == "2.1":
        return head + ("If reserved but unallocated memory is large try setting max_split_size_mb to avoid "
                       f"fragmentation.  {_OLD_DOCS}")
    url = _URL_22 if e == "2.2" else _URL_28
    return head + ("If reserved but unallocated memory is large try setting "
                   "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  "
                   f"See documentation for Memory Management  ({url})")


def for_row(oom: dict, torch_version: str) -> str:
    """The full line (exception name and message) for an OOM row of a replay."""
    e = OutOfMemory(oom["tried_bytes"], oom["requested_bytes"], oom["capacity_bytes"], oom["free_bytes"],
                    oom["allocated_bytes"], oom["reserved_bytes"], oom["allowed_bytes"])
    return f"{exception_name(torch_version)}: {message(e, torch_version)}"
