"""DTensor operands of the grouped MLP and of the ``nvfp4::*`` ops: what is accepted, how it runs.

The contract (docs/distributed.md), checked by ``local_operands`` before anything runs:

    placements of (x, fc1_weight, fc2_weight, group_sizes, probs)     runs as
    ---------------------------------------------------------------   -----------------------------------------
    no DTensor                                                         the eager chain (any process group)
    weights Shard(0) on every mesh dim (experts split over ranks);     expert parallel: the chain on the local
      x, group_sizes, probs plain tensors (the rows this rank's          experts (``to_local``, as ``local_map``
      experts received, their counts, their probabilities)               would); weight gradients come back as
                                                                         Shard(0) DTensors
    every tensor a DTensor, Replicate on every mesh dim, one mesh      the chain's ``nvfp4::*`` ops through their
                                                                         sharding strategies: outputs Replicate
    anything else                                                      ValueError naming the argument and the rule

Sharding strategies (``register_sharding_strategies``, registered once, on first sight of a
DTensor): every eager ``nvfp4::*`` op maps all-Replicate inputs to all-Replicate outputs;
``nvfp4::quantize_weights`` also maps a Shard(0) expert stack to Shard(0) outputs (every
output is per expert). A Replicate output promises equal values on every rank, so an op
that rounds stochastically there needs ``sr_per_rank=False`` (ranks seeded alike then
draw equal bits); with ``sr_per_rank=True`` the strategy raises a ValueError instead of
returning silently diverged "replicas". The grouped GEMMs have no Shard strategy: their
rows are routed data, not a shard of a global tensor (expert parallelism converts to local
tensors above the ops instead). The compiled path rewrites only plain-tensor sites
(``compiler/placements.py`` rejects the others with a reason).
"""

from __future__ import annotations

import functools
import sys

import torch

from . import ops  # noqa: F401  (registers torch.ops.nvfp4)

# The eager ops with an all-Replicate strategy, and those among them that draw SR seeds.
REPLICATE_OPS = ("quantize", "group_quantize", "group_hadamard_amax", "quantize_weights", "grouped_gemm",
                 "grouped_gemm_wgrad", "activation", "activation_backward", "fc1_act_amax", "fc2_dgrad_act")
SEEDED_OPS = ("quantize", "group_quantize")


def dtensor_type():
    """``torch.distributed.tensor.DTensor`` when that module was imported (no DTensor can
    exist otherwise), else None: asking costs no import."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


def is_dtensor(t) -> bool:
    cls = dtensor_type()
    return cls is not None and isinstance(t, cls)


def describe(t) -> str:
    """'a DTensor with placements (Shard(dim=0),) on a 1-D mesh' (for messages)."""
    return f"a DTensor with placements {tuple(t.placements)} on a {t.device_mesh.ndim}-D mesh"


def _is_expert_shard(placement) -> bool:
    from torch.distributed.tensor import Shard

    return isinstance(placement, Shard) and placement.dim == 0


def local_operands(x, fc1_weight, fc2_weight, group_sizes, probs, recipe):
    """(x, fc1_weight, fc2_weight, group_sizes, probs) as the eager chain takes them under
    the contract above: expert-parallel weights become their local experts; all-Replicate
    operands stay DTensors (their strategies registered; `recipe` must then not fold the
    rank into stochastic-rounding seeds); plain tensors pass through."""
    cls = dtensor_type()
    operands = {"x": x, "fc1_weight": fc1_weight, "fc2_weight": fc2_weight, "group_sizes": group_sizes,
                "probs": probs}
    dtensors = [name for name, t in operands.items() if cls is not None and isinstance(t, cls)]
    if not dtensors:
        return x, fc1_weight, fc2_weight, group_sizes, probs
    if dtensors == ["fc1_weight", "fc2_weight"]:
        for name in dtensors:
            weight = operands[name]
            if not all(_is_expert_shard(p) for p in weight.placements):
                raise ValueError(
                    f"{name} is {describe(weight)}; with plain-tensor rows the expert weights must be "
                    "Shard(0) (experts split over ranks) on every mesh dim (expert parallel)")
        if fc1_weight.device_mesh != fc2_weight.device_mesh:
            raise ValueError("fc1_weight and fc2_weight must be sharded over the same DeviceMesh; got "
                             f"{fc1_weight.device_mesh} and {fc2_weight.device_mesh}")
        return x, fc1_weight.to_local(), fc2_weight.to_local(), group_sizes, probs
    present = [name for name, t in operands.items() if t is not None]
    if dtensors != present:
        plain = [name for name in present if name not in dtensors]
        raise ValueError(
            f"{', '.join(dtensors)} {'is a DTensor' if len(dtensors) == 1 else 'are DTensors'} but "
            f"{', '.join(plain)} {'is' if len(plain) == 1 else 'are'} not: the grouped MLP takes either "
            "expert-parallel weights (fc1_weight and fc2_weight Shard(0) DTensors, every other argument a "
            "plain local tensor) or every tensor argument a Replicate DTensor (docs/distributed.md)")
    mesh = operands[dtensors[0]].device_mesh
    for name in dtensors:
        t = operands[name]
        if not all(p.is_replicate() for p in t.placements):
            raise ValueError(
                f"{name} is {describe(t)}; when x is a DTensor every tensor argument must be Replicate "
                "(sharded rows or features have no grouped-MLP strategy; expert parallelism passes plain "
                "local rows with Shard(0) weights)")
        if t.device_mesh != mesh:
            raise ValueError(f"{name} is on DeviceMesh {t.device_mesh}, {dtensors[0]} on {mesh}: one mesh for all")
    if recipe.stochastic_rounding and recipe.sr_per_rank:
        raise ValueError(
            "recipe.sr_per_rank must be False for Replicate DTensor operands with stochastic rounding (every rank "
            "must draw the same rounding bits for the gradients to stay replicated; seed every rank alike), or "
            "recipe.stochastic_rounding False")
    ensure_strategies(x)
    return x, fc1_weight, fc2_weight, group_sizes, probs


# ---------------------------------------------------------------------------------------
# Sharding strategies (torch.distributed.tensor.experimental.register_sharding)


def _argument_values(op, args, kwargs) -> dict:
    """Every schema argument by name; the dispatcher drops trailing defaults, so fill them."""
    values = {}
    for i, argument in enumerate(op._schema.arguments):
        if i < len(args):
            values[argument.name] = args[i]
        else:
            values[argument.name] = kwargs.get(argument.name, argument.default_value)
    return values


def _check_replicated_rounding(name: str, values: dict) -> None:
    if values.get("stochastic_rounding") and values.get("sr_per_rank", True):
        raise ValueError(
            f"nvfp4::{name} on Replicate DTensors with stochastic_rounding=True needs sr_per_rank=False "
            "(Recipe(sr_per_rank=False)): sr_per_rank folds each rank into its seed, so the ranks would round "
            "differently and the output would not be replicated. With sr_per_rank=False every rank must seed "
            "torch's generators alike (torch.manual_seed).")


def _strategy(op, name: str, *, expert_shard: bool):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

    returns = len(op._schema.returns)

    def strategy(*args, **kwargs):
        if name in SEEDED_OPS:
            _check_replicated_rounding(name, _argument_values(op, args, kwargs))
        flat = list(args) + list(kwargs.values())
        tensors = [isinstance(a, DTensorSpec) for a in flat]
        shardings = [([Replicate()] * returns, [Replicate() if t else None for t in tensors])]
        if expert_shard:  # quantize_weights: every output is per expert
            shardings.append(([Shard(0)] * returns, [Shard(0) if t else None for t in tensors]))
        return shardings

    return strategy


@functools.cache
def register_sharding_strategies() -> None:
    """Register the DTensor strategies of the eager ``nvfp4::*`` ops, once."""
    from torch.distributed.tensor.experimental import register_sharding

    for name in REPLICATE_OPS:
        op = getattr(torch.ops.nvfp4, name).default
        register_sharding(op)(_strategy(op, name, expert_shard=name == "quantize_weights"))


def ensure_strategies(*tensors) -> None:
    """Register the strategies if any of `tensors` is a DTensor (``local_operands`` and the
    public quantizers call this; while Dynamo traces, the backend registers them)."""
    if any(is_dtensor(t) for t in tensors) and not torch.compiler.is_compiling():
        register_sharding_strategies()


def draw_sr_seeds(after, n: int, per_rank: bool) -> list:
    """``nvfp4::draw_sr_seeds`` for a backward whose gradient `after` may be a Replicate
    DTensor (the eager chain's all-Replicate case): drawn on the local tensor and made
    Replicate DTensors, equal on every rank since ``local_operands`` refused ``sr_per_rank``
    there (the op's list of seeds has no sharding strategy: DTensor's propagation needs a
    fixed number of outputs)."""
    if not is_dtensor(after):
        return ops.draw_sr_seeds(after, n, per_rank)
    from torch.distributed.tensor import DTensor

    seeds = ops.draw_sr_seeds(after.to_local(), n, per_rank)
    return [DTensor.from_local(s, after.device_mesh, after.placements, run_check=False) for s in seeds]


def check_quantize_operand(x, *, stochastic_rounding: bool, sr_per_rank: bool) -> None:
    """The public quantizers' DTensor rule: a DTensor x runs the ops' strategies (Replicate
    outputs; other placements are redistributed to Replicate by DTensor), which with
    stochastic rounding needs sr_per_rank=False. Registers the strategies."""
    if not is_dtensor(x):
        return
    if stochastic_rounding and sr_per_rank:
        raise ValueError(f"x is {describe(x)}: the quantized copies would be Replicate DTensors, so with "
                         "stochastic_rounding=True every rank must draw the same bits: pass sr_per_rank=False "
                         "(and seed every rank alike)")
    ensure_strategies(x)
