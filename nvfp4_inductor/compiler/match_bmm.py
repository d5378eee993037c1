"""Grouped MLPs over equal-size groups written with ``torch.bmm`` on an expert batch.

Matched subgraph (Dynamo graph)::

    h = bmm(x, W1)                     # x (G, T/G, H); W1 (G, H, F1), or W1p.transpose(1, 2)
                                       # with W1p (G, F1, H) in nn.Linear layout
    d = f(h) [* p[..., None]]          # see match_activation.py; p (G, T/G)
    y = bmm(d, W2)                     # W2 (G, F, H) or W2p.transpose(1, 2)
    [y = y * p[..., None]]

Replacement: ``make_call(x.flatten(0, 1), W1, W2, full((G,), T/G), p.reshape(-1))``
viewed back as (G, T/G, H). Accepts bf16 tensors. The per-token form
``bmm(W[expert_ids], x.unsqueeze(-1))`` (Hugging Face "batched_mm" experts) is rejected
with its reason: each token is its own group there.
"""

from __future__ import annotations

import torch

from .match_activation import fc1_candidates, gemms_behind, match_activation, match_output_prob
from .legality import can_grouped_mlp
from .nodes import Node, is_op, shape, transposed_last_two
from .regions import escaping_use, kn_weight, fc1_bias_reason, fc2_bias_reason, prob_on_input_reason
from .site import GroupSizes, Rejection, Site, location_of


def is_bmm(node) -> bool:
    return is_op(node, torch.bmm)


def find_bmm(gm: torch.fx.GraphModule) -> tuple[list[Site], list[Rejection]]:
    sites, rejections = [], []
    for fc2 in list(gm.graph.nodes):
        if not is_bmm(fc2):
            continue
        if gemms_behind(fc2.args[1], is_bmm):
            rejections.append(Rejection("bmm", location_of(fc2), (
                f"bmm `{fc2.name}` takes the activation as its second operand (per-token "
                "W[expert_ids] @ x form); only x @ W over a (G, T/G, H) expert batch is recognised")))
            continue
        if not fc1_candidates(fc2.args[0], is_bmm):
            continue
        found = bmm_site(fc2)
        if isinstance(found, Site):
            sites.append(found)
        else:
            rejections.append(Rejection("bmm", location_of(fc2), found))
    return sites, rejections


def bmm_site(fc2: Node) -> Site | str:
    activation = match_activation(fc2.args[0], is_bmm)
    if isinstance(activation, str):
        return fc1_bias_reason(fc2.args[0], is_bmm) or activation
    fc1s = activation.fc1_outputs
    x = fc1s[0].args[0]
    if any(h.args[0] is not x for h in fc1s):
        return "the gate and up bmm read different inputs"
    reason = prob_on_input_reason(x) or fc2_bias_reason(fc2)
    if reason:
        return reason
    for node in (*fc1s, fc2):
        if len(shape(node.args[0]) or ()) != 3:
            return f"bmm `{node.name}` input is {shape(node.args[0])}, expected (G, T/G, K)"
    out_probs, output, out_nodes, out_masks = match_output_prob(fc2)
    if activation.probs is not None and out_probs is not None:
        return "router prob multiplied twice (on the activation and on the fc2 output)"
    reason = escaping_use(set(fc1s) | set(activation.nodes), allowed={fc2})
    if reason:
        return reason
    weights = [kn_weight(h.args[1]) for h in fc1s]
    transposes = tuple(w for w in (*(h.args[1] for h in fc1s), fc2.args[1]) if transposed_last_two(w) is not None)
    site = Site(
        x=x, fc1_weight=weights[0], fc2_weight=kn_weight(fc2.args[1]),
        fc1_up_weight=weights[1] if len(weights) == 2 else None,
        gate_second=activation.gate_second,
        group_sizes=GroupSizes("equal", None, shape(x)[0]),
        probs=activation.probs if activation.probs is not None else out_probs,
        activation=activation.activation, tanh_clamp_scale=activation.tanh_clamp_scale,
        spelling="bmm", location=location_of(fc1s[0]), output=output,
        nodes=tuple(dict.fromkeys((*fc1s, *activation.nodes, fc2, *out_nodes, *transposes))),
        x_batched=True, row_masks=tuple(dict.fromkeys((*activation.masks, *out_masks))),
    )
    return can_grouped_mlp(site) or site
