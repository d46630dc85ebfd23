"""PYTORCH_ALLOC_CONF as torch 2.13 reads it: the harness takes what torch's own parser takes and
refuses what it refuses, honours large_segment_size_mb in the allocator model, and refuses up front
the settings it cannot replay."""

import json
import os
import subprocess
import sys

import pytest
import torch

from harness.allocator.model import CachingAllocator, Device, allocation_size
from harness.allocator.settings import AllocSettings
from harness.config import alloc_conf
from harness.config.compose import compose
from harness.config.validate import validate
from harness.errors import ConfigError

MiB = 1024**2

# The keys every device reads (c10/core/AllocatorConfig.cpp), well-formed and not: a CPU build of
# torch parses these as a CUDA build does (it has no CUDA hook, which would also refuse unknown keys)
COMMON = [
    "", "expandable_segments:True", "expandable_segments:False", "expandable_segments:true", "expandable_segments:1",
    "max_split_size_mb:20", "max_split_size_mb:19", "max_split_size_mb:512", "max_non_split_rounding_mb:20",
    "max_non_split_rounding_mb:10", "large_segment_size_mb:11", "large_segment_size_mb:10", "large_segment_size_mb:64",
    "large_segment_size_mb:40,max_split_size_mb:30", "max_split_size_mb:30,large_segment_size_mb:40",
    "max_split_size_mb:40,large_segment_size_mb:40", "large_segment_size_mb:40,max_non_split_rounding_mb:30",
    "large_segment_size_mb:12,max_split_size_mb:12", "garbage_collection_threshold:0.8",
    "garbage_collection_threshold:1.0", "garbage_collection_threshold:0", "garbage_collection_threshold:abc",
    "roundup_power2_divisions:4", "roundup_power2_divisions:3", "roundup_power2_divisions:0", "roundup_power2_divisions:1",
    "roundup_power2_divisions:[256:4,>:0]", "roundup_power2_divisions:[256:3]", "roundup_power2_divisions:[3:4]",
    "roundup_power2_divisions:[1:2,64:8,>:1]", "roundup_power2_divisions:[>:4]", "roundup_power2_divisions:[256:4",
    "pinned_use_background_threads:True", "pinned_use_background_threads:yes", "pinned_max_round_threshold_mb:4",
    "pinned_max_cached_size_mb:100", " max_split_size_mb : 512 , expandable_segments : True ", "max_split_size_mb:512,",
    "max_split_size_mb", "max_split_size_mb:", ":512", "max_split_size_mb::512", "expandable_segments:[True]",
    "max_split_size_mb:[512]", "max_split_size_mb:512 expandable_segments:True",
]

_TORCH_PARSES = """
import json, sys, torch
out = []
for conf in json.loads(sys.stdin.read()):
    torch._C._accelerator_setAllocatorSettings("large_segment_size_mb:20")  # it outlives a parse; the others reset
    try:
        torch._C._accelerator_setAllocatorSettings(conf)
        out.append(None)
    except Exception as e:
        out.append(str(e).splitlines()[0])
print(json.dumps(out))
"""


def _harness_parses(conf: str) -> str | None:
    try:
        alloc_conf.parse(conf)
    except ConfigError as e:
        assert e.key == "allocator.conf" and "\n" not in str(e)
        return str(e)
    return None


@pytest.mark.skipif(not torch.__version__.startswith("2.13"), reason="the parser is torch 2.13's (README's pin)")
def test_the_common_keys_are_taken_and_refused_as_torchs_own_parser_does():
    torch_says = json.loads(subprocess.run([sys.executable, "-c", _TORCH_PARSES], input=json.dumps(COMMON),
                                           capture_output=True, text=True, check=True).stdout)
    differ = [(conf, t, _harness_parses(conf)) for conf, t in zip(COMMON, torch_says, strict=True)
              if (t is None) != (_harness_parses(conf) is None)]
    assert not differ
    assert sum(t is None for t in torch_says) >= 20  # both ways: taken and refused


@pytest.mark.parametrize("conf,expected", [
    ("max_split_size_mb:512,garbage_collection_threshold:0.8",
     {"max_split_size_mb": 512, "garbage_collection_threshold": 0.8}),
    ("roundup_power2_divisions:[256:1,512:2,>:0]", {"roundup_power2_divisions": {"256": 1, "512": 2, ">": 0}}),
    ("large_segment_size_mb:40,max_split_size_mb:40", {"large_segment_size_mb": 40, "max_split_size_mb": 40}),
    # CUDA's own keys (CUDAAllocatorConfig, torch 2.13)
    ("release_lock_on_cudamalloc:True,pinned_use_cuda_host_register:False,pinned_num_register_threads:8",
     {"release_lock_on_cudamalloc": True, "pinned_use_cuda_host_register": False, "pinned_num_register_threads": 8}),
    ("graph_capture_record_stream_reuse:True,pinned_free_catch_all:True,pinned_reserve_segment_size_mb:64",
     {"graph_capture_record_stream_reuse": True, "pinned_free_catch_all": True, "pinned_reserve_segment_size_mb": 64}),
    ("per_process_memory_fraction:0.5,throw_on_cudamalloc_oom:False,backend:native",
     {"per_process_memory_fraction": 0.5, "throw_on_cudamalloc_oom": False, "backend": "native"}),
])
def test_settings_parse_to_their_values(conf, expected):
    assert alloc_conf.parse(conf) == expected


@pytest.mark.parametrize("conf", ["bogus_key:1", "pinned_num_register_threads:3", "pinned_num_register_threads:256",
                                  "pinned_reserve_segment_size_mb:0", "per_process_memory_fraction:1.5",
                                  "backend:cudaMalloc", "throw_on_cudamalloc_oom:true", "max_split_size_mb:40.5"])
def test_what_cudas_parser_refuses_is_refused_naming_the_key(conf):
    assert _harness_parses(conf) is not None


@pytest.mark.parametrize("conf", ["backend:cudaMallocAsync", "throw_on_cudamalloc_oom:True",
                                  "per_process_memory_fraction:0.5"])
def test_settings_the_model_cannot_replay_are_refused_before_any_work(conf):
    alloc_conf.parse(conf)  # torch takes each
    with pytest.raises(ConfigError) as e:
        validate(compose(["model=tiny", f"allocator.conf={conf}"]))
    assert e.value.key == "allocator.conf"
    with pytest.raises(ConfigError):
        AllocSettings.from_conf(conf)


def test_a_large_segment_size_sizes_segments_for_1_to_10_mib_and_rounding_after_it():
    s = AllocSettings.from_conf("large_segment_size_mb:40")
    assert (s.large_segment_size, s.max_non_split_rounding) == (40 * MiB, 40 * MiB)
    assert AllocSettings.from_conf("large_segment_size_mb:40,max_non_split_rounding_mb:64").max_non_split_rounding \
        == 64 * MiB
    assert [allocation_size(n, 40 * MiB) for n in (MiB, 3 * MiB, 10 * MiB)] == [2 * MiB, 40 * MiB, 10 * MiB]
    for conf, reserved in [("", 20 * MiB), ("large_segment_size_mb:40", 40 * MiB),
                           ("expandable_segments:True", 20 * MiB),
                           ("expandable_segments:True,large_segment_size_mb:64", 64 * MiB)]:
        a = CachingAllocator(AllocSettings.from_conf(conf), Device())
        blocks = [a.malloc(3 * MiB) for _ in range(4)]  # 12 MiB: one segment (or page) holds them, or two
        assert a.stats.reserved_bytes.current == (reserved if reserved >= 12 * MiB else 2 * reserved), conf
        for b in blocks:
            a.free(b)


@pytest.mark.parametrize("conf", ["max_split_size_mb:64,max_non_split_rounding_mb:128", "large_segment_size_mb:40",
                                  "expandable_segments:True,large_segment_size_mb:32,garbage_collection_threshold:0.5,"
                                  "roundup_power2_divisions:[256:4,>:0]"])
def test_the_settings_a_written_snapshot_carries_are_read_back_the_same(conf):
    settings = AllocSettings.from_conf(conf)
    assert AllocSettings.from_snapshot(settings.snapshot_dict()) == settings


def test_a_snapshots_large_segment_size_is_read_from_the_conf_it_recorded():
    recorded = {"PYTORCH_ALLOC_CONF": "large_segment_size_mb:32,expandable_segments:True", "expandable_segments": True}
    assert AllocSettings.from_snapshot(recorded).large_segment_size == 32 * MiB
    assert AllocSettings.from_snapshot({"PYTORCH_ALLOC_CONF": "some_newer_key:1"}).large_segment_size == 20 * MiB


@pytest.mark.skipif(not torch.__version__.startswith("2.13"), reason="the order is torch 2.13's (README's pin)")
@pytest.mark.parametrize("env", [
    {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:100", "PYTORCH_ALLOC_CONF": "max_split_size_mb:200"},
    {"PYTORCH_ALLOC_CONF": "max_split_size_mb:200"}])
def test_the_environments_settings_are_the_ones_torch_reads(env, monkeypatch):
    for name in alloc_conf.ENV_NAMES:
        monkeypatch.delenv(name, raising=False)
    read = subprocess.run([sys.executable, "-c", "import torch; print(torch._C._accelerator_getAllocatorSettings())"],
                          capture_output=True, text=True, check=True, env={**os.environ, **env})
    assert (alloc_conf.from_environment(env) or ("", ""))[1] == read.stdout.strip()
