"""The cudnn target: nvidia-cudnn-frontend's NVFP4 grouped GEMMs on Blackwell (SM10x).

Its capabilities, ``describe`` and step table over the frontend's wrappers are in
``cudnn.py``; ``steps`` imports the frontend when the target first runs, so declaring it
imports no vendor package. Its probe runs the self-check (``self_check.py``) on the device
the first time a plan asks, once per machine and software stack (the verdict is cached on
disk), and gives the capabilities the check left on; ``self_checked_target`` builds the
same target over any frontend (``nvfp4_inductor.testing``: the simulator on a faked SM10x).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from . import self_check
from .cudnn import capabilities_from_signatures, describe, installed_capabilities, make_steps, read_signatures
from .cudnn import wired, wrappers_used
from .steps import Steps
from .target import Target


def self_checked_target(name: str, frontend: Callable[[], object], base: Callable[[], Steps],
                        stack: Callable[[torch.device], self_check.Stack],
                        capabilities: Optional[Callable[[], object]] = None, **where) -> Target:
    """The cudnn target over `frontend()` (the ``cudnn`` package, or a simulator), with
    `base()`'s quantizers and unfused activations; its probe runs the self-check on the
    site's device for `stack(device)` and gives the capabilities it left on; `describe`
    adds each wrapper's verdict. `capabilities()`: the frontend's (default: read from its
    signatures); `where`: ``Target``'s device fields."""

    def caps():
        found = capabilities() if capabilities is not None else capabilities_from_signatures(
            read_signatures(frontend()))
        return found if isinstance(found, str) else wired(found)

    def verdict(device):
        found = caps()
        if isinstance(found, str):
            return found
        return self_check.verdict(frontend(), torch.device(device), stack(torch.device(device)), base(), found)

    def probe(device):
        found = verdict(device)
        if isinstance(found, str):
            return found
        if found.refusal:
            return f"{name}: its self-check on {found.stack.gpu} ({found.date[:10]}) failed: {found.refusal}"
        return self_check.restricted(caps(), found)

    def describe_checked(plan, site, recipe):
        found = verdict(site.device)
        if isinstance(found, str):  # a probe that did not check (a test's described target)
            return describe(plan, site, recipe)
        checked = "; ".join(f"{w}: {found.says(w, None if w in _BASIS else site.activation)}"
                            for w in wrappers_used(plan, site.activation))
        off = [c for c in found.cases if not c.ok and c.activation == site.activation]
        checked += "".join(f"; {c.wrapper}: {found.says(c.wrapper, c.activation)}" for c in off)
        return f"{describe(plan, site, recipe)}; {checked}"

    return Target(name, lambda: make_steps(frontend(), base()), probe, describe=describe_checked, **where)


_BASIS = ("grouped_gemm_quant_wrapper_sm100", "grouped_gemm_wgrad_wrapper_sm100")


def _frontend():
    import cudnn

    return cudnn


def _base() -> Steps:
    """Quantizers and the unfused activations from the Triton target (bit-exact twins of
    the reference)."""
    from .triton import STEPS

    return STEPS


# SM10x/SM11x (tcgen05, 2-CTA MMA). SM12x passes the wrappers' own gate (>= 10.0) but the
# kernels are SM10x-class and are expected to fail at JIT compile there: refused here.
CUDNN = self_checked_target("cudnn", _frontend, _base, self_check.Stack.of, capabilities=installed_capabilities,
                            device_types=("cuda",), min_capability=(10, 0), max_capability=(11, 99))
