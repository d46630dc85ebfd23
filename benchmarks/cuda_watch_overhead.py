"""What the cuda probe's readings cost a step: `python benchmarks/cuda_watch_overhead.py [model]`.

The same training steps (the preset's TrainStep, bf16 AdamW, batch 4 x 1,024 tokens) timed twice on the GPU:
with synchronize-and-time hooks only, and with CudaWatch (memory_stats() and a peak reset at each
of the step's phases). Prints median step times and the overhead in percent. Needs a GPU.
"""

import contextlib
import json
import statistics
import sys
import time

import torch
from omegaconf import OmegaConf

from harness.config.compose import CONF_DIR
from harness.config.models import hf_config
from harness.config.point import Leak
from harness.probe.cuda.watch import CudaWatch
from harness.probe.jobs import watching
from harness.probe.presets import TrainStep


class TimingOnly:
    def __init__(self):
        self.times = []

    def begin_step(self, step):
        torch.cuda.synchronize()
        self.t0 = time.perf_counter()

    def set_phase(self, phase):
        pass

    def end_step(self):
        torch.cuda.synchronize()
        self.times.append(time.perf_counter() - self.t0)


def _train(model, optimizer, ids, n_steps: int, watch) -> None:
    step = TrainStep(contextlib.nullcontext, Leak.none)
    with watching(watch):
        for i in range(n_steps):
            watch.begin_step(i)
            step(model, optimizer, ids)
            watch.end_step()


def main(model_name: str = "demo-1b", n_steps: int = 10, rounds: int = 2) -> dict:
    from transformers import AutoModelForCausalLM

    config = hf_config(OmegaConf.to_container(OmegaConf.load(CONF_DIR / "model" / f"{model_name}.yaml")))
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, config.vocab_size, (4, 1024), device="cuda")
    plain, watched = [], []
    for _ in range(rounds):  # alternate, so clocks and caches warm both alike
        t = TimingOnly()
        _train(model, optimizer, ids, n_steps, t)
        plain += t.times[1:]
        w = CudaWatch()
        _train(model, optimizer, ids, n_steps, w)
        watched += [s.time_s for s in w.steps[1:]]
    p, w = statistics.median(plain), statistics.median(watched)
    return {"model": model_name, "device": torch.cuda.get_device_name(0), "steps": len(plain),
            "plain_step_s": p, "watched_step_s": w, "overhead_pct": 100 * (w - p) / p}


if __name__ == "__main__":
    if not torch.cuda.is_available():
        sys.exit("cuda_watch_overhead: needs a GPU")
    print(json.dumps(main(*sys.argv[1:2]), indent=1))
