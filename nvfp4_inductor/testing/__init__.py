"""Test doubles for this package's targets, for tests here and in projects that use it (as
``torch.testing``): nothing in the package imports this module.

    simulated_target(name="cudnn_sim", base=None, fused=True)   the cudnn target on CPU tensors
    simulated_sm100(semantics=None, ...)                          the self-checked cudnn target
                                                                  over the simulator, registered
                                                                  as "cudnn" on a faked SM10x
    simulated_sm100_fp4(steps=None, ...)                          the self-checked triton_fp4
                                                                  target (the interpreter's FP4
                                                                  GEMMs, or a stand-in) and the
                                                                  triton target on a faked SM10x
    cudnn_sim                                                    the CPU simulator it calls
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterator, Optional

from ..lowerings import Target, get_target, register_target, unregister_target
from ..lowerings import cudnn_sim
from ..lowerings.cudnn import capabilities_from_signatures, describe, make_steps, read_signatures, wired
from ..lowerings.cudnn_target import self_checked_target
from ..lowerings.reference import STEPS as REFERENCE_STEPS
from ..lowerings.self_check import Stack
from ..lowerings.triton_fp4_target import self_checked_fp4_target

__all__ = ["cudnn_sim", "simulated_sm100", "simulated_sm100_fp4", "simulated_target", "SIMULATED_STACK"]

# The stack of the faked SM10x device: a B200 that is the simulator on the CPU.
SIMULATED_STACK = Stack("simulated NVIDIA B200 (cudnn_sim on CPU)", (10, 0), "simulated", "simulated", "1.32 (cudnn_sim)",
                        "simulated", "simulated", "simulated")


def simulated_target(name: str = "cudnn_sim", base=None, fused: bool = True) -> Target:
    """The cudnn step table over ``cudnn_sim`` on CPU tensors, with the capabilities the
    probe reads from the simulator's signatures (1.32's) restricted to what is wired: for
    tests (register it with ``lowerings.registered``). `base`: the step table it borrows
    quantizers and unfused activations from (default: the reference's); `fused` False: no
    fused kernels (every step unfused). No self-check."""
    steps = make_steps(cudnn_sim, base or REFERENCE_STEPS)
    caps = wired(capabilities_from_signatures(read_signatures(cudnn_sim)), fused)
    return Target(name, lambda: steps, lambda device: caps, device_types=("cpu",), describe=describe)


@contextlib.contextmanager
def simulated_sm100(semantics: Optional[dict] = None, stack: Stack = SIMULATED_STACK) -> Iterator[Target]:
    """Inside the block the registry's "cudnn" target is the self-checked one over
    ``cudnn_sim.frontend(semantics)`` (a frontend whose wrappers compute those releases'
    contracts) on CPU tensors, as if the CPU were an SM10x GPU with `stack`: its probe runs the
    self-check (or reads its verdict from the cache) exactly as on a Blackwell GPU."""
    frontend = cudnn_sim.frontend(semantics)
    target = self_checked_target("cudnn", lambda: frontend, lambda: REFERENCE_STEPS, lambda device: stack,
                                 device_types=("cpu",))
    with _in_place_of(target):
        yield target


@contextlib.contextmanager
def simulated_sm100_fp4(steps=None, stack: Stack = SIMULATED_STACK) -> Iterator[Target]:
    """Inside the block the registry's "triton_fp4" target is the self-checked one over
    `steps` (default: its own table, ``lowerings.triton.FP4_STEPS``, whose FP4 GEMMs run under
    the Triton interpreter, the one MMA replaced by its exact sum) on CPU tensors, and the
    "triton" target (bf16-operand GEMMs) runs on CPU tensors too: the CPU as an SM10x GPU
    with `stack` and without the cuDNN frontend. Its probe runs the FP4 self-check (or reads
    its verdict from the cache) exactly as on a Blackwell GPU; a wrong stand-in in `steps`
    fails it, and plans fall to "triton". Needs TRITON_INTERPRET=1 (the kernels on CPU)."""
    from ..lowerings.triton import FP4_STEPS

    table = steps or FP4_STEPS
    target = self_checked_fp4_target("triton_fp4", lambda: table, lambda device: stack, device_types=("cpu",))
    with _in_place_of(target), _in_place_of(dataclasses.replace(get_target("triton"), device_types=("cpu",))):
        yield target


@contextlib.contextmanager
def _in_place_of(target: Target) -> Iterator[None]:
    """`target` registered in place of the registry's target of its name, inside the block."""
    real = get_target(target.name)
    after = _next_name(real.name)
    unregister_target(real.name)
    register_target(target, before=after)
    try:
        yield
    finally:
        unregister_target(target.name)
        register_target(real, before=after)


def _next_name(name: str) -> Optional[str]:
    from ..lowerings import targets

    names = [t.name for t in targets()]
    index = names.index(name)
    return names[index + 1] if index + 1 < len(names) else None
