"""Targets that run the grouped MLP's steps, and the policy that picks one per site.

A lowering is a table of step functions with one signature per step (the reference's);
the eager ops and the fused compiled op call the same table, so compiled == eager
bitwise on every device by construction.
"""

from .base import Lowering, lowering_for_device
from .policy import Plan, SiteSpec, TargetCapabilities, choose_plan, TARGETS

__all__ = ["Lowering", "lowering_for_device", "Plan", "SiteSpec", "TargetCapabilities", "choose_plan", "TARGETS"]
