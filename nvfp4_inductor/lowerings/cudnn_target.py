"""The cudnn target: nvidia-cudnn-frontend's NVFP4 grouped GEMMs on Blackwell (SM10x).

Its probe, ``describe`` and step table over the frontend's wrappers are in ``cudnn.py``;
``steps`` imports the frontend when the target first runs, so declaring it imports no
vendor package.
"""

from __future__ import annotations

import dataclasses

from .cudnn import describe, installed_capabilities, make_steps, probe, wired
from .steps import Steps
from .target import Target


def steps() -> Steps:
    """The frontend's wrappers; quantizers and the unfused activations from the Triton
    target (bit-exact twins of the reference)."""
    import cudnn

    from .triton import STEPS

    return make_steps(cudnn, STEPS)


# SM10x/SM11x (tcgen05, 2-CTA MMA). SM12x passes the wrappers' own gate (>= 10.0) but the
# kernels are SM10x-class and are expected to fail at JIT compile there: refused here.
CUDNN = Target("cudnn", steps, probe, device_types=("cuda",), min_capability=(10, 0), max_capability=(11, 99),
               describe=describe)


def check_target(name: str = "cudnn_check", fused: bool = True) -> Target:
    """The real cudnn target with its probe ungated, for an explicit registration (the
    Blackwell check): the installed frontend's capabilities, restricted to what is wired."""

    def probe_now(device):
        caps = installed_capabilities()
        return caps if isinstance(caps, str) else wired(caps, fused)

    return dataclasses.replace(CUDNN, name=name, probe=probe_now)
