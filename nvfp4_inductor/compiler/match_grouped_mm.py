"""Grouped MLPs written with ``torch._grouped_mm`` / ``F.grouped_mm`` and ``offs``.

Matched subgraph (Dynamo graph; ``F.grouped_mm`` arrives as ``torch._grouped_mm``; a
library's own grouped GEMM op of the same signature, ``nodes.LIBRARY_GROUPED_GEMMS``, such
as transformers' ``grouped_mm_fallback``, counts as one)::

    [x.masked_fill_(m, 0)]                                    # row masks on x stay in the graph
    h = _grouped_mm(x, W1.transpose(-2, -1), offs=offs)      # W1 (G, F1, H), or W1 (G, H, F1) untransposed
      | gate = _grouped_mm(x, Wg.mT, offs)  up = _grouped_mm(x, Wu.mT, offs)   # torchtitan w1 / w3
    [h = h.masked_fill(m, 0)]                                 # row masks: folded into the prob (f(0) = 0)
    d = f(h) [* p[:, None]]                                   # see match_activation.py
    y = _grouped_mm(d, W2.transpose(-2, -1), offs=offs)       # the SAME offs node
    [y = y.masked_fill(m, 0)]
    [y = (y.float() * p[:, None]).to(bf16)]                   # prob on the output instead
    [y.masked_fill_(m, 0)]

These are the transformers 5.x grouped_mm experts of every release (5.0-5.24: no masks,
the expert-parallel sentinel masks of 5.6-5.17 in place or not, masks only under expert
parallelism from 5.18) and torchtitan's GroupedExperts.

Spelling "token_permutation" when x is gathered by a permutation (``x[perm // top_k]``,
``gather``, ``index_select``) — the form Hugging Face's grouped_mm experts and torchtitan
emit, with ``offs = cumsum(histc | bincount(expert_ids), dtype=int32)``; the routing,
gather, un-permute and top-k sum stay in the graph. Otherwise "grouped_mm".

Candidates: every grouped GEMM with a grouped GEMM behind it through elementwise/view ops
is a candidate fc2 (a rejection says why it is not a site), except one that reads the
other's output directly (``match_activation.fc1_candidates``): two chained MLPs' fc2 ->
fc1, no room for an activation. A grouped GEMM in no candidate is reported on its own.

Replacement: ``make_call(x, W1, W2, diff(offs, prepend=[0]), p)`` (rewrite.py), p with
the masked rows zeroed. Accepts bf16 x and weights on any device (``_grouped_mm`` itself
only compiles in bf16), and fp32 ones under ``torch.autocast(dtype=torch.bfloat16)``
(legality.py).
"""

from __future__ import annotations

import operator

import torch

from .match_activation import fc1_candidates, match_activation, match_output_prob
from .legality import can_grouped_mlp
from .nodes import Node, arg, is_grouped_gemm, is_op, shape, strip_row_masks, transposed_last_two
from .regions import escaping_use, kn_weight, fc1_bias_reason, fc2_bias_reason, prob_on_input_reason
from .site import GroupSizes, Rejection, Site, location_of


def is_grouped_mm(node) -> bool:
    return is_grouped_gemm(node)


def find_grouped_mm(gm: torch.fx.GraphModule) -> tuple[list[Site], list[Rejection]]:
    sites, rejections, claimed = [], [], set()
    for fc2 in list(gm.graph.nodes):
        if not is_grouped_mm(fc2):
            continue
        fc1s = fc1_candidates(fc2.args[0], is_grouped_mm)
        if not fc1s:
            continue
        claimed.update(fc1s + [fc2])
        found = grouped_mm_site(fc2)
        if isinstance(found, Site):
            sites.append(found)
        else:
            rejections.append(Rejection(_spelling_of(fc1s[0].args[0]), location_of(fc2), found))
    for node in gm.graph.nodes:
        if is_grouped_mm(node) and node not in claimed:
            rejections.append(Rejection(
                _spelling_of(node.args[0]), location_of(node),
                f"grouped GEMM `{node.name}` has no activation and second grouped GEMM after it"))
    return sites, rejections


def grouped_mm_site(fc2: Node) -> Site | str:
    """The Site whose fc2 GEMM is ``fc2``, or the reason there is none."""
    _, w2, offs, reason = _gemm_operands(fc2, "fc2")
    if reason:
        return reason
    activation = match_activation(fc2.args[0], is_grouped_mm)
    if isinstance(activation, str):
        return fc1_bias_reason(fc2.args[0], is_grouped_mm) or activation
    fc1s = activation.fc1_outputs
    parsed = [_gemm_operands(h, "fc1") for h in fc1s]
    for x, _, fc1_offs, reason in parsed:
        if reason:
            return reason
        if fc1_offs is not offs:
            return f"fc1 and fc2 grouped GEMMs use different offsets (`{fc1_offs.name}` vs `{offs.name}`)"
    x = parsed[0][0]
    if any(strip_row_masks(p[0]) is not strip_row_masks(x) for p in parsed):
        return "the gate and up grouped GEMMs read different inputs"
    reason = prob_on_input_reason(x) or fc2_bias_reason(fc2)
    if reason:
        return reason
    out_probs, output, out_nodes, out_masks = match_output_prob(fc2)
    if activation.probs is not None and out_probs is not None:
        return "router prob multiplied twice (on the activation and on the fc2 output)"
    weights = [kn_weight(p[1]) for p in parsed]
    fc2_weight = kn_weight(w2)
    nodes = (*fc1s, *activation.nodes, fc2, *out_nodes, *_transpose_nodes(w2, *[p[1] for p in parsed]))
    reason = escaping_use(set(fc1s) | set(activation.nodes), allowed={fc2})
    if reason:
        return reason
    site = Site(
        x=x, fc1_weight=weights[0], fc2_weight=fc2_weight,
        fc1_up_weight=weights[1] if len(weights) == 2 else None,
        gate_second=activation.gate_second,
        group_sizes=GroupSizes("offsets", offs, (shape(offs) or (0,))[0]),
        probs=activation.probs if activation.probs is not None else out_probs,
        activation=activation.activation, tanh_clamp_scale=activation.tanh_clamp_scale,
        spelling=_spelling_of(x), location=location_of(fc1s[0]), output=output,
        nodes=tuple(dict.fromkeys(nodes)), row_masks=tuple(dict.fromkeys((*activation.masks, *out_masks))),
    )
    return can_grouped_mlp(site) or site


def _gemm_operands(node: Node, name: str):
    """``(a, b, offs, reason)`` of a 2-D x 3-D ``_grouped_mm`` node."""
    a, b = node.args[0], arg(node, 1, "mat_b")
    offs = arg(node, 2, "offs")
    if arg(node, 3, "bias") is not None:
        return a, b, offs, f"{name} grouped GEMM `{node.name}` has a bias"
    out_dtype = arg(node, 4, "out_dtype")
    if out_dtype not in (None, torch.bfloat16):
        return a, b, offs, f"{name} grouped GEMM `{node.name}` has out_dtype={out_dtype}"
    if offs is None:
        return a, b, offs, f"{name} grouped GEMM `{node.name}` has no offs (3-D x 3-D batched form)"
    if len(shape(a) or ()) != 2 or len(shape(b) or ()) != 3:
        return a, b, offs, (f"{name} grouped GEMM `{node.name}` multiplies shapes {shape(a)} x "
                            f"{shape(b)}; expected (T, K) x (G, K, N)")
    return a, b, offs, None



def _transpose_nodes(*bs: Node) -> tuple[Node, ...]:
    return tuple(b for b in bs if transposed_last_two(b) is not None)


def _spelling_of(x) -> str:
    """"token_permutation" when the GEMM input was gathered by a permutation."""
    x = strip_row_masks(x)
    gathered = (is_op(x, operator.getitem) and isinstance(x.args[1], Node)) or \
        is_op(x, torch.gather, torch.index_select, torch.Tensor.gather, torch.Tensor.index_select)
    return "token_permutation" if gathered else "grouped_mm"
