"""Reading Dynamo FX nodes: one name per op however the user spelled it, example values.

Dynamo graphs are torch-level IR: ``x.relu()`` is a ``call_method`` node, ``torch.relu(x)``
and ``F.relu(x)`` are ``call_function`` nodes with different targets. ``op_of`` maps all
of them to one canonical callable so matchers compare against small sets.
"""

from __future__ import annotations

import operator

import torch
import torch.fx
import torch.nn.functional as F

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
}


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
