"""Can a matched Site take the fused grouped-MLP call? Dtypes, shapes, expert counts.

Dtypes: bf16, or fp32 where ``torch.autocast(dtype=torch.bfloat16)`` is in force at the
site (fp32 master weights, fp32 activations): the block then computes in bf16 as autocast
computes a GEMM, and the rewrite casts each fp32 operand to bf16 with a graph node, so the
NVFP4 copies are made from those casts and gradients reach the fp32 tensors through the
casts' backward, as under autocast.

``can_grouped_mlp(site)`` returns None when the canonical call can replace the site, else
the reason (rule and value). It decides legality only; which target runs the call is
the backend's policy.
"""

from __future__ import annotations

import torch

from ..activations import get_activation
from ..constants import BLOCK
from .nodes import autocast_dtype, same_dims, val
from .placements import dtensor_reason
from .site import Site, Weight


def weight_shape(weight: Weight) -> tuple:
    """``(G, out, in)`` of a weight in the canonical nn.Linear layout."""
    first = tuple(val(weight.nodes[0]).shape)
    g, (a, b) = (first[0], first[1:]) if weight.stacked else (len(weight.nodes), first)
    return (g, a, b) if weight.layout == "out_in" else (g, b, a)


def can_grouped_mlp(site: Site) -> str | None:
    if reason := dtensor_reason(site):  # before anything reads a DTensor's fake value
        return reason
    x = val(site.x)
    weights = {"fc1 weight": site.fc1_weight, "fc2 weight": site.fc2_weight}
    if site.fc1_up_weight is not None:
        weights["fc1 up weight"] = site.fc1_up_weight
    autocast = autocast_dtype(site.output, x.device.type)
    for name, tensor in [("x", x)] + [(n, val(node)) for n, w in weights.items() for node in w.nodes]:
        if tensor.dtype != torch.bfloat16 and not (tensor.dtype == torch.float32 and autocast == torch.bfloat16):
            where = (f"torch.autocast is in force with dtype={autocast}" if autocast is not None
                     else "no torch.autocast is in force")
            return (f"{name} is {tensor.dtype}; the fused grouped MLP takes torch.bfloat16, or torch.float32 "
                    f"under torch.autocast(dtype=torch.bfloat16) ({where})")
        if tensor.device != x.device:
            return f"{name} is on {tensor.device}, x on {x.device}"
    for name, w in weights.items():
        shapes = [tuple(val(n).shape) for n in w.nodes]
        if any(not same_dims(s, shapes[0]) for s in shapes):
            return f"{name}: the experts' weights have different shapes {shapes}"
    rank = 3 if site.x_batched else 2
    if x.dim() != rank:
        return f"x has {x.dim()} dims, expected {rank}"
    hidden = x.shape[-1]
    g1, f1, h1 = weight_shape(site.fc1_weight)
    g2, h2, f2 = weight_shape(site.fc2_weight)
    if site.fc1_up_weight is not None:
        gu, fu, hu = weight_shape(site.fc1_up_weight)
        if (gu, fu, hu) != (g1, f1, h1):
            return f"fc1 gate weight is {(g1, f1, h1)} but fc1 up weight is {(gu, fu, hu)} (G, out, in)"
        f1 = f1 + fu
    for name, dim in (("H", hidden), ("F", f2), ("G", g1)):
        if not isinstance(dim, int):
            return f"{name} = {dim} is symbolic; the expert weights must have static shapes"
    if g1 != g2:
        return f"fc1 weight has {g1} experts, fc2 weight has {g2}"
    if g1 != site.group_sizes.count:
        return f"the weights have {g1} experts, the routing has {site.group_sizes.count} groups"
    if h1 != hidden or h2 != hidden:
        return f"x has H = {hidden}, fc1 weight takes {h1}, fc2 weight gives {h2}"
    expected_f1 = 2 * f2 if get_activation(site.activation).gated else f2
    if f1 != expected_f1:
        return f"fc1 gives {f1} features, fc2 takes {f2}; {site.activation} needs fc1 = {expected_f1}"
    for name, dim in (("H", hidden), ("F", f2)):
        if dim % BLOCK:
            return f"{name} = {dim} is not a multiple of {BLOCK} (the NVFP4 block size)"
    return None
