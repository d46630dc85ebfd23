"""Random combinations of the documented knobs, each run as a user runs it:
`python scripts/knob_combos.py [N] [SEED] [--presets | --custom | --architectures] [backend=cpu ...]`.

Each combination is one `python -m harness run model=tiny ...` (two at a time); with `--presets`,
on the 7B-70B presets instead (deeper than tiny's two layers: their traces are synthesized from a
few, and DDP's shallow journals are shared between counts), with up to 64 GPUs; with `--custom`,
the examples as jobs of the user's own (workload=custom), the GPT over several GPUs; with
`--architectures`, `model=hf` on the small configs of tests/data/architectures/ (GPT-2, Falcon,
Gemma 2, GLM-4, Mixtral, DeepSeek-V3, Mamba, T5, ...: what transformers builds beyond Llama), half
of them 6 or 14 layers deep (synthesized from a few). A run must end in a
row (exit 0: ok or OOM) or be refused before anything runs (exit 2, one line naming the key); an
error row (exit 1) or any other exit is a bug, and the script exits 1 after listing them. Prints
each run's exit code and overrides, then the refusals by message.
"""

import collections
import json
import random
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


PRESETS = ["7b", "13b", "70b", "llama3-8b", "qwen2.5-7b", "mistral-7b", "demo-1b"]
ARCHITECTURES = sorted((REPO / "tests" / "data" / "architectures").glob("*.json"))


def combination(rng: random.Random, presets: bool = False, architectures: bool = False) -> list[str]:
    """One point's overrides, drawn from README's table of knobs (tiny: 4 heads, 2 key/value heads;
    a preset where `presets`, with more GPUs; a small architecture of transformers' where
    `architectures`, 4 heads as tiny's)."""
    model, lengths = (rng.choice(PRESETS), [128, 512, 1024]) if presets else ("tiny", [64, 96, 128])
    o = [f"model={model}"]
    if architectures:
        o = ["model=hf", f"model.config_json={rng.choice(ARCHITECTURES).relative_to(REPO)}"]
        if rng.random() < 0.5:  # deep enough to be synthesized (blocks of layers: 14)
            o.append(f"+model.hf.num_hidden_layers={rng.choice([6, 14])}")
    seq_len = rng.choice(lengths)
    o += [f"seq_len={seq_len}", f"batch_size={rng.choice([1, 2, 4])}",
          f"precision={rng.choice(['fp32', 'bf16', 'fp16', 'amp_bf16', 'amp_fp16'])}",
          _allocator(rng), f"gpu={rng.choice(['a100-80gb', 't4', 'h100-80gb', 'rtx4060', 'mi300x', 'l4'])}"]
    if rng.random() < 0.25:
        o.append("workload=infer")
        if architectures and rng.random() < 0.3:  # a sliding window crossed 24 steps past the prompt
            o += ["workload.new_tokens=48", f"++model.hf.sliding_window={seq_len - 24}"]
        elif rng.random() < 0.5:
            o.append(f"workload.new_tokens={rng.choice([1, 4])}")
        if rng.random() < 0.4:  # serving over tensor parallel (on the nodes the card needs)
            o += [f"parallel.tp={rng.choice([2, 4] if presets else [2])}", "parallel.nodes=auto"]
        return o
    if rng.random() < 0.5:
        o.append("checkpointing=true")
        if rng.random() < 0.5:
            o.append("checkpointing_policy=op")
    o.append(f"optimizer={rng.choice(['adamw', 'sgd', 'adafactor'])}")
    if rng.random() < 0.4:
        o.append(f"optimizer.impl={rng.choice(['foreach', 'fused', 'forloop'])}")
    if rng.random() < 0.2:
        o.append(f"workload.leak={rng.choice(['graph', 'cycle'])}")
    more = ([8, 64], [8], [4, 8]) if presets else ([], [], [])
    shard, replicate, tp = (rng.choice([1, 1, 2, *m]) for m in more)
    o += [f"parallel.dp_shard={shard}"] if shard > 1 else []
    o += [f"parallel.dp_replicate={replicate}"] if replicate > 1 else []
    if tp > 1:
        o.append(f"parallel.tp={tp}")
        o += ["parallel.sequence_parallel=true"] if rng.random() < 0.4 else []
        o += ["parallel.loss_parallel=true"] if rng.random() < 0.4 else []
    if shard * replicate * tp > 1 and rng.random() < 0.5:
        o.append("parallel.nodes=auto")  # (a node of RTX 4060s holds one)
    if shard > 1:
        o += ["parallel.reshard_after_forward=false"] if rng.random() < 0.3 else []
        o += [f"parallel.param_dtype={rng.choice(['bf16', 'fp16'])}"] if rng.random() < 0.3 else []
    return o


# PYTORCH_ALLOC_CONF strings beyond the presets: torch 2.13's keys, large segments among them
CONFS = ["large_segment_size_mb:64", "expandable_segments:True,large_segment_size_mb:32",
         "max_split_size_mb:256,large_segment_size_mb:40",
         "roundup_power2_divisions:[256:4,>:0],garbage_collection_threshold:0.6",
         "release_lock_on_cudamalloc:True,pinned_use_background_threads:True,max_non_split_rounding_mb:64"]


def _allocator(rng: random.Random) -> str:
    """A preset allocator, or (one in five) an allocator.conf of several keys, quoted for Hydra."""
    if rng.random() < 0.2:
        return f'allocator.conf="{rng.choice(CONFS)}"'
    return f"allocator={rng.choice(['default', 'expandable', 'max_split_512', 'roundup4', 'gc80'])}"


# The examples as users run them (workload=custom), small: their own models, optimizers and steps
EXAMPLES = {"examples.gpt:build": ["+workload.args.layers=2", "+workload.args.d_model=128", "+workload.args.vocab=2048"],
            "examples.resnet:build": ["+workload.args.image_size=64"],
            "examples.leaky:build": ["+workload.args.width=128"]}


def custom_combination(rng: random.Random) -> list[str]:
    """One point of a job of the user's own (an example): the knobs a custom job takes, and the
    GPT spread over several GPUs (FSDP2, DDP, HSDP: what it applies itself)."""
    target = rng.choice(list(EXAMPLES))
    o = ["workload=custom", f"workload.target={target}", *EXAMPLES[target], f"batch_size={rng.choice([1, 2, 4])}",
         f"seq_len={rng.choice([64, 128])}", f"precision={rng.choice(['fp32', 'bf16', 'fp16', 'amp_bf16', 'amp_fp16'])}",
         _allocator(rng), f"gpu={rng.choice(['a100-80gb', 't4', 'h100-80gb', 'rtx4060', 'mi300x', 'l4'])}"]
    if rng.random() < 0.4:
        o.append("checkpointing=true")
    if target == "examples.gpt:build" and rng.random() < 0.6:
        shard, replicate = rng.choice([(2, 1), (4, 1), (1, 2), (2, 2)])
        o += [f"parallel.dp_shard={shard}"] if shard > 1 else []
        o += [f"parallel.dp_replicate={replicate}"] if replicate > 1 else []
        o.append("parallel.nodes=auto")
    return o


def run(overrides: list[str], results: Path) -> tuple[int, str, str | None]:
    """(exit code, the last line it printed to stderr, the row's status)."""
    r = subprocess.run([sys.executable, "-m", "harness", "run", *overrides, f"results_dir={results}"],
                       cwd=REPO, capture_output=True, text=True)
    said = [line for line in r.stderr.splitlines() if line.strip() and not line.startswith("[rank")]
    rows = [json.loads(p.read_text()).get("status") for p in results.rglob("result.json")]
    return r.returncode, said[-1] if said else "", rows[0] if rows else None


def main(args: list[str]) -> int:
    presets, custom, architectures = "--presets" in args, "--custom" in args, "--architectures" in args
    args = [a for a in args if a not in ("--presets", "--custom", "--architectures")]
    n = int(args[0]) if args else 40
    rng = random.Random(int(args[1]) if len(args) > 1 else 0)
    extra = args[2:]
    combos = [(custom_combination(rng) if custom else combination(rng, presets, architectures)) + extra
              for _ in range(n)]
    refused: collections.Counter = collections.Counter()
    bad = []
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(2) as pool:
        outcomes = pool.map(lambda ic: run(ic[1], Path(tmp) / str(ic[0])), enumerate(combos))
        for overrides, (rc, said, status) in zip(combos, outcomes, strict=True):
            print(rc, status or "-", " ".join(overrides), flush=True)
            if rc == 2 and said.startswith("harness: error: "):
                refused[said] += 1
            elif rc != 0:
                bad.append(f"exit {rc} ({status}): {' '.join(overrides)}: {said}")
    print(f"\n{n} combinations: {n - sum(refused.values()) - len(bad)} rows, {sum(refused.values())} refused, "
          f"{len(bad)} failed")
    for said, count in refused.most_common():
        print(f"{count:4d}  {said}")
    for line in bad:
        print("FAILED", line)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
