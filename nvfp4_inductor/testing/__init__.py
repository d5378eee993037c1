"""Test doubles for this package's targets, for tests here and in projects that use it (as
``torch.testing``): nothing in the package imports this module.

    simulated_target(name="cudnn_sim", base=None, fused=True)   the cudnn target on CPU tensors
    cudnn_sim                                                    the CPU simulator it calls
"""

from __future__ import annotations

from ..lowerings import Target
from ..lowerings.cudnn import capabilities_from_signatures, describe, make_steps, read_signatures, wired
from ..lowerings.reference import STEPS as REFERENCE_STEPS
from . import cudnn_sim

__all__ = ["cudnn_sim", "simulated_target"]


def simulated_target(name: str = "cudnn_sim", base=None, fused: bool = True) -> Target:
    """The cudnn step table over ``cudnn_sim`` on CPU tensors, with the capabilities the
    probe reads from the simulator's signatures (1.32's) restricted to what is wired: for
    tests (register it with ``lowerings.registered``). `base`: the step table it borrows
    quantizers and unfused activations from (default: the reference's); `fused` False: no
    fused kernels (every step unfused)."""
    steps = make_steps(cudnn_sim, base or REFERENCE_STEPS)
    caps = wired(capabilities_from_signatures(read_signatures(cudnn_sim)), fused)
    return Target(name, lambda: steps, lambda device: caps, device_types=("cpu",), describe=describe)
