"""This package's own grouped MLP, already one call in the Dynamo graph.

Matched node (``grouped_mlp`` validates its arguments, then calls
``nvfp4_inductor.nn.grouped_mlp_call``, which is allowed in the graph, so Dynamo keeps
``GroupedMLP`` / ``grouped_mlp`` as one call_function node)::

    y = nvfp4_inductor.nn.grouped_mlp_call(x, fc1_weight, fc2_weight, group_sizes, probs,
                                           activation=..., tanh_clamp_scale=..., recipe=...)

Its operands are already canonical (x (T, H), W1 (G, F1, H), W2 (G, H, F), group sizes
(G,), probs (T,) or None). Replacement: ``make_call`` with the same operands. The
``recipe`` keyword is not part of the canonical call (the backend's options carry the
recipe). Accepts bf16, as the eager function does.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..activations import activation_names, get_activation
from ..nn import grouped_mlp_call
from ..recipe import Recipe
from .legality import can_grouped_mlp
from .nodes import Node, arg, shape
from .site import GroupSizes, Rejection, Site, Weight, location_of


def find_grouped_mlp(gm: torch.fx.GraphModule) -> tuple[list[Site], list[Rejection]]:
    sites, rejections = [], []
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not grouped_mlp_call:
            continue
        found = grouped_mlp_site(node)
        if isinstance(found, Site):
            sites.append(found)
        else:
            rejections.append(Rejection("grouped_mlp_module", location_of(node), found))
    return sites, rejections


def grouped_mlp_site(node: Node) -> Site | str:
    x, fc1, fc2, sizes = (arg(node, i, name) for i, name in
                          enumerate(("x", "fc1_weight", "fc2_weight", "group_sizes")))
    probs = arg(node, 4, "probs")
    activation = node.kwargs.get("activation", "srelu")
    scale = node.kwargs.get("tanh_clamp_scale")
    if activation not in activation_names():
        return f"activation {activation!r} is not one of {activation_names()}"
    if not get_activation(activation).takes_scale:
        scale = None
    elif not isinstance(scale, float):
        return f"tanh_clamp_scale must be a python float for {activation}, got {scale!r}"
    for name, operand in (("x", x), ("fc1_weight", fc1), ("fc2_weight", fc2), ("group_sizes", sizes)):
        if not isinstance(operand, Node):
            return f"{name} is {operand!r}, not a tensor of the graph"
    recipe = recipe_call(node)
    site = Site(
        x=x, fc1_weight=Weight((fc1,), "out_in"), fc2_weight=Weight((fc2,), "out_in"),
        group_sizes=GroupSizes("sizes", sizes, (shape(sizes) or (0,))[0]),
        probs=probs if isinstance(probs, Node) else None,
        activation=activation, tanh_clamp_scale=scale, spelling="grouped_mlp_module",
        location=location_of(node), output=node, nodes=(node,) if recipe is None else (node, recipe),
    )
    return can_grouped_mlp(site) or site


def recipe_call(node: Node) -> Optional[Node]:
    """The node building a ``grouped_mlp`` call's ``Recipe`` (Dynamo keeps the constructor
    call when the module makes its recipe in forward), or None. The site matches it with the
    call so that the rewrite erases it (a graph calling a class of ours is not one
    AOTAutograd's cache takes); the backend reads the recipe off it."""
    recipe = node.kwargs.get("recipe")
    return recipe if isinstance(recipe, Node) and recipe.op == "call_function" and recipe.target is Recipe else None
