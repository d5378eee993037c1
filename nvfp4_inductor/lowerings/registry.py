"""The registered targets, in order of preference, and the built-in ones.

    register_target(target, before=None)   add one (first by default: most preferred)
    unregister_target(name)                remove one
    registered(target)                     context manager: registered inside the block
    targets()                              all, most preferred first
    get_target(name)                       one, by name (ValueError naming the known ones)

Built in: ``cudnn`` (nvidia-cudnn-frontend's NVFP4 grouped GEMMs, CUDA SM100+; its probe
refuses until a run on an SM100 GPU has checked it, ``lowerings/cudnn.py``), then ``triton`` (this
package's Triton kernels, CUDA SM80+), then ``reference`` (pure PyTorch, every device; the
definition every other target is tested against).
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Iterator, Optional, Union

import torch

from .. import activations
from .cudnn import CUDNN  # imports no vendor package: its probe does, lazily
from .target import Capabilities, Target


def _load(module: str):
    return lambda: importlib.import_module(module, __package__).STEPS


def _reference_probe(device: torch.device) -> Capabilities:
    return Capabilities(dtypes=frozenset({torch.bfloat16, torch.float16, torch.float32}))


def _triton_probe(device: torch.device) -> Union[Capabilities, str]:
    from .. import kernels

    if not kernels.available(device):
        return f"triton: the kernels do not run on {device} (Triton missing, or no CUDA)"
    # The fused kernels implement the activations that have Triton code. No fused_amax: D's
    # amaxes come from one amax pass, cheaper than reading D back in the fc1 epilogue
    # (kernels/grouped_gemm_act.py).
    fused = frozenset(name for name in activations.activation_names()
                      if activations.get_activation(name).triton_code is not None)
    return Capabilities(fused_activations=fused)


def _triton_inline() -> bool:
    from .. import kernels

    return kernels.TRACEABLE


TRITON = Target("triton", _load(".triton"), _triton_probe, device_types=("cuda",), min_capability=(8, 0),
                inline=_triton_inline)
REFERENCE = Target("reference", _load(".reference"), _reference_probe)

_TARGETS: list[Target] = [CUDNN, TRITON, REFERENCE]


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
