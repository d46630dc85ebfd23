"""Attributes of torch's (and the libraries') classes and modules set for the length of a trace."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def patched(patches: list[tuple[object, str, object]]) -> Iterator[None]:
    """Each (owner, name, value) set inside, as it was after (read from the owner's own dict:
    a staticmethod stays one)."""
    saved = [(owner, name, vars(owner)[name]) for owner, name, _ in patches]
    for owner, name, value in patches:
        setattr(owner, name, value)
    try:
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)
