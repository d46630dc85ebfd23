"""PyTorch's own estimator on the same workload: MemTracker under FakeTensorMode.

Same model, same CUDA emulations (kernels, foreach), same steps; only the bookkeeping differs.
"""

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from harness.config.models import hf_config
from harness.probe import presets
from harness.probe.jobs import knobs, prepare_optimizer
from harness.probe.sim import cuda_emulation as cu


def memtracker_peak(point) -> int:
    from torch.distributed._tools.mem_tracker import MemTracker
    from transformers import AutoModelForCausalLM

    param_dtype = knobs(point).dtype
    with FakeTensorMode(), cu.unpacked_sequences(), cu.cuda_kernels():
        model = AutoModelForCausalLM.from_config(hf_config(point.model), dtype=param_dtype)
        model.train()
        opt = presets.build_optimizer(point.optimizer.name, model.parameters(), {}, 1e-4)
        prepare_optimizer(opt, point.optimizer.impl, virtual=True)
        ids = torch.randint(0, model.config.vocab_size, (point.batch_size, point.seq_len))
        mt = MemTracker()
        mt.track_external(model, opt)
        with mt:
            for step in range(point.workload.steps):
                loss = model(input_ids=ids, labels=ids, use_cache=False).loss
                loss.backward()
                del loss
                opt.step()
                opt.zero_grad(set_to_none=True)
                if step < point.workload.steps - 1:
                    mt.reset_mod_stats()  # per-module stats per iteration; the device peak stays
        snap = mt.get_tracker_snapshot("peak")
        return max(v["Total"] for v in snap.values())


def fsdp_memtracker_peak(point) -> int:
    """FSDPMemTracker on rank 0 of a fake process group of the point's world size: the model
    built on the meta device, sharded as the harness shards it, made on the mesh's device."""
    import torch.distributed as dist
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from transformers import AutoModelForCausalLM

    from harness.probe.sim import sharded

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=point.parallel.world_size)
    try:
        mesh = init_device_mesh("cpu", (point.parallel.dp_shard,))
        with FakeTensorMode(), cu.unpacked_sequences(), cu.cuda_kernels():
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(hf_config(point.model), dtype=knobs(point).dtype)
            model.train()
            sharded.shard(model, mesh, point.parallel)
            model.to_empty(device="cpu")
            opt = presets.build_optimizer(point.optimizer.name, model.parameters(), {}, 1e-4)
            ids = torch.randint(0, model.config.vocab_size, (point.batch_size, point.seq_len))
            fmt = FSDPMemTracker(model, opt)
            fmt.track_inputs((ids,))
            with fmt:
                for step in range(point.workload.steps):
                    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
                    loss.backward()
                    del loss
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    if step < point.workload.steps - 1:
                        fmt.reset_mod_stats()
            snap = fmt.get_tracker_snapshot("peak")
            return max(v["Total"] for v in snap.values())
    finally:
        dist.destroy_process_group()
