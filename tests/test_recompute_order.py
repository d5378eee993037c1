"""Each checkpointed site's recompute runs before its backward (compiler/recompute_order.py).

Checked on hand-made backward graphs (the rule: per site, only what the site's backward
reads, never a random draw across the seeds') and on the graphs the backend compiles for a
checkpointed ``GroupedMLP`` whose fused ops are traced as their Triton launches, as on a GPU
(here the launches are the interpreter's ops): the recomputed fc1 GEMM before the site's
seed draw and the backward's first bf16 operand copies, in the aot_eager graph and in
Inductor's generated code, with every output and gradient the bits of the eager chain.
"""

import operator
import re

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint

import nvfp4_inductor as nv
from _assertions import assert_bytes_equal
from nvfp4_inductor.compiler import fused
from nvfp4_inductor.compiler.recompute_order import hoist_site_recompute

aten = torch.ops.aten
SEEDS = torch.ops.nvfp4.draw_sr_seeds.default


class _Backward:
    """A hand-made backward graph: ``op(name, *inputs, recomputed=False, target=aten.mul.Tensor)``."""

    def __init__(self):
        self.graph = torch.fx.Graph()
        self.nodes = {}

    def input(self, name):
        self.nodes[name] = self.graph.placeholder(name)
        return self

    def op(self, name, *inputs, recomputed=False, target=aten.mul.Tensor):
        args = tuple(self.nodes[i] for i in inputs)
        if target is SEEDS:
            args = (args[0], 2, True)
        node = self.graph.call_function(target, args)
        node.name = name
        if recomputed:
            node.meta["recompute"] = CheckpointPolicy.PREFER_RECOMPUTE
        self.nodes[name] = node
        return self

    def order(self):
        return [n.name for n in self.graph.nodes if n.op == "call_function"]


def _two_sites(**seeded):
    """Layer 2's site backward, then layer 1's, each reading a recomputed fc1 output (and
    layer 1's through its recomputed input); one recomputed node that neither site reads."""
    b = _Backward().input("dy").input("x").input("w")
    b.op("seeds2", "dy", target=SEEDS).op("dy_cast2", "dy", "seeds2")
    b.op("w_cast2", "w", recomputed=True).op("deq2", "dy_cast2", "w_cast2")
    b.op("fc1_2", "x", "w", recomputed=True).op("dact2", "deq2", "fc1_2").op("dc_cast2", "dact2", "seeds2")
    b.op("other", "x", recomputed=True).op("other_grad", "dc_cast2", "other")
    b.op("seeds1", "other_grad", target=SEEDS).op("dy_cast1", "other_grad", "seeds1")
    b.op("attn", "x", recomputed=True, **seeded).op("fc1_1", "attn", "w", recomputed=True)
    b.op("dact1", "dy_cast1", "fc1_1").op("dc_cast1", "dact1", "seeds1")
    b.graph.output((b.nodes["dc_cast1"],))
    return b


def test_each_site_recompute_moves_before_its_own_seeds_only():
    b = _two_sites()
    assert hoist_site_recompute(b.graph) == 4
    b.graph.lint()
    assert b.order() == ["w_cast2", "fc1_2", "seeds2", "dy_cast2", "deq2", "dact2", "dc_cast2", "other", "other_grad",
                         "attn", "fc1_1", "seeds1", "dy_cast1", "dact1", "dc_cast1"]
    assert hoist_site_recompute(b.graph) == 0  # already in place


def test_views_and_every_output_of_a_moved_node_move_with_it():
    """Views of a recomputed node move with it; so does each getitem of a multi-output node
    (a cast's copies), even one that only a late GEMM reads: a graph run keeps all of the
    node's outputs until its last getitem."""
    b = _Backward().input("dy").input("x")
    b.op("seeds", "dy", target=SEEDS).op("cast", "x", recomputed=True)
    b.op("data", "cast", target=operator.getitem).op("viewed", "data", target=aten.t.default)
    b.op("gemm", "viewed", "seeds").op("late_data", "cast", target=operator.getitem)
    b.op("wgrad", "gemm", "late_data")
    b.graph.output((b.nodes["wgrad"],))
    assert hoist_site_recompute(b.graph) == 4
    b.graph.lint()
    assert b.order() == ["cast", "late_data", "data", "viewed", "seeds", "gemm", "wgrad"]


def test_a_random_draw_never_moves_across_the_seeds():
    b = _two_sites(target=aten.bernoulli.default)  # layer 1's recomputed input draws random bits
    before = b.order()
    assert hoist_site_recompute(b.graph) == 2  # layer 2's site only
    assert b.order()[b.order().index("seeds2") + 1:] == [n for n in before if n not in ("w_cast2", "fc1_2")][1:]
    assert b.order().index("attn") > b.order().index("seeds1")


def test_a_backward_without_seeds_is_left_alone():
    b = _Backward().input("dy").input("x")
    b.op("grad", "dy").op("fc1", "x", recomputed=True).op("dact", "grad", "fc1")
    b.graph.output((b.nodes["dact"],))
    assert hoist_site_recompute(b.graph) == 0 and b.order() == ["grad", "fc1", "dact"]


@pytest.fixture
def triton_launches_inlined(use_steps, monkeypatch):
    """The Triton target's steps traced as their launches into the compiled graphs, as on a
    GPU. The group-size check is the GPU's device-side assert: a host tensor's values cannot
    be read while the inlined op body is traced."""
    from nvfp4_inductor.lowerings.triton import STEPS
    from nvfp4_inductor.validate import assert_group_sizes_on_device

    monkeypatch.setattr(fused, "check_group_sizes_values", assert_group_sizes_on_device)
    return use_steps(STEPS, like="triton", inline=True).name


def _step(compiler, checkpointed):
    torch.manual_seed(0)
    mlp = nv.GroupedMLP(4, 64, 64, activation="srelu")
    x = torch.randn(64, 64, dtype=torch.bfloat16, requires_grad=True)
    sizes, probs = torch.tensor([16, 0, 32, 16]), torch.rand(64)
    fn = (lambda *a: checkpoint(mlp, *a, use_reentrant=False)) if checkpointed else mlp
    if compiler is not None:
        torch._dynamo.reset()
        fn = torch.compile(fn, backend=nv.backend(compiler=compiler))
    torch.manual_seed(1)  # the backward's stochastic-rounding seeds
    y = fn(x, sizes, probs)
    y.float().square().mean().backward()
    return [y, x.grad, mlp.fc1_weight.grad, mlp.fc2_weight.grad]


def _backward_ops(graphs):
    """The ops of the backward graph among `graphs` (the one drawing seeds), in order."""
    names = [[str(n.target) for n in graph.nodes if n.op == "call_function"] for graph in graphs]
    return next(ops for ops in names if str(SEEDS) in ops)


def _kernel_order(names):
    """The first fc1 GEMM, seed draw and bf16 operand copy in a backward's kernel `names`."""
    return [next(i for i, n in enumerate(names) if key in n)
            for key in ("grouped_gemm_act", "draw_sr_seeds", "dequantize_bf16_pair")]


@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
def test_checkpointed_backward_recomputes_fc1_before_the_site_backward(compiler, triton_launches_inlined,
                                                                      monkeypatch):
    from torch._inductor.utils import run_and_get_code

    graphs = []
    if compiler == "aot_eager":  # the graphs the aot_eager compiler runs, after the move
        from torch._dynamo.backends import debugging

        nop = debugging.boxed_nop
        monkeypatch.setattr(debugging, "boxed_nop", lambda gm, inputs: graphs.append(gm) or nop(gm, inputs))
        checkpointed = _step(compiler, True)
        names = _backward_ops(gm.graph for gm in graphs)
    else:  # the launches in Inductor's generated backward, in its order
        checkpointed, codes = run_and_get_code(_step, compiler, True)
        names = re.findall(r"= torch\.ops\.(nvfp4\w*\.\w+)\.default\(", codes[-1])
    fc1, seeds, first_copy = _kernel_order(names)
    assert fc1 < seeds < first_copy, names
    eager = _step(None, False)
    for i, (e, c) in enumerate(zip(eager, checkpointed, strict=True)):
        assert_bytes_equal(c, e, f"checkpointed {compiler} against the eager chain, tensor {i}")


def test_the_partition_alone_recomputes_fc1_after_the_first_bf16_copies(triton_launches_inlined, monkeypatch):
    """The control: without the move, the min-cut partition's own order (what the thirty-first
    session traced) has the fc1 recompute after the dact GEMM's operand copies."""
    from nvfp4_inductor.compiler import backend

    graphs = []
    monkeypatch.setattr(backend, "hoist_site_recompute", lambda graph: graphs.append(graph) and 0)
    _step("aot_eager", True)
    fc1, seeds, first_copy = _kernel_order(_backward_ops(graphs))
    assert seeds < first_copy < fc1


def test_the_cpu_memory_model_sees_the_move_lower_the_backward_peak(triton_launches_inlined, replace_launches):
    """benchmarks/checkpoint_memory.py at the tiny shape (the figures for the real shapes are
    in compiler/recompute_order.py's docstring): the kernels stubbed, the checkpointed backward's peak is lower
    with the recompute moved than in the partitioner's order."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    import checkpoint_memory

    replace_launches(lambda launch: lambda kernel, grid, **kwargs: None)
    kept, before, after = checkpoint_memory.peaks("tiny", "srelu", triton_launches_inlined)
    assert kept < after < before
