"""What a checkpointed grouped-MLP step holds at its backward's peak, in the backend's
recompute order and in the partitioner's. CPU only.

Traces one fully checkpointed training step of the fused op at a benchmarks/grouped_mlp.py
shape as the backend compiles it: AOTAutograd's joint graph on fake tensors (nothing runs),
with the Triton target's launches inlined as on a GPU (here the interpreter's kernel ops),
every forward node tagged for recomputation as torch.utils.checkpoint tags a region, and
Inductor's min-cut partition. Then runs the partitioned forward and backward on
uninitialised CPU tensors with every kernel launch stubbed (memory_model.py's way: the
allocations are the GPU run's, the values are not; each value freed after its last use, as
the compiled graphs do, but the step's inputs and dY, which the caller holds), the backward
twice: as partitioned, and after ``recompute_order.hoist_site_recompute``. Prints each
backward's peak of live bytes, from dY and what the forward saved (under a full checkpoint,
mostly the block's inputs) on.

    python benchmarks/checkpoint_memory.py [--shapes S4 S1] [--activations srelu swiglu]
"""

from __future__ import annotations

import argparse
import copy
import operator
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from host_overhead import stub_launches, triton_here  # noqa: E402  (sets TRITON_INTERPRET for CPU tensors)
from memory_model import LiveBytes  # noqa: E402

import torch  # noqa: E402
from torch._dynamo.backends.debugging import boxed_nop  # noqa: E402
from torch._functorch.aot_autograd import aot_function  # noqa: E402
from torch._functorch.partitioners import min_cut_rematerialization_partition  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402
from torch.utils.checkpoint import CheckpointPolicy  # noqa: E402

from grouped_mlp import SHAPES  # noqa: E402
from nvfp4_inductor import lowerings  # noqa: E402
from nvfp4_inductor.compiler import fused  # noqa: E402
from nvfp4_inductor.compiler.backend import _RecomputeEmptyPlaceholders  # noqa: E402
from nvfp4_inductor.compiler.recompute_order import hoist_site_recompute  # noqa: E402
from nvfp4_inductor.recipe import Recipe  # noqa: E402
from nvfp4_inductor.validate import assert_group_sizes_on_device  # noqa: E402

MiB = 2**20


def partitioned_step(shape: str, activation: str, target: str):
    """The partitioned (forward, backward) graphs of one fully checkpointed step."""
    g, t, h, f, _ = SHAPES[shape]
    f1 = 2 * f if activation == "swiglu" else f
    options = dict(activation=activation, tanh_clamp_scale=None, rht=True, sign_mask=Recipe().sign_mask,
                   block_2d=True, stochastic_rounding=True, sr_per_rank=True, recompute=True, target=target,
                   fused_fc1=True, fused_amax=lowerings.get_target(target).probe(torch.device("cpu")).fused_amax,
                   fused_dgrad=True)
    graphs = {}

    def partition(joint, joint_inputs, **kwargs):
        # the whole forward is one checkpointed region: what Dynamo's checkpoint tags carry,
        # on every node that reads no tangent (the graph is in order: inputs come first)
        backward = set()
        for node in joint.graph.nodes:
            if (node.op == "placeholder" and node.name.startswith("tangents")) or not backward.isdisjoint(
                    node.all_input_nodes):
                backward.add(node)
            elif node.op == "call_function":
                node.meta.update(recompute=CheckpointPolicy.PREFER_RECOMPUTE, ac_graph_id=1)
        _RecomputeEmptyPlaceholders()(joint.graph)
        graphs["fw"], graphs["bw"] = min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)
        return graphs["fw"], graphs["bw"]

    with FakeTensorMode():
        x = torch.empty(t, h, dtype=torch.bfloat16, requires_grad=True)
        w1 = torch.empty(g, f1, h, dtype=torch.bfloat16, requires_grad=True)
        w2 = torch.empty(g, h, f, dtype=torch.bfloat16, requires_grad=True)
        sizes, probs = torch.empty(g, dtype=torch.int64), torch.empty(t, requires_grad=True)
        step = aot_function(lambda *a: fused.fused_grouped_mlp(*a, **options), fw_compiler=boxed_nop,
                            partition_fn=partition)
        step(x, w1, w2, sizes, probs).sum().backward()
    return graphs["fw"], graphs["bw"]


def materialize(values) -> list:
    """Uninitialised CPU tensors for the forward's inputs (x, W1, W2, group sizes, probs);
    the group sizes even."""
    args = [torch.empty(v.shape, dtype=v.dtype) for v in values]
    args[3].fill_(args[0].shape[0] // args[3].numel())
    return args


def getitems_first(gm):
    """Each getitem right after its multi-output node: a graph run keeps a node's outputs
    until its last getitem, where Inductor frees each output buffer after its own last use."""
    gm = copy.deepcopy(gm)
    for node in list(gm.graph.nodes):
        for user in [u for u in node.users if u.target is operator.getitem]:
            node.append(user)
    gm.graph.lint()
    gm.recompile()
    return gm


def backward_peak(fw, bw) -> tuple[int, int]:
    """(bytes of dY and the saved tensors, the backward's peak). The caller holds the step's
    inputs and dY, as benchmarks/grouped_mlp.py does (a layer's input and the weights outlive
    its step); every other saved tensor is freed after its last use."""
    inputs = materialize([n.meta["val"] for n in fw.graph.find_nodes(op="placeholder")])
    outs = boxed_nop(copy.deepcopy(fw), [])(list(inputs))
    dy = torch.empty_like(outs[0])
    bw_args = [*outs[1:], dy]  # what the forward saved, and dY
    del outs
    backward = boxed_nop(getitems_first(bw), [])
    with LiveBytes() as mode:
        for t in bw_args:
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes():
                mode._track(t)
        kept = mode.now
        backward(bw_args)  # clears the list: a saved tensor then lives until its last use
    return kept, mode.peak


def peaks(shape: str, activation: str, target: str) -> tuple[int, int, int]:
    """(bytes of dY and the saved tensors, the backward's peak in the partitioner's order,
    its peak with each site's recompute moved before its backward), on `target` (one whose
    launches are inlined; with them stubbed and the group-size check device-side, see main)."""
    fw, bw = partitioned_step(shape, activation, target)
    _, before = backward_peak(fw, bw)
    moved = copy.deepcopy(bw)
    assert hoist_site_recompute(moved.graph) > 0, "nothing to move: no checkpointed site with stochastic rounding"
    moved.recompile()
    kept, after = backward_peak(fw, moved)
    return kept, before, after


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["S4", "S1"], choices=sorted(SHAPES))
    parser.add_argument("--activations", nargs="+", default=["srelu", "swiglu"], choices=["srelu", "swiglu"])
    args = parser.parse_args()
    stub_launches()
    target = triton_here(inline=True)
    fused.check_group_sizes_values = assert_group_sizes_on_device  # a host tensor's values cannot be read in a trace
    print("| shape act | dY + saved MiB | backward peak MiB, partitioner's order | recompute moved | lower by |")
    print("|---|---|---|---|---|")
    for shape in args.shapes:
        for activation in args.activations:
            kept, before, after = peaks(shape, activation, target)
            print(f"| {shape} {activation} | {kept / MiB:.0f} | {before / MiB:.0f} | {after / MiB:.0f} | "
                  f"{(before - after) / MiB:.0f} |")


if __name__ == "__main__":
    main()
