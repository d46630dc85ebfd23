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
