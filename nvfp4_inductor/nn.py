"""The grouped MLP in eager NVFP4: ``grouped_mlp`` and the ``GroupedMLP`` module.

Forward and backward are docs/numerics.md section 5 run op by op (one ``nvfp4::`` op per step),
on the plan ``lowerings.choose_plan`` gives for the call, the same function and the same
plan as the backend's for a compiled site; this is the semantics the compiled path
reproduces bit for bit.

    forward                                       backward (dY)
    xq  = group_quantize(x)   row + col RHT       dYq = group_quantize(dY)  row + col RHT, SR
    W1q, W2q = quantize_weights (16x16 tiles)     G   = gemm(dYq.row, W2q.col)
    C   = gemm(xq.row, W1q.row)        (saved)    dC, dp = activation_backward(G, C, p)
    D   = activation(C, p)                        dW2 = wgrad(dYq.col, Dq.col)
    Dq  = group_quantize(D)   row + col RHT       dCq = group_quantize(dC)  row + col RHT, SR
    Y   = gemm(Dq.row, W2q.row)                   dX  = gemm(dCq.row, W1q.col)
                                                  dW1 = wgrad(dCq.col, xq.col)
Where the plan fuses fc1, ``fc1_act_amax`` replaces the fc1 GEMM and the activation (and,
with ``fused_amax``, gives D's amaxes to its casts); where it fuses the dgrad,
``fc2_dgrad_act`` replaces G's GEMM and the activation backward. On the reference and
Triton targets fused and unfused steps give the same bits; on cuDNN they do not
(numerics.md 7), and eager means the fused ones there, as compiled does.
The eager path saves D's column-wise copy; the compiled path instead regenerates D in the
backward from C and the saved amaxes where the plan allows it (``compiler/fused.py``).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from . import ops  # noqa: F401  (registers torch.ops.nvfp4)
from .activations import get_activation
from .distributed import local_operands
from .lowerings import SiteSpec, choose_plan
from .numerics import copy_amaxes
from .recipe import Recipe
from .saved import SavedForBackward
from .validate import check_grouped_mlp_args

nvfp4 = torch.ops.nvfp4


def _group_quantize(x, group_sizes, recipe: Recipe, target: str, *, stochastic: bool, amax=(None, None)):
    """(row data, row scale, row amax, col data, col scale, col amax, padded offsets);
    `amax`: the (row-wise, column-wise) amaxes to use instead of computing them."""
    return nvfp4.group_quantize(x, group_sizes, True, True, recipe.rht, recipe.sign_mask,
                                stochastic and recipe.stochastic_rounding, *amax, target, recipe.sr_per_rank)


class _GroupedMLPChain(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, fc1_weight, fc2_weight, group_sizes, probs, activation, tanh_clamp_scale, recipe):
        # The plan the backend chooses for a compiled site: its target, and its fused kernels
        # where it fuses a step (compiled == eager on every target, numerics.md 5.3).
        plan = choose_plan(SiteSpec.on(x.device, activation, dtype=x.dtype, hidden=x.shape[1],
                                       ffn=fc2_weight.shape[2]), recipe)
        target = plan.target
        xq = _group_quantize(x, group_sizes, recipe, target, stochastic=False)
        w1q = nvfp4.quantize_weights(fc1_weight, recipe.block_2d, target)
        w2q = nvfp4.quantize_weights(fc2_weight, recipe.block_2d, target)
        fc1 = (xq[0], xq[1], xq[2], w1q[0], w1q[1], w1q[4], group_sizes)
        if plan.fused_fc1:
            c, d, pre_rht, post_rht = nvfp4.fc1_act_amax(*fc1, probs, activation, tanh_clamp_scale, recipe.sign_mask,
                                                         plan.fused_amax, target)
        else:
            c = nvfp4.grouped_gemm(*fc1, target)
            d = nvfp4.activation(c, probs, activation, tanh_clamp_scale, target)
        # rule 2: the epilogue's amaxes where the plan takes them, as the compiled forward does
        amax = copy_amaxes(pre_rht, post_rht, recipe.rht) if plan.fused_amax else (None, None)
        dq = _group_quantize(d, group_sizes, recipe, target, stochastic=False, amax=amax)
        y = nvfp4.grouped_gemm(dq[0], dq[1], dq[2], w2q[0], w2q[1], w2q[4], group_sizes, target)
        saved = SavedForBackward(
            c=c, x_col_data=xq[3], x_col_scale=xq[4], x_col_amax=xq[5], offsets=xq[6],
            w1_col_data=w1q[2], w1_col_scale=w1q[3], w1_amax=w1q[4], w2_col_data=w2q[2], w2_col_scale=w2q[3],
            w2_amax=w2q[4], d_col_amax=dq[5], d_col_data=dq[3], d_col_scale=dq[4],
        )
        ctx.save_for_backward(probs, group_sizes, *saved.flatten())
        ctx.activation, ctx.tanh_clamp_scale, ctx.recipe, ctx.plan = activation, tanh_clamp_scale, recipe, plan
        ctx.probs_dtype = probs.dtype if probs is not None else None
        return y

    @staticmethod
    def backward(ctx, dy):
        probs, group_sizes, *saved = ctx.saved_tensors
        s, recipe, target = SavedForBackward.unflatten(saved), ctx.recipe, ctx.plan.target
        dyq = _group_quantize(dy.contiguous(), group_sizes, recipe, target, stochastic=True)
        dgrad = (dyq[0], dyq[1], dyq[2], s.w2_col_data, s.w2_col_scale, s.w2_amax, group_sizes)
        if ctx.plan.fused_dgrad:
            dc, dp = nvfp4.fc2_dgrad_act(*dgrad, s.c, probs, ctx.activation, ctx.tanh_clamp_scale, target)
        else:
            g = nvfp4.grouped_gemm(*dgrad, target)
            dc, dp, _ = nvfp4.activation_backward(g, s.c, probs, ctx.activation, ctx.tanh_clamp_scale, False, target)
        dw2 = nvfp4.grouped_gemm_wgrad(dyq[3], dyq[4], dyq[5], s.d_col_data, s.d_col_scale, s.d_col_amax, s.offsets,
                                       target)
        dcq = _group_quantize(dc, group_sizes, recipe, target, stochastic=True)
        dx = nvfp4.grouped_gemm(dcq[0], dcq[1], dcq[2], s.w1_col_data, s.w1_col_scale, s.w1_amax, group_sizes, target)
        dw1 = nvfp4.grouped_gemm_wgrad(dcq[3], dcq[4], dcq[5], s.x_col_data, s.x_col_scale, s.x_col_amax, s.offsets,
                                       target)
        dprobs = dp.to(ctx.probs_dtype) if probs is not None else None
        return dx, dw1, dw2, None, dprobs, None, None, None


# The recipe of a call that passes none: one instance, not a Recipe() made in the traced
# code. Dynamo (torch 2.11) guards a frozen dataclass made in a compiled frame on its class's
# field defaults through a Python lambda that wraps ``dataclasses.fields`` anew at every
# call. Guard checks took 7.7% of a compiled step's host samples on the H200 with Recipe()
# here, 3.4% with this instance, whose fields Dynamo guards by attribute, in C++
# (benchmarks/NOTES.md runs J2, J3).
_DEFAULT_RECIPE = Recipe()


@torch.compiler.allow_in_graph
def grouped_mlp_call(x, fc1_weight, fc2_weight, group_sizes, probs, *, activation, tanh_clamp_scale, recipe):
    """The eager chain as ONE node of a Dynamo graph (allowed in the graph): the anchor the
    backend's ``match_grouped_mlp`` rewrites. Arguments already validated."""
    return _GroupedMLPChain.apply(
        x, fc1_weight, fc2_weight, group_sizes, probs, activation, tanh_clamp_scale, recipe or Recipe()
    )


def grouped_mlp(
    x: torch.Tensor,
    fc1_weight: torch.Tensor,
    fc2_weight: torch.Tensor,
    group_sizes: torch.Tensor,
    probs: Optional[torch.Tensor] = None,
    *,
    activation: str = "srelu",
    tanh_clamp_scale: Optional[float] = None,
    recipe: Optional[Recipe] = None,
) -> torch.Tensor:
    """Y = fc2(f(fc1(x)) * probs) per expert, in NVFP4 (numerics.md 5), eagerly, op by op.

    x: (T, H) bf16, rows sorted by expert; fc1_weight: (G, F1, H) bf16 (F1 = 2F for a
    gated activation such as swiglu: rows 0..F-1 gate, F..2F-1 up); fc2_weight: (G, H, F)
    bf16; group_sizes: (G,) int tensor on x's device (no host sync); probs: (T,) router
    probabilities or None; activation: a registered name (``activations.activation_names()``),
    built in: "srelu" | "tanh_srelu" (needs tanh_clamp_scale) | "swiglu".
    Returns (T, H) bf16. Differentiable in x, both weights and probs.
    DTensors (docs/distributed.md): weights Shard(0) over experts with plain local rows run
    on the local experts (expert parallel; weight gradients Shard(0)); all-Replicate
    operands run the ops' sharding strategies; other placements raise a ValueError.
    """
    # Traced by Dynamo (outside the graph node), so a bad input raises this ValueError in
    # compiled runs too, not an error wrapped by fake-tensor propagation. DTensor operands:
    # expert-parallel weights become their local experts (distributed.py).
    recipe = _DEFAULT_RECIPE if recipe is None else recipe
    x, fc1_weight, fc2_weight, group_sizes, probs = local_operands(x, fc1_weight, fc2_weight, group_sizes, probs,
                                                                  recipe)
    check_grouped_mlp_args(x, fc1_weight, fc2_weight, group_sizes, probs, activation, tanh_clamp_scale)
    return grouped_mlp_call(x, fc1_weight, fc2_weight, group_sizes, probs, activation=activation,
                            tanh_clamp_scale=tanh_clamp_scale, recipe=recipe)


class GroupedMLP(nn.Module):
    """G experts, each Linear(H -> F1) -> activation (x router prob) -> Linear(F -> H), no
    biases, trained in NVFP4. Parameters are stacked: fc1_weight (G, F1, H), fc2_weight
    (G, H, F), bf16, initialised like nn.Linear (kaiming-uniform, a = sqrt(5))."""

    def __init__(
        self,
        num_experts: int,
        hidden: int,
        ffn: int,
        activation: str = "srelu",
        tanh_clamp_scale: Optional[float] = None,
        recipe: Optional[Recipe] = None,
        *,
        device=None,
        dtype: torch.dtype = torch.bfloat16,
    ):
        super().__init__()
        if dtype not in (torch.bfloat16, torch.float32):  # fp32: master weights that FSDP2's mixed precision casts
            raise ValueError(f"GroupedMLP: dtype must be torch.bfloat16 (or torch.float32 for master weights cast "
                             f"to bfloat16 before the forward, as by FSDP2's mixed precision); got {dtype}")
        fc1_out = 2 * ffn if get_activation(activation).gated else ffn
        self.activation, self.tanh_clamp_scale = activation, tanh_clamp_scale
        self.recipe = recipe or Recipe()
        self.fc1_weight = nn.Parameter(torch.empty(num_experts, fc1_out, hidden, device=device, dtype=dtype))
        self.fc2_weight = nn.Parameter(torch.empty(num_experts, hidden, ffn, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for weight in (self.fc1_weight, self.fc2_weight):
            for expert in weight.data:  # each expert as its own nn.Linear
                nn.init.kaiming_uniform_(expert, a=math.sqrt(5))

    def forward(self, x, group_sizes, probs=None):
        return grouped_mlp(
            x, self.fc1_weight, self.fc2_weight, group_sizes, probs,
            activation=self.activation, tanh_clamp_scale=self.tanh_clamp_scale, recipe=self.recipe,
        )

    def extra_repr(self) -> str:
        g, f1, h = self.fc1_weight.shape
        return f"num_experts={g}, hidden={h}, ffn={self.fc2_weight.shape[2]}, activation={self.activation!r}"
