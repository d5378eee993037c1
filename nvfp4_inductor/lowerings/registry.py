"""The registered targets, in order of preference, and the built-in ones.

    register_target(target, before=None)   add one (first by default: most preferred)
    unregister_target(name)                remove one
    registered(target)                     context manager: registered inside the block
    targets()                              all, most preferred first
    get_target(name)                       one, by name (ValueError naming the known ones)

Built in: ``cudnn`` (nvidia-cudnn-frontend's NVFP4 grouped GEMMs, CUDA SM100+; its probe
runs its self-check on the GPU first, ``lowerings/self_check.py``), then ``triton_fp4``
(the Triton kernels with the plain GEMMs on the FP4 tensor cores, SM10x-11x, after its own
self-check, ``lowerings/fp4_self_check.py``), then ``triton`` (this package's Triton
kernels, CUDA SM80+), then ``reference`` (pure PyTorch, every device; the
definition every other target is tested against).
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

from .cudnn_target import CUDNN
from .reference_target import REFERENCE
from .target import Target
from .triton_fp4_target import TRITON_FP4
from .triton_target import TRITON

# Each built-in target is declared in its own module (``<name>_target.py``), which imports
# no step table, Triton or vendor package: its ``steps`` does, when the target first runs.
_TARGETS: list[Target] = [CUDNN, TRITON_FP4, TRITON, REFERENCE]


def targets() -> tuple[Target, ...]:
    return tuple(_TARGETS)


def get_target(name: str) -> Target:
    for target in _TARGETS:
        if target.name == name:
            return target
    raise ValueError(f"target must be one of {[t.name for t in _TARGETS]}; got {name!r}")


def register_target(target: Target, before: Optional[str] = None) -> None:
    """Add `target` before the target named `before` (default: first, the most preferred)."""
    if not isinstance(target, Target):
        raise ValueError(f"register_target takes a lowerings.Target; got {type(target).__name__}")
    if any(t.name == target.name for t in _TARGETS):
        raise ValueError(f"a target named {target.name!r} is already registered")
    index = 0 if before is None else _TARGETS.index(get_target(before))
    _TARGETS.insert(index, target)


def unregister_target(name: str) -> None:
    _TARGETS.remove(get_target(name))


@contextlib.contextmanager
def registered(target: Target, before: Optional[str] = None) -> Iterator[Target]:
    register_target(target, before)
    try:
        yield target
    finally:
        unregister_target(target.name)
