"""`python -m harness plan [overrides]`: per card, the largest batch (or sequence) that fits.

The grid (sweeps=<name>, key=a,b sweeps) names the groups; `plan.axis` is searched, not swept.
Every probe is a point run like a sweep's, with its row under runs/; the frontiers go to
frontier.parquet/.csv and into the report.
"""

from __future__ import annotations

import datetime as dt
import sys
from pathlib import Path

from harness.cli.common import aggregate, make_out_dir, own_out_dir, unknown_flag
from harness.config.compose import compose, expand_grid, parallelism, split_overrides
from harness.errors import EXIT_USAGE, ConfigError
from harness.launch.point import to_point
from harness.plan.frontier import Planner
from harness.record import results
from harness.report import words


def main(overrides: list[str], asked: list[str] | None = None) -> int:
    """`asked`: the overrides as typed (`overrides` with a grid file staged), for the report's advice."""
    import pandas as pd

    if unknown_flag(overrides):
        print(f"harness: error: {unknown_flag(overrides)}: unknown flag (plan takes overrides only)", file=sys.stderr)
        return EXIT_USAGE
    given, out_key, overrides = own_out_dir(overrides)
    try:
        base = compose(split_overrides(overrides)[0])
        if base.backend in ("cuda", "cpu"):
            raise ConfigError("backend", "plans search on the virtual GPU: use backend=sim (or auto)")
        # auto too: a plan's probes never take a GPU
        overrides = [*(o for o in overrides if o.split("=", 1)[0] != "backend"), "backend=sim"]
        results_dir = Path(base.results_dir).expanduser().resolve()
        out = given or results_dir / base.sweep / dt.datetime.now().strftime("%Y%m%d-%H%M%S-%f")
        planner = Planner(out, results_dir, compose, to_point)
        groups = planner.groups(expand_grid(overrides))
        make_out_dir(out, out_key)
    except ConfigError as e:
        print(f"harness: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    total = sum(len(g.values) for g in groups)
    print(f"harness: plan: {len(groups)} group(s) x {len(planner.cards(groups[0]))} card(s), "
          f"searching {groups[0].cfg.plan.axis} ({total} grid points in all) on the virtual GPU -> {out}",
          file=sys.stderr)
    rows = planner.plan(groups, parallelism())
    results.write_frontier(pd.DataFrame(words.with_serving_why(rows)), out)
    return aggregate(out, asked=asked)
