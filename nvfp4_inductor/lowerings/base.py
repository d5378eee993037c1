"""The step table every target fills in, and the lookup by device."""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch


@dataclasses.dataclass(frozen=True)
class Lowering:
    """One target's implementation of each step of the grouped MLP.

    Each field takes exactly the arguments of the reference function named in
    ``lowerings/reference.py`` and returns the same types and bits.
    """

    name: str
    quantize: Callable  # numerics.quantize_torch
    group_quantize: Callable  # numerics.group_quantize_torch
    group_hadamard_amax: Callable  # numerics.group_hadamard_amax_torch
    quantize_weights: Callable  # numerics.quantize_weights_torch
    grouped_gemm: Callable  # numerics.grouped_gemm_torch (fprop, dgrad)
    grouped_gemm_wgrad: Callable  # numerics.grouped_gemm_wgrad_torch
    activation_forward: Callable  # activations.activation_forward
    activation_backward: Callable  # activations.activation_backward

    def runs(self, step: str) -> str:
        """What runs `step` (a field name), e.g. 'numerics.group_quantize_torch', for explain."""
        fn = getattr(self, step)
        return f"{fn.__module__.removeprefix('nvfp4_inductor.')}.{fn.__qualname__}"


def lowering_for_device(device: torch.device) -> Lowering:
    """The lowering that runs on `device`: the pure-PyTorch reference on CPU, and on CUDA
    too until the Triton target is wired in (it slots in here)."""
    from .reference import REFERENCE

    return REFERENCE
