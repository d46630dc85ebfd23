"""PyTorch's own estimator on the same workload: MemTracker under FakeTensorMode.

Same model, same CUDA emulations (kernels, foreach), same steps; only the bookkeeping differs.
"""

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from harness.config.models import hf_config
from harness.probe import presets
from harness.probe.jobs import knobs, prepare_optimizer
from harness.probe.sim import cuda_emulation as cu


def _inputs(model, point) -> torch.Tensor:
    return torch.randint(0, model.config.vocab_size, (point.batch_size, point.seq_len))


def _train(model, opt, ids, point, tracker) -> int:
    """The point's steps under `tracker` (a MemTracker or FSDPMemTracker): its device peak."""
    with tracker:
        for step in range(point.workload.steps):
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
            del loss
            opt.step()
            opt.zero_grad(set_to_none=True)
            if step < point.workload.steps - 1:
                tracker.reset_mod_stats()  # per-module stats per iteration; the device peak stays
    snap = tracker.get_tracker_snapshot("peak")
    return max(v["Total"] for v in snap.values())


def memtracker_peak(point) -> int:
    from torch.distributed._tools.mem_tracker import MemTracker
    from transformers import AutoModelForCausalLM

    with FakeTensorMode(), cu.unpacked_sequences(), cu.cuda_kernels():
        model = AutoModelForCausalLM.from_config(hf_config(point.model), dtype=knobs(point).dtype)
        model.train()
        opt = presets.build_optimizer(point.optimizer.name, model.parameters(), {}, 1e-4)
        prepare_optimizer(opt, point.optimizer.impl, virtual=True)
        ids = _inputs(model, point)
        mt = MemTracker()
        mt.track_external(model, opt)
        return _train(model, opt, ids, point, mt)


def fsdp_memtracker_peak(point) -> int:
    """FSDPMemTracker on rank 0 of the fake process group the harness joins (sharded.process_group):
    the model built on the meta device, sharded as the harness shards it, made on the mesh's device."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from transformers import AutoModelForCausalLM

    from harness.probe.parallelize import parallelize
    from harness.probe.sim import sharded

    with sharded.process_group(point.parallel) as mesh, FakeTensorMode(), cu.unpacked_sequences(), \
            cu.cuda_kernels():
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_config(point.model), dtype=knobs(point).dtype)
        model.train()
        model = parallelize(model, mesh, point.parallel)
        opt = presets.build_optimizer(point.optimizer.name, model.parameters(), {}, 1e-4)
        ids = _inputs(model, point)
        fmt = FSDPMemTracker(model, opt)
        fmt.track_inputs((ids,))
        return _train(model, opt, ids, point, fmt)
