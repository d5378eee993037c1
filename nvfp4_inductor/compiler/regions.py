"""Checks on a matched region that every matcher shares: biases, where the prob is
applied, and intermediates that escape the region. Each returns None or the reason."""

from __future__ import annotations

import operator

import torch

from .match_activation import gemms_behind, prob_column
from .nodes import Node, is_op, op_name, strip_row_masks, transposed_last_two
from .site import Weight

ADD = (torch.add, operator.add, torch.Tensor.add, torch.Tensor.__add__, torch.Tensor.__radd__)


def _bias_add(node: Node) -> Node | None:
    """The user of ``node`` (through casts) that adds a tensor to it, if any."""
    for user in node.users:
        if is_op(user, torch.Tensor.to):
            found = _bias_add(user)
            if found is not None:
                return found
        elif is_op(user, *ADD) and all(isinstance(a, Node) for a in user.args[:2]):
            return user
    return None


def fc2_bias_reason(fc2: Node) -> str | None:
    add = _bias_add(fc2)
    return None if add is None else f"fc2 output has a bias added (`{add.name}`)"


def fc1_bias_reason(fc2_input: Node, is_gemm) -> str | None:
    for gemm in gemms_behind(fc2_input, is_gemm):
        add = _bias_add(gemm)
        if add is not None:
            return f"fc1 output has a bias added (`{add.name}`)"
    return None


def prob_on_input_reason(x: Node) -> str | None:
    """The router prob multiplied on the expert input x: not the fused MLP's semantics
    (it applies the prob to the activation, after the fc1 quantization of x)."""
    product = strip_row_masks(x)
    if prob_column(product) is not None:
        return (f"router prob multiplied on the expert input (`{product.name}`); the fused "
                "grouped MLP applies it to the activation")
    return None


def escaping_use(region: set, allowed: set) -> str | None:
    """A node of ``region`` used by a node outside ``region | allowed``."""
    for node in region:
        for user in node.users:
            if user not in region and user not in allowed:
                return (f"`{node.name}` ({op_name(node)}) inside the grouped MLP is also used by "
                        f"`{user.name}` outside it")
    return None


def kn_weight(b: Node) -> Weight:
    """The stacked weight behind a (G, K, N) GEMM operand: a transposed (G, N, K)
    tensor is in nn.Linear layout, anything else is taken as (in, out)."""
    source = transposed_last_two(b)
    return Weight((source,), "out_in") if source is not None else Weight((b,), "in_out")
