"""FakeTensor's dispatch cache, its key and its hits' outputs made with less Python.

FakeTensorMode answers an op from its cache when it saw the op before on inputs of the same
metadata, and in a trace nearly every op is such a hit (a 7B training trace of 4 layers from an
empty cache: 4,518 of 4,855 keyed dispatches). Making the key is then the largest part of a
dispatch (55% of `_cached_dispatch_impl`'s time there): torch walks each fake input
through `extract_tensor_metadata` and `TensorMetadata._flatten_into` (a `dataclasses.fields` walk
and three sparse-layout checks per tensor). `FakeTensorMode._prep_args_for_hash` here appends the
very same values for what a step passes (strided fake tensors of concrete shape, numbers, dtypes,
devices, lists of them) and hands everything else to torch's own code.

Making a hit's output is the next largest part: torch checks each size for a symbol, enters two
generator-made context managers, and `FakeTensor.__new__` normalises the device and sets five memo
descriptors (three attributes each). `_get_output_tensor_from_cache_entry` here makes the same
tensor for what a trace's hits are (a fresh or viewed strided tensor on the CPU, no shape
environment) and hands the rest (in-place ops, constants, symbols) to torch's own code.

Each stands in only for the torch code it was written against: the source of the functions it
repeats (and the metadata's field names, in order) must hash to its CHECKED digest, else torch's
own code is kept (a newer torch is slower here, never wrong). `checking()` makes both keys and
both outputs at every dispatch and fails where they differ (the tests).
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

# sha256 of _sources() and of _hit_sources() on torch 2.13.0, where the key and the hit's output
# were checked equal to torch's
CHECKED = "125645abb4e22dbf"
HIT_CHECKED = "8b4003f7d5fa8f19"

_TORCHS = fake_tensor.FakeTensorMode._prep_args_for_hash
_TORCHS_HIT = fake_tensor.FakeTensorMode._get_output_tensor_from_cache_entry
_STRIDED = torch.strided
# Arguments torch keys as (type, value): none is a tensor, a symbol, a container or a callable.
_PLAIN = frozenset((int, float, bool, type(None), str, torch.dtype, torch.device, torch.layout,
                    torch.memory_format))

# The memo descriptors FakeTensor.__new__ sets to None, as the attributes their __set__ writes (none
# where a torch names the descriptor otherwise: hit_applies() is then False).
_MEMO = getattr(fake_tensor, "SymNumberMemoDescriptor", None)
_MEMOS = sorted(n for n, v in vars(fake_tensor.FakeTensor).items() if isinstance(v, _MEMO)) if _MEMO is not None else []
_NO_MEMOS = {f"_{n}{part}": None for n in _MEMOS for part in ("", "_vc", "_epoch")}
_CPU = torch.device("cpu")
_make_subclass = torch.Tensor._make_subclass


def _sources() -> str:
    """What the fast key repeats: the key's walk, each field's value, and the fields' order (their
    names, not the class's source: finding a class's source parses its whole module, 0.1 s)."""
    metadata = fake_tensor.TensorMetadata
    return "".join([*(inspect.getsource(f) for f in (fake_tensor.FakeTensorMode._prep_args_for_hash,
                                                     fake_tensor.extract_tensor_metadata, metadata._flatten_into)),
                    *(f.name for f in dataclasses.fields(metadata))])


def _hit_sources() -> str:
    """What the fast hit repeats: the output's making, the kernel-invocation guard, the tensor's
    construction, its device's normalisation and its memos' setting (and their names)."""
    fake = fake_tensor.FakeTensor
    return "".join([*(inspect.getsource(f) for f in (
        _TORCHS_HIT, fake_tensor.in_kernel_invocation_manager, fake.__new__, fake._normalize_fake_device,
        fake_tensor.SymNumberMemoDescriptor.__set__)), *_MEMOS])


def _matches(sources, checked: str) -> bool:
    try:
        digest = hashlib.sha256(sources().encode()).hexdigest()[:16]
    except (OSError, TypeError, AttributeError):  # no source on disk (a frozen or stripped install), or gone
        return False
    return digest == checked


@functools.lru_cache(maxsize=1)
def applies() -> bool:
    """Whether this torch's key code is the code the fast key repeats."""
    return _matches(_sources, CHECKED)


@functools.lru_cache(maxsize=1)
def hit_applies() -> bool:
    """Whether this torch's code for a hit's output is the code the fast hit repeats."""
    return _matches(_hit_sources, HIT_CHECKED)


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


def _hit(self, state, entry, key, func, args):
    """FakeTensorMode._get_output_tensor_from_cache_entry: the same tensor, for a fresh or viewed
    strided output on the CPU without a shape environment (a trace's hits)."""
    metadata = entry.metadata
    if entry.inplace_idx is not None or metadata is None or self.shape_env is not None or self.in_kernel_invocation \
            or metadata.device != _CPU or metadata.layout is not _STRIDED or metadata.is_conj or metadata.is_neg \
            or fake_tensor.FakeTensorConfig.debug:
        return _TORCHS_HIT(self, state, entry, key, func, args)
    # in_kernel_invocation_manager, inline: torch dispatch off, the meta kernels on
    with torch._C._DisableTorchDispatch(), torch._C._PreserveDispatchKeyGuard():
        self.in_kernel_invocation = True
        torch._C._set_meta_in_tls_dispatch_include(True)
        try:
            empty = torch.empty_strided(metadata.shape, metadata.stride, dtype=metadata.dtype, layout=_STRIDED,
                                        device="meta", requires_grad=metadata.requires_grad)
            if isinstance(func, torch._ops.OpOverload) and func.is_view:  # a view shares its input's storage
                empty.set_(args[entry.view_idx].untyped_storage(), metadata.storage_offset, metadata.shape,
                           metadata.stride)
        finally:
            self.in_kernel_invocation = False
    # FakeTensor.__new__(self, empty, cpu), its device already normalised and its memos empty
    out = _make_subclass(fake_tensor.FakeTensor, empty, empty.requires_grad, dispatch_device=True,
                         device_for_backend_keys=_CPU)
    if self._allow_unsafe_data_ptr_access:
        torch._C._set_warn_deprecated_on_mutable_data_ptr(out)
    else:
        torch._C._set_throw_on_mutable_data_ptr(out)
    state_of = out.__dict__
    state_of.update(_NO_MEMOS)
    state_of.update(_fake_device=_CPU, fake_mode=self, constant=None, pytype=None, dispatch_keys=None, real_tensor=None)
    return out


def _described(t) -> tuple:
    """What tells two hit outputs apart but a view's storage (which _checked_hit compares): a
    FakeTensor's metadata, dispatch keys and own attributes."""
    if not isinstance(t, torch.Tensor):
        return (type(t), t)
    return (type(t), t.shape, t.stride(), t.storage_offset(), t.dtype, t.requires_grad, t.is_inference(),
            torch._C._dispatch_keys(t), t.untyped_storage().nbytes(), sorted(t.__dict__.items()))


def _checked_hit(self, state, entry, key, func, args):
    """torch's output, after failing where the fast one differs from it."""
    fast, torchs = _hit(self, state, entry, key, func, args), _TORCHS_HIT(self, state, entry, key, func, args)
    same_storage = not isinstance(torchs, torch.Tensor) or entry.view_idx is None or \
        fast.untyped_storage()._cdata == torchs.untyped_storage()._cdata
    if _described(fast) != _described(torchs) or not same_storage:
        raise AssertionError(f"fast FakeTensor cache hit of {func} {_described(fast)} differs from torch's "
                             f"{_described(torchs)}")
    return torchs


def fast_cache() -> contextlib.AbstractContextManager:
    """FakeTensor's cache keyed by `_prep_args_for_hash` here and its hits made by `_hit` while in
    it, each where it applies (and where nothing else stands in: `checking()` around a trace stays)."""
    mode = fake_tensor.FakeTensorMode
    patches: list[tuple[object, str, object]] = []
    if applies() and mode._prep_args_for_hash is _TORCHS:
        patches.append((mode, "_prep_args_for_hash", _prep_args_for_hash))
    if hit_applies() and mode._get_output_tensor_from_cache_entry is _TORCHS_HIT:
        patches.append((mode, "_get_output_tensor_from_cache_entry", _hit))
    return patched(patches)


def checking() -> contextlib.AbstractContextManager:
    """Both keys and both outputs of a hit made at every dispatch while in it; AssertionError where
    they differ."""
    return patched([(fake_tensor.FakeTensorMode, "_prep_args_for_hash", _checked),
                    (fake_tensor.FakeTensorMode, "_get_output_tensor_from_cache_entry", _checked_hit)])
