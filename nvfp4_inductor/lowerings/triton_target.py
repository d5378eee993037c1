"""The triton target: this package's Triton kernels (CUDA SM80+; on CPU tensors through the
Triton interpreter). Its step table is ``triton.py``, imported when the target first runs."""

from __future__ import annotations

from typing import Union

import torch

from .. import activations
from .steps import Steps
from .target import Capabilities, Target


def steps() -> Steps:
    from .triton import STEPS

    return STEPS


def probe(device: torch.device) -> Union[Capabilities, str]:
    from .. import kernels

    if not kernels.available(device):
        return f"triton: the kernels do not run on {device} (Triton missing, or no CUDA)"
    # The fused kernels implement the activations that have Triton code. No fused_amax: D's
    # amaxes come from one amax pass, cheaper than reading D back in the fc1 epilogue
    # (kernels/grouped_gemm_act.py).
    fused = frozenset(name for name in activations.activation_names()
                      if activations.get_activation(name).triton_code is not None)
    return Capabilities(fused_activations=fused)


def inline() -> bool:
    from .. import kernels

    return kernels.TRACEABLE


TRITON = Target("triton", steps, probe, device_types=("cuda",), min_capability=(8, 0), inline=inline)
