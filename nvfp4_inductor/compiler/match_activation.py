"""Activations in FX graphs: the registered activations' patterns matched against Dynamo
nodes. One of three activation modules: ``activations.py`` holds the registry and the
reference math, ``kernels/activation.py`` the Triton kernels.

The region between the two GEMMs of a grouped MLP: activation and router probability.
Recognised, walking back from the node that feeds fc2 (dtype casts are looked through
everywhere):

    d = f(h) [* p]          p: a (T, 1) column (``p.unsqueeze(-1)``, ``p[:, None]``,
                            ``p.reshape(-1, 1)``), on either side of the multiply

f is the first registered activation whose ``pattern`` (activations.py) the nodes spell,
each pattern op in any of its spellings:

    square(x)    x**2 | x.pow(2) | torch.pow(x, 2) | x.square() | torch.square(x) | x * x
                 (one node, or the same op written twice on the same inputs:
                 relu(h) * relu(h))
    mul(x, y)    x * y | torch.mul(x, y) | x.mul(y), either operand order
    div(x, y)    x / y | torch.div(x, y) | x.div(y), no rounding mode
    relu(x)      F.relu | torch.relu | x.relu(), not inplace
    silu(x)      F.silu, not inplace
    tanh(x)      torch.tanh | x.tanh()
    H            the fc1 output
    GATE, UP     the two halves of one fc1 output (``h.chunk(2, -1)``, ``h.split(F, -1)``,
                 ``h[..., :F]`` / ``h[..., F:]``; the gate in the second half sets
                 ``gate_second``) or the outputs of two separate fc1 GEMMs (gate, up)
    S            one python float, the same wherever S occurs, > 0

so the built-ins are srelu = square(relu(H)), tanh_srelu = square(mul(S, tanh(div(relu(H),
S)))) and swiglu = mul(silu(GATE), UP); and, after fc2 (``match_output_prob``):

    y = fc2_out [.to(fp32)] * p [.to(bf16)]

Row masks (``nodes.RowMask``: ``masked_fill(m, 0)`` / ``masked_fill_`` / ``where(m, 0, .)``
/ ``* m.to(dtype)`` with a bool (T, 1) column m) on D (before or after the prob), on the
fc2 output (before or after the prob; ``match_output_prob``) or on an fc1 output are part
of the block: they are returned with the match and the rewrite folds them into the prob
as zeros, which gives the masked rows D = f(C) * 0 = 0, Y = 0 and dprob = 0 (the
masked_fill on the prob). That is the model's function:
* a mask on D or on Y zeroes D's or Y's row, whatever f: the same rows and dprob = 0;
* a mask on C gives the row D = f(0) * p, which is 0 only for an activation that is 0 at
  0 (``Activation.zero_at_zero``; every built-in: relu(0) = tanh(0) = silu(0) * u = 0).
  For any other activation the site is rejected with that reason and runs as written;
* a mask inside the activation's expression (in place on one of its intermediates) would
  need the rest of the expression to be 0 at 0, which the registry does not record: the
  site is rejected.
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.nn.functional as F

from ..activations import PATTERN_OPS, Activation, Op, Var, activation_names, get_activation
from .nodes import (
    ELEMENTWISE_OR_VIEW,
    Node,
    RowMask,
    arg,
    inplace_row_masks,
    int_index,
    is_column_of,
    is_op,
    not_a_row_mask,
    op_name,
    op_of,
    row_mask,
    shape,
    strip_casts,
    strip_row_masks,
)


@dataclasses.dataclass(frozen=True)
class ActivationMatch:
    """activation / tanh_clamp_scale: as in Site.
    fc1_outputs: ``(h,)`` the one fc1 output, or ``(gate, up)`` for separate GEMMs.
    gate_second: a gated activation on one fc1 output whose second half is the gate.
    probs: the (T, 1)-shaped prob column multiplied on the activation, or None.
    nodes: the nodes of the region (from the fc1 outputs' users to fc2's input).
    masks: the row masks on the fc1 outputs and on D (in the region's nodes too), each
        one that folds into the prob (module docstring).
    """

    activation: str
    tanh_clamp_scale: float | None
    fc1_outputs: tuple[Node, ...]
    gate_second: bool
    probs: Node | None
    nodes: tuple[Node, ...]
    masks: tuple[RowMask, ...] = ()


def match_activation(fc2_input: Node, is_gemm) -> ActivationMatch | str:
    """Match the region ending in ``fc2_input``; ``is_gemm(node)`` says what an fc1 GEMM
    output looks like. Returns the match or the reason it is not one."""
    nodes: list[Node] = []
    masks: list[RowMask] = []
    probs, d = _activation_output(fc2_input, masks, nodes)
    d_side = {*nodes, d}  # D (the activation's output) and the nodes from it to fc2's input
    reasons: list[str] = []
    for name in activation_names():
        found = _match_entry(get_activation(name), d, is_gemm, reasons)
        if found is not None:
            break
    else:
        names = activation_names()
        listed = f"{', '.join(names[:-1])} or {names[-1]}" if len(names) > 1 else names[0]
        return reasons[0] if reasons else f"activation {describe_region(fc2_input, is_gemm)} is not {listed}"
    activation, scale, fc1_outputs, gate_second, region = found
    gemms, on_c = [], []
    for h in fc1_outputs:
        gemm = strip_row_masks(h, on_c, nodes)
        if not is_gemm(gemm):
            return (f"activation input `{gemm.name}` ({op_name(gemm)}{not_a_row_mask(gemm)}) is not the output "
                    f"of the fc1 grouped GEMM")
        gemms.append(gemm)
    masks += on_c
    region = [*nodes, *region]
    for node in (*gemms, *region):  # in-place masks: ``h.masked_fill_(m, 0)``
        for mask in inplace_row_masks(node):
            if _holds_fc1_output(node, is_gemm):
                on_c.append(mask)
            elif node not in d_side:
                return (f"row mask `{mask.node.name}` on `{node.name}`, inside the activation {activation}: only "
                        f"masks on fc1's output, on D or on fc2's output fold into the router prob")
            masks.append(mask)
            region.append(mask.node)
    if on_c and not get_activation(activation).zero_at_zero:
        return (f"row mask `{on_c[0].node.name}` on the fc1 output: {activation} is not 0 at 0 "
                f"(Activation.zero_at_zero), so the masked rows' D = f(0) * p is not 0 and the mask cannot fold "
                f"into the router prob")
    return ActivationMatch(activation, scale, tuple(gemms), gate_second, probs,
                           tuple(dict.fromkeys(region)), tuple(dict.fromkeys(masks)))


def _activation_output(fc2_input: Node, masks: list, nodes: list) -> tuple[Node | None, Node]:
    """``(probs, d)``: d the activation's output D that fc2 reads, row masks, casts and a
    prob column looked through (the masks appended to ``masks``, the nodes passed to
    ``nodes``), probs that column's prob or None."""
    d = strip_row_masks(fc2_input, masks, nodes)
    column = prob_column(d)
    if column is None:
        return None, d
    nodes.append(d)
    probs, d = column
    return probs, strip_row_masks(d, masks, nodes)


def fc1_candidates(fc2_input: Node, is_gemm) -> list[Node]:
    """The GEMMs that may be the fc1 of a grouped MLP whose fc2 reads ``fc2_input``: those
    behind it through elementwise/view ops (``gemms_behind``), and none when D itself
    (``_activation_output``) is a GEMM's output: then no op lies between the two GEMMs for an
    activation (the row masks, casts and prob column looked through are those that follow
    an fc2, ``match_output_prob``), so the pair is no grouped MLP. That is one grouped MLP's
    fc2 feeding the next one's fc1 (chained MLPs, or stacked layers without a residual): the
    second GEMM is the next MLP's fc1, found with its own fc2, not a near miss to report."""
    _, d = _activation_output(fc2_input, [], [])
    return [] if is_gemm(d) else gemms_behind(fc2_input, is_gemm)


def _holds_fc1_output(node: Node, is_gemm) -> bool:
    """``node`` is an fc1 output, or one half of one (casts and row masks looked through)."""
    node = strip_row_masks(node)
    half = _half(node, [])
    return is_gemm(strip_row_masks(half[0]) if half is not None else node)


def match_output_prob(fc2_out: Node) -> tuple[Node | None, Node, tuple[Node, ...], tuple[RowMask, ...]]:
    """``(probs, last, nodes, masks)`` of the chain after the fc2 output: casts, row masks
    (in place or not) and at most one multiply by a prob column, in any order. probs is the
    prob (or None), last the last node of the chain (the fc2 output when the chain has no
    prob and no mask), nodes the chain's nodes, masks its row masks."""
    nodes: list[Node] = []
    masks: list[RowMask] = []
    probs, node, last = None, fc2_out, fc2_out
    while True:
        for mask in inplace_row_masks(node):
            masks.append(mask)
            nodes.append(mask.node)
        users = [u for u in node.users if u not in nodes]
        if len(users) != 1:
            break
        user = users[0]
        masked = row_mask(user)
        if is_op(user, torch.Tensor.to):
            pass
        elif masked is not None and masked[1] is node and not is_op(user, torch.Tensor.masked_fill_):
            masks.append(masked[0])
        elif probs is None and prob_column(user) is not None and prob_column(user)[1] is node:
            probs = prob_column(user)[0]
        else:
            break
        nodes.append(user)
        node = user
        last = node
    if probs is None and not masks:
        return None, fc2_out, (), ()
    return probs, last, tuple(nodes), tuple(masks)


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
    (T, 1) column (not a row mask: a column cast from bool)."""
    if not is_op(node, torch.mul) or len(node.args) < 2 or row_mask(node) is not None:
        return None
    a, b = node.args[:2]
    if not (isinstance(a, Node) and isinstance(b, Node)):
        return None
    for column, other in ((b, a), (a, b)):
        if is_column_of(column, other):
            return _column_source(column), other
    return None


def _column_source(column: Node) -> Node:
    """The prob tensor behind an added unit dim (``p.unsqueeze(-1)``, ``p[:, None]``,
    ``p.view(-1, 1)``); the column itself when it was built otherwise."""
    node = strip_casts(column)
    if is_op(node, torch.unsqueeze, torch.reshape):
        return node.args[0]
    if is_op(node, operator.getitem) and isinstance(node.args[1], tuple) and node.args[1][-1] is None:
        return node.args[0]
    return column


# ----------------------------------------------------------------------------- patterns

# The canonical callable (nodes.op_of) of each one-operand pattern op.
_UNARY = {"relu": torch.relu, "silu": F.silu, "tanh": torch.tanh}
_NO_INPLACE = ("relu", "silu")
# Ops whose node, written twice on the same inputs, computes the same value twice.
_PURE = {torch.relu, F.silu, torch.tanh, torch.square, torch.pow, torch.mul, torch.div}

_Found = tuple[dict, tuple]  # (leaf name -> Node or python float, the region's nodes)


def _match_entry(entry: Activation, d: Node, is_gemm, reasons: list[str]):
    """``(name, scale, fc1_outputs, gate_second, region nodes)`` when ``d`` computes
    ``entry``, else None, with a reason appended to ``reasons`` when it nearly does."""
    scales: list[tuple[float, float]] = []
    found = _match(entry.pattern, d, ({}, ()), scales)
    if found is None:
        reasons.extend(f"{entry.name} scales differ: S is {a!r} and {b!r}; it must be one python float"
                       for a, b in scales)
        return None
    bound, region = found
    scale = bound.get("S")
    if entry.takes_scale and not scale > 0:
        reasons.append(f"{entry.name} clamp scale must be > 0, got {scale!r}")
        return None
    if not entry.gated:
        return entry.name, scale, (bound["H"],), False, region
    gate, up = bound["GATE"], bound["UP"]
    if is_gemm(strip_row_masks(gate)) and is_gemm(strip_row_masks(up)):
        return entry.name, scale, (gate, up), False, region
    halves: list[Node] = []
    gate_half, up_half = _half(gate, halves), _half(up, halves)
    if gate_half is None or up_half is None:
        return None
    (g_src, g_idx), (u_src, u_idx) = gate_half, up_half
    if g_src is not u_src or {g_idx, u_idx} != {0, 1}:
        reasons.append(f"{entry.name} gate and up are not the two halves of one fc1 output")
        return None
    return entry.name, scale, (g_src,), g_idx == 1, (*region, *halves)


def _match(pattern: Op | Var, value, found: _Found, scales: list) -> _Found | None:
    """``found`` extended by ``value`` (casts looked through) computing ``pattern``, or None.
    Pairs of different floats that S would be bound to are appended to ``scales``."""
    bound, region = found
    casts: list[Node] = []
    value = strip_casts(value, casts)
    region = (*region, *casts)
    if isinstance(pattern, Var):
        return _bind(pattern.name, value, (bound, region), scales)
    if not isinstance(value, Node):
        return None
    for operands, extra in _spellings(pattern.name, value):
        attempt = (bound, (*region, value, *extra))
        for sub, operand in zip(pattern.args, operands):
            attempt = _match(sub, operand, attempt, scales)
            if attempt is None:
                break
        else:
            return attempt
    return None


def _bind(name: str, value, found: _Found, scales: list) -> _Found | None:
    """Bind leaf ``name`` to ``value``: S to a python float, the others to a node; a leaf
    seen before must get the same value (the same float, the same node)."""
    bound, region = found
    if not isinstance(value, float if name == "S" else Node):
        return None
    if name not in bound:
        return {**bound, name: value}, region
    if bound[name] is value or name == "S" and bound[name] == value:
        return found
    if name == "S":
        scales.append((bound[name], value))
    return None


def _spellings(name: str, node: Node) -> list[tuple[tuple, tuple]]:
    """The ways ``node`` computes the pattern op ``name``: (its operands, other nodes of
    the region) for each."""
    op, args = op_of(node), node.args
    if name in _UNARY:
        inplace = name in _NO_INPLACE and arg(node, 1, "inplace", False)
        return [((arg(node, 0, "input"),), ())] if op is _UNARY[name] and not inplace else []
    if name == "square":
        if op is torch.square or (op is torch.pow and len(args) >= 2 and args[1] == 2):
            return [((args[0],), ())]
        if op is torch.mul and len(args) >= 2:
            a, b = args[:2]
            if a is b:
                return [((a,), ())]
            if _recomputes(a, b):
                return [((a,), (b,))]  # relu(h) * relu(h): both relus are in the region
        return []
    if name == "mul":
        return [((args[0], args[1]), ()), ((args[1], args[0]), ())] if op is torch.mul and len(args) >= 2 else []
    if name == "div":
        plain = op is torch.div and len(args) >= 2 and node.kwargs.get("rounding_mode") is None
        return [((args[0], args[1]), ())] if plain else []
    raise AssertionError(f"pattern op {name!r} has no spellings here; activations.PATTERN_OPS is {PATTERN_OPS}")


def _recomputes(a, b) -> bool:
    """``b`` is a second node of the same pure op on the same inputs as ``a``."""
    return (isinstance(a, Node) and isinstance(b, Node) and op_of(a) in _PURE and op_of(a) is op_of(b)
            and a.args == b.args and a.kwargs == b.kwargs)


# ----------------------------------------------------------------------------- gated halves

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
