"""Find grouped-MLP sites in a Dynamo graph and replace each by one canonical call.

``find_sites(gm)`` runs the matchers in order (the thin pipeline). ``rewrite_sites``
normalises each site's operands with a few inserted nodes and calls the backend's
``make_call`` (signature in site.py)::

    x      = x                           | x.flatten(0, 1)                   (bmm batch)
                 [.to(bf16)]                                                  (fp32 under autocast)
    W1     = W1 | stack(W1_e) [.to(bf16)] [.transpose(1, 2)] [cat((W1, Wup), 1)] [roll halves]
    W2     = W2 | stack(W2_e) [.to(bf16)] [.transpose(1, 2)]
    sizes  = diff(offs, prepend=[0]) | counts.to(int32) | tensor(split sizes) | full(G, T/G)
    probs  = p [.reshape(-1)]
             [.masked_fill(m, 0)] per row mask, m = (T,) rows to zero     (a ones prob if no p)
    y      = make_call(x, W1, W2, sizes, probs, activation=..., tanh_clamp_scale=...)
    y      = y [.view_as(x batch)] [.to(output dtype)]

Every inserted node gets ``meta["val"]`` (and ``example_value``) computed by running its
target on the example values under the graph's fake mode; the call's value is the
contract's (T, H) bf16. The site's output uses move to ``y`` and the matched nodes left
without users are erased.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Optional

import torch
import torch.fx
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensor

from .match_bmm import find_bmm
from .match_library_op import find_library_ops
from .match_expert_loop import find_expert_loop
from .match_grouped_mlp import find_grouped_mlp
from .match_grouped_mm import find_grouped_mm
from .nodes import Node, val
from .site import Rejection, Site, Weight

# In order: our own op first (it is already canonical), then the most used spellings.
MATCHERS = (
    ("grouped_mlp_module", find_grouped_mlp),
    ("grouped_mm", find_grouped_mm),
    ("expert_loop", find_expert_loop),
    ("bmm", find_bmm),
    ("library_op", find_library_ops),  # reasons only: library ops the others do not see into
)


# Higher-order ops that call a body graph as plain code each time they run, and that
# AOTAutograd traces through into the joint graph: activation checkpointing
# (torch.utils.checkpoint; AOTAutograd tags the body's nodes for recomputation in the
# backward) and nested compile regions (torch.compiler.nested_compile_region). A grouped
# MLP inside one is rewritten in its body, so it is recomputed (or shared) with the rest
# of the body. Their first argument is the body, a submodule of the graph module.
BODY_HOPS = ("tag_activation_checkpoint", "invoke_subgraph")


def _bodies(module: torch.fx.GraphModule):
    """(higher-order op name, body graph module, whether the backend rewrites it) for every
    graph-module argument of every higher-order op call in `module`."""
    for node in module.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.HigherOrderOperator):
            continue
        hop = node.target.__name__
        for i, arg in enumerate(node.args):
            if isinstance(arg, Node) and arg.op == "get_attr":
                try:
                    body = module.get_submodule(arg.target)  # (a dotted path too)
                except AttributeError:  # an attribute that is no module: no body
                    continue
                if isinstance(body, torch.fx.GraphModule):
                    yield hop, body, hop in BODY_HOPS and i == 0


def graph_modules(gm: torch.fx.GraphModule) -> list[tuple[torch.fx.GraphModule, tuple[str, ...]]]:
    """`gm`, then the body of every ``BODY_HOPS`` call in it (and in those bodies), each once
    (a nested compile region's calls share one body), with the ``BODY_HOPS`` it runs
    inside, outermost first (() for `gm`)."""
    found = [(gm, ())]
    for module, inside in found:
        for hop, body, rewritten in _bodies(module):
            if rewritten and all(body is not m for m, _ in found):
                found.append((body, (*inside, hop)))
    return found


# Why a grouped MLP inside another higher-order op's body is left as written.
_UNREACHED = {
    "autograd_function_apply": "it is inside a custom torch.autograd.Function, whose own backward would "
                               "replace the NVFP4 one",
}


def unreached_sites(modules: list[tuple[torch.fx.GraphModule, tuple[str, ...]]]) -> list[Rejection]:
    """Every grouped MLP (and near-miss) in the body of a higher-order op the backend does not
    rewrite in (a custom autograd.Function, torch.cond, a loop, ...), called from one of
    `modules` (``graph_modules``'s list), as a rejection saying where it is: it runs as
    written, and explain must not be silent about it."""
    out, seen = [], set()
    pending = [(body, hop) for module, _ in modules for hop, body, rewritten in _bodies(module) if not rewritten]
    while pending:
        body, hop = pending.pop(0)
        if id(body) in seen:
            continue
        seen.add(id(body))
        why = _UNREACHED.get(hop, f"it is inside the body of torch's higher-order op {hop}, where the "
                                  "backend rewrites nothing (only checkpointed and nested compile regions)")
        sites, rejections = find_sites(body)
        out += [Rejection(s.spelling, s.location, f"not rewritten: {why}") for s in sites]
        out += [dataclasses.replace(r, reason=f"{r.reason} (and {why})") for r in rejections]
        pending += [(inner, inner_hop) for inner_hop, inner, _ in _bodies(body)]
    return out


def find_sites(gm: torch.fx.GraphModule) -> tuple[list[Site], list[Rejection]]:
    sites, rejections = [], []
    for _, find in MATCHERS:
        found, rejected = find(gm)
        sites += found
        rejections += rejected
    return _without_overlaps(gm, sites, rejections)


def _without_overlaps(gm: torch.fx.GraphModule, sites: list[Site],
                      rejections: list[Rejection]) -> tuple[list[Site], list[Rejection]]:
    """One node cannot be rewritten into two sites. Three grouped GEMMs with an activation
    between each match twice, the middle GEMM being the first match's fc2 and the second's
    fc1; the site that comes first in the graph is kept and the other rejected (its GEMMs
    stay as the user wrote them)."""
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    kept: list[Site] = []
    for site in sorted(sites, key=lambda s: order[s.output]):
        clash = next((k for k in kept if k.output in site.nodes or site.output in k.nodes), None)
        if clash is None:
            kept.append(site)
        else:
            rejections.append(Rejection(site.spelling, site.location,
                                        f"shares its GEMM {clash.output.name} with the grouped MLP at "
                                        f"{clash.location}, which is rewritten instead"))
    return [s for s in sites if s in kept], rejections


def rewrite_sites(gm: torch.fx.GraphModule, sites: list[Site], *, make_call,
                  call_options: Optional[list[dict]] = None) -> list[Node]:
    """Replace every site by a call of ``make_call`` (one callable for all sites, or a list
    with one per site), with the site's ``call_options`` (constants) as more keyword
    arguments; recompiles ``gm`` and returns the call nodes, one per site. All sites in one
    call: a site may consume an earlier site's output (stacked layers), which the earlier
    rewrite replaces."""
    if not sites:
        return []
    # The example values' own mode: inside a backend, TracingContext (which
    # detect_fake_mode consults first) holds a different mode than Dynamo's example values.
    fake_mode = next(
        (v.fake_mode for v in map(val, gm.graph.nodes) if isinstance(v, FakeTensor)),
        None,
    ) or detect_fake_mode([val(n) for n in gm.graph.nodes if n.op == "placeholder"])
    calls = make_call if isinstance(make_call, (list, tuple)) else [make_call] * len(sites)
    replaced: dict[Node, Node] = {}  # a rewritten site's output -> the node that took its uses
    call_nodes = []
    for site, call, options in zip(sites, calls, call_options or [{}] * len(sites), strict=True):
        # a site fed by an earlier one (stacked layers) matched that site's output node
        site = _resolved(site, replaced)
        inserter = _Inserter(gm.graph, fake_mode, _anchor(gm.graph, site))
        call_node, replaced[site.output] = inserter.replace(site, call, options)
        call_nodes.append(call_node)
    gm.graph.lint()
    gm.recompile()
    return call_nodes


def _resolved(part, replaced: dict[Node, Node]):
    """`part` of a Site (the Site itself, its dataclasses, tuples, nodes) with every node an
    earlier rewrite replaced swapped for its replacement (the matched node is erased)."""
    if isinstance(part, Node):
        return replaced.get(part, part)
    if isinstance(part, tuple):
        return tuple(_resolved(p, replaced) for p in part)
    if dataclasses.is_dataclass(part) and not isinstance(part, type):
        return dataclasses.replace(part, **{f.name: _resolved(getattr(part, f.name), replaced)
                                            for f in dataclasses.fields(part) if f.init})
    return part


def _anchor(graph: torch.fx.Graph, site: Site) -> Node:
    """Where the call goes: before the site's output, or before the last node applying a
    row mask when that comes later (a mask built after fc2, applied in place to the
    output: transformers 5.6's ``weighted_out.masked_fill_``), so that every mask exists."""
    late = [m.node for m in site.row_masks]
    if not late:
        return site.output
    order = {node: i for i, node in enumerate(graph.nodes)}
    return max([site.output, *late], key=order.__getitem__)


class _Inserter:
    """Inserts nodes before ``anchor``, each with its fake value and the anchor's
    source metadata (stack trace, module stack) for provenance."""

    def __init__(self, graph: torch.fx.Graph, fake_mode, anchor: Node):
        self.graph, self.fake_mode, self.anchor = graph, fake_mode, anchor

    def call(self, target, *args, **kwargs) -> Node:
        return self._insert("call_function", target, args, kwargs, value=None)

    def method(self, name: str, *args, **kwargs) -> Node:
        return self._insert("call_method", name, args, kwargs, value=None)

    def _insert(self, op, target, args, kwargs, value):
        with self.graph.inserting_before(self.anchor):
            node = self.graph.create_node(op, target, args, kwargs)
        if value is None:
            fake_args, fake_kwargs = torch.fx.node.map_arg((args, kwargs), val)
            with self.fake_mode:
                fn = target if op == "call_function" else getattr(type(fake_args[0]), target)
                value = fn(*fake_args, **fake_kwargs)
        node.meta["val"] = node.meta["example_value"] = value
        for key in ("stack_trace", "nn_module_stack", "source_fn_stack"):
            if key in self.anchor.meta:
                node.meta[key] = self.anchor.meta[key]
        return node

    # ------------------------------------------------------------------ one site

    def bf16(self, node: Node) -> Node:
        """``node.to(bf16)`` for an fp32 operand (legal only under bf16 autocast, where the
        GEMM computes on that cast); AOTAutograd differentiates the cast."""
        return node if val(node).dtype == torch.bfloat16 else self.method("to", node, torch.bfloat16)

    def replace(self, site: Site, make_call, options: dict) -> tuple[Node, Node]:
        """(the call node, the node that takes the site output's uses)"""
        x = self.bf16(self.method("flatten", site.x, 0, 1) if site.x_batched else site.x)
        fc1, fc1_how = self.weight(site.fc1_weight)
        if site.fc1_up_weight is not None:
            up, up_how = self.weight(site.fc1_up_weight)
            fc1, fc1_how = self.call(torch.cat, [fc1, up], 1), f"cat([{fc1_how}, {up_how}], 1)"
        if site.gate_second:
            # rolling the 2F rows by F swaps the halves: the gate (silu) half comes first
            shift = val(fc1).shape[1] // 2
            fc1, fc1_how = self.call(torch.roll, fc1, shift, 1), f"roll({fc1_how}, {shift}, 1)"
        fc2, fc2_how = self.weight(site.fc2_weight)
        sizes = self.group_sizes(site, x)
        probs = site.probs
        if probs is not None and val(probs).dim() != 1:
            probs = self.call(torch.reshape, probs, (-1,))
        for mask in dict.fromkeys((m.mask, m.zero_where) for m in site.row_masks):  # each once
            probs = self.fold_row_mask(*mask, probs)
        x_val, fc2_val = val(x), val(fc2)
        with self.fake_mode:
            y_val = x_val.new_empty((x_val.shape[0], fc2_val.shape[1]), dtype=torch.bfloat16)
        args = (x, fc1, fc2, sizes, probs)
        if options.get("reuse_weight_casts"):  # what the weights' kept copies are keyed on (fused_grouped_mlp)
            sources, inputs_how = _weight_sources(site)
            args += sources
            options = {**options, "weight_derivation": f"fc1 = {fc1_how}; fc2 = {fc2_how}; {inputs_how}"}
        y = call = self._insert("call_function", make_call, args,
                                {"activation": site.activation, "tanh_clamp_scale": site.tanh_clamp_scale,
                                 **options}, value=y_val)
        if site.x_batched:
            y = self.method("view_as", y, site.x)
        if val(site.output).dtype != torch.bfloat16:
            y = self.method("to", y, val(site.output).dtype)
        site.output.replace_all_uses_with(y)
        _erase_dead(self.graph, site.nodes)
        return call, y

    def weight(self, weight: Weight) -> tuple[Node, str]:
        """The weight as a (G, out, in) bf16 stack, and how it is made from the graph's nodes
        (``fused_grouped_mlp``'s ``weight_derivation``)."""
        how = "W" if weight.stacked else f"stack({len(weight.nodes)} W_e, 0)"
        w = weight.nodes[0] if weight.stacked else self.call(torch.stack, list(weight.nodes), 0)
        if val(w).dtype != torch.bfloat16:
            w, how = self.bf16(w), f"{how}.to(bf16)"
        if weight.layout != "out_in":
            w, how = self.call(torch.transpose, w, 1, 2), f"{how}.transpose(1, 2)"
        return w, how

    def fold_row_mask(self, mask: Node, zero_where: bool, probs: Node | None) -> Node:
        """probs with the rows where ``mask`` is ``zero_where`` set to 0 (RowMask;
        masked_fill: its backward gives those rows dprob = 0, as the original graph does);
        a 0/1 prob when there was none. The model's function only for the masks a matcher
        puts in a Site: on D or on fc2's output, or on fc1's output of an activation that
        is 0 at 0 (match_activation rejects the others)."""
        rows = mask if val(mask).dim() == 1 else self.call(torch.reshape, mask, (-1,))
        if not zero_where:
            rows = self.call(torch.logical_not, rows)
        if probs is None:
            return self.method("to", self.call(torch.logical_not, rows), torch.float32)
        return self.call(torch.masked_fill, probs, rows, 0.0)

    def group_sizes(self, site: Site, x: Node) -> Node:
        sizes, device = site.group_sizes, val(x).device
        if sizes.kind == "offsets":
            offs = sizes.source
            if site.row_masks:
                # Rows past offs[-1] are the masked rows (transformers' expert-parallel
                # sentinels sort to the tail, which histc leaves out of offs): they join
                # the last group, where their zeroed prob gives Y = 0 and dprob = 0.
                end = self.call(torch.full, (1,), self.method("size", x, 0), dtype=val(offs).dtype, device=device)
                offs = self.call(torch.cat, [self.call(operator.getitem, offs, slice(None, -1)), end])
            zero = self.call(torch.zeros, (1,), dtype=val(offs).dtype, device=device)
            out = self.call(torch.diff, offs, dim=0, prepend=zero)
        elif sizes.kind == "sizes":
            out = sizes.source
        elif sizes.kind == "split":
            out = self.call(torch.tensor, list(sizes.source), dtype=torch.int32, device=device)
        else:  # "equal": x was flattened from a (G, T/G, H) batch
            rows = self.method("size", site.x, 1)
            out = self.call(torch.full, (sizes.count,), rows, dtype=torch.int32, device=device)
        if val(out).dtype != torch.int32:
            out = self.method("to", out, torch.int32)
        return out


# Ops whose result is a fixed function of one tensor argument (every other argument a
# constant): a weight made from a graph input by these alone is unchanged while the input is.
_PURE_METHODS = frozenset({"to", "bfloat16", "float", "type", "contiguous", "view", "reshape", "transpose", "t",
                           "permute", "detach"})
_PURE_FUNCTIONS = frozenset({torch.transpose, torch.reshape, torch.t, torch.permute})


def _graph_input(node: Node) -> tuple[Optional[Node], str]:
    """The graph input (a parameter) `node` is made from by pure single-tensor ops, and
    how ("W = input.bfloat16()"); (None, "") where it is made otherwise."""
    how = []
    while node.op in ("call_method", "call_function"):
        pure = node.target in (_PURE_METHODS if node.op == "call_method" else _PURE_FUNCTIONS)
        rest = (*node.args[1:], *node.kwargs.items())
        others = []
        torch.fx.node.map_arg(rest, others.append)  # any other node: not a function of one input
        if not (pure and node.args and isinstance(node.args[0], Node)) or others:
            return None, ""
        how.append(f"{getattr(node.target, '__name__', node.target)}{rest}")
        node = node.args[0]
    if node.op not in ("placeholder", "get_attr"):
        return None, ""
    return node, ".".join(["input", *reversed(how)])


def _weight_sources(site: Site) -> tuple[tuple[Optional[Node], Optional[Node], Optional[Node]], str]:
    """(fc1's, fc1's up half's, fc2's) graph input where the site's weight is one stacked
    tensor made from a graph input (a parameter) by pure ops (``_graph_input``), and how;
    None where it is not (per-expert weights, a weight the user's code computes from
    other tensors), and then the kept copies are keyed on the weight the call receives."""

    def source(weight: Optional[Weight]) -> tuple[Optional[Node], str]:
        return _graph_input(weight.nodes[0]) if weight is not None and weight.stacked else (None, "")

    (fc1, fc1_how), (up, up_how), (fc2, fc2_how) = map(source, (site.fc1_weight, site.fc1_up_weight,
                                                                 site.fc2_weight))
    if fc1 is None or (site.fc1_up_weight is not None and up is None):
        fc1 = up = None
    return (fc1, up, fc2), f"W of fc1 = {fc1_how}, of its up half = {up_how}, of fc2 = {fc2_how}"


def _erase_dead(graph: torch.fx.Graph, nodes) -> None:
    """Erase the matched nodes left without users, last first, until none is erasable."""
    pending = [n for n in nodes if n.op in ("call_function", "call_method")]
    changed = True
    while changed:
        changed = False
        for node in reversed(pending):
            if not node.users:
                graph.erase_node(node)
                pending.remove(node)
                changed = True
