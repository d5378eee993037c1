"""Run a checkpointed site's recompute before its backward starts, not in the middle of it.

Under activation checkpointing the min-cut partition recomputes a site's forward pieces in
the backward graph (the casts of x, W1 and W2, fc1 with its activation) and puts each
recomputed node just before its first user. For a grouped MLP the first user of fc1's
output is the dact GEMM, which comes after the bf16 copies of its own operands (deq() of dY
and of W2 where the plan's dact GEMM takes bf16 operands, as at benchmarks/grouped_mlp.py's
S4): those copies, 640 MiB at S4, were alive through the whole fc1 recompute, with x's and
W1's bf16 copies. A checkpointed step's peak was 1.46-1.54x BF16's on the H200, against
1.14-1.19x unchecked. On benchmarks/checkpoint_memory.py's CPU model, moving the recompute
lowers the checkpointed backward's peak by 342 MiB (S4 srelu) and 447 MiB (S4 swiglu), 11%;
13-15% at S3; little or nothing at S1 and S2. Measured on an H100, the checkpointed step's
peak fell to the unchecked step's at S1, S3 and S4 alike (1.15-1.25x BF16's; S1 too, where
the CPU model saw no gain; docs/performance.md, "H100").

``hoist_site_recompute`` moves the recomputed nodes that feed each site's backward to just
before that backward's first node, its stochastic-rounding seed draw
(``nvfp4::draw_sr_seeds``, one per site, ordered after the site's incoming gradient): the
recompute then runs beside dY and the saved tensors only. Per site, not to the graph's
start, which would make every checkpointed layer's recompute alive at once. A site without
stochastic rounding draws no seeds and keeps the partitioner's order.

Runs on the partitioned backward graph while it is still functional: Inductor's
``post_grad_custom_post_pass`` (before its reinplacing and scheduling; its peak-memory
reordering starts from this order) and the ``aot_eager`` compiler's graphs.
"""

from __future__ import annotations

import operator

import torch
from torch.fx import Graph, Node


def hoist_site_recompute(graph: Graph) -> int:
    """Move each site's recompute before its seed draw, in place; returns the nodes moved."""
    seeds = [node for node in graph.nodes if _draws_seeds(node)]
    return sum(_hoist(seed, end) for seed, end in zip(seeds, [*seeds[1:], None]))


def _draws_seeds(node: Node) -> bool:
    return node.op == "call_function" and node.target is torch.ops.nvfp4.draw_sr_seeds.default


def _hoist(seed: Node, end: Node | None) -> int:
    """Move the recomputed nodes between `seed` and `end` (the next site's seeds) that the
    site's stochastic-rounding casts read, directly or not, before `seed`. Those casts (of dY
    and of dC) read the whole site's recompute but nothing of the layer around it: a
    checkpointed block's attention is recomputed for its own backward, after the site's."""
    segment = []
    node = seed.next
    while node is not end and node.op != "output":
        segment.append(node)
        node = node.next
    placed_after = {seed, *segment}
    movable = set()  # recomputed nodes (and views of them) whose inputs all come before `seed` or move too
    for node in segment:
        inputs = node.all_input_nodes
        if node.op == "call_function" and all(i not in placed_after or i in movable for i in inputs) and (
                node.meta.get("recompute") is not None or (_is_view(node) and inputs)):
            movable.add(node)
    seeds, casts, stack = {seed}, set(), [seed]  # the seeds' readers, past the getitems and views between
    while stack:
        for user in stack.pop().users:
            if _is_view(user):
                seeds.add(user)
                stack.append(user)
            else:
                casts.add(user)
    read, stack = set(), list(casts)  # what the casts read, within the segment
    while stack:
        for i in stack.pop().all_input_nodes:
            if i in placed_after and i not in read:
                read.add(i)
                stack.append(i)
    wanted = read & movable
    # a draw of random bits moved across the seeds' would change the bits both draw
    if any(torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ()) for node in wanted):
        return 0
    moved = [node for node in segment if node in wanted]
    for node in moved:
        seed.prepend(node)
    # then every getitem of a moved multi-output node right after it, wherever it was: a graph
    # run keeps the node's outputs until its last getitem (a bf16 copy read once would stay
    # alive with the siblings a late GEMM reads)
    for node in moved:
        for user in [u for u in node.users if u.target is operator.getitem and u not in wanted]:
            node.append(user)
            moved.append(user)
    return len(moved)


def _is_view(node: Node) -> bool:
    target = node.target
    return target is operator.getitem or (isinstance(target, torch._ops.OpOverload) and (
        target.is_view or target in (torch.ops.aten.detach.default, torch.ops.aten.alias.default)))
