"""The region between the two GEMMs of a grouped MLP: activation and router probability.

Recognised, walking back from the node that feeds fc2 (dtype casts are looked through):

    d = f(h) [* p]          p: a (T, 1) column (``p.unsqueeze(-1)``, ``p[:, None]``,
                            ``p.reshape(-1, 1)``), on either side of the multiply
    srelu:       r**2 | r.pow(2) | torch.pow(r, 2) | r.square() | torch.square(r) | r * r
                 with r = relu(h)                     (F.relu, torch.relu, h.relu())
    tanh_srelu:  the same square of  s * tanh(relu(h) / s)  (either operand order of the
                 outer multiply; s one python float, the same twice)
    swiglu:      silu(a) * b  (either order), a and b the two halves of one fc1 output
                 (``h.chunk(2, -1)``, ``h.split(F, -1)``, ``h[..., :F]`` / ``h[..., F:]``)
                 or the outputs of two separate fc1 GEMMs (gate, up)

and, after fc2 (``match_output_prob``):

    y = fc2_out [.to(fp32)] * p [.to(bf16)]
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.nn.functional as F

from .nodes import (
    ELEMENTWISE_OR_VIEW,
    Node,
    arg,
    int_index,
    is_op,
    op_name,
    op_of,
    shape,
    strip_casts,
)


@dataclasses.dataclass(frozen=True)
class ActivationMatch:
    """activation / tanh_clamp_scale: as in Site.
    fc1_outputs: ``(h,)`` the one fc1 output, or ``(gate, up)`` for separate GEMMs.
    gate_second: swiglu on one fc1 output whose second half goes through silu.
    probs: the (T, 1)-shaped prob column multiplied on the activation, or None.
    nodes: the nodes of the region (from the fc1 outputs' users to fc2's input).
    """

    activation: str
    tanh_clamp_scale: float | None
    fc1_outputs: tuple[Node, ...]
    gate_second: bool
    probs: Node | None
    nodes: tuple[Node, ...]


def match_activation(fc2_input: Node, is_gemm) -> ActivationMatch | str:
    """Match the region ending in ``fc2_input``; ``is_gemm(node)`` says what an fc1 GEMM
    output looks like. Returns the match or the reason it is not one."""
    nodes: list[Node] = []
    d = strip_casts(fc2_input, nodes)
    probs = None
    column = prob_column(d)
    if column is not None:
        nodes.append(d)
        probs, d = column
        d = strip_casts(d, nodes)
    result = _square_form(d, nodes) or _swiglu_form(d, nodes, is_gemm)
    if result is None:
        return f"activation {describe_region(fc2_input, is_gemm)} is not srelu, tanh_srelu or swiglu"
    if isinstance(result, str):
        return result
    activation, scale, fc1_outputs, gate_second = result
    for h in fc1_outputs:
        if not is_gemm(h):
            return (f"activation input `{h.name}` ({op_name(h)}) is not the output of the fc1 "
                    f"grouped GEMM")
    return ActivationMatch(activation, scale, fc1_outputs, gate_second, probs, tuple(dict.fromkeys(nodes)))


def match_output_prob(fc2_out: Node) -> tuple[Node | None, Node, tuple[Node, ...]]:
    """``(probs, last, nodes)``: the prob column multiplied on the fc2 output (or None),
    the last node of that product (after a cast back), and the nodes from the product on."""
    nodes: list[Node] = []
    node = fc2_out
    while len(node.users) == 1 and is_op(next(iter(node.users)), torch.Tensor.to):
        node = next(iter(node.users))
        nodes.append(node)
    if len(node.users) != 1:
        return None, fc2_out, ()
    mul = next(iter(node.users))
    if not is_op(mul, torch.mul) or not all(isinstance(a, Node) for a in mul.args[:2]):
        return None, fc2_out, ()
    other = mul.args[1] if mul.args[0] is node else mul.args[0]
    if not _is_column_of(other, node):
        return None, fc2_out, ()
    nodes.append(mul)
    last = mul
    while len(last.users) == 1 and is_op(next(iter(last.users)), torch.Tensor.to):
        last = next(iter(last.users))
        nodes.append(last)
    return _column_source(other), last, tuple(nodes)


def describe_region(fc2_input: Node, is_gemm, limit: int = 24) -> str:
    """``{op, op, ...}``: the ops between the fc1 GEMM(s) and ``fc2_input``, for reasons."""
    names, stack, seen = [], [fc2_input], set()
    while stack and len(seen) < limit:
        node = stack.pop()
        if not isinstance(node, Node) or node in seen or is_gemm(node) or \
                node.op not in ("call_function", "call_method"):
            continue
        seen.add(node)
        if op_of(node) not in ELEMENTWISE_OR_VIEW:
            continue
        if not is_op(node, operator.getitem, torch.Tensor.to):
            names.append(op_name(node))
        stack.extend(a for a in node.args if isinstance(a, Node))
    return "{" + ", ".join(sorted(set(names))) + "}"


def gemms_behind(fc2_input: Node, is_gemm, limit: int = 24) -> list[Node]:
    """The GEMM nodes reachable back from ``fc2_input`` through elementwise/view ops only."""
    found, stack, seen = [], [fc2_input], set()
    while stack and len(seen) < limit:
        node = stack.pop()
        if not isinstance(node, Node) or node in seen:
            continue
        seen.add(node)
        if is_gemm(node):
            found.append(node)
            continue
        if op_of(node) not in ELEMENTWISE_OR_VIEW:
            continue
        if is_op(node, operator.getitem) and not _is_static_index(node.args[1]):
            continue
        stack.extend(a for a in node.args if isinstance(a, Node))
    return found


def _is_static_index(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return all(isinstance(i, (int, slice)) or i is Ellipsis or i is None for i in items)


# ----------------------------------------------------------------------------- the prob


def prob_column(node: Node) -> tuple[Node, Node] | None:
    """``(prob column, other operand)`` when ``node`` multiplies a (T, F) tensor by a
    (T, 1) column."""
    if not is_op(node, torch.mul) or len(node.args) < 2:
        return None
    a, b = node.args[:2]
    if not (isinstance(a, Node) and isinstance(b, Node)):
        return None
    for column, other in ((b, a), (a, b)):
        if _is_column_of(column, other):
            return _column_source(column), other
    return None


def _is_column_of(column: Node, other: Node) -> bool:
    c, o = shape(column), shape(other)
    return (c is not None and o is not None and len(c) == len(o) >= 2
            and c[-1] == 1 and o[-1] != 1 and c[:-1] == o[:-1])


def _column_source(column: Node) -> Node:
    """The prob tensor behind an added unit dim (``p.unsqueeze(-1)``, ``p[:, None]``,
    ``p.view(-1, 1)``); the column itself when it was built otherwise."""
    node = strip_casts(column)
    if is_op(node, torch.unsqueeze, torch.reshape):
        return node.args[0]
    if is_op(node, operator.getitem) and isinstance(node.args[1], tuple) and node.args[1][-1] is None:
        return node.args[0]
    return column


# ----------------------------------------------------------------------------- srelu forms


def _squared(node: Node) -> Node | None:
    """r when ``node`` is r**2 in one of its spellings."""
    op = op_of(node)
    if op is torch.square:
        return node.args[0]
    if op is torch.pow and len(node.args) >= 2 and node.args[1] == 2 and isinstance(node.args[0], Node):
        return node.args[0]
    if op is torch.mul and len(node.args) >= 2 and isinstance(node.args[0], Node):
        a, b = node.args[:2]
        if a is b:
            return a
        if is_op(a, torch.relu) and is_op(b, torch.relu) and a.args[0] is b.args[0]:
            return a  # relu(h) * relu(h), the relu written twice; both are in the region
    return None


def _relu_input(node: Node, nodes: list) -> Node | None:
    node = strip_casts(node, nodes)
    if is_op(node, torch.relu) and not node.kwargs.get("inplace", False):
        nodes.append(node)
        return node.args[0]
    return None


def _square_form(d: Node, nodes: list):
    r = _squared(d)
    if r is None:
        return None
    nodes.extend(a for a in d.args if isinstance(a, Node) and a is not r and is_op(a, torch.relu))
    nodes.append(d)
    h = _relu_input(r, nodes)
    if h is not None:
        return "srelu", None, (strip_casts(h, nodes),), False
    tanh_form = _tanh_clamp(strip_casts(r, nodes), nodes)
    if tanh_form is None:
        return None
    return tanh_form


def _tanh_clamp(b: Node, nodes: list):
    """``s * tanh(relu(h) / s)`` -> ("tanh_srelu", s, (h,), False)."""
    if not is_op(b, torch.mul) or len(b.args) < 2:
        return None
    x, y = b.args[:2]
    s, t = (x, y) if isinstance(x, float) else (y, x)
    if not isinstance(s, float) or not is_op(t, torch.tanh):
        return None
    q = strip_casts(t.args[0], nodes)
    if not is_op(q, torch.div) or len(q.args) < 2:
        return None
    if q.args[1] != s:
        return f"tanh-SReLU scales differ: s * tanh(relu(h) / {q.args[1]!r}) with s = {s!r}"
    h = _relu_input(q.args[0], nodes)
    if h is None:
        return None
    if not s > 0:
        return f"tanh-SReLU clamp scale must be > 0, got {s!r}"
    nodes.extend((b, t, q))
    return "tanh_srelu", s, (strip_casts(h, nodes),), False


# ----------------------------------------------------------------------------- swiglu forms


def _swiglu_form(d: Node, nodes: list, is_gemm):
    if not is_op(d, torch.mul) or len(d.args) < 2:
        return None
    a, b = (strip_casts(x, nodes) if isinstance(x, Node) else x for x in d.args[:2])
    gate_silu, up = (a, b) if _is_silu(a) else (b, a)
    if not _is_silu(gate_silu) or not isinstance(up, Node):
        return None
    nodes.extend((d, gate_silu))
    gate = strip_casts(gate_silu.args[0], nodes)
    if is_gemm(gate) and is_gemm(up):
        return "swiglu", None, (gate, up), False
    gate_half, up_half = _half(gate, nodes), _half(up, nodes)
    if gate_half is None or up_half is None:
        return None
    (g_src, g_idx), (u_src, u_idx) = gate_half, up_half
    if g_src is not u_src or {g_idx, u_idx} != {0, 1}:
        return "swiglu gate and up are not the two halves of one fc1 output"
    return "swiglu", None, (g_src,), g_idx == 1


def _is_silu(node) -> bool:
    return is_op(node, F.silu) and not (isinstance(node, Node) and node.kwargs.get("inplace", False))


def _half(node: Node, nodes: list) -> tuple[Node, int] | None:
    """``(h, 0 | 1)`` when ``node`` is the first / second half of h along its last dim."""
    index = int_index(node)
    if index is not None:
        parent = node.args[0]
        h = parent.args[0] if isinstance(parent, Node) else None
        width = (shape(h) or (None,))[-1]
        if is_op(parent, torch.chunk) and arg(parent, 1, "chunks") == 2 and _last_dim(parent, 2, h):
            nodes.extend((node, parent))
            return h, index
        if is_op(parent, torch.split) and _last_dim(parent, 2, h):
            sizes = arg(parent, 1, "split_size_or_sections", arg(parent, 1, "split_size"))
            if isinstance(sizes, int) and width == 2 * sizes or (
                    isinstance(sizes, (list, tuple)) and len(sizes) == 2 and sizes[0] == sizes[1]):
                nodes.extend((node, parent))
                return h, index
        return None
    if is_op(node, operator.getitem) and isinstance(node.args[1], tuple):
        h = node.args[0]
        width = (shape(h) or (None,))[-1]
        *lead, last = node.args[1]
        if not isinstance(last, slice) or not all(i is Ellipsis or i == slice(None) for i in lead):
            return None
        if last.step is None and width is not None and width % 2 == 0:
            half = width // 2
            if last.start in (None, 0) and last.stop == half:
                nodes.append(node)
                return h, 0
            if last.start == half and last.stop in (None, width):
                nodes.append(node)
                return h, 1
    return None


def _last_dim(node: Node, dim_index: int, h) -> bool:
    dim = arg(node, dim_index, "dim", 0)
    rank = len(shape(h) or ())
    return rank > 0 and isinstance(dim, int) and dim % rank == rank - 1
