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
    """The lowering that runs on `device` (SPEC 7): the Triton kernels on CUDA devices of
    compute capability >= 8.0 when Triton is installed, else the pure-PyTorch reference
    (always on CPU). Decided at call time, never at import."""
    if triton_runs_on(device):
        from .triton import TRITON

        return TRITON
    from .reference import REFERENCE

    return REFERENCE


def triton_runs_on(device: torch.device) -> bool:
    device = torch.device(device)
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 0):
        return False
    from .. import kernels

    return kernels.available(device)
