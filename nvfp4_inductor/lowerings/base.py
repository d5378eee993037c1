"""The step table every target fills in, and the lookup by device."""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch


@dataclasses.dataclass(frozen=True)
class Lowering:
    """One target's implementation of each step of the grouped MLP.

    Each field takes exactly the arguments of the reference function named in
    ``lowerings/reference.py`` and returns the same types and bits.

    Optional fused steps (None: the target runs the unfused steps above). Each returns
    the same bits as the unfused steps it replaces, so callers may use either:
      fc1_act_amax(a_data, a_scale, a_amax, b_data, b_scale, b_amax, group_sizes, probs,
                   activation, tanh_clamp_scale, sign_mask, *, want_amax=True)
          -> (C, D, pre-RHT amax, post-RHT amax)   grouped_gemm -> activation_forward
                                                   -> group_hadamard_amax(D, sizes, sign_mask)
      fc2_dgrad_act(a_data, a_scale, a_amax, b_data, b_scale, b_amax, group_sizes, c, probs,
                    activation, tanh_clamp_scale, *, regenerate=False)
          -> (dC, dp or None, D or None)           grouped_gemm -> activation_backward
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
    fc1_act_amax: Optional[Callable] = None  # fused fc1 + activation + D's amaxes
    fc2_dgrad_act: Optional[Callable] = None  # fused fc2 dgrad + activation backward

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
