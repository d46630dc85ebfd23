"""What the verbs share: every point composed and validated before work, and a finished (or
partial) sweep aggregated into its results and report."""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig

from harness.config.compose import compose, expand_grid, split_overrides
from harness.config.point import Point, WorkloadName
from harness.config.validate import validate
from harness.errors import EXIT_OK, EXIT_ROW_ERROR, ConfigError
from harness.record import results  # (pandas only where rows become a table)


def unknown_flag(args: list[str]) -> str | None:
    """The first flag among a verb's arguments (the verbs past run and sweep take overrides only)."""
    return next((a for a in args if a.startswith("-")), None)


@dataclass
class Prepared:
    points: list[list[str]]  # each point's overrides, as Hydra will launch them
    base: DictConfig  # the config with hydra
    configs: dict[tuple[str, ...], DictConfig]  # each distinct point, composed
    built: dict[tuple[str, ...], Point]  # and its point, as validated

    def resolved(self, cwd: str, cluster: bool, extra: list[str], results_dir: Path) -> list:
        """Every point as its job runs it (launch.point.to_point; `extra`: the overrides the CLI adds
        to each, as Hydra adds them to its jobs), in order: their run_ids are the jobs' own."""
        from harness.launch.point import to_point

        return [to_point(self.configs[tuple(p)], [*without(p, extra), *extra], cwd, cluster=cluster,
                         results_dir=results_dir, built=self.built[tuple(p)]) for p in self.points]

    def manifest(self, resolved: list, verb: str) -> list[dict]:
        """The sweep's manifest from its resolved points (each in Hydra's run dir for the verb:
        conf/config.yaml's hydra.sweep.subdir for a sweep's, the command's own for a run)."""
        return [results.manifest_entry(point, p, f"runs/{i}" if verb == "sweep" else ".")
                for i, (point, p) in enumerate(zip(resolved, self.points))]


def without(overrides: list[str], added: list[str]) -> list[str]:
    """`overrides` less those of a key the CLI sets itself in `added` (a typed results_dir=runs, where
    `added` has its absolute path): a row's overrides name each key once."""
    keys = {_key(o) for o in added}
    return [o for o in overrides if _key(o) not in keys]


# Hydra's own output directories: where a command's rows go when the user names one
OUT_DIR_KEYS = ("hydra.sweep.dir", "hydra.run.dir")


def own_out_dir(overrides: list[str]) -> tuple[Path | None, str, list[str]]:
    """The output directory `overrides` name (OUT_DIR_KEYS, the last given), the key it was given
    by (else results_dir, which the default lies under: what a directory nobody can write to is
    blamed on), and the overrides without them: for the verbs that run their points themselves
    (plan, calibrate), as a sweep takes its hydra.sweep.dir, not a knob of any point."""
    given = [o for o in overrides if _key(o) in OUT_DIR_KEYS]
    rest = [o for o in overrides if _key(o) not in OUT_DIR_KEYS]
    if not given:
        return None, "results_dir", rest
    return Path(given[-1].split("=", 1)[1]).expanduser().resolve(), _key(given[-1]), rest


def make_out_dir(out: Path, key: str = "results_dir") -> None:
    """Where a command's rows go, made before anything runs: a path nobody can write to is bad
    input (ConfigError naming `key`), not a traceback after the points ran."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(key, f"cannot write {out}: {e.strerror or e}") from None


def prepare(verb: str, overrides: list[str]) -> Prepared:
    """Every point composed and validated, before anything runs."""
    points = expand_grid(overrides) if verb == "sweep" else [overrides]
    # A knob a point's job ignores is refused where the grid varies it (its rows would be one run
    # twice), or where it is typed with one value and no point uses it; a grid file's one value
    # (smoke's model under a custom job) only goes unused, as does a typed one some points use
    # (optimizer=sgd over workload=train,infer)
    values: dict[str, set[str]] = {}
    for p in points:
        for o in p:
            values.setdefault(_key(o), set()).add(o)
    varied = {k for k, v in values.items() if len(v) > 1}
    unused = {_key(o) for o in overrides} - varied  # typed, and ignored by every point so far
    why: dict[str, str] = {}
    configs: dict[tuple[str, ...], DictConfig] = {}
    built: dict[tuple[str, ...], Point] = {}
    for p in points:
        key = tuple(p)
        if key in configs:
            continue
        try:
            configs[key] = cfg = compose(p)
            built[key] = point = validate(cfg)
            ignored = _ignored(verb, point, p)
            clash = next((k for k in ignored if k in varied), None)
            if clash is not None:
                raise ConfigError(clash, ignored[clash])
            unused &= ignored.keys()
            why.update(ignored)
        except ConfigError as e:
            if len(points) > 1:
                knobs = [o for o in p if not _key(o).startswith("hydra.")]  # ours, not Hydra's
                raise ConfigError(e.key, f"{e.message} (point: {' '.join(knobs)})")
            raise
    first = next((k for k in map(_key, overrides) if k in unused), None)
    if first is not None:
        raise ConfigError(first, why[first])
    plain, _ = split_overrides(overrides)
    return Prepared(points, compose(plain, with_hydra=True), configs, built)


# Knobs a job of each workload ignores, and why: asked for, they are refused (a key ending in "."
# stands for every key under it).
_OPTIMIZER = ("optimizer", "optimizer.name", "optimizer.lr")  # which optimizer (optimizer.impl: how it steps)
_DECODES = {"workload.new_tokens": "the tokens decoded after the prompt: workload=infer only"}
_PRESETS = dict.fromkeys(("workload.target", "workload.args", "workload.args."),
                         "a job of your own's (workload=custom): the presets take none")
_IGNORED = {
    WorkloadName.custom: {**dict.fromkeys(_OPTIMIZER, "a custom job builds its own optimizer (workload.target); "
                                                      "only optimizer.impl applies to it"),
                          **dict.fromkeys(("model", "model."), "a custom job builds its own model "
                                                               "(workload.target): model= picks a preset's"),
                          **_DECODES},
    WorkloadName.train: {**_DECODES, **_PRESETS},
    WorkloadName.infer: {**dict.fromkeys((*_OPTIMIZER, "optimizer.impl"),
                                         "workload=infer runs no optimizer step: its rows would be one run"),
                         "workload.steps": "workload=infer runs its prefill and a step per decoded token: "
                                           "set workload.new_tokens", **_PRESETS},
}


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def _ignored(verb: str, point, overrides: list[str]) -> dict[str, str]:
    """The keys of `overrides` that the point's job (or the verb) would ignore, and why."""
    ignored = _IGNORED[point.workload.name]
    out = {}
    for o in overrides:
        key = _key(o)
        reason = ignored.get(key) or next((r for k, r in ignored.items() if k.endswith(".") and key.startswith(k)), None)
        if reason is not None:
            out[key] = reason
        elif verb != "plan" and (key == "plan" or key.startswith("plan.")):
            out[key] = f"sets the search of `python -m harness plan`, which `{verb}` does not run"
    return out


def import_report_meanwhile() -> threading.Thread:
    """`aggregate`'s imports (pandas, matplotlib, the analysis: 1-3 s) in a thread, while this
    process waits for the points (a core is idle while the zygote starts): the report then comes
    that much sooner after the last point. Join it before `aggregate` (which draws its figures in
    forked processes only when no other thread runs)."""
    def imports() -> None:
        from harness.analysis import kinds, verdict  # noqa: F401
        from harness.plan import fit  # noqa: F401
        from harness.report import console, document, words  # noqa: F401

    thread = threading.Thread(target=imports, name="import-report", daemon=True)
    thread.start()
    return thread


def aggregate(path: Path, expected: int | None = None, asked: list[str] | None = None) -> int:
    """Rows -> results.parquet/csv, the verdicts, the tables on the terminal, report.md/.html
    (`asked`: the overrides of the command that made them, as typed, for what to run next)."""
    # pandas, matplotlib and the analysis: a second of imports that a command refused as bad input
    # (checked before any of this) does not wait for
    from harness.analysis.kinds import with_kinds
    from harness.analysis.verdict import unspread_static, verdicts
    from harness.plan import fit
    from harness.report import console, document, words

    rows = results.load_rows(path)
    if not rows:
        print(f"harness: error: no result.json under {path}", file=sys.stderr)
        return EXIT_ROW_ERROR
    target = path if path.is_dir() else path.parent
    missing = results.missing_points(target, rows)
    df = results.to_frame(with_kinds(rows))
    judged = words.worded_verdicts(verdicts(df, missing or []), df)
    # the verdict's data (remedies, the card needed) and, derived from it, its words
    columns = {"verdict": "verdict", "remedies": "verdict_remedies", "card_needed": "verdict_card_needed",
               "card_count": "verdict_card_count", "card_headroom_bytes": "verdict_card_headroom_bytes",
               "detail": "verdict_detail"}
    df = df.merge(judged[["run_id", *columns]].rename(columns=columns), on="run_id", how="left")
    out = results.write(df, target)
    frontier = results.load_frontier(target)
    fit_long = fit.fit_table(df)
    static = unspread_static(judged, df)
    more_gpus = words.more_gpus(static, asked) if static else None
    # every file before the terminal's tables: a reader that goes away (`| head`) loses none of them
    html = document.write(target, df, fit_long, judged, frontier, title=f"Memory report: {target.name}",
                          more_gpus=more_gpus)
    try:
        console.render(df, fit_long, title=f"{out}")
        console.render_capacity(df, fit_long)
        console.render_verdicts(judged, more_gpus)
        console.render_frontier(frontier)
        gone = None
    except BrokenPipeError as e:  # raised again once stderr has said where everything went
        gone = e
    print(f"harness: report: {html} (and report.md, results.parquet, results.csv, fit.csv)", file=sys.stderr)
    bad = int(df["status"].isin(["error", "timeout"]).sum())
    if frontier is not None and not frontier.empty:
        bad += int((frontier["status"] != "ok").sum())
    if missing:  # the manifest names them
        print(f"harness: {len(missing)} of {len(missing) + len(df)} point(s) have no row (the sweep did not "
              "finish): " + "; ".join(" ".join(m["overrides"]) or "(defaults)" for m in missing[:10])
              + (f"; and {len(missing) - 10} more" if len(missing) > 10 else ""), file=sys.stderr)
    unnamed = (expected - len(df)) if expected is not None and missing is None else 0
    if unnamed > 0:
        print(f"harness: {unnamed} point(s) left no row", file=sys.stderr)
    if gone is not None:
        raise gone
    return EXIT_ROW_ERROR if bad or missing or unnamed > 0 else EXIT_OK
