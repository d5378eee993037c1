"""Activation checkpointing and nested compile regions around a grouped MLP.

Dynamo puts a checkpointed region (torch.utils.checkpoint; full, selective and reentrant
checkpointing alike) and a nested compile region (torch.compiler.nested_compile_region) in
the graph as a higher-order op whose body is a graph of its own; the backend rewrites the
sites in those bodies (compiler/rewrite.py, ``BODY_HOPS``). Checked here: the site inside
is rewritten, compiled == the eager NVFP4 chain bit for bit, checkpointing changes no bit
of any output or gradient (the forward rounds to nearest, and the backward draws its
stochastic-rounding seeds as without it), and what the step keeps from forward to backward
is the region's inputs, not the block's NVFP4 copies (the forward is recomputed in the
backward). transformers' own gradient
checkpointing is in test_model_libraries.py.
"""

import contextlib
import functools

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import moe_models as mm
import nvfp4_inductor as nv
from _assertions import assert_bytes_equal, dtypes_kept_for_backward

PACKED = (torch.uint8, torch.float8_e4m3fn)  # what the block's NVFP4 copies are made of


def _recompute_all_but_mm(ctx, op, *args, **kwargs):
    """A selective-checkpointing policy (torchtitan's kind): keep matmul outputs, recompute the rest."""
    return CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE


CHECKPOINTS = {
    "full": dict(use_reentrant=False),
    "selective": dict(use_reentrant=False,
                      context_fn=functools.partial(create_selective_checkpoint_contexts, _recompute_all_but_mm)),
    "reentrant": dict(use_reentrant=True),  # Dynamo traces it as the non-reentrant form
}


class Block(torch.nn.Module):
    """A residual torchtitan MoE (a router, grouped experts, a shared expert), its MoE
    checkpointed as ``CHECKPOINTS[how]`` says, or not (how=None)."""

    def __init__(self, how=None):
        super().__init__()
        self.moe, self.how = mm.TitanMoE(), how

    def forward(self, x):
        return x + (checkpoint(self.moe, x, **CHECKPOINTS[self.how]) if self.how else self.moe(x))


def _step(how, compiler: str, seed: int = 0, device: str = "cpu"):
    """One compiled step: (output, gradients of x and every parameter, dtypes of the
    tensors the step kept for backward (``dtypes_kept_for_backward``), sites rewritten)."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    block = Block(how).to(device)
    x = block.moe.inputs(seed)[0].to(device).requires_grad_()
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(block, backend=nv.backend(compiler=compiler))
    torch.manual_seed(1)  # the backward's stochastic-rounding seeds
    with dtypes_kept_for_backward() as kept:
        y = compiled(x)
    y.float().square().mean().backward()
    grads = [x.grad] + [p.grad for p in block.parameters()]
    return y, grads, kept, counters["nvfp4"]["sites_rewritten"]


def _assert_same_bits(expected: list, actual: list, label: str) -> None:
    for i, (e, a) in enumerate(zip(expected, actual, strict=True)):
        assert_bytes_equal(a, e, f"{label}, tensor {i}")


def _check_checkpointing(how, compiler: str, device: str = "cpu") -> None:
    """The step with its MoE checkpointed as `how` against the uncheckpointed step: one site
    each, every output and gradient bit for bit, and none of the block's packed copies kept
    for the backward (without checkpointing they are)."""
    y, grads, kept, sites = _step(None, compiler, device=device)
    y_ac, grads_ac, kept_ac, sites_ac = _step(how, compiler, device=device)
    assert sites == sites_ac == 1
    _assert_same_bits([y, *grads], [y_ac, *grads_ac], f"{how} checkpointing, {compiler}")
    assert set(kept) & set(PACKED), kept
    assert not set(kept_ac) & set(PACKED), kept_ac
    assert len(kept_ac) < len(kept)


@pytest.mark.parametrize("how, compiler", [("full", "aot_eager"), ("full", "inductor"), ("selective", "aot_eager"),
                                          ("reentrant", "aot_eager")])
def test_checkpointing_recomputes_the_block_and_changes_no_bit(how, compiler):
    _check_checkpointing(how, compiler)


def test_checkpointed_site_compiled_equal_eager_chain():
    torch.manual_seed(0)
    block = Block("full")
    report = nv.compare(block, backend=nv.backend(compiler="aot_eager"))(block.moe.inputs(0)[0].requires_grad_())
    assert report.sites == 1 and report.bitwise, str(report)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_checkpointing_on_a_gpu_recomputes_the_traced_launches():
    """On CUDA with Inductor the fused ops are traced as their kernel launches
    (target_ops.py); under checkpointing AOTAutograd tags those for recomputation too.
    Run in compare's deterministic mode: on CUDA the block's scatter_add and its gather's
    backward add with atomics, in an order that changes from run to run (the same compiled
    step twice differed in about 6% of the output's elements on the H200)."""
    from nvfp4_inductor.inspection import _deterministic_algorithms

    with _deterministic_algorithms(True):
        _check_checkpointing("full", "inductor", device="cuda")


def test_explain_names_the_checkpointed_region():
    torch.manual_seed(0)
    block = Block("full")
    report = nv.explain(block)(block.moe.inputs(0)[0].requires_grad_())
    assert len(report.sites) == 1 and report.sites[0].checkpointed
    text = str(report)
    assert "recomputed (checkpointed)" in text and "activation checkpointing: the site is in a checkpointed" in text


def test_eager_grouped_mlp_under_checkpoint_changes_no_bit():
    torch.manual_seed(0)
    mlp = nv.GroupedMLP(4, 32, 32, activation="swiglu")
    x, sizes, probs = mm._x(0, 48, 32), torch.tensor([10, 0, 22, 16]), torch.rand(48)
    runs = []
    for checkpointed in (False, True):
        mlp.zero_grad()
        xi = x.clone().requires_grad_()
        torch.manual_seed(1)
        y = checkpoint(mlp, xi, sizes, probs, use_reentrant=False) if checkpointed else mlp(xi, sizes, probs)
        y.float().square().mean().backward()
        runs.append([y, xi.grad, mlp.fc1_weight.grad, mlp.fc2_weight.grad])
    _assert_same_bits(*runs, "eager, checkpointed")


class RegionLayers(torch.nn.Module):
    """Two MoE layers, each through one nested compile region (compiled once, called twice)."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([mm.TitanMoE(), mm.TitanMoE()])

    def forward(self, x):
        for layer in self.layers:
            x = x + _region(layer, x)
        return x


@torch.compiler.nested_compile_region
def _region(layer, x):
    return layer(x)


def test_nested_compile_region_rewritten_once_for_every_call():
    torch.manual_seed(0)
    model = RegionLayers()
    x = model.layers[0].inputs(0)[0].requires_grad_()
    report = nv.compare(model, backend=nv.backend(compiler="aot_eager"))(x)
    assert report.sites == 1 and report.bitwise, str(report)
    explained = nv.explain(model)(x)
    assert explained.sites[0].regions == ("invoke_subgraph",)
    assert "nested compile region" in str(explained)


def test_checkpointed_recompute_reuses_the_weight_casts():
    """With ``reuse_weight_casts``, the backward's recompute of a checkpointed block takes the
    copies its forward cast (inside a block even one step casts each stack once), with the
    same bits as casting again."""
    torch.manual_seed(0)
    block = Block("full")
    x = block.moe.inputs(0)[0].requires_grad_()
    runs = []
    for reuse in (False, True):
        block.zero_grad()
        xi = x.detach().clone().requires_grad_()
        torch._dynamo.reset()
        compiled = torch.compile(block, backend=nv.backend(compiler="aot_eager", reuse_weight_casts=reuse))
        with nv.reuse_weight_casts() if reuse else contextlib.nullcontext() as kept:
            torch.manual_seed(1)
            compiled(xi).float().square().mean().backward()
        runs.append([xi.grad] + [p.grad for p in block.parameters()])
    assert (kept.casts, kept.reuses) == (2, 2)
    _assert_same_bits(*runs, "casts reused in the recompute")


def test_torchtitan_checkpoint_wrapper():
    """torchtitan's activation checkpointing: each block wrapped by
    ``torch.distributed.algorithms._checkpoint.checkpoint_wrapper`` (non-reentrant
    torch.utils.checkpoint underneath), then compiled."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    torch.manual_seed(0)
    inner = mm.TitanMoE030(torch.bfloat16)
    x = inner.inputs(0)[0].requires_grad_()
    block = checkpoint_wrapper(inner, preserve_rng_state=False)
    assert [s.checkpointed for s in nv.explain(block)(x).sites] == [True]
    report = nv.compare(block, backend=nv.backend(compiler="aot_eager"))(x)
    assert report.sites == 1 and report.bitwise, str(report)


class FunctionMLP(torch.autograd.Function):
    """A grouped MLP inside a custom autograd.Function (its own backward: a stand-in)."""

    @staticmethod
    def forward(ctx, x, w1, w2, offs):
        h = torch.nn.functional.relu(torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs)) ** 2
        return torch._grouped_mm(h, w2.transpose(-2, -1), offs=offs)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None, None


class InFunction(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = torch.nn.Parameter(torch.randn(4, 32, 32, dtype=torch.bfloat16))
        self.w2 = torch.nn.Parameter(torch.randn(4, 32, 32, dtype=torch.bfloat16))

    def forward(self, x, offs):
        return FunctionMLP.apply(x, self.w1, self.w2, offs)


class InCond(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.moe = mm.TitanMoE030(torch.bfloat16)

    def forward(self, x):
        return torch.cond(x.sum() > 0, lambda x: self.moe(x), lambda x: x.clone(), (x,))


def test_sites_in_other_higher_order_ops_are_reported_not_silent():
    """A grouped MLP in the body of a higher-order op the backend does not rewrite in (a
    custom autograd.Function: its backward is the user's; torch.cond) runs as written, and
    explain lists it with where it is."""
    torch.manual_seed(0)
    offs = torch.tensor([16, 32, 48, 64], dtype=torch.int32)
    x = torch.randn(64, 32, dtype=torch.bfloat16, requires_grad=True)
    report = nv.explain(InFunction())(x, offs)
    assert report.sites == [] and len(report.rejected) == 1, str(report)
    location, _, reason = report.rejected[0]
    assert "custom torch.autograd.Function" in reason and "test_checkpointing.py" in location
    model = InCond()
    report = nv.explain(model)(model.moe.inputs(0)[0])
    assert report.sites == [] and len(report.rejected) == 1, str(report)
    assert "higher-order op cond" in report.rejected[0][2]
