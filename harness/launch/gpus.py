"""Which GPU a cuda point runs on, and the environment its process starts with.

Two points never share a card: each takes a flock'd file named for its device (a per-host lock
directory, so two sweeps on one machine do not share one either; a killed process gives its card
back). With several GPUs, several points run at once, one per card.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from harness.config.cards import CardTooLarge, emulation_changes, emulation_fraction
from harness.config.point import Point
from harness.errors import ConfigError
from harness.launch import slots

POLL_S = 0.2


def visible_devices() -> list[str]:
    """The devices this process may use, as CUDA_VISIBLE_DEVICES names them (indexes or UUIDs);
    without it, every device the driver reports. [] when there is no GPU."""
    if not driver_present():
        return []  # no NVIDIA or ROCm driver: no need to import torch (3 s) to know
    import torch

    if not torch.cuda.is_available():
        return []
    return listed(os.environ.get("CUDA_VISIBLE_DEVICES"), torch.cuda.device_count())


def driver_present() -> bool:
    """An NVIDIA driver (its control device) or ROCm's kernel driver (/dev/kfd) on this machine."""
    return any(Path(p).exists() for p in ("/dev/nvidiactl", "/dev/nvidia0", "/proc/driver/nvidia/version", "/dev/kfd"))


def listed(env: str | None, count: int) -> list[str]:
    """The names of the `count` devices CUDA sees, given CUDA_VISIBLE_DEVICES (`env`, maybe unset)."""
    if env is None:
        return [str(i) for i in range(count)]
    return [d.strip() for d in env.split(",") if d.strip()][:count]


def lock_dir() -> Path:
    path = Path(tempfile.gettempdir()) / f"harness-gpus-{os.getuid()}"
    path.mkdir(exist_ok=True)
    return path


def take(devices: list[str], locks: Path | None = None, timeout_s: float | None = None):
    """Wait for a free device of `devices`: (device, open lock file; closing it frees the card)."""
    if not devices:
        raise RuntimeError("no GPU to run on (CUDA_VISIBLE_DEVICES is empty)")
    locks = locks or lock_dir()
    try:
        i, f = slots.take([locks / f"gpu-{d}.lock" for d in devices], POLL_S, timeout_s)
    except TimeoutError:
        raise TimeoutError(f"no free GPU among {', '.join(devices)} within {timeout_s} s") from None
    f.write(f"{os.getpid()}\n")  # who holds the card, for a person looking
    f.flush()
    return devices[i], f


def worker_env(device: str, alloc_conf: str, base: dict | None = None) -> dict:
    """The point's process environment: its one card, and the allocator settings under both names
    (PYTORCH_ALLOC_CONF since 2.8; 2.9.1 honoured only the old name for expandable_segments), set
    before CUDA starts because the allocator reads them once."""
    env = dict(os.environ if base is None else base)
    env["CUDA_VISIBLE_DEVICES"] = device
    for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        if alloc_conf:
            env[name] = alloc_conf
        else:
            env.pop(name, None)  # the default allocator, not whatever the user's shell exported
    return env


_DESCRIBE = ("import json, torch; print(json.dumps([[p.name, p.total_memory] for p in "
             "(torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count()))]))")


def describe(devices: list[str]) -> list[tuple[str, int]]:
    """(name, total_memory bytes) of each device, read in a child process so that this one (the
    launcher) never holds a CUDA context on a card its points measure."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(devices)}
    out = subprocess.run([sys.executable, "-c", _DESCRIBE], capture_output=True, text=True, env=env,
                         timeout=120, check=True)
    return [(name, int(total)) for name, total in json.loads(out.stdout.strip().splitlines()[-1])]


def resolve_backend(backend: str, cluster: bool = False) -> str:
    """auto -> cuda when a GPU is visible, sim (the virtual GPU) otherwise (sim and cpu as they are);
    cuda without a GPU is a
    config error, not a sweep of error rows. Launching to a cluster, the GPUs are the nodes': auto is
    cuda there, and the launching machine needs none."""
    if backend in ("sim", "cpu"):
        return backend
    if cluster:
        return "cuda"
    if visible_devices():
        return "cuda"
    if backend == "auto":
        return "sim"
    raise ConfigError("backend", "cuda asked for, but no GPU is visible (use backend=sim or auto)")


def check_cards(points: list[Point], devices: list[tuple[str, int]]) -> None:
    """Every point's card can run on every device a point may get: the device itself, or a smaller
    card emulated on it, under an allocator the emulation leaves as the card runs it
    (emulation_changes). A larger card, or such a setting, is a config error, not a silent run."""
    for point in points:
        for name, total in devices:
            try:
                fraction = emulation_fraction(point.gpu, name, total)
            except CardTooLarge as e:
                raise ConfigError("gpu", str(e)) from None
            why = emulation_changes(point.gpu, point.allocator.conf, name, fraction)
            if why:
                raise ConfigError("allocator.conf", why)
