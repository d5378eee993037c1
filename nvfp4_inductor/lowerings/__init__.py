"""Targets that run the grouped MLP's steps: the registry and the policy that picks one.

A target (``Target``) is a name, where it runs, its capabilities on a device (its probe)
and its step table (``Steps``, one function per step with the reference's signature).
The eager ops and the fused compiled ops call the same table of the same target, so
compiled == eager bitwise on every device by construction. ``choose_plan`` picks the
target and its fused kernels per site; ``explain`` prints that plan, and the fused ops
run it.
"""

from .policy import Plan, SiteSpec, choose_plan, choose_target, steps_for
from .registry import get_target, register_target, registered, targets, unregister_target
from .steps import Steps
from .target import Capabilities, Target

__all__ = [
    "Capabilities", "Plan", "SiteSpec", "Steps", "Target", "choose_plan", "choose_target", "get_target",
    "register_target", "registered", "steps_for", "targets", "unregister_target",
]
