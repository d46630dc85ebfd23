"""The caching allocator's settings, from a PYTORCH_ALLOC_CONF string or a snapshot's allocator_settings."""

from __future__ import annotations

from dataclasses import dataclass, field

from harness.config import alloc_conf
from harness.errors import ConfigError
from harness.units import MiB

SIZE_MAX = (1 << 64) - 1
K_LARGE_BUFFER = 20 * MiB  # kLargeBuffer: the default large segment/page size and max_non_split_rounding
N_DIVISION_INTERVALS = 16  # roundup_power2_divisions table: [1 MiB, 2 MiB) ... [32 GiB, inf)


@dataclass(frozen=True)
class AllocSettings:
    max_split_size: int = SIZE_MAX  # bytes; blocks at or above it are "oversize" (never split)
    max_non_split_rounding: int = K_LARGE_BUFFER  # oversize reuse only within this many bytes
    # what a request between 1 and 10 MiB cudaMallocs, and an expandable segment's large-pool page
    # (large_segment_size_mb; max_non_split_rounding's default follows it)
    large_segment_size: int = K_LARGE_BUFFER
    roundup_power2_divisions: tuple[int, ...] = field(default=(0,) * N_DIVISION_INTERVALS)
    garbage_collection_threshold: float = 0.0
    expandable_segments: bool = False
    conf: str = ""  # the PYTORCH_ALLOC_CONF string these came from

    @classmethod
    def from_conf(cls, conf: str) -> AllocSettings:
        """The settings of a PYTORCH_ALLOC_CONF string; a ConfigError for one torch would refuse or
        the model cannot replay (alloc_conf.modelled)."""
        return cls.from_parsed(alloc_conf.modelled(conf), conf)

    @classmethod
    def from_parsed(cls, parsed: dict, conf: str) -> AllocSettings:
        """The settings of alloc_conf.parse's dict (of the string `conf`)."""
        kw: dict = {"conf": conf}
        if "large_segment_size_mb" in parsed:
            kw["large_segment_size"] = kw["max_non_split_rounding"] = parsed["large_segment_size_mb"] * MiB
        if "max_split_size_mb" in parsed:
            kw["max_split_size"] = parsed["max_split_size_mb"] * MiB
        if "max_non_split_rounding_mb" in parsed:
            kw["max_non_split_rounding"] = parsed["max_non_split_rounding_mb"] * MiB
        if "garbage_collection_threshold" in parsed:
            kw["garbage_collection_threshold"] = parsed["garbage_collection_threshold"]
        if "expandable_segments" in parsed:
            kw["expandable_segments"] = parsed["expandable_segments"]
        if "roundup_power2_divisions" in parsed:
            kw["roundup_power2_divisions"] = _division_table(parsed["roundup_power2_divisions"])
        return cls(**kw)

    @classmethod
    def from_snapshot(cls, settings: dict) -> AllocSettings:
        """From `torch.cuda.memory._snapshot()["allocator_settings"]`."""
        msz = settings.get("max_split_size", -1)
        table = settings.get("roundup_power2_divisions") or {}
        divisions = tuple(int(table.get(str(1 << i), 0)) for i in range(N_DIVISION_INTERVALS))
        conf = settings.get("PYTORCH_ALLOC_CONF", settings.get("PYTORCH_CUDA_ALLOC_CONF", "")) or ""
        large = _large_segment(conf)
        return cls(
            large_segment_size=large,
            max_split_size=SIZE_MAX if msz in (-1, None) or msz >= SIZE_MAX else int(msz),
            max_non_split_rounding=int(settings.get("max_non_split_rounding_size", large)),
            roundup_power2_divisions=divisions,
            garbage_collection_threshold=float(settings.get("garbage_collection_threshold", 0.0)),
            expandable_segments=bool(settings.get("expandable_segments", False)),
            conf=conf,
        )

    def snapshot_dict(self) -> dict:
        """The allocator_settings block a snapshot carries."""
        return {
            "PYTORCH_CUDA_ALLOC_CONF": self.conf,
            "max_split_size": -1 if self.max_split_size == SIZE_MAX else self.max_split_size,
            "max_non_split_rounding_size": self.max_non_split_rounding,
            "garbage_collection_threshold": self.garbage_collection_threshold,
            "expandable_segments": self.expandable_segments,
            "pinned_num_register_threads": 1,
            "release_lock_on_cudamalloc": False,
            "pinned_use_cuda_host_register": False,
            "roundup_power2_divisions": {str(1 << i): d for i, d in enumerate(self.roundup_power2_divisions)},
        }


def _large_segment(conf: str) -> int:
    """A recorded run's large segment size, from the PYTORCH_ALLOC_CONF it recorded (a snapshot's
    settings carry no field of their own for it); the default where that string does not parse here
    (a newer torch's keys: its other settings are read from their own fields)."""
    try:
        return alloc_conf.parse(conf).get("large_segment_size_mb", K_LARGE_BUFFER // MiB) * MiB
    except ConfigError:
        return K_LARGE_BUFFER


def _division_table(value) -> tuple[int, ...]:
    """PyTorch's parsing: one value fills every interval; the list form `[K:v,...,>:v]` maps K MiB
    to interval log2(K), the first value also fills the lower intervals, `>` all the higher ones."""
    if isinstance(value, int):
        return (value,) * N_DIVISION_INTERVALS
    table = [0] * N_DIVISION_INTERVALS
    last_index, first = -1, True
    for key, divs in value.items():
        if key == ">":
            for i in range(last_index + 1, N_DIVISION_INTERVALS):
                table[i] = divs
            continue
        index = min(max(int(key).bit_length() - 1, 0), N_DIVISION_INTERVALS - 1)
        if first:
            for i in range(index):
                table[i] = divs
            first = False
        table[index] = divs
        last_index = index
    return tuple(table)
