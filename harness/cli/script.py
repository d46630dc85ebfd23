"""`python -m harness script file.py [its args] [gpu=...] [allocator=...]`: a whole script, as it
is, on the virtual GPU. Its own `torch.cuda` readings, snapshots and OOMs are the virtual card's.

Arguments `gpu=...`, `gpu.<key>=...`, `allocator=...` and `allocator.<key>=...` are the harness's,
wherever they stand; everything else goes to the script. Exit codes: the script's own (0 when it
ends normally, its SystemExit code, 1 when it raises: the error is printed with its file and
line; 130 on Ctrl-C, with the peaks so far), 2 when the command itself is wrong (no such script,
a bad gpu=/allocator= value).
"""

from __future__ import annotations

import os
import re
import sys
import traceback

from harness.errors import EXIT_USAGE, ConfigError
from harness.units import GiB

_HARNESS_KEY = re.compile(r"^(gpu|allocator)(\.[\w.]+)?=")


def split_args(args: list[str]) -> tuple[str, list[str], list[str]]:
    """(script, the script's args, the harness's overrides)."""
    ours = [a for a in args if _HARNESS_KEY.match(a)]
    rest = [a for a in args if not _HARNESS_KEY.match(a)]
    if not rest:
        raise ConfigError("script", "names the script to run: script file.py [its args] [gpu=...] [allocator=...]")
    return rest[0], rest[1:], ours


def _card_and_settings(overrides: list[str]):
    """The card, the allocator settings and where they come from: allocator= (None), else the
    environment the script runs in, as torch reads it (the variable's name; "" where none is set)."""
    from harness.allocator.settings import AllocSettings
    from harness.config import alloc_conf
    from harness.config.compose import as_dict, compose, one_conf, user_card_and_free_text
    from harness.config.point import Card

    cfg = compose(user_card_and_free_text([one_conf(o) for o in overrides]))
    card = Card.from_dict(as_dict(cfg.gpu))
    if any(o.startswith(("allocator=", "allocator.")) for o in overrides):
        return card, AllocSettings.from_conf(cfg.allocator.conf), None
    name, conf = alloc_conf.from_environment(os.environ) or ("", "")
    try:
        return card, AllocSettings.from_conf(conf), name
    except ConfigError as e:
        raise ConfigError(name, e.message) from None


def _print_error(e: BaseException) -> None:
    """The script's error as Python prints it, without the harness's frames in between."""
    from harness.probe.jobs import UserCodeError

    if isinstance(e, UserCodeError):
        print(f"harness: {e}", file=sys.stderr)
        return
    from harness.probe.sim.virtual_cuda import shown

    frames = shown(traceback.extract_tb(e.__traceback__))
    print("Traceback (most recent call last):", file=sys.stderr)
    print("".join(traceback.format_list(frames)), end="", file=sys.stderr)
    print("".join(traceback.format_exception_only(type(e), e)), end="", file=sys.stderr)


def main(args: list[str]) -> int:
    try:
        script, script_args, overrides = split_args(args)
        from harness.probe.sim.script import run_script, script_path

        path = script_path(script)
        card, settings, source = _card_and_settings(overrides)
    except (ConfigError, FileNotFoundError, ValueError) as e:
        print(f"harness: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    from harness.config import alloc_conf
    from harness.report import words

    found = alloc_conf.from_environment(os.environ)
    if source is None and found and found[1] != settings.conf:
        print(f"harness: allocator.conf='{settings.conf}' stands in for {found[0]}='{found[1]}' from the environment",
              file=sys.stderr)
    run = run_script(path, script_args, card, settings, os.environ if source is not None else None)
    sys.stdout.flush()
    if run.error is not None:
        _print_error(run.error)
    peaks = run.peaks
    print(f"harness: {path.name} on a virtual {card.name} ({card.room() / GiB:.2f} GiB for PyTorch"
          f"{', ' + run.settings.conf if run.settings.conf else ''}"
          f"{' (' + source + ')' if source and run.settings.conf else ''}): peak allocated "
          f"{peaks['allocated_bytes'] / GiB:.2f} GiB, peak reserved {peaks['reserved_bytes'] / GiB:.2f} GiB"
          f"{', out of memory' if run.stats['num_ooms'] else ''}", file=sys.stderr)
    if run.value_reads:
        print(f"harness: values read from tensors (first at {run.value_reads[0]}) are stand-ins (0, or True): "
              "the virtual GPU has shapes, not values", file=sys.stderr)
    if run.unmodelled:
        print(f"harness: {words.unmodelled(', '.join(run.unmodelled))}", file=sys.stderr)
    if run.compiled:
        print(f"harness: torch.compile (first at {run.compiled[0]}) ran the code eagerly: these are eager "
              "peaks; a compiled graph's can be lower", file=sys.stderr)
    return run.exit_code
