"""The cudnn self-check's training step (``lowerings/self_check.py``): on a target with the
capabilities the wrapper checks left on, one training step of a small grouped MLP through
the fused ops (``fused.fused_grouped_mlp``: what a compiled graph calls) equals the eager
chain (``nn.grouped_mlp``) bit for bit, Y and every gradient, for each activation it fuses.

It calls the fused ops directly, with the autograd formula a compiled graph traces, not
through ``torch.compile``: the probe that runs the check is itself called while the backend
compiles a graph, and Dynamo does not compile inside a compile. What AOTAutograd and
Inductor add around those ops gives the same bits on every target (the CPU tests).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from ..lowerings import Capabilities, SiteSpec, Target, choose_plan, registered
from ..nn import GroupedMLP, grouped_mlp
from ..recipe import Recipe
from .fused import fused_grouped_mlp, site_options

NAME = "cudnn_self_check"


def fused_equals_eager(caps: Capabilities, steps: Callable, device: torch.device) -> Optional[str]:
    """None when the fused ops equal the eager chain bitwise on a target with `caps` and the
    step table `steps()` on `device`, else which output differs, for which activation."""
    table = steps()
    target = Target(NAME, lambda: table, lambda _device: caps, device_types=(device.type,))
    dgrad = caps.fused_activations if caps.fused_dgrad_activations is None else caps.fused_dgrad_activations
    activations = sorted(caps.fused_activations | dgrad) or ["srelu"]
    with registered(target), torch.enable_grad():  # the probe may be asked under no_grad
        for activation in activations:
            why = _one_step(activation, device)
            if why:
                return why
    return None


def _one_step(activation: str, device: torch.device) -> Optional[str]:
    clamp = 3.0 if activation == "tanh_srelu" else None
    recipe = Recipe()
    torch.manual_seed(0)
    mlp = GroupedMLP(3, 64, 128, activation, tanh_clamp_scale=clamp, recipe=recipe, device=device)
    x = torch.randn(40, 64, dtype=torch.bfloat16, device=device)
    sizes = torch.tensor([10, 0, 30], device=device)
    probs = torch.rand(40, device=device)
    dy = torch.randn(40, 64, dtype=torch.bfloat16, device=device)
    plan = choose_plan(SiteSpec.on(device, activation, hidden=64, ffn=128), recipe)
    if plan.target != NAME:
        return f"the training step for {activation} was planned on {plan.target}: {plan.reason}"

    def step(fused: bool) -> list[torch.Tensor]:
        w1, w2 = (mlp.fc1_weight.detach().clone().requires_grad_(), mlp.fc2_weight.detach().clone().requires_grad_())
        xs, ps = x.clone().requires_grad_(), probs.clone().requires_grad_()
        torch.manual_seed(1)
        if fused:
            y = fused_grouped_mlp(xs, w1, w2, sizes, ps, activation=activation, tanh_clamp_scale=clamp,
                                  **site_options(recipe, True, plan))
        else:
            y = grouped_mlp(xs, w1, w2, sizes, ps, activation=activation, tanh_clamp_scale=clamp, recipe=recipe)
        y.backward(dy)
        return [y.detach(), xs.grad, ps.grad, w1.grad, w2.grad]

    for name, a, b in zip(("Y", "dX", "dprobs", "dW1", "dW2"), step(True), step(False)):
        if not torch.equal(a, b):
            differ = int((a.view(-1) != b.view(-1)).sum())
            return f"{activation}: the fused ops' {name} differs from the eager chain's in {differ} of {a.numel()} values"
    return None
