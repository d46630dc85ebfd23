"""The cuda backend's parts that need no GPU: environment and settings handling, card emulation,
OOM rows from every wording, record assembly from the allocator's readings, one point per GPU,
calibration, and the errors a machine without a GPU gets. The GPU itself: tests/test_cuda.py."""

import dataclasses
import subprocess
import sys
import threading
import time

import pytest

from harness.allocator import snapshot as snap
from harness.allocator.settings import AllocSettings
from harness.analysis import calibration
from harness.analysis.kinds import kind
from harness.analysis.oom_text import oom_columns
from harness.config.cards import CardTooLarge, emulation_fraction
from harness.config.point import Allocator, Card
from harness.errors import ConfigError
from harness.launch import gpus
from harness.launch.gpus import check_cards, resolve_backend
from harness.probe.cuda.run import settings_mismatch
from harness.probe.cuda.watch import PhaseReading, StepReading, measurements, read_peaks
from tests.conftest import run_cli, train_point
from tests.test_diagnose import MESSAGES, SHARED

GiB, MiB = 1024**3, 1024**2
H200 = ("NVIDIA H200", 150_109_106_995)
T4 = Card(name="T4", device_name="Tesla T4", memory_bytes=15_633_680_957, non_pytorch_bytes=512 * MiB)
B200 = Card(name="B200", device_name="NVIDIA B200", memory_bytes=191_000_000_000, non_pytorch_bytes=512 * MiB)
H200_CARD = Card(name="H200", device_name="NVIDIA H200", memory_bytes=H200[1], non_pytorch_bytes=512 * MiB)


# ---- environment and allocator settings ----------------------------------------------------

def test_worker_env_sets_both_names_and_its_one_card():
    env = gpus.worker_env("3", "expandable_segments:True", base={"PATH": "/bin"})
    assert env["PYTORCH_ALLOC_CONF"] == env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert env["CUDA_VISIBLE_DEVICES"] == "3" and env["PATH"] == "/bin"


def test_worker_env_for_the_default_allocator_drops_the_users_exported_settings():
    env = gpus.worker_env("0", "", base={"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128",
                                         "PYTORCH_ALLOC_CONF": "expandable_segments:True"})
    assert "PYTORCH_ALLOC_CONF" not in env and "PYTORCH_CUDA_ALLOC_CONF" not in env


@pytest.mark.parametrize("conf", ["", "expandable_segments:True", "max_split_size_mb:512",
                                  "garbage_collection_threshold:0.8,max_split_size_mb:256",
                                  "roundup_power2_divisions:[256:1,512:2,1024:4,>:8]"])
def test_settings_read_back_agree_with_what_was_asked(conf):
    assert settings_mismatch(conf, AllocSettings.from_conf(conf).snapshot_dict()) is None


def test_settings_the_allocator_ignored_are_named():
    # PyTorch 2.9.1 ignored PYTORCH_ALLOC_CONF=expandable_segments:True: the row must say so.
    recorded = AllocSettings.from_conf("").snapshot_dict()
    msg = settings_mismatch("expandable_segments:True", recorded)
    assert msg == "expandable_segments: asked True, got False"


def test_settings_a_version_does_not_report_are_not_called_ignored():
    recorded = AllocSettings.from_conf("").snapshot_dict()
    del recorded["max_non_split_rounding_size"]  # as 2.6 reports
    assert settings_mismatch("max_non_split_rounding_mb:40", recorded) is None
    recorded["max_non_split_rounding_size"] = 20 * MiB
    assert settings_mismatch("max_non_split_rounding_mb:40", recorded) == (
        f"max_non_split_rounding: asked {40 * MiB}, got {20 * MiB}")


def test_a_real_snapshots_settings_are_the_default_allocator():
    data = snap.load(SHARED / "snapshots" / "memory_ctx128_fullstep.pickle")
    assert settings_mismatch("", data["allocator_settings"]) is None
    assert "max_split_size" in settings_mismatch("max_split_size_mb:128", data["allocator_settings"])


# ---- a smaller card on a bigger one ----------------------------------------------------------

def test_the_device_itself_is_not_emulated():
    assert emulation_fraction(H200_CARD, *H200) is None


def test_the_device_with_less_memory_asked_for_is_emulated():
    smaller = dataclasses.replace(H200_CARD, memory_bytes=40 * GiB)  # gpu=h200 gpu.memory_bytes=...
    assert emulation_fraction(smaller, *H200) == pytest.approx((40 * GiB - 512 * MiB) / H200[1])
    assert emulation_fraction(dataclasses.replace(H200_CARD, memory_bytes=H200[1] + 5 * MiB), *H200) is None  # catalog rounding


def test_a_smaller_card_caps_reserved_at_its_room():
    fraction = emulation_fraction(T4, *H200)
    # reserved bytes are capped at the T4's memory less its CUDA context: what a T4 gives PyTorch
    assert fraction * H200[1] == pytest.approx(T4.memory_bytes - T4.non_pytorch_bytes)


def test_a_larger_card_is_an_error_naming_both():
    with pytest.raises(CardTooLarge, match="gpu=B200 .* larger than this device, NVIDIA H200"):
        emulation_fraction(B200, *H200)
    with pytest.raises(ConfigError, match="^gpu: gpu=B200"):
        check_cards([_on(T4), _on(B200)], [H200])
    check_cards([_on(T4), _on(H200_CARD)], [H200])  # smaller or the same: fine


def _on(card, conf: str = ""):
    return train_point().replace(gpu=card, allocator=Allocator(conf=conf))


def test_a_garbage_collection_threshold_on_an_emulated_card_is_refused_up_front():
    """torch collects only under a per-process fraction, and emulating a T4 on an H200 sets one: a T4
    under gc80 would collect here and not on a T4. The H200 itself sets none: fine."""
    with pytest.raises(ConfigError, match="^allocator.conf: garbage_collection_threshold acts only under"):
        check_cards([_on(T4, "garbage_collection_threshold:0.8")], [H200])
    check_cards([_on(H200_CARD, "garbage_collection_threshold:0.8"), _on(T4, "max_split_size_mb:512")], [H200])


# ---- OOM as data -----------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(MESSAGES))
def test_every_wording_becomes_oom_columns_in_bytes(name):
    cols = oom_columns(MESSAGES[name])
    assert cols["oom_message"] == MESSAGES[name]
    assert cols["oom_tried_bytes"] > 0 and cols["oom_capacity_bytes"] > cols["oom_tried_bytes"]
    assert cols["oom_verdict"] in ("capacity", "fragmentation", "other_process")
    if cols["oom_allocated_bytes"] is not None:
        assert cols["oom_reserved_bytes"] >= cols["oom_allocated_bytes"]


def test_a_fraction_capped_oom_keeps_the_allowed_bytes():
    cols = oom_columns(MESSAGES["2.0 with a per-process fraction"])
    assert cols["oom_allowed_bytes"] == 16 * GiB


def test_an_oom_that_is_not_the_allocators_keeps_its_text():
    cols = oom_columns("CUDA out of memory. cuBLAS failed to allocate its workspace")
    assert cols == {"oom_message": "CUDA out of memory. cuBLAS failed to allocate its workspace"}


def test_a_real_oom_row_is_explained_by_its_message():
    base = {"status": "oom", "workload": "train", "gpu_memory_bytes": 80 * GiB, "gpu_non_pytorch_bytes": GiB,
            "params_bytes": 10 * GiB, "optimizer_bytes": 20 * GiB, "peak_allocated_bytes": 60 * GiB,
            "peak_reserved_bytes": 77 * GiB, "oom_allocated_bytes": 60 * GiB, "oom_tried_bytes": 2 * GiB,
            "oom_reserved_bytes": 77 * GiB}
    assert kind({**base, "oom_verdict": "fragmentation"}).kind == "fragmentation"
    k = kind({**base, "oom_verdict": "capacity"})
    assert (k.kind, k.rule, k.oom_held_bytes, k.oom_asked_bytes) == ("activations", "oom_message", 60 * GiB, 2 * GiB)
    assert kind({**base, "oom_verdict": "capacity", "params_bytes": 30 * GiB}).kind == "static"


# ---- record assembly from the allocator's readings --------------------------------------------

def _phase(step, phase, alloc, reserved, requested=None, split=0):
    return PhaseReading(step, phase, alloc, reserved, requested or alloc - 100, split)


def _steps():
    # step 0 builds the optimizer state (its peak is not the steady state's); step 2 leaks 3 MiB
    peaks = [(900, 1000), (700, 1100), (710, 1100)]
    out = []
    for i, (fwd, opt) in enumerate(peaks):
        ph = [_phase(i, "forward", fwd * MiB, 1200 * MiB), _phase(i, "backward", (fwd + 50) * MiB, 1200 * MiB),
              _phase(i, "optimizer", opt * MiB, 1300 * MiB, split=5 * MiB)]
        out.append(StepReading(i, (400 + 3 * i * i) * MiB, 1300 * MiB, 0.1 + 0.01 * i, ph))
    return out


def test_the_whole_run_and_the_steady_state_each_have_one_window_for_all_three_peaks():
    steps = _steps()
    setup = [_phase(None, "setup", 300 * MiB, 1500 * MiB)]
    m = measurements(steps, setup + [p for s in steps for p in s.phases], trains=True, tokens_per_step=4096)
    assert m["peak_allocated_bytes"] == 1100 * MiB and m["peak_phase"] == "optimizer" and m["peak_step"] == 1
    assert m["peak_requested_bytes"] == 1100 * MiB - 100
    assert m["peak_reserved_bytes"] == 1500 * MiB  # the whole run: setup counts
    assert (m["steady_peak_allocated_bytes"], m["steady_peak_requested_bytes"], m["steady_peak_reserved_bytes"]) \
        == (1100 * MiB, 1100 * MiB - 100, 1300 * MiB)  # from step 2 on
    assert m["step_peak_bytes"] == [1000 * MiB, 1100 * MiB, 1100 * MiB]
    assert m["step_allocated_bytes"] == [400 * MiB, 403 * MiB, 412 * MiB]
    assert m["retained_bytes"] == 9 * MiB
    assert m["step_time_s"] == pytest.approx(0.115) and m["tokens_per_s"] == pytest.approx(4096 / 0.115)
    assert m["peak_inactive_split_bytes"] == 5 * MiB


def test_a_peak_in_the_first_step_is_the_whole_runs_and_a_single_step_has_no_steady_state():
    steps = _steps()
    steps[0].phases[0] = _phase(0, "forward", 2000 * MiB, 2100 * MiB)  # e.g. a one-off warm-up
    phases = [p for s in steps for p in s.phases]
    m = measurements(steps, phases, trains=True, tokens_per_step=8)
    assert (m["peak_allocated_bytes"], m["peak_step"], m["peak_reserved_bytes"]) == (2000 * MiB, 0, 2100 * MiB)
    assert m["steady_peak_allocated_bytes"] == 1100 * MiB
    one = measurements(steps[:1], steps[0].phases, trains=False, tokens_per_step=8)
    assert one["peak_allocated_bytes"] == 2000 * MiB and one["steady_peak_allocated_bytes"] is None


def test_inference_peaks_count_every_step():
    steps = _steps()
    m = measurements(steps, [p for s in steps for p in s.phases], trains=False, tokens_per_step=8)
    assert m["peak_allocated_bytes"] == 1100 * MiB and m["retained_bytes"] == 0


def test_a_run_that_failed_before_its_first_step_still_has_readings():
    m = measurements([], [_phase(None, "setup", 300 * MiB, 400 * MiB)], trains=True, tokens_per_step=1)
    assert m["peak_reserved_bytes"] == 400 * MiB and m["peak_allocated_bytes"] == 300 * MiB  # how far it got
    assert m["peak_phase"] == "setup" and m["peak_step"] is None and m["steady_peak_allocated_bytes"] is None
    assert m["step_allocated_bytes"] == [] and m["retained_bytes"] == 0


def test_peaks_are_read_from_memory_stats_keys():
    stats = {"allocated_bytes.all.peak": 5, "reserved_bytes.all.peak": 6, "requested_bytes.all.peak": 4,
             "inactive_split_bytes.all.peak": 1}
    assert read_peaks(stats, 2, "backward") == PhaseReading(2, "backward", 5, 6, 4, 1)


# ---- one point per GPU -------------------------------------------------------------------------

def test_two_points_never_share_a_card_and_every_card_is_used(tmp_path):
    devices, running, seen, lock = ["0", "1"], {}, [], threading.Lock()

    def point():
        device, held = gpus.take(devices, tmp_path)
        with held:
            with lock:
                running[device] = running.get(device, 0) + 1
                seen.append((device, dict(running)))
            time.sleep(0.3)
            with lock:
                running[device] -= 1

    threads = [threading.Thread(target=point) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(count <= 1 for _d, snapshot in seen for count in snapshot.values())
    assert {d for d, _s in seen} == {"0", "1"}
    assert any(sum(snapshot.values()) == 2 for _d, snapshot in seen)  # two at a time, not one


def test_a_card_held_by_another_process_is_skipped_until_it_exits(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, sys, time; f = open(sys.argv[1], 'w'); fcntl.flock(f, fcntl.LOCK_EX); "
        "print('held', flush=True); time.sleep(30)"), str(tmp_path / "gpu-0.lock")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        device, held = gpus.take(["0", "1"], tmp_path)
        assert device == "1"
        with pytest.raises(TimeoutError, match="no free GPU among 0"):
            gpus.take(["0"], tmp_path, timeout_s=0.5)
        held.close()
    finally:
        holder.kill()
        holder.wait()
    device, held = gpus.take(["0"], tmp_path, timeout_s=5)  # a killed holder gives its card back
    assert device == "0"
    held.close()


def test_no_devices_is_an_error_not_a_wait(tmp_path):
    with pytest.raises(RuntimeError, match="no GPU"):
        gpus.take([], tmp_path)


# ---- calibration -------------------------------------------------------------------------------

def _row(backend, status, alloc, reserved, **kw):
    return {"run_id": backend, "backend": backend, "status": status, "model": "tiny", "workload": "train",
            "precision": "bf16", "checkpointing": False, "optimizer": "adamw", "batch_size": 2, "seq_len": 64,
            "allocator_conf": "", "gpu": "H200", "peak_allocated_bytes": alloc, "peak_reserved_bytes": reserved, **kw}


def test_calibration_reports_relative_errors_against_the_measurement():
    pairs = [(_row("sim", "ok", 1010 * MiB, 1100 * MiB), _row("cuda", "ok", 1000 * MiB, 1000 * MiB, step_time_s=0.2)),
             (_row("sim", "ok", 1000 * MiB, 1000 * MiB), _row("cuda", "ok", 1005 * MiB, 1020 * MiB)),
             (_row("sim", "oom", 9 * GiB, 9 * GiB), _row("cuda", "oom", 5 * GiB, 6 * GiB))]
    df = calibration.compare(pairs)
    assert df["allocated_error"][0] == pytest.approx(0.01) and df["reserved_error"][0] == pytest.approx(0.10)
    assert list(df["within_target"]) == [False, True, False]
    assert df["allocated_error"].isna()[2]  # an OOM's peak is how far it got: not compared
    assert list(df["status_agrees"]) == [True, True, True]
    s = calibration.summary(df)
    assert s == {"points": 3, "compared": 2, "status_agrees": 3, "within_target": 1,
                 "max_abs_allocated_error": pytest.approx(0.01), "max_abs_reserved_error": pytest.approx(0.10)}


def test_the_calibration_table_puts_prediction_beside_measurement(capsys):
    from harness.report import console, tables

    df = calibration.compare([(_row("sim", "ok", 1010 * MiB, 1100 * MiB),
                               _row("cuda", "ok", 1000 * MiB, 1000 * MiB, step_time_s=0.2, device_name="NVIDIA H200"))])
    header, rows = tables.calibration_table(df)
    cells = dict(zip(header, rows[0]))
    assert cells["status sim/cuda"] == "ok/ok" and cells["alloc err"] == "+1.00%" and cells["reserved err"] == "+10.00%"
    assert cells["alloc GiB sim"] == "0.99" and cells["step s"] == "0.200" and cells["device"] == "NVIDIA H200"
    console.render_calibration(df, calibration.summary(df))
    assert "1 of 1 point(s) compared, 0 within target" in capsys.readouterr().out


def test_calibration_flags_a_status_the_sim_got_wrong():
    df = calibration.compare([(_row("sim", "ok", GiB, GiB), _row("cuda", "oom", GiB, GiB))])
    assert not df["status_agrees"][0] and not df["within_target"][0]


# ---- a machine without a GPU ---------------------------------------------------------------------

needs_no_gpu = pytest.mark.skipif(bool(gpus.visible_devices()), reason="checks a machine without a GPU")


@needs_no_gpu
def test_auto_is_the_virtual_gpu_and_cuda_is_a_config_error():
    assert resolve_backend("auto") == "sim"
    with pytest.raises(ConfigError, match="^backend: cuda asked for, but no GPU is visible"):
        resolve_backend("cuda")


@needs_no_gpu
@pytest.mark.parametrize("verb", ["run", "calibrate"])
def test_cuda_without_a_gpu_exits_2_with_one_line(verb, tmp_path):
    args = [verb, "model=tiny", f"results_dir={tmp_path}"] + (["backend=cuda"] if verb == "run" else [])
    r = run_cli(*args)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("harness: error: backend: ")
    if verb == "run":  # the words, once
        assert lines == ["harness: error: backend: cuda asked for, but no GPU is visible (use backend=sim or auto)"]
    else:  # the advice for run (backend=sim) is no answer for calibrate, which needs the GPU
        assert "backend=sim" not in lines[0]
    assert not any(tmp_path.iterdir())


def test_calibrate_refuses_a_backend_override(tmp_path):
    r = run_cli("calibrate", "model=tiny", "backend=sim", f"results_dir={tmp_path}")
    assert r.returncode == 2 and "backend: calibrate runs every point on both backends" in r.stderr


def test_devices_are_named_as_cuda_visible_devices_names_them():
    assert gpus.listed("5,7", 2) == ["5", "7"]
    assert gpus.listed(None, 2) == ["0", "1"]
    assert gpus.listed("GPU-1a2b, GPU-3c4d,", 2) == ["GPU-1a2b", "GPU-3c4d"]
    assert gpus.listed("0,1,2", 1) == ["0"]  # CUDA stops at the first invalid one: trust its count
