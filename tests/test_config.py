"""Config: presets, grids and bad input, all before any work is done."""

import json

import pytest

from harness.cli.main import entry
from harness.config.compose import compose, expand_grid, with_grid_files
from harness.config.validate import validate
from harness.errors import ConfigError
from tests.conftest import run_cli


def test_default_grid_covers_batch_seq_precision_checkpointing():
    """`sweep model=7b` expands sweeps/default.yaml into its 48 training points."""
    points = expand_grid(["model=7b"])
    assert len(points) == 48
    assert {p for pt in points for p in pt if p.startswith("checkpointing=")} == {
        "checkpointing=False", "checkpointing=True"}


def test_a_grid_file_by_path_is_swept_like_a_named_one(tmp_path):
    """`sweeps=path/grid.yaml`: the user's own grid, its values and its sweep name; a grid named like
    a built-in one is still the user's."""
    for name in ("mine", "default"):
        grid = tmp_path / name / f"{name}.yaml"
        grid.parent.mkdir()
        grid.write_text("# @package _global_\ndefaults:\n  - override /model: tiny\nsweep: my-grid\n"
                        "hydra:\n  sweeper:\n    params:\n      batch_size: 3,5\n      seq_len: 64\n")
        overrides = with_grid_files([f"sweeps={grid}", "precision=fp32"])
        points = expand_grid(overrides)
        assert [[o for o in p if o.startswith("batch_size=")] for p in points] == [["batch_size=3"], ["batch_size=5"]]
        cfg = compose(points[0])
        assert (cfg.sweep, cfg.model.name, cfg.seq_len, cfg.precision) == ("my-grid", "tiny", 64, "fp32")


def test_a_missing_grid_file_is_a_one_line_error(tmp_path, capsys):
    assert entry(["sweep", f"sweeps={tmp_path}/nope.yaml"]) == 2
    assert capsys.readouterr().err.strip() == f"harness: error: sweeps: no such grid file: {tmp_path}/nope.yaml"
    (tmp_path / "headless.yaml").write_text("hydra:\n  sweeper:\n    params:\n      batch_size: 1,2\n")
    assert entry(["sweep", f"sweeps={tmp_path}/headless.yaml"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("harness: error: sweeps: grid file ") and "@package _global_" in err[0]


def test_a_typo_in_a_grid_file_is_refused_naming_the_key_and_the_points_knobs_only(tmp_path, capsys):
    grid = tmp_path / "grid.yaml"
    grid.write_text("# @package _global_\nhydra:\n  sweeper:\n    params:\n      batch_size: 1,2\n      precison: bf16\n")
    assert entry(["sweep", "model=tiny", f"sweeps={grid}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("harness: error: precison: unknown key (point: ")
    assert "hydra." not in err[0]  # the grid file's staging is Hydra's business, not a knob of the point


def test_a_user_config_directory_adds_cards_and_grids(tmp_path):
    """`hydra.searchpath=[file://dir]`: dir/gpu/<card>.yaml is a card like the catalog's."""
    (tmp_path / "gpu").mkdir()
    (tmp_path / "gpu" / "my-card.yaml").write_text("name: My card (24 GB)\ndevice_name: NVIDIA My Card\n"
                                                   "memory_bytes: 25769803776\nnon_pytorch_bytes: 536870912\n")
    cfg = compose(["gpu=my-card", f"hydra.searchpath=[file://{tmp_path}]"])
    validate(cfg)
    assert (cfg.gpu.name, cfg.gpu.memory_bytes) == ("My card (24 GB)", 25769803776)


def test_command_line_sweep_replaces_the_grid_axis():
    """A swept key on the command line wins over the grid file's values for that key."""
    points = expand_grid(["model=7b", "batch_size=16,32"])
    assert len(points) == 2 * 3 * 2 * 2
    assert {p for pt in points for p in pt if p.startswith("batch_size=")} == {"batch_size=16", "batch_size=32"}


def test_plain_value_pins_a_grid_axis():
    points = expand_grid(["model=7b", "precision=fp32"])
    assert len(points) == 24 and all("precision=fp32" in p for p in points)


@pytest.mark.parametrize("preset", ["7b", "13b", "70b", "llama3-8b", "qwen2.5-7b", "mistral-7b", "tiny"])
def test_every_model_preset_composes_and_validates(preset):
    validate(compose([f"model={preset}", "seq_len=128"]))


def test_validating_a_preset_point_leaves_transformers_unimported():
    """A preset's own keys answer what validation asks of a model (its architecture a causal LM,
    its positions given, no heads to split): importing transformers' config classes costs 3 s, most
    of a re-run that reuses every row (benchmarks/sweep_7b.py)."""
    import subprocess
    import sys

    code = ("import sys; from harness.config.compose import compose; from harness.config.validate import validate; "
            "validate(compose(['model=7b', 'seq_len=4096'])); print('transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False"]


@pytest.mark.parametrize("override, key", [
    ("batch_size=1,2", "batch_size"),  # an int: Hydra refuses it
    ("allocator.conf=max_split_size_mb:128,expandable_segments:True", "allocator.conf"),  # a str: Hydra would take its text
    ("workload.target=a:build,b:build", "workload.target"),
])
def test_several_values_where_one_point_is_asked_for_are_refused_naming_the_key(override, key):
    with pytest.raises(ConfigError) as e:
        compose(["model=tiny", override])
    assert e.value.key == key and "sweep" in str(e.value) and "\n" not in str(e.value)
    # quoted, the commas are one value
    assert compose(["model=tiny", 'allocator.conf="max_split_size_mb:128,expandable_segments:True"']).allocator.conf \
        == "max_split_size_mb:128,expandable_segments:True"


def test_hf_config_json_points_at_a_local_architecture(tmp_path):
    """model=hf model.config_json=<file> builds from a Hugging Face config.json."""
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 100,
        "max_position_embeddings": 128}))
    cfg = compose(["model=hf", f"model.config_json={tmp_path}", "seq_len=128"])
    validate(cfg)
    cfg.seq_len = 129
    with pytest.raises(ConfigError, match="max_position_embeddings"):
        validate(cfg)


def test_a_model_type_without_a_causal_lm_is_refused_naming_the_file(tmp_path):
    """An encoder-decoder's config.json (T5: no AutoModelForCausalLM class) is refused before any
    work, naming model.config_json, rather than failing in the point as an error row."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "t5", "d_model": 64, "num_layers": 1,
                                                      "num_heads": 4, "vocab_size": 100}))
    with pytest.raises(ConfigError) as e:
        validate(compose(["model=hf", f"model.config_json={tmp_path}"]))
    assert e.value.key == "model.config_json" and "t5" in str(e.value) and "workload=custom" in str(e.value)


def test_a_config_json_transformers_cannot_build_is_refused_naming_the_file(tmp_path):
    """SmolLM3's default pad token (128004) outside a 1000-token vocabulary: nn.Embedding asserts as
    the model is built, in each point an error row; it is refused before any work instead."""
    import json

    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "smollm3", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000}))
    with pytest.raises(ConfigError) as e:
        validate(compose(["model=hf", f"model.config_json={tmp_path}", "seq_len=32"]))
    assert e.value.key == "model.config_json" and "Padding_idx" in str(e.value)


def test_a_quantized_checkpoints_config_is_refused_naming_the_file_and_its_method(tmp_path):
    """gpt-oss's config.json (MXFP4 experts): built unquantized, its peaks would be those of weights
    four times larger, a "card problem" on the one H100 it is made to fit; refused, saying how to
    plan the unquantized model instead."""
    arch = {"model_type": "gpt_oss", "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_local_experts": 4,
            "num_experts_per_tok": 2, "vocab_size": 256}
    (tmp_path / "config.json").write_text(json.dumps({**arch, "quantization_config": {"quant_method": "mxfp4"}}))
    with pytest.raises(ConfigError) as e:
        validate(compose(["model=hf", f"model.config_json={tmp_path}", "seq_len=32"]))
    assert e.value.key == "model.config_json" and "mxfp4" in str(e.value) and str(tmp_path) in str(e.value)
    (tmp_path / "config.json").write_text(json.dumps(arch))  # as the message says: the unquantized model
    validate(compose(["model=hf", f"model.config_json={tmp_path}", "seq_len=32"]))


@pytest.mark.parametrize("model_type", ["gemma3", "llama4", "mllama"])
def test_a_multimodal_models_config_is_refused_naming_the_file_and_its_language_model(tmp_path, model_type):
    """A vision-language model's config.json (Gemma 3 4B+, Llama 4, Mllama: the language model in
    text_config) is refused before any work, naming model.config_json and text_config's model_type:
    it was an error row (no num_hidden_layers), and the presets would feed it tokens alone."""
    from transformers import AutoConfig

    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    text = AutoConfig.for_model(model_type).get_text_config().model_type
    with pytest.raises(ConfigError) as e:
        validate(compose(["model=hf", f"model.config_json={tmp_path}", "seq_len=32"]))
    assert e.value.key == "model.config_json" and f"'{text}'" in str(e.value) and "text_config" in str(e.value)


@pytest.mark.parametrize("override,key", [
    ("model=nope", "model"),
    ("batch_size=0", "batch_size"),
    ("batch_size=-3", "batch_size"),
    ("precision=fp9", "precision"),
    ("gpu=nope", "gpu"),
    ("optimizer=nope", "optimizer"),
    ("seq_len=4097", "seq_len"),  # Llama-2-7B has 4096 positions
    ("allocator.conf=expandable_segments", "allocator.conf"),
    ("modle=7b", "modle"),
    ("batch_size=abc", "batch_size"),
])
def test_bad_input_is_one_line_naming_the_key_exit_2_and_keeps_results(tmp_path, override, key):
    """Bad input: one line on stderr naming the key, exit 2, no traceback, nothing lost."""
    kept = tmp_path / "default" / "old" / "runs" / "0" / "result.json"
    kept.parent.mkdir(parents=True)
    kept.write_text('{"status": "ok"}')
    r = run_cli("sweep", "model=7b", override, f"results_dir={tmp_path}")
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith(f"harness: error: {key}:"), lines[0]
    assert "Traceback" not in r.stderr
    assert kept.read_text() == '{"status": "ok"}'
    assert sorted(p.name for p in tmp_path.rglob("*")) == sorted(["default", "old", "runs", "0", "result.json"])


@pytest.mark.parametrize("verb,overrides,key", [
    ("run", ["workload=infer", "checkpointing=true"], "checkpointing"),
    ("run", ["workload=infer", "optimizer=sgd"], "optimizer"),
    ("run", ["workload=infer", "optimizer.impl=fused"], "optimizer.impl"),
    ("run", ["workload=infer", "workload.steps=5"], "workload.steps"),  # a prefill, then a step a token
    ("run", ["workload.new_tokens=8"], "workload.new_tokens"),  # training decodes nothing
    ("run", ["workload=custom", "workload.target=examples.gpt:build", "optimizer.lr=0.1"], "optimizer.lr"),
    ("sweep", ["workload=infer"], "checkpointing"),  # the default grid sweeps checkpointing
    ("sweep", ["+workload.args.width=1,2"], "workload.args.width"),  # a preset takes no args
    ("run", ["workload.target=examples.gpt:build"], "workload.target"),
    ("run", ["workload=custom", "workload.target=examples.gpt:build", "model=7b"], "model"),
    ("run", ["workload=custom", "workload.target=examples.gpt:build", "model.hf.num_hidden_layers=4"],
     "model.hf.num_hidden_layers"),
    ("sweep", ["plan.hi=5,6"], "plan.hi"),  # a sweep searches nothing
    ("sweep", ["sweeps=smoke", "workload=custom", "workload.target=examples.gpt:build", "model=tiny,7b"], "model"),
])
def test_a_knob_the_job_would_ignore_is_refused_by_its_key_before_anything_runs(verb, overrides, key):
    """Rows under two values of a knob the job ignores would be one run twice: inference has no
    backward to checkpoint and no optimizer step, and steps a token at a time; training decodes
    nothing; a custom job builds its own model and optimizer, and a preset takes no workload.args;
    a sweep or a run searches nothing (plan.*)."""
    from harness.cli.common import prepare

    preset = [] if "workload=custom" in overrides else ["model=tiny"]
    with pytest.raises(ConfigError) as e:
        prepare(verb, [*preset, *overrides])
    assert e.value.key == key
    assert len(prepare("sweep", ["model=tiny", "workload=infer", "checkpointing=false"]).points) == 24
    # a grid file's one value the job does not use (smoke's model=tiny for a custom job) goes unused,
    # as does a typed one that some of the sweep's points use; varied, it is refused
    assert len(prepare("sweep", ["sweeps=smoke", "workload=custom", "workload.target=examples.gpt:build"]).points) == 4
    mixed = ["model=tiny", "workload=train,infer", "checkpointing=false"]
    assert len(prepare("sweep", [*mixed, "optimizer=sgd"]).points) == 48
    with pytest.raises(ConfigError) as e:
        prepare("sweep", [*mixed, "optimizer=sgd,adamw"])
    assert e.value.key == "optimizer"


def test_unknown_verb_is_a_usage_error():
    r = run_cli("sweeep", "model=7b")
    assert r.returncode == 2 and "unknown verb" in r.stderr


def test_slurm_launcher_picks_the_card_from_the_catalog():
    """hydra/launcher=harness_slurm takes gres and constraint from conf/gpu/<card>.yaml."""
    from omegaconf import OmegaConf

    cfg = compose(["hydra/launcher=harness_slurm", "gpu=h100-80gb"], with_hydra=True)
    launcher = OmegaConf.to_container(cfg.hydra.launcher, resolve=True)
    assert launcher["gres"] == "gpu:h100:1" and launcher["constraint"] == "h100"
    assert launcher["_target_"].endswith("SlurmLauncher")


def test_every_card_cites_its_capacity():
    from harness.config import cards as catalog
    cards = catalog.cards()
    assert {c.key for c in cards} >= {"t4", "l4", "a10g", "rtx3060-12gb", "rtx3090", "rtx4060", "rtx4090", "a6000",
                                         "l40s", "a100-40gb", "a100-80gb", "h100-80gb", "h100-pcie", "h100-nvl",
                                         "h20", "gh200", "h200", "b200", "mi300x"}
    for c in cards:  # every figure with its source and how far it is known
        assert c.memory_bytes > 4 * 1024**3 and c.source and c.non_pytorch_source, c.key
        # (the non-PyTorch memory's spread, 256 MiB where it is an estimate, is the most of it: 3.2% of an
        # RTX 4060's 8 GB)
        assert 0 < c.uncertainty_bytes < 0.05 * c.memory_bytes, c.key
        unverified = "estimate" in c.source
        assert unverified or "github.com" in c.source or "shared/data" in c.source or "issue 14" in c.source, c.key
    # SXM and PCIe parts are their own entries; the A100 40GB's spread covers the reports it cites
    a100 = catalog.by_key()["a100-40gb"]
    assert a100.memory_bytes - a100.memory_spread_bytes <= 42_298_834_944 <= 42_474_471_424 <= a100.memory_bytes


def test_a_users_own_card_is_one_override_and_its_name_may_hold_parentheses(tmp_path):
    from harness.config.compose import user_card_and_free_text

    own = validate(compose(user_card_and_free_text(["model=tiny", "gpu.memory_bytes=12000000000"])))
    assert own.gpu.memory_bytes == 12_000_000_000 and own.gpu.name.startswith("own card")
    named = validate(compose(user_card_and_free_text(["model=tiny", "gpu.memory_bytes=12000000000",
                                                      "gpu.name=My card (12GB), rev. 2"])))
    assert named.gpu.name == "My card (12GB), rev. 2"
    r = run_cli("run", "model=tiny", "seq_len=32", "gpu.memory_bytes=12000000000", "gpu.name=Lab card (12GB)",
                f"results_dir={tmp_path}")
    assert r.returncode == 0, r.stderr
    [row] = [json.loads(p.read_text()) for p in tmp_path.rglob("result.json")]
    assert row["gpu"] == "Lab card (12GB)" and row["gpu_memory_bytes"] == 12_000_000_000 and row["status"] == "ok"


@pytest.mark.parametrize("args,key,hint", [
    (["run", "model=tiny", "results_dir={file}"], "results_dir", "is a file"),
    (["run", "model=tiny", "results_dir={file}/below"], "results_dir", "is a file"),
    (["run", "model=tiny", "batch_size=1,2"], "batch_size", "harness sweep"),
    (["run", "workload=custom", "workload.target=examples.gpt:build", "workload.args.width=8"],
     "workload.args.width", "+workload.args.width="),
])
def test_rough_input_gets_one_line_with_the_way_out_and_exit_2(tmp_path, capsys, args, key, hint):
    file = tmp_path / "a-file"
    file.write_text("kept")
    assert entry([a.format(file=file) for a in args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"harness: error: {key}:") and hint in err[0], err
    assert file.read_text() == "kept"


def test_a_knob_a_custom_job_ignores_is_refused_up_front(capsys):
    args = ["sweep", "workload=custom", "workload.target=examples.gpt:build", "optimizer=adamw,sgd"]
    assert entry(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("harness: error: optimizer:"), err


def test_paths_the_override_grammar_cannot_read_are_quoted_and_a_value_it_cannot_read_is_named_by_its_key():
    """A results dir with a tilde the shell left (zsh does after `=`) or a parenthesis is quoted for
    Hydra (it was "overrides: LexerNoViableAltException"); a readable path and a sweep of config
    files stay as typed; another unreadable value is refused naming its key."""
    from harness.config.compose import split_overrides, user_card_and_free_text

    assert user_card_and_free_text(["results_dir=~/runs", "results_dir=/r/a(b)", "results_dir=/r/plain",
                                    "model.config_json=a.json,b.json"]) == \
        ["results_dir='~/runs'", "results_dir='/r/a(b)'", "results_dir=/r/plain", "model.config_json=a.json,b.json"]
    with pytest.raises(ConfigError) as e:
        split_overrides(["model=tiny", "gpu.memory_bytes=12(GB)"])
    assert e.value.key == "gpu.memory_bytes" and "12(GB)" in str(e.value)
