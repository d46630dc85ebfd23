"""One rank of a job run as its ranks (launch.ranks): the job's process group joined from torchrun's
environment, NCCL between GPUs (backend=cuda) or gloo between CPU processes (backend=cpu). A cuda
rank sees one device, its own: cuda:0."""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Iterator

from harness.config.point import Backend, Point

_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def runs_as_ranks(point: Point) -> bool:
    """Whether the point is one of its ranks here: a job over several GPUs run for real."""
    return point.backend in (Backend.cuda, Backend.cpu) and point.parallel.world_size > 1


def this_rank() -> int:
    return int(os.environ.get("RANK", "0"))


@contextlib.contextmanager
def joined(point: Point) -> Iterator[None]:
    """Inside: this process is its rank of the job's process group (left on the way out)."""
    import torch
    import torch.distributed as dist

    world = point.parallel.world_size
    missing = [k for k in _ENV if k not in os.environ]
    if missing:
        raise RuntimeError(f"a point over {world} GPUs runs as its ranks (harness.launch.ranks), each with "
                           f"torchrun's environment: {', '.join(missing)} not set")
    if int(os.environ["WORLD_SIZE"]) != world:
        raise RuntimeError(f"WORLD_SIZE={os.environ['WORLD_SIZE']}, and the point's job has {world} ranks")
    # A peer that failed leaves this rank waiting in a collective: the point's timeout ends the wait
    timeout = datetime.timedelta(seconds=point.timeout_s)
    if point.backend == Backend.cuda:
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", timeout=timeout, device_id=torch.device("cuda", 0))
    else:
        dist.init_process_group("gloo", timeout=timeout)
    try:
        yield
    finally:
        dist.destroy_process_group()
