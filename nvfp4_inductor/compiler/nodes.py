"""Reading Dynamo FX nodes: one name per op however the user spelled it, example values.

Dynamo graphs are torch-level IR: ``x.relu()`` is a ``call_method`` node, ``torch.relu(x)``
and ``F.relu(x)`` are ``call_function`` nodes with different targets. ``op_of`` maps all
of them to one canonical callable so matchers compare against small sets.
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import statically_known_true

Node = torch.fx.Node

# Canonical callables, each with every spelling Dynamo emits for it.
_ALIASES = {
    torch.relu: (F.relu, torch.relu, torch.Tensor.relu),
    F.silu: (F.silu,),
    torch.tanh: (torch.tanh, torch.Tensor.tanh),
    torch.square: (torch.square, torch.Tensor.square),
    torch.pow: (torch.pow, operator.pow, torch.Tensor.pow, torch.Tensor.__pow__),
    torch.mul: (torch.mul, operator.mul, torch.Tensor.mul, torch.Tensor.__mul__, torch.Tensor.__rmul__),
    torch.div: (torch.div, operator.truediv, torch.Tensor.div, torch.Tensor.__truediv__),
    torch.chunk: (torch.chunk, torch.Tensor.chunk),
    torch.split: (torch.split, torch.functional.split, torch.Tensor.split),
    torch.cat: (torch.cat, torch.concat, torch.concatenate),
    torch.transpose: (torch.transpose, torch.Tensor.transpose, torch.swapaxes, torch.Tensor.swapaxes),
    torch.t: (torch.t, torch.Tensor.t),
    torch.permute: (torch.permute, torch.Tensor.permute),
    torch.matmul: (torch.matmul, operator.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.mm, torch.Tensor.mm),
    torch.bmm: (torch.bmm, torch.Tensor.bmm),
    F.linear: (F.linear, torch._C._nn.linear),
    torch._grouped_mm: (torch._grouped_mm,),
    torch.unsqueeze: (torch.unsqueeze, torch.Tensor.unsqueeze),
    torch.reshape: (torch.reshape, torch.Tensor.reshape, torch.Tensor.view),
    torch.Tensor.to: (torch.Tensor.to, torch.Tensor.float, torch.Tensor.bfloat16, torch.Tensor.type_as, torch.Tensor.contiguous),
    torch.Tensor.item: (torch.Tensor.item,),
    operator.getitem: (operator.getitem,),
    torch.masked_fill: (torch.masked_fill, torch.Tensor.masked_fill),
    torch.Tensor.masked_fill_: (torch.Tensor.masked_fill_,),
    torch.where: (torch.where, torch.Tensor.where),
}
_CANONICAL = {alias: canon for canon, aliases in _ALIASES.items() for alias in aliases}

# Ops an activation region between two GEMMs may be built of (walked when looking for
# the fc1 GEMM behind an fc2 GEMM). Tensor-indexing getitems are excluded at the call.
ELEMENTWISE_OR_VIEW = {
    torch.relu, F.silu, torch.tanh, torch.square, torch.pow, torch.mul, torch.div,
    torch.chunk, torch.split, torch.Tensor.to, operator.getitem, torch.unsqueeze,
    F.gelu, torch.sigmoid, torch.Tensor.sigmoid, torch.add, operator.add, torch.Tensor.add,
    torch.sub, operator.sub, torch.clamp, torch.Tensor.clamp, torch.clip, torch.neg,
    operator.neg, torch.exp, torch.erf, F.relu6, F.leaky_relu, F.elu, torch.Tensor.clamp_min,
    torch.Tensor.clamp_max, torch.minimum, torch.maximum, torch.Tensor.__radd__,
    torch.Tensor.__add__, torch.Tensor.__sub__, torch.Tensor.__rsub__, torch.squeeze, torch.Tensor.squeeze,
    torch.masked_fill, torch.where,
}

# Library ops (torch.library, by qualified name) that compute ``_grouped_mm(input, weight,
# offs)``: (T, K) x (G, K, N) with cumulative offsets, the same arguments in the same order.
#   transformers::grouped_mm_fallback  transformers >= 5.4 (integrations/moe.py), taken for
#       non-bf16 weights under torch.compile: fp32 models, fp32 master weights under autocast
LIBRARY_GROUPED_GEMMS = ("transformers::grouped_mm_fallback",)


def op_of(node) -> object:
    """The canonical callable a call_function / call_method node computes, or None."""
    if not isinstance(node, Node):
        return None
    if node.op == "call_function":
        return _CANONICAL.get(node.target, node.target)
    if node.op == "call_method":
        method = getattr(torch.Tensor, node.target, None)
        return _CANONICAL.get(method, method)
    return None


def op_name(node) -> str:
    """A short readable name of what a node computes, for rejection reasons."""
    op = op_of(node)
    if op is None:
        return node.op if isinstance(node, Node) else repr(node)
    return getattr(op, "__name__", str(op))


def is_op(node, *ops) -> bool:
    return op_of(node) in ops


def library_op(node) -> str | None:
    """``"namespace::name"`` of a call to a torch.library op outside aten / prims, else None."""
    if not isinstance(node, Node) or node.op != "call_function":
        return None
    target = node.target
    name = getattr(target, "_qualified_op_name", None)  # OpOverloadPacket
    if name is None and isinstance(target, torch._ops.OpOverload):
        name = target._schema.name
    if not isinstance(name, str) or name.split("::")[0] in ("aten", "prims", "prim"):
        return None
    return name


def is_grouped_gemm(node) -> bool:
    """``torch._grouped_mm`` / ``F.grouped_mm`` or a library op in LIBRARY_GROUPED_GEMMS."""
    return is_op(node, torch._grouped_mm) or library_op(node) in LIBRARY_GROUPED_GEMMS


def val(node):
    """The example value (FakeTensor, SymInt, ...) Dynamo or a pass recorded for ``node``."""
    if not isinstance(node, Node):
        return node
    meta = node.meta
    return meta["val"] if "val" in meta else meta.get("example_value")


def shape(node) -> tuple | None:
    v = val(node)
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def arg(node: Node, index: int, name: str, default=None):
    """Argument ``index`` / keyword ``name`` of a call node (call_method: index 0 is self)."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def only_user(node: Node) -> Node | None:
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def known_equal(a, b) -> bool:
    """``a == b`` for ints or SymInts, answered without a guard: False unless provable
    (sizes may be unbacked, data-dependent symbols)."""
    return a is b or statically_known_true(a == b)


def same_dims(a, b) -> bool:
    return len(a) == len(b) and all(known_equal(x, y) for x, y in zip(a, b))


def is_column_of(column, other) -> bool:
    """``column`` is (..., 1) and ``other`` (..., N>1) with the same leading dims: a
    per-row value (a router prob, a row mask) broadcast along other's last dim."""
    c, o = shape(column), shape(other)
    return (c is not None and o is not None and len(c) == len(o) >= 2
            and known_equal(c[-1], 1) and not known_equal(o[-1], 1) and same_dims(c[:-1], o[:-1]))


def strip_casts(node, seen: list | None = None):
    """Follow ``.to(dtype)`` / ``.float()`` / ``.bfloat16()`` / ``.type_as`` / ``.contiguous()``
    back to their input; casted nodes are appended to ``seen``."""
    while is_op(node, torch.Tensor.to) and isinstance(node.args[0], Node):
        if seen is not None:
            seen.append(node)
        node = node.args[0]
    return node


def int_index(node: Node) -> int | None:
    """``i`` when ``node`` is ``parent[i]`` with a python int i, else None."""
    if is_op(node, operator.getitem) and isinstance(node.args[1], int):
        return node.args[1]
    return None


def transposed_last_two(node) -> Node | None:
    """The input of a node that swaps the last two dims of a 2-D or 3-D tensor
    (``.transpose(-2, -1)``, ``.transpose(1, 2)``, ``.mT``-like ``permute``, ``.t()``)."""
    op = op_of(node)
    if op is None:
        return None
    src = node.args[0]
    rank = len(shape(src) or ())
    if op is torch.transpose:
        dims = {d % rank for d in (arg(node, 1, "dim0"), arg(node, 2, "dim1"))} if rank else set()
        return src if dims == {rank - 2, rank - 1} else None
    if op is torch.t:
        return src if rank == 2 else None
    if op is torch.permute:
        dims = node.args[1:] if len(node.args) > 2 else tuple(node.args[1])
        want = tuple(range(rank - 2)) + (rank - 1, rank - 2)
        return src if tuple(d % rank for d in dims) == want else None
    return None


# ----------------------------------------------------------------------------- row masks


@dataclasses.dataclass(frozen=True)
class RowMask:
    """Rows of a (T, N) tensor set to 0 by a bool row mask:

        t.masked_fill(m, 0) | t.masked_fill_(m, 0) | where(m, 0, t)    zero_where=True
        where(m, t, 0) | t * m.to(t.dtype)                              zero_where=False

    mask: the bool node, shaped (T, 1) (a column of t) or for ``t * m`` the bool node
        behind the cast; the rows zeroed are those where it is ``zero_where``.
    node: the node that applies it (an in-place ``masked_fill_`` has no users).
    """

    mask: Node
    zero_where: bool
    node: Node


def _is_zero(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0


def _bool_column(mask, t) -> bool:
    v = val(mask)
    return isinstance(v, torch.Tensor) and v.dtype == torch.bool and is_column_of(mask, t)


def row_mask(node) -> tuple[RowMask, Node] | None:
    """``(RowMask, t)`` when ``node`` zeroes rows of ``t`` by a row mask, else None."""
    op = op_of(node)
    if op in (torch.masked_fill, torch.Tensor.masked_fill_):
        t, mask, value = arg(node, 0, "input"), arg(node, 1, "mask"), arg(node, 2, "value")
        if isinstance(t, Node) and _is_zero(value) and _bool_column(mask, t):
            return RowMask(mask, True, node), t
        return None
    if op is torch.where:
        if node.op == "call_method":  # t.where(cond, other) is where(cond, t, other)
            cond, a, b = arg(node, 1, "condition"), node.args[0], arg(node, 2, "other")
        else:
            cond, a, b = arg(node, 0, "condition"), arg(node, 1, "input"), arg(node, 2, "other")
        for zero, t, zero_where in ((a, b, True), (b, a, False)):
            if _is_zero(zero) and isinstance(t, Node) and _bool_column(cond, t):
                return RowMask(cond, zero_where, node), t
        return None
    if op is torch.mul and len(node.args) >= 2 and all(isinstance(a, Node) for a in node.args[:2]):
        for column, t in ((node.args[1], node.args[0]), (node.args[0], node.args[1])):
            source = strip_casts(column)
            if source is not column and _bool_column(source, t):
                return RowMask(source, False, node), t
    return None


def not_a_row_mask(node) -> str:
    """Why a ``masked_fill`` / ``where`` node is not a row mask (for reasons), else ""."""
    if row_mask(node) is not None or not is_op(node, torch.masked_fill, torch.Tensor.masked_fill_, torch.where):
        return ""
    if is_op(node, torch.where):
        return "; not where(m, 0, t) / where(m, t, 0) with a bool (T, 1) row mask m"
    value = arg(node, 2, "value")
    if not _is_zero(value):
        return f"; it fills {value!r}, a row mask fills 0"
    return "; its mask is not a bool (T, 1) column of the rows"


def inplace_row_masks(node: Node) -> list[RowMask]:
    """The in-place row masks applied to ``node`` (``node.masked_fill_(m, 0)``)."""
    found = []
    for user in node.users:
        if is_op(user, torch.Tensor.masked_fill_) and user.args[0] is node:
            mask = row_mask(user)
            if mask is not None:
                found.append(mask[0])
    return found


def strip_row_masks(node, masks: list | None = None, seen: list | None = None):
    """Follow out-of-place row masks and casts back to the masked tensor; the masks are
    appended to ``masks``, the nodes passed (masks and casts) to ``seen``."""
    while True:
        found = row_mask(node)
        if found is not None and not is_op(node, torch.Tensor.masked_fill_):
            if masks is not None:
                masks.append(found[0])
            if seen is not None:
                seen.append(node)
            node = found[1]
            continue
        stripped = strip_casts(node, seen)
        if stripped is node:
            return node
        node = stripped


# ----------------------------------------------------------------------------- autocast


def autocast_dtype(node: Node, device_type: str) -> torch.dtype | None:
    """The dtype ``torch.autocast`` computes GEMMs in where ``node`` runs, or None where it
    is off: the state the graph is compiled under (the backend runs inside the user's call,
    so an enclosing ``with torch.autocast(...)`` is in force, and Dynamo guards on it),
    changed by the graph's own ``_enter_autocast`` / ``_exit_autocast`` nodes before ``node``."""
    enter, leave = torch.amp.autocast_mode._enter_autocast, torch.amp.autocast_mode._exit_autocast
    ambient = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None
    stack = [ambient]
    for n in node.graph.nodes:
        if n is node:
            break
        if n.op != "call_function":
            continue
        if n.target is enter:
            device, dtype, enabled = (list(n.args) + [None, None, True])[:3]
            if device != device_type:
                stack.append(stack[-1])
            else:
                stack.append((dtype or torch.get_autocast_dtype(device_type)) if enabled else None)
        elif n.target is leave and len(stack) > 1:
            stack.pop()
    return stack[-1]
