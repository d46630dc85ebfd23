#!/usr/bin/env bash
# The harness's pure-Python dependencies that a PyTorch image usually lacks (Hydra, OmegaConf and its
# ANTLR runtime, submitit and its Hydra launcher), copied from this environment into DIR, for a
# machine whose torch, transformers, pandas and pyarrow are its own (a lent GPU machine, a cluster
# module): there, from the repository root,
#   PYTHONPATH=$PWD/DIR:$PWD scripts/gpu-check.sh
#   scripts/pure-deps.sh DIR        (here, in the environment the README installs)
set -euo pipefail
dest=${1:?usage: scripts/pure-deps.sh DIR}
mkdir -p "$dest/hydra_plugins"
site=$(python -c "import sysconfig; print(sysconfig.get_path('purelib'))")
for pkg in hydra omegaconf antlr4 submitit; do
    cp -r "$site/$pkg" "$dest/"
done
cp -r "$site/hydra_plugins/hydra_submitit_launcher" "$dest/hydra_plugins/"
find "$dest" -name __pycache__ -prune -exec rm -rf {} +
du -sh "$dest"
