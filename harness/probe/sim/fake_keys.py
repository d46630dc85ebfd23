"""FakeTensor's dispatch cache key, the same key made with less Python.

FakeTensorMode answers an op from its cache when it saw the op before on inputs of the same
metadata, and in a trace nearly every op is such a hit (a 7B training trace of 4 layers from an
empty cache: 4,518 of 4,855 keyed dispatches). Making the key is then the largest part of a
dispatch (55% of `_cached_dispatch_impl`'s time there): torch walks each fake input
through `extract_tensor_metadata` and `TensorMetadata._flatten_into` (a `dataclasses.fields` walk
and three sparse-layout checks per tensor). `FakeTensorMode._prep_args_for_hash` here appends the
very same values for what a step passes (strided fake tensors of concrete shape, numbers, dtypes,
devices, lists of them) and hands everything else to torch's own code.

It stands in only for the torch code it was written against: the source of the functions it
repeats and the metadata's field names, in order, must hash to CHECKED, else torch's own key is
kept (a newer torch is slower here, never wrong). `checking()` makes both keys at every dispatch
and fails where they differ (the tests).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import inspect

import torch
import torch._subclasses.fake_tensor as fake_tensor
from torch._prims_common import suggest_memory_format

from harness.probe.sim.patches import patched

# sha256 of _sources() on torch 2.13.0, where this key was checked equal to torch's
CHECKED = "125645abb4e22dbf"

_TORCHS = fake_tensor.FakeTensorMode._prep_args_for_hash
_STRIDED = torch.strided
# Arguments torch keys as (type, value): none is a tensor, a symbol, a container or a callable.
_PLAIN = frozenset((int, float, bool, type(None), str, torch.dtype, torch.device, torch.layout,
                    torch.memory_format))


def _sources() -> str:
    """What the fast key repeats: the key's walk, each field's value, and the fields' order (their
    names, not the class's source: finding a class's source parses its whole module, 0.1 s)."""
    metadata = fake_tensor.TensorMetadata
    return "".join([*(inspect.getsource(f) for f in (fake_tensor.FakeTensorMode._prep_args_for_hash,
                                                     fake_tensor.extract_tensor_metadata, metadata._flatten_into)),
                    *(f.name for f in dataclasses.fields(metadata))])


@functools.lru_cache(maxsize=1)
def applies() -> bool:
    """Whether this torch's key code is the code the fast key repeats."""
    try:
        digest = hashlib.sha256(_sources().encode()).hexdigest()[:16]
    except (OSError, TypeError):  # no source on disk (a frozen or stripped install)
        return False
    return digest == CHECKED


def _tensor(result: list, t) -> None:
    """What `extract_tensor_metadata(t)._flatten_into` appends, for a strided fake tensor of
    concrete sizes: the metadata's fields in order, its shape and stride as torch keys a tuple."""
    fmt = suggest_memory_format(t)
    if not t.is_contiguous(memory_format=fmt):
        fmt = None
    shape, stride = t.shape, t.stride()
    result += (t.dtype, torch.Size, f"length_{len(shape)}")
    for d in shape:
        result += (int, d)
    result += (tuple, f"length_{len(stride)}")
    for d in stride:
        result += (int, d)
    # device, layout, memory format, storage offset and bytes, requires_grad, is_quantized,
    # is_conj, is_neg, is_inference, is_sparse, is_coalesced, dense_dim, sparse_dim
    result += (t.device, _STRIDED, fmt, t.storage_offset(), t.untyped_storage().nbytes(), t.requires_grad,
               t.is_quantized, t.is_conj(), t.is_neg(), t.is_inference(), False, None, None, None)


def _prep_args_for_hash(self, result: list, args, state, id_hashed_objects: list) -> None:
    """FakeTensorMode._prep_args_for_hash: the same values appended to `result`."""
    if isinstance(args, (list, tuple, dict)):
        result += (type(args), f"length_{len(args)}")
    if isinstance(args, dict):
        _prep_args_for_hash(self, result, args.keys(), state, id_hashed_objects)
        _prep_args_for_hash(self, result, args.values(), state, id_hashed_objects)
        return
    for arg in args:
        kind = type(arg)
        if kind in _PLAIN:
            result += (kind, arg)
        elif kind is list or kind is tuple:
            _prep_args_for_hash(self, result, arg, state, id_hashed_objects)
        elif (kind is fake_tensor.FakeTensor and arg.layout == _STRIDED and not arg._has_symbolic_sizes_strides
              and self.is_our_fake(arg) and arg.constant is None):
            _tensor(result, arg)
        else:  # torch's own way, for this argument alone: without the header of its one-tuple
            n = len(result)
            _TORCHS(self, result, (arg,), state, id_hashed_objects)
            del result[n:n + 2]


def _checked(self, result: list, args, state, id_hashed_objects: list) -> None:
    """torch's key, after failing where the fast one differs from it."""
    fast: list = list(result)
    _prep_args_for_hash(self, fast, args, state, [])
    _TORCHS(self, result, args, state, id_hashed_objects)
    if fast != result or list(map(type, fast)) != list(map(type, result)):
        raise AssertionError(f"fast FakeTensor cache key {fast} differs from torch's {result}")


def _keyed_by(prep) -> contextlib.AbstractContextManager:
    return patched([(fake_tensor.FakeTensorMode, "_prep_args_for_hash", prep)])


def fast_keys() -> contextlib.AbstractContextManager:
    """FakeTensor's cache keyed by `_prep_args_for_hash` here while in it, where it applies (and
    where nothing else keys it: `checking()` around a trace stays)."""
    if applies() and fake_tensor.FakeTensorMode._prep_args_for_hash is _TORCHS:
        return _keyed_by(_prep_args_for_hash)
    return contextlib.nullcontext()


def checking() -> contextlib.AbstractContextManager:
    """Both keys made at every dispatch while in it; AssertionError where they differ."""
    return _keyed_by(_checked)
