"""Composing configs the way `python -m harness` does, and expanding a sweep into its points.

Used before any work: every point of a grid is composed and validated first, so a typo or an
impossible value fails in a second with the key named, not an hour into a sweep.
"""

from __future__ import annotations

import copy
import functools
import math
import os
import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from harness.config import schema
from harness.config.point import AUTO_NODES, fewest_nodes
from harness.errors import ConfigError

# The config ships inside the package (a wheel holds it too); sweeps/ is one of its groups.
CONF_DIR = Path(__file__).resolve().parents[1] / "conf"

# A point on the virtual GPU needs about 2 GiB of host memory (torch + transformers + trace).
_HOST_BYTES_PER_POINT = 2 * 1024**3


def _available_host_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # reported in KiB
    except OSError:
        pass
    return None


def cores() -> int:
    """The CPU cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def parallelism() -> int:
    """Points to run at once: one per core, fewer if host memory is short."""
    n = cores()
    avail = _available_host_bytes()
    by_memory = n if avail is None else avail // _HOST_BYTES_PER_POINT
    return max(1, min(n, by_memory))


def slurm_minutes(timeout_s) -> int:
    """A job's Slurm time limit: the point's timeout, plus time to start and write its row."""
    return math.ceil(float(timeout_s) / 60) + 5


def slurm_gres(backend, gres, per_node=1):
    """The card's gres for a point on the card, `per_node` GPUs a node (the count it names replaced);
    none off the card (the virtual GPU, CPU ranks)."""
    if backend in ("sim", "cpu") or not gres:
        return None
    parts = str(gres).split(":")
    return ":".join([*(parts[:-1] if parts[-1].isdigit() else parts), str(per_node)])


def slurm_gpus(backend, gres, per_node=1):
    """`per_node` GPUs by --gpus-per-node where the card names no gres (which carries the count)."""
    return None if backend in ("sim", "cpu") or gres else int(per_node)


def slurm_ranks_per_node(backend, dp_shard, dp_replicate, tp, nodes, gpus_per_node=8):
    """The Slurm tasks a node runs: a job over several GPUs run for real is one task per rank; on
    the virtual GPU one rank is traced, in one task."""
    if backend == "sim":
        return 1
    return int(dp_shard) * int(dp_replicate) * int(tp) // slurm_nodes(backend, nodes, dp_shard, dp_replicate, tp,
                                                                      gpus_per_node)


def slurm_nodes(backend, nodes, dp_shard=1, dp_replicate=1, tp=1, gpus_per_node=8):
    """The nodes a point's job takes: parallel.nodes, or with `auto` the fewest of its card's that
    hold its GPUs (as the point resolves it); one on the virtual GPU."""
    if backend == "sim":
        return 1
    if nodes == AUTO_NODES:
        return fewest_nodes(int(dp_shard) * int(dp_replicate) * int(tp), int(gpus_per_node))
    return int(nodes)


_RESOLVERS: dict[str, Callable[..., Any]] = {
    "harness_parallelism": parallelism, "harness_slurm_minutes": slurm_minutes,
    "harness_slurm_gres": slurm_gres, "harness_slurm_gpus": slurm_gpus,
    "harness_slurm_ranks_per_node": slurm_ranks_per_node, "harness_slurm_nodes": slurm_nodes,
}


def as_dict(node, resolve: bool = True) -> dict[str, Any]:
    """A config node as plain data (a mapping node: a point, a card, a launcher's options)."""
    out = OmegaConf.to_container(node, resolve=resolve)
    if not isinstance(out, dict):
        raise TypeError(f"expected a mapping config node, got {type(out).__name__}")
    return {str(k): v for k, v in out.items()}


def register_resolvers() -> None:
    for name, fn in _RESOLVERS.items():
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn)


schema.register()
register_resolvers()


_COMPOSE_LOCK = threading.Lock()  # Hydra's GlobalHydra is process-wide: one compose at a time


def compose(overrides: list[str], with_hydra: bool = False):
    """The config `python -m harness run <overrides>` would see (ConfigError on bad input); safe
    to call from several threads.

    Hydra composes the defaults list (the config groups: model=, gpu=, sweeps=, ...) once per
    distinct choice of them, then applies the value overrides (batch_size=4, +workload.args.x=1)
    with its own function, so a grid's points cost a copy each instead of a composition
    (~0.15 s each)."""
    if with_hydra:  # the sweep's own config (launcher, grid): composed once per command line
        key = ("hydra", *overrides)
        with _COMPOSE_LOCK:
            cached = _COMPOSED.get(key)
        if cached is None:
            cached = _hydra_compose(list(overrides), True)
            with _COMPOSE_LOCK:
                _COMPOSED[key] = cached
        return copy.deepcopy(cached)
    try:
        parsed = _parse(overrides)
    except Unreadable:
        raise
    except ConfigError:
        return _hydra_compose(list(overrides), False)  # Hydra's own message for it
    groups = [text for text, o in zip(overrides, parsed) if _is_group(o.key_or_group)]
    values = [o for o in parsed if not _is_group(o.key_or_group)]
    for o in values:
        if o.is_sweep_override():  # applied below, Hydra would make its text the value
            raise ConfigError(o.key_or_group, sweep_outside_a_sweep(o.key_or_group, o.input_line))
    key = tuple(groups)
    with _COMPOSE_LOCK:
        base = _COMPOSED.get(key)
    if base is None:
        base = _hydra_compose(groups, False)
        with _COMPOSE_LOCK:
            _COMPOSED[key] = base
    from hydra._internal.config_loader_impl import ConfigLoaderImpl

    cfg = copy.deepcopy(base)
    try:
        ConfigLoaderImpl._apply_overrides_to_config(values, cfg)
    except Exception:  # a value Hydra refuses: its own composition says why, as it would have
        return _hydra_compose(list(overrides), False)
    return cfg


_COMPOSED: dict[tuple[str, ...], Any] = {}  # the config groups' choices -> Hydra's composition


class Unreadable(ConfigError):
    """An override Hydra's grammar cannot read (its message names the key, as Hydra's does not)."""


def _parse(overrides: list[str]) -> list:
    from hydra.errors import OverrideParseException

    parsed = []
    for text in overrides:
        try:
            parsed.append(_parse_one(text))
        except OverrideParseException as e:
            key, _, value = text.partition("=")
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise Unreadable(key.lstrip("+~") or "overrides", f"Hydra's override grammar cannot read '{value}' "
                              f"({first}): quote the value past the shell, as in '{key}=\"{value}\"'") from e
        except Exception as e:
            raise friendly_error(e) from e
    return parsed


@functools.lru_cache(maxsize=4096)
def _parse_one(text: str):
    """One override as Hydra parses it (its grammar's parser costs ~10 ms a point; a grid repeats
    a few texts across all of its points). Hydra only reads what it returns."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return OverridesParser.create().parse_overrides([text])[0]


def _is_group(key: str) -> bool:
    """A config group (chosen in the defaults list), or Hydra's own config: what only Hydra's
    composition can apply."""
    return "/" in key or key == "hydra" or key.startswith("hydra.") or (CONF_DIR / key).is_dir()


def _hydra_compose(overrides: list[str], with_hydra: bool):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    with _COMPOSE_LOCK:
        GlobalHydra.instance().clear()
        try:
            with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR)):
                return hydra_compose("config", overrides=list(overrides),
                                     return_hydra_config=with_hydra)
        except Exception as e:  # Hydra and OmegaConf raise many types; all are bad input here
            raise friendly_error(e) from e
        finally:
            GlobalHydra.instance().clear()


def friendly_error(e: Exception) -> ConfigError:
    """One line naming the key, from Hydra's and OmegaConf's multi-line messages."""
    msg = str(e)
    m = re.search(r"Could not find '([\w/.-]+)/([^']+)'", msg)
    if m:
        group, option = m.group(1), m.group(2)
        choices = sorted(p.stem for p in _group_dir(group).glob("*.yaml"))
        return ConfigError(group, f"no option '{option}' (choices: {', '.join(choices)})")
    inner: BaseException = e
    while inner.__cause__ is not None and getattr(inner, "full_key", None) is None:
        inner = inner.__cause__  # Hydra wraps OmegaConf's error, which knows the key
    key = getattr(inner, "full_key", None)
    if key:
        first = str(inner).strip().splitlines()[0]
        if "not in" in first:
            first = "unknown key"
            if str(key).startswith("workload.args."):  # a job's own keys are new to the schema
                first += f" (a custom job's own argument is a new key: +{key}=...)"
        return ConfigError(str(key), first)
    first = msg.strip().splitlines()[0] if msg.strip() else type(e).__name__
    if first.startswith("Ambiguous value for argument"):  # a=1,2 outside a sweep
        m = re.search(r"argument '([\w.+~/-]+)=", first)
        if m:
            key = m.group(1).lstrip("+~")
            return ConfigError(key, sweep_outside_a_sweep(key, first.split("'")[1]))
    m = re.search(r"(?:override|argument) '?([\w.+~/-]+)", first)
    return ConfigError(m.group(1).lstrip("+~") if m else "overrides", first)


def one_conf(override: str) -> str:
    """An `allocator.conf=...` override as one value where one setting is all a command takes
    (replay, script): PYTORCH_ALLOC_CONF's own string, commas and all, quoted for Hydra unless the
    user quoted it. Other overrides as they are."""
    key, sep, value = override.partition("=")
    if key != "allocator.conf" or not sep or value[:1] in ("'", '"'):
        return override
    return f'{key}="' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def sweep_outside_a_sweep(key: str, text: str) -> str:
    """Why `key=a,b` is refused where one point is asked for."""
    why = f"'{text}': several values are a sweep (python -m harness sweep ...)"
    if key == "allocator.conf":  # PYTORCH_ALLOC_CONF separates its keys with commas too
        why += "; one setting of several keys is quoted: 'allocator.conf=\"max_split_size_mb:128,expandable_segments:True\"'"
    return why


_STAGED: dict[Path, Path] = {}  # a user's grid file -> the search-path root it is staged under


def _is_path(option: str) -> bool:
    return "/" in option or option.endswith((".yaml", ".yml"))


def with_grid_files(overrides: list[str]) -> list[str]:
    """`sweeps=path/to/grid.yaml` (a user's grid file) as Hydra can compose it: the file staged as
    option `<stem>` of a `sweeps/` group in a directory of this process's own, which joins any
    `hydra.searchpath` the user gave. Hydra composes every job in this process, so the staging
    lives as long as it does."""
    import atexit
    import shutil
    import tempfile

    roots, out = [], []
    for text in overrides:
        key, eq, value = text.partition("=")
        if key.lstrip("+") != "sweeps" or not eq or not _is_path(value):
            out.append(text)
            continue
        path = Path(value).expanduser().resolve()
        if not path.is_file():
            raise ConfigError("sweeps", f"no such grid file: {value}")
        if path.read_text(errors="replace").split("\n", 1)[0].strip() != "# @package _global_":
            raise ConfigError("sweeps", f"grid file {value}: its first line must be '# @package _global_' "
                              "(a grid sets the point's own keys, as harness/conf/sweeps/*.yaml do)")
        # A built-in grid of the same name would be found first (the package's config leads the path).
        name = path.stem if not (CONF_DIR / "sweeps" / f"{path.stem}.yaml").exists() else f"{path.stem}-file"
        if path not in _STAGED:
            root = Path(tempfile.mkdtemp(prefix="harness-grid-"))
            atexit.register(shutil.rmtree, root, True)
            (root / "sweeps").mkdir()
            shutil.copyfile(path, root / "sweeps" / f"{name}.yaml")
            _STAGED[path] = root
        roots.append(_STAGED[path])
        out.append(f"sweeps={name}")
    if not roots:
        return out
    given = [t for t in out if t.split("=", 1)[0] == "hydra.searchpath"]
    entries = [e.strip() for t in given for e in t.split("=", 1)[1].strip("[]").split(",") if e.strip()]
    entries += [f"file://{r}" for r in roots]
    return [t for t in out if t not in given] + [f"hydra.searchpath=[{','.join(entries)}]"]


def _group_dir(group: str) -> Path:
    return CONF_DIR / group


def split_overrides(overrides: list[str]) -> tuple[list[str], list[str]]:
    """(plain overrides, sweep overrides such as batch_size=1,2,4)."""
    parsed = _parse(overrides)
    plain: list[str] = []
    sweeps: list[str] = []
    for text, o in zip(overrides, parsed):
        (sweeps if o.is_sweep_override() else plain).append(text)
    return plain, sweeps


def _for_hydra(text: str) -> bool:
    """An override of Hydra's own config (hydra.* keys, hydra/ groups), not of the point's."""
    key = text.split("=", 1)[0].lstrip("+~")
    return key == "hydra" or key.startswith(("hydra.", "hydra/"))


def expand_grid(overrides: list[str]) -> list[list[str]]:
    """Every point of the sweep, as Hydra's sweeper will launch them: its grid (hydra.sweeper.params
    of the sweeps/<name>.yaml grid) with the command line's overrides after it, expanded by Hydra's
    own BasicSweeper (a command-line sweep of a key replaces the grid's values, a plain value pins
    it). Each point carries the overrides of Hydra's own config too, to compose like its job."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    plain, _ = split_overrides(overrides)
    params = compose(plain, with_hydra=True).hydra.sweeper.params  # None: a grid that only sets values
    grid = [f"{k}={v}" for k, v in (as_dict(params, resolve=False) if params else {}).items()]
    for_hydra = [t for t in overrides if _for_hydra(t)]
    try:
        parsed = OverridesParser.create().parse_overrides(grid + [t for t in overrides if not _for_hydra(t)])
        (jobs,) = BasicSweeper.split_arguments(parsed, None)
    except Exception as e:  # Hydra's parser and sweeper errors: bad input, named by its override
        raise friendly_error(e) from e
    return [[*for_hydra, *job] for job in jobs]


# Hydra's override grammar: a value with these characters is a function call, a list or a sweep
# unless quoted. The string fields users type free text into are quoted for them; so are paths
# that the grammar cannot read as they are (`~/runs` where the shell leaves the tilde, as zsh does
# after `=`; a parenthesis), but for one with a comma (model.config_json=a.json,b.json sweeps).
_FREE_TEXT = ("gpu.name", "gpu.device_name", "gpu.source", "gpu.non_pytorch_source", "sweep")
_PATHS = ("results_dir", "model.config_json", "hydra.run.dir", "hydra.sweep.dir")


def _quoted(value: str) -> str:
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def path_override(key: str, path) -> str:
    """`key=path` as Hydra's grammar reads it (quoted where it could not read it as it is)."""
    text = f"{key}={path}"
    return f"{key}={_quoted(str(path))}" if _unreadable(text) else text


def _unreadable(text: str) -> bool:
    from hydra.errors import OverrideParseException

    try:
        _parse_one(text)
    except OverrideParseException:
        return True
    return False


def user_card_and_free_text(overrides: list[str]) -> list[str]:
    """Overrides as Hydra must see them: free text (a card named 'My card (12GB)') quoted, and a
    card given by its size alone (`gpu.memory_bytes=...`) named as the user's own, so that its rows
    do not carry the name of the catalog card it was composed over."""
    out = []
    for text in overrides:
        key, eq, value = text.partition("=")
        if eq and value and value[0] not in "'\"" and (
                key.lstrip("+") in _FREE_TEXT
                or key.lstrip("+") in _PATHS and "," not in value and _unreadable(text)):
            text = f"{key}={_quoted(value)}"
        out.append(text)
    keys = {t.split("=", 1)[0].lstrip("+~") for t in out}
    if "gpu.memory_bytes" in keys and not keys & {"gpu", "gpu.name"}:
        size = next(t.split("=", 1)[1] for t in out if t.split("=", 1)[0].lstrip("+~") == "gpu.memory_bytes")
        out += [f"gpu.name='own card ({size} B)'", "gpu.device_name=''", "gpu.memory_spread_bytes=0",
                "gpu.source='the user: gpu.memory_bytes'", "gpu.slurm.gres=null", "gpu.slurm.constraint=null"]
    return out
