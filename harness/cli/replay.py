"""`python -m harness replay <snapshot.pickle> [allocator=...] [gpu=... [fraction=...]] [torch_version=...] [--json]`."""

from __future__ import annotations

import json
import sys

from harness.config.compose import as_dict
from harness.config.point import Card
from harness.errors import EXIT_OK, EXIT_USAGE, ConfigError
from harness.units import GiB


def _parse(args: list[str]) -> tuple[str, dict, bool]:
    paths = [a for a in args if "=" not in a and not a.startswith("-")]
    flags = [a for a in args if a.startswith("-")]
    unknown = [f for f in flags if f != "--json"]
    if unknown:
        raise ConfigError(unknown[0], "unknown flag (replay takes --json)")
    if len(paths) != 1:
        raise ConfigError("replay", "takes one snapshot file: replay <snapshot.pickle> [allocator=...] [gpu=...]")
    overrides = dict(a.split("=", 1) for a in args if "=" in a)
    return paths[0], overrides, "--json" in flags


def _what_if(overrides: dict):
    """AllocSettings and Device from allocator=/allocator.conf=/gpu= (None: as recorded)."""
    from harness.allocator.model import Device
    from harness.allocator.settings import AllocSettings
    from harness.config.compose import compose, one_conf

    known = {"allocator", "allocator.conf", "gpu", "fraction", "torch_version"}
    for key in overrides:
        if key not in known:
            raise ConfigError(key, f"unknown key for replay (known: {', '.join(sorted(known))})")
    cfg_overrides = [one_conf(f"{k}={v}") for k, v in overrides.items() if k not in ("torch_version", "fraction")]
    fraction = None
    if "fraction" in overrides:  # torch.cuda.set_per_process_memory_fraction
        try:
            fraction = float(overrides["fraction"])
        except ValueError:
            fraction = -1.0
        if not 0.0 < fraction <= 1.0:
            raise ConfigError("fraction", f"must be in (0, 1], got '{overrides['fraction']}'")
        if "gpu" not in overrides:
            raise ConfigError("fraction", "needs gpu= (a fraction of which card?)")
    settings = device = card = None
    if cfg_overrides:
        cfg = compose(cfg_overrides)
        if "allocator" in overrides or "allocator.conf" in overrides:
            settings = AllocSettings.from_conf(cfg.allocator.conf)
        if "gpu" in overrides:
            device = Device.for_card(Card.from_dict(as_dict(cfg.gpu)), fraction)
            card = cfg.gpu.name
    return settings, device, card


def main(args: list[str]) -> int:
    from harness.allocator import oom_message
    from harness.allocator import snapshot as snap
    from harness.allocator.replay import replay_snapshot

    try:
        path, overrides, as_json = _parse(args)
        settings, device, card = _what_if(overrides)
        version = overrides.get("torch_version", "2.8")
        oom_message.era(version)
        data = snap.load(path)
    except (ConfigError, snap.SnapshotError) as e:
        print(f"harness: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except ValueError as e:
        print(f"harness: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    try:
        result = replay_snapshot(data, settings, device)
    except snap.SnapshotError as e:
        print(f"harness: error: {path}: {e}", file=sys.stderr)
        return EXIT_USAGE
    out = result.as_dict()
    out["snapshot"] = path
    out["gpu"] = card
    for oom in out["ooms"]:
        oom["message"] = oom_message.for_row(oom, version)
    if as_json:
        print(json.dumps(out, indent=1))
    else:
        _print(out, result)
    return EXIT_OK


def _print(out: dict, result) -> None:
    def g(n):
        return f"{n / GiB:.3f} GiB"

    print(f"snapshot          {out['snapshot']}")
    print(f"settings          {out['settings'] or '(default)'}" + (f" on {out['gpu']}" if out["gpu"] else ""))
    print(f"requests          {out['requests']}")
    print(f"peak reserved     {g(out['peak_reserved_bytes'])}")
    print(f"peak allocated    {g(out['peak_allocated_bytes'])}")
    print(f"final reserved    {g(out['final_reserved_bytes'])}")
    print(f"fragmentation     {g(out['fragmentation_at_peak_bytes'])} reserved but unallocated at the "
          f"reserved peak; inactive split peak {g(out['peak_inactive_split_bytes'])}")
    print(f"alloc retries     {out['num_alloc_retries']}")
    if out["allocs_total"] is not None:
        verdict = "exact" if result.exact else "DIFFERS"
        print(f"against the recording ({verdict}): addresses {out['allocs_address_matched']}/{out['allocs_total']}, "
              f"segment decisions {out['segments_matched']}/{out['segments_total']}, reserved after each "
              f"event {out['reserved_matched']}/{out['reserved_checked']}")
    for oom in out["ooms"]:
        print(f"OOM at request {oom['event']}: {oom['message']}")
    if not out["ooms"]:
        print("OOM               none")
