"""Blocks freed on a side stream are not reused by the default stream, only by their own stream
(the caching allocator keys its free lists by stream): run on a real GPU and on the virtual one
(`python -m harness script tests/scripts/side_stream.py`), the readings are the same."""

import torch

MiB = 2**20


def reading(label: str) -> None:
    print(label, "allocated", torch.cuda.memory_allocated(), "max_allocated", torch.cuda.max_memory_allocated(),
          "reserved", torch.cuda.memory_reserved())


side = torch.cuda.Stream()
with torch.cuda.stream(side):
    a = torch.empty(100 * MiB, dtype=torch.uint8, device="cuda")
del a  # back to the side stream's pool
reading("side freed")
b = torch.empty(100 * MiB, dtype=torch.uint8, device="cuda")  # a segment of its own
reading("default")
del b
with torch.cuda.stream(side):
    c = torch.empty(100 * MiB, dtype=torch.uint8, device="cuda")  # the side stream's free block
reading("side again")
print("current is default", torch.cuda.current_stream() == torch.cuda.default_stream())
