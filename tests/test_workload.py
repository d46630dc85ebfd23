"""Your own job (harness.workload): the examples measured on the virtual GPU equal the same steps
on real CPU tensors; value reads in the step are refused with the user's line; sweeps of user jobs."""

import dataclasses
from pathlib import Path

import pandas as pd
import pytest
import torch

from harness.config.point import Point, Workload
from harness.probe.jobs import UserCodeError
from harness.probe.sim.trace import run_point
from tests.conftest import REPO, run_cli, train_point


def custom_point(target: str, args: dict | None = None, **kw) -> Point:
    return train_point(**kw).replace(workload=Workload(name="custom", steps=3, target=target, args=args or {}),
                                     cwd=str(REPO))


SMALL = {
    "examples.gpt:build": {"layers": 2, "d_model": 64, "vocab": 512},
    "examples.resnet:build": {"image_size": 32},
    "examples.leaky:build": {"width": 64},
    "tests.jobs.hf_llama:build": {},
    "tests.jobs.vit_init:build": {},  # torch.nn.init.trunc_normal_ reads values in torch 2.13
    "tests.jobs.encoder:build": {},  # copy.deepcopy of modules (nn.TransformerEncoder, an EMA teacher)
    "tests.jobs.scaled_step:build": {},  # torch.amp.GradScaler's check for inf gradients reads a value
    "tests.jobs.sampled:build": {},  # torch.distributions' validation reads whether its constraints hold
}


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("target", list(SMALL))
def test_a_user_job_on_the_virtual_gpu_equals_its_steps_on_real_cpu_tensors(target, checkpointing):
    point = custom_point(target, SMALL[target], batch_size=2, seq_len=64, precision="bf16",
                         checkpointing=checkpointing)
    fake, _ = run_point(point, emulate_cuda=False, fake=True)
    real, _ = run_point(point, emulate_cuda=False, fake=False)
    assert fake["peak_allocated_bytes"] == real["peak_allocated_bytes"] > 0
    assert fake["step_allocated_bytes"] == real["step_allocated_bytes"]
    assert fake["step_peak_bytes"] == real["step_peak_bytes"]
    assert fake["peak_breakdown"] == real["peak_breakdown"]
    assert fake["peak_phase"] in ("forward", "backward", "optimizer")


def test_checkpointing_the_named_blocks_lowers_the_peak():
    args = {"layers": 4, "d_model": 128, "vocab": 512}
    plain, _ = run_point(custom_point("examples.gpt:build", args, batch_size=4, seq_len=256))
    ckpt, _ = run_point(custom_point("examples.gpt:build", args, batch_size=4, seq_len=256, checkpointing=True))
    assert ckpt["activations_bytes"] < plain["activations_bytes"]


def test_the_cuda_emulations_apply_to_a_users_optimizer():
    # torch.optim picks foreach on CUDA when the user leaves it unset: its temporaries show.
    point = custom_point("examples.gpt:build", {"layers": 2, "d_model": 128, "vocab": 512}, batch_size=1, seq_len=32)
    on_cuda, _ = run_point(point, emulate_cuda=True)
    point = point.replace(optimizer=dataclasses.replace(point.optimizer, impl="forloop"))
    forloop, _ = run_point(point, emulate_cuda=True)
    assert on_cuda["peak_allocated_bytes"] > forloop["peak_allocated_bytes"]


def test_the_leaky_example_is_retained_and_names_its_holder():
    m, _ = run_point(custom_point("examples.leaky:build", {"width": 128}, batch_size=4, seq_len=64, steps=4))
    after = m["step_allocated_bytes"]
    assert all(b > a for a, b in zip(after[1:], after[2:]))
    assert m["retained_bytes"] > 0 and "a list holding Tensor()(grad_fn=MeanBackward0)" in m["retained_holder"]


@pytest.mark.parametrize("target,line", [("tests.jobs.item_in_step:build", "losses.append(loss.item())"),
                                         ("tests.jobs.branch_in_step:build", "if out.mean() > 0:")])
def test_reading_values_in_the_step_names_the_users_file_and_line(target, line):
    with pytest.raises(UserCodeError) as e:
        run_point(custom_point(target))
    module = REPO / "tests" / "jobs" / f"{target.split('.')[2].split(':')[0]}.py"
    lineno = module.read_text().splitlines().index(next(s for s in module.read_text().splitlines() if line in s)) + 1
    assert f"{module}:{lineno}: `{line}" in str(e.value)
    assert "out of the measured step" in str(e.value)


@pytest.mark.parametrize("args,message", [
    (["workload=custom"], "workload.target: workload=custom needs workload.target=module:function"),
    (["workload=custom", "workload.target=nope.nothing:build"], "workload.target: cannot import nope.nothing"),
    (["workload=custom", "workload.target=examples.gpt"], "workload.target: 'examples.gpt' is not 'module:function'"),
    (["workload=custom", "workload.target=examples.gpt:nothing"], "workload.target: examples.gpt has no function 'nothing'"),
])
def test_a_bad_target_is_a_one_line_config_error(args, message, tmp_path):
    r = run_cli("run", *args, f"results_dir={tmp_path}")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1] == f"harness: error: {message}" or message in r.stderr


def test_submitit_stopping_the_job_during_the_targets_import_is_not_an_import_error(tmp_path, monkeypatch):
    # Submitit's time-limit handler raises wherever the job is; in the user's import it must end the
    # job (a timeout), not become "cannot import" (an error row).
    from submitit.core.utils import UncompletedJobError

    from harness.config.target import load_target
    from harness.errors import ConfigError

    (tmp_path / "stopped_mid_import.py").write_text(
        "from submitit.core.utils import UncompletedJobError\n"
        "raise UncompletedJobError('Job not requeued because: timed-out too many times')\n")
    (tmp_path / "broken_import.py").write_text("raise RuntimeError('the module itself is broken')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(UncompletedJobError):
        load_target("stopped_mid_import:build", str(tmp_path))
    with pytest.raises(ConfigError, match="cannot import broken_import: RuntimeError"):
        load_target("broken_import:build", str(tmp_path))


@pytest.mark.slow
def test_a_sweep_of_a_user_job_has_its_keys_as_columns_and_the_usual_outputs(tmp_path):
    r = run_cli("sweep", "sweeps=smoke", "workload=custom", "workload.target=examples.resnet:build",
                "batch_size=4", "seq_len=32", "+workload.args.image_size=32,48", f"results_dir={tmp_path}")
    assert r.returncode == 0, r.stderr
    [sweep_dir] = list((tmp_path / "smoke").iterdir())
    df = pd.read_parquet(sweep_dir / "results.parquet")
    assert sorted(df["image_size"]) == [32, 48]
    assert set(df["model"]) == {"resnet-32px", "resnet-48px"} and set(df["workload"]) == {"custom"}
    assert df["run_id"].nunique() == 2 and (df["status"] == "ok").all()
    assert set(df["kind"]) == {"fits"} and (df["peak_reserved_bytes"] > df["peak_allocated_bytes"] * 0.9).all()
    assert (sweep_dir / "report.html").exists()


@pytest.mark.slow
def test_a_value_read_in_a_users_step_is_an_error_row_with_the_line(tmp_path):
    r = run_cli("run", "workload=custom", "workload.target=tests.jobs.item_in_step:build", f"results_dir={tmp_path}")
    assert r.returncode == 1
    [result] = list(Path(tmp_path).glob("runs/*/runs/*/result.json")) or list(Path(tmp_path).glob("runs/*/result.json"))
    row = pd.read_json(result, typ="series")
    assert row["status"] == "error" and "item_in_step.py:13" in row["error"]


def test_a_script_written_for_a_gpu_runs_as_it_is_on_the_virtual_gpu():
    # device="cuda", .cuda(), .to(device), torch.autocast("cuda", bf16), torch.cuda.synchronize()
    point = custom_point("tests.jobs.cuda_script:build", batch_size=2, seq_len=64, precision="fp32")
    fake, _ = run_point(point, emulate_cuda=False, fake=True)
    real, _ = run_point(point, emulate_cuda=False, fake=False)
    assert fake["peak_allocated_bytes"] == real["peak_allocated_bytes"]
    assert fake["step_allocated_bytes"] == real["step_allocated_bytes"]
    # Its own autocast took effect: bf16 activations, below the same job without autocast.
    plain, _ = run_point(custom_point("tests.jobs.cuda_script:build_portable", batch_size=2, seq_len=64,
                                      precision="fp32"), emulate_cuda=False)
    assert fake["activations_bytes"] < plain["activations_bytes"]
    # And equals the same script with those habits removed by hand, event for event.
    ref, _ = run_point(custom_point("tests.jobs.cuda_script:build_reference", batch_size=2, seq_len=64,
                                     precision="fp32"), emulate_cuda=False)
    assert fake["peak_allocated_bytes"] == ref["peak_allocated_bytes"]
    assert fake["step_peak_bytes"] == ref["step_peak_bytes"]


def test_a_checkpointed_blocks_recompute_makes_its_tensors_on_the_card_as_its_forward_did():
    """Backward runs the block's Python again (transformers' MoE routing: an index built on
    `x.device`, the card); it sees the card as the forward did and traces as real tensors run."""
    point = custom_point("tests.jobs.routed_tokens:build", batch_size=2, seq_len=32, precision="fp32")
    fake, _ = run_point(point, emulate_cuda=False, fake=True)
    real, _ = run_point(point, emulate_cuda=False, fake=False)
    assert fake["peak_allocated_bytes"] == real["peak_allocated_bytes"]
    assert fake["step_peak_bytes"] == real["step_peak_bytes"]


def test_a_scripts_autocast_regions_nest_as_on_cuda():
    from harness.probe.sim.cuda_script import script_autocast

    a = torch.randn(4, 4)
    with script_autocast():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            assert (a @ a).dtype == torch.bfloat16
            with torch.autocast("cuda", enabled=False):
                assert (a @ a).dtype == torch.float32
            assert (a @ a).dtype == torch.bfloat16
        assert (a @ a).dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):  # untouched once the script is done
        assert (a @ a).dtype == torch.bfloat16


def test_a_step_names_its_own_phases_and_enters_its_own_autocast():
    """harness.workload.phase() labels the trace; Job(autocast=False) leaves autocast to the step,
    whose bf16 projection is then half the size it would be in fp32, its square in fp32 (CUDA's
    autocast casts `square`'s pow: a copy and the output); Job.steps sets the count."""
    point = custom_point("tests.jobs.named_phases:build", batch_size=64, precision="amp_bf16")
    m, tracker = run_point(point)
    phases = {e[5] for e in tracker.events if e[6] >= 0}
    assert {"embed", "head", "backward", "optimizer"} <= phases
    assert m["peak_phase"] in {"head", "backward"} and len(m["step_peak_bytes"]) == 4
    head_out = [e[3] for e in tracker.events if e[1] == "alloc" and e[5] == "head" and e[6] == 1]
    # under the step's autocast: the projection's bias, weight and input cast to bf16 (last first), its
    # output in bf16; the square's input cast to fp32, and its output
    assert head_out[:6] == [8192 * 2, 8192 * 64 * 2, 64 * 64 * 2, 64 * 8192 * 2, 64 * 8192 * 4, 64 * 8192 * 4]


def test_an_error_in_the_users_step_names_their_file_and_line(tmp_path):
    import json

    from harness.config.point import Point
    from harness.probe.worker import main
    from harness.record.row import POINT_FILE, RESULT_FILE

    point = custom_point("tests.jobs.raises:build", precision="fp32")
    (tmp_path / POINT_FILE).write_text(json.dumps(point.to_dict()))
    assert Point.from_dict(json.loads((tmp_path / POINT_FILE).read_text())) == point
    main(tmp_path)
    row = json.loads((tmp_path / RESULT_FILE).read_text())
    line = next(i for i, text in enumerate((REPO / "tests/jobs/raises.py").read_text().splitlines(), 1) if "view(-1, 15)" in text)
    assert row["status"] == "error" and row["error"].startswith(f"{REPO / 'tests/jobs/raises.py'}:{line}: RuntimeError")


def test_layers_run_through_cudnn_are_named_as_not_modelled_in_the_row_the_report_and_the_terminal(capsys):
    """nn.LSTM and nn.GRU run cuDNN's RNN on a GPU, convolutions cuDNN's convolution, whose own
    memory (workspace, reserve space) the virtual GPU does not model: the row names each such layer
    class, where it first is and how many more (`unmodelled`), and the terminal and the report say
    what that means; a job without one names none."""
    from harness.report import console, tables

    m, _ = run_point(custom_point("tests.jobs.recurrent:build", batch_size=2, seq_len=16))
    assert m["unmodelled"] == "LSTM at encoder; GRU at decoder"
    resnet, _ = run_point(custom_point("examples.resnet:build", SMALL["examples.resnet:build"], batch_size=2, seq_len=1))
    assert resnet["unmodelled"] == "Conv2d at stem.0 and 19 more"  # 1 + 8 blocks x 2 + 3 shortcuts
    from harness.probe.sim import shortcut
    from tests.test_repeat import _on_architecture

    # a preset's, of the model at its depth (its shallow traces have fewer layers): Mamba's causal convolutions
    mamba = _on_architecture("mamba", num_hidden_layers=3)
    assert shortcut.trace(mamba).measurements["unmodelled"] == "Conv1d at backbone.layers.0.mixer.conv1d and 2 more"
    plain, _ = run_point(custom_point("examples.gpt:build", SMALL["examples.gpt:build"], batch_size=2, seq_len=16))
    assert plain["unmodelled"] is None
    df = pd.DataFrame([{**m, "run_id": "r", "model": "Tagger", "workload": "custom", "batch_size": 2, "seq_len": 16,
                        "precision": "fp32", "checkpointing": False, "gpu": "A100 80GB"},
                       {**plain, "run_id": "p", "model": "GPT", "workload": "custom", "batch_size": 2, "seq_len": 16,
                        "precision": "fp32", "checkpointing": False, "gpu": "A100 80GB"}])
    header, rows = tables.unmodelled_table(df)
    assert [r[0].split()[0] for r in rows] == ["Tagger"] and "through cuDNN" in rows[0][1]
    console.render(df.assign(status="ok", kind="fits", backend="sim", optimizer="AdamW", optimizer_impl="auto",
                             allocator_conf=None, leak="none", peak_reserved_bytes=df["peak_allocated_bytes"]),
                   pd.DataFrame(columns=["run_id", "card", "edge", "headroom_pct"]), "t")
    said = capsys.readouterr().out.replace("\n", " ")
    assert "1 run(s): LSTM at encoder; GRU at decoder: a GPU runs these through cuDNN" in said
