"""The grouped MLP in eager NVFP4: ``grouped_mlp`` and the ``GroupedMLP`` module.

Forward and backward are SPEC.md section 5 run op by op (one ``nvfp4::`` op per step),
which is the semantics the compiled path reproduces bit for bit from fused ops.

    forward                                       backward (dY)
    xq  = group_quantize(x)   row + col RHT       dYq = group_quantize(dY)  row + col RHT, SR
    W1q, W2q = quantize_weights (16x16 tiles)     G   = gemm(dYq.row, W2q.col)
    C   = gemm(xq.row, W1q.row)        (saved)    dC, dp = activation_backward(G, C, p)
    D   = activation(C, p)                        dW2 = wgrad(dYq.col, Dq.col)
    Dq  = group_quantize(D)   row + col RHT       dCq = group_quantize(dC)  row + col RHT, SR
    Y   = gemm(Dq.row, W2q.row)                   dX  = gemm(dCq.row, W1q.col)
                                                  dW1 = wgrad(dCq.col, xq.col)
The eager path saves D's column-wise copy; the compiled path instead regenerates D in the
backward from C and the saved amaxes (``compiler/fused.py``).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from . import ops  # noqa: F401  (registers torch.ops.nvfp4)
from .activations import get_activation
from .recipe import Recipe
from .validate import check_grouped_mlp_args

nvfp4 = torch.ops.nvfp4


def _group_quantize(x, group_sizes, recipe: Recipe, *, stochastic: bool, rowwise=True, columnwise=True,
                    rowwise_amax=None, columnwise_amax=None):
    """(row data, row scale, row amax, col data, col scale, col amax, padded offsets)."""
    return nvfp4.group_quantize(
        x, group_sizes, rowwise, columnwise, recipe.rht, recipe.sign_mask,
        stochastic and recipe.stochastic_rounding, rowwise_amax, columnwise_amax,
    )


class _GroupedMLPChain(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, fc1_weight, fc2_weight, group_sizes, probs, activation, tanh_clamp_scale, recipe):
        xq = _group_quantize(x, group_sizes, recipe, stochastic=False)
        w1q = nvfp4.quantize_weights(fc1_weight, recipe.block_2d)
        w2q = nvfp4.quantize_weights(fc2_weight, recipe.block_2d)
        c = nvfp4.grouped_gemm(xq[0], xq[1], xq[2], w1q[0], w1q[1], w1q[4], group_sizes)
        d = nvfp4.activation(c, probs, activation, tanh_clamp_scale)
        dq = _group_quantize(d, group_sizes, recipe, stochastic=False)
        y = nvfp4.grouped_gemm(dq[0], dq[1], dq[2], w2q[0], w2q[1], w2q[4], group_sizes)
        ctx.save_for_backward(
            c, probs, group_sizes, xq[3], xq[4], xq[5], xq[6], w1q[2], w1q[3], w1q[4], w2q[2], w2q[3], w2q[4],
            dq[3], dq[4], dq[5],
        )
        ctx.activation, ctx.tanh_clamp_scale, ctx.recipe = activation, tanh_clamp_scale, recipe
        ctx.probs_dtype = probs.dtype if probs is not None else None
        return y

    @staticmethod
    def backward(ctx, dy):
        (c, probs, group_sizes, x_cd, x_cs, x_ca, offsets, w1_cd, w1_cs, w1_a, w2_cd, w2_cs, w2_a,
         d_cd, d_cs, d_ca) = ctx.saved_tensors
        recipe = ctx.recipe
        dyq = _group_quantize(dy.contiguous(), group_sizes, recipe, stochastic=True)
        g = nvfp4.grouped_gemm(dyq[0], dyq[1], dyq[2], w2_cd, w2_cs, w2_a, group_sizes)
        dc, dp, _ = nvfp4.activation_backward(g, c, probs, ctx.activation, ctx.tanh_clamp_scale, False)
        dw2 = nvfp4.grouped_gemm_wgrad(dyq[3], dyq[4], dyq[5], d_cd, d_cs, d_ca, offsets)
        dcq = _group_quantize(dc, group_sizes, recipe, stochastic=True)
        dx = nvfp4.grouped_gemm(dcq[0], dcq[1], dcq[2], w1_cd, w1_cs, w1_a, group_sizes)
        dw1 = nvfp4.grouped_gemm_wgrad(dcq[3], dcq[4], dcq[5], x_cd, x_cs, x_ca, offsets)
        dprobs = dp.to(ctx.probs_dtype) if probs is not None else None
        return dx, dw1, dw2, None, dprobs, None, None, None


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
    """Y = fc2(f(fc1(x)) * probs) per expert, in NVFP4 (SPEC 5), eagerly, op by op.

    x: (T, H) bf16, rows sorted by expert; fc1_weight: (G, F1, H) bf16 (F1 = 2F for a
    gated activation such as swiglu: rows 0..F-1 gate, F..2F-1 up); fc2_weight: (G, H, F)
    bf16; group_sizes: (G,) int tensor on x's device (no host sync); probs: (T,) router
    probabilities or None; activation: a registered name (``activations.activation_names()``),
    built in: "srelu" | "tanh_srelu" (needs tanh_clamp_scale) | "swiglu".
    Returns (T, H) bf16. Differentiable in x, both weights and probs.
    """
    # Traced by Dynamo (outside the graph node), so a bad input raises this ValueError in
    # compiled runs too, not an error wrapped by fake-tensor propagation.
    check_grouped_mlp_args(x, fc1_weight, fc2_weight, group_sizes, probs, activation, tanh_clamp_scale)
    return grouped_mlp_call(x, fc1_weight, fc2_weight, group_sizes, probs, activation=activation,
                            tanh_clamp_scale=tanh_clamp_scale, recipe=recipe or Recipe())


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
