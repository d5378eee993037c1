"""What a target is: a name, where it runs, what its kernels can do, and its step table.

A target's static facts (device kinds, compute-capability range) are plain fields; what
depends on the machine (is the package importable, does the installed version take an
optional argument) comes from its ``probe``, which returns the target's ``Capabilities``
on a device or the reason it cannot run there. ``steps`` loads the step table on first
use, so importing this package never imports Triton or a vendor library.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Union

import torch

from ..constants import BLOCK
from .steps import Steps


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What a target's kernels can do on one device.

    fused_activations: the activations its fused kernels implement (fc1 GEMM + activation,
        fc2 dgrad + activation backward; the steps ``fc1_act_amax`` / ``fc2_dgrad_act``).
        Other activations run as separate GEMM and activation steps. tanh-SReLU belongs
        here only where the fused kernel implements the clamp (rule 3).
    fused_amax: the fused fc1 kernel's epilogue can emit D's per-group pre- and post-RHT amax.
    fused_amax_activations: the fused activations whose fc1 kernel emits that amax (None: all
        of ``fused_activations``; cuDNN's Hadamard kernel has no tanh clamp, for one).
    fused_dgrad_activations: the activations whose fused fc2-dgrad kernel runs (None: those of
        ``fused_activations``); the cudnn self-check turns one off without the other.
    fused_amax_signed_hadamard: that post-RHT amax is of the signed Hadamard, the recipe's
        signs applied (cuDNN's SM100 Hadamard kernel uses the unsigned one: False) (rule 4).
    fused_d_from_stored_c: its fused fc1 kernel computes D from the bf16 C it stores, as the
        unfused activation step does, so the backward can rebuild that D from the saved C
        (cuDNN's reads the fp32 accumulator: False, and D's column-wise copy is saved) (rule 5).
    dtypes: the dtypes of x and the weights it takes.
    alignment: H and F must be multiples of it.
    activations: the activations it runs at all (None: every registered one).
    """

    fused_activations: frozenset[str] = frozenset()
    fused_amax: bool = False
    fused_amax_activations: Optional[frozenset[str]] = None
    fused_dgrad_activations: Optional[frozenset[str]] = None
    fused_amax_signed_hadamard: bool = False
    fused_d_from_stored_c: bool = True
    dtypes: frozenset[torch.dtype] = frozenset({torch.bfloat16})
    alignment: int = BLOCK
    activations: Optional[frozenset[str]] = None


Probe = Callable[[torch.device], Union[Capabilities, str]]


@dataclasses.dataclass(frozen=True)
class Target:
    """A way to run the grouped MLP's steps.

    name: how plans, ops and ``explain`` name it.
    steps: returns the step table (called when the target runs, not at import).
    probe: ``probe(device)`` -> its Capabilities there, or why it cannot run there
        (a missing package, an unsupported device).
    device_types: the torch device types it runs on (None: every device).
    min_capability / max_capability: the CUDA compute-capability range it runs on,
        inclusive (None: unbounded); only read for CUDA devices.
    describe: ``describe(plan, site, recipe)`` -> what the target's plan runs and why, in
        words (which vendor kernel for each fused step), appended to the plan's reason.
    inline: ``inline()`` -> whether a compiled graph may hold its steps themselves instead
        of one opaque call per op (``target_ops.py``): only for steps made of Triton
        launches and exact integer and copy torch ops, which Inductor runs with the same
        bits. False by default.
    """

    name: str
    steps: Callable[[], Steps]
    probe: Probe
    device_types: Optional[tuple[str, ...]] = None
    min_capability: Optional[tuple[int, int]] = None
    max_capability: Optional[tuple[int, int]] = None
    describe: Optional[Callable] = None
    inline: Callable[[], bool] = lambda: False

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"Target.name must be a non-empty str; got {self.name!r}")

    def device_mismatch(self, device_type: str, capability: Optional[tuple[int, int]]) -> Optional[str]:
        """Why the target cannot run on a device of this type and (CUDA) compute capability
        by its static facts, or None."""
        if self.device_types is not None and device_type not in self.device_types:
            return f"{self.name} runs on {'/'.join(self.device_types)}, not {device_type}"
        if device_type == "cuda" and capability is not None:
            if self.min_capability and capability < self.min_capability:
                return f"{self.name} needs compute capability >= {_cc(self.min_capability)}, the device has {_cc(capability)}"
            if self.max_capability and capability > self.max_capability:
                return f"{self.name} needs compute capability <= {_cc(self.max_capability)}, the device has {_cc(capability)}"
        return None


def _cc(capability: tuple[int, int]) -> str:
    return f"{capability[0]}.{capability[1]}"
