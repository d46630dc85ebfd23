"""`python -m harness calibrate [overrides]`: the same points on the virtual GPU and on this
machine's GPU, predicted beside measured.

Each point runs twice, as a sweep would run it (rows under runs/, reused by later runs): first
every sim point (on the cores), then every cuda point (one per card at a time). The comparison goes
to calibration.parquet/.csv beside results.parquet and the report, and to the terminal.
"""

from __future__ import annotations

import datetime as dt
import os
import sys
from pathlib import Path

from harness.analysis import calibration
from harness.cli.common import aggregate, make_out_dir, own_out_dir, prepare, unknown_flag
from harness.config import cards as catalog
from harness.config.compose import compose, parallelism
from harness.errors import EXIT_USAGE, ConfigError
from harness.launch import gpus
from harness.launch.gpus import check_cards
from harness.launch.point import to_point
from harness.launch.runner import run_point
from harness.launch.threads import map_threads
from harness.report import console

CALIBRATION_FILE = "calibration.parquet"


def main(overrides: list[str]) -> int:
    if unknown_flag(overrides):
        print(f"harness: error: {unknown_flag(overrides)}: unknown flag (calibrate takes overrides only)", file=sys.stderr)
        return EXIT_USAGE
    given, out_key, overrides = own_out_dir(overrides)
    try:
        if any(o.split("=", 1)[0].lstrip("+~") == "backend" for o in overrides):
            raise ConfigError("backend", "calibrate runs every point on both backends; leave backend unset")
        devices = gpus.visible_devices()
        if not devices:  # no GPU: exit 2 before anything runs
            raise ConfigError("backend", "calibrate measures each point on this machine's CUDA GPU beside the "
                              "virtual GPU, and no GPU is visible here (CUDA_VISIBLE_DEVICES, the driver)")
        prepared = prepare("sweep", overrides)
        points, base = prepared.points, prepared.base
        check_cards(list(prepared.built.values()), gpus.describe(devices))
        results_dir = Path(base.results_dir).expanduser().resolve()
        out = given or results_dir / base.sweep / f"calibrate-{dt.datetime.now().strftime('%Y%m%d-%H%M%S-%f')}"
        make_out_dir(out, out_key)
    except ConfigError as e:
        print(f"harness: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    print(f"harness: calibrate: {len(points)} point(s) on sim and on {len(devices)} GPU(s) -> {out}", file=sys.stderr)
    sim = _run_all(points, "sim", out, results_dir, parallelism())
    cuda = _run_all(points, "cuda", out, results_dir, len(devices))
    recorded = catalog.record_measured(cuda, {c.name: c.key for c in catalog.cards()})
    for key, m in recorded.items():
        print(f"harness: calibrate: gpu={key}: total {m['memory_bytes']:,} B, non-PyTorch "
              f"{m['non_pytorch_bytes'] / 2**30:.2f} GiB measured -> {catalog.measured_path()}", file=sys.stderr)
    df = calibration.compare(list(zip(sim, cuda)))
    df.to_parquet(out / CALIBRATION_FILE, index=False)
    df.to_csv(out / "calibration.csv", index=False)

    code = aggregate(out, expected=2 * len(points))
    console.render_calibration(df, calibration.summary(df))
    return code


def _run_all(points: list[list[str]], backend: str, out: Path, results_dir: Path, width: int) -> list[dict]:
    """Every point on `backend`, `width` at a time; rows in the points' order."""
    def one(i: int) -> dict:
        point = to_point(compose([*points[i], f"backend={backend}"]), points[i], os.getcwd(),
                         results_dir=results_dir)
        return run_point(point, out / "runs" / f"{i}-{backend}", results_dir)

    return map_threads(one, range(len(points)), width)
