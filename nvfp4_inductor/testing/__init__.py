"""Test doubles for this package's targets, for tests here and in projects that use it (as
``torch.testing``): nothing in the package imports this module.

    simulated_target(name="cudnn_sim", base=None, fused=True)   the cudnn target on CPU tensors
    simulated_sm100(semantics=None, ...)                          the self-checked cudnn target
                                                                  over the simulator, registered
                                                                  as "cudnn" on a faked SM10x
    cudnn_sim                                                    the CPU simulator it calls
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

from ..lowerings import Target, get_target, register_target, unregister_target
from ..lowerings import cudnn_sim
from ..lowerings.cudnn import capabilities_from_signatures, describe, make_steps, read_signatures, wired
from ..lowerings.cudnn_target import self_checked_target
from ..lowerings.reference import STEPS as REFERENCE_STEPS
from ..lowerings.self_check import Stack

__all__ = ["cudnn_sim", "simulated_sm100", "simulated_target", "SIMULATED_STACK"]

# The stack of the faked SM10x device: a B200 that is the simulator on the CPU.
SIMULATED_STACK = Stack("simulated NVIDIA B200 (cudnn_sim on CPU)", (10, 0), "simulated", "simulated", "1.32 (cudnn_sim)",
                        "simulated", "simulated")


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
    real = get_target("cudnn")
    after = _next_name(real.name)
    unregister_target("cudnn")
    register_target(target, before=after)
    try:
        yield target
    finally:
        unregister_target("cudnn")
        register_target(real, before=after)


def _next_name(name: str) -> Optional[str]:
    from ..lowerings import targets

    names = [t.name for t in targets()]
    index = names.index(name)
    return names[index + 1] if index + 1 < len(names) else None
