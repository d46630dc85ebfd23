"""torch.cuda answered by the virtual GPU: the user's own memory code runs unchanged.

Inside a traced job or script, `torch.cuda.memory_allocated`, `max_memory_allocated`,
`memory_reserved`, `max_memory_reserved`, `memory_stats`, `memory_summary`, `mem_get_info`,
`reset_peak_memory_stats`, `empty_cache` and `set_per_process_memory_fraction` read and drive the
allocator model fed with the tracker's events (the card of `gpu=`, the settings of `allocator=`);
`torch.cuda.memory._record_memory_history` / `_snapshot` / `_dump_snapshot` record and write the
virtual snapshot of exactly the recorded region; `torch.cuda.nvtx` does nothing; the device
queries (`is_available`, `get_device_properties`, ...) describe the card.
`torch.cuda.memory._set_allocator_settings` is taken before the card's first allocation and refused
after it (as is any call in a traced job, whose replays run under the point's allocator.conf).

The model is fed lazily (at each reading) unless `eager`: a script's allocations then go through
it as they happen, so one that does not fit the card raises torch.OutOfMemoryError where a real
run would.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import sys
import traceback
from pathlib import Path
from types import SimpleNamespace

import torch

from harness.allocator import oom_message
from harness.allocator import snapshot as snap
from harness.allocator.model import CachingAllocator, Device, OutOfMemory
from harness.allocator.settings import AllocSettings
from harness.config import alloc_conf
from harness.config.point import Card
from harness.errors import ConfigError
from harness.probe.sim.tracker import StorageTracker

_HARNESS = str(Path(__file__).resolve().parents[2])
_TORCH = Path(torch.__file__).parent
# Frames of the dispatch machinery between the user's op and the tracker: not where memory is used.
_MACHINERY = tuple(str(_TORCH / p) for p in ("_ops.py", "_compile.py", "_dynamo", "utils/_python_dispatch.py",
                                               "_subclasses", "overrides.py"))


class LiveAllocator:
    """The allocator model following a tracker's events, readable at any moment."""

    def __init__(self, tracker: StorageTracker, settings: AllocSettings, card: Card, eager: bool = False,
                 environ: dict | None = None):
        """`environ` (a script's os.environ, where its settings come from the environment): the
        settings torch reads there at the card's first allocation, as a script may set them first."""
        self.tracker, self.card, self.settings, self.environ = tracker, card, settings, environ
        # Eager, it is the card; lazy (a sweep's trace, whose replays decide each card's OOM), a card
        # of the same size that never runs out.
        self.alloc = CachingAllocator(settings, Device.for_card(card) if eager else Device(total=card.memory_bytes))
        self.alloc.on_event = self._on_event
        self.blocks: dict = {}  # tracker key -> Block
        self.done = 0  # tracker events consumed
        self.eager = eager
        self.history: collections.deque | None = None  # trace entries while recording
        self._frames: list = []
        self._clock = 0
        self.whole_run: dict = {}  # the peaks before the code last reset them
        tracker.on_drop = self._dropped
        tracker.after_alloc = self.catch_up if eager else None
        # torch.cuda's streams, numbered per trace (0: the default stream) so that traces of one
        # job at other depths number them alike
        self.Stream = type("Stream", (_Stream,), {"live": self})
        self.stream_ids = itertools.count(1)
        self.default_stream = self.Stream(_default=True)
        self.current_stream = self.default_stream

    def use_stream(self, stream: _Stream) -> _Stream:
        """Make `stream` current (torch.cuda.set_stream); returns the one current before."""
        if not isinstance(stream, _Stream):
            raise TypeError(f"expected a torch.cuda.Stream of the virtual GPU, got {type(stream).__name__}")
        before, self.current_stream = self.current_stream, stream
        self.tracker.stream = stream.stream_id
        return before

    # ---- following the tracker -------------------------------------------------------------
    def catch_up(self) -> None:
        events = self.tracker.events
        if self.environ is not None and self.done < len(events):  # the first allocation: torch reads its settings
            self._take_environment()
        while self.done < len(events):
            e = events[self.done]
            self.done += 1
            if e.action == "alloc":
                try:
                    self.blocks[e.key] = self.alloc.malloc(e.size, e.stream)
                except OutOfMemory as oom:
                    text = oom_message.message(oom, torch.__version__)
                    raise torch.OutOfMemoryError(text) from None
            else:
                b = self.blocks.pop(e.key, None)
                if b is not None:
                    self.alloc.free(b)

    def _dropped(self, key: int, index: int) -> None:
        """The tracker took back an alloc event (a tensor a real run keeps on the host)."""
        if index < self.done:
            self.done -= 1
            b = self.blocks.pop(key, None)
            if b is not None:
                self.alloc.free(b)

    # ---- recording -------------------------------------------------------------------------
    def record(self, enabled, max_entries: int | None) -> None:
        self.catch_up()
        if not enabled:
            self.tracker.after_alloc = self.catch_up if self.eager else None
            self.history = None
            return
        self.history = collections.deque(maxlen=max_entries if max_entries and max_entries < sys.maxsize else None)
        self.tracker.after_alloc = self._catch_up_with_frames  # each allocation where it happens

    def _catch_up_with_frames(self) -> None:
        self._frames = _user_frames()
        self.catch_up()

    def _on_event(self, action, addr, size, stream) -> None:
        if self.history is not None:
            self._clock += 1  # an event count: the ring buffer keeps the newest, in order
            self.history.append({"action": action, "addr": addr, "size": size, "stream": stream,
                                 "time_us": self._clock, "frames": self._frames if action == "alloc" else []})

    def snapshot(self) -> dict:
        self.catch_up()
        return snap.as_dict(self.alloc, list(self.history or ()))

    # ---- torch.cuda's readings ---------------------------------------------------------------
    def stats(self) -> dict:
        self.catch_up()
        return self.alloc.stats.as_dict()

    def reset_peaks(self) -> None:
        self.catch_up()
        self.whole_run = self.peaks()
        self.alloc.stats.reset_peaks()

    def peaks(self) -> dict:
        """The whole run's peaks, whatever the code reset: allocated, requested, reserved."""
        self.catch_up()
        st = self.alloc.stats
        now = {"allocated_bytes": st.allocated_bytes.peak, "requested_bytes": st.requested_bytes.peak,
               "reserved_bytes": st.reserved_bytes.peak}
        return {k: max(v, self.whole_run.get(k, 0)) for k, v in now.items()}

    def empty_cache(self) -> None:
        self.catch_up()
        self.alloc.empty_cache()

    def reset_accumulated(self) -> None:
        """reset_accumulated_memory_stats: the allocated/freed totals and the retry and OOM counts."""
        self.catch_up()
        self.alloc.stats.reset_accumulated()

    def mem_get_info(self) -> tuple[int, int]:
        """(free, total) as cudaMemGetInfo: the card less what the CUDA context holds and PyTorch reserved."""
        self.catch_up()
        total = self.card.memory_bytes
        return max(0, total - self.card.non_pytorch_bytes - self.alloc.stats.reserved_bytes.current), total

    def set_settings(self, conf: str) -> None:
        """torch.cuda.memory._set_allocator_settings(conf): what torch keeps in force (alloc_conf.
        persisting) taken where the card has allocated nothing yet; after that, a change is refused
        at the code's line (one run under two settings is not modelled: segments made under each)."""
        self.catch_up()
        if self.environ is not None:  # the environment's settings are torch's until now
            self._take_environment()
        parsed = alloc_conf.persisting(alloc_conf.parse(self.settings.conf), alloc_conf.parse(conf))
        settings = AllocSettings.from_parsed(alloc_conf.refuse_unmodelled(parsed), alloc_conf.text(parsed))
        if dataclasses.replace(settings, conf="") == dataclasses.replace(self.settings, conf=""):
            return
        if not self.eager or self.alloc.stats.num_device_alloc:
            from harness.probe.jobs import UserCodeError
            from harness.probe.sim.fake_code import user_line

            if not self.eager:  # a job's trace: each card's replay runs under the point's settings
                raise UserCodeError(f"{user_line()}: the job sets the allocator's settings to '{conf}'; a point "
                                    f"runs under its allocator.conf ('{self.settings.conf}'): pass them there")
            raise UserCodeError(
                f"{user_line()}: the allocator's settings change to '{conf}' after the card's first allocation "
                f"(under '{self.settings.conf}'), which is not modelled: set them before the run starts "
                "(PYTORCH_ALLOC_CONF, or allocator.conf=)")
        self._take(settings)

    def _take_environment(self) -> None:
        """Run under the settings the script's environment holds now, as torch reads them once
        (a string torch refuses raises at the code's line, naming its variable)."""
        name, conf = alloc_conf.from_environment(self.environ) or ("", "")
        self.environ = None
        if conf != self.settings.conf:
            try:
                self._take(AllocSettings.from_conf(conf))
            except ConfigError as err:
                raise ValueError(f"{name}: {err.message}") from None

    def _take(self, settings: AllocSettings) -> None:
        """Run under `settings` from here (the card has allocated nothing: nothing else changes)."""
        self.settings = settings
        self.alloc = CachingAllocator(settings, self.alloc.device)
        self.alloc.on_event = self._on_event

    def set_fraction(self, fraction: float) -> None:
        self.catch_up()
        if self.eager:
            self.alloc.device = Device.for_card(self.card, fraction)


def shown(frames) -> list[traceback.FrameSummary]:
    """The frames worth showing of a stack or traceback: the code's own and torch's modules, without
    the harness, runpy and the dispatch machinery between an op and the virtual GPU."""
    return [f for f in frames if not f.filename.startswith((_HARNESS, *_MACHINERY)) and f.filename != "<frozen runpy>"]


def _user_frames() -> list[dict]:
    """The Python stack of an allocation as a real snapshot's frames (innermost first)."""
    return [{"filename": f.filename, "line": f.lineno, "name": f.name} for f in reversed(shown(traceback.extract_stack()))]


class _Event:
    """torch.cuda.Event on the virtual GPU: nothing runs, so no time passes (elapsed_time is 0)."""

    def __init__(self, enable_timing=False, blocking=False, interprocess=False, external=False):
        pass

    def record(self, stream=None):
        return None

    def wait(self, stream=None):
        return None

    def query(self) -> bool:
        return True

    def synchronize(self):
        return None

    def elapsed_time(self, end_event) -> float:
        return 0.0


class _Stream:
    """torch.cuda.Stream on the virtual GPU: an id the tracker puts on each storage allocated while
    it is current (the allocator model reuses a free block on its own stream only, as the caching
    allocator does). Nothing runs, so waits and synchronizations return at once; a tensor's
    record_stream is not modelled (the model frees at once). Each trace has its subclass, bound to
    its LiveAllocator (`live`), so that its streams are numbered per trace."""

    live: LiveAllocator

    def __init__(self, device=None, priority: int = 0, _default: bool = False, **kwargs):
        self.stream_id = 0 if _default else next(self.live.stream_ids)
        self.priority = priority
        self.device = torch.device("cuda", 0)
        self.cuda_stream = self.stream_id  # the handle torch reports: here the id, 0 for the default stream

    def synchronize(self):
        return None

    def wait_stream(self, stream):
        return None

    def wait_event(self, event):
        return None

    def record_event(self, event=None):
        return event or _Event()

    def query(self) -> bool:
        return True

    def __enter__(self):  # `with stream:` as torch.Stream allows
        self._entered = self.live.use_stream(self)
        return self

    def __exit__(self, *exc):
        self.live.use_stream(self._entered)
        return False

    def __repr__(self) -> str:
        return f"<virtual torch.cuda.Stream device=cuda:0 cuda_stream={self.stream_id}>"


@contextlib.contextmanager
def _stream_context(live: LiveAllocator, stream):
    """torch.cuda.stream(s): `s` current inside (None: unchanged)."""
    if stream is None:
        yield None
        return
    before = live.use_stream(stream)
    try:
        yield stream
    finally:
        live.use_stream(before)


class _NoNvtx:
    """torch.cuda.nvtx's C functions: no profiler is attached to a virtual GPU."""

    def __getattr__(self, name):
        return lambda *a, **k: 0


def _flat(stats: dict) -> dict:
    """memory_stats()' keys: torch's flat "allocated_bytes.all.current" naming."""
    return dict(sorted(stats.items()))


def _nested(stats: dict) -> dict:
    out: dict = {}
    for key, value in stats.items():
        parts = key.split(".")
        d = out
        for p in parts[:-1]:
            d = d.setdefault(p, {})
        d[parts[-1]] = value
    return out


def _functions(live: LiveAllocator, original_summary) -> dict:
    """torch.cuda.memory's functions, answered by `live`."""
    card = live.card

    def stat(name, which):
        """One reading (e.g. allocated_bytes' current), without building all of memory_stats()."""
        def read(device=None):
            live.catch_up()
            return getattr(getattr(live.alloc.stats, name), which)
        return read

    def record(enabled="all", context="all", stacks="all", max_entries=sys.maxsize, device=None, **kw):
        live.record(enabled, kw.get("trace_alloc_max_entries", max_entries))

    def dump(filename="dump_snapshot.pickle", augment_with_fx_traces=False):
        live.catch_up()
        snap.write(Path(filename), live.alloc, list(live.history or ()))

    # An unknown card answers as the commonest training card does (an A100's 8.0).
    major, minor = card.capability or (8, 0)
    props = SimpleNamespace(name=card.device_name, total_memory=card.memory_bytes, major=major, minor=minor,
                            is_integrated=False, is_multi_gpu_board=False)
    return {
        "memory_stats": lambda device=None: _flat(live.stats()),
        "memory_stats_as_nested_dict": lambda device=None: _nested(live.stats()),
        "memory_allocated": stat("allocated_bytes", "current"),
        "max_memory_allocated": stat("allocated_bytes", "peak"),
        "memory_reserved": stat("reserved_bytes", "current"),
        "max_memory_reserved": stat("reserved_bytes", "peak"),
        "memory_cached": stat("reserved_bytes", "current"),
        "max_memory_cached": stat("reserved_bytes", "peak"),
        "reset_peak_memory_stats": lambda device=None: live.reset_peaks(),
        "reset_max_memory_allocated": lambda device=None: live.reset_peaks(),
        "reset_max_memory_cached": lambda device=None: live.reset_peaks(),
        "reset_accumulated_memory_stats": lambda device=None: live.reset_accumulated(),
        "empty_cache": live.empty_cache,
        "mem_get_info": lambda device=None: live.mem_get_info(),
        "memory_summary": lambda device=None, abbreviated=False: original_summary(0, abbreviated),
        "memory_snapshot": lambda *a, **k: live.snapshot()["segments"],
        "set_per_process_memory_fraction": lambda fraction, device=None: live.set_fraction(fraction),
        "_set_allocator_settings": live.set_settings,
        "get_per_process_memory_fraction": lambda device=None: (
            live.alloc.device.allowed / card.memory_bytes if live.alloc.device.allowed else 1.0),
        "_record_memory_history": record,
        "_snapshot": lambda device=None, augment_with_fx_traces=False: live.snapshot(),
        "_dump_snapshot": dump,
        # the card itself
        "is_available": lambda: True,
        "is_initialized": lambda: True,
        "init": lambda: None,
        "device_count": lambda: 1,
        "current_device": lambda: 0,
        "set_device": lambda device: None,
        "get_device_name": lambda device=None: card.device_name,
        "get_device_properties": lambda device=None: props,
        "get_device_capability": lambda device=None: (props.major, props.minor),
        # from sm80 natively; below, emulated (torch.cuda's default including_emulation=True)
        "is_bf16_supported": lambda including_emulation=True: major >= 8 or bool(including_emulation),
        "manual_seed": lambda seed: None,
        "manual_seed_all": lambda seed: None,
        "synchronize": lambda device=None: None,
        # The virtual GPU captures no CUDA graphs (torch <= 2.12's optimizers ask torch.cuda here).
        "is_current_stream_capturing": lambda: False,
        "Event": _Event,
        "Stream": live.Stream,
        "current_stream": lambda device=None: live.current_stream,
        "default_stream": lambda device=None: live.default_stream,
        "set_stream": lambda stream: live.use_stream(stream) and None,
        "stream": lambda stream=None: _stream_context(live, stream),
        "StreamContext": lambda stream: _stream_context(live, stream),
        "device": lambda device: contextlib.nullcontext(),  # `with torch.cuda.device(0):` - there is one
    }


_CPU_STREAMS = ("Stream", "stream", "current_stream", "Event", "StreamContext")

# The answers that depend on the card or the allocator settings: a job that reads one may run
# otherwise on another card (its trace is then kept for this card alone: record.trace_store).
_READS_CARD = {
    "memory_stats", "memory_stats_as_nested_dict", "memory_allocated", "max_memory_allocated", "memory_reserved",
    "max_memory_reserved", "memory_cached", "max_memory_cached", "mem_get_info", "memory_summary",
    "memory_snapshot", "get_per_process_memory_fraction", "_snapshot", "get_device_name", "get_device_properties",
    "get_device_capability", "is_bf16_supported",
}
READS_CARD = "reads_card"  # the tracker's finding: the job read one of those


def _noting_the_read(live: LiveAllocator, fn):
    def read(*args, **kwargs):
        live.tracker.findings[READS_CARD] = True
        return fn(*args, **kwargs)
    return read


@contextlib.contextmanager
def virtual_cuda(live: LiveAllocator):
    """torch.cuda (and torch.cuda.memory) answered by `live` inside; everything restored after."""
    import torch.cuda.memory as memory
    import torch.cuda.nvtx as nvtx

    fns = {name: _noting_the_read(live, fn) if name in _READS_CARD else fn
           for name, fn in _functions(live, memory.memory_summary).items()}
    saved: list = []
    for name, fn in fns.items():
        for module in (torch.cuda, memory):
            if hasattr(module, name):
                saved.append((module, name, getattr(module, name)))
                setattr(module, name, fn)
    # The trace's CPU tensors stand for the GPU's: code that takes its streams from the tensors'
    # device (FSDP2 on a CPU mesh: torch.cpu.Stream, ...) gets the virtual GPU's streams too.
    for name in _CPU_STREAMS:
        saved.append((torch.cpu, name, getattr(torch.cpu, name)))
        setattr(torch.cpu, name, fns[name])
    saved.append((nvtx, "_nvtx", nvtx._nvtx))
    nvtx._nvtx = _NoNvtx()  # type: ignore[assignment]  # restored below
    try:
        yield live
    finally:
        for module, name, fn in reversed(saved):
            setattr(module, name, fn)
