"""Sites with DTensor operands: rejected with a reason (``can_grouped_mlp`` asks first).

The fused ops take plain tensors. A site whose operands are DTensors stays as the user
wrote it: ``GroupedMLP`` with all-Replicate DTensors then runs its eager ``nvfp4::*`` ops
through their sharding strategies (registered here, so AOTAutograd can trace them), and
other spellings run as stock PyTorch. Expert-parallel weights (Shard(0) over experts,
rows already local) never reach this check from ``GroupedMLP`` / ``grouped_mlp``: they
turn them into local tensors before the graph's call node (``distributed.py``), so those
sites are rewritten. Accepts: any site; returns a reason only when an operand is a DTensor.
"""

from __future__ import annotations

from ..distributed import describe, is_dtensor, register_sharding_strategies
from .nodes import Node, val
from .site import Site


def site_operands(site: Site) -> list[tuple[str, Node]]:
    """(name, node) of every tensor operand of the site, as the user's graph holds it."""
    operands = [("x", site.x)]
    for name, weight in (("fc1 weight", site.fc1_weight), ("fc1 up weight", site.fc1_up_weight),
                         ("fc2 weight", site.fc2_weight)):
        if weight is not None:
            operands += [(name, node) for node in weight.nodes]
    if isinstance(site.group_sizes.source, Node):
        operands.append(("group sizes", site.group_sizes.source))
    if site.probs is not None:
        operands.append(("probs", site.probs))
    return operands


def dtensor_reason(site: Site) -> str | None:
    for name, node in site_operands(site):
        value = val(node)
        if is_dtensor(value):
            register_sharding_strategies()  # the unrewritten site may run the eager ops on DTensors
            return (f"{name} is {describe(value)}; the fused grouped MLP takes plain local tensors (expert "
                    "parallel: local rows and the Shard(0) weights' .to_local(), as GroupedMLP does; an "
                    "all-Replicate GroupedMLP runs its eager ops through their sharding strategies; "
                    "docs/distributed.md)")
    return None
