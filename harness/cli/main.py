"""`python -m harness run|sweep|report`: validate everything first, run through Hydra, aggregate.

Exit codes: 0 every point produced a row (OOM rows count); 1 some row is an error, a timeout,
or missing; 2 usage or config error (nothing was run, nothing already written is touched);
130/143 interrupted by SIGINT/SIGTERM (every point's process stopped, the rows written kept); 141
its output's reader went away (a closed pipe: `| head`).
"""

from __future__ import annotations

import datetime as dt
import os
import sys
from pathlib import Path

import hydra

from harness.cli import callbacks, interrupt
from harness.cli.common import aggregate, import_report_meanwhile, make_out_dir, prepare, without
from harness.config.compose import CONF_DIR, as_dict, path_override, user_card_and_free_text, with_grid_files
from harness.config.validate import validate
from harness.errors import EXIT_OK, EXIT_USAGE, ConfigError
from harness.launch import local, threads
from harness.launch.gpus import check_cards, resolve_backend, visible_devices
from harness.launch.point import to_point
from harness.launch.ranks import check_here
from harness.record import results

USAGE = """usage: python -m harness <verb> [overrides]

  run    [overrides]    one point, e.g. run model=7b batch_size=4 seq_len=2048 backend=sim
  sweep  [overrides]    a grid (sweeps/default.yaml unless sweeps=<name>); key=a,b,c sweeps a key
  plan   [overrides]    per card, the largest batch (plan.axis=seq_len: sequence) that fits, found
                        by search on the virtual GPU, e.g. plan sweeps=finetune-7b plan.margin=0.05
  calibrate [overrides] the same points on the virtual GPU and on this machine's GPU: predicted vs
                        measured allocated and reserved peaks per point (needs a GPU)
  report <dir|file>     aggregate a finished, partial or interrupted sweep (or plan) into
                        results.parquet/.csv, fit.csv, report.md and a self-contained report.html
  diagnose <-|path> [--json]
                        an OOM message on stdin (-): code or card problem; a result.json, sweep dir
                        or snapshot.pickle: the kind of memory behind each peak and its timeline
  replay <snapshot.pickle> [allocator=...] [gpu=... [fraction=0.5]] [torch_version=2.6] [--json]
                        replay a memory snapshot through the allocator model: checked against
                        the recording, or what-if under other settings / on another card
  script <file.py> [its args] [gpu=...] [allocator=...]
                        run a whole script as it is on the virtual GPU: its torch.cuda memory
                        readings, snapshots and OOMs are the card's (exit code: the script's)

exit codes: 0 every point produced a row (OOM rows count); 1 some row is an error, timeout or
missing; 2 usage or config error; 130/143 interrupted by Ctrl-C/SIGTERM (rows written are kept);
141 the output's reader went away (a closed pipe)."""


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def main(cfg) -> str:
    """Hydra's task: one point -> one result.json. Never raises for an expected outcome."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    from hydra.utils import to_absolute_path

    from harness.launch.runner import run_point
    from harness.launch.slurm import slurm_job_id
    from harness.record.row import config_error_row, write_row

    hc = HydraConfig.get()
    run_dir = Path(hc.runtime.output_dir)
    overrides = list(hc.overrides.task)
    if hc.runtime.cwd not in sys.path:  # a user's workload module lives where they ran us
        sys.path.insert(0, hc.runtime.cwd)
    job_id = slurm_job_id(os.environ)
    results_dir = Path(to_absolute_path(cfg.results_dir))
    try:
        validate(cfg)
        point = to_point(cfg, overrides, hc.runtime.cwd, results_dir=results_dir, job_id=job_id)
    except ConfigError as e:  # validated up front; a worker composing differently still leaves a row
        return write_row(run_dir, config_error_row(as_dict(cfg), str(e), job_id))["status"]
    reuse = results_dir if hc.mode == RunMode.MULTIRUN else None
    return run_point(point, run_dir, reuse)["status"]


def _fail(message: str) -> int:
    print(f"harness: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def _gpu_launch(points: list) -> None:
    """For cuda points on this machine: every card asked for must fit the devices (check_cards); the
    devices go to the points (GPU_DEVICES_ENV), one point per card at a time, as many at once as cards."""
    from harness.launch import gpus
    from harness.launch.runner import GPU_DEVICES_ENV

    devices = gpus.visible_devices()
    check_cards(points, gpus.describe(devices))
    os.environ[GPU_DEVICES_ENV] = ",".join(devices)


def _launch(verb: str, overrides: list[str], asked: list[str] | None = None) -> int:
    """Run `overrides` through Hydra; `asked`: what the user typed (for the resume line)."""
    try:
        prepared = prepare(verb, overrides)
        points, base = prepared.points, prepared.base
        # Only a sweep goes through the launcher: `run` is one point on this machine.
        cluster = verb == "sweep" and "Slurm" in str(base.hydra.launcher.get("_target_", ""))
        backend = resolve_backend(base.backend, cluster)
        if backend == "cuda" and not cluster:
            _gpu_launch(list(prepared.built.values()))
        if backend in ("cuda", "cpu") and not cluster:  # a job over several GPUs: its ranks run here
            check_here([p.replace(backend=backend) for p in prepared.built.values()],
                       visible_devices() if backend == "cuda" else [])
        if verb == "sweep" and local.chosen(base):
            local.workers(base.hydra.launcher.get("workers"))  # checked before anything is written
    except ConfigError as e:
        return _fail(str(e))
    results_dir = Path(base.results_dir).expanduser().resolve()
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S-%f")
    extra = [path_override("results_dir", results_dir)]
    if not any(o.split("=", 1)[0] == "backend" for o in overrides):
        extra.append(f"backend={backend}")  # resolved once, so run_ids don't depend on the host
    dir_key = "hydra.sweep.dir" if verb == "sweep" else "hydra.run.dir"
    given = [o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0] == dir_key]
    if given:  # the user's own output dir wins; we only need to know it
        out = Path(given[-1]).expanduser().resolve()
        overrides = [o for o in overrides if o.split("=", 1)[0] != dir_key]
    elif verb == "sweep":
        out = results_dir / base.sweep / stamp
    else:
        out = results_dir / "runs" / stamp
    passed = [*without(overrides, extra), path_override(dir_key, out), *extra]
    hydra_args = passed if verb == "run" else ["--multirun", *passed]
    try:
        make_out_dir(out, dir_key if given else "results_dir")
    except ConfigError as e:
        return _fail(str(e))
    # Every point asked for, before any runs: `report` names those an interrupted sweep never ran.
    resolved = prepared.resolved(os.getcwd(), cluster, extra, results_dir)
    results.write_manifest(out, prepared.manifest(resolved, verb))
    print(f"harness: {verb}: {len(points)} point(s) on backend={backend} -> {out}", file=sys.stderr)
    if verb == "sweep" and local.chosen(base):
        return _sweep_here(resolved, base, out, results_dir, asked or overrides)
    sys.argv = [sys.argv[0], *hydra_args]  # hydra.main reads its overrides from argv
    callbacks.arm(out, len(points), asked or overrides)  # Hydra's callback shows progress and writes the report
    try:
        with interrupt.stoppable():
            try:
                main()
            except SystemExit as e:  # Hydra's own way to stop on an error of its own
                if e.code not in (0, None):
                    print(f"harness: Hydra stopped with code {e.code}; rows written so far are kept", file=sys.stderr)
    except interrupt.Interrupted as e:
        return _interrupted(verb, asked or overrides, out, len(points), e)
    return callbacks.finish()


def _sweep_here(points: list, base, out: Path, results_dir: Path, asked: list[str]) -> int:
    """hydra/launcher=harness_local: the points from threads of this process (launch.local)."""
    from harness.cli.progress import SweepProgress

    expected = len(points)
    try:
        with interrupt.stoppable(), SweepProgress(out, expected):
            report_imported = import_report_meanwhile()
            local.sweep(points, local.workers(base.hydra.launcher.get("workers")), out, results_dir, os.getcwd())
            threads.join(report_imported)
    except interrupt.Interrupted as e:
        return _interrupted("sweep", asked, out, expected, e)
    return aggregate(out, expected=expected, asked=asked)


def _interrupted(verb: str, asked: list[str], out: Path | None, expected: int, e) -> int:
    """Ctrl-C or SIGTERM: every point's process stopped, the rows kept, one line to go on from.
    This process ends at once: the points' threads would wait for points forked from the zygote,
    which stop when this process's end closes their sockets (and a plan's would search on).
    `out` None: a plan or calibration (interrupt.resume_line)."""
    from harness.launch.runner import STOPPING

    with interrupt.stoppable():  # a second Ctrl-C while stopping changes nothing
        STOPPING.set()  # the points' threads write no row for a point stopped with the sweep
        callbacks.abandon()
        interrupt.stop_everything_started()
        interrupt.say(interrupt.resume_line(verb, asked, out, expected, e))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(e.exit_code)


def _searching(verb: str, rest: list[str], asked: list[str]) -> int:
    """plan and calibrate: their points run from threads of this process; on Ctrl-C or SIGTERM
    every point's process stops and this process ends at once (the threads would start more)."""
    if verb == "plan":
        from harness.cli.plan import main as plan

        def run(overrides: list[str]) -> int:
            return plan(overrides, asked)
    else:
        from harness.cli.calibrate import main as run
    try:
        with interrupt.stoppable():
            return run(rest)
    except interrupt.Interrupted as e:
        return _interrupted(verb, asked, None, 0, e)


# Hydra's flags that show the config, the help or the search path, and run nothing
_SHOWING = frozenset({"--help", "-h", "--hydra-help", "--version", "--cfg", "-c", "--resolve", "--package", "-p",
                      "--info", "-i", "--shell-completion", "-sc"})


def _flags_apart(args: list[str]) -> tuple[list[str], list[str]]:
    """Hydra's flags, each with its value (`--cfg job`, `--info defaults`, `-cn name`: the word
    right after a flag, unless it is an override: those have an `=` or start with `~`), and the
    overrides."""
    flags: list[str] = []
    overrides: list[str] = []
    after_flag = False
    for a in args:
        if a.startswith("-"):
            flags.append(a)
            after_flag = True
            continue
        (flags if after_flag and "=" not in a and not a.startswith("~") else overrides).append(a)
        after_flag = False
    return flags, overrides


def entry(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return EXIT_OK if argv else EXIT_USAGE
    verb, rest = argv[0], argv[1:]
    if verb in ("run", "sweep", "plan", "calibrate"):
        try:
            rest = with_grid_files(user_card_and_free_text(rest))
        except ConfigError as e:
            return _fail(str(e))
    # Each verb imports only what it needs: torch, pandas and Hydra take seconds to import.
    if verb == "diagnose":
        from harness.cli.diagnose import main as diagnose

        return diagnose(rest)
    if verb == "replay":
        from harness.cli.replay import main as replay

        return replay(rest)
    if verb == "script":
        from harness.cli.script import main as script

        return script(rest)
    if verb in ("plan", "calibrate"):
        return _searching(verb, rest, argv[1:])
    if verb == "report":
        if len(rest) != 1:
            return _fail("report takes one path: a sweep dir, a run dir or a result.json")
        path = Path(rest[0])
        if not path.exists():
            return _fail(f"report: no such file or directory: {path}")
        if path.is_file() and not results.is_json(path):
            return _fail(f"report: {path} is not a result.json (report takes a sweep dir, a run dir or a result.json)")
        if path.is_dir() and not (path / results.MANIFEST_FILE).exists() and not results.has_rows(path):
            # (a sweep's dir without rows holds its manifest: its points left none, exit 1)
            return _fail(f"report: {path} holds no result.json and no sweep's points.json (report takes a sweep "
                         "dir, a run dir or a result.json)")
        return aggregate(path)
    if verb not in ("run", "sweep"):
        return _fail(f"unknown verb '{verb}' (run, sweep, plan, calibrate, report, replay, diagnose, script)")
    flags, overrides = _flags_apart(rest)
    running = next((f for f in flags if f.startswith("-") and f.split("=", 1)[0] not in _SHOWING), None)
    if running is not None:  # (--multirun ran the grid in this process: no validation first, no report)
        return _fail(f"{running}: not a flag the harness takes; `python -m harness sweep` runs a grid, and of "
                     f"Hydra's own flags those that only show things: {', '.join(sorted(f for f in _SHOWING if f[1] == '-'))}")
    if flags:  # --cfg, --info, --help: Hydra's own, nothing runs
        sys.argv = [sys.argv[0], *overrides, *flags]  # (argparse takes the overrides in one run, first)
        main()
        return EXIT_OK
    return _launch(verb, overrides, asked=argv[1:])
