"""The grouped MLP in eager NVFP4: ``grouped_mlp`` and the ``GroupedMLP`` module.

Forward and backward are docs/numerics.md section 5, the steps of ``program.py`` (written once
for this chain, the fused ops and ``explain``), run op by op: one ``nvfp4::`` op per step
(``ops.EagerSteps``), on the plan ``lowerings.choose_plan`` gives for the call, the same
function and the same plan as the backend's for a compiled site; this is the semantics the
compiled path reproduces bit for bit. Where the plan fuses fc1, ``fc1_act_amax`` replaces the
fc1 GEMM and the activation (and, with ``fused_amax``, gives D's amaxes to its casts); where
it fuses the dgrad, ``fc2_dgrad_act`` replaces G's GEMM and the activation backward. On the
reference and Triton targets fused and unfused steps give the same bits; on cuDNN they do
not (numerics.md 7), and eager means the fused ones there, as compiled does.
The eager path saves D's column-wise copy (``recompute`` off) and casts packed copies only;
the compiled path instead regenerates D in the backward from C and the saved amaxes where
the plan allows it (``compiler/fused.py``).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from . import ops, program
from .activations import get_activation
from .distributed import local_operands
from .lowerings import SiteSpec, choose_plan
from .recipe import Recipe
from .saved import SavedForBackward
from .validate import check_grouped_mlp_args


class _GroupedMLPChain(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, fc1_weight, fc2_weight, group_sizes, probs, activation, tanh_clamp_scale, recipe):
        # The plan the backend chooses for a compiled site: its target, and its fused kernels
        # where it fuses a step (compiled == eager on every target, numerics.md 5.3).
        plan = choose_plan(SiteSpec.on(x.device, activation, dtype=x.dtype, hidden=x.shape[1],
                                       ffn=fc2_weight.shape[2]), recipe)
        opts = program.SiteOptions(activation, tanh_clamp_scale, recipe, plan)
        y, saved = program.forward(_runner(opts), opts, x, fc1_weight, fc2_weight, group_sizes, probs, save=True)
        ctx.save_for_backward(probs, group_sizes, *saved.flatten())
        ctx.opts = opts
        ctx.probs_dtype = probs.dtype if probs is not None else None
        return y

    @staticmethod
    def backward(ctx, dy):
        probs, group_sizes, *saved = ctx.saved_tensors
        saved, run = SavedForBackward.unflatten(saved), _runner(ctx.opts)
        dw2, dp, dcq = program.backward_fc2(run, ctx.opts, dy, saved, probs, group_sizes)
        dx, dw1 = program.backward_fc1(run, dcq, saved, group_sizes)
        dprobs = dp.to(ctx.probs_dtype) if probs is not None else None
        return dx, dw1, dw2, None, dprobs, None, None, None


def _runner(opts: program.SiteOptions) -> program.Runner:
    """The program's steps as the eager ops of the plan's target, packed operands, D saved."""
    return program.Runner(ops.EagerSteps(opts.plan.target, opts.recipe.sr_per_rank), opts)


# The recipe of a call that passes none: one instance, not a Recipe() made in the traced
# code. Dynamo (torch 2.11) guards a frozen dataclass made in a compiled frame on its class's
# field defaults through a Python lambda that wraps ``dataclasses.fields`` anew at every
# call. Guard checks took 7.7% of a compiled step's host samples on the H200 with Recipe()
# here, 3.4% with this instance, whose fields Dynamo guards by attribute, in C++
# (docs/decisions.md, Host time).
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
