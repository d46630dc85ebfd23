#!/usr/bin/env bash
# The whole cuda path on one GPU, in a few minutes: tests/test_cuda.py (a small model trained, an OOM
# provoked under an emulated small card, a snapshot replayed, calibrate on two points, a user's job),
# calibrate on a 1B model (this card, where the catalog knows it, and an A100 emulated on it) and the
# measurement overhead on step time. Figures for the notes are the [gpu-check] lines and the
# calibration table; everything goes to $GPU_CHECK_LOG (gpu-check.log).
#   scripts/gpu-check.sh            (from the repository root, in the environment the README installs;
#                                    on a machine whose torch is its own: scripts/pure-deps.sh first)
set -euo pipefail
cd "$(dirname "$0")/.."
LOG=${GPU_CHECK_LOG:-gpu-check.log}
native=$(python - <<'PY'
import sys, torch
if not torch.cuda.is_available():
    sys.exit("gpu-check: no CUDA GPU visible (torch %s)" % torch.__version__)
from harness.config import cards
name = torch.cuda.get_device_name(0)
print("gpu-check: %s, torch %s, CUDA %s, cuDNN %s" % (name, torch.__version__, torch.version.cuda,
      torch.backends.cudnn.version()), file=sys.stderr)
print(next((c.key for c in cards.cards() if c.device_name == name), ""))
PY
)
# -rA: each test's output in the summary (xdist's workers swallow -s)
python -m pytest -m gpu tests/test_cuda.py -v -rA -p no:cacheprovider 2>&1 | tee "$LOG" || true
python -m harness calibrate model=demo-1b "gpu=${native:+$native,}a100-80gb" batch_size=2 seq_len=1024 precision=bf16 \
    checkpointing=false,true workload.steps=3 "results_dir=${GPU_CHECK_RESULTS:-results/gpu-check}" 2>&1 | tee -a "$LOG"
python benchmarks/cuda_watch_overhead.py | tee -a "$LOG"
