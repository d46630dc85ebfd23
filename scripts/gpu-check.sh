#!/usr/bin/env bash
# The whole cuda path on one GPU, in a few minutes: tests/test_cuda.py (a small model trained, an OOM
# provoked under an emulated small card, a snapshot replayed, calibrate on two points, a user's job)
# and the measurement overhead on step time. Figures for the notes are the [gpu-check] lines.
#   scripts/gpu-check.sh            (from the repository root, in the environment the README installs)
set -euo pipefail
cd "$(dirname "$0")/.."
python - <<'PY'
import sys, torch
if not torch.cuda.is_available():
    sys.exit("gpu-check: no CUDA GPU visible (torch %s)" % torch.__version__)
print("gpu-check: %s, torch %s, CUDA %s" % (torch.cuda.get_device_name(0), torch.__version__, torch.version.cuda))
PY
python -m pytest -m gpu tests/test_cuda.py -v -s -p no:cacheprovider 2>&1 | tee "${GPU_CHECK_LOG:-gpu-check.log}"
python benchmarks/cuda_watch_overhead.py | tee -a "${GPU_CHECK_LOG:-gpu-check.log}"
