"""Grouped MLPs written as a Python loop over experts (unrolled by Dynamo).

Matched subgraph (Dynamo graph)::

    xs = torch.split(x, sizes)  |  x.split(sizes)       # sizes: list of ints, SymInts, or
                                                        # counts.tolist() items (capture_scalar_outputs)
    [ps = torch.split(p, sizes)]
    for e in range(G):                                  # every split, in order
        h_e = fc1(xs[e])                                # F.linear(xs[e], W1_e) | nn.Linear(bias=False)
                                                        # | xs[e] @ W1_e.T | xs[e] @ W1_e
              [gate_e = fc1g(xs[e]); up_e = fc1u(xs[e])]   # Mixtral / torchtitan w1, w3
        d_e = f(h_e) [* ps[e][:, None]]                 # see match_activation.py
        y_e = fc2(d_e) [* ps[e][:, None]]
    y = torch.cat([y_0, ..., y_{G-1}], dim=0)

W_e is ``W[e]`` of one stacked (G, ...) tensor or a per-expert tensor (a ModuleList of
nn.Linear); the rewrite uses W directly or stacks the W_e. Replacement:
``make_call(x, W1, W2, sizes, p)`` whose output replaces the cat. Accepts bf16.
Loops that Dynamo splits into several graphs (data-dependent ``nonzero`` routing) have
no split+cat in one graph and are not matched.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .match_activation import gemms_behind, match_activation, prob_column
from .legality import can_grouped_mlp
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from .nodes import Node, arg, int_index, is_op, shape, strip_casts, transposed_last_two, val
from .regions import ADD, escaping_use, fc1_bias_reason, prob_on_input_reason
from .site import GroupSizes, Rejection, Site, Weight, location_of


def is_linear(node) -> bool:
    """A per-expert GEMM: F.linear / nn.Linear or a 2-D matmul."""
    return is_op(node, F.linear) or (is_op(node, torch.matmul) and len(shape(node.args[0]) or ()) == 2)


def find_expert_loop(gm: torch.fx.GraphModule) -> tuple[list[Site], list[Rejection]]:
    sites, rejections = [], []
    for cat in list(gm.graph.nodes):
        if not is_op(cat, torch.cat) or not isinstance(cat.args[0], (list, tuple)):
            continue
        parts = list(cat.args[0])
        # a loop concatenates several experts' fc2 outputs; one GEMM output among the parts
        # is any concatenation of projections (MLA's query input, a gated head's inputs)
        experts = sum(isinstance(p, Node) and _fc2_of(p) is not None for p in parts)
        if experts < min(2, len(parts)):
            continue
        found = expert_loop_site(cat)
        if isinstance(found, Site):
            sites.append(found)
        else:
            rejections.append(Rejection("expert_loop", location_of(cat), found))
    return sites, rejections


def _fc2_of(part: Node) -> Node | None:
    """The per-expert fc2 GEMM producing ``part`` (through an output prob multiply)."""
    node = strip_casts(part)
    column = prob_column(node)
    if column is not None:
        node = strip_casts(column[1])
    if is_op(node, *ADD):  # a biased fc2: found here so that it is rejected with its reason
        node = next((a for a in node.args if is_linear(a)), node)
    if is_linear(node) and gemms_behind(node.args[0], is_linear):
        return node
    return None


def expert_loop_site(cat: Node) -> Site | str:
    dim = arg(cat, 1, "dim", 0)
    if dim != 0:
        return f"experts concatenated along dim {dim}, expected dim 0"
    parts = list(cat.args[0])
    chains = []
    for index, part in enumerate(parts):
        chain = _expert_chain(part, index)
        if isinstance(chain, str):
            return f"expert {index}: {chain}"
        chains.append(chain)
    split = chains[0]["split"]
    for key in ("split", "activation", "scale", "gate_second", "fc1_layout", "up_layout", "fc2_layout",
                "has_up"):
        values = [c[key] for c in chains]
        if any(v != values[0] for v in values):
            return f"experts differ in {key}: {values}"
    sizes = arg(split, 1, "split_size_or_sections", arg(split, 1, "split_size"))
    if not isinstance(sizes, (list, tuple)):
        return f"x is split by a chunk size ({sizes!r}), not by per-expert sizes"
    if len(sizes) != len(parts):
        return f"the loop concatenates {len(parts)} experts but x is split into {len(sizes)}"
    if arg(split, 2, "dim", 0) != 0:
        return "x is split along a dim other than 0"
    group_sizes = _group_sizes(sizes)
    if isinstance(group_sizes, str):
        return group_sizes
    probs = _probs([c["prob"] for c in chains], sizes)
    if isinstance(probs, str):
        return probs
    x = split.args[0]
    reason = prob_on_input_reason(x)
    if reason:
        return reason
    weights = {}
    for key in ("fc1", "up", "fc2"):
        if chains[0]["has_up"] or key != "up":
            weights[key] = _weight([c[key] for c in chains], chains[0][f"{key}_layout"], key)
            if isinstance(weights[key], str):
                return weights[key]
    nodes = [cat, split]
    for c in chains:
        nodes += c["nodes"]
    reason = escaping_use(set(nodes) - {cat, split}, allowed={cat})
    if reason:
        return reason
    site = Site(
        x=x, fc1_weight=weights["fc1"][0], fc2_weight=weights["fc2"][0],
        fc1_up_weight=weights["up"][0] if "up" in weights else None,
        gate_second=chains[0]["gate_second"], group_sizes=group_sizes, probs=probs,
        activation=chains[0]["activation"], tanh_clamp_scale=chains[0]["scale"],
        spelling="expert_loop", location=location_of(chains[0]["fc1_node"]), output=cat,
        nodes=tuple(dict.fromkeys(nodes + [n for w in weights.values() for n in w[1]])),
    )
    return can_grouped_mlp(site) or site


def _expert_chain(part, index: int) -> dict | str:
    """One expert's fc1 -> activation -> fc2 chain, described as a dict."""
    if not isinstance(part, Node):
        return f"concatenated value {part!r} is not a tensor node"
    casts: list = []
    node = strip_casts(part, casts)
    out_prob = None
    column = prob_column(node)
    if column is not None:
        casts.append(node)
        out_prob, node = column[0], strip_casts(column[1], casts)
    if is_op(node, *ADD) and any(is_linear(a) for a in node.args):
        return f"fc2 output has a bias added (`{node.name}`)"
    if not is_linear(node):
        return f"`{node.name}` is not an fc2 linear/matmul"
    fc2 = node
    fc2_w, fc2_layout, reason = _linear_operands(fc2, "fc2")
    if reason:
        return reason
    activation = match_activation(fc2.args[0], is_linear)
    if isinstance(activation, str):
        return fc1_bias_reason(fc2.args[0], is_linear) or activation
    if activation.masks:
        return (f"row mask `{activation.masks[0].node.name}` inside an expert loop; row masks are folded "
                "into the prob for grouped GEMM spellings only")
    if activation.probs is not None and out_prob is not None:
        return "router prob multiplied twice (on the activation and on the fc2 output)"
    fc1s = activation.fc1_outputs
    operands = [_linear_operands(h, "fc1") for h in fc1s]
    for _, _, reason in operands:
        if reason:
            return reason
    xs = {h.args[0] for h in fc1s}
    if len(xs) != 1:
        return "the gate and up GEMMs read different inputs"
    x_e = next(iter(xs))
    if int_index(x_e) != index or not is_op(x_e.args[0], torch.split):
        return f"fc1 input `{x_e.name}` is not split output {index} of x"
    return {
        "split": x_e.args[0], "activation": activation.activation,
        "scale": activation.tanh_clamp_scale, "gate_second": activation.gate_second,
        "prob": activation.probs if activation.probs is not None else out_prob,
        "fc1": operands[0][0], "up": operands[1][0] if len(operands) == 2 else None,
        "fc2": fc2_w, "fc1_layout": operands[0][1],
        "up_layout": operands[-1][1], "fc2_layout": fc2_layout, "has_up": len(operands) == 2,
        "fc1_node": fc1s[0],
        "nodes": [x_e, *fc1s, *activation.nodes, fc2, *casts, *(o[0] for o in operands),
                  *_transposes(fc2, *fc1s)],
    }


def _linear_operands(node: Node, name: str):
    """``(W, layout, reason)`` of a per-expert F.linear / matmul."""
    if is_op(node, F.linear):
        if arg(node, 2, "bias") is not None:
            return None, None, f"{name} `{node.name}` has a bias"
        return node.args[1], "out_in", None
    b = node.args[1]
    source = transposed_last_two(b)
    return (source, "out_in", None) if source is not None else (b, "in_out", None)


def _transposes(*gemms: Node) -> list:
    return [g.args[1] for g in gemms if is_op(g, torch.matmul) and transposed_last_two(g.args[1]) is not None]


def _weight(per_expert: list, layout: str, name: str):
    """``(Weight, consumed nodes)``: one stacked W when every expert reads ``W[e]``."""
    parents = {w.args[0] if int_index(w) is not None else None for w in per_expert}
    indices = [int_index(w) for w in per_expert]
    parent = parents.pop() if len(parents) == 1 else None
    if parent is not None and indices == list(range(len(per_expert))):
        stacked = (shape(parent) or (None,))[0]
        if stacked != len(per_expert):
            return f"{name} weight stacks {stacked} experts but the loop runs over {len(per_expert)}"
        return Weight((parent,), layout), tuple(per_expert)
    return Weight(tuple(per_expert), layout), ()


def _group_sizes(sizes) -> GroupSizes | str:
    """Split sizes as GroupSizes: counts[e].item() items of one counts tensor -> that tensor
    ("sizes"); ints and backed SymInts -> "split"."""
    counts = [_item_of(s) for s in sizes]
    if all(c is not None for c in counts):
        tensors = {c[0] for c in counts}
        if len(tensors) == 1 and [c[1] for c in counts] == list(range(len(sizes))) and \
                shape(counts[0][0]) == (len(sizes),):
            return GroupSizes("sizes", counts[0][0], len(sizes))
        return "split sizes are items of a counts tensor, but not counts[0..G-1] in order"
    for s in sizes:
        if isinstance(s, Node) and _is_unbacked(s):
            return f"split size `{s.name}` is data-dependent and not an item of one counts tensor"
    return GroupSizes("split", tuple(sizes), len(sizes))


def _item_of(size):
    """``(counts, e)`` when ``size`` is ``counts[e].item()``."""
    if is_op(size, torch.Tensor.item):
        index = int_index(size.args[0])
        if index is not None:
            return size.args[0].args[0], index
    return None


def _is_unbacked(node: Node) -> bool:
    return bool(free_unbacked_symbols(val(node)))


def _probs(columns: list, sizes) -> Node | None | str:
    """The (T,) prob tensor split alongside x, from the experts' prob columns."""
    if all(c is None for c in columns):
        return None
    if any(c is None for c in columns):
        return "some experts multiply a router prob and others do not"
    sources = []
    for e, column in enumerate(columns):
        if int_index(column) != e or not is_op(column.args[0], torch.split):
            return f"expert {e}'s prob `{column.name}` is not split output {e} of one prob tensor"
        sources.append(column.args[0])
    split = sources[0]
    if any(s is not split for s in sources):
        return "the experts' probs come from different splits"
    if list(arg(split, 1, "split_size_or_sections", [])) != list(sizes):
        return "the probs are split with other sizes than x"
    return split.args[0]

