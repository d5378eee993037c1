"""Which target runs a site, and which of its fused kernels run (rules 3-5 of
docs/numerics.md section 6).

Legality of a site (dtypes, shapes) is the compiler's business; this module picks, among
registered targets that can run the site, the first in preference order, and decides
whether its fused kernels run and whether D's amaxes come from the fused fc1 epilogue.
``choose_plan`` is a function of the site and the registry only (each target's probe
says what it can do on the site's device), so the rules are unit-testable on CPU with
described targets. The backend chooses once per site and hands the plan to the fused
ops; the eager chain (``nn.py``) runs the plan ``choose_plan`` gives for its call, fused
kernels included, and a lone eager op with no target runs ``choose_target``.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence, Union

import torch

from ..recipe import Recipe
from . import registry
from .steps import Steps
from .target import Capabilities, Target


@dataclasses.dataclass(frozen=True)
class SiteSpec:
    """What the policy needs to know about a site.

    device: where it runs; capability: the CUDA compute capability (None elsewhere);
    dtype: of x and the weights; hidden / ffn: H and F (None: not checked).
    """

    activation: str
    device: torch.device
    capability: Optional[tuple[int, int]] = None
    dtype: torch.dtype = torch.bfloat16
    hidden: Optional[int] = None
    ffn: Optional[int] = None

    @classmethod
    def on(cls, device, activation: str, **facts) -> "SiteSpec":
        """The spec of a site on a real device (its compute capability read from it)."""
        device = torch.device(device)
        capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
        return cls(activation, device, capability, **facts)


@dataclasses.dataclass(frozen=True)
class Plan:
    """What runs a site.

    target: the target's name.
    fused_fc1: its fused fc1 GEMM + activation kernel runs (else the GEMM, then the activation).
    fused_amax: that kernel's epilogue gives D's pre/post-RHT amax (else one group
        Hadamard-amax pass over D).
    fused_dgrad: its fused fc2 dgrad + activation backward kernel runs.
    reason: why, for a person.
    d_regenerable: the backward can rebuild D bit for bit from the saved bf16 C (rule 5):
        False only when a fused fc1 kernel makes D from something else.
    """

    target: str
    fused_fc1: bool
    fused_amax: bool
    fused_dgrad: bool
    reason: str
    d_regenerable: bool = True

    def recomputes_d(self, recompute: bool) -> bool:
        """Whether the backward regenerates D under the backend's `recompute` option (rule 1):
        only where that D is the forward's (rule 5); otherwise D's column-wise copy is saved."""
        return recompute and self.d_regenerable


def fused_amax_allowed(name: str, caps: Capabilities, recipe: Recipe,
                       activation: Optional[str] = None) -> tuple[bool, str]:
    """Rule 4 (given a fused fc1 kernel): may its amax feed the fc2 input's casts?"""
    if not caps.fused_amax:
        return False, f"{name}'s fused fc1 kernel emits no amax: one group Hadamard-amax pass over D"
    if activation is not None and caps.fused_amax_activations is not None and (
            activation not in caps.fused_amax_activations):
        return False, f"{name}'s fused fc1 kernel emits no amax for {activation}: one group Hadamard-amax pass over D"
    if recipe.rht and recipe.sign_mask != 0 and not caps.fused_amax_signed_hadamard:
        return False, (
            f"{name}'s fused post-RHT amax uses the unsigned Hadamard but the recipe's sign mask is "
            f"{recipe.sign_mask:#06x}: amax pass (fused only with sign_mask=0)"
        )
    return True, f"{name} fuses D's amax into the fc1 epilogue"


def site_mismatch(name: str, caps: Capabilities, site: SiteSpec) -> Optional[str]:
    """Why a target with these capabilities cannot run the site, or None."""
    if caps.activations is not None and site.activation not in caps.activations:
        return f"{name} does not run {site.activation}"
    if site.dtype not in caps.dtypes:
        return f"{name} does not take {str(site.dtype).replace('torch.', '')}"
    for dim, size in (("H", site.hidden), ("F", site.ffn)):
        if size is not None and size % caps.alignment:
            return f"{name} needs {dim} % {caps.alignment} == 0, got {dim} = {size}"
    return None


def plan_with(name: str, caps: Capabilities, site: SiteSpec, recipe: Recipe) -> tuple[Plan, str]:
    """The plan for a site on a target that can run it (rules 3-5), and why."""
    fc1 = site.activation in caps.fused_activations
    dgrad = site.activation in (caps.fused_activations if caps.fused_dgrad_activations is None
                                else caps.fused_dgrad_activations)
    if not fc1 and not dgrad:
        why = (f"{name} has no fused kernel for {site.activation}: GEMMs and activation run apart, "
               f"one group Hadamard-amax pass over D")
        return Plan(name, False, False, False, ""), why
    if fc1:
        fused_amax, why = fused_amax_allowed(name, caps, recipe, site.activation)
    else:
        fused_amax, why = False, f"{name}'s fused fc1 is off for {site.activation}: GEMM, then the activation"
    if not dgrad:
        why += f"; {name}'s fused fc2 dgrad is off for {site.activation}: GEMM, then the activation backward"
    if not caps.fused_d_from_stored_c:
        why += (f"; {name}'s fused kernels do not make D from the bf16 C it stores, so the backward cannot "
                "rebuild D from the saved C: D's column-wise copy is saved, recompute or not")
    return Plan(name, fc1, fused_amax, dgrad, "", d_regenerable=caps.fused_d_from_stored_c), why


CUDNN_MODES = ("auto", "require", "off")


def choose_plan(site: SiteSpec, recipe: Recipe, candidates: Optional[Sequence[Target]] = None,
                cudnn: str = "auto") -> Plan:
    """The first target (in preference order; default: the registry's) that runs on the
    site's device and can run the site, with its fused-kernel decisions and a reason a
    person can read. Raises when none can (the reference runs everywhere, so only a
    registry without it can get there). `cudnn` (the backend option): "auto" takes the
    cudnn target where it runs (on SM10x after its self-check passed); "off" passes it over;
    "require" raises NotImplementedError, with the reason, where the plan is not cudnn's."""
    if cudnn not in CUDNN_MODES:
        raise ValueError(f"cudnn must be one of {CUDNN_MODES}; got {cudnn!r}")
    if cudnn != "auto":
        plan = choose_plan(site, recipe, [t for t in (registry.targets() if candidates is None else candidates)
                                          if t.name != "cudnn"] if cudnn == "off" else candidates)
        if cudnn == "require" and plan.target != "cudnn":
            raise NotImplementedError(f"option cudnn='require': the cudnn target cannot run this {site.activation} "
                                      f"grouped MLP on {site.device}: {plan.reason}")
        return plan
    skipped = []
    for target in registry.targets() if candidates is None else candidates:
        caps = _capabilities(target, site.device.type, site.capability, site.device)
        if isinstance(caps, str):
            if target.device_types is None or site.device.type in target.device_types:
                skipped.append(caps)
            continue
        mismatch = site_mismatch(target.name, caps, site)
        if mismatch:
            skipped.append(mismatch)
            continue
        plan, why = plan_with(target.name, caps, site, recipe)
        if target.describe is not None:
            why = f"{why}; {target.describe(plan, site, recipe)}"
        return dataclasses.replace(plan, reason="; ".join(skipped + [f"{target.name} on {site.device.type}", why]))
    raise RuntimeError(f"no registered target runs a {site.activation} grouped MLP on {site.device}: "
                       + "; ".join(skipped))


def choose_target(device) -> Target:
    """The first registered target that runs on `device`: what an eager op runs when no
    plan names its target."""
    device = torch.device(device)
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    for target in registry.targets():
        if not isinstance(_capabilities(target, device.type, capability, device), str):
            return target
    raise RuntimeError(f"no registered target runs on {device}")


def steps_for(target: Optional[str], device) -> Steps:
    """The step table of the named target, or of ``choose_target(device)`` when None."""
    return (registry.get_target(target) if target is not None else choose_target(device)).steps()


def _capabilities(target: Target, device_type: str, capability, device) -> Union[Capabilities, str]:
    return target.device_mismatch(device_type, capability) or target.probe(device)
