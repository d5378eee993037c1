"""Which target runs a site, and how the fc2 input's amax is obtained (SPEC 6, rules 3-4).

Legality of a site (dtypes, shapes) is the compiler's business; this module only picks,
among targets that can run the site, the one to use and whether its fused
GEMM+activation kernel may emit D's amax. Capabilities are plain data, so the rules are
unit-testable on CPU with described (not installed) targets.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from ..recipe import Recipe


@dataclasses.dataclass(frozen=True)
class TargetCapabilities:
    """What a target's kernels can do.

    fused_act_amax: the fc1 GEMM epilogue can emit D's per-group pre- and post-RHT amax.
    fused_amax_takes_sign_mask: that post-RHT amax uses the quantizer's sign mask
        (cuDNN's SM100 Hadamard kernel uses the unsigned Hadamard: False).
    fused_tanh_clamp: the fused kernel implements tanh-SReLU's clamp.
    """

    name: str
    device_type: str
    min_capability: Optional[tuple[int, int]] = None
    fused_act_amax: bool = False
    fused_amax_takes_sign_mask: bool = False
    fused_tanh_clamp: bool = False


@dataclasses.dataclass(frozen=True)
class SiteSpec:
    """What the policy needs to know about a site."""

    activation: str
    device_type: str
    capability: Optional[tuple[int, int]] = None


@dataclasses.dataclass(frozen=True)
class Plan:
    target: str
    fused_amax: bool  # D's amax comes from the fc1 epilogue (else from one amax pass)
    reason: str


REFERENCE_CAPS = TargetCapabilities(name="reference", device_type="cpu")
# The Triton fc1 epilogue (kernels/grouped_gemm_act.py) emits D's pre- and post-RHT amax
# with the recipe's sign mask, bit-identical to the amax pass; the TRITON lowering's
# fc1_act_amax field is that kernel.
TRITON_CAPS = TargetCapabilities(
    name="triton",
    device_type="cuda",
    min_capability=(8, 0),
    fused_act_amax=True,
    fused_amax_takes_sign_mask=True,
    fused_tanh_clamp=True,
)
CUDNN_CAPS = TargetCapabilities(
    name="cudnn",
    device_type="cuda",
    min_capability=(10, 0),
    fused_act_amax=True,
    fused_amax_takes_sign_mask=False,
    fused_tanh_clamp=True,
)
TARGETS = (CUDNN_CAPS, TRITON_CAPS, REFERENCE_CAPS)


def fused_amax_allowed(caps: TargetCapabilities, site: SiteSpec, recipe: Recipe) -> tuple[bool, str]:
    """Rules 3 and 4: may the fused kernel's amax feed the fc2 input's casts?"""
    if not caps.fused_act_amax:
        return False, f"{caps.name} has no fused GEMM+activation amax: one group Hadamard-amax pass over D"
    if site.activation == "tanh_srelu" and not caps.fused_tanh_clamp:
        return False, f"{caps.name}'s fused kernel lacks the tanh clamp: tanh-SReLU runs the amax pass"
    if recipe.rht and recipe.sign_mask != 0 and not caps.fused_amax_takes_sign_mask:
        return False, (
            f"{caps.name}'s fused post-RHT amax uses the unsigned Hadamard but the recipe's sign mask is "
            f"{recipe.sign_mask:#06x}: amax pass (fused only with sign_mask=0)"
        )
    return True, f"{caps.name} fuses D's amax into the fc1 epilogue"


def choose_plan(
    site: SiteSpec,
    recipe: Recipe,
    targets: tuple[TargetCapabilities, ...] = TARGETS,
    available: Optional[set[str]] = None,
) -> Plan:
    """The first target (in preference order) that runs on the site's device and is
    available, with the fused-amax decision and a reason a person can read."""
    skipped = []
    for caps in targets:
        if caps.device_type != site.device_type:
            continue
        if caps.min_capability and (site.capability is None or site.capability < caps.min_capability):
            skipped.append(f"{caps.name} needs compute capability >= {caps.min_capability}")
            continue
        if available is not None and caps.name not in available:
            skipped.append(f"{caps.name} is not installed/wired")
            continue
        fused, why = fused_amax_allowed(caps, site, recipe)
        reason = "; ".join(skipped + [f"{caps.name} on {site.device_type}", why])
        return Plan(target=caps.name, fused_amax=fused, reason=reason)
    # Every device can run the pure-PyTorch reference.
    fused, why = fused_amax_allowed(REFERENCE_CAPS, site, recipe)
    return Plan("reference", fused, "; ".join(skipped + [f"reference (pure PyTorch) on {site.device_type}", why]))


def available_targets(device: torch.device) -> set[str]:
    """Targets whose code is wired in for `device` today (cuDNN's is not yet)."""
    from .base import triton_runs_on

    return {"reference"} | ({"triton"} if triton_runs_on(device) else set())
